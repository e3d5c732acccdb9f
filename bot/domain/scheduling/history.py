"""Run-time predictions from the team's own finished runs: the scheduler needs no oracle.

Why: neither the worker nor an honest simulation knows how long a run will take (a
user's --max is a limit, often absent). What both know is how long the runs that have
finished took. Following Helios' QSSF (predict a job from the same user's similar jobs)
and Tiresias/Gittins (condition on the service a running job has already attained), a
run's expected length is the mean of the finished runs of its user and size that are
longer than what it has already run, falling back to everybody's when its own are too
few. Heavy tails make this grow as a run goes on: a run still going after an hour is
probably a long one.

A running run's predicted end is stepped, not continuous: its first prediction T0 at
start, and once it outlives that, T1 = the prediction given T0 of attained time, and so
on. The scheduler's inputs then change only at those steps (Tiresias' discretized
priority queues), and the simulator can keep an instance's snapshot between them.

Only runs that ended feed it, so a run's own length is unknown to every decision made
before it ends: the predictions are non-clairvoyant by construction.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

Key = tuple[str, int]  # (user, GPUs)


@dataclass
class _Samples:
    """Sorted durations with prefix sums, for E[D - a | D > a] in O(log n).

    New samples wait in `pending` until they are 1% of those visible (at once while
    there are fewer than a hundred): a query stays a bisect, and the sort and the sums
    are redone about a hundred times per tenfold growth, not on every finished run,
    which would make a long trace quadratic. Deterministic, so the worker and the
    simulator see the same predictions from the same history."""

    sorted_s: list[float] = field(default_factory=list)
    prefix: list[float] = field(default_factory=lambda: [0.0])
    pending: list[float] = field(default_factory=list)

    def add(self, d: float) -> None:
        self.pending.append(d)
        if len(self.pending) >= max(1, len(self.sorted_s) // 100):
            self.sorted_s.extend(self.pending)
            self.sorted_s.sort()
            self.pending.clear()
            self.prefix = [0.0, *accumulate(self.sorted_s)]

    @classmethod
    def of(cls, durations: Sequence[float]) -> _Samples:
        """The samples exactly as adding `durations` one at a time, in this order, leaves
        them (the same visible ones, sums and pending), with one sort: a month of a busy
        team's runs added one by one re-sorted them hundreds of times."""
        visible = 0
        while visible + max(1, visible // 100) <= len(durations):
            visible += max(1, visible // 100)
        out = cls(sorted_s=sorted(durations[:visible]), pending=list(durations[visible:]))
        out.prefix = [0.0, *accumulate(out.sorted_s)]
        return out

    def __len__(self) -> int:
        return len(self.sorted_s)

    def above(self, attained: float) -> int:
        return len(self.sorted_s) - bisect.bisect_right(self.sorted_s, attained)

    def remaining(self, attained: float) -> float | None:
        """Mean of (D - attained) over samples longer than `attained`; None if none."""
        xs = self.sorted_s
        i = bisect.bisect_right(xs, attained)
        n = len(xs) - i
        if n <= 0:
            return None
        return (self.prefix[-1] - self.prefix[i]) / n - attained


@dataclass
class RunHistory:
    """Durations of finished runs, everybody's and per (user, GPUs)."""

    min_own: int = 5  # own samples needed before they are trusted over everybody's
    cap_s: float = 7 * 86400.0  # no prediction beyond this (a week: longer is "long")
    all: _Samples = field(default_factory=_Samples)
    own: dict[Key, _Samples] = field(default_factory=dict)

    def add(self, user: str, gpus: int, duration_s: float) -> None:
        d = max(0.0, float(duration_s))
        self.all.add(d)
        self.own.setdefault((user, gpus), _Samples()).add(d)

    @classmethod
    def of(cls, finished: Iterable[tuple[str, int, float]]) -> RunHistory:
        """The history `add` makes of these (user, GPUs, duration) in this order, built at
        once (`_Samples.of`): the same predictions, to the bit."""
        everybody: list[float] = []
        own: dict[Key, list[float]] = {}
        for user, gpus, duration_s in finished:
            d = max(0.0, float(duration_s))
            everybody.append(d)
            own.setdefault((user, gpus), []).append(d)
        out = cls()
        out.all = _Samples.of(everybody)
        out.own = {k: _Samples.of(v) for k, v in own.items()}
        return out

    def trusted_keys(self) -> list[Key]:
        """The (user, GPUs) whose own runs can outweigh everybody's: the others are
        predicted from everybody's runs alone."""
        return [k for k, v in self.own.items() if len(v) >= self.min_own]

    def __len__(self) -> int:
        return len(self.all)

    def expected_remaining(self, user: str, gpus: int, attained_s: float) -> float | None:
        """E[D - a | D > a] from the run's own kind if enough outlived a, else everybody's;
        None when no run has finished yet (nothing to go on)."""
        mine = self.own.get((user, gpus))
        if mine is not None and mine.above(attained_s) >= self.min_own:
            r = mine.remaining(attained_s)
            if r is not None:
                return min(r, self.cap_s)
        r = self.all.remaining(attained_s)
        if r is None:
            if not len(self.all) or attained_s <= 0:
                return None
            # It outlived every finished run: nothing observed says how long it goes on.
            # A heavy tail's answer (Pareto with index 2, the doubling rule of
            # non-clairvoyant scheduling): as long again as it has run.
            r = attained_s
        return min(r, self.cap_s)

    def predict_duration(self, user: str, gpus: int) -> float | None:
        """A queued run's expected length (attained 0)."""
        return self.expected_remaining(user, gpus, 0.0)

    def predict_end(self, user: str, gpus: int, started_s: float, now: float) -> float | None:
        """The stepped predicted end of a run running since `started_s` (see the module
        docstring): the first prediction in the chain that still lies after `now`."""
        for total in self.stepped_ends(user, gpus):
            if started_s + total > now:
                return started_s + total
        return None

    def stepped_ends(self, user: str, gpus: int) -> Iterator[float]:
        """The chain of predicted run times (the module docstring): T0, then T1 = the
        prediction given T0 of attained time, and so on; at most 64, and none after a
        step with nothing to go on. The worker keeps it per (user, GPUs) as runs end."""
        attained = 0.0
        for _ in range(64):
            r = self.expected_remaining(user, gpus, attained)
            if r is None:
                return
            attained += max(r, 1.0)
            yield attained
