"""Is a run healthy? Pure judgement of what a run reported and what its GPUs did.

The worker's poll (`bot.app.runs`) gathers a run's observations (its status file's curve,
warnings and NaN count, the telemetry samples attributed to it, when its step last
moved) and asks `judge` for alerts. Each alert has a stable `key`, so the owner hears
about each kind of trouble once per run while it goes on; the final DM lists them all
(`summary_lines`). Nothing here reads the database, a file or a clock: the same
observations always give the same alerts, which is what the tests rely on.

The status file is the contract (`training.status`): recipes and user scripts that
call `training.report(step=..., loss=...)` both fill it, so every check below works for
both.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

# Loss this many times its starting value (and above start + 1) counts as diverged.
DIVERGE_FACTOR: Final = 3.0
# A cross-entropy this large has blown up whatever its start was (it starts near
# ln(classes): 2.3 for 10, 10.8 for a 50k vocabulary).
EXPLODED_LOSS: Final = 1e3
# Rising this many reported points in a row, ending 50% above the best, is steady growth.
RISING_POINTS: Final = 6
# Telemetry: at least this many samples, most of them under LOW_UTIL_PCT, is input bound.
MIN_SAMPLES: Final = 5
LOW_UTIL_PCT: Final = 30.0
LOW_UTIL_SHARE: Final = 0.7
# Memory: a sample at or above this share of the GPU's memory is "close to full".
MEM_FULL_SHARE: Final = 0.95
# No new step for this long while the process lives: it stopped reporting.
SILENT_S: Final = 15 * 60
# GPUs without bf16 (recommend.FP16_ONLY holds the same two; kept here so this stays pure).
NO_BF16: Final = frozenset({"v100", "t4", "cpu"})


@dataclass(frozen=True)
class GpuReading:
    """One telemetry sample of one of the run's GPUs."""

    util_pct: float
    mem_used_mb: float
    mem_total_mb: float


@dataclass(frozen=True)
class Observations:
    """What the bot knows of one running run at one poll."""

    run_id: int
    what: str  # "recipe digits", "`python train.py`"
    gpu_model: str | None = None
    precision: str | None = None
    history: Sequence[dict[str, float]] = ()
    warnings: Sequence[str] = ()
    nonfinite_losses: int = 0
    samples: Sequence[GpuReading] = ()
    # Seconds since the step last moved (bot clock), None when not known yet.
    silent_s: float | None = None
    lr: float | None = None
    # The loss is a cross-entropy (a built-in recipe), so its size alone says it blew up;
    # a script's loss may be an MSE in any units, judged only against its own start.
    cross_entropy: bool = False


@dataclass(frozen=True)
class Alert:
    key: str  # "nonfinite", "diverging", "scaler", "input_bound", "memory", "silent"
    seen: str  # what was seen, one sentence
    fix: str  # the likely fix, one sentence
    severity: str = "warning"  # "warning" (the run is likely wasted) or "notice"

    def text(self, run_id: int, what: str) -> str:
        return f"Run #{run_id} ({what}): {self.seen} {self.fix}"


@dataclass
class Judgement:
    alerts: list[Alert] = field(default_factory=list)

    def keys(self) -> set[str]:
        return {a.key for a in self.alerts}


def _losses(history: Sequence[dict[str, float]]) -> list[tuple[float, float]]:
    return [
        (p["step"], p["loss"])
        for p in history
        if isinstance(p.get("loss"), int | float)
        and isinstance(p.get("step"), int | float)
        and math.isfinite(p["loss"])
    ]


def _bf16_fix(obs: Observations) -> str:
    model = (obs.gpu_model or "").lower()
    if model and model not in NO_BF16:
        return (
            f"Fix: this {obs.gpu_model} has bf16, which needs no loss scaling: "
            "`--precision bf16`; or lower the learning rate."
        )
    return "Fix: lower the learning rate, or run in fp32 (`--precision fp32`)."


