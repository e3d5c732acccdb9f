"""A run's exit watcher (bot.app.runs.watch) when finding its host fails: the database it
reads hosts from can be down, or dropped under it while a test ends. The watcher must
end with a log line, not an unhandled thread exception, and the next poll's `ensure`
must watch the process again once hosts can be read."""

from __future__ import annotations

import logging
import subprocess
import threading
from pathlib import Path

import pytest

from bot.app.ports import HostSeat
from bot.app.runs.watch import ExitWatchers
from bot.domain.clock import VirtualClock
from provisioning.local_runner import LOCAL_TARGET, LocalRunner
from tests.core.helpers import wait_for


class FlakyAccess:
    """`HostAccess` whose lookups raise until `healthy` is set."""

    def __init__(self, runs_dir: Path) -> None:
        self.healthy = threading.Event()
        self.seat = HostSeat(LocalRunner(), LOCAL_TARGET, runs_dir)
        self.lookups = 0

    def runner_for(self, host_name: str) -> HostSeat | None:
        self.lookups += 1
        if not self.healthy.is_set():
            raise RuntimeError('relation "host" does not exist')
        return self.seat


def test_a_failed_host_lookup_ends_the_watcher_quietly_and_the_next_poll_watches_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    crashed: list[threading.ExceptHookArgs] = []
    old_hook = threading.excepthook
    threading.excepthook = crashed.append
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    access = FlakyAccess(tmp_path)
    nudges = threading.Event()
    watchers = ExitWatchers(access, VirtualClock(), nudges.set, wait_s=0.5, retry_s=0.05)
    try:
        with caplog.at_level(logging.ERROR, logger="bot.app.runs.watch"):
            watchers.ensure(7, "local", proc.pid)
            wait_for(lambda: access.lookups >= 1 and not watchers.watching())
        assert crashed == []
        assert any("watching run 7 on local failed" in r.getMessage() for r in caplog.records)
        assert watchers.exited_at(7, "local", proc.pid) is None  # nothing was seen

        access.healthy.set()
        watchers.ensure(7, "local", proc.pid)  # the poll, a tick later
        assert watchers.watching() == [(7, "local", proc.pid)]
        proc.kill()
        proc.wait()
        assert nudges.wait(30)
        assert watchers.exited_at(7, "local", proc.pid) is not None
        assert crashed == []
    finally:
        threading.excepthook = old_hook
        watchers.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
