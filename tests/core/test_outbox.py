"""The outbox: written with the change, delivered by the worker, sent once, retried
after a transient failure when the notifier says so."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from bot.app.delivery import DeliveryRetry, deliver
from bot.app.outbox import DeliveryFacts, StoredDeliveryLog
from bot.app.service import GpuService, OutboxItem
from bot.domain.clock import VirtualClock
from bot.domain.commands import Release, Reserve
from db.models import Notification
from tests.core.helpers import actor, host, make_service


class Recorder:
    """A notifier double: records sends, fails the first `fail` of them."""

    def __init__(self, fail: int = 0, transient: bool = True) -> None:
        self.sent: list[OutboxItem] = []
        self.fail = fail
        self.transient = transient

    def send(self, item: OutboxItem) -> None:
        if self.fail:
            self.fail -= 1
            if self.transient:
                raise DeliveryRetry("rate limited", timedelta(seconds=30))
            raise ConnectionError("network down")
        self.sent.append(item)


def _one_dm(engine: Engine) -> tuple[GpuService, VirtualClock]:
    svc, clock = make_service(engine, [host("one", "A100", 1)])
    svc.reserve(actor(svc, "alice"), Reserve())
    svc.reserve(actor(svc, "bob"), Reserve())
    svc.release(actor(svc, "alice"), Release())
    return svc, clock


def test_each_notification_is_sent_once(engine: Engine) -> None:
    svc, _ = _one_dm(engine)
    rec = Recorder()
    assert deliver(svc, rec) == 1
    assert deliver(svc, rec) == 0
    assert [(i.kind, i.target) for i in rec.sent] == [("dm", "bob")]
    assert "Your turn" in rec.sent[0].view.text


def test_a_rate_limit_defers_delivery_until_retry_after(engine: Engine) -> None:
    svc, clock = _one_dm(engine)
    rec = Recorder(fail=1)
    assert deliver(svc, rec) == 0
    with Session(engine) as s:
        n = s.exec(select(Notification)).one()
    assert n.attempts == 1 and n.sent_at is None and n.last_error == "rate limited"
    clock.advance(timedelta(seconds=10))
    assert deliver(svc, rec) == 0, "not before Retry-After"
    clock.advance(timedelta(seconds=25))
    assert deliver(svc, rec) == 1
    with Session(engine) as s:
        n = s.exec(select(Notification)).one()
    assert n.attempts == 2 and n.sent_at is not None and n.last_error is None


def test_a_send_cut_short_by_a_crash_is_flagged_maybe_sent(engine: Engine) -> None:
    svc, clock = _one_dm(engine)
    item = svc.pending_notifications()[0]
    assert not item.maybe_sent
    assert svc.mark_attempt(item.id)
    # ... the process dies here, before mark_sent ...
    assert svc.pending_notifications() == [], "claimed: nobody else sends it during the lease"
    assert not svc.mark_attempt(item.id), "a second deliverer cannot claim it"
    clock.advance(timedelta(seconds=61))
    again = svc.pending_notifications()[0]
    assert again.id == item.id and again.maybe_sent and again.attempts == 1


def test_an_unexpected_failure_backs_off_and_keeps_the_message(engine: Engine) -> None:
    svc, clock = _one_dm(engine)
    rec = Recorder(fail=1, transient=False)
    assert deliver(svc, rec) == 0
    with Session(engine) as s:
        n = s.exec(select(Notification)).one()
    assert n.sent_at is None and n.last_error is not None and "ConnectionError" in n.last_error
    clock.advance(timedelta(minutes=1))
    assert deliver(svc, rec) == 1


def test_delivery_facts_outlive_the_process_that_wrote_them(engine: Engine) -> None:
    """What one deliverer writes down, a second one on the same database reads: where a
    target lives, how far each notification got, and Slack's pause (which never shrinks)."""
    svc, clock = _one_dm(engine)
    (item,) = svc.pending_notifications()
    first, second = StoredDeliveryLog(engine, clock), StoredDeliveryLog(engine, clock)

    assert second.conversation("channel", "gpu") is None
    first.remember_conversation("channel", "gpu", "C0GPU0001")
    first.remember_conversation("dm", "bob", "D0BOB0001")
    assert second.conversation("channel", "gpu") == "C0GPU0001"
    assert second.conversation("dm", "bob") == "D0BOB0001"
    assert second.conversation("dm", "gpu") is None

    assert second.facts(item.id) == DeliveryFacts()
    first.attempt_started(item.id, "D0BOB0001")
    maybe = second.facts(item.id)
    assert maybe.attempt_channel == "D0BOB0001" and maybe.attempt_started_at == clock.now()
    assert maybe.posted_ts is None
    first.attempt_refused(item.id)
    assert second.facts(item.id).attempt_started_at is None
    first.attempt_started(item.id, "D0BOB0001")
    first.posted(item.id, "D0BOB0001", "1767600000.000100")
    done = second.facts(item.id)
    assert done.posted_ts == "1767600000.000100" and done.attempt_started_at is None

    assert second.paused_until() is None
    later = clock.now() + timedelta(seconds=30)
    first.pause(later, "chat.postMessage: 429")
    second.pause(clock.now() + timedelta(seconds=5), "conversations.history: 429")
    assert first.paused_until() == later, "a shorter Retry-After never cuts a longer one"
