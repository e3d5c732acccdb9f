"""A run across hosts listens for its nodes on node 0 at a port no other open run there
has: two runs whose ids differ by a multiple of the port range, both with node 0 on one
host, used to get the same port and join each other's torchrun."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session

from bot.app.runs.dispatch import (
    RENDEZVOUS_PORT_BASE,
    RENDEZVOUS_PORTS,
    _ports_in_use,
    rendezvous_port,
)
from db.models import RUN_FAILED, RUN_QUEUED, RUN_RUNNING, RUN_STARTING, TrainingRun, User

T0 = datetime(2026, 3, 30, 12, 0, tzinfo=UTC)


def test_a_run_takes_its_own_port_or_the_next_free_one_in_the_range() -> None:
    assert rendezvous_port(1) == RENDEZVOUS_PORT_BASE + 1
    assert rendezvous_port(1 + RENDEZVOUS_PORTS) == RENDEZVOUS_PORT_BASE + 1
    taken = {RENDEZVOUS_PORT_BASE + 1, RENDEZVOUS_PORT_BASE + 2}
    assert rendezvous_port(1 + RENDEZVOUS_PORTS, taken) == RENDEZVOUS_PORT_BASE + 3
    # The top of the range wraps to its bottom, never above it.
    top = RENDEZVOUS_PORT_BASE + RENDEZVOUS_PORTS - 1
    assert rendezvous_port(RENDEZVOUS_PORTS - 1, {top}) == RENDEZVOUS_PORT_BASE
    every = set(range(RENDEZVOUS_PORT_BASE, RENDEZVOUS_PORT_BASE + RENDEZVOUS_PORTS))
    with pytest.raises(RuntimeError, match="every rendezvous port"):
        rendezvous_port(7, every)


def _run(s: Session, user_id: int, state: str, rdzv: str | None) -> None:
    placement = {"host": "gpu-a", "nodes": [{}, {}], "rdzv": rdzv} if rdzv else {}
    s.add(TrainingRun(user_id=user_id, state=state, placement=placement, submitted_at=T0))


def test_the_ports_in_use_are_the_open_runs_with_node_0_on_that_host(engine: Engine) -> None:
    with Session(engine) as s:
        user = User(key="alice", display_name="alice", created_at=T0)
        s.add(user)
        s.flush()
        assert user.id is not None
        _run(s, user.id, RUN_RUNNING, "127.0.0.5:29501")
        _run(s, user.id, RUN_STARTING, "127.0.0.5:29502")
        _run(s, user.id, RUN_RUNNING, "127.0.0.6:29503")  # node 0 elsewhere
        _run(s, user.id, RUN_FAILED, "127.0.0.5:29504")  # ended: its port is free again
        _run(s, user.id, RUN_QUEUED, "127.0.0.5:29505")  # requeued: not listening now
        _run(s, user.id, RUN_RUNNING, None)  # one host: no rendezvous
        s.commit()
        in_use = _ports_in_use(s, "127.0.0.5")
        assert in_use == {29501, 29502}
        # Run 501 would have taken 29501 like run 1: it takes the next free port.
        assert rendezvous_port(501, in_use) == 29503
        assert rendezvous_port(501, _ports_in_use(s, "127.0.0.7")) == 29501
