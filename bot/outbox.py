"""Writing to the outbox: one row per notification, in the caller's transaction.

The one place that knows the row's shape and the dedupe rule, for the service and for the
modules that run inside its transactions without holding it (bot.budgets).
"""

from __future__ import annotations

from datetime import datetime

from sqlmodel import Session, select

from bot import views
from db.models import Notification


def enqueue(
    s: Session,
    kind: str,
    target: str,
    view: views.View,
    now: datetime,
    dedupe: str | None,
    attachment: tuple[str, bytes] | None = None,
) -> None:
    """Queues one DM ("dm", a user key) or channel post ("channel", a name or id); a
    `dedupe` key already in the outbox means this change was reported: nothing is added."""
    if dedupe is not None:
        exists = s.exec(select(Notification.id).where(Notification.dedupe_key == dedupe)).first()
        if exists is not None:
            return
    s.add(
        Notification(
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
    )
