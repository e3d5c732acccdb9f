"""The outbox as the use cases and the delivery loop see it: a DM or a channel post
written in the caller's transaction, then leased, sent and marked by the delivery loop
(bot.app.delivery)."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlalchemy import update
from sqlmodel import Session, col, select

from bot.app.outbox import enqueue
from bot.app.ports import Core
from bot.app.service.common import IN_FLIGHT, OutboxItem
from bot.domain import views
from db.models import Notification
from db.session import transaction

log = logging.getLogger(__name__)


class Notices:
    """DMs and channel posts in, deliveries out."""

    def __init__(self, core: Core) -> None:
        self.core = core

    def notify_dm(
        self,
        s: Session,
        user_key: str,
        view: views.View,
        now: datetime,
        dedupe: str | None,
        attachment: tuple[str, bytes] | None = None,
    ) -> None:
        enqueue(s, "dm", user_key, view, now, dedupe, attachment)

    def notify_channel(
        self,
        view: views.View,
        dedupe: str | None = None,
        attachment: tuple[str, bytes] | None = None,
    ) -> None:
        """A post to the team channel; `attachment` is (file name, bytes), e.g. a chart."""
        with transaction(self.core.engine) as s:
            enqueue(
                s,
                "channel",
                self.core.settings.channel,
                view,
                self.core.clock.now(),
                dedupe,
                attachment,
            )

    def pending_notifications(self, limit: int = 50) -> list[OutboxItem]:
        with transaction(self.core.engine, write=False) as s:
            now = self.core.clock.now()
            rows = s.exec(
                select(Notification)
                .where(col(Notification.sent_at).is_(None), col(Notification.deliver_after) <= now)
                .order_by(col(Notification.id))
                .limit(limit)
            ).all()
            return [
                OutboxItem(
                    id=n.id or 0,
                    kind=n.kind,
                    target=n.target,
                    view=views.View.from_dict(n.view),
                    attempts=n.attempts,
                    maybe_sent=n.last_error == IN_FLIGHT,
                    attachment=(n.attachment_name or "attachment", n.attachment)
                    if n.attachment is not None
                    else None,
                    edit_of=n.edit_of,
                )
                for n in rows
            ]

    def mark_attempt(self, item_id: int, lease: timedelta = timedelta(seconds=60)) -> bool:
        """Claims one notification for sending, before the send starts; False when
        another deliverer (a replica, the worker) claimed it first.

        The claim pushes `deliver_after` out by `lease`, so nobody else picks the item
        up meanwhile. If this process dies mid-send, the item becomes due again after
        the lease with `last_error` still "in flight": its outcome is unknown, and a
        notifier that can check (Slack: the message's metadata) must check before
        sending it again.
        """
        now = self.core.clock.now()
        with transaction(self.core.engine) as s:
            claimed = s.exec(
                update(Notification)
                .where(
                    col(Notification.id) == item_id,
                    col(Notification.sent_at).is_(None),
                    col(Notification.deliver_after) <= now,
                )
                .values(
                    attempts=Notification.attempts + 1,
                    last_error=IN_FLIGHT,
                    deliver_after=now + lease,
                )
            )
            return bool(claimed.rowcount == 1)

    def mark_sent(self, item_id: int) -> None:
        with transaction(self.core.engine) as s:
            n = s.get(Notification, item_id)
            if n is not None and n.sent_at is None:
                n.sent_at = self.core.clock.now()
                n.last_error = None
                s.add(n)

    def mark_failed(self, item_id: int, error: str, retry_after: timedelta) -> None:
        with transaction(self.core.engine) as s:
            n = s.get(Notification, item_id)
            if n is not None and n.sent_at is None:
                n.last_error = error[:500]
                n.deliver_after = self.core.clock.now() + retry_after
                s.add(n)
