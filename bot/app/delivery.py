"""Outbox delivery: the `Notifier` port, the transient-failure signal, and `deliver`,
the one loop that sends what is due.

Its own module, below both callers: the worker's tick delivers after each pass, and
the shell face (`bot.faces.terminal`) delivers right after each command so a person sees
their DM at once. With `deliver` in `bot.faces.worker`, the terminal imported the worker,
which imports every periodic job, the digest among them, whose CLI printed through
the terminal: a cycle.

Delivery is at-least-once from the outbox's point of view: a notification is
marked sent only after the notifier returned, and a failure schedules a retry
(the notifier says how long to wait, e.g. Slack's Retry-After).
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Protocol

from bot.app.service import GpuService, OutboxItem
from bot.domain.errors import new_ref

log = logging.getLogger(__name__)


class DeliveryRetry(Exception):
    """A transient failure: try again after `retry_after` (rate limit, network)."""

    def __init__(
        self,
        reason: str,
        retry_after: timedelta = timedelta(seconds=30),
        *,
        stop_batch: bool = False,
    ) -> None:
        super().__init__(reason)
        self.retry_after = retry_after
        # Slack's 429 is for the whole app, not this item: the rest of the batch waits too.
        self.stop_batch = stop_batch


class Notifier(Protocol):
    def send(self, item: OutboxItem) -> None:
        """Delivers one notification, or raises DeliveryRetry / any error."""
        ...


_deliver_lock = threading.Lock()
_BACKOFF_CAP = timedelta(minutes=30)


def deliver(service: GpuService, notifier: Notifier, limit: int = 50) -> int:
    """Sends what is due; returns how many went out. Serialized within the process
    so the command thread and the worker thread never send one item twice."""
    sent = 0
    with _deliver_lock:
        for item in service.pending_notifications(limit):
            if not service.mark_attempt(item.id):
                continue  # another deliverer has it
            try:
                notifier.send(item)
            except DeliveryRetry as exc:
                service.mark_failed(item.id, str(exc), exc.retry_after)
                if exc.stop_batch:
                    break
                continue
            except Exception as exc:
                ref = new_ref()
                log.error(
                    "ref=%s notification %s to %s failed", ref, item.id, item.kind, exc_info=exc
                )
                backoff = min(_BACKOFF_CAP, timedelta(seconds=15 * 2 ** min(item.attempts, 10)))
                service.mark_failed(item.id, f"{type(exc).__name__} (ref {ref})", backoff)
                continue
            service.mark_sent(item.id)
            sent += 1
    return sent
