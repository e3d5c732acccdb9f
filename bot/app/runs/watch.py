"""Learning that a run's process ended when it ends, not at the next poll.

The worker's poll reads every running run once a tick (15 s by default), so a run that
ends waits for it: its owner hears late, and its GPUs are billed and held until the bot
notices. Each running run (each node of a run across hosts) therefore has a watcher
here: a thread that blocks on `HostShell.wait_gone` (a channel of its own on the host's
connection, or /proc on this machine), notes the time the process was seen gone on the
bot's clock, and asks for a tick (`Core.nudge`); the tick's poll then finishes the run
as before, with its GPUs billed to that time (`exited_at`) rather than to the moment
the tick got round to it.

A run's first figures are hurried the same way: for its first minute its watcher waits
in short steps and reads its status file between them, and asks for a tick once the
runner has measured some steps, so the live message shows them within seconds of being
measured rather than at the next tick (bot.app.watching.runwatch.live_edit).

The poll stays the truth and the safety net: a watcher only hurries it. A watcher whose
host cannot be reached now waits and looks again; one whose run the poll no longer
sees running is stopped (`keep_only`). Watchers are made by whichever process
dispatches and polls (the leading worker), and again by its poll after a restart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime

from bot.app.ports import HostAccess
from bot.app.watching.runwatch import has_figures
from bot.domain.clock import Clock
from provisioning.ssh import SshError
from training.status import parse_status

log = logging.getLogger(__name__)

# One wait's length on the host: a new wait is asked for after it, so a watcher notices
# that it was stopped within this long. Short enough that an SSH channel is not held
# idle for long, long enough that waiting costs about nothing.
WAIT_S = 60.0
# How long a watcher pauses when its host cannot be asked now (not ready, or backing
# off after failed dials: bot.app.hosts.remote), before it asks again.
RETRY_S = 5.0
# For a run's first minute its status is read between waits this long, until it shows
# the runner's first figures.
EARLY_S = 60.0
EARLY_WAIT_S = 2.0

Key = tuple[int, str, int]  # (run id, host name, process-group id)


@dataclass
class _Watch:
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    # Node 0's status file while its first figures are awaited; None once seen (or
    # for another node, whose status is not the run's).
    status: str | None = None
    # It is in a wait on the host (set as each wait starts, cleared on an SSH error): only
    # then does it stand in for the poll's look.
    waiting: bool = False


class ExitWatchers:
    """One thread per running process; `nudge` is called when one ends."""

    def __init__(
        self,
        access: HostAccess,
        clock: Clock,
        nudge: Callable[[], None],
        *,
        wait_s: float = WAIT_S,
        retry_s: float = RETRY_S,
    ) -> None:
        self.access = access
        self.clock = clock
        self.nudge = nudge
        self.wait_s = wait_s
        self.retry_s = retry_s
        self._watches: dict[Key, _Watch] = {}
        self._exited: dict[Key, datetime] = {}
        # Runs whose first figures a watcher saw and the poll has not read yet.
        self._figured: set[Key] = set()
        self._lock = threading.Lock()

    def ensure(self, run_id: int, host: str, pgid: int, status: str | None = None) -> None:
        """Watch this process unless it is watched already or was seen gone; `status`: its
        status file, read for the run's first figures."""
        key = (run_id, host, pgid)
        with self._lock:
            if key in self._exited:
                return
            found = self._watches.get(key)
            if found is not None and found.thread is not None and found.thread.is_alive():
                return
            watch = _Watch(status=status)
            watch.thread = threading.Thread(
                target=self._watch,
                args=(key, watch),
                name=f"run-{run_id}-watch",
                daemon=True,
            )
            self._watches[key] = watch
        watch.thread.start()

    def exited_at(self, run_id: int, host: str, pgid: int) -> datetime | None:
        """When a watcher saw the process gone (the bot's clock), or None."""
        with self._lock:
            return self._exited.get((run_id, host, pgid))

    def waiting(self, run_id: int, host: str, pgid: int) -> bool:
        """Whether a watcher is waiting on this process now (its thread alive, the host
        answering: a watcher retrying an unreachable host is not waiting) and has nothing
        for the poll: it has not seen it gone, nor its first figures unread."""
        key = (run_id, host, pgid)
        with self._lock:
            if key in self._exited or key in self._figured:
                return False
            found = self._watches.get(key)
            return (
                found is not None
                and found.thread is not None
                and found.thread.is_alive()
                and found.waiting
            )

    def read(self, host: str, pgid: int) -> None:
        """The poll read this process's status: its first figures, if a watcher saw
        them, are read."""
        with self._lock:
            self._figured = {k for k in self._figured if k[1:] != (host, pgid)}

    def keep_only(self, run_ids: Iterable[int]) -> None:
        """Stops the watchers of every run but these (the poll's running runs) and forgets
        the others' exit times."""
        wanted = set(run_ids)
        with self._lock:
            for k in [k for k in self._watches if k[0] not in wanted]:
                self._watches.pop(k).stop.set()
            for k in [k for k in self._exited if k[0] not in wanted]:
                del self._exited[k]
            self._figured = {k for k in self._figured if k[0] in wanted}

    def watching(self) -> list[Key]:
        with self._lock:
            return sorted(
                k for k, w in self._watches.items() if w.thread is not None and w.thread.is_alive()
            )

    def close(self) -> None:
        with self._lock:
            watches = list(self._watches.values())
            self._watches.clear()
        for w in watches:
            w.stop.set()

    def _watch(self, key: Key, watch: _Watch) -> None:
        run_id, host, pgid = key
        stop = watch.stop
        early_until = time.monotonic() + EARLY_S
        while not stop.is_set():
            try:
                seat = self.access.runner_for(host)  # reads the database: it may fail too
                if seat is None:
                    stop.wait(self.retry_s)
                    continue
                early = watch.status is not None and time.monotonic() < early_until
                watch.waiting = True
                gone = seat.runner.wait_gone(
                    seat.target, pgid, EARLY_WAIT_S if early else self.wait_s
                )
                if not gone and early and watch.status is not None:
                    raw = seat.runner.read_file(seat.target, watch.status)
                    status = parse_status(raw.decode("utf-8", "replace")) if raw else None
                    if status is not None and has_figures(status):
                        watch.status = None
                        with self._lock:
                            self._figured.add(key)
                        log.info("run %s has its first figures; asking for a tick", run_id)
                        self.nudge()
            except SshError as exc:
                watch.waiting = False
                log.info("watching run %s on %s: %s; looking again soon", run_id, host, exc)
                stop.wait(self.retry_s)
                continue
            except Exception:  # never die silently; the poll's ensure makes a new one next tick
                log.exception("watching run %s on %s failed", run_id, host)
                return
            if gone:
                with self._lock:
                    if stop.is_set():
                        return
                    self._exited[key] = self.clock.now()
                log.info("run %s's process on %s ended; asking for a tick", run_id, host)
                self.nudge()
                return
