"""`GPUBOT_PROVIDER=slurm` against the machine's real one-node Slurm (tests/slurm_cluster.py:
four fake A100s, partitions gpu and short): status shows the cluster, a reservation is a
holding job that Slurm runs and release ends, extend raises its limit, a run is a batch
job whose result DM says its accuracy, a controller that stops answering is one line in
status and loses nothing.

The runs use the bot's own interpreter for the cluster's Python (the shortcut every
loopback host test takes); `bench/slurm.py` and docs/SLURM.md cover the real bootstrap
into the work directory. Runs execute on CPU: the GPUs are fake.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlmodel import Session, select

from bot.app.config import load_settings
from bot.app.remote import PreparedHost
from bot.domain.commands import Cancel, Extend, Logs, Queue, Release, Reserve, Run, Status
from bot.domain.errors import UserError
from bot.faces.runtime import Runtime, build_runtime
from db.models import Reservation, TrainingRun
from provisioning.ssh import SshRunner, SshTarget
from tests.runtime_helpers import dms
from tests.slurm_cluster import SlurmCluster

GUARD_S = 240.0  # a guard against a hang, not a speed assertion


@pytest.fixture
def slurm_rt(
    slurm_cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Runtime]:
    monkeypatch.setenv("GPUBOT_PROVIDER", "slurm")
    monkeypatch.setenv("GPUBOT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    workdir = tmp_path / "shared"
    workdir.mkdir()
    monkeypatch.setenv("GPUBOT_SLURM_WORKDIR", str(workdir))
    monkeypatch.setenv("GPUBOT_SLURM_RATES", "A100=2.00")
    monkeypatch.setenv("GPUBOT_SLURM_CACHE_S", "0.5")

    def prepare(runner: SshRunner, target: SshTarget) -> PreparedHost:
        # A shortcut: the bot's interpreter is this machine's, which is the node.
        return PreparedHost(root=str(workdir / "env"), python=sys.executable)

    rt = build_runtime(load_settings(), prepare=prepare)
    try:
        yield rt
    finally:
        rt.engine.dispose()


def _squeue(cluster: SlurmCluster) -> str:
    return cluster.command("squeue", "--noheader", "-o", "%i %j %T %b").stdout


def _until(check: Callable[[], bool], what: str, tick: Callable[[], object]) -> None:
    deadline = time.monotonic() + GUARD_S
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within the guard"
        tick()
        time.sleep(0.3)


def test_status_shows_the_clusters_gpus(slurm_rt: Runtime) -> None:
    view = slurm_rt.service.status(slurm_rt.service.actor("alice"), Status()).view
    assert view.text == "4 of 4 free on 1 host"
    line = next(str(b) for b in view.blocks if "slurm" in str(b) and "*" in str(b))
    assert "Slurm: idle, 0 of 4 GPUs allocated" in line
    assert "A100" in str(view.blocks)


def test_a_reservation_is_a_holding_job_that_release_ends(
    slurm_rt: Runtime, slurm_cluster: SlurmCluster
) -> None:
    svc = slurm_rt.service
    alice = svc.actor("alice")
    first = svc.reserve(alice, Reserve(2, "A100")).view
    assert first.text.startswith("Reserved: reservation #1, GPUs "), first.text
    with Session(slurm_rt.engine) as s:
        job = s.exec(select(Reservation)).one().external["job"]
    # How to use them: a shell inside the holding job's allocation.
    assert f"srun --jobid {job} --overlap --pty bash" in str(first.blocks)
    assert re.search(rf"^{job} gpubot-res-1 RUNNING gres:gpu:a100:2", _squeue(slurm_cluster), re.M)
    assert "Reserved" in svc.reserve(alice, Reserve(1, "A100")).view.text  # a second job
    status = svc.status(alice, Status()).view.text
    assert status.startswith("1 of 4 free"), status  # 2 held by #1, 1 by #2
    svc.release(alice, Release(all=True))
    _until(lambda: "gpubot-res" not in _squeue(slurm_cluster), "holding jobs end", svc.tick)


def test_a_reservation_that_pends_says_why_and_is_granted_when_slurm_runs_it(
    slurm_rt: Runtime, slurm_cluster: SlurmCluster
) -> None:
    svc = slurm_rt.service
    alice, bob = svc.actor("alice"), svc.actor("bob")
    assert "Reserved" in svc.reserve(alice, Reserve(4, "A100")).view.text
    waiting = svc.reserve(bob, Reserve(2, "A100")).view.text
    assert "is waiting" in waiting and "Slurm job" in waiting and "pends (" in waiting, waiting
    svc.release(alice, Release(all=True))
    _until(
        lambda: any("Your turn: granted: reservation #2" in t for t in dms(slurm_rt, "bob")),
        "bob's reservation granted",
        svc.tick,
    )


def test_extend_raises_the_holding_jobs_limit(
    slurm_rt: Runtime, slurm_cluster: SlurmCluster
) -> None:
    svc = slurm_rt.service
    alice = svc.actor("alice")
    svc.reserve(alice, Reserve(1, "A100"))
    with Session(slurm_rt.engine) as s:
        job = s.exec(select(Reservation)).one().external["job"]
    assert "extended by 1h" in svc.extend(alice, Extend(timedelta(hours=1))).view.text
    limit = slurm_cluster.command("squeue", "--noheader", "-j", str(job), "-o", "%l").stdout
    assert limit.strip() == "3:00:00", limit  # the default 2 h and one more


def test_a_request_slurm_refuses_is_said_in_words(slurm_rt: Runtime) -> None:
    with pytest.raises(UserError) as refused:
        slurm_rt.service.reserve(slurm_rt.service.actor("alice"), Reserve(8, "A100"))
    assert "the most on one host is 4" in refused.value.text or "8 A100" in refused.value.text


def test_a_controller_that_stops_answering_is_one_line_and_loses_nothing(
    slurm_rt: Runtime, slurm_cluster: SlurmCluster
) -> None:
    svc = slurm_rt.service
    alice = svc.actor("alice")
    with slurm_cluster.controller_down():
        time.sleep(0.6)  # past the cache
        status = svc.status(alice, Status()).view
        said = [str(b) for b in status.blocks if "not answering" in str(b)]
        assert said and "The Slurm controller is not answering" in said[0]
        reply = svc.reserve(alice, Reserve(1, "A100")).view.text
        assert "controller is not answering" in reply and "#1" in reply, reply
    _until(
        lambda: any("Your turn: granted: reservation #1" in t for t in dms(slurm_rt, "alice")),
        "the waiting reservation submitted and granted once the controller answers",
        svc.tick,
    )


def test_a_digits_run_is_a_batch_job_whose_result_dm_says_its_accuracy(
    slurm_rt: Runtime, slurm_cluster: SlurmCluster
) -> None:
    svc = slurm_rt.service
    runs = svc.runs
    assert runs is not None
    alice = svc.actor("alice")
    rid = int(runs.submit(alice, Run(recipe="digits", model="A100")).extra["run_id"])

    def step() -> None:
        svc.tick()
        runs.poll()
        runs.dispatch()

    def finished() -> bool:
        with Session(slurm_rt.engine) as s:
            run = s.get(TrainingRun, rid)
            return run is not None and run.finished_at is not None

    _until(finished, "the digits run finished", step)
    with Session(slurm_rt.engine) as s:
        run = s.get(TrainingRun, rid)
        assert run is not None
        assert run.state == "succeeded", run.metrics
        assert isinstance(run.placement.get("job"), int)
    [result] = [t for t in dms(slurm_rt, "alice") if f"Run #{rid} (recipe digits) finished" in t]
    accuracy = float(re.search(r"test_accuracy (\d+\.\d+)%", result).group(1))  # type: ignore[union-attr]
    assert accuracy >= 95.0, result
    assert "GPU-hours" in result


def test_a_run_that_pends_in_slurm_is_queued_there_and_cancel_ends_its_job(
    slurm_rt: Runtime, slurm_cluster: SlurmCluster
) -> None:
    """The verbs around a run on a cluster: /gpu queue says where it waits (Slurm's queue,
    and why), /gpu logs answers before it has a log, /gpu cancel scancels its batch job,
    and /gpu cost bills the reservation that held the GPUs at the configured rate."""
    svc = slurm_rt.service
    runs = svc.runs
    assert runs is not None
    alice, bob = svc.actor("alice"), svc.actor("bob")
    assert "Reserved" in svc.reserve(alice, Reserve(4, "A100")).view.text
    rid = int(runs.submit(bob, Run(recipe="digits", model="A100")).extra["run_id"])

    def step() -> None:
        svc.tick()
        runs.poll()
        runs.dispatch()

    def job() -> int | None:
        with Session(slurm_rt.engine) as s:
            run = s.get(TrainingRun, rid)
            assert run is not None
            found = run.placement.get("job")
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

    def ended() -> bool:
        with Session(slurm_rt.engine) as s:
            run = s.get(TrainingRun, rid)
            return run is not None and run.state == "cancelled"

    _until(ended, "the run cancelled", step)
    svc.release(alice, Release(all=True))
    _, costs, _ = svc.costs("today", "alice")
    assert costs["alice"] > 0, costs  # 4 A100s at $2.00 an hour, for as long as they were held
    assert "bob" not in svc.costs("today", "bob")[1]  # the run never ran: nothing billed
