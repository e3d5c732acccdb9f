"""`GPUBOT_PROVIDER=slurm` against the machine's real Slurm, configured as a lab's
(tests/slurm_cluster.py: four fake A100s, memory counted, partitions short (default,
30 minutes), long and a preempting urgent one, slurmdbd's accounting, people as their
own unix accounts). The bot is not root here: every Slurm command and every file of the
work directory goes through `gpubot-slurmbot`, a plain account whose sudoers lines let
it run Slurm's tools as the people (docs/SLURM.md), as a lab's admin would allow it.

The cluster's Python is the real preparation (the bootstrap from an interpreter every
account can execute), kept between sessions in one directory of the test cluster's.
Runs execute on CPU: the GPUs are fake.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlmodel import Session, select

from bot.app.config import load_settings
from bot.domain.commands import Cancel, Extend, Logs, Queue, Release, Reserve, Run, Status
from bot.domain.errors import UserError
from bot.faces.runtime import Runtime, build_runtime
from db.models import Reservation, TrainingRun
from tests.runtime_helpers import dms
from tests.slurm_cluster import PEOPLE, SlurmCluster
from tests.slurm_lab import SHARED_ENV, as_bot_account, lab_env, lab_runtime
from training.status import parse_status

GUARD_S = 240.0  # a guard against a hang, not a speed assertion


@pytest.fixture
def slurm_rt(
    slurm_cluster: SlurmCluster,
    lab_workdir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Runtime]:
    with lab_runtime(slurm_cluster, lab_workdir, tmp_path / "home", monkeypatch) as rt:
        yield rt


def _squeue(cluster: SlurmCluster) -> str:
    return cluster.command("squeue", "--noheader", "-o", "%i %j %T %b %u %P %k").stdout


def _sacct(cluster: SlurmCluster, job: int) -> list[str]:
    out = cluster.command(
        "sacct", "-a", "-X", "-n", "-P", "-j", str(job), "-o", "User,Account,State,ElapsedRaw"
    ).stdout
    return out.strip().split("|")


def _until(
    check: Callable[[], bool],
    what: str,
    tick: Callable[[], object],
    shown: Callable[[], object] = lambda: "",
) -> None:
    deadline = time.monotonic() + GUARD_S
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within the guard {shown()}"
        tick()
        time.sleep(0.3)


def _job_of(rt: Runtime, rid: int) -> int:
    with Session(rt.engine) as s:
        res = s.get(Reservation, rid)
        assert res is not None
        return int(res.external["job"])


def test_status_shows_the_clusters_gpus(slurm_rt: Runtime) -> None:
    view = slurm_rt.service.status(slurm_rt.service.actor("alice"), Status()).view
    assert view.text == "4 of 4 free on 1 host"
    line = next(str(b) for b in view.blocks if "slurm" in str(b) and "*" in str(b))
    assert "Slurm: idle, 0 of 4 GPUs allocated" in line
    assert "A100" in str(view.blocks)


def test_someone_without_a_cluster_account_is_refused_and_nothing_runs(
    slurm_rt: Runtime, slurm_cluster: SlurmCluster
) -> None:
    svc = slurm_rt.service
    runs = svc.runs
    carol = svc.actor("carol")
    asks: list[Callable[[], object]] = [
        lambda: svc.reserve(carol, Reserve(1, "A100")),
        lambda: runs.submit(carol, Run(command=("id", "-un"), model="A100")),
    ]
    for ask in asks:
        with pytest.raises(UserError) as refused:
            ask()
        assert "no account on the Slurm cluster" in refused.value.text
        assert "GPUBOT_SLURM_USERS=carol=" in refused.value.text
    with Session(slurm_rt.engine) as s:
        assert s.exec(select(Reservation)).first() is None
        assert s.exec(select(TrainingRun)).first() is None
    assert _squeue(slurm_cluster).strip() == ""


def test_peoples_jobs_are_theirs_and_two_share_the_node(
    slurm_rt: Runtime, slurm_cluster: SlurmCluster
) -> None:
    """Memory is counted and no partition sets a default: each 1-GPU holding job asks a
    node's share per GPU, so alice's and bob's run side by side, each as its owner,
    traced to its Slack person; accounting records them as theirs."""
    svc = slurm_rt.service
    first = svc.reserve(svc.actor("alice"), Reserve(1, "A100", timedelta(minutes=20))).view
    second = svc.reserve(svc.actor("bob"), Reserve(1, "A100", timedelta(minutes=20))).view
    assert first.text.startswith("Reserved: reservation #1"), first.text
    assert second.text.startswith("Reserved: reservation #2"), second.text
    shown = _squeue(slurm_cluster)
    for rid, person in ((1, "alice"), (2, "bob")):
        job = _job_of(slurm_rt, rid)
        line = re.search(rf"^{job} gpubot-res-{rid} RUNNING \S+ (\S+) (\S+) (.*)$", shown, re.M)
        assert line is not None, shown
        assert line.group(1) == PEOPLE[person] and line.group(2) == "short"
        assert f"reservation {rid} of {person}" in line.group(3)
    svc.release(svc.actor("alice"), Release(all=True))
    job = _job_of(slurm_rt, 1)
    _until(
        lambda: _sacct(slurm_cluster, job)[2].startswith("CANCELLED"), "alice's job ended", svc.tick
    )
    assert _sacct(slurm_cluster, job)[:2] == [PEOPLE["alice"], "lab"]


def test_a_two_hour_reservation_goes_to_the_partition_that_allows_it(
    slurm_rt: Runtime, slurm_cluster: SlurmCluster
) -> None:
    svc = slurm_rt.service
    reply = svc.reserve(svc.actor("alice"), Reserve(1, "A100", timedelta(hours=2))).view
    assert reply.text.startswith("Reserved"), reply.text
    assert re.search(
        rf"^{_job_of(slurm_rt, 1)} \S+ RUNNING \S+ \S+ long ", _squeue(slurm_cluster), re.M
    )
    with pytest.raises(UserError, match=r"No partition allows 3d: the longest allowed is 2d"):
        svc.reserve(svc.actor("alice"), Reserve(1, "A100", timedelta(days=3)))
    with pytest.raises(UserError, match=r"may not use Slurm account `vision`"):
        svc.reserve(svc.actor("bob"), Reserve(1, "A100", place=(("account", "vision"),)))


def test_a_reservation_that_pends_says_why_and_is_granted_when_slurm_runs_it(
    slurm_rt: Runtime, slurm_cluster: SlurmCluster
) -> None:
    svc = slurm_rt.service
    alice, bob = svc.actor("alice"), svc.actor("bob")
    assert "Reserved" in svc.reserve(alice, Reserve(4, "A100", timedelta(minutes=20))).view.text
    waiting = svc.reserve(bob, Reserve(2, "A100", timedelta(minutes=20))).view.text
    assert "is waiting" in waiting and "Slurm job" in waiting and "pends (" in waiting, waiting
    svc.release(alice, Release(all=True))
    _until(
        lambda: any("Your turn: granted: reservation #2" in t for t in dms(slurm_rt, "bob")),
        "bob's reservation granted",
        svc.tick,
    )


def test_extend_raises_a_pending_holding_jobs_limit_as_its_owner(
    slurm_rt: Runtime, slurm_cluster: SlurmCluster
) -> None:
    """The bot's account is no Slurm operator here: a running holding job's limit stays
    (said plainly), a pending one's its owner raises."""
    svc = slurm_rt.service
    alice, bob = svc.actor("alice"), svc.actor("bob")
    svc.reserve(alice, Reserve(4, "A100", timedelta(minutes=20)))
    with pytest.raises(UserError, match="Slurm refused to extend holding job"):
        svc.extend(alice, Extend(timedelta(minutes=5)))
    svc.reserve(bob, Reserve(1, "A100", timedelta(minutes=10)))
    said = svc.extend(bob, Extend(timedelta(minutes=5))).view.text
    assert "will last 15m once granted" in said, said
    job = _job_of(slurm_rt, 2)
    limit = slurm_cluster.command("squeue", "--noheader", "-j", str(job), "-o", "%l").stdout
    assert limit.strip() == "15:00", limit


