"""Choosing and using a training precision, and watching mixed precision for trouble.

Mixed precision is only worth it where the hardware makes the narrow type fast:

* CUDA, compute capability 8.0 and up (Ampere, Ada, Hopper, Blackwell): **bf16 autocast**.
  bf16 has fp32's exponent range, so no loss scaling is needed.
* CUDA 7.x (Volta, Turing): tensor cores do fp16 but not bf16: **fp16 autocast with a
  GradScaler**, because fp16 gradients underflow without loss scaling.
* Older CUDA GPUs (no tensor cores) and CPUs without AMX: **fp32**. There the narrow types
  are emulated or converted at every op, and training gets slower, not faster (up to
  3.7x slower for bf16 autocast on AVX-512 CPUs, depending on the model).

A `GradScaler` is only ever enabled for fp16: with bf16 or fp32 it would only cost time.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from typing import Final, Literal

import torch

from training.status import ENV_PRECISION

Precision = Literal["bf16", "fp16", "fp32"]
PRECISIONS: Final[tuple[Precision, ...]] = ("bf16", "fp16", "fp32")
DTYPES: Final[dict[Precision, torch.dtype]] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}


@dataclass(frozen=True)
class PrecisionChoice:
    precision: Precision
    reason: str
    """Goes to the status file and the log, so the user learns why ``auto`` did what it did."""


def _cpu_has_amx() -> bool:
    """AMX tiles are what make bf16 matmuls faster than fp32 on a CPU."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


def choose_precision(requested: str, device: torch.device) -> PrecisionChoice:
    """Resolve ``auto`` for this device; pass an explicit request through with its reason."""
    if requested != "auto":
        if requested not in PRECISIONS:
            raise ValueError(f"unknown precision {requested!r}; use auto, bf16, fp16 or fp32")
        return PrecisionChoice(requested, f"{requested} requested")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        if major >= 8:
            return PrecisionChoice(
                "bf16", f"auto: {name} (sm_{major}{minor}) has fast bf16; bf16 autocast"
            )
        if major == 7:
            return PrecisionChoice(
                "fp16",
                f"auto: {name} (sm_{major}{minor}) has fp16 tensor cores but no fast bf16; "
                "fp16 autocast with GradScaler",
            )
        return PrecisionChoice(
            "fp32",
            f"auto: {name} (sm_{major}{minor}) has no tensor cores; mixed precision "
            "would be slower, so fp32",
        )
    if device.type == "cpu":
        if _cpu_has_amx():
            return PrecisionChoice("bf16", "auto: this CPU has AMX bf16 units; bf16 autocast")
        return PrecisionChoice(
            "fp32",
            "auto: this CPU has no AMX bf16 units; bf16 autocast would convert at every "
            "op and train slower than fp32, so fp32",
        )
    return PrecisionChoice("fp32", f"auto: no mixed-precision policy for {device.type}; fp32")


def autocast(
    precision: Precision, device: torch.device | str
) -> contextlib.AbstractContextManager[object]:
    """The forward-pass context for `precision`; a no-op context for fp32."""
    device_type = torch.device(device).type
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[precision])


def make_grad_scaler(precision: Precision, device: torch.device | str) -> torch.amp.GradScaler:
    """A scaler that is live only for fp16, so a loop can always call ``scale``/``step``."""
    return torch.amp.GradScaler(torch.device(device).type, enabled=precision == "fp16")


# -- helpers for user scripts ------------------------------------------------------------


def precision_from_env(default: Precision = "fp32") -> Precision:
    """The precision the runner chose for this run (``GPUBOT_PRECISION``)."""
    value = os.environ.get(ENV_PRECISION, default)
    if value not in PRECISIONS:
        raise ValueError(f"{ENV_PRECISION}={value!r} is not one of {', '.join(PRECISIONS)}")
    return value


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autocast_context(
    device: torch.device | str | None = None,
) -> contextlib.AbstractContextManager[object]:
    """``with training.autocast_context(): loss = model(x)``: the runner's precision, applied."""
    return autocast(precision_from_env(), device if device is not None else _default_device())


def grad_scaler(device: torch.device | str | None = None) -> torch.amp.GradScaler:
    """The scaler for the runner's precision: live for fp16, a pass-through otherwise."""
    return make_grad_scaler(
        precision_from_env(), device if device is not None else _default_device()
    )


# -- watching for trouble ----------------------------------------------------------------


@dataclass
class AmpReport:
    """What `AmpMonitor.collect` found since the last call."""

    mean_loss: float | None
    """Mean of the finite losses of the window; None when there was none."""
    nonfinite_losses: int
    skipped_steps: int
    longest_skip_streak: int
    loss_scale: float | None
    warnings: list[str]
    points: list[tuple[int, float | None]] = field(default_factory=list)
    """(step, mean finite loss) at the end of each segment (`AmpMonitor.end_segment`, and
    the window's own end), oldest first: the curve's points."""
    diverged: bool = False
    """A segment had no finite loss at all and nothing can recover it: no GradScaler, or
    its scale had collapsed below `AmpMonitor.min_scale` by the segment's end."""


@dataclass
class _Tally:
    """Running sums over some steps (a segment, or the window)."""

    finite_sum: float = 0.0
    finite: int = 0
    nonfinite: int = 0

    def add(self, other: _Tally) -> None:
        self.finite_sum += other.finite_sum
        self.finite += other.finite
        self.nonfinite += other.nonfinite

    @property
    def mean(self) -> float | None:
        return self.finite_sum / self.finite if self.finite else None


