"""Utilization sampling: recorded telemetry becomes attributed samples; a host without a
driver, or one that does not answer, is reported and skipped; the real probe through the
real `LocalRunner` (no GPU here: "no NVIDIA driver") and through a real sshd; thinning
of the rolling history, pure and in the database; `/gpu util` and the channel post.

The sshd case logs in as a stranger (`stranger_lab`) whose "python" is a script the test
puts there; the probe with a bootstrapped host's own venv is in the journey
(tests/provisioning_aws)."""

from __future__ import annotations

import json
import os
import stat
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.app.config import Settings
from bot.app.ports import HostSeat, Interpreter, bot_python
from bot.app.service import GpuService
from bot.app.watching.utilization import (
    CHART_WINDOW,
    TIERS,
    Sample,
    chart_start,
    collect,
    on_host,
    snapshot_job,
    thin,
    thin_db,
)
from bot.domain.commands import Reserve
from bot.faces.dispatch import handle_text
from bot.faces.terminal import render
from bot.faces.worker import periodic_jobs
from bot.providers.local import LocalProvider
from db.models import Gpu, GpuSample, Host, Notification, TrainingRun, User
from db.session import transaction
from provisioning.base import GpuDevice, Instance
from provisioning.hosts import LocalCompute
from provisioning.hostshell import HostShell
from provisioning.local_runner import LOCAL_TARGET, LocalRunner
from provisioning.ssh import RunResult, SshClient, SshError, SshTarget
from tests.core.helpers import actor, host, make_service, place
from tests.e2e.shell_driver import run_shell
from tests.ssh_hosts import SshLab
from training.telemetry import GpuProcess, GpuSnapshot, HostSnapshot, parse_snapshot, take_snapshot

# --- recorded telemetry --------------------------------------------------------------

# `python -m training.telemetry --json` on a p4d.24xlarge (8× A100-SXM4-40GB) with a
# 4-GPU DDP job on GPUs 2-5, a notebook holding memory at 0% on GPU 0, a small job on 6.
A100_HOST_JSON = json.dumps(
    {
        "schema_version": 1,
        "taken_at": "2026-01-05T09:00:02.418211+00:00",
        "source": "nvml",
        "error": None,
        "gpus": [
            {
                "index": i,
                "uuid": f"GPU-5b9c1e7a-3f0d-4c1e-9a7b-0c2d4e6f80{i:02d}",
                "name": "NVIDIA A100-SXM4-40GB",
                "util_pct": util,
                "mem_used_mb": used,
                "mem_total_mb": 40960,
                "temp_c": temp,
                "power_w": power,
                "power_limit_w": 400.0,
                "processes": procs,
            }
            for i, (util, used, temp, power, procs) in enumerate(
                [
                    (0, 30512, 34, 61.2, [{"pid": 41873, "used_mb": 30502}]),
                    (0, 4, 31, 52.7, []),
                    (97, 37890, 71, 388.4, [{"pid": 52011, "used_mb": 37880}]),
                    (96, 37890, 69, 379.9, [{"pid": 52012, "used_mb": 37880}]),
                    (98, 37890, 72, 391.0, [{"pid": 52013, "used_mb": 37880}]),
                    (95, 37890, 70, 377.5, [{"pid": 52014, "used_mb": 37880}]),
                    (41, 12044, 55, 201.3, [{"pid": 60220, "used_mb": 12034}]),
                    (0, 4, 30, 50.9, []),
                ]
            )
        ],
    }
)

NO_DRIVER_JSON = json.dumps(
    {
        "schema_version": 1,
        "taken_at": "2026-01-05T09:00:02+00:00",
        "source": "none",
        "error": "no NVIDIA driver (NVML: NVML Shared Library Not Found; nvidia-smi not found)",
        "gpus": [],
    }
)


