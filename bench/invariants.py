"""What must hold in the bot's database after any schedule of faults (issue 39).

The fault campaign (still to come: `bench --only chaos`) ends each run by calling
`check` on the campaign's database, and prints a line per invariant. The checks read the
database only, or compare it with what the caller read from outside: the instances moto
lists, the Slurm jobs squeue lists, the processes left on each host. So a database kept
from a campaign (`GPUBOT_CHAOS_KEEP`) can be checked again by anyone, and each check is
tested on its own (tests/test_invariants.py) against a database that breaks it on
purpose.

Each check returns the broken cases, in words, at most `SHOWN` of them: empty means it
holds.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from db.models import (
    RES_ACTIVE,
    RUN_CANCELLED,
    RUN_FAILED,
    RUN_ON_HOST,
    RUN_SUCCEEDED,
    Host,
    Notification,
    Reservation,
    TrainingRun,
    UsageInterval,
)

SHOWN = 10
_ENDED = (RUN_SUCCEEDED, RUN_FAILED, RUN_CANCELLED)
_KEY = re.compile(r"^(run-finished|run-started|granted):(\d+)$")


@dataclass
class Report:
    """Invariant name -> the cases that break it (empty: it holds)."""

    broken: dict[str, list[str]] = field(default_factory=dict)

    @property
    def held(self) -> dict[str, bool]:
        return {name: not cases for name, cases in self.broken.items()}

    def lines(self) -> list[str]:
        out = []
        for name, cases in self.broken.items():
            out.append(f"{name}: {'held' if not cases else 'BROKEN'}")
            out.extend(f"  {case}" for case in cases[:SHOWN])
        return out


def _notified(s: Session) -> dict[str, dict[int, list[Notification]]]:
    """The outbox's DMs that say a run ended or started, or a reservation was granted, by
    kind and id (their dedupe keys)."""
    found: dict[str, dict[int, list[Notification]]] = defaultdict(lambda: defaultdict(list))
    for n in s.exec(select(Notification).where(col(Notification.dedupe_key).is_not(None))):
        m = _KEY.match(n.dedupe_key or "")
        if m is not None:
            found[m.group(1)][int(m.group(2))].append(n)
    return found


def runs_ended_once(s: Session) -> list[str]:
    """Every run that held GPUs and ended has exactly one result DM; no run that has not
    ended has one. (A run cancelled while still in line held nothing and gets none.)"""
    results = _notified(s)["run-finished"]
    held = set(s.exec(select(UsageInterval.run_id).where(col(UsageInterval.run_id).is_not(None))))
    broken = []
    for run in s.exec(select(TrainingRun).order_by(col(TrainingRun.id))):
        assert run.id is not None
        dms = len(results.get(run.id, ()))
        if run.state in _ENDED:
            if run.id in held and dms != 1:
                broken.append(f"run {run.id} ({run.state}) has {dms} result DMs")
        elif dms:
            broken.append(f"run {run.id} is {run.state} but its result DM was sent")
    return broken


def no_gpu_twice(s: Session) -> list[str]:
    """No GPU was held by two reservations or runs at once: its usage intervals, in time
    order, never overlap (an open one lasts until now)."""
    by_gpu: dict[int, list[UsageInterval]] = defaultdict(list)
    for iv in s.exec(select(UsageInterval).order_by(col(UsageInterval.started_at))):
        by_gpu[iv.gpu_id].append(iv)
    broken = []
    for gpu_id, intervals in sorted(by_gpu.items()):
        # The interval that holds the GPU longest so far: any later start before its end
        # overlaps it.
        holder: UsageInterval | None = None
        for iv in intervals:
            if holder is not None and (holder.ended_at is None or holder.ended_at > iv.started_at):
                broken.append(
                    f"GPU {gpu_id}: interval {holder.id} ({_owner(holder)}) still held when "
                    f"interval {iv.id} ({_owner(iv)}) began at {iv.started_at:%Y-%m-%d %H:%M:%S}"
                )
            if holder is None or (
                holder.ended_at is not None
                and (iv.ended_at is None or iv.ended_at > holder.ended_at)
            ):
                holder = iv
    return broken


def _owner(iv: UsageInterval) -> str:
    return f"run {iv.run_id}" if iv.run_id is not None else f"reservation {iv.reservation_id}"


def intervals_closed_or_live(s: Session) -> list[str]:
    """Every open usage interval belongs to something live: an active reservation or a
    run on its host (starting, running, cancelling)."""
    broken = []
    for iv in s.exec(select(UsageInterval).where(col(UsageInterval.ended_at).is_(None))):
        if iv.run_id is not None:
            run = s.get(TrainingRun, iv.run_id)
            if run is None or run.state not in RUN_ON_HOST:
                broken.append(f"interval {iv.id} is open for run {iv.run_id} ({_state(run)})")
        elif iv.reservation_id is not None:
            res = s.get(Reservation, iv.reservation_id)
            if res is None or res.state != RES_ACTIVE:
                broken.append(
                    f"interval {iv.id} is open for reservation {iv.reservation_id} ({_state(res)})"
                )
        else:
            broken.append(f"interval {iv.id} is open and belongs to nothing")
    return broken


def _state(row: TrainingRun | Reservation | None) -> str:
    return "gone" if row is None else row.state


def told_as_recorded(s: Session) -> list[str]:
    """Nothing a person was told contradicts the database: a run said "started" held
    GPUs; a result DM says how the run ended as its row does; a reservation said
    "granted" held GPUs."""
    told = _notified(s)
    broken = []
    held_runs = set(
        s.exec(select(UsageInterval.run_id).where(col(UsageInterval.run_id).is_not(None)))
    )
    held_res = set(
        s.exec(
            select(UsageInterval.reservation_id).where(
                col(UsageInterval.reservation_id).is_not(None)
            )
        )
    )
    for run_id in sorted(told["run-started"]):
        if run_id not in held_runs:
            broken.append(f"run {run_id} was said started but never held a GPU")
    for res_id in sorted(told["granted"]):
        if res_id not in held_res:
            broken.append(f"reservation {res_id} was said granted but never held a GPU")
    for run_id, dms in sorted(told["run-finished"].items()):
        run = s.get(TrainingRun, run_id)
        said = _ending_said(dms[0].text, run_id)
        if run is None or said != run.state:
            broken.append(f"run {run_id}'s result DM says {said}; its row says {_state(run)}")
    return broken


def _ending_said(text: str, run_id: int) -> str:
    """How a result DM (bot.app.watching.runwatch.result_view) says the run ended."""
    head = text.split("\n", 1)[0]
    label = re.escape(f"Run #{run_id} (")
    if re.search(label + r".*\) was cancelled", head):
        return RUN_CANCELLED
    if re.search(label + r".*\) finished", head):
        return RUN_SUCCEEDED
    return RUN_FAILED


def nothing_unknown(kind: str, outside: Collection[str], known: Collection[str]) -> list[str]:
    """What the bot's own place lists (moto's instances tagged the bot's, Slurm's jobs
    named the bot's) that the database does not know: bought or submitted, then lost."""
    return [f"{kind} {name} is not in the database" for name in sorted(set(outside) - set(known))]


