"""A sweep on the real test cluster (tests/slurm_cluster.py) is one Slurm job array.

`/gpu run --recipe digits --sweep lr=…` of six values is one `sbatch --array=0-5%2`: two
runs at most at once (the person's share of the partition's four GPUs, split between the
lab's two people), one line in `/gpu queue`, cancelled as one (one scancel for the tasks
that run, one for those that wait), and the same comparison table in the owner's DM as on
hosts. A cluster whose MaxSubmitJobs the sweep would exceed refuses it as one, in words.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session, col, select

from bot.domain.commands import Cancel, Queue, Run
from bot.faces.runtime import Runtime
from db.models import Notification, TrainingRun
from provisioning.slurm import SlurmClient
from tests.slurm_cluster import PEOPLE, SlurmCluster
from tests.slurm_lab import lab_runtime

GUARD_S = 420.0  # a guard against a hang, not a speed assertion
VALUES = (1e-3, 2e-3, 3e-3, 5e-3, 8e-3, 1e-2)
# Long enough that the second pair still runs when the sweep is cancelled.
EPOCHS = 40


@pytest.fixture
def sweep_rt(
    slurm_cluster: SlurmCluster,
    lab_workdir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Runtime]:
    with lab_runtime(slurm_cluster, lab_workdir, tmp_path / "home", monkeypatch) as rt:
        yield rt


def _runs(rt: Runtime, ids: list[int]) -> list[TrainingRun]:
    with Session(rt.engine) as s:
        return list(
            s.exec(
                select(TrainingRun)
                .where(col(TrainingRun.id).in_(ids))
                .order_by(col(TrainingRun.id))
            )
        )


def _tasks(cluster: SlurmCluster, array: int) -> dict[str, str]:
    """The array's tasks as Slurm lists them now ("12_3" → RUNNING), pending ones apart."""
    shown = cluster.command("squeue", "-h", "-r", "-j", str(array), "-o", "%i %T")
    out: dict[str, str] = {}
    for line in shown.stdout.splitlines():
        ref, _, state = line.partition(" ")
        out[ref] = state.strip()
    return out


def _until(
    check: Callable[[], bool], what: str, rt: Runtime, each: Callable[[], None] = lambda: None
) -> None:
    runs = rt.service.runs
    deadline = time.monotonic() + GUARD_S
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within the guard"
        rt.service.tick()
        runs.poll()
        runs.dispatch()
        each()
        time.sleep(0.3)


def _sweep(values: tuple[float, ...], epochs: int) -> Run:
    return Run(
        recipe="digits",
        model="A100",
        gpus=1,
        options=(("epochs", float(epochs)),),
        sweep=("lr", values),
    )


