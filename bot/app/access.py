"""Who may do what, beyond "your own things are yours": who may start runs, who may
read a run's log, and the audit line every admin action leaves.

Starting a run executes code on the team's machines, so it can be narrowed to some
people (`GPUBOT_RUN_USERS`), the members of Slack user groups (`GPUBOT_RUN_GROUPS`)
and some channels (`GPUBOT_RUN_CHANNELS`). With no users and no groups set, everyone
who can use `/gpu` may run; admins (`GPUBOT_ADMINS`) always may.

Group members come through a narrow port, `Membership`: Slack's
`usergroups.users.list` in the Slack app (bot.faces.slack.membership), a fixed table in the
shell and in tests (`StaticMembership`). `RunGate` caches each group's members for a
few minutes, so a run request does not cost a Slack round trip each time, and turns a
failed lookup into a plain refusal.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

from sqlalchemy import event

from bot.app.config import Settings

if TYPE_CHECKING:
    from sqlalchemy.orm import SessionTransaction
    from sqlmodel import Session

    from bot.app.ports import Actor

AUDIT_LOGGER = "gpubot.audit"
_audit_log = logging.getLogger(AUDIT_LOGGER)
_PENDING = "gpubot_audit_pending"

# How long a user group's member list is trusted before it is read again.
GROUP_TTL_S = 300.0


class MembershipError(Exception):
    """The membership source could not say who is in a group (network, auth, unknown group)."""


class Membership(Protocol):
    """Who is in a user group. Raises `MembershipError` when that cannot be known; an
    empty answer means "nobody", never "could not ask"."""

    def members(self, group_id: str) -> frozenset[str]: ...


class StaticMembership:
    """A fixed table of groups: the shell (which has no Slack, so no groups unless one is
    given) and tests. An unknown group is an error, as it is on Slack."""

    def __init__(self, groups: Mapping[str, Iterable[str]] | None = None) -> None:
        self._groups = {g: frozenset(users) for g, users in (groups or {}).items()}

    def members(self, group_id: str) -> frozenset[str]:
        try:
            return self._groups[group_id]
        except KeyError:
            raise MembershipError(f"no user group {group_id}") from None


class RunGate:
    """The answers to "may this person start a run here?" and "may they read this log?"."""

    def __init__(
        self,
        settings: Settings,
        membership: Membership,
        *,
        ttl_s: float = GROUP_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.membership = membership
        self._ttl = ttl_s
        self._clock = clock
        self._groups: dict[str, tuple[float, frozenset[str]]] = {}
        self._lock = threading.Lock()

    def run_refusal(self, actor: Actor) -> str | None:
        """None when `actor` may start runs; else the reason, in words for them."""
        s = self.settings
        if actor.admin or (not s.run_users and not s.run_groups) or actor.key in s.run_users:
            return None
        unknown = False
        for group in s.run_groups:
            try:
                if actor.key in self._members(group):
                    return None
            except MembershipError as exc:
                log = logging.getLogger(__name__)
                log.warning("members of user group %s unknown: %s", group, exc)
                unknown = True
        if unknown:
            return (
                "I could not check with Slack whether you are in a group that may start "
                "runs, so nothing was queued. Try again in a minute."
            )
        return (
            "Starting runs is limited to some people here, and you are not one of them. "
            "An admin can add you (GPUBOT_RUN_USERS or GPUBOT_RUN_GROUPS)."
        )

    def channel_refusal(self, channel_id: str | None) -> str | None:
        """None when runs may be started from this channel (Slack only; the shell has none)."""
        allowed = self.settings.run_channels
        if not allowed or (channel_id and channel_id in allowed):
            return None
        where = ", ".join(f"<#{c}>" for c in allowed)
        return f"Runs are started from {where} only; nothing was queued."

    def may_read_log(self, actor: Actor, owner_key: str) -> bool:
        return self.settings.shared_logs or actor.admin or actor.key == owner_key

    def _members(self, group: str) -> frozenset[str]:
        now = self._clock()
        with self._lock:
            hit = self._groups.get(group)
        if hit is not None and now - hit[0] < self._ttl:
            return hit[1]
        members = self.membership.members(group)  # a failure is not cached: asked again next time
        with self._lock:
            self._groups[group] = (now, members)
        return members


# --- the audit line -------------------------------------------------------------------


def audit(actor: Actor, verb: str, target: str, session: Session | None = None) -> None:
    """One line on `gpubot.audit` for an admin action: who, what, to what.

    With `session`, the line is written when that transaction commits, so a refused or
    rolled-back (and retried) change leaves no line, or one, never two.
    """
    line = f"actor={actor.key} name={actor.name!r} verb={verb} target={target!r}"
    if session is None:
        _audit_log.info(line)
        return
    pending: list[str] | None = session.info.get(_PENDING)
    if pending is None:
        pending = session.info[_PENDING] = []
        event.listen(session, "after_commit", _write_pending)
        event.listen(session, "after_transaction_end", _drop_pending)
    pending.append(line)


def _write_pending(session: Session) -> None:
    for line in session.info.pop(_PENDING, None) or ():
        _audit_log.info(line)
    session.info[_PENDING] = []


def _drop_pending(session: Session, transaction: SessionTransaction) -> None:
    """The whole transaction ended (after commit, the lines are written already); a
    savepoint's rollback keeps them, as the outer transaction may still commit."""
    if transaction.parent is None:
        session.info[_PENDING] = []
