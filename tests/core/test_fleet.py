"""`/gpu pool` and the fleet's place in the worker, on SQLite and PostgreSQL.

The fleet's cloud side (launch, reuse, idle stop, reconcile) is tested against moto in
tests/provisioning_aws/test_fleet.py and tests/e2e/test_fleet_crash.py.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session

from bot.app.fleet import fleet_job, fleet_trigger
from bot.faces.dispatch import handle_text
from bot.faces.worker import periodic_jobs
from db.models import PoolLimit
from provisioning.base import Instance
from tests.core.helpers import host, make_service


def aws_host(name: str, itype: str, count: int, hourly: float, state: str = "ready") -> Instance:
    return replace(
        host(name, "A100", count, hourly),
        provider="aws",
        instance_id=name,
        instance_type=itype,
        state=state,
    )


@pytest.fixture(params=["sqlite", "postgres"])
def engine(request: pytest.FixtureRequest) -> Engine:
    fixture = "sqlite_engine" if request.param == "sqlite" else "pg_engine"
    result: Engine = request.getfixturevalue(fixture)
    return result


def test_pool_shows_types_in_use_and_limits(engine: Engine) -> None:
    svc, _ = make_service(
        engine,
        [
            aws_host("i-1", "p4d.24xlarge", 8, 32.77),
            aws_host("i-2", "p4d.24xlarge", 8, 32.77, state="stopped"),
            aws_host("i-3", "p4d.24xlarge", 8, 32.77, state="pending"),
            host("box", "A100", 2),
        ],
        pool_max_instances=3,
    )
    reply = handle_text(svc, svc.actor("alice"), "/gpu pool")
    assert not reply.error
    assert reply.view.text == "GPU pool: p4d.24xlarge: 2 running, 1 stopped; $65.54/h now."
    table = next(b for b in reply.view.blocks if b.type == "table")
    assert table.rows == (
        ("p4d.24xlarge", "2", "1", "16", "$65.54", "3 (default)", "no cap (default)"),
    )


def test_pool_set_is_for_admins_and_merges_fields(engine: Engine) -> None:
    svc, clock = make_service(engine, [host("box", "A100", 2)])
    refused = handle_text(svc, svc.actor("bob"), "/gpu pool set g5.xlarge max=2")
    assert refused.error and refused.view.text.startswith("Only an admin can change the pool")
    with Session(engine) as s:
        assert s.get(PoolLimit, "g5.xlarge") is None

    ok = handle_text(svc, svc.actor("root"), "/gpu pool set g5.xlarge max=2")
    assert not ok.error and not ok.ephemeral
    assert ok.view.text.startswith("Pool limit for g5.xlarge updated.")
    handle_text(svc, svc.actor("root"), "/gpu pool set g5.xlarge spend=12.50")
    with Session(engine) as s:
        row = s.get(PoolLimit, "g5.xlarge")
        assert row is not None
        assert (row.max_instances, row.max_usd_per_hour, row.updated_by) == (2, 12.5, "root")
        assert row.updated_at == clock.now()
    shown = handle_text(svc, svc.actor("bob"), "/gpu pool")
    table = next(b for b in shown.view.blocks if b.type == "table")
    assert table.rows == (("g5.xlarge", "0", "0", "0", "$0.00", "2", "$12.50/h"),)


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("/gpu pool set x9.huge max=2", "not an instance type the catalog knows"),
        ("/gpu pool set g5.xlarge max=two", "is not `max=N` or `spend=USD`"),
        ("/gpu pool set g5.xlarge", "Use `/gpu pool` to see the pool"),
    ],
)
def test_pool_bad_input_is_a_clear_error(sqlite_engine: Engine, line: str, words: str) -> None:
    svc, _ = make_service(sqlite_engine, [])
    reply = handle_text(svc, svc.actor("root"), line)
    assert reply.error and words in reply.view.text


def test_the_worker_runs_the_fleet_at_start_and_every_tick(sqlite_engine: Engine) -> None:
    svc, _ = make_service(sqlite_engine, [], tick_seconds=2.0)
    (job,) = [j for j in periodic_jobs(svc) if j.id == "fleet"]
    assert job.run is fleet_job and job.trigger == "interval"
    args = fleet_trigger(svc.settings)
    assert args["seconds"] == 5.0  # never more often than every 5 s
    assert abs((args["next_run_time"] - datetime.now(UTC)).total_seconds()) < 5
    # Without a cloud provider there is no fleet, and the job does nothing.
    assert svc.fleet is None
    fleet_job(svc)
