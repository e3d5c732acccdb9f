"""Built-in recipes: a model, its data, and the settings that make it train well.

A recipe is what ``--recipe NAME`` runs without any user code, so the bot can check a
fresh GPU host end to end (drivers, precision, DDP, checkpoints) on real data without a
download. The data is held as tensors on the device: a recipe here is small enough for
that, and it keeps the data loader out of the runner's overhead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import torch
from torch import nn


@dataclass(frozen=True)
class TensorData:
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor

    def to(self, device: torch.device) -> TensorData:
        return TensorData(
            self.train_x.to(device),
            self.train_y.to(device),
            self.test_x.to(device),
            self.test_y.to(device),
        )


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    load_data: Callable[[], TensorData]
    build_model: Callable[[], nn.Module]
    reference_batch: int
    """The batch that `base_lr` is tuned for; other batches scale the LR linearly."""
    base_lr: float
    epochs: int
    max_batch: int
    """Cap for ``--batch-size auto``: past it, more steps per epoch beat a bigger batch."""
    weight_decay: float = 0.0

    def make_optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=self.weight_decay)

    @staticmethod
    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, target)


# The split is fixed, independent of --seed, so every run is scored on the same test set.
_DIGITS_SPLIT_SEED: Final = 20240601
_DIGITS_TEST_FRACTION: Final = 0.2


def load_digits_data() -> TensorData:
    """scikit-learn's bundled 8x8 digits (1,797 images): real data that ships with the wheel."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(_DIGITS_SPLIT_SEED))
    x, y = x[order], y[order]
    n_test = int(len(x) * _DIGITS_TEST_FRACTION)
    return TensorData(x[n_test:], y[n_test:], x[:n_test], y[:n_test])


def build_digits_model(hidden: int = 256) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


RECIPES: Final[dict[str, Recipe]] = {
    "digits": Recipe(
        name="digits",
        description="an MLP on scikit-learn's bundled digits; ~97% test accuracy in 15 epochs",
        load_data=load_digits_data,
        build_model=build_digits_model,
        reference_batch=64,
        base_lr=1e-3,
        epochs=15,
        max_batch=512,
    ),
}


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; known: {', '.join(sorted(RECIPES))}") from None


@torch.no_grad()
def accuracy(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    autocast: Callable[[], contextlib.AbstractContextManager[object]],
    batch: int = 1024,
) -> float:
    """Top-1 accuracy under the run's own precision: what the run would serve with."""
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(x), batch):
        with autocast():
            logits = model(x[start : start + batch])
        correct += int((logits.argmax(dim=1) == y[start : start + batch]).sum())
    model.train(was_training)
    return correct / max(1, len(x))