def known_instances(s: Session) -> set[str]:
    return {i for i in s.exec(select(Host.instance_id)) if i is not None}


def known_slurm_jobs(s: Session) -> set[str]:
    """Every job id the database names: a run's placement's `job` (an array task's is its
    array's), a reservation's holding job (`external`)."""
    jobs: set[str] = set()
    for placement in s.exec(select(TrainingRun.placement)):
        if (placement or {}).get("job") is not None:
            jobs.add(str(placement["job"]))
    for external in s.exec(select(Reservation.external)):
        if (external or {}).get("job") is not None:
            jobs.add(str(external["job"]))
    return jobs


def no_process_of_an_ended_run(
    s: Session, alive_groups: Mapping[str, Collection[int]]
) -> list[str]:
    """No process group of an ended run is still alive on its host. `alive_groups`: each
    host's live process-group ids, as the caller read them there."""
    broken = []
    for run in s.exec(select(TrainingRun).where(col(TrainingRun.state).in_(_ENDED))):
        nodes = [run.placement, *run.placement.get("nodes", [])[1:]]
        for node in nodes:
            host, pgid = node.get("host"), node.get("pgid")
            if host is not None and pgid is not None and pgid in alive_groups.get(str(host), ()):
                broken.append(f"run {run.id} ({run.state}) still has group {pgid} on {host}")
    return broken


def check(
    engine: Engine,
    *,
    instances: Collection[str] | None = None,
    slurm_jobs: Collection[str] | None = None,
    alive_groups: Mapping[str, Collection[int]] | None = None,
) -> Report:
    """Every invariant the database and what the caller read from outside allow; one
    that needs an outside reading the caller did not give is left out of the report."""
    report = Report()
    with Session(engine) as s:
        report.broken["runs_ended_once"] = runs_ended_once(s)
        report.broken["no_gpu_twice"] = no_gpu_twice(s)
        report.broken["intervals_closed_or_live"] = intervals_closed_or_live(s)
        report.broken["told_as_recorded"] = told_as_recorded(s)
        if instances is not None:
            report.broken["no_unknown_instance"] = nothing_unknown(
                "instance", instances, known_instances(s)
            )
        if slurm_jobs is not None:
            report.broken["no_unknown_slurm_job"] = nothing_unknown(
                "Slurm job", slurm_jobs, known_slurm_jobs(s)
            )
        if alive_groups is not None:
            report.broken["no_process_of_an_ended_run"] = no_process_of_an_ended_run(
                s, alive_groups
            )
    return report
