"""What tests of a whole runtime read back and wait on: its hosts checked, a run's row, a
person's DMs in the order they were written, and a guarded poll-and-dispatch loop. One
copy, where four test modules each had their own."""

from __future__ import annotations

import time
from collections.abc import Callable

from sqlmodel import Session, col, select

from bot.app.hosts.hostcheck import HostChecker
from bot.app.runs import RunService
from bot.faces.runtime import Runtime
from db.models import Notification, TrainingRun


def checked(rt: Runtime) -> Runtime:
    """The runtime after its declared hosts' first checks have run and finished, as the
    worker's first host-check pass does at start: a static host is granted on and placed
    on only once a check has reached it (bot.app.hosts.hostcheck)."""
    for checker in rt.service.places.checkers:
        assert isinstance(checker, HostChecker)
        checker.tick()
        checker.wait(timeout=300)
    return rt


def run_row(rt: Runtime, rid: int) -> TrainingRun:
    """The run as the database has it now."""
    with Session(rt.engine) as s:
        run = s.get(TrainingRun, rid)
        assert run is not None
        return run


def dms(rt: Runtime, user: str) -> list[str]:
    """The DMs written for `user`, oldest first."""
    with Session(rt.engine) as s:
        return [
            n.text
            for n in s.exec(
                select(Notification)
                .where(Notification.kind == "dm", Notification.target == user)
                .order_by(col(Notification.id))
            )
        ]


def drive_until(
    runs: RunService, done: Callable[[], bool], what: str, guard_s: float = 300.0
) -> None:
    """Polls and dispatches, as the worker's tick does, until `done`. `guard_s` guards
    against a hang (torchrun on a loaded machine); it is not a speed goal."""
    deadline = time.monotonic() + guard_s
    while not done():
        assert time.monotonic() < deadline, what
        runs.poll()
        runs.dispatch()
        time.sleep(0.2)
