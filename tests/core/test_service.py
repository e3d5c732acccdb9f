"""The reservation use cases, on SQLite and PostgreSQL, with a virtual clock."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.app.service import GpuService
from bot.domain.commands import Extend, Release, Reserve, Status
from bot.domain.errors import UserError
from db.models import Notification, Reservation, UsageInterval, User
from tests.core.helpers import HOUR, actor, host, make_service

A100_BOX = host("box-a", "A100", 8, hourly=21.96)
H100_BOX = host("box-h", "H100", 2, hourly=13.76)


def dms(engine: Engine, to: str | None = None) -> list[Notification]:
    with Session(engine) as s:
        q = select(Notification).where(Notification.kind == "dm").order_by(col(Notification.id))
        rows = list(s.exec(q))
    return [n for n in rows if to is None or n.target == to]


def reservation(engine: Engine, rid: int) -> Reservation:
    with Session(engine) as s:
        res = s.get(Reservation, rid)
        assert res is not None
        return res


def rid_of(svc: GpuService, name: str) -> int:
    with Session(svc.engine) as s:
        rows = s.exec(select(Reservation).order_by(col(Reservation.id).desc())).all()
        for r in rows:
            from db.models import User

            u = s.get(User, r.user_id)
            if u is not None and u.key == name:
                assert r.id is not None
                return r.id
    raise AssertionError(f"no reservation for {name}")


def test_grant_reply_says_which_gpus_where_and_how(engine: Engine) -> None:
    svc, _ = make_service(engine, [A100_BOX])
    reply = svc.reserve(actor(svc, "alice"), Reserve(count=2, model="A100", duration=3 * HOUR))
    text = reply.view.text
    assert "Reserved" in text and "box-a" in text and "GPUs A100 0, 1" in text
    code = next(b for b in reply.view.blocks if getattr(b, "type", "") == "code")
    assert "ssh ubuntu@box-a.example" in code.text  # type: ignore[union-attr]
    assert "CUDA_VISIBLE_DEVICES=0,1" in code.text  # type: ignore[union-attr]
    res = reservation(engine, rid_of(svc, "alice"))
    assert res.state == "active" and res.ends_at is not None and res.granted_at is not None
    assert res.ends_at - res.granted_at == 3 * HOUR


def test_usage_intervals_carry_each_gpus_share_of_the_price(engine: Engine) -> None:
    svc, _ = make_service(engine, [A100_BOX])
    svc.reserve(actor(svc, "alice"), Reserve(count=2, model="A100"))
    with Session(engine) as s:
        ivs = s.exec(select(UsageInterval)).all()
    assert len(ivs) == 2
    assert all(abs(iv.usd_per_hour - 21.96 / 8) < 1e-9 and iv.market == "ondemand" for iv in ivs)


def test_full_pool_waits_in_line_and_release_grants_with_a_dm(engine: Engine) -> None:
    svc, _ = make_service(engine, [H100_BOX])
    svc.reserve(actor(svc, "alice"), Reserve(count=2, model="H100"))
    wait = svc.reserve(actor(svc, "bob"), Reserve(count=1, model="H100"))
    assert "waiting" in wait.view.text and "first in line" in wait.view.text
    wait2 = svc.reserve(actor(svc, "carol"), Reserve(count=1, model="H100"))
    assert "1 ahead of you" in wait2.view.text
    assert dms(engine) == []
    svc.release(actor(svc, "alice"), Release())
    bob, carol = reservation(engine, rid_of(svc, "bob")), reservation(engine, rid_of(svc, "carol"))
    assert bob.state == "active" and carol.state == "active"
    assert [n.target for n in dms(engine)] == ["bob", "carol"]
    assert "Your turn" in dms(engine, "bob")[0].text


def test_line_order_is_first_come_first_served_per_model(engine: Engine) -> None:
    svc, _ = make_service(engine, [H100_BOX, A100_BOX])
    svc.reserve(actor(svc, "alice"), Reserve(count=2, model="H100"))
    svc.reserve(actor(svc, "bob"), Reserve(count=2, model="H100"))  # waits
    svc.reserve(actor(svc, "carol"), Reserve(count=1, model="H100"))  # waits behind bob
    # Another model is not blocked by the H100 line.
    dave = svc.reserve(actor(svc, "dave"), Reserve(count=1, model="A100"))
    assert "Reserved" in dave.view.text
    svc.release(actor(svc, "alice"), Release())
    assert reservation(engine, rid_of(svc, "bob")).state == "active"
    assert reservation(engine, rid_of(svc, "carol")).state == "waiting"


def test_best_fit_keeps_big_holes_for_big_requests(engine: Engine) -> None:
    svc, _ = make_service(engine, [host("big", "A100", 8), host("small", "A100", 1)])
    svc.reserve(actor(svc, "alice"), Reserve(count=1, model="A100"))
    res = reservation(engine, rid_of(svc, "alice"))
    big = svc.reserve(actor(svc, "bob"), Reserve(count=8, model="A100"))
    assert "Reserved" in big.view.text, "a 1-GPU request must not break up the only 8-GPU host"
    assert res.host_id != reservation(engine, rid_of(svc, "bob")).host_id


def test_expiry_ends_the_reservation_at_its_time_and_grants_the_next(engine: Engine) -> None:
    svc, clock = make_service(engine, [host("one", "A100", 1)])
    svc.reserve(actor(svc, "alice"), Reserve(duration=HOUR))
    svc.reserve(actor(svc, "bob"), Reserve(duration=HOUR))
    start = clock.now()
    clock.advance(HOUR + timedelta(seconds=20))  # the tick runs a little late
    report = svc.tick()
    assert report.expired == 1 and report.granted == 1
    alice = reservation(engine, rid_of(svc, "alice"))
    assert alice.state == "expired"
    with Session(engine) as s:
        iv = s.exec(select(UsageInterval).where(UsageInterval.reservation_id == alice.id)).one()
    assert iv.ended_at == start + HOUR, "the holder pays until the end they asked for, not the tick"
    assert "ended" in dms(engine, "alice")[-1].text
    assert "Your turn" in dms(engine, "bob")[-1].text
    assert svc.tick() == type(report)(), "a second tick changes nothing"


def test_warning_ten_minutes_before_the_end_goes_out_once(engine: Engine) -> None:
    svc, clock = make_service(engine, [host("one", "A100", 1)])
    svc.reserve(actor(svc, "alice"), Reserve(duration=HOUR))
    clock.advance(timedelta(minutes=45))
    assert svc.tick().warned == 0
    clock.advance(timedelta(minutes=6))  # 9 minutes left
    assert svc.tick().warned == 1
    assert svc.tick().warned == 0
    warning = dms(engine, "alice")
    assert len(warning) == 1 and "ends" in warning[0].text and "/gpu extend" in warning[0].text
    buttons = next(b for b in warning[0].view["blocks"] if b["type"] == "actions")["buttons"]
    assert {b["label"] for b in buttons} == {"Extend 1h", "Release"}


def test_extend_moves_the_end_and_rearms_the_warning(engine: Engine) -> None:
    svc, clock = make_service(engine, [host("one", "A100", 1)], max_duration=timedelta(hours=4))
    svc.reserve(actor(svc, "alice"), Reserve(duration=HOUR))
    clock.advance(timedelta(minutes=51))
    svc.tick()
    rid = rid_of(svc, "alice")
    reply = svc.extend(actor(svc, "alice"), Extend(duration=HOUR, reservation_id=rid))
    assert "extended by 1h" in reply.view.text
    res = reservation(engine, rid)
    assert res.ends_at is not None and res.granted_at is not None
    assert res.ends_at - res.granted_at == 2 * HOUR and res.warned_at is None
    with pytest.raises(UserError, match="at most 4h"):
        svc.extend(actor(svc, "alice"), Extend(duration=3 * HOUR))
    with pytest.raises(UserError, match="not yours"):
        svc.extend(actor(svc, "bob"), Extend(duration=HOUR, reservation_id=rid))


def test_only_the_holder_or_an_admin_releases(engine: Engine) -> None:
    svc, _ = make_service(engine, [host("one", "A100", 2)], admins=("root",))
    svc.reserve(actor(svc, "alice"), Reserve())
    rid = rid_of(svc, "alice")
    with pytest.raises(UserError, match="not yours"):
        svc.release(actor(svc, "bob"), Release(reservation_id=rid))
    reply = svc.release(actor(svc, "root"), Release(reservation_id=rid))
    assert "held by alice" in reply.view.text
    assert "root released your reservation" in dms(engine, "alice")[-1].text
    with pytest.raises(UserError, match="already released"):
        svc.release(actor(svc, "root"), Release(reservation_id=rid))
    with pytest.raises(UserError, match="no reservation #999"):
        svc.release(actor(svc, "alice"), Release(reservation_id=999))


def test_release_without_id_needs_to_know_which(engine: Engine) -> None:
    svc, _ = make_service(engine, [host("one", "A100", 4)])
    a = actor(svc, "alice")
    with pytest.raises(UserError, match="hold no GPUs"):
        svc.release(a, Release())
    svc.reserve(a, Reserve())
    svc.reserve(a, Reserve(count=2))
    with pytest.raises(UserError, match=r"2 reservations \(#1, #2\)"):
        svc.release(a, Release())
    reply = svc.release(a, Release(all=True))
    assert "#1 released" in reply.view.text and "#2 released" in reply.view.text


def test_releasing_a_waiting_request_leaves_the_line(engine: Engine) -> None:
    svc, _ = make_service(engine, [host("one", "A100", 1)])
    svc.reserve(actor(svc, "alice"), Reserve())
    svc.reserve(actor(svc, "bob"), Reserve())
    reply = svc.release(actor(svc, "bob"), Release())
    assert "left the line" in reply.view.text
    assert reservation(engine, rid_of(svc, "bob")).state == "cancelled"


def test_requests_that_can_never_be_granted_are_refused_up_front(engine: Engine) -> None:
    svc, _ = make_service(engine, [A100_BOX])
    with pytest.raises(UserError, match="most on one host is 8"):
        svc.reserve(actor(svc, "alice"), Reserve(count=9, model="A100"))
    with pytest.raises(UserError, match="No host here has H100"):
        svc.reserve(actor(svc, "alice"), Reserve(model="H100"))
    with pytest.raises(UserError, match="at most 3d"):
        svc.reserve(actor(svc, "alice"), Reserve(duration=timedelta(days=4)))


def test_the_same_request_delivered_twice_reserves_once(engine: Engine) -> None:
    svc, _ = make_service(engine, [A100_BOX])
    first = svc.reserve(actor(svc, "alice"), Reserve(count=2), request_key="slack:trigger-1")
    again = svc.reserve(actor(svc, "alice"), Reserve(count=2), request_key="slack:trigger-1")
    assert first.view.text == again.view.text
    with Session(engine) as s:
        assert len(s.exec(select(Reservation)).all()) == 1
        assert len(s.exec(select(UsageInterval)).all()) == 2


def test_status_lists_every_gpu_holder_and_the_line(engine: Engine) -> None:
    svc, _ = make_service(engine, [host("one", "A100", 2)])
    svc.reserve(actor(svc, "alice"), Reserve(count=2, duration=2 * HOUR))
    svc.reserve(actor(svc, "bob"), Reserve(count=1))
    view = svc.status(actor(svc, "bob"), Status()).view
    assert view.text == "0 of 2 free on 1 host; 1 waiting"
    tables = [b for b in view.blocks if getattr(b, "type", "") == "table"]
    gpu_rows = tables[0].rows  # type: ignore[union-attr]
    assert [r[2] for r in gpu_rows] == ["alice (#1)", "alice (#1)"]
    assert all("in 2h" in r[3] for r in gpu_rows)
    assert tables[1].rows[0][:3] == ("1", "#2", "bob")  # type: ignore[union-attr]
    yours = [b for b in view.blocks if getattr(b, "text", "").startswith("*Yours*")]
    assert "waiting for 1 GPU, position 1" in yours[0].text  # type: ignore[union-attr]


def test_sync_hosts_is_idempotent_and_marks_vanished_gpus(engine: Engine) -> None:
    svc, _ = make_service(engine, [host("one", "A100", 2)])
    svc.sync_hosts([host("one", "A100", 2)])
    svc.sync_hosts([host("one", "A100", 1)])
    view = svc.status(actor(svc, "alice"), Status()).view
    assert view.text == "1 of 1 free on 1 host"


def test_status_is_never_staler_than_the_cache_limit(sqlite_engine: Engine) -> None:
    """Writes of this process drop the cache at once; others' writes (made here through
    a raw connection, as another replica would) show within status_cache_s."""
    import time

    from sqlalchemy import text

    svc, _ = make_service(sqlite_engine, [host("one", "A100", 2)], status_cache_s=0.3)
    alice = actor(svc, "alice")
    assert svc.status(alice, Status()).view.text == "2 of 2 free on 1 host"
    svc.reserve(alice, Reserve())
    assert svc.status(alice, Status()).view.text == "1 of 2 free on 1 host"
    with sqlite_engine.begin() as conn:
        conn.execute(text('UPDATE gpu SET present = 0 WHERE "index" = 1'))
    assert svc.status(alice, Status()).view.text == "1 of 2 free on 1 host"  # cached
    time.sleep(0.35)
    assert svc.status(alice, Status()).view.text == "0 of 1 free on 1 host"


def test_cost_is_each_gpu_second_held_at_its_share_of_the_price(engine: Engine) -> None:
    # One p4d-like host: $21.96/h for 8 GPUs = $2.745 per GPU-hour.
    svc, clock = make_service(engine, [host("box", "A100", 8, hourly=21.96)])
    alice, bob = actor(svc, "alice"), actor(svc, "bob")
    svc.reserve(alice, Reserve(count=2, duration=3 * HOUR))  # 2 GPUs x 3 h = $16.47
    svc.reserve(bob, Reserve(count=1, duration=HOUR))  # 1 GPU x 1 h, still held at "now"
    clock.advance(HOUR / 2)
    window, costs, _ = svc.costs("week")
    assert window.start <= clock.now() < window.end
    assert costs["alice"] == Decimal("2.745")  # 2 GPUs x 0.5 h so far
    assert costs["bob"] == Decimal("1.3725")
    clock.advance(4 * HOUR)
    svc.tick()  # both end at their times
    _, costs, _ = svc.costs("week")
    assert costs == {"alice": Decimal("16.47"), "bob": Decimal("2.745")}
    _, only_bob, _ = svc.costs("today", "bob")
    assert only_bob == {"bob": Decimal("2.745")}


def test_a_verb_never_puts_back_the_name_its_actor_was_made_with(engine: Engine) -> None:
    # The Slack face makes a new user under the payload's name and renames them once
    # users.info answers, while the first command may still be running with the actor it
    # was given: the verbs must not write that actor's older name back.
    svc, _ = make_service(engine, [A100_BOX])
    first = svc.actor("U0CAROL01", name_if_new="carol")
    assert first.name == "carol"
    svc.actor("U0CAROL01", "Carol Danvers")
    svc.reserve(first, Reserve(count=1))
    svc.extend(first, Extend(duration=HOUR))
    svc.release(first, Release())
    with Session(engine) as s:
        carol = s.exec(select(User).where(User.key == "U0CAROL01")).one()
        assert carol.display_name == "Carol Danvers"
    assert svc.actor("U0CAROL01", name_if_new="carol").name == "Carol Danvers"
