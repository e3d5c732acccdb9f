"""EC2 instances are set up (bootstrapped) off the tick, on the host checker's pool.

The fleet on moto (in process), its instances reached on one real loopback sshd host.
The preparation is a double that can block or fail per instance (a shortcut: these tests
are about who waits for a bootstrap, not about what it installs; the bootstrap itself is
tested on isolated hosts). Tests wait for the checker's futures, never for time.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from bot.app.hosts.hostcheck import BACKOFF_FIRST, HostChecker
from bot.app.hosts.remote import PreparedHost
from bot.domain.commands import Reserve, Run
from db.models import (
    HOST_PENDING,
    HOST_READY,
    HOST_UNREACHABLE,
    RES_ACTIVE,
    RES_WAITING,
    Reservation,
    TrainingRun,
)
from provisioning.base import ProvisioningError
from provisioning.compute import LaunchSpec
from provisioning.hostshell import HostShell
from provisioning.ssh import SshTarget
from tests.core.fleet_helpers import FleetBench, make_fleet
from tests.provisioning_aws.conftest import AwsLab
from tests.ssh_hosts import SshLab

HOUR = timedelta(hours=1)


class Setups:
    """The preparation double: per instance, block until released or fail with a reason."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.gates: dict[str, threading.Event] = {}
        self.entered: dict[str, threading.Event] = {}
        self.failures: dict[str, str] = {}
        self.calls: list[str] = []

    def block(self, name: str) -> threading.Event:
        self.entered[name] = threading.Event()
        self.gates[name] = threading.Event()
        return self.gates[name]

    def __call__(self, runner: HostShell, target: SshTarget) -> PreparedHost:
        self.calls.append(target.name)
        if target.name in self.entered:
            self.entered[target.name].set()
            assert self.gates[target.name].wait(60), "the test never released the bootstrap"
        why = self.failures.pop(target.name, None)
        if why is not None:
            raise ProvisioningError(why)
        assert runner.run(target, "true", timeout=15).ok  # it really dials the host
        return PreparedHost(root=str(self.root), python=sys.executable)


@pytest.fixture
def world(
    sqlite_engine: Engine, inprocess_lab: AwsLab, ssh: SshLab, tmp_path: Path
) -> Iterator[tuple[FleetBench, HostChecker, Setups]]:
    b = make_fleet(sqlite_engine, inprocess_lab.compute(), ssh, tmp_path / "remote")
    setups = Setups(tmp_path / "remote")
    access = b.fleet.access
    access.prepare = setups
    access.wait_for_prepare = False  # as production wires it: the checker prepares
    checker = HostChecker(b.service, access, (), cloud=b.fleet.compute.name)
    b.fleet.set_up_off_tick(checker.tick)
    try:
        yield b, checker, setups
    finally:
        for gate in setups.gates.values():
            gate.set()
        checker.close()
        b.client.close()


def launch(b: FleetBench, key: str, model: str = "T4", gpus: int = 1) -> str:
    inst = b.fleet.compute.launch(
        LaunchSpec(
            gpu_model=model,
            gpus=gpus,
            market="ondemand",
            owner="root",
            request_key=key,
            reservation_id="0",
        )
    )
    assert inst.instance_id is not None
    return inst.instance_id


