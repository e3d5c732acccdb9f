"""Fair-share ordering: which waiting run goes first.

Slurm's multifactor score per run over each user's own queue, merged by the heads'
scores, with the decayed usage that drives it (see the package docstring). Placement
and preemption both walk the queue in this order.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import groupby, islice
from operator import attrgetter

from bot.domain.scheduling.model import QueuedRun, SchedulerConfig


def decay_usage(
    usage: Mapping[str, float], running: Mapping[str, int], dt: float, half_life_s: float
) -> dict[str, float]:
    """Advances decayed GPU-seconds by dt while `running[user]` GPUs ran throughout.

    Exact for a constant rate: u' = u * 2^(-dt/h) + g * h/ln2 * (1 - 2^(-dt/h)). The worker
    and the simulator both keep usage with this, so they agree with each other."""
    if dt <= 0:
        return dict(usage)
    f = 2.0 ** (-dt / half_life_s)
    acc = half_life_s / math.log(2.0) * (1.0 - f)
    out = {u: v * f for u, v in usage.items()}
    for user, g in running.items():
        if g:
            out[user] = out.get(user, 0.0) + g * acc
    return out


def fairshare_factors(users: Iterable[str], usage: Mapping[str, float]) -> dict[str, float]:
    """Slurm's classic factor 2^(-usage_share / fair_share) with equal shares."""
    names = set(users) | {u for u, v in usage.items() if v > 0}
    total = sum(usage.get(u, 0.0) for u in names)
    if not names:
        return {}
    n = len(names)
    if total <= 0:
        return dict.fromkeys(names, 1.0)
    return {u: 2.0 ** (-n * usage.get(u, 0.0) / total) for u in names}


submit_key = attrgetter("submit_s", "run_id")


_user_key = attrgetter("user")


_priority_key = attrgetter("priority")


_attained_key = attrgetter("attained_s")


def order_queue(
    queue: Sequence[QueuedRun], now: float, usage: Mapping[str, float], config: SchedulerConfig
) -> list[QueuedRun]:
    """The fair order (each user's first scan_limit runs): users' queues merged by head score."""
    return list(iter_order(queue, now, usage, config))


def iter_order(
    queue: Sequence[QueuedRun], now: float, usage: Mapping[str, float], config: SchedulerConfig
) -> Iterator[QueuedRun]:
    """Lazy `order_queue`: a decision that runs out of room stops pulling runs."""
    return iter(Ordering(queue, now, usage, config))


class Ordering:
    """The fair order of a queue, pulled lazily; `key` ranks runs the same way."""

    def __init__(
        self,
        queue: Sequence[QueuedRun],
        now: float,
        usage: Mapping[str, float],
        config: SchedulerConfig,
    ) -> None:
        # C-keyed sorts + groupby: this runs on every decision over the whole window
        self.by_user = {u: list(g) for u, g in groupby(sorted(queue, key=_user_key), key=_user_key)}
        self.factors = fairshare_factors(self.by_user, usage)
        self.usage = usage
        las = config.las_after_s
        demoted = False
        # one priority level (the usual case): the stable sort by it changes nothing
        one_prio = len(set(map(_priority_key, queue))) <= 1
        limit = config.scan_limit
        for runs in self.by_user.values():
            runs.sort(key=submit_key)
            if las is not None and max(map(_attained_key, runs)) >= las:
                # the long queue of least-attained-service: a run that has already run
                # that long goes after its user's runs that have not (see preemption)
                runs.sort(key=lambda r: r.attained_s >= las)
                demoted = True
            if not one_prio:
                runs.sort(key=_priority_key, reverse=True)
            del runs[limit:]
        # With one priority level the merge is a plain sort by `key` (score falls with
        # submit time within a user), so a subset can be ordered directly.
        self.uniform = one_prio and not demoted
        self.now = now
        self.config = config
        # `key` runs for every run a decision looks at: its constants, read once
        self._max_age = config.max_age_s
        self._w = (config.w_fairshare, config.w_priority, config.w_age)

    def key(self, run: QueuedRun) -> tuple[float, float, float, str, str]:
        max_age = self._max_age
        submit = run.submit_s
        age = min(max(0.0, self.now - submit) / max_age, 1.0) if max_age > 0 else 1.0
        w_fairshare, w_priority, w_age = self._w
        user = run.user
        score = w_fairshare * self.factors.get(user, 1.0) + w_priority * run.priority + w_age * age
        # Raw usage breaks ties of the score: the factor rounds to 1.0 for tiny shares,
        # and less recent usage must still go first among equals.
        return (-score, self.usage.get(user, 0.0), submit, run.run_id, user)

    def runs(self) -> Iterator[QueuedRun]:
        for runs in self.by_user.values():
            yield from runs

    def __iter__(self) -> Iterator[QueuedRun]:
        by_user, key = self.by_user, self.key
        heads = [key(runs[0]) for runs in by_user.values()]
        heapq.heapify(heads)
        pos = dict.fromkeys(by_user, 0)
        while heads:
            user = heads[0][-1]
            runs = by_user[user]
            i = pos[user]
            yield runs[i]
            i += 1
            pos[user] = i
            if i < len(runs):
                heapq.heapreplace(heads, key(runs[i]))
            else:
                heapq.heappop(heads)


class Lazy:
    """A list filled from an iterator on demand (look-ahead for the peer choice)."""

    def __init__(self, it: Iterator[QueuedRun], limit: int) -> None:
        self._it = islice(it, limit)
        self.items: list[QueuedRun] = []

    def get(self, i: int) -> QueuedRun | None:
        items = self.items
        while len(items) <= i:
            nxt = next(self._it, None)
            if nxt is None:
                return None
            items.append(nxt)
        return items[i]
