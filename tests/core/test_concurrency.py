"""50 teammates racing for 4 free GPUs, on SQLite and on PostgreSQL.

PostgreSQL is where locking is really tested: SQLite serializes writers anyway,
while on PostgreSQL the grant pass relies on `FOR UPDATE` row locks.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime

import pytest
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from bot.commands import Reserve
from bot.views import Reply
from db.models import Gpu, Reservation, UsageInterval, User
from db.session import transaction
from tests.core.helpers import actor, host, make_service

THREADS = 50


def test_fifty_threads_reserve_four_gpus(engine: Engine) -> None:
    svc, _ = make_service(engine, [host("box", "A100", 4)])
    actors = [actor(svc, f"user{i}") for i in range(THREADS)]
    barrier = threading.Barrier(THREADS)
    replies: dict[str, Reply] = {}
    errors: list[BaseException] = []

    def race(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            replies[actors[i].key] = svc.reserve(actors[i], Reserve(count=1, model="A100"))
        except BaseException as exc:  # the assertion below reports it
            errors.append(exc)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(replies) == THREADS

    with Session(engine) as s:
        states = [r.state for r in s.exec(select(Reservation))]
        open_ivs = s.exec(select(UsageInterval).where(col(UsageInterval.ended_at).is_(None))).all()
        granted_users = {
            u.key
            for r, u in s.exec(
                select(Reservation, User).join(User).where(Reservation.state == "active")
            )
        }
    assert states.count("active") == 4
    assert states.count("waiting") == THREADS - 4
    assert len(open_ivs) == 4 and len({iv.gpu_id for iv in open_ivs}) == 4, "a GPU held twice"
    # Every caller was told the truth about its own request.
    for key, reply in replies.items():
        if key in granted_users:
            assert reply.view.text.startswith("Reserved"), reply.view.text
        else:
            assert "waiting" in reply.view.text, reply.view.text


def test_the_database_refuses_a_gpu_held_twice(engine: Engine) -> None:
    svc, _ = make_service(engine, [host("box", "A100", 1)])
    svc.reserve(actor(svc, "alice"), Reserve())
    now = datetime.now(UTC)
    with Session(engine) as s:
        gpu = s.exec(select(Gpu)).one()
        user = s.exec(select(User).where(User.key == "alice")).one()
        assert gpu.id is not None and user.id is not None
        ids = (gpu.id, gpu.host_id, user.id)
    with pytest.raises(IntegrityError), transaction(engine) as s:
        s.add(UsageInterval(gpu_id=ids[0], host_id=ids[1], user_id=ids[2], started_at=now))
