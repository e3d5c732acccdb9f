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
from dataclasses import dataclass
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
    nonfinite_losses: int
    skipped_steps: int
    longest_skip_streak: int
    loss_scale: float | None
    warnings: list[str]


class AmpMonitor:
    """Counts the signs of a run going wrong without a host sync per step.

    Per step it only does device-side tensor arithmetic; `collect`, called at each status
    write, reads everything back at once. A GradScaler step is known to be skipped when
    the scale went down at ``update`` (that is what ``update`` does on inf/NaN grads).
    """

    skip_streak_warn: Final = 5
    """Consecutive skipped steps before the status warns: a few are normal in early fp16."""
    min_scale: Final = 1.0
    """Below this the scaler is fighting overflow in the forward pass itself."""

    def __init__(self, scaler: torch.amp.GradScaler | None, device: torch.device) -> None:
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.device = device
        self._host = device.type == "cpu"
        self._reset()
        self.total_skipped = 0

    def _reset(self) -> None:
        self._loss_sum_host = 0.0
        self._nonfinite_host = 0
        self._count = 0
        zero = torch.zeros((), device=self.device)
        self._loss_sum = zero.clone()
        self._nonfinite = zero.clone()
        self._skipped = zero.clone()
        self._streak = zero.clone()
        self._max_streak = zero.clone()

    def before_update(self) -> torch.Tensor | float | None:
        """The scale before ``scaler.update()``; pass it to `after_step`."""
        if self.scaler is None:
            return None
        if self._host:
            return self.scaler.get_scale()
        scale = self.scaler._scale
        return scale.clone() if scale is not None else None

    def after_step(
        self, loss: torch.Tensor, scale_before: torch.Tensor | float | None = None
    ) -> None:
        self._count += 1
        if self._host:
            value = loss.detach().item()
            if math.isfinite(value):
                self._loss_sum_host += value
            else:
                self._nonfinite_host += 1
        else:
            detached = loss.detach().float()
            finite = torch.isfinite(detached)
            self._loss_sum += torch.where(finite, detached, 0.0)
            self._nonfinite += (~finite).float()
        if self.scaler is not None and scale_before is not None:
            scale_after = self.scaler._scale
            assert scale_after is not None
            skipped = (scale_after < scale_before).float()
            self._skipped += skipped
            self._streak = (self._streak + 1.0) * skipped
            self._max_streak = torch.maximum(self._max_streak, self._streak)

    def collect(self) -> AmpReport:
        count = self._count
        if self._host:
            nonfinite = self._nonfinite_host
            loss_sum = self._loss_sum_host
        else:
            nonfinite = int(self._nonfinite.item())
            loss_sum = float(self._loss_sum.item())
        skipped = int(self._skipped.item())
        streak = int(self._max_streak.item())
        scale = float(self.scaler.get_scale()) if self.scaler is not None else None
        finite_count = count - nonfinite
        mean = loss_sum / finite_count if finite_count > 0 else None
        warnings = []
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
        streak_carry = self._streak.clone()
        self._reset()
        self._streak = streak_carry
        return AmpReport(mean, nonfinite, skipped, streak, scale, warnings)
