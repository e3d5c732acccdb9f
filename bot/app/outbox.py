"""Writing to the outbox: one row per notification, in the caller's transaction; and
the delivery facts a notifier stores beside each row (DeliveryLog).

The one place that knows the row's shape and the dedupe rule, for the service and for the
modules that run inside its transactions without holding it (bot.app.money.budgets).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Protocol

from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select, update

from bot.domain import views
from bot.domain.clock import Clock
from db.models import DeliveryPause, Notification, SlackConversation
from db.session import transaction


def enqueue(
    s: Session,
    kind: str,
    target: str,
    view: views.View,
    now: datetime,
    dedupe: str | None,
    attachment: tuple[str, bytes] | None = None,
) -> int | None:
    """Queues one DM ("dm", a user key) or channel post ("channel", a name or id); a
    `dedupe` key already in the outbox means this change was reported: nothing is added.
    Returns the new row's id (None when deduplicated), for a message later edited in place."""
    if dedupe is not None:
        exists = s.exec(select(Notification.id).where(Notification.dedupe_key == dedupe)).first()
        if exists is not None:
            return None
    row = Notification(
        kind=kind,
        target=target,
        text=view.text,
        view=view.to_dict(),
        created_at=now,
        deliver_after=now,
        dedupe_key=dedupe,
        attachment_name=attachment[0] if attachment else None,
        attachment=attachment[1] if attachment else None,
    )
    s.add(row)
    s.flush()
    return row.id


# chat.update is Tier 3 ("50+ per minute" per workspace, ../shared/slack/limits.json); edits
# are spaced so that at most 40 go out a minute, which also keeps any one channel under
# one a second.
EDIT_SPACING: Final = timedelta(seconds=1.5)
SUPERSEDED: Final = "superseded by a newer edit"
# The kind of an edit's row: not a new DM, so nothing that counts DMs counts it.
EDIT: Final = "edit"


def next_edit_slot(s: Session, now: datetime) -> datetime:
    """When the next edit may go out: `EDIT_SPACING` after the latest one sent or due.

    From the outbox itself, so every worker and replica spaces edits alike: a queued edit
    counts at its `deliver_after`, a sent one at its `sent_at` (a claim's lease moves
    `deliver_after` and must not count)."""
    recent = now - timedelta(minutes=5)
    latest = now - EDIT_SPACING
    for due, sent in s.exec(
        select(Notification.deliver_after, Notification.sent_at).where(
            col(Notification.edit_of).is_not(None), col(Notification.created_at) >= recent
        )
    ):
        at = sent if sent is not None else due
        latest = max(latest, at)
    return max(now, latest + EDIT_SPACING)


def enqueue_edit(
    s: Session, message_id: int, target: str, view: views.View, now: datetime
) -> datetime:
    """Queues an edit of message `message_id` (a DM to `target`) (the outbox row of the message as first
    sent) at the next free slot; older edits of it not yet tried are superseded, since only
    the newest matters. Returns when it is due."""
    for old in s.exec(
        select(Notification).where(
            col(Notification.edit_of) == message_id,
            col(Notification.sent_at).is_(None),
            col(Notification.attempts) == 0,
        )
    ):
        old.sent_at = now
        old.last_error = SUPERSEDED
        s.add(old)
    s.flush()
    due = next_edit_slot(s, now)
    s.add(
        Notification(
            kind=EDIT,
            target=target,
            text=view.text,
            view=view.to_dict(),
            created_at=now,
            deliver_after=due,
            edit_of=message_id,
        )
    )
    s.flush()
    return due


# --- what the deliverer knows, stored ------------------------------------------------------

SLACK_PAUSE = "slack"


@dataclass(frozen=True)
class DeliveryFacts:
    """One notification's delivery as far as anybody knows: an attempt that started and
    has no recorded outcome is maybe-sent; a `posted_ts` means the message exists."""

    attempt_channel: str | None = None
    attempt_started_at: datetime | None = None
    posted_ts: str | None = None
    upload_started_at: datetime | None = None
    uploaded_at: datetime | None = None


class DeliveryLog(Protocol):
    """The facts a notifier records around each call to Slack, so that the question
    "did that post go out?" is answered from what was written down rather than from one
    process's memory. Every method commits before it returns."""

    def now(self) -> datetime: ...

    def conversation(self, kind: str, name: str) -> str | None:
        """The stored channel id of a channel name or a user's DM, if learnt."""
        ...

    def remember_conversation(self, kind: str, name: str, channel_id: str) -> None: ...

    def facts(self, item_id: int) -> DeliveryFacts: ...

    def attempt_started(self, item_id: int, channel: str) -> None:
        """Before chat.postMessage: from here until `posted` or `attempt_refused`, the
        message may exist."""
        ...

    def attempt_refused(self, item_id: int) -> None:
        """Slack answered without taking the message (429, an error): not maybe-sent."""
        ...

    def posted(self, item_id: int, channel: str, ts: str) -> None: ...

    def upload_started(self, item_id: int) -> None: ...

    def upload_refused(self, item_id: int) -> None: ...

    def uploaded(self, item_id: int) -> None: ...

    def paused_until(self) -> datetime | None:
        """Until when Slack asked us not to call (a 429's Retry-After); None: no pause."""
        ...

    def pause(self, until: datetime, reason: str) -> None:
        """Records a 429; an earlier end never shortens a later one already stored."""
        ...


