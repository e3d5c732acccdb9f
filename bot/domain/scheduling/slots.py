"""The warm fleet as slots with GPUs free over time, for placement and provisioning alike.

A slot is an instance as one decision sees it (free GPUs now, when it comes free, how
long it is paid for); a profile is its free GPUs as a step function of time, from the
runs' estimated ends. Both the EASY reservation and the provisioning wait estimate read
them, so they live below both.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from bot.domain.scheduling.model import FleetInstance, QueuedRun, SchedulerConfig, split_hosts


class Slot:
    """Mutable view of one instance during a decision."""

    __slots__ = (
        "free",
        "gpus",
        "horizon",
        "inst",
        "pinned",
        "placed",
        "ready",
        "ref",
        "type_name",
        "usd_hr",
    )

    def __init__(
        self,
        inst: FleetInstance | None,
        ref: str,
        gpus: int,
        ready: float,
        usd_hr: float,
        type_name: str,
        free: int,
        horizon: float,
    ) -> None:
        self.inst = inst
        self.ref = ref
        self.gpus = gpus
        self.ready = ready
        self.usd_hr = usd_hr
        self.type_name = type_name
        self.free = free
        self.horizon = horizon  # latest expected end of what it holds
        self.placed: list[tuple[float, int]] = []  # (end, GPUs) placed in this decision
        # holds a run that cannot be moved, so consolidation can never empty it
        self.pinned = inst is not None and inst.pinned


def free_profile(
    inst: FleetInstance, config: SchedulerConfig, now: float
) -> list[tuple[float, int]]:
    """(time, free GPUs from then on) steps from the allocations' expected ends."""
    free = inst.free_gpus
    start = max(now, inst.ready_at_s)
    steps = [(start, free)]
    rel: Iterable[tuple[float, int]] = inst.releases
    if inst.unknown_end_gpus:
        rel = sorted([*rel, (now + config.unknown_duration_s, inst.unknown_end_gpus)])
    for end, g in rel:
        free += g
        if end <= start:
            steps[-1] = (start, free)
        elif steps[-1][0] == end:
            steps[-1] = (end, free)
        else:
            steps.append((end, free))
    return steps


def earliest_start(profile: list[tuple[float, int]], need: int, dur: float) -> float:
    """Earliest t with free >= need during [t, t + dur) on a step profile."""
    n = len(profile)
    for i in range(n):
        t, f = profile[i]
        if f < need:
            continue
        ok = True
        for j in range(i + 1, n):
            tj, fj = profile[j]
            if tj >= t + dur:
                break
            if fj < need:
                ok = False
                break
        if ok:
            return t
    return math.inf


def reserve_profile(profile: list[tuple[float, int]], t0: float, t1: float, need: int) -> None:
    """Takes `need` GPUs off the profile during [t0, t1)."""
    times = [p[0] for p in profile]
    for t in (t0, t1):
        if t == math.inf or t in times:
            continue
        prev = max((p for p in profile if p[0] < t), key=lambda p: p[0], default=None)
        profile.append((t, prev[1] if prev else 0))
        times.append(t)
    profile.sort()
    for i, (t, f) in enumerate(profile):
        if t0 <= t < t1:
            profile[i] = (t, f - need)


def hosts_for(run: QueuedRun, group: list[Slot]) -> tuple[int, int]:
    """(k, per-host GPUs) on instances of the group's largest size."""
    biggest = 0
    for s in group:
        if s.gpus > biggest:
            biggest = s.gpus
    if biggest <= 0:
        return 0, 0
    if run.gpus <= biggest:
        return 1, run.gpus
    k = split_hosts(run.gpus, biggest)
    return k, run.gpus // k