def diverging(obs: Observations) -> Alert | None:
    """Far above its start, or rising steadily for the last `RISING_POINTS` reports."""
    points = _losses(obs.history)
    if not points:
        return None
    first, last = points[0][1], points[-1][1]
    lower = " (it is at " + f"{obs.lr:g})" if obs.lr else ""
    fix = (
        f"Fix: lower the learning rate{lower} by 10x, add warm-up or gradient clipping; "
        "the rest of this run is likely wasted."
    )
    if obs.cross_entropy and last >= EXPLODED_LOSS:
        return Alert(
            "diverging",
            f"the loss is {last:.4g} at step {points[-1][0]:.0f} (it started at {first:.4g}): "
            "a loss that size means the weights blew up.",
            fix,
        )
    if len(points) < 2:
        return None
    if last > DIVERGE_FACTOR * first and last > first + 1.0:
        return Alert(
            "diverging",
            f"the loss is diverging: {last:.4g} at step {points[-1][0]:.0f}, "
            f"up from {first:.4g} at the start.",
            fix,
        )
    tail = [loss for _, loss in points[-RISING_POINTS:]]
    best = min(loss for _, loss in points)
    if (
        len(tail) == RISING_POINTS
        and all(b > a for a, b in itertools.pairwise(tail))
        and last > 1.5 * best
        and last > best + 0.1
    ):
        return Alert(
            "diverging",
            f"the loss has grown for {RISING_POINTS} reports in a row, to {last:.4g} "
            f"(best so far {best:.4g}).",
            fix,
        )
    return None


def nonfinite(obs: Observations) -> Alert | None:
    if obs.nonfinite_losses <= 0 and not any("NaN or inf" in w for w in obs.warnings):
        return None
    n = obs.nonfinite_losses
    seen = (
        "1 NaN/inf loss was reported."
        if n == 1
        else f"{n} NaN/inf losses were reported."
        if n
        else "NaN/inf losses were reported."
    )
    return Alert(
        "nonfinite",
        seen,
        "Fix: lower the learning rate, clip gradients, check the data for NaNs; with fp16 "
        "try bf16. The model's weights may already be ruined.",
    )


def scaler(obs: Observations) -> Alert | None:
    said = [w for w in obs.warnings if "GradScaler" in w or "loss scale collapsed" in w]
    if not said:
        return None
    return Alert("scaler", said[-1].split(";")[0] + ".", _bf16_fix(obs))


def input_bound(obs: Observations) -> Alert | None:
    if len(obs.samples) < MIN_SAMPLES:
        return None
    low = sum(1 for s in obs.samples if s.util_pct < LOW_UTIL_PCT)
    share = low / len(obs.samples)
    if share < LOW_UTIL_SHARE:
        return None
    mean = sum(s.util_pct for s in obs.samples) / len(obs.samples)
    return Alert(
        "input_bound",
        f"its GPUs were under {LOW_UTIL_PCT:.0f}% busy in {share:.0%} of samples "
        f"(mean {mean:.0f}%): it is waiting on input, not computing.",
        "Fix: more DataLoader workers (`num_workers`, `pin_memory=True`), a larger batch, "
        "and the data on the host's local disk rather than a network mount.",
        severity="notice",
    )


def memory(obs: Observations) -> Alert | None:
    full = [s for s in obs.samples if s.mem_total_mb > 0]
    if not full:
        return None
    worst = max(s.mem_used_mb / s.mem_total_mb for s in full)
    if worst < MEM_FULL_SHARE:
        return None
    return Alert(
        "memory",
        f"GPU memory reached {worst:.0%} of the card: one larger batch or longer sequence "
        "and it runs out.",
        "Fix: a smaller `--batch-size` with `--effective-batch` (gradient accumulation), "
        "bf16, or a GPU with more memory.",
        severity="notice",
    )


def silent(obs: Observations) -> Alert | None:
    if obs.silent_s is None or obs.silent_s < SILENT_S:
        return None
    minutes = obs.silent_s / 60
    return Alert(
        "silent",
        f"it has not reported a new step for {minutes:.0f} minutes, though its process "
        "is still alive.",
        f"Fix: look at `/gpu logs {obs.run_id}` for a hang (a stuck data loader, a "
        "deadlock across GPUs); a script must call `training.report(step=...)` to show "
        "progress.",
    )


CHECKS: Final = (nonfinite, diverging, scaler, input_bound, memory, silent)


def judge(obs: Observations) -> Judgement:
    """Every check that fires, in a fixed order."""
    found = Judgement()
    for check in CHECKS:
        alert = check(obs)
        if alert is not None:
            found.alerts.append(alert)
    return found


def summary_lines(alerts: dict[str, str]) -> list[str]:
    """The final DM's health section: the alerts raised during the run, by key."""
    return [alerts[k] for k in sorted(alerts)]