def test_a_controller_that_stops_answering_is_one_line_and_loses_nothing(
    slurm_rt: Runtime, slurm_cluster: SlurmCluster
) -> None:
    svc = slurm_rt.service
    alice = svc.actor("alice")
    svc.status(alice, Status())  # the partitions and accounting read once, while it answers
    with slurm_cluster.controller_down():
        time.sleep(0.6)  # past the cache
        status = svc.status(alice, Status()).view
        said = [str(b) for b in status.blocks if "not answering" in str(b)]
        assert said and "The Slurm controller is not answering" in said[0]
        reply = svc.reserve(alice, Reserve(1, "A100", timedelta(minutes=20))).view.text
        assert "controller is not answering" in reply and "#1" in reply, reply
    _until(
        lambda: any("Your turn: granted: reservation #1" in t for t in dms(slurm_rt, "alice")),
        "the waiting reservation submitted and granted once the controller answers",
        svc.tick,
    )


def _step(rt: Runtime) -> Callable[[], None]:
    runs = rt.service.runs

    def step() -> None:
        rt.service.tick()
        runs.poll()
        runs.dispatch()

    return step


def _run(rt: Runtime, rid: int) -> TrainingRun:
    with Session(rt.engine) as s:
        run = s.get(TrainingRun, rid)
        assert run is not None
        return run