def test_a_slow_bootstrap_holds_neither_the_fleet_nor_another_hosts_grant_and_dispatch(
    world: tuple[FleetBench, HostChecker, Setups], tmp_path: Path
) -> None:
    b, checker, setups = world
    slow, fast = launch(b, "slow"), launch(b, "fast", "V100", gpus=4)
    gate = setups.block(slow)

    # The fleet's pass lists both instances, pending, hands their setups to the pool and
    # returns while the slow one's bootstrap is still inside it.
    b.fleet.cycle()
    assert setups.entered[slow].wait(60)
    assert b.host(slow).state == HOST_PENDING
    checker.wait(timeout=60, names=(fast,))
    assert b.host(fast).state == HOST_READY
    assert checker.in_flight() == [slow]

    # Another full pass completes meanwhile, and the ready host is granted and placed on.
    b.fleet.cycle()
    b.service.reserve(b.service.actor("alice"), Reserve(count=1, model="V100", duration=2 * HOUR))
    b.service.tick()
    runs = b.service.runs
    script = tmp_path / "train.py"
    script.write_text("print('trained')\n")
    rid = runs.submit(
        b.service.actor("bob"), Run(command=(sys.executable, str(script)), model="V100")
    ).extra["run_id"]
    assert runs.dispatch() == 1
    with Session(b.service.engine) as s:
        (res,) = s.exec(select(Reservation)).all()
        run = s.get(TrainingRun, rid)
        assert run is not None
        fast_id = b.host(fast).id
        assert (res.state, res.host_id) == (RES_ACTIVE, fast_id)
        assert run.host_id == fast_id and run.state in ("starting", "running")
    # Nothing was granted or placed on the instance still setting up.
    assert b.host(slow).state == HOST_PENDING and checker.in_flight() == [slow]

    # Its bootstrap finishes: it is ready, and the next reservation is granted there.
    gate.set()
    checker.wait(timeout=60)
    assert b.host(slow).state == HOST_READY
    b.service.reserve(b.service.actor("carol"), Reserve(count=1, model="T4", duration=2 * HOUR))
    b.service.tick()
    with Session(b.service.engine) as s:
        carol = s.exec(select(Reservation).order_by(Reservation.id.desc())).first()  # type: ignore[union-attr]
        assert carol is not None and carol.host_id == b.host(slow).id
    # Each instance was prepared once; the passes after it did not dial it again.
    assert sorted(setups.calls) == sorted([slow, fast])


def test_a_failed_setup_marks_the_instance_down_tells_the_waiting_owner_and_backs_off(
    world: tuple[FleetBench, HostChecker, Setups],
) -> None:
    b, checker, setups = world
    iid = launch(b, "broken")
    setups.failures[iid] = "pip install failed: No space left on device"
    b.service.reserve(b.service.actor("alice"), Reserve(count=1, model="T4", duration=2 * HOUR))

    b.fleet.refresh()
    checker.wait(timeout=60)
    host = b.host(iid)
    assert host.state == HOST_UNREACHABLE
    assert host.down_reason == "setup failed: pip install failed: No space left on device"
    assert host.next_check_at == b.clock.now() + BACKOFF_FIRST
    # Nothing is granted there; the waiting owner is told why, once.
    b.service.tick()
    with Session(b.service.engine) as s:
        (res,) = s.exec(select(Reservation)).all()
    assert res.state == RES_WAITING and res.host_id is None
    told = [dm for dm in b.dms("alice") if iid in dm and "setup failed" in dm]
    assert len(told) == 1 and "No space left on device" in told[0]
    # A pass before the backoff is over neither dials it nor changes it back.
    b.fleet.refresh()
    assert checker.in_flight() == [] and setups.calls == [iid]
    assert b.host(iid).state == HOST_UNREACHABLE

    # After the backoff the setup is tried again; it works, and the reservation is granted.
    b.clock.advance(BACKOFF_FIRST)
    b.fleet.refresh()
    checker.wait(timeout=60)
    assert setups.calls == [iid, iid]
    host = b.host(iid)
    assert (host.state, host.down_reason, host.check_failures) == (HOST_READY, None, 0)
    b.service.tick()
    with Session(b.service.engine) as s:
        (res,) = s.exec(select(Reservation)).all()
    assert (res.state, res.host_id) == (RES_ACTIVE, host.id)
    assert len([dm for dm in b.dms("alice") if "setup failed" in dm]) == 1
    assert any("back in the pool" in note for note in b.channel())


def test_an_instance_whose_ssh_does_not_answer_yet_is_booting_not_failing(
    sqlite_engine: Engine, inprocess_lab: AwsLab, ssh: SshLab, tmp_path: Path
) -> None:
    # Loopback, but nothing listens there: the instance boots and SSH does not answer.
    dead = SshTarget(host="127.0.0.9", port=1, user=ssh.user, key_path=str(ssh.client_key))
    b = make_fleet(sqlite_engine, inprocess_lab.compute(), ssh, tmp_path / "r", target=dead)
    checker = HostChecker(b.service, b.fleet.access, (), cloud=b.fleet.compute.name)
    b.fleet.set_up_off_tick(checker.tick)
    try:
        iid = launch(b, "booting")
        b.fleet.refresh()
        checker.wait(timeout=60)
        host = b.host(iid)
        assert (host.state, host.check_failures, host.down_reason) == (HOST_PENDING, 0, None)
        assert host.next_check_at is not None and host.next_check_at > b.clock.now()
        assert b.prepared == []
    finally:
        checker.close()
        b.client.close()