class StoredDeliveryLog:
    """DeliveryLog in the database: shared by every process on it and kept across restarts."""

    def __init__(self, engine: Engine, clock: Clock) -> None:
        self._engine = engine
        self._clock = clock

    def now(self) -> datetime:
        return self._clock.now()

    def conversation(self, kind: str, name: str) -> str | None:
        with transaction(self._engine, write=False) as s:
            row = s.get(SlackConversation, (kind, name))
            return row.channel_id if row is not None else None

    def remember_conversation(self, kind: str, name: str, channel_id: str) -> None:
        try:
            with transaction(self._engine) as s:
                row = s.get(SlackConversation, (kind, name))
                if row is None:
                    row = SlackConversation(kind=kind, name=name, channel_id=channel_id)
                elif row.channel_id == channel_id:
                    return
                row.channel_id = channel_id
                row.resolved_at = self._clock.now()
                s.add(row)
        except IntegrityError:
            pass  # another process stored it at the same moment; ids of one name agree

    def _update(self, item_id: int, **values: Any) -> None:
        with transaction(self._engine) as s:
            s.exec(
                update(Notification)
                .where(col(Notification.id) == item_id, col(Notification.sent_at).is_(None))
                .values(**values)
            )

    def facts(self, item_id: int) -> DeliveryFacts:
        with transaction(self._engine, write=False) as s:
            n = s.get(Notification, item_id)
            if n is None:
                return DeliveryFacts()
            return DeliveryFacts(
                attempt_channel=n.attempt_channel,
                attempt_started_at=n.attempt_started_at,
                posted_ts=n.posted_ts,
                upload_started_at=n.upload_started_at,
                uploaded_at=n.uploaded_at,
            )

    def attempt_started(self, item_id: int, channel: str) -> None:
        self._update(item_id, attempt_channel=channel, attempt_started_at=self._clock.now())

    def attempt_refused(self, item_id: int) -> None:
        self._update(item_id, attempt_started_at=None)

    def posted(self, item_id: int, channel: str, ts: str) -> None:
        self._update(item_id, attempt_channel=channel, attempt_started_at=None, posted_ts=ts)

    def upload_started(self, item_id: int) -> None:
        self._update(item_id, upload_started_at=self._clock.now())

    def upload_refused(self, item_id: int) -> None:
        self._update(item_id, upload_started_at=None)

    def uploaded(self, item_id: int) -> None:
        self._update(item_id, upload_started_at=None, uploaded_at=self._clock.now())

    def paused_until(self) -> datetime | None:
        with transaction(self._engine, write=False) as s:
            row = s.get(DeliveryPause, SLACK_PAUSE)
            return row.until if row is not None else None

    def pause(self, until: datetime, reason: str) -> None:
        try:
            with transaction(self._engine) as s:
                row = s.get(DeliveryPause, SLACK_PAUSE)
                if row is None:
                    row = DeliveryPause(name=SLACK_PAUSE, until=until)
                elif row.until >= until:
                    return
                row.until = until
                row.reason = reason[:200]
                s.add(row)
        except IntegrityError:
            self.pause(until, reason)  # a concurrent first 429: now the row exists


class MemoryDeliveryLog:
    """DeliveryLog in one process's memory, for callers that have no database at hand.

    It survives nothing: after a restart a maybe-sent post cannot be checked, and with no
    clock shared with the outbox it keeps no pause (each item still waits its own
    Retry-After in the outbox). `gpubot worker` and `serve` use StoredDeliveryLog.
    """

    def __init__(self) -> None:
        self._conversations: dict[tuple[str, str], str] = {}
        self._facts: dict[int, DeliveryFacts] = {}

    def now(self) -> datetime:
        return datetime.now(UTC)

    def conversation(self, kind: str, name: str) -> str | None:
        return self._conversations.get((kind, name))

    def remember_conversation(self, kind: str, name: str, channel_id: str) -> None:
        self._conversations[(kind, name)] = channel_id

    def facts(self, item_id: int) -> DeliveryFacts:
        return self._facts.get(item_id, DeliveryFacts())

    def _set(self, item_id: int, **values: Any) -> None:
        self._facts[item_id] = replace(self.facts(item_id), **values)

    def attempt_started(self, item_id: int, channel: str) -> None:
        self._set(item_id, attempt_channel=channel, attempt_started_at=self.now())

    def attempt_refused(self, item_id: int) -> None:
        self._set(item_id, attempt_started_at=None)

    def posted(self, item_id: int, channel: str, ts: str) -> None:
        self._set(item_id, attempt_channel=channel, attempt_started_at=None, posted_ts=ts)

    def upload_started(self, item_id: int) -> None:
        self._set(item_id, upload_started_at=self.now())

    def upload_refused(self, item_id: int) -> None:
        self._set(item_id, upload_started_at=None)

    def uploaded(self, item_id: int) -> None:
        self._set(item_id, upload_started_at=None, uploaded_at=self.now())

    def paused_until(self) -> datetime | None:
        return None

    def pause(self, until: datetime, reason: str) -> None:
        return None