def test_a_sweep_is_one_array_two_at_a_time_one_queue_line_cancelled_as_one(
    sweep_rt: Runtime, slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    svc = sweep_rt.service
    alice = svc.actor("alice")
    reply = svc.runs.submit(alice, _sweep(VALUES, EPOCHS))
    ids = [int(i) for i in reply.extra["run_ids"]]
    label = str(_runs(sweep_rt, ids)[0].sweep)
    _until(lambda: all("job" in r.placement for r in _runs(sweep_rt, ids)), "submitted", sweep_rt)

    # One submission: every run is a task of one array, in order, two at most at once.
    runs = _runs(sweep_rt, ids)
    arrays = {int(r.placement["job"]) for r in runs}
    assert len(arrays) == 1, [r.placement for r in runs]
    array = arrays.pop()
    assert [r.placement["array_task"] for r in runs] == list(range(len(VALUES)))
    assert {r.placement["array_running"] for r in runs} == {2}  # 4 GPUs / 2 people / 1 GPU
    shown = slurm_cluster.command(
        "squeue", "-h", "-r", "-j", str(array), "-o", "%i|%u|%j"
    ).stdout.split()
    assert len(shown) == len(VALUES), shown
    assert all(line.endswith(f"|{PEOPLE['alice']}|gpubot-sweep-{ids[0]}") for line in shown), shown

    # A worker that died between the submission and recording it: each run's task is
    # found again from the array's script, not submitted twice.
    claim = {k: runs[3].placement[k] for k in ("dir", "status", "log", "checkpoints")}
    found = svc.runs.ctx.executor.orphan(claim)
    assert isinstance(found, dict), found
    assert (found["job"], found["array_task"], found["as"]) == (array, 3, PEOPLE["alice"])

    most = 0
    samples: list[dict[str, str]] = []

    def sample() -> None:
        nonlocal most
        tasks = _tasks(slurm_cluster, array)
        samples.append(tasks)
        most = max(most, sum(1 for s in tasks.values() if s == "RUNNING"))

    # One line in /gpu queue for the six, with their states.
    _until(
        lambda: sum(r.state == "running" for r in _runs(sweep_rt, ids)) == 2,
        "two running",
        sweep_rt,
        sample,
    )
    board = svc.runs.queue(alice, Queue()).view
    lines = [str(row) for b in board.blocks for row in getattr(b, "rows", ())]
    assert len(lines) == 1 and f"sweep {label}" in lines[0], lines
    assert f"Slurm array {array}: 2 running, 4 waiting, 0 ended" in lines[0], lines
    assert "at most 2 of its 6 runs at once" in lines[0], lines

    # The first pair ends; the next pair starts; Slurm never runs more than two.
    _until(
        lambda: (
            sum(r.state == "succeeded" for r in _runs(sweep_rt, ids)) >= 2
            and any(r.state == "running" for r in _runs(sweep_rt, ids))
        ),
        "the first pair done and the next running",
        sweep_rt,
        sample,
    )

    # Cancelled as one: one scancel for the waiting tasks, one for the running ones.
    calls: list[tuple[Any, ...]] = []
    real_cancel = SlurmClient.cancel

    def counted(self: SlurmClient, job_id: int, *args: Any, **kw: Any) -> None:
        calls.append((job_id, kw.get("signal"), kw.get("task")))
        real_cancel(self, job_id, *args, **kw)

    monkeypatch.setattr(SlurmClient, "cancel", counted)
    said = svc.runs.cancel(alice, Cancel(sweep=label)).view.text
    assert f"Sweep {label}:" in said and "stopping" in said, said
    _until(
        lambda: all(r.finished_at is not None for r in _runs(sweep_rt, ids)),
        "every run of the sweep ended",
        sweep_rt,
        sample,
    )
    assert most == 2, f"at most two tasks ran at once, saw {most}: {samples[-5:]}"
    # The waiting tasks first (none starts meanwhile), then SIGTERM to the running ones.
    assert calls == [(array, None, None), (array, "TERM", None)], calls
    final = _runs(sweep_rt, ids)
    states = [r.state for r in final]
    assert states.count("succeeded") >= 2 and "failed" not in states, states
    assert set(states) <= {"succeeded", "cancelled"}, states
    left = _tasks(slurm_cluster, array)
    assert not any(s in ("RUNNING", "PENDING") for s in left.values()), left

    # The sweep's table, once, as on hosts: every variant with its lr.
    with Session(sweep_rt.engine) as s:
        tables = [
            n
            for n in s.exec(
                select(Notification).where(
                    Notification.kind == "dm", Notification.target == "alice"
                )
            )
            if n.text.startswith(f"Sweep {label}")
        ]
    assert len(tables) == 1, [t.text for t in tables]
    assert f"{len(VALUES)} variants done. Best: run #" in tables[0].text, tables[0].text
    shown_view = str(tables[0].view)
    for rid, value in zip(ids, VALUES, strict=True):
        assert f"#{rid}" in shown_view and f"{value:g}" in shown_view, shown_view


def test_a_sweep_the_clusters_submit_limit_refuses_fails_as_one_in_words(
    sweep_rt: Runtime, slurm_cluster: SlurmCluster
) -> None:
    person = PEOPLE["bob"]
    limit = ["sacctmgr", "-i", "modify", "user", "where", f"name={person}", "set"]
    done = slurm_cluster.command(*limit, "MaxSubmitJobs=3")
    assert done.returncode == 0, done.stderr
    try:
        svc = sweep_rt.service
        reply = svc.runs.submit(svc.actor("bob"), _sweep((1e-3, 2e-3, 3e-3, 5e-3), 1))
        ids = [int(i) for i in reply.extra["run_ids"]]
        _until(
            lambda: all(r.finished_at is not None for r in _runs(sweep_rt, ids)),
            "the sweep refused",
            sweep_rt,
        )
        runs = _runs(sweep_rt, ids)
        assert {r.state for r in runs} == {"failed"}, [r.state for r in runs]
        error = str(runs[0].metrics.get("summary", {}).get("error", runs[0].metrics))
        assert "MaxSubmitJobs" in error and "its 4 jobs" in error, error
        gone = slurm_cluster.command("squeue", "-h", "-u", person, "-o", "%i")
        assert not gone.stdout.strip(), gone.stdout
    finally:
        slurm_cluster.command(*limit, "MaxSubmitJobs=-1")
