"""Room on a host's disk for runs: read it, mark a host that has none, bring it back.

A run whose host's disk fills fails in whatever way its program meets the ENOSPC (a
traceback, a status file that could not be written, nothing at all), and the next run
placed there fails the same way. So when a run on a host the bot places for ends failed,
the poll reads the free space where runs live there (`free_mb`, one `df`): with less than
`Settings.min_free_mb` the run fails with "disk full on HOST" in its result, and the host
is marked full (`mark_full`): unreachable for placements and grants, as a host drained
for a spot notice is, with `down_reason` saying why, while its SSH is still used (its
other runs are read, signalled and ended through it: `down_since` stays unset). The host
checks (bot.app.hosts.hostcheck) read the room again on their backoff; the first check
that finds room brings the host back.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlalchemy.engine import Engine
from sqlmodel import select

from bot.app.config import Settings
from bot.app.money.billing import note_host_state
from db.models import HOST_READY, HOST_UNREACHABLE, Host
from db.session import transaction
from provisioning import shell
from provisioning.hostshell import HostShell
from provisioning.ssh import SshTarget

log = logging.getLogger(__name__)

# What a host marked full says, first: the host checks and the status read it back.
FULL_PREFIX = "disk full"
# When a full host is first read again (then the checks' own backoff).
FULL_RECHECK = timedelta(seconds=30)
DF_TIMEOUT_S = 30.0


def free_mb(runner: HostShell, target: SshTarget, path: str) -> float | None:
    """Free megabytes on the filesystem that holds `path` (its nearest existing parent),
    for an unprivileged user; None when the host cannot tell (no `df`, no such path).
    Raises SshError when the host cannot be asked."""
    line = shell.join(["df", "-Pk", "--", shell.anchored(path)])
    # The path itself may not exist yet (a host's first run): its parent is read then.
    parent = path.rstrip("/").rpartition("/")[0] or "."
    fallback = shell.join(["df", "-Pk", "--", shell.anchored(parent)])
    done = runner.run(target, f"{line} 2>/dev/null || {fallback}", timeout=DF_TIMEOUT_S)
    if not done.ok:
        return None
    rows = [r.split() for r in done.stdout.splitlines()[1:] if r.strip()]
    try:
        return int(rows[-1][3]) / 1024.0
    except (IndexError, ValueError):
        return None


def full_reason(host: str, path: str, free: float) -> str:
    """The words a full host and its failed run are shown with."""
    return f"{FULL_PREFIX} on {host}: {free:.1f} MB free in {path}"


def is_full(free: float | None, settings: Settings) -> bool:
    return free is not None and free < settings.min_free_mb


def mark_full(engine: Engine, settings: Settings, host: str, reason: str, now: datetime) -> None:
    """Takes a host that answers out of placements and grants until a host check finds
    room (`down_reason` says so in `/gpu status`; the channel hears when it is back)."""
    with transaction(engine) as s:
        row = s.exec(select(Host).where(Host.name == host)).first()
        if row is None or row.state not in (HOST_READY, HOST_UNREACHABLE):
            return
        was_ready = row.state == HOST_READY
        row.state = HOST_UNREACHABLE
        row.down_reason = reason[:300]
        row.check_failures = max(row.check_failures, 1)
        row.next_check_at = now + FULL_RECHECK
        row.updated_at = now
        s.add(row)
        if was_ready:
            s.flush()
            note_host_state(s, row, now, settings)
    if was_ready:
        log.warning("host %s: %s; nothing new is placed there until it has room", host, reason)
