"""Replicas on PostgreSQL, as real `gpubot worker` processes: exactly one leads; when the
leader is killed with SIGKILL in the middle of dispatching, the other leads within one
tick, and every queued run is started exactly once and finishes (none lost, none twice).
SIGTERM is graceful: the tick in hand completes, the lock is free at once, exit 0.

Each run's command appends its own tag to one file before sleeping, so the file counts
real process starts, whatever the database says."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.adapters.leader import _ADVISORY_KEY
from bot.app.config import Settings
from bot.app.service import GpuService
from bot.domain.clock import SystemClock
from bot.domain.commands import Run
from db.models import TrainingRun
from provisioning.base import GpuDevice, Instance
from tests.core.helpers import runs_here
from tests.fakes.slack_api import FakeSlack
from tests.slack.conftest import SignedClient

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parents[2]
TICK_S = 0.5
SLOTS = 4
SERVE = "import typer; from bot.faces.slack.cli import serve; typer.run(serve)"


class WorkerProc:
    """One `gpubot worker` child with JSON logs in a file of its own."""

    def __init__(self, name: str, env: dict[str, str], tmp: Path) -> None:
        self.name = name
        self.log_path = tmp / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bot.faces.cli", "worker", "--log-format", "json"],
            env=env,
            cwd=tmp,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for raw in self.log_path.read_text("utf-8", "replace").splitlines():
            try:
                out.append(json.loads(raw))
            except json.JSONDecodeError:
                continue  # a line being written right now
        return out

    def leads_at(self) -> float | None:
        """When this worker logged that it leads (epoch seconds), if it did."""
        from datetime import datetime

        for doc in self.lines():
            if doc["message"] == "this worker leads":
                return datetime.fromisoformat(doc["time"]).timestamp()
        return None

    def logged(self, words: str) -> bool:
        return any(words in doc["message"] for doc in self.lines())

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._log.close()
        return code


def wait_until(check: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


@pytest.fixture
def env(pg_engine: Engine, tmp_path: Path, pg_leader_key: int) -> dict[str, str]:
    """A `gpubot worker`'s environment on this test's schema. Its workers lead by the
    database-wide advisory lock (`pg_leader_key`): no other test may hold it meanwhile."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLACK_", "GPUBOT_", "PORT"))}
    e.update(
        GPUBOT_HOME=str(tmp_path),  # shared: both workers see the runs' directories
        GPUBOT_LOCAL_GPUS="none",
        GPUBOT_LOCAL_SLOTS=str(SLOTS),
        GPUBOT_TICK_SECONDS=str(TICK_S),
        DATABASE_URL=pg_engine.url.render_as_string(hide_password=False),
        PYTHONPATH=str(ROOT),
    )
    return e


@pytest.fixture
def workers() -> Iterator[list[WorkerProc]]:
    started: list[WorkerProc] = []
    yield started
    for w in started:
        w.stop()


def service(engine: Engine, tmp_path: Path) -> GpuService:
    svc = GpuService(engine, Settings(), SystemClock(), runs_here(tmp_path / "runs"))
    local = Instance(
        name="local",
        provider="local",
        state="ready",
        gpus=tuple(GpuDevice(index=i, model="cpu") for i in range(SLOTS)),
    )
    svc.sync_hosts([local])
    return svc


def queue_runs(svc: GpuService, n: int, starts: Path, sleep_s: float) -> list[int]:
    assert svc.runs is not None
    ids = []
    for i in range(n):
        cmd = ("sh", "-c", f"echo run-{i} >> {starts}; sleep {sleep_s}")
        ids.append(
            svc.runs.submit(svc.actor("alice"), Run(command=cmd, model="cpu")).extra["run_id"]
        )
    return ids


def states(engine: Engine) -> dict[int, tuple[str, dict[str, Any]]]:
    with Session(engine) as s:
        return {
            r.id: (r.state, dict(r.placement))
            for r in s.exec(select(TrainingRun).order_by(col(TrainingRun.id)))
            if r.id is not None
        }


def lock_is_free(engine: Engine) -> bool:
    with engine.connect() as conn:
        got = bool(
            conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": _ADVISORY_KEY}).scalar()
        )
        if got:
            conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _ADVISORY_KEY})
        conn.commit()
    return got


