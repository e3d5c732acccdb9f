"""`/gpu queue`'s estimates: when each waiting run should start, and what it should cost.

Pure and deterministic, the clock passed in, like `bot.domain.scheduling`. The picture is the
scheduler's: hosts with GPUs of one model, each holder (a running run, a reservation)
with the time it should let go — a run's `eta_s` from its status, else its start plus
`--max`; a reservation's `ends_at`; unknown for a run without either. The waiting runs
are then laid out in line order, each at the earliest time a host of its model has
enough GPUs free for its whole `--max` (conservative backfill's profile), and each
waiting run, once placed, holds its GPUs for the runs behind it.

Reservations still waiting for GPUs come first in the line, and no run of their model
starts before they are granted, as `bot.app.runs` dispatches (people at a keyboard before
batch work). A holder of unknown length never lets go in this picture, so a run that can only start
after one gets no start estimate ("unknown") rather than a made-up one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Hold:
    gpus: int
    # When the holder lets go (epoch seconds); None when nobody can say.
    until_s: float | None


@dataclass(frozen=True)
class HostPicture:
    name: str
    gpu_model: str
    gpus: int
    # Price of one GPU-hour on this host (its hourly price over its GPUs); 0 when owned.
    usd_per_gpu_hour: float
    holds: tuple[Hold, ...] = ()


@dataclass(frozen=True)
class WaitingRun:
    # A run's id; a waiting reservation (which goes first) as "res:<id>".
    run_id: int | str
    gpus: int
    # "" for any model (a reservation that named none).
    gpu_model: str
    # `--max` in seconds; None: unknown length.
    max_seconds: int | None
    # A waiting reservation: while it waits, no run of its model (of any, for "") starts.
    holds_line: bool = False


@dataclass(frozen=True)
class Estimate:
    run_id: int | str
    # Epoch seconds; None when it depends on a holder of unknown length (or never fits).
    start_s: float | None
    host: str | None
    # GPUs × per-GPU price × --max; None for unknown length (see `usd_per_hour`).
    cost_usd: float | None
    # What the run costs per hour where it is expected to run (0 on owned hosts).
    usd_per_hour: float | None


@dataclass
class _Timeline:
    host: HostPicture
    # (start, end, gpus); end None = for good.
    busy: list[tuple[float, float | None, int]] = field(default_factory=list)

    def used_at(self, t: float) -> int:
        return sum(n for a, b, n in self.busy if a <= t and (b is None or t < b))

    def fits(self, start: float, end: float | None, gpus: int) -> bool:
        """Enough free GPUs over all of [start, end): usage only rises where a holding
        starts, so checking `start` and each later holding's start is enough."""
        points = [start] + [a for a, _, _ in self.busy if a > start and (end is None or a < end)]
        return all(self.host.gpus - self.used_at(p) >= gpus for p in points)

    def candidates(self, now: float) -> list[float]:
        ends = {b for _, b, _ in self.busy if b is not None and b > now}
        return sorted({now, *ends})


def estimate_queue(
    waiting: list[WaitingRun], hosts: list[HostPicture], now_s: float
) -> list[Estimate]:
    """One estimate per waiting run, in the order given (the line's order)."""
    lines = []
    for h in hosts:
        tl = _Timeline(h)
        for hold in h.holds:
            # A holder past its expected end is still there now: it lets go "soon".
            end = None if hold.until_s is None else max(hold.until_s, now_s)
            tl.busy.append((now_s, end, hold.gpus))
        lines.append(tl)
    out = []
    # Model ("" = every model) -> when the last reservation waiting for it is granted.
    gate: dict[str, float] = {}
    for run in waiting:
        best: tuple[float, int, _Timeline] | None = None
        earliest = now_s
        if not run.holds_line:
            blocked = [gate.get("", now_s)] + (
                [gate.get(run.gpu_model, now_s)] if run.gpu_model else [v for v in gate.values()]
            )
            earliest = max(now_s, *blocked)
        for order, tl in enumerate(lines):
            if math.isinf(earliest):
                break
            if (run.gpu_model and tl.host.gpu_model != run.gpu_model) or tl.host.gpus < run.gpus:
                continue
            for t in tl.candidates(earliest):
                end = None if run.max_seconds is None else t + run.max_seconds
                if tl.fits(t, end, run.gpus):
                    if best is None or (t, order) < (best[0], best[1]):
                        best = (t, order, tl)
                    break
        if best is None:
            if run.holds_line:
                gate[run.gpu_model] = math.inf
            price = _price(lines, run)
            out.append(Estimate(run.run_id, None, None, _cost(run, price), _hourly(run, price)))
            continue
        t, _, tl = best
        if run.holds_line:
            gate[run.gpu_model] = max(gate.get(run.gpu_model, now_s), t)
        end = None if run.max_seconds is None else t + run.max_seconds
        tl.busy.append((t, end, run.gpus))
        price = tl.host.usd_per_gpu_hour
        out.append(Estimate(run.run_id, t, tl.host.name, _cost(run, price), _hourly(run, price)))
    return out


def _price(lines: list[_Timeline], run: WaitingRun) -> float | None:
    """Where no start is known, the cheapest host that could ever hold the run prices it."""
    prices = [
        tl.host.usd_per_gpu_hour
        for tl in lines
        if (not run.gpu_model or tl.host.gpu_model == run.gpu_model) and tl.host.gpus >= run.gpus
    ]
    return min(prices) if prices else None


def _cost(run: WaitingRun, price: float | None) -> float | None:
    if price is None or run.max_seconds is None:
        return None
    return run.gpus * price * run.max_seconds / 3600


def _hourly(run: WaitingRun, price: float | None) -> float | None:
    return None if price is None else run.gpus * price


def start_phrase(estimate: Estimate, now_s: float) -> str:
    """`now`, `in 1h20m`, or `unknown` (after a run or hold of unknown length)."""
    if estimate.start_s is None:
        return "unknown"
    wait = estimate.start_s - now_s
    if wait < 60:
        return "now"
    minutes = math.ceil(wait / 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"in {days}d{hours}h" if hours else f"in {days}d"
    if hours:
        return f"in {hours}h{minutes:02d}m" if minutes else f"in {hours}h"
    return f"in {minutes}m"


def cost_phrase(estimate: Estimate) -> str:
    """`$12.34`, `$0 (owned)`, or `$3.20/h, unknown length`."""
    if estimate.usd_per_hour is None:
        return "unknown"
    if estimate.usd_per_hour == 0:
        return "$0 (owned)"
    if estimate.cost_usd is None:
        return f"${estimate.usd_per_hour:.2f}/h, unknown length"
    return f"${estimate.cost_usd:.2f}"
