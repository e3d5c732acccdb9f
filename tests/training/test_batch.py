"""Batch search and the batch/LR plan."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as hs

from training.batch import find_max_batch, is_oom, plan_batch


class Memory:
    """A device with room for `limit` samples: raises the allocator's own OOM error above it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.cleanups = 0

    def try_batch(self, size: int) -> None:
        if size > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} MiB")

    def cleanup(self) -> None:
        self.cleanups += 1


def test_grows_then_bisects_to_the_largest_fit() -> None:
    memory = Memory(300)
    search = find_max_batch(memory.try_batch, start=8, cap=4096, cleanup=memory.cleanup)
    assert search.largest_fit == 300 and not search.capped
    sizes = [size for size, _ in search.tries]
    assert sizes[:7] == [8, 16, 32, 64, 128, 256, 512]
    assert len(sizes) <= 7 + 9
    assert memory.cleanups == len(sizes), "the cache must be emptied after every try"


@given(limit=hs.integers(min_value=0, max_value=5000), start=hs.integers(1, 64))
def test_search_is_exact_for_any_limit(limit: int, start: int) -> None:
    memory = Memory(limit)
    search = find_max_batch(memory.try_batch, start=start, cap=4096, cleanup=memory.cleanup)
    expected = min(limit, 4096)
    assert search.largest_fit == expected


def test_stops_at_the_cap_and_other_errors_propagate() -> None:
    search = find_max_batch(lambda size: None, start=1, cap=100)
    assert search.largest_fit == 100 and search.capped

    def broken(size: int) -> None:
        raise ValueError("shape mismatch")

    with pytest.raises(ValueError, match="shape"):
        find_max_batch(broken)


def test_is_oom() -> None:
    assert is_oom(torch.OutOfMemoryError("x"))
    assert is_oom(RuntimeError("CUDA error: out of memory"))
    assert not is_oom(RuntimeError("size mismatch"))


def test_plan_without_effective_batch_scales_lr_linearly() -> None:
    plan = plan_batch(
        max_micro_batch=256, effective_batch=None, world_size=2, base_lr=1e-3, reference_batch=64
    )
    assert (plan.micro_batch, plan.accum_steps, plan.effective_batch) == (256, 1, 512)
    assert plan.lr == pytest.approx(8e-3)


def test_plan_accumulates_to_reach_the_requested_batch() -> None:
    plan = plan_batch(
        max_micro_batch=48, effective_batch=256, world_size=2, base_lr=1e-3, reference_batch=64
    )
    assert plan.accum_steps == 3 and plan.micro_batch == 43
    assert plan.effective_batch == 258
    assert plan.lr == pytest.approx(1e-3 * 258 / 64)


@given(max_micro=hs.integers(1, 512), effective=hs.integers(8, 8192), world=hs.integers(1, 8))
def test_plan_never_exceeds_memory_nor_falls_short(
    max_micro: int, effective: int, world: int
) -> None:
    plan = plan_batch(
        max_micro_batch=max_micro,
        effective_batch=effective,
        world_size=world,
        base_lr=1.0,
        reference_batch=64,
    )
    assert 1 <= plan.micro_batch <= max_micro
    assert plan.effective_batch >= effective
    assert plan.effective_batch - effective < plan.accum_steps * world
    # the fewest accumulation steps that can reach the request
    assert (plan.accum_steps - 1) * max_micro * world < effective