def test_a_digits_run_is_its_owners_job_and_its_result_dm_says_its_accuracy(
    slurm_rt: Runtime, slurm_cluster: SlurmCluster
) -> None:
    svc = slurm_rt.service
    runs = svc.runs
    reply = runs.submit(svc.actor("alice"), Run(recipe="digits", model="A100")).view.text
    assert "No --max: Slurm gives it partition short's default time, 10m" in reply, reply
    rid = 1
    _until(
        lambda: _run(slurm_rt, rid).finished_at is not None,
        "the digits run finished",
        _step(slurm_rt),
    )
    run = _run(slurm_rt, rid)
    assert run.state == "succeeded", run.metrics
    job = int(run.placement["job"])
    assert run.placement["as"] == PEOPLE["alice"] and run.placement["partition"] == "short"
    [result] = [t for t in dms(slurm_rt, "alice") if f"Run #{rid} (recipe digits) finished" in t]
    accuracy = float(re.search(r"test_accuracy (\d+\.\d+)%", result).group(1))  # type: ignore[union-attr]
    assert accuracy >= 95.0, result
    user, account, state, elapsed = _sacct(slurm_cluster, job)
    assert (user, account, state) == (PEOPLE["alice"], "lab", "COMPLETED")
    # Billed from Slurm's own start and end: /gpu cost's GPU-hours are sacct's.
    hours = svc.costs("today", "alice")
    assert float(hours[1]["alice"]) == pytest.approx(2.00 * int(elapsed) / 3600, abs=0.011), hours


def test_a_run_slurm_ends_itself_says_how_and_is_billed_to_its_end(
    slurm_rt: Runtime, slurm_cluster: SlurmCluster
) -> None:
    """An admin's scancel: the result names Slurm's state and who, not 'the process
    vanished'; its GPUs are billed from Slurm's start to Slurm's end."""
    svc = slurm_rt.service
    runs = svc.runs
    rid = int(
        runs.submit(svc.actor("bob"), Run(command=("sleep", "300"), model="A100")).extra["run_id"]
    )
    step = _step(slurm_rt)
    _until(lambda: _run(slurm_rt, rid).state == "running", "the run started", step)
    job = int(_run(slurm_rt, rid).placement["job"])
    slurm_cluster.command("scancel", str(job))
    _until(lambda: _run(slurm_rt, rid).finished_at is not None, "the run ended", step)
    run = _run(slurm_rt, rid)
    assert run.state == "failed"
    assert f"Slurm ended its job {job}: CANCELLED by root" in str(run.metrics["summary"]), (
        run.metrics
    )
    [said] = [t for t in dms(slurm_rt, "bob") if f"Run #{rid}" in t and "CANCELLED" in t]
    assert "the process ended without writing a final status" not in said