def snapshot_json(gpus: Mapping[int, tuple[int, int]], total_mb: int = 40960) -> str:
    """A probe answer built with the probe's own dataclasses: index → (util %, MiB used)."""
    return HostSnapshot(
        taken_at=datetime(2026, 1, 5, 9, 0, tzinfo=UTC),
        source="nvml",
        gpus=tuple(
            GpuSnapshot(
                index=i,
                uuid=f"GPU-{i:08d}",
                name="NVIDIA A100-SXM4-40GB",
                util_pct=util,
                mem_used_mb=used,
                mem_total_mb=total_mb,
                temp_c=40,
                power_w=90.0,
                power_limit_w=400.0,
                processes=(GpuProcess(pid=1000 + i, used_mb=used),) if used else (),
            )
            for i, (util, used) in sorted(gpus.items())
        ),
    ).to_json()


class RecordedRunner(LocalRunner):
    """An `HostShell` whose telemetry probe answers with recorded stdout (a GPU host we do
    not have); every other call is the real local runner. `answer` may be changed between
    samples; an exception instance is raised instead, like a host that drops."""

    def __init__(self, answer: str | Exception) -> None:
        super().__init__(command_timeout=20)
        self.answer: str | Exception = answer
        self.commands: list[str] = []

    def run(
        self,
        target: SshTarget,
        command: str,
        timeout: float | None = None,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> RunResult:
        if "training.telemetry" not in command:
            return super().run(target, command, timeout, cwd=cwd, env=env)
        self.commands.append(command)
        if isinstance(self.answer, Exception):
            raise self.answer
        return RunResult(0, self.answer + "\n", "")


@dataclass
class MapAccess:
    """`HostAccess` over a fixed map: host name → runner and target; every host's
    interpreter is `python` (the bot's own unless a test names another)."""

    runners: dict[str, tuple[HostShell, SshTarget]] = field(default_factory=dict)
    runs_dir: Path = Path("/tmp/gpubot-runs")
    python: Interpreter = field(default_factory=bot_python)

    def runner_for(self, host_name: str) -> HostSeat | None:
        got = self.runners.get(host_name)
        if got is None:
            return None
        return HostSeat(got[0], got[1], self.runs_dir, lambda: self.python)


def with_access(access: MapAccess, **runners: HostShell | tuple[HostShell, SshTarget]) -> MapAccess:
    """`access` (the service's place's) reaches these hosts through these runners."""
    for name, r in runners.items():
        name = name.replace("_", "-")
        access.runners[name] = r if isinstance(r, tuple) else (r, SshTarget(host=name, name=name))
    return access


def rows(engine: Engine) -> list[GpuSample]:
    with Session(engine) as s:
        return list(
            s.exec(select(GpuSample).order_by(col(GpuSample.host_id), col(GpuSample.gpu_index)))
        )


def notifications(engine: Engine, kind: str | None = None) -> list[Notification]:
    with Session(engine) as s:
        q = select(Notification).order_by(col(Notification.id))
        if kind is not None:
            q = q.where(Notification.kind == kind)
        return list(s.exec(q))


def gpu_a(count: int = 8) -> Instance:
    return host("gpu-a", "A100", count, hourly=32.77, address="127.0.0.2")


# --- collection -------------------------------------------------------------------------


def test_recorded_snapshot_becomes_samples_attributed_to_their_holders(engine: Engine) -> None:
    access = MapAccess()
    svc, clock = make_service(engine, [gpu_a()], places=place("ssh", access))
    runner = RecordedRunner(A100_HOST_JSON)
    with_access(access, gpu_a=runner)
    alice, bob, carol = actor(svc, "alice"), actor(svc, "bob"), actor(svc, "carol")
    res_alice = svc.reserve(alice, Reserve(count=2, model="A100")).view.text
    res_bob = svc.reserve(bob, Reserve(count=4, model="A100")).view.text
    assert "#1" in res_alice and "#2" in res_bob
    with transaction(engine) as s:  # carol's run holds GPU 6, as the run dispatcher claims it
        h = s.exec(select(Host).where(Host.name == "gpu-a")).one()
        user = svc.user_row(s, carol.key)
        assert user.id is not None
        run = TrainingRun(user_id=user.id, state="running", host_id=h.id, submitted_at=clock.now())
        s.add(run)
        s.flush()
        g6 = s.exec(select(Gpu).where(Gpu.host_id == h.id, Gpu.index == 6)).one()
        svc.open_usage(s, h, [g6], user.id, clock.now(), run_id=run.id)
        run_id = run.id

    report = collect(svc)

    assert report.hosts == 1 and report.samples == 8 and not report.failed
    assert runner.commands and runner.commands[0].endswith("-m training.telemetry --json")
    got = rows(engine)
    assert [r.gpu_index for r in got] == list(range(8))
    with Session(engine) as s:
        ids = {u.key: u.id for u in s.exec(select(User))}
    who = [(r.user_id, r.reservation_id, r.run_id) for r in got]
    assert who[:2] == [(ids["alice"], 1, None)] * 2
    assert who[2:6] == [(ids["bob"], 2, None)] * 4
    assert who[6] == (ids["carol"], None, run_id)
    assert who[7] == (None, None, None)  # free GPU: sampled, nobody's
    squatter, busy = got[0], got[2]
    assert (squatter.util_pct, squatter.mem_used_mb, squatter.mem_total_mb) == (0.0, 30512, 40960)
    assert (busy.util_pct, busy.temperature_c, busy.power_w) == (97.0, 71.0, 388.4)
    assert all(r.at == clock.now() and r.span_s == 60 for r in got)


def test_a_host_without_a_driver_stores_nothing_and_says_so(engine: Engine) -> None:
    access = MapAccess()
    svc, _ = make_service(engine, [gpu_a(1)], places=place("ssh", access))
    with_access(access, gpu_a=RecordedRunner(NO_DRIVER_JSON))
    svc.reserve(actor(svc, "alice"), Reserve())
    report = collect(svc)
    assert report.no_driver == ("gpu-a",) and report.samples == 0 and rows(engine) == []


def test_only_busy_hosts_are_asked_and_a_silent_host_is_skipped(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    access = MapAccess()
    svc, _ = make_service(
        engine,
        [gpu_a(8), host("gpu-b", "A100", 8), host("gpu-c", "A100", 8)],
        places=place("ssh", access),
    )
    a = RecordedRunner(A100_HOST_JSON)
    b = RecordedRunner(SshError("gpu-b: connection refused"))
    c = RecordedRunner(A100_HOST_JSON)
    with_access(access, gpu_a=a, gpu_b=b, gpu_c=c)
    assert collect(svc).hosts == 0 and not a.commands  # nothing held: nobody is asked
    for _ in range(3):  # 8 + 8 GPUs held: the best fit fills gpu-a, then gpu-b
        svc.reserve(actor(svc, "alice"), Reserve(count=8 if _ < 2 else 1, model="A100"))
    report = collect(svc)
    assert report.hosts == 3 and report.samples == 16
    assert report.failed == ("gpu-b: gpu-b: connection refused",)
    assert "gpu-b did not answer" in caplog.text
    assert {r.host_id for r in rows(engine)} == {1, 3}


def test_a_garbled_answer_is_a_failure_not_a_crash(sqlite_engine: Engine) -> None:
    access = MapAccess()
    svc, _ = make_service(sqlite_engine, [gpu_a(1)], places=place("ssh", access))
    with_access(access, gpu_a=RecordedRunner('{"schema_version": 99}'))
    svc.reserve(actor(svc, "alice"), Reserve())
    report = collect(svc)
    assert report.samples == 0 and "cannot read" in report.failed[0]


def test_a_gpu_without_a_utilization_reading_gets_no_sample(sqlite_engine: Engine) -> None:
    """Stored as 0% it would look idle, and idle detection would take it from its holder."""
    doc = json.loads(A100_HOST_JSON)
    doc["gpus"][3]["util_pct"] = None  # nvidia-smi said [N/A]
    access = MapAccess()
    svc, _ = make_service(sqlite_engine, [gpu_a()], places=place("ssh", access))
    with_access(access, gpu_a=RecordedRunner(json.dumps(doc)))
    svc.reserve(actor(svc, "alice"), Reserve(count=8))
    assert collect(svc).samples == 7
    assert [r.gpu_index for r in rows(sqlite_engine)] == [0, 1, 2, 4, 5, 6, 7]


def _no_gpu_here() -> None:
    if take_snapshot().gpus:
        pytest.skip("this machine has NVIDIA GPUs; the no-driver path cannot be seen here")


def local_instance() -> Instance:
    return Instance(name="local", provider="local", state="ready", gpus=(GpuDevice(0, "cpu"),))


def test_the_real_probe_on_this_machine_says_no_driver_end_to_end(
    engine: Engine, tmp_path: Path
) -> None:
    _no_gpu_here()
    access = MapAccess()
    # As the runtime wires it: the local provider words its host "this machine".
    words = LocalProvider(Settings(), LocalCompute(probe=list))
    svc, _ = make_service(engine, [local_instance()], places=place("local", access, display=words))
    with_access(access, local=(LocalRunner(), LOCAL_TARGET))
    alice = actor(svc, "alice")
    before = render(handle_text(svc, alice, "/gpu util").view)
    assert "No utilization samples for local yet: nothing has been held or run" in before
    assert "local: no NVIDIA driver on this machine" in before
    svc.reserve(alice, Reserve())
    report = collect(svc)  # sys.executable -m training.telemetry --json, for real
    assert report.hosts == 1 and report.no_driver == ("local",) and rows(engine) == []
    reply = handle_text(svc, alice, "/gpu util local")
    text = render(reply.view)
    assert not reply.error
    assert "no NVIDIA driver on this machine" in text and "nvidia-smi not found" in text
    assert "nothing has been held" not in text  # it is busy: the driver is the reason
    assert notifications(engine) == []  # no chart without history


def test_gpu_util_in_the_piped_shell_says_no_driver(tmp_path: Path) -> None:
    _no_gpu_here()
    proc = run_shell(tmp_path, "--user", "alice", "--no-wait", script="/gpu util\n")
    assert proc.returncode == 0, proc.stderr
    assert "No utilization samples" in proc.stdout
    assert "local: no NVIDIA driver on this machine" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_collection_over_real_ssh(sqlite_engine: Engine, stranger_lab: SshLab) -> None:
    """The same collection through `SshClient` and a real sshd, logging in as a stranger
    (an account of its own, nothing of the bot's); the host's "python" is a script placed
    there that prints the recorded JSON, whatever it is asked."""
    lab = stranger_lab
    h = lab.hosts["gpu-a"]
    target = SshTarget(
        host=h.address,
        port=h.port,
        user=lab.user_of("gpu-a"),
        key_path=str(lab.client_key),
        name="gpu-a",
    )
    client = SshClient(connect_timeout=5, command_timeout=20)
    try:
        h.root.mkdir(parents=True, exist_ok=True)
        fake_python = str(h.root / "python-with-a100s")
        script = f"#!/bin/sh\ncat <<'EOF'\n{A100_HOST_JSON}\nEOF\n"
        client.write_file(target, fake_python, script.encode(), mode=0o755)
        assert os.stat(fake_python).st_mode & stat.S_IXUSR
        access = MapAccess()
        svc, _ = make_service(sqlite_engine, [gpu_a()], places=place("ssh", access))
        access = with_access(access, gpu_a=(client, target))
        access.python = Interpreter(fake_python)
        svc.reserve(actor(svc, "alice"), Reserve(count=8))
        report = collect(svc)
        assert report.samples == 8 and not report.failed, report
        got = rows(sqlite_engine)
        assert [r.util_pct for r in got] == [0, 0, 97, 96, 98, 95, 41, 0]
        assert all(r.reservation_id == 1 for r in got)
        # and a host whose interpreter is missing is a failure in words, not a crash
        access.python = Interpreter(str(h.root / "nope"))
        report = collect(svc)
        assert report.samples == 0 and "telemetry exited 127" in report.failed[0]
    finally:
        client.close()


# --- thinning ---------------------------------------------------------------------------

NOW = datetime(2026, 1, 12, 0, 0, tzinfo=UTC)  # on the hour: tier buckets line up


def minute_samples(days: float, now: datetime = NOW) -> list[Sample]:
    n = int(days * 1440)
    return [
        Sample(
            id=i,
            host_id=1,
            gpu_index=0,
            at=now - timedelta(minutes=i),
            span_s=60,
            util_pct=float((i * 37) % 101),
            mem_used_mb=float(1000 + (i * 13) % 3000),
            mem_total_mb=40960.0,
            temperature_c=40.0 + i % 7,
            power_w=None if i % 5 == 0 else 100.0 + i % 50,
            user_id=7,
            reservation_id=3,
        )
        for i in range(1, n + 1)
    ]


def weighted(samples: list[Sample], at_least: timedelta, below: timedelta) -> tuple[float, int]:
    """Span-weighted mean utilization and total span of the samples aged [at_least, below]."""
    band = [s for s in samples if at_least <= NOW - s.at <= below]
    span = sum(s.span_s for s in band)
    return sum(s.util_pct * s.span_s for s in band) / span, span


def apply(
    samples: list[Sample], plan_delete: tuple[int, ...], add: tuple[Sample, ...]
) -> list[Sample]:
    gone = set(plan_delete)
    return [s for s in samples if s.id not in gone] + list(add)


def test_a_week_of_minute_samples_thins_to_the_tiers() -> None:
    week = minute_samples(7)  # ages 1 min … 7 days
    plan = thin(week, NOW)
    after = apply(week, plan.delete, plan.add)
    six_h, seven_d = TIERS[0].max_age, TIERS[1].max_age
    recent = [s for s in after if NOW - s.at < six_h]
    older = [s for s in after if six_h <= NOW - s.at < seven_d]
    hourly = [s for s in after if NOW - s.at >= seven_d]
    # Last 6 h: every minute sample, untouched (ages 1 … 359 min).
    assert len(recent) == 359 and all(s.span_s == 60 and s.id is not None for s in recent)
    # 6 h … 7 d: 10-minute samples. The minute at exactly 6 h sits alone in its bucket (the
    # other nine are younger); ages 6h01 … 6d23h50 fill 971 buckets of ten.
    assert Counter(s.span_s for s in older) == {60: 1, 600: 971}
    # The oldest 10-minute bucket had nine minutes (the tenth, at exactly 7 days, is in the
    # hourly tier); merged, it sits at its start, 7 days old, so it joins that minute in
    # their hour: one sample standing for those ten minutes.
    assert [(s.span_s, NOW - s.at) for s in hourly] == [(600, seven_d)]
    assert len(after) == 359 + 972 + 1
    # Time-weighted averages survive, per band (bar the 10 minutes that moved up) and over all.
    bands = [(timedelta(0), six_h), (six_h, seven_d - timedelta(minutes=10))]
    for lo, hi in [*bands, (timedelta(0), timedelta(days=8))]:
        before_avg, before_span = weighted(week, lo, hi)
        after_avg, after_span = weighted(after, lo, hi)
        assert after_span == before_span
        assert after_avg == pytest.approx(before_avg, rel=1e-12)
    merged = next(s for s in after if s.span_s == 600)
    assert merged.at.minute % 10 == 0 and merged.at.second == 0  # at its bucket's start
    assert (merged.user_id, merged.reservation_id) == (7, 3)  # attribution kept
    # Power was missing in some minutes: the merge averages what was there.
    assert merged.power_w is not None and 100.0 <= merged.power_w < 150.0
    # A second pass finds nothing to do.
    again = thin(after, NOW)
    assert again.delete == () and again.add == ()


def test_older_history_goes_hourly_then_is_dropped() -> None:
    old = minute_samples(2, now=NOW - timedelta(days=30))  # 30-32 days old
    ancient = minute_samples(0.01, now=NOW - timedelta(days=91))  # 14 samples past 90 days
    ancient = [replace(s, id=100000 + (s.id or 0)) for s in ancient]
    plan = thin(old + ancient, NOW)
    after = apply(old + ancient, plan.delete, plan.add)
    assert not any(NOW - s.at >= timedelta(days=90) for s in after)
    assert all(s.span_s == 3600 for s in after if s.id is None)
    assert len(after) == 48  # 2 days of full hours
    before_avg = sum(s.util_pct for s in old) / len(old)
    after_avg = sum(s.util_pct * s.span_s for s in after) / sum(s.span_s for s in after)
    assert after_avg == pytest.approx(before_avg, rel=1e-12)


def test_merges_never_mix_holders_or_unfinished_buckets() -> None:
    t = NOW - timedelta(hours=7)

    def mk(i: int, user: int, at: datetime) -> Sample:
        return Sample(i, 1, 0, at, 60, 50.0, 1.0, 2.0, user_id=user)

    a = [mk(i, 1, t + timedelta(minutes=i)) for i in range(5)]
    b = [mk(10 + i, 2, t + timedelta(minutes=5 + i)) for i in range(5)]
    plan = thin(a + b, NOW)
    assert sorted((m.user_id, m.span_s) for m in plan.add) == [(1, 300), (2, 300)]
    # The current minute is still filling: two samples in it stay as they are.
    fresh = [mk(20, 1, NOW + timedelta(seconds=10)), mk(21, 1, NOW + timedelta(seconds=25))]
    assert thin(fresh, NOW + timedelta(seconds=30)) == thin([], NOW)
    assert len(thin(fresh, NOW + timedelta(seconds=60)).add) == 1  # once it is full, it is


def test_thinning_in_the_database(engine: Engine) -> None:
    svc, clock = make_service(engine, [gpu_a(1)])
    clock.set(NOW)
    samples = minute_samples(1.5)  # 36 h: 6 h of minutes, then 30 h of 10-minute buckets
    with transaction(engine) as s:
        s.add_all(replace(x, user_id=None, reservation_id=None).row() for x in samples)
    before = rows(engine)
    plan = thin_db(svc)
    after = rows(engine)
    assert len(after) == len(before) - len(plan.delete) + len(plan.add)
    assert sum(1 for r in after if r.span_s == 60) == 359 + 1
    assert sum(1 for r in after if r.span_s == 600) == (2160 - 370) // 10 + 1

    def mean(rs: list[GpuSample]) -> float:
        return sum(r.util_pct * r.span_s for r in rs) / sum(r.span_s for r in rs)

    assert mean(after) == pytest.approx(mean(before), rel=1e-9)
    assert sum(r.span_s for r in after) == sum(r.span_s for r in before)
    second = thin_db(svc)
    assert second.delete == () and second.add == ()


# --- /gpu util and the channel post ------------------------------------------------------


def sample_minutes(svc: GpuService, minutes: int) -> None:
    from bot.domain.clock import VirtualClock

    clock = svc.clock
    assert isinstance(clock, VirtualClock)
    for _ in range(minutes):
        collect(svc)
        clock.advance(timedelta(minutes=1))


def test_gpu_util_shows_the_table_and_dms_the_chart(engine: Engine) -> None:
    access = MapAccess()
    svc, _ = make_service(engine, [gpu_a()], places=place("ssh", access))
    with_access(access, gpu_a=RecordedRunner(A100_HOST_JSON))
    alice = actor(svc, "alice")
    nothing_yet = render(handle_text(svc, alice, "/gpu util").view)
    assert "gpu-a: 8 GPUs answer now, 5 working; samples start when one is held." in nothing_yet
    svc.reserve(alice, Reserve(count=2, model="A100"))
    sample_minutes(svc, 30)
    reply = handle_text(svc, alice, "/gpu util", request_key="slack:cmd:1")
    text = render(reply.view)
    assert not reply.error, text
    assert "5 of 8 GPUs busy" in reply.view.text  # GPUs 2-6 work; 0 squats, 1 and 7 rest
    line0 = next(ln for ln in text.splitlines() if ln.strip().startswith("gpu-a  0"))
    assert "A100" in line0 and "0%" in line0 and "29.8/40 GiB" in line0 and "alice" in line0
    line2 = next(ln for ln in text.splitlines() if ln.strip().startswith("gpu-a  2"))
    assert "97%" in line2 and "71°C" in line2 and "388 W" in line2 and "free" in line2
    assert "1m ago" in text and "chart of the last 6 h follows in a DM" in text
    (dm,) = notifications(engine, "dm")
    assert dm.target == "alice" and dm.attachment_name and dm.attachment_name.endswith(".png")
    assert dm.attachment is not None and dm.attachment.startswith(b"\x89PNG\r\n\x1a\n")
    # A retried delivery of the same command queues no second chart.
    handle_text(svc, alice, "/gpu util", request_key="slack:cmd:1")
    assert len(notifications(engine, "dm")) == 1
    # One host by name; an unknown one is a clear error with the usage.
    assert "gpu-a" in render(handle_text(svc, alice, "/gpu util gpu-a", "k2").view)
    bad = handle_text(svc, alice, "/gpu util gpu-z")
    assert bad.error and "There is no host `gpu-z`; hosts: gpu-a." in bad.view.text
    assert "/gpu util keep ID" in bad.view.text


def test_the_channel_snapshot_posts_once_per_slot_and_only_while_busy(engine: Engine) -> None:
    access = MapAccess()
    svc, clock = make_service(
        engine, [gpu_a()], util_post_interval=timedelta(hours=1), places=place("ssh", access)
    )
    runner = RecordedRunner(A100_HOST_JSON)
    with_access(access, gpu_a=runner)
    assert snapshot_job(svc) is False  # nothing held, nothing sampled
    alice = actor(svc, "alice")
    svc.reserve(alice, Reserve(count=1, model="A100"))
    sample_minutes(svc, 5)
    assert snapshot_job(svc) is True
    assert snapshot_job(svc) is True  # a second worker or a retry in the same slot…
    posts = notifications(engine, "channel")
    assert len(posts) == 1  # …posts nothing more
    assert posts[0].target == "gpu" and posts[0].attachment is not None
    assert "GPU utilization" in posts[0].text
    clock.advance(timedelta(hours=1))
    sample_minutes(svc, 1)
    snapshot_job(svc)
    assert len(notifications(engine, "channel")) == 2  # the next slot
    handle_text(svc, alice, "/gpu release")
    clock.advance(timedelta(hours=1))
    assert snapshot_job(svc) is False  # nobody holds anything: silence
    off, _ = make_service(engine, [gpu_a()], util_post_interval=timedelta(0))
    assert snapshot_job(off) is False


def test_the_worker_runs_the_three_jobs(sqlite_engine: Engine) -> None:
    svc, _ = make_service(sqlite_engine, [], util_sample_s=30.0, util_post_interval=timedelta(0))
    jobs = {j.id: j for j in periodic_jobs(svc)}
    assert jobs["util-sample"].trigger_args == {"seconds": 30.0}
    assert jobs["idle-check"].trigger_args == {"seconds": 30.0}
    assert "util-post" in jobs


def test_the_chart_axis_fits_data_shorter_than_its_window() -> None:
    """A fresh install has twenty minutes of samples: the axis spans them (with a little
    room before), not six hours with all the data in its last pixel; older data keeps
    the whole window."""
    from bot.domain.charts import GpuSeries

    now = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
    fresh = [now - timedelta(minutes=m) for m in (20, 10, 0)]
    series = [GpuSeries("a:0 A100", fresh, [50.0] * 3, [10.0] * 3)]
    start = chart_start(series, now)
    assert now - timedelta(minutes=22) <= start <= now - timedelta(minutes=20)
    old = [now - CHART_WINDOW - timedelta(minutes=5), now]
    assert chart_start([GpuSeries("a:0 A100", old, [1.0, 2.0], [0.0, 0.0])], now) == (
        now - CHART_WINDOW
    )


def test_a_jobs_gpus_seen_from_0_are_mapped_back_to_the_nodes() -> None:
    """A step inside a Slurm job under ConstrainDevices sees the job's GPUs as 0..k-1;
    `gpu_map` (the node's indexes the job holds) puts each sample on the node's GPU. A
    step that sees the whole node keeps the node's numbering."""
    constrained = parse_snapshot(snapshot_json({0: (90, 100), 1: (0, 0)}))
    assert constrained is not None
    mapped = on_host(constrained, (2, 3))
    assert [(g.index, g.util_pct) for g in mapped.gpus] == [(2, 90), (3, 0)]
    whole = parse_snapshot(snapshot_json({i: (0, 0) for i in range(4)}))
    assert whole is not None
    assert [g.index for g in on_host(whole, (2, 3)).gpus] == [0, 1, 2, 3]
    assert on_host(constrained, ()) == constrained  # a host's own seat: as it is


@dataclass
class JobSeatAccess(MapAccess):
    """A host reached through the jobs on it (a Slurm node's `ClusterSeat`): a seat per
    job, each seeing what its runner answers, with the node's index of each GPU it sees."""

    jobs: dict[str, list[tuple[HostShell, tuple[int, ...]]]] = field(default_factory=dict)

    def seats_for(self, host_name: str) -> list[HostSeat]:
        target = SshTarget(host=host_name, name=host_name)
        return [
            HostSeat(runner, target, self.runs_dir, lambda: self.python, gpu_map=gpus)
            for runner, gpus in self.jobs.get(host_name, [])
        ]


def test_a_node_reached_through_its_jobs_is_sampled_in_each_job_or_once_if_one_sees_all(
    engine: Engine,
) -> None:
    """Under ConstrainDevices each job's step sees its own GPUs from 0: every job is
    asked, and each answer lands on the node's GPUs the job holds. A step that sees the
    whole node is enough: the node's other jobs are not asked (one step fewer for the
    cluster's controller each sample)."""
    access = JobSeatAccess()
    svc, _ = make_service(engine, [gpu_a(8)], places=place("ssh", access))
    first = RecordedRunner(snapshot_json({0: (97, 100), 1: (95, 100)}))
    second = RecordedRunner(snapshot_json({0: (0, 0), 1: (0, 0), 2: (0, 0)}))
    access.jobs["gpu-a"] = [(first, (4, 6)), (second, (0, 1, 2))]
    svc.reserve(actor(svc, "alice"), Reserve(count=5, model="A100"))
    report = collect(svc)
    assert report.samples == 5 and first.commands and second.commands
    assert {(r.gpu_index, r.util_pct) for r in rows(engine)} == {
        (4, 97.0), (6, 95.0), (0, 0.0), (1, 0.0), (2, 0.0),
    }  # fmt: skip

    whole = RecordedRunner(snapshot_json({i: (50, 100) for i in range(8)}))
    other = RecordedRunner(snapshot_json({0: (0, 0)}))
    access.jobs["gpu-a"] = [(whole, (4, 6)), (other, (0, 1, 2))]
    assert collect(svc).samples == 8
    assert whole.commands and not other.commands