def test_sigkill_of_the_leader_mid_dispatch_loses_no_run_and_starts_none_twice(
    pg_engine: Engine, env: dict[str, str], workers: list[WorkerProc], tmp_path: Path
) -> None:
    svc = service(pg_engine, tmp_path)
    a = WorkerProc("a", env, tmp_path)
    workers.append(a)
    wait_until(a.leads_at, 60, "the first worker to lead")
    b = WorkerProc("b", env, tmp_path)
    workers.append(b)
    wait_until(lambda: b.logged("worker started"), 60, "the second worker to start")
    time.sleep(2 * TICK_S)
    assert b.leads_at() is None, "two workers lead at once"

    starts = tmp_path / "starts.log"
    ids = queue_runs(svc, 8, starts, sleep_s=1.0)

    # Kill the leader the moment a run is claimed but not yet recorded as started.
    def claimed() -> bool:
        return any(st == "starting" for st, _ in states(pg_engine).values())

    mid_dispatch = False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if claimed():
            mid_dispatch = True
            break
        time.sleep(0.002)
    a.proc.send_signal(signal.SIGKILL)
    killed_at = time.time()
    assert a.proc.wait(timeout=10) == -signal.SIGKILL
    assert mid_dispatch, "never saw a run being dispatched"

    took_over = wait_until(b.leads_at, 10, "the standby to lead")
    lead_delay = took_over - killed_at
    print(f"standby led {lead_delay:.3f} s after the SIGKILL (tick {TICK_S} s)")
    # One tick, plus what a busy two-core machine adds to a process being scheduled.
    assert lead_delay <= TICK_S + 0.5

    # A run claimed by the dead leader and never started goes back in line after the
    # starting grace (bot.app.runs.STARTING_GRACE, 90 s): allow for that.
    def all_done() -> bool:
        return all(st in ("succeeded", "failed") for st, _ in states(pg_engine).values())

    wait_until(all_done, 180, "every run to finish", every=0.5)
    final = states(pg_engine)
    assert {rid: st for rid, (st, _) in final.items()} == {rid: "succeeded" for rid in ids}
    started = Counter(starts.read_text().split())
    assert started == Counter({f"run-{i}": 1 for i in range(len(ids))}), started
    # Each run has one directory and one process group.
    assert len({p["dir"] for _, p in final.values()}) == len(ids)
    assert b.stop() == 0


def test_sigterm_finishes_the_tick_in_hand_and_frees_the_lock_at_once(
    pg_engine: Engine, env: dict[str, str], workers: list[WorkerProc], tmp_path: Path
) -> None:
    svc = service(pg_engine, tmp_path)
    w = WorkerProc("solo", env, tmp_path)
    workers.append(w)
    wait_until(w.leads_at, 60, "the worker to lead")
    assert not lock_is_free(pg_engine)

    starts = tmp_path / "starts.log"
    queue_runs(svc, 2, starts, sleep_s=0.5)
    wait_until(
        lambda: any(st == "starting" for st, _ in states(pg_engine).values()),
        60,
        "a dispatch in progress",
        every=0.002,
    )
    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(timeout=30) == 0
    assert lock_is_free(pg_engine), "the lock outlived a graceful exit"
    # The dispatch in hand was finished, not cut: no run is left claimed but unstarted.
    for rid, (st, placement) in states(pg_engine).items():
        assert st != "starting", (rid, placement)
        if st == "running":
            assert "pgid" in placement
    assert w.logged("worker stopped")


def test_two_serve_replicas_share_nothing_but_the_database(
    pg_engine: Engine, env: dict[str, str], fake_slack: FakeSlack, tmp_path: Path
) -> None:
    """Two `gpubot serve` processes on two ports, one PostgreSQL schema, each with a home
    of its own: what one grants, the other shows (after at most `status_cache_s`, 1 s by
    default, the bound on a status cached before another process wrote)."""
    secret = "replica-test-signing-secret-00"
    procs: list[subprocess.Popen[bytes]] = []
    clients: list[SignedClient] = []
    try:
        for name in ("web1", "web2"):
            home = tmp_path / name
            home.mkdir()
            port = _free_port()
            e = dict(env)
            e.update(
                GPUBOT_HOME=str(home),
                GPUBOT_LOCAL_SLOTS="2",
                SLACK_BOT_TOKEN=fake_slack.bot_token,
                SLACK_SIGNING_SECRET=secret,
                SLACK_API_URL=fake_slack.url,
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", SERVE, "--port", str(port), "--no-worker"],
                    env=e,
                    cwd=home,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            clients.append(SignedClient("127.0.0.1", port, secret, fake_slack))
        for proc, client in zip(procs, clients, strict=True):
            wait_until(functools.partial(_healthy, client.port, proc), 60, "serve to come up")
        web1, web2 = clients
        # Each answer where the user sees it: in the ack, or (the machine was slow) posted to
        # the response_url the ack promised (SignedClient.answer).
        assert "free" in web2.answer("status")["text"]  # web2 has a cached status now
        first = web1.answer("reserve 1 cpu for 1h", user="U0ALICE01")
        assert "Reserved: reservation #1" in first["text"], first["text"]
        second = web2.answer("reserve 1 cpu for 1h", user="U0BOB0001")
        assert "Reserved: reservation #2" in second["text"], second["text"]
        time.sleep(1.1)  # status_cache_s
        texts = [json.dumps(c.answer("status", user="U0CAROL01")["blocks"]) for c in clients]
        # The same, but for "(in 59m59s)" against "(in 59m58s)": each reads its own clock,
        # and a loaded machine can put a second between the two answers.
        assert _no_countdown(texts[0]) == _no_countdown(texts[1])
        assert "#1" in texts[0] and "#2" in texts[0], texts[0]
        # One more would exceed the host's slots on either replica: both see it wait.
        third = web1.answer("reserve 1 cpu for 1h", user="U0CAROL01")
        assert "#3" in third["text"] and "waiting" in third["text"], third["text"]
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(timeout=20) for proc in procs]
    assert codes == [0, 0]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(port: int, proc: subprocess.Popen[bytes]) -> bool:
    import http.client

    assert proc.poll() is None, f"serve exited {proc.returncode}"
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/healthz")
        return conn.getresponse().status == 200
    except OSError:
        return False


def _no_countdown(text: str) -> str:
    return re.sub(r"\(in [0-9dhms]+\)", "(in …)", text)