class AmpMonitor:
    """Counts the signs of a run going wrong with no host sync and no arithmetic per step.

    On a GPU a small model's step is a few milliseconds of kernel launches; every extra
    kernel adds to it, and a per-step ``.item()`` (a host-device sync) costs several
    percent. So `after_step` only keeps the step's loss tensor (detached: a view, no
    kernel) and, with a live GradScaler, a copy of its scale after ``update`` (one tiny
    kernel; the scaler updates its scale in place). They come to the host stacked, in
    one transfer, when `capacity` steps are held and at `collect` (each status write),
    and are judged there. A GradScaler step was skipped when its scale went down at
    ``update``: that is what ``update`` does on inf/NaN gradients, and only then.
    """

    skip_streak_warn: Final = 5
    """Consecutive skipped steps before the status warns: a few are normal in early fp16."""
    min_scale: Final = 1.0
    """Below this the scaler is fighting overflow in the forward pass itself."""

    def __init__(self, scaler: torch.amp.GradScaler | None, capacity: int = 512) -> None:
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.capacity = capacity
        self._losses: list[torch.Tensor] = []
        self._scales: list[torch.Tensor] = []
        # The scale before the first step (no sync: an unused scaler holds it as a float).
        self._scale = self.scaler.get_scale() if self.scaler is not None else None
        self._streak = 0
        self.total_skipped = 0
        self._new_window()

    def _new_window(self) -> None:
        self._marks: list[tuple[int, int]] = []  # (steps recorded by then, step number)
        self._seen = 0  # steps of this window drained so far
        self._next_mark = 0  # the first mark not closed yet
        self._closed_at = 0  # steps of this window in closed segments
        self._segment = _Tally()
        self._window = _Tally()
        self._points: list[tuple[int, float | None]] = []
        self._skipped = 0
        self._max_streak = 0  # the streak itself carries over into the next window
        self._diverged = False

    def after_step(self, loss: torch.Tensor) -> None:
        """Record one optimizer step's loss, after ``scaler.update()``."""
        self._losses.append(loss.detach())
        if self.scaler is not None:  # updated in place: this step's value needs a copy
            self._scales.append(self.scaler._scale.clone())  # type: ignore[union-attr]
        if len(self._losses) == self.capacity:
            self._drain()

    def end_segment(self, step: int) -> None:
        """The steps recorded so far end a point of the curve (an epoch) at `step`.

        Host bookkeeping only: the segment is closed when its steps are drained."""
        recorded = self._seen + len(self._losses)
        pending = len(self._marks) > self._next_mark
        if recorded <= (self._marks[-1][0] if pending else self._closed_at):
            return  # no step since the last end
        if self._losses:
            self._marks.append((recorded, step))
        else:  # all on the host already
            self._close(step)

    def _drain(self) -> None:
        """Bring what is held to the host (one sync) and judge it, step by step."""
        if not self._losses:
            return
        n = len(self._losses)
        held = torch.stack(self._losses).float()
        if self._scales:
            held = torch.cat([held, torch.stack(self._scales)])
        self._losses, self._scales = [], []
        values: list[float] = held.tolist()  # the one host-device sync
        losses, scales = values[:n], values[n:] if self.scaler is not None else None
        marks, m = self._marks, self._next_mark
        segment = self._segment
        for k, loss in enumerate(losses):
            if math.isfinite(loss):
                segment.finite_sum += loss
                segment.finite += 1
            else:
                segment.nonfinite += 1
            if scales is not None:
                scale = scales[k]
                if self._scale is not None and scale < self._scale:
                    self._skipped += 1
                    self._streak += 1
                    self._max_streak = max(self._max_streak, self._streak)
                else:
                    self._streak = 0
                self._scale = scale
            self._seen += 1
            if m < len(marks) and marks[m][0] == self._seen:
                self._close(marks[m][1])
                segment = self._segment
                m += 1
        self._next_mark = m

    def _close(self, step: int) -> None:
        segment, self._segment = self._segment, _Tally()
        self._closed_at = self._seen
        self._window.add(segment)
        self._points.append((step, segment.mean))
        if segment.finite == 0 and segment.nonfinite > 0:
            scale = self._scale
            if scale is None or scale < self.min_scale:
                self._diverged = True

    def collect(self, step: int) -> AmpReport:
        """Everything since the last call, judged; the window ends at `step`."""
        self.end_segment(step)
        self._drain()
        window = self._window
        count = window.finite + window.nonfinite
        nonfinite, streak, skipped = window.nonfinite, self._max_streak, self._skipped
        scale = self._scale
        warnings: list[str] = []
        if nonfinite:
            warnings.append(f"{nonfinite} of the last {count} losses were NaN or inf")
        if streak >= self.skip_streak_warn:
            warnings.append(
                f"GradScaler skipped {streak} steps in a row (inf/NaN gradients); "
                "fp16 overflow: consider bf16 or a lower learning rate"
            )
        if scale is not None and scale < self.min_scale:
            warnings.append(
                f"loss scale collapsed to {scale:g}: fp16 overflows even unscaled; "
                "consider bf16 or fp32"
            )
        self.total_skipped += skipped
        report = AmpReport(
            window.mean,
            nonfinite,
            skipped,
            streak,
            scale,
            warnings,
            points=self._points,
            diverged=self._diverged,
        )
        self._new_window()
        return report


def _probe(requested: str, device_wanted: str) -> dict[str, str]:
    """What `python -m training.precision REQUESTED DEVICE` prints (training.launching
    `probe_precision`): the choice for this host's device and the device's name."""
    cuda = device_wanted != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    choice = choose_precision(requested, device)
    name = f"cuda ({torch.cuda.get_device_name(0)})" if cuda else "cpu"
    return {"precision": choice.precision, "reason": choice.reason, "device": name}


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(_probe(sys.argv[1], sys.argv[2])), flush=True)
