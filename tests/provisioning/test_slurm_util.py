"""GPU use inside Slurm allocations, on the real test cluster (tests/slurm_cluster.py).

The bot samples each running gpubot job on a node (runs and reservations' holding jobs)
as a step inside it (`srun --jobid N --overlap python -m training.telemetry`). The
cluster's GPUs are fake: a driver tool on every task's PATH (TaskProlog) answers as
nvidia-smi does, showing a step its job's GPUs alone, renumbered from 0, as a cluster
with ConstrainDevices does; tests set what each GPU reports. The bot maps them back to
the node's GPUs, so samples land on the GPUs each job holds."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlmodel import Session, col, select

from bot.app.watching.idle import idle_job
from bot.app.watching.utilization import collect, util_reply
from bot.domain.commands import Release, Reserve, Run
from bot.faces.runtime import Runtime
from db.models import GpuSample, Reservation, TrainingRun
from tests.runtime_helpers import dms
from tests.slurm_cluster import SlurmCluster
from tests.slurm_lab import lab_runtime

GUARD_S = 180.0  # a guard against a hang, not a speed assertion
BUSY = 90


@pytest.fixture
def util_rt(
    slurm_cluster: SlurmCluster,
    lab_workdir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Runtime]:
    with lab_runtime(
        slurm_cluster,
        lab_workdir,
        tmp_path / "home",
        monkeypatch,
        # A sample stands for the cadence (its span): this test samples once a loop,
        # and a loaded machine's loop (two srun steps) took 3-5 s, which left 1-s
        # samples too sparse to cover any window (seen: 270 idle samples, no prompt).
        GPUBOT_UTIL_SAMPLE_SECONDS="6",
        GPUBOT_IDLE_WINDOW="12s",  # idle for 12 s of samples: asked Keep/Release
        GPUBOT_IDLE_GRACE="1h",  # never released without the holder here
    ) as rt:
        yield rt


def _until(
    check: Callable[[], bool], what: str, rt: Runtime, shown: Callable[[], object] = str
) -> None:
    deadline = time.monotonic() + GUARD_S
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within the guard {shown()}"
        rt.service.tick()
        rt.service.runs.poll()
        rt.service.runs.dispatch()
        collect(rt.service)
        idle_job(rt.service)
        time.sleep(0.5)


def _squeue(cluster: SlurmCluster) -> str:
    return cluster.command("squeue", "-h", "-o", "%i %j %T").stdout


def test_samples_land_on_each_jobs_gpus_and_an_idle_reservation_is_released_on_its_answer(
    util_rt: Runtime, slurm_cluster: SlurmCluster
) -> None:
    """bob's run holds GPU 0 and works (90%); alice's reservation holds GPUs 1 and 2 and
    does nothing. Each job's step sees its own GPUs as 0.. (ConstrainDevices); the
    samples land on the node's GPUs each holds, `/gpu util` shows them, alice is asked
    Keep or Release about her reservation alone, and her Release ends its job."""
    svc = util_rt.service
    alice, bob = svc.actor("alice"), svc.actor("bob")
    node = slurm_cluster.node
    rid = int(svc.runs.submit(bob, Run(command=("sleep", "300"), model="A100")).extra["run_id"])

    def run_gpus() -> list[int]:
        with Session(util_rt.engine) as s:
            run = s.get(TrainingRun, rid)
            assert run is not None
            return list(run.placement.get("gpu_indexes") or []) if run.state == "running" else []

    _until(lambda: bool(run_gpus()), "bob's run running", util_rt)
    [run_gpu] = run_gpus()
    slurm_cluster.set_utilization(node, {run_gpu: BUSY})
    reply = svc.reserve(alice, Reserve(2, "A100", timedelta(minutes=20))).view.text
    assert "Reserved" in reply, reply
    with Session(util_rt.engine) as s:
        [res] = s.exec(select(Reservation).where(Reservation.state == "active")).all()
    assert res.id is not None

    def asked() -> list[str]:
        return [t for t in dms(util_rt, "alice") if f"Reservation #{res.id}" in t and "idle" in t]

    def seen() -> str:
        """What the guard's message says: the jobs, and the samples taken of each."""
        with Session(util_rt.engine) as s:
            taken = list(s.exec(select(GpuSample).order_by(col(GpuSample.at))))
        by: dict[str, list[GpuSample]] = {}
        for x in taken:
            by.setdefault(f"res {x.reservation_id}, run {x.run_id}", []).append(x)
        last = {k: (len(v), str(v[-1].at), v[-1].util_pct) for k, v in by.items()}
        return f"{_squeue(slurm_cluster)} samples (count, last, %): {last}"

    _until(lambda: bool(asked()), "alice asked Keep or Release", util_rt, seen)
    with Session(util_rt.engine) as s:
        samples = list(s.exec(select(GpuSample)))
    held = {x.gpu_index for x in samples if x.reservation_id == res.id}
    assert held and run_gpu not in held and len(held) == 2, samples[-6:]
    ran = [x for x in samples if x.run_id == rid]
    assert ran and {x.gpu_index for x in ran} == {run_gpu}, samples[-6:]
    assert ran[-1].util_pct == BUSY  # (0% in its first samples, before it was set busy)
    assert all(x.util_pct == 0 for x in samples if x.reservation_id == res.id)
    assert not any("idle" in t for t in dms(util_rt, "bob"))  # the working run is not asked

    shown = util_reply(svc, alice, None).view
    # The three GPUs gpubot holds on the node (bob's run's busy, alice's two idle).
    assert "1 of 3 GPUs busy" in shown.text, shown.text
    assert node in str(shown.blocks) and str(BUSY) in str(shown.blocks), shown.blocks

    job = int(res.external["job"])
    said = svc.release(alice, Release(res.id)).view.text
    assert f"#{res.id}" in said, said
    _until(lambda: f"gpubot-res-{res.id}" not in _squeue(slurm_cluster), "its job ended", util_rt)
    state = slurm_cluster.command("sacct", "-a", "-X", "-n", "-P", "-j", str(job), "-o", "State")
    assert state.stdout.strip().startswith("CANCELLED"), state.stdout
