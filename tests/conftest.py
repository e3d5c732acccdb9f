"""Suite-wide markers: `gpu` tests skip where CUDA is absent, `postgres` ones where the server is."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.training.test_agent import FakeImds

# No test may ever dial anything but loopback (moto invents 10.x and public addresses):
# the SSH layer refuses other targets while this is set, in this process and its children.
os.environ["GPUBOT_SSH_LOOPBACK_ONLY"] = "1"

from tests.fakes.fixtures import fake_slack  # noqa: F401  (the fake Slack Web API, for every test)
from tests.isolated_hosts import (  # noqa: F401  (hosts not this machine)
    bootstrapped,
    isolated_lab,
    stranger_lab,
)
from tests.slurm_cluster import (  # noqa: F401  (one per machine)
    lab_workdir,
    slurm_cluster,
    slurm_machine,
)


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


# --- parallel runs (pytest-xdist, `make test` runs `-n 2 --dist loadgroup`) -----------
#
# Each worker is its own process with its own session fixtures, so a fixture that holds
# something of this machine's that exists once must never be set up by two workers at
# once. Such tests share an `xdist_group`, which loadgroup sends whole to one worker; the
# group follows from the fixtures a test uses (its closure), so a new test that takes one
# of them is grouped without anyone remembering to. Without xdist the mark does nothing.
XDIST_GROUPS: dict[str, frozenset[str]] = {
    # The two host accounts (gpubot-host-a/-b): `isolated_lab` empties their homes and
    # kills their processes, `bootstrapped` (from nothing, over a minute) fills lab-a's.
    # (`stranger_lab` is not here: each worker has accounts of its own, see ssh_hosts.)
    "isolated-hosts": frozenset({"isolated_lab", "bootstrapped"}),
    # The run account (gpubot-run): its one prepared venv (~/.gpubot) is shared by every
    # run as that account, and one test breaks it on purpose to see it mended.
    "run-account": frozenset({"run_account"}),
    # The workers' leader lock on PostgreSQL: an advisory lock spans the database, not a
    # test's schema, so two tests running `gpubot worker`s there would fight for one lead.
    "pg-leader": frozenset({"pg_leader_key"}),
    # Runs across two hosts of the default lab: torchrun's rendezvous listens on node 0's
    # address at 29500 + run id % 500 (bot.app.runs.dispatch; another port only when an
    # open run in the same database has it), node 0 is 127.0.0.2 in every worker's lab
    # and run ids start at 1 in every test's database, so two such tests at once (two
    # databases) would join each other's run.
    "rendezvous": frozenset({"loopback_rendezvous"}),
    # The machine's one Slurm cluster (tests/slurm_cluster.py): each test leases it whole
    # (its 4 GPUs, its controller), so its tests run in turn in one worker rather than
    # one worker waiting for the other's lease.
    "slurm": frozenset({"slurm_cluster"}),
}
# `bench` asks for the run account only in its "local-as" case (request.getfixturevalue).
_PARAM_GROUPS = {("bench", "local-as"): "run-account"}


def xdist_group_of(item: pytest.Item) -> str | None:
    """The group of a test that uses a resource of this machine's that exists once."""
    names = set(getattr(item, "fixturenames", ()))
    for group, fixtures in XDIST_GROUPS.items():
        if names & fixtures:
            return group
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        for (name, value), group in _PARAM_GROUPS.items():
            if callspec.params.get(name) == value:
                return group
    return None


def _name_with_group(item: pytest.Item, group: str) -> None:
    """Give `item` the id xdist's loadgroup expects, "<nodeid>@<group>", as xdist does.

    pytest-xdist 3.8 renames an item by assigning `item._nodeid`, which pytest 9.2 no
    longer reads (the id is `item._id`, a NodeId): the rename is lost, every test is a
    group of its own, and the grouped tests would run in both workers at once. Only on an
    xdist worker with --dist loadgroup; a no-op where xdist's own rename took."""
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pytest before 9.2: xdist's rename works
        return
    if item.nodeid.endswith(f"@{group}") or not isinstance(getattr(item, "_id", None), NodeId):
        return
    item._id = NodeId.parse(f"{item.nodeid}@{group}")


# First: xdist's own hook (on each worker) reads the groups to rename the items.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = None
    postgres = None
    for item in items:
        group = xdist_group_of(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
            if getattr(config.option, "loadgroup", False):
                _name_with_group(item, group)
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


@pytest.fixture
def run_account() -> str:
    """The unprivileged account runs go to (GPUBOT_RUN_AS); skips where it cannot be used.

    Every test that acts as it takes this fixture, which puts it in the "run-account"
    xdist group (above)."""
    from tests.provisioning.conftest import RUN_ACCOUNT, run_account_missing

    reason = run_account_missing()
    if reason is not None:
        pytest.skip(reason)
    return RUN_ACCOUNT


@pytest.fixture
def pg_leader_key() -> int:
    """The advisory lock key every `gpubot worker` on PostgreSQL contends for to lead.

    It spans the database, not a test's schema: a test that runs workers on PostgreSQL
    takes this fixture, which puts it in the "pg-leader" xdist group (above)."""
    from bot.adapters.leader import _ADVISORY_KEY

    return _ADVISORY_KEY


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def engine(request: pytest.FixtureRequest) -> Engine:
    """Both databases: the code must behave the same on the embedded and the production one."""
    name = "sqlite_engine" if request.param == "sqlite" else "pg_engine"
    result: Engine = request.getfixturevalue(name)
    return result


@pytest.fixture
def loopback_rendezvous() -> None:
    """Taken by a test that starts a run across the default lab's hosts: it only puts the
    test in the "rendezvous" xdist group (XDIST_GROUPS), one such test at a time."""


@pytest.fixture
def imds() -> Iterator[FakeImds]:
    """EC2's instance metadata service (IMDSv2) on loopback, for the host agent's token
    PUT and spot-notice GET: no notice (404) until a test sets `notice`. Nothing in the
    suite dials 169.254.169.254."""
    import threading
    from http.server import ThreadingHTTPServer

    from tests.training.test_agent import FakeImds, _imds_handler

    state = FakeImds()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _imds_handler(state))
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
