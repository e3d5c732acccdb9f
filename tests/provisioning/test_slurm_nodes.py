"""Runs larger than one node on the real test cluster (tests/slurm_cluster.py): two nodes of
four fake A100s on this machine (two slurmd, each with its own address on loopback, port
and spool), both in partition `wide`. The bot sees every partition here
(GPUBOT_SLURM_PARTITIONS empty), as a lab's bot would.

`/gpu run --gpus 8 --gpu a100` is one job of two nodes (`--nodes=2 --ntasks-per-node=1
--gres=gpu:a100:4`): its batch script launches one task a node (training.across_nodes),
each the runner with its node's rank, under torchrun's rendezvous on the first node. The
runs execute on CPU (the GPUs are fake), over gloo on loopback.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlmodel import Session, select

from bot.domain.commands import Cancel, Run
from bot.domain.errors import UserError
from bot.faces.runtime import Runtime
from db.models import TrainingRun, UsageInterval
from provisioning.slurm_parse import expand_hostlist
from tests.runtime_helpers import dms
from tests.slurm_cluster import GPUS, PEOPLE, WIDE, SlurmCluster
from tests.slurm_lab import lab_runtime
from training.loop import TrainConfig, train
from training.recipes import load_digits_data
from training.status import parse_status

GUARD_S = 300.0  # a guard against a hang, not a speed assertion
EPOCHS = 4
# Long enough to outlast a node's death being noticed (SlurmdTimeout, 20 s here).
LONG_EPOCHS = 60
# Eight ranks of 8 samples: the 64 samples a step of one process takes (the recipe's
# reference batch), so the two-node run and the one-process yardstick see the same batch.
PER_RANK_BATCH = 8


@pytest.fixture
def nodes_rt(
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
        GPUBOT_SLURM_PARTITIONS="",  # every partition: `wide` holds both nodes
    ) as rt:
        yield rt


def _run(rt: Runtime, rid: int) -> TrainingRun:
    with Session(rt.engine) as s:
        run = s.get(TrainingRun, rid)
        assert run is not None
        return run


def _until(check: Callable[[], bool], what: str, rt: Runtime, shown: object = "") -> None:
    runs = rt.service.runs
    deadline = time.monotonic() + GUARD_S
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within the guard {shown}"
        rt.service.tick()
        runs.poll()
        runs.dispatch()
        time.sleep(0.3)


def _eight(epochs: int) -> Run:
    options = (("epochs", float(epochs)), ("batch-size", float(PER_RANK_BATCH)))
    return Run(recipe="digits", model="A100", gpus=2 * GPUS, options=options)


def test_an_eight_gpu_run_is_one_job_over_both_nodes_and_reaches_one_nodes_accuracy(
    nodes_rt: Runtime, slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    svc = nodes_rt.service
    reply = svc.runs.submit(svc.actor("alice"), _eight(EPOCHS))
    rid = int(reply.extra["run_id"])
    _until(lambda: _run(nodes_rt, rid).finished_at is not None, "the run ended", nodes_rt)
    run = _run(nodes_rt, rid)
    log_text = Path(str(run.placement["log"])).read_text(errors="replace")[-3000:]
    assert run.state == "succeeded", (run.metrics.get("summary"), log_text)
    assert run.placement["partition"] == WIDE and run.placement["slurm_nodes"] == 2
    job = int(run.placement["job"])
    shown = slurm_cluster.command(
        "sacct", "-a", "-X", "-n", "-P", "-j", str(job), "-o", "User,NNodes,NodeList,AllocTRES"
    ).stdout.strip()
    user, nnodes, nodelist, tres = shown.split("|")
    assert (user, nnodes) == (PEOPLE["alice"], "2"), shown
    assert "gres/gpu=8" in tres, shown
    assert set(expand_hostlist(nodelist)) == set(slurm_cluster.nodes), shown

    # One run, one result: node 0's status holds it; node 1 wrote its own beside it.
    head = parse_status(Path(str(run.placement["status"])).read_text())
    assert head is not None and head.state == "done" and head.world_size == 2 * GPUS
    other = Path(str(run.placement["status"])).with_name("status.node1.json")
    assert other.exists(), list(other.parent.iterdir())
    [result] = [t for t in dms(nodes_rt, "alice") if f"Run #{rid} (recipe digits) finished" in t]
    found = re.search(r"test_accuracy (\d+\.\d+)%", result)
    assert found is not None, result

    # Metered on both nodes: eight GPUs, four on each.
    with Session(nodes_rt.engine) as s:
        spans = list(s.exec(select(UsageInterval).where(UsageInterval.run_id == rid)))
    assert len(spans) == 2 * GPUS and len({iv.host_id for iv in spans}) == 2

    # The yardstick: the same recipe in one process, the same 64 samples a step (the
    # runner's code and torch wheel): only the order of float additions differs.
    one = train(
        TrainConfig(
            recipe="digits",
            device="cpu",
            seed=0,
            epochs=EPOCHS,
            effective_batch=PER_RANK_BATCH * 2 * GPUS,
            status_file=tmp_path / "one.json",
            verbose=False,
        )
    )
    one_sample = 1 / len(load_digits_data().test_y)
    two = float(head.metrics["test_accuracy"])
    assert abs(two - float(one.metrics["test_accuracy"])) <= one_sample + 1e-9, (two, one.metrics)


def test_a_run_too_large_for_the_cluster_is_refused_with_what_it_holds(nodes_rt: Runtime) -> None:
    svc = nodes_rt.service
    with pytest.raises(UserError, match="split evenly"):
        svc.runs.submit(svc.actor("alice"), Run(recipe="digits", model="A100", gpus=12))


def test_a_node_that_dies_mid_run_is_named_and_a_run_that_checkpoints_is_requeued(
    nodes_rt: Runtime, slurm_cluster: SlurmCluster
) -> None:
    """The second node's slurmd is killed (SIGKILL, as a node that dies) while an 8-GPU
    recipe run makes steps on both: slurmctld declares the node down after SlurmdTimeout,
    the job ends NODE_FAIL and, submitted requeueable (a recipe checkpoints), goes back in
    Slurm's queue under the same id. Its owner is told which node failed; the GPUs are
    metered no more while it waits; once the node is back, the run resumes from its
    checkpoint (the live node's runners got SIGTERM and saved it) and finishes as one run
    with one result DM."""
    svc = nodes_rt.service
    rid = int(svc.runs.submit(svc.actor("alice"), _eight(LONG_EPOCHS)).extra["run_id"])

    def stepped() -> bool:
        run = _run(nodes_rt, rid)
        return run.state == "running" and int(run.metrics.get("step") or 0) >= 2

    _until(stepped, "the run started and made steps", nodes_rt)
    job = int(_run(nodes_rt, rid).placement["job"])
    slurm_cluster.kill_node(slurm_cluster.second)

    def told() -> list[str]:
        return [t for t in dms(nodes_rt, "alice") if "put back in the cluster's queue" in t]

    _until(lambda: bool(told()), "the run put back in Slurm's queue", nodes_rt)
    [said] = told()
    assert f"node {slurm_cluster.second} failed (NODE_FAIL)" in said, said
    assert f"Slurm requeued job {job}" in said, said
    back = _run(nodes_rt, rid)
    assert back.state == "starting" and back.placement["job"] == job, back.placement
    with Session(nodes_rt.engine) as s:
        spans = list(s.exec(select(UsageInterval).where(UsageInterval.run_id == rid)))
    assert len(spans) == 2 * GPUS and all(iv.ended_at is not None for iv in spans)

    slurm_cluster.repair()  # the node comes back (ReturnToService=2)
    _until(lambda: _run(nodes_rt, rid).finished_at is not None, "the run ended", nodes_rt)
    run = _run(nodes_rt, rid)
    log_text = Path(str(run.placement["log"])).read_text(errors="replace")[-3000:]
    assert run.state == "succeeded", (run.metrics.get("summary"), log_text)
    assert run.placement["job"] == job  # the same job, its second start
    final = parse_status(Path(str(run.placement["status"])).read_text())
    assert final is not None and final.state == "done" and final.world_size == 2 * GPUS
    assert final.resumed_from_step is not None and final.resumed_from_step > 0, final
    assert sum(f"Run #{rid} (recipe digits) finished" in t for t in dms(nodes_rt, "alice")) == 1
    attempts = slurm_cluster.command(
        "sacct", "-a", "-X", "-D", "-n", "-P", "-j", str(job), "-o", "State,NodeList"
    ).stdout.split()
    assert attempts[0].startswith("NODE_FAIL") and attempts[-1].startswith("COMPLETED"), attempts


def test_a_cancelled_run_over_two_nodes_stops_on_both_and_leaves_nothing(
    nodes_rt: Runtime, slurm_cluster: SlurmCluster
) -> None:
    """`/gpu cancel` of a run over both nodes: SIGTERM reaches the batch script (srun,
    which forwards it) and every node's runner; they stop on the same step, rank 0 saves
    the checkpoint, and the job ends. One DM, the GPUs unmetered on both nodes, and no
    runner left on either node."""
    svc = nodes_rt.service
    alice = svc.actor("alice")
    rid = int(svc.runs.submit(alice, _eight(LONG_EPOCHS)).extra["run_id"])

    def stepped() -> bool:
        run = _run(nodes_rt, rid)
        return run.state == "running" and int(run.metrics.get("step") or 0) >= 2

    _until(stepped, "the run started and made steps", nodes_rt)
    run_dir = str(Path(str(_run(nodes_rt, rid).placement["status"])).parent)
    assert f"run #{rid}" in svc.runs.cancel(alice, Cancel(rid)).view.text.lower()
    _until(lambda: _run(nodes_rt, rid).finished_at is not None, "the run ended", nodes_rt)
    run = _run(nodes_rt, rid)
    assert run.state == "cancelled", run.metrics.get("summary")
    final = parse_status(Path(str(run.placement["status"])).read_text())
    log_text = Path(str(run.placement["log"])).read_text(errors="replace")[-4000:]
    # Stopped on the same step everywhere, checkpointed: resumable with --resume.
    assert final is not None and final.state == "preempted", (final, log_text)
    assert sum(f"Run #{rid}" in t and "cancel" in t.lower() for t in dms(nodes_rt, "alice")) == 1
    with Session(nodes_rt.engine) as s:
        spans = list(s.exec(select(UsageInterval).where(UsageInterval.run_id == rid)))
    assert len(spans) == 2 * GPUS and all(iv.ended_at is not None for iv in spans)

    def left() -> list[str]:
        found = subprocess.run(
            ["pgrep", "-af", "training.runner"], capture_output=True, text=True, check=False
        )
        return [ln for ln in found.stdout.splitlines() if run_dir in ln]

    _until(lambda: not left(), "no runner of the run left on either node", nodes_rt, left)
