"""Batch size and learning rate: the largest batch that fits, linear LR scaling, accumulation.

`find_max_batch` grows the batch by doubling until a try runs out of memory (or reaches the
cap), then bisects between the last size that fitted and the first that did not. The
allocator cache is emptied after every failed try: otherwise the freed blocks of the
failed try stay reserved and the next, smaller try fails too.

`plan_batch` then turns "the largest micro-batch that fits" and "the effective batch the
user asked for" into a micro-batch and an accumulation count, and the learning rate is
scaled linearly from the recipe's reference batch (Goyal et al., 2017): the same
``--lr`` means the same per-sample step size at any batch size.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


def is_oom(error: BaseException) -> bool:
    """True for the allocator's out-of-memory errors, CUDA's and the CPU's."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def empty_cache() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class BatchSearch:
    largest_fit: int
    """The largest batch size that ran; 0 if even the smallest did not."""
    tries: list[tuple[int, bool]]
    """Every size tried, in order, and whether it fitted: the status shows the search."""
    capped: bool
    """True when the search stopped at the cap, not at an OOM."""


def find_max_batch(
    try_batch: Callable[[int], None],
    *,
    start: int = 1,
    cap: int = 65536,
    oom: Callable[[BaseException], bool] = is_oom,
    cleanup: Callable[[], None] = empty_cache,
) -> BatchSearch:
    """Largest ``b`` in ``[1, cap]`` for which ``try_batch(b)`` does not raise an OOM.

    `start` is only the first guess: a good one saves tries, a bad one (too big) just means
    the bisection runs below it. 0 means even a batch of 1 does not fit.

    `try_batch` should do what a real step does at that size (forward, backward, optimizer
    state), since the backward pass is where the memory peaks. Errors other than OOM
    propagate: they are bugs, not sizes.
    """
    if start < 1 or cap < start:
        raise ValueError(f"need 1 <= start <= cap, got start={start} cap={cap}")
    tries: list[tuple[int, bool]] = []

    def fits(size: int) -> bool:
        try:
            try_batch(size)
        except BaseException as error:
            if not oom(error):
                raise
            del error
            cleanup()
            tries.append((size, False))
            return False
        cleanup()
        tries.append((size, True))
        return True

    good, bad = 0, 0
    size = start
    while True:
        if fits(size):
            good = size
            if size == cap:
                return BatchSearch(good, tries, capped=True)
            size = min(size * 2, cap)
        else:
            bad = size
            break
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return BatchSearch(good, tries, capped=False)


@dataclass(frozen=True)
class BatchPlan:
    micro_batch: int
    """Per-process batch through the model at once."""
    accum_steps: int
    """Micro-batches per optimizer step."""
    world_size: int
    lr: float
    """The learning rate, linearly scaled from the reference batch."""

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.accum_steps * self.world_size


def plan_batch(
    *,
    max_micro_batch: int,
    effective_batch: int | None,
    world_size: int,
    base_lr: float,
    reference_batch: int,
) -> BatchPlan:
    """Micro-batch and accumulation for a requested effective batch, and the scaled LR.

    Without a requested effective batch, each process runs `max_micro_batch` and there is
    no accumulation. With one, the accumulation count is the fewest micro-batches that
    reach it, and the micro-batch is then evened out so that the effective batch is as
    close to the request as whole numbers allow (never below it).
    """
    if max_micro_batch < 1 or world_size < 1 or reference_batch < 1:
        raise ValueError("batch sizes and world size must be positive")
    if effective_batch is None:
        micro, accum = max_micro_batch, 1
    else:
        if effective_batch < world_size:
            raise ValueError(
                f"effective batch {effective_batch} is smaller than the {world_size} processes"
            )
        accum = math.ceil(effective_batch / (max_micro_batch * world_size))
        micro = math.ceil(effective_batch / (accum * world_size))
    lr = base_lr * (micro * accum * world_size) / reference_batch
    return BatchPlan(micro, accum, world_size, lr)
