"""The shared read of a Slurm cluster backs off while slurmctld does not answer and
waits longer after a slow answer (issue 36: a controller that must not be hammered).
A client double stands in for Slurm's tools; the timings are loose bounds, true on a
loaded machine too (load only makes fewer reads)."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import pytest

from bot.providers.slurm import cluster as cluster_module
from bot.providers.slurm.cluster import BACKOFF_MAX, ClusterView
from provisioning.slurm import SlurmUnavailable


class Controller:
    """`SlurmClient`'s two reads; down (raising as a timeout does) or slow on demand."""

    def __init__(self) -> None:
        self.down = False
        self.delay_s = 0.0
        self.reads = 0

    def nodes(self) -> list[Any]:
        self.reads += 1
        if self.down:
            raise SlurmUnavailable("sinfo: timed out after 15 s")
        time.sleep(self.delay_s)
        return []

    def jobs(self) -> list[Any]:
        return []


def view(controller: Controller, cache_s: float) -> ClusterView:
    return ClusterView(
        controller,  # type: ignore[arg-type]
        cache_s=cache_s,
        clock=lambda: datetime.now(UTC),
    )


def test_a_controller_that_does_not_answer_is_asked_less_and_less() -> None:
    slurm = Controller()
    cluster = view(slurm, cache_s=0.05)
    assert cluster.read() is not None
    slurm.down, slurm.reads = True, 0
    deadline = time.monotonic() + 1.0
    calls = 0
    while time.monotonic() < deadline:
        cluster.read(fresh=True)  # even a caller that insists waits its turn
        calls += 1
        time.sleep(0.001)
    assert cluster.down_since is not None
    # Without back-off every call would have asked; with it: 0, .05, .15, .35, .75 s, …
    # (the wait doubling up to BACKOFF_MAX × cache_s = 0.4 s).
    assert calls > 100 and 2 <= slurm.reads <= 7, (calls, slurm.reads)
    assert BACKOFF_MAX == 8
    slurm.down = False
    deadline = time.monotonic() + 5.0
    while cluster.down_since is not None:
        assert time.monotonic() < deadline, "the controller answers again but is not asked"
        cluster.read()
        time.sleep(0.01)
    assert cluster.down_reason == ""


def test_a_slow_answer_stretches_the_wait_before_the_next_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cluster_module, "SLOW_READ_S", 0.01)
    slurm = Controller()
    cluster = view(slurm, cache_s=0.01)
    slurm.delay_s = 0.2  # "slow": twenty times SLOW_READ_S: the next read waits 2 s or more
    cluster.read()
    slurm.delay_s = 0.0
    time.sleep(0.05)  # past cache_s, well within 10 × the read's 0.2 s
    before = slurm.reads
    cluster.read()
    assert slurm.reads == before, "read again right after a slow answer"
    # Asked again once that longer wait is over (a guard, not a timing).
    until_read(cluster, slurm, before + 1)


def until_read(cluster: ClusterView, slurm: Controller, reads: int) -> None:
    deadline = time.monotonic() + 5.0
    while slurm.reads < reads:
        assert time.monotonic() < deadline, "never read again"
        cluster.read()
        time.sleep(0.01)
