"""Starts that upload code or a checkpoint, run off the tick.

Fetching or uploading a run's code (bot.app.hosts.sources: a staged tree over SSH, a git clone
on the host) takes as long as the code and the link make it, so dispatch claims the run
and its GPUs in its own transaction and hands the rest of the start (code, runner) to
this small pool: the tick returns at once and every other grant, placement and DM goes
ahead. The run is "starting" meanwhile, its placement saying "uploading code" or, for a
resumed run, "uploading its checkpoint" (`/gpu queue` shows it), and poll leaves it alone
while its start is in flight here.

Nothing is lost if the worker dies mid-upload: the run is "starting" with no process id,
which the next worker's poll checks on the host after the starting grace (its runner
never wrote a pgid file) and puts back in line; its next dispatch uploads it again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)


class OffTickStarts:
    """At most one start per run in flight; `workers` at once."""

    def __init__(self, workers: int = 4) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="run-start")
        self._inflight: dict[int, Future[None]] = {}
        # A start's own result (started or not) is recorded by the start itself.
        self._lock = threading.Lock()

    def submit(self, run_id: int, start: Callable[[], Any]) -> None:
        with self._lock:
            self._inflight[run_id] = self._pool.submit(self._guarded, run_id, start)

    def in_flight(self, run_id: int) -> bool:
        with self._lock:
            running = self._inflight.get(run_id)
            return running is not None and not running.done()

    def wait(self, timeout: float | None = None) -> None:
        """Every start in flight, finished (tests; a worker shutting down)."""
        with self._lock:
            futures = list(self._inflight.values())
        for f in futures:
            f.exception(timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    @staticmethod
    def _guarded(run_id: int, start: Callable[[], Any]) -> None:
        try:
            start()
        except Exception:  # the start ends the run itself; this only keeps the thread's word
            log.exception("starting run %s failed", run_id)
