"""Suite-wide markers: `gpu` tests skip where CUDA is absent, `postgres` ones where the server is."""

from __future__ import annotations

import os
import socket

import pytest

# No test may ever dial anything but loopback (moto invents 10.x and public addresses):
# the SSH layer refuses other targets while this is set, in this process and its children.
os.environ["GPUBOT_SSH_LOOPBACK_ONLY"] = "1"

from tests.fakes.fixtures import fake_slack  # noqa: F401  (the fake Slack Web API, for every test)
from tests.isolated_hosts import bootstrapped, isolated_lab  # noqa: F401  (hosts not this machine)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _postgres_reachable() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5432), timeout=0.5):
            return True
    except OSError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = None
    postgres = None
    for item in items:
        if "gpu" in item.keywords:
            if cuda is None:
                cuda = _cuda_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU with CUDA"))
        if "postgres" in item.keywords:
            if postgres is None:
                postgres = _postgres_reachable()
            if not postgres:
                item.add_marker(
                    pytest.mark.skip(reason="PostgreSQL not reachable at 127.0.0.1:5432")
                )


# --- databases -----------------------------------------------------------------

import secrets  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

from sqlalchemy import text  # noqa: E402
from sqlalchemy.engine import Engine  # noqa: E402

PG_URL = "postgresql://postgres@127.0.0.1:5432/test"


@pytest.fixture
def sqlite_engine(tmp_path: Path) -> Iterator[Engine]:
    from db.migrate import upgrade
    from db.session import make_engine

    engine = make_engine(f"sqlite:///{tmp_path / 'gpubot.db'}")
    upgrade(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def pg_engine() -> Iterator[Engine]:
    """A fresh schema per test on the machine's PostgreSQL, dropped afterwards."""
    if not _postgres_reachable():
        pytest.skip("PostgreSQL not reachable at 127.0.0.1:5432")
    from db.migrate import upgrade
    from db.session import make_engine

    schema = "t_" + secrets.token_hex(6)
    admin = make_engine(PG_URL)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    engine = make_engine(f"{PG_URL}?options=-csearch_path%3D{schema}")
    try:
        upgrade(engine)
        yield engine
    finally:
        engine.dispose()
        with admin.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def engine(request: pytest.FixtureRequest) -> Engine:
    """Both databases: the code must behave the same on the embedded and the production one."""
    name = "sqlite_engine" if request.param == "sqlite" else "pg_engine"
    result: Engine = request.getfixturevalue(name)
    return result