def test_a_run_that_ends_while_the_bot_is_stopped_is_billed_to_its_real_end(
    slurm_rt: Runtime, slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    svc = slurm_rt.service
    runs = svc.runs
    rid = int(
        runs.submit(svc.actor("alice"), Run(command=("sleep", "4"), model="A100")).extra["run_id"]
    )
    step = _step(slurm_rt)
    _until(lambda: _run(slurm_rt, rid).state == "running", "the run started", step)
    job = int(_run(slurm_rt, rid).placement["job"])
    slurm_rt.engine.dispose()  # the bot stops; the job ends and Slurm forgets it
    deadline = time.monotonic() + GUARD_S
    while str(job) in _squeue(slurm_cluster) or _sacct(slurm_cluster, job)[2:3] != ["COMPLETED"]:
        assert time.monotonic() < deadline, "the job ended and was forgotten"
        time.sleep(0.5)
    time.sleep(4)  # MinJobAge: squeue no longer has it
    again = build_runtime(load_settings())
    try:
        _until(
            lambda: _run(again, rid).finished_at is not None, "billed after restart", _step(again)
        )
        run = _run(again, rid)
        assert run.state == "succeeded", run.metrics
        elapsed = int(_sacct(slurm_cluster, job)[3])
        assert run.started_at is not None and run.finished_at is not None
        billed = (run.finished_at - run.started_at).total_seconds()
        assert abs(billed - elapsed) <= 1.0, (billed, elapsed)
    finally:
        again.engine.dispose()


def test_a_run_that_pends_in_slurm_is_queued_there_and_cancel_ends_its_job(
    slurm_rt: Runtime, slurm_cluster: SlurmCluster
) -> None:
    """The verbs around a run on a cluster: /gpu queue says where it waits (Slurm's queue,
    and why), /gpu logs answers before it has a log, /gpu cancel scancels its batch job
    (as its owner), and /gpu cost bills the reservation that held the GPUs at the rate."""
    svc = slurm_rt.service
    runs = svc.runs
    alice, bob = svc.actor("alice"), svc.actor("bob")
    assert "Reserved" in svc.reserve(alice, Reserve(4, "A100", timedelta(minutes=20))).view.text
    rid = int(runs.submit(bob, Run(recipe="digits", model="A100")).extra["run_id"])
    step = _step(slurm_rt)

    def job() -> int | None:
        found = _run(slurm_rt, rid).placement.get("job")
        return int(found) if found is not None else None

    _until(lambda: job() is not None, "the run handed to Slurm", step)
    assert re.search(rf"^{job()} gpubot-run-{rid} PENDING", _squeue(slurm_cluster), re.M)
    step()
    board = str(runs.queue(bob, Queue()).view.blocks)
    assert f"#{rid}" in board and "Slurm" in board, board
    logs = runs.logs(bob, Logs(rid)).view.text
    assert f"#{rid}" in logs, logs  # an answer, not a traceback, before there is a log
    said = runs.cancel(bob, Cancel(rid)).view.text
    assert f"run #{rid}" in said, said
    _until(lambda: f"gpubot-run-{rid}" not in _squeue(slurm_cluster), "the batch job ends", step)
    _until(lambda: _run(slurm_rt, rid).state == "cancelled", "the run cancelled", step)
    svc.release(alice, Release(all=True))
    _, costs, _ = svc.costs("today", "alice")
    assert costs["alice"] > 0, costs  # 4 A100s at $2.00 an hour, for as long as they were held
    assert "bob" not in svc.costs("today", "bob")[1]  # the run never ran: nothing billed


def test_the_cluster_environment_is_made_from_an_interpreter_every_account_runs(
    slurm_rt: Runtime,
) -> None:
    """The bot's own python3 lies under root's 0700 home here: the environment is made from
    one every job account can execute, and job accounts cannot change it."""
    runs = slurm_rt.service.runs
    rid = int(runs.submit(slurm_rt.service.actor("bob"), Run(command=("true",))).extra["run_id"])
    _until(lambda: _run(slurm_rt, rid).finished_at is not None, "the run ended", _step(slurm_rt))
    assert _run(slurm_rt, rid).state == "succeeded", _run(slurm_rt, rid).metrics
    python = SHARED_ENV / "venv" / "bin" / "python"
    assert python.exists()
    real = Path(os.path.realpath(python))
    assert not str(real).startswith("/root/"), real
    assert shutil.which("python3") is not None
    for path in (SHARED_ENV, SHARED_ENV / "venv", SHARED_ENV / "venv" / "bin"):
        assert not path.stat().st_mode & 0o022, path  # neither group nor others may write


def test_a_run_slurm_preempts_saves_resumes_and_its_wait_is_not_billed(
    slurm_rt: Runtime, slurm_cluster: SlurmCluster
) -> None:
    """A higher-priority partition's job takes the node (preempt/partition_prio,
    PreemptMode=REQUEUE, a grace): the run is told (its batch script gets SIGTERM, asked
    with --signal), saves a checkpoint, is requeued, resumes from it (step > 0) and
    finishes as one run; its owner is told; the time it waited is not billed."""
    svc = slurm_rt.service
    runs = svc.runs
    # 120 epochs: ~2,600 steps, about 25 s alone and a few minutes under the suite's load
    # (300 ran, once resumed, past the 240-s guard in two fresh-clone runs); the preemption
    # comes within seconds of its first steps, long before it could finish.
    ask = Run(recipe="digits", model="A100", options=(("epochs", 120.0),))
    rid = int(runs.submit(svc.actor("alice"), ask).extra["run_id"])
    step = _step(slurm_rt)

    def stepped() -> bool:
        run = _run(slurm_rt, rid)
        return run.state == "running" and int(run.metrics.get("step") or 0) >= 2

    _until(stepped, "the run started and made steps", step, lambda: _run(slurm_rt, rid))
    first_start = _run(slurm_rt, rid).started_at
    urgent = slurm_cluster.command(
        "sbatch", "--parsable", "-p", "urgent", "-A", "lab", "-J", "urgent",
        "--gres=gpu:a100:4", "--mem=1000", "--time=5", "--output=/dev/null",
        "--wrap", "sleep 15",
    )  # fmt: skip
    assert urgent.returncode == 0, urgent.stderr
    _until(lambda: _run(slurm_rt, rid).finished_at is not None, "the run ended", step)
    run = _run(slurm_rt, rid)
    log_text = Path(str(run.placement["log"])).read_text(errors="replace")[-3000:]
    assert run.state == "succeeded", (run.metrics.get("summary"), dms(slurm_rt, "alice"), log_text)
    said = dms(slurm_rt, "alice")
    # The bot account read the checkpoint the owner's job wrote (the work directory's
    # group; the file's mode from the job's umask, not mkstemp's 0600).
    assert any(f"Run #{rid} was interrupted" in t and "resumes from step" in t for t in said), said
    assert sum(f"Run #{rid} (recipe digits) finished" in t for t in said) == 1
    final = parse_status(Path(str(run.placement["status"])).read_text())
    assert final is not None and final.state == "done"
    assert final.resumed_from_step is not None and final.resumed_from_step > 0, final
    from db.models import UsageInterval

    with Session(slurm_rt.engine) as s:
        spans = list(s.exec(select(UsageInterval).where(UsageInterval.run_id == rid)))
    assert spans and all(iv.ended_at is not None for iv in spans)
    billed = sum((iv.ended_at - iv.started_at).total_seconds() for iv in spans if iv.ended_at)
    assert first_start is not None and run.finished_at is not None
    wall = (run.finished_at - first_start).total_seconds()
    assert billed < wall - 5, (billed, wall)  # the urgent job's turn is not the run's


def test_the_doctor_says_the_mode_and_proves_it_with_a_held_job(
    slurm_rt: Runtime, slurm_cluster: SlurmCluster
) -> None:
    [provider] = slurm_rt.providers
    checks = provider.identity_checks()  # type: ignore[attr-defined]
    [identity, submitted] = checks
    assert identity.ok and "through `sudo -n -u PERSON`" in identity.detail
    assert "people without a mapping are refused" in identity.detail
    assert submitted.ok, submitted.detail
    job = re.search(r"held job (\d+) submitted and cancelled as gpubot-", submitted.detail)
    assert job is not None, submitted.detail
    assert _sacct(slurm_cluster, int(job.group(1)))[2].startswith("CANCELLED")


def test_a_run_at_slurms_limit_saves_its_checkpoint_and_resumes_from_it(
    slurm_cluster: SlurmCluster,
    lab_workdir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A recipe run without --max gets partition short's default time (10m); Slurm warns
    it before that (--signal, here 575 s ahead so that the warning comes within a minute):
    it saves a checkpoint and the bot ends it there, at Slurm's limit, not requeued; the
    DM says the step and how to resume; `/gpu run --resume` goes on from that step."""
    monkeypatch.delenv("DATABASE_URL", raising=False)
    with as_bot_account(slurm_cluster.conf):
        env = lab_env(
            slurm_cluster.conf,
            lab_workdir,
            tmp_path / "home",
            GPUBOT_SLURM_CACHE_S="0.5",
            GPUBOT_SLURM_SIGNAL="TERM@575",
        )
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        rt = build_runtime(load_settings())
    try:
        runs = rt.service.runs
        alice = rt.service.actor("alice")
        ask = Run(recipe="digits", model="A100", options=(("epochs", 10000.0),))
        reply = runs.submit(alice, ask)
        assert "default time, 10m" in reply.view.text, reply.view.text
        rid = int(reply.extra["run_id"])
        step = _step(rt)
        _until(lambda: _run(rt, rid).finished_at is not None, "the run ended", step)
        run = _run(rt, rid)
        assert run.state == "failed" and run.exit_code == 76, run.metrics.get("summary")
        status_text = Path(str(run.placement["status"])).read_text()
        saved = run.metrics["summary"].get("resume_step")
        assert isinstance(saved, int) and saved > 0, (run.metrics, status_text)
        said = [t for t in dms(rt, "alice") if f"Run #{rid} (recipe digits) stopped" in t]
        assert len(said) == 1, dms(rt, "alice")
        assert "its time limit (Slurm's limit in partition short, 10m)" in said[0], said
        assert f"checkpoint at step {saved}: `/gpu run --resume {rid}`" in said[0], said
        assert not any(f"Run #{rid} was interrupted" in t for t in dms(rt, "alice"))

        again = int(runs.submit(alice, Run(resume=rid)).extra["run_id"])

        def resumed() -> bool:
            raw = Path(str(_run(rt, again).placement.get("status", "/nonexistent")))
            status = parse_status(raw.read_text()) if raw.exists() else None
            return status is not None and status.resumed_from_step == saved

        _until(resumed, "the resumed run went on from the saved step", step)
        with contextlib.suppress(UserError):  # (it may have met its own limit already)
            runs.cancel(alice, Cancel(again))
        _until(lambda: _run(rt, again).finished_at is not None, "the resumed run ended", step)
    finally:
        rt.engine.dispose()
