"""What runs on a GPU host: the runner, its recipes, and helpers for users' own scripts.

A user script started by ``python -m training.runner -- python train.py`` uses::

    import training
    scaler = training.grad_scaler()            # live only when the run chose fp16
    with training.autocast_context():          # bf16 / fp16 / nothing, as chosen
        loss = model(x)
    training.report(step=step, loss=loss.item(), accuracy=acc)

Importing this package does not import torch: the bot imports `training.status` (the
status file's format) on machines that have no torch. The torch-backed helpers load on
first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from training.status import read_status, report

if TYPE_CHECKING:
    from training.checkpoint import load_checkpoint, save_checkpoint
    from training.precision import (
        autocast,
        autocast_context,
        choose_precision,
        grad_scaler,
        make_grad_scaler,
        precision_from_env,
    )

_LAZY = {
    "autocast": "training.precision",
    "autocast_context": "training.precision",
    "choose_precision": "training.precision",
    "grad_scaler": "training.precision",
    "make_grad_scaler": "training.precision",
    "precision_from_env": "training.precision",
    "load_checkpoint": "training.checkpoint",
    "save_checkpoint": "training.checkpoint",
}

__all__ = [
    "autocast",
    "autocast_context",
    "choose_precision",
    "grad_scaler",
    "load_checkpoint",
    "make_grad_scaler",
    "precision_from_env",
    "read_status",
    "report",
    "save_checkpoint",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'training' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
