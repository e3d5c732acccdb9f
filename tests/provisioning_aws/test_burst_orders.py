"""The offer of the cloud under random orders of what can happen to it (issue 37's Done
when (e)): the owned host frees, its owner takes or declines the offer, a launch fails,
the run is cancelled, the bot restarts, time passes, in any order. Whatever the order,
nothing is held twice, billed twice or left running for nobody.

The places are `ssh,aws` on EC2 in moto (in process); every host, the owned one and the
instances, is reached through the real `RemoteAccess` with a `LocalRunner` in place of
SSH (a host's runs are process groups on this machine), so one example takes well under a
second. The SSH path itself is tests/provisioning_aws/test_burst.py's; the cluster's
race (`scancel --state=PENDING`) is tests/provisioning_aws/test_slurm_burst.py's.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as hs
from moto import mock_aws
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.app.burst import state as st
from bot.app.config import Settings
from bot.app.hosts.remote import PreparedHost, RemoteAccess
from bot.app.places import RunParts, Wiring
from bot.app.service import GpuService
from bot.domain.clock import VirtualClock
from bot.domain.commands import Release, Reserve, Run
from bot.faces.dispatch import handle_text
from db.migrate import upgrade
from db.models import (
    HOST_TERMINATED,
    RES_ACTIVE,
    BurstOffer,
    Host,
    LaunchRequest,
    Reservation,
    TrainingRun,
    UsageInterval,
)
from db.session import make_engine
from provisioning.base import Instance
from provisioning.hostshell import HostShell
from provisioning.local_runner import LOCAL_TARGET, LocalRunner
from provisioning.ssh import SshTarget
from tests.core.fleet_helpers import cloud_place
from tests.core.helpers import host
from tests.provisioning_aws.conftest import AwsLab, _build_world, fresh_session
from tests.provisioning_aws.faults import RunInstancesFaults

EVENTS = ("tick", "tick", "free", "take", "wait", "fail", "cancel", "restart")
TERMINAL = ("succeeded", "failed", "cancelled")
SETTLE_S = 60.0  # a guard against a hang, not a speed assertion


@dataclass(frozen=True)
class Here:
    """Every host, the owned one and each instance, is this machine."""

    def resolve(self, instance: Instance | str) -> SshTarget:
        name = instance.name if isinstance(instance, Instance) else instance
        return replace(LOCAL_TARGET, name=name)


class World:
    def __init__(self, engine: Engine, lab: AwsLab, root: Path) -> None:
        self.engine = engine
        self.lab = lab
        self.root = root
        self.clock = VirtualClock()
        self.failing = False
        lab.on_run_instances(
            RunInstancesFaults(lambda *_: "InsufficientInstanceCapacity" if self.failing else None)
        )
        self.build()
        bob = self.svc.actor("bob")
        assert not self.svc.reserve(bob, Reserve(1, "T4", timedelta(hours=8))).error
        ask = Run(command=("sleep", "0.3"), model="T4", max_duration=timedelta(hours=1))
        self.rid = int(self.svc.runs.submit(self.svc.actor("alice"), ask).extra["run_id"])

    def build(self) -> None:
        """The bot, made anew on the same database and cloud: a restart."""

        def prepare(runner: HostShell, target: SshTarget) -> PreparedHost:
            return PreparedHost(root=str(self.root), python=sys.executable)

        access = RemoteAccess(self.engine, LocalRunner(), Here(), prepare=prepare)
        compute = self.lab.compute()
        cloud = cloud_place(compute, access)

        def wire(core: GpuService) -> list[Wiring]:
            core.sync_hosts([host("box", "T4", 1)])
            return [Wiring("ssh", runs=RunParts(access, compute.catalog)), *cloud(core)]

        cfg = Settings(admins=("root",), burst_after_s=5 * 60.0)  # one tick passes it
        self.svc = GpuService(self.engine, cfg, self.clock, wire)

    def tick(self) -> None:
        svc = self.svc
        assert svc.bursts is not None and svc.fleet is not None
        self.clock.advance(timedelta(minutes=6))
        svc.tick()
        svc.bursts.tick()
        svc.runs.poll()
        svc.runs.dispatch()
        svc.fleet.refresh()  # type: ignore[attr-defined]
        self.failing = False

    def act(self, event: str) -> None:
        svc, alice = self.svc, self.svc.actor("alice")
        if event == "tick":
            self.tick()
        elif event == "free":
            with Session(self.engine) as s:
                held = s.exec(select(Reservation).where(Reservation.state == RES_ACTIVE)).first()
            if held is not None:
                svc.release(svc.actor("bob"), Release(held.id))
        elif event == "take":
            handle_text(svc, alice, f"/gpu cloud take {self.rid}")
        elif event == "wait":
            handle_text(svc, alice, f"/gpu cloud wait {self.rid}")
        elif event == "fail":
            self.failing = True
        elif event == "cancel":
            handle_text(svc, alice, f"/gpu cancel {self.rid}")
        elif event == "restart":
            self.build()

    # --- what must hold -------------------------------------------------------------

    def bought(self, s: Session) -> tuple[list[LaunchRequest], list[Host]]:
        """The launches made for the run, and their instances not terminated."""
        reqs = list(s.exec(select(LaunchRequest).where(LaunchRequest.run_id == self.rid)))
        ids = [r.instance_id for r in reqs if r.instance_id]
        alive = select(Host).where(col(Host.instance_id).in_(ids), Host.state != HOST_TERMINATED)
        return reqs, list(s.exec(alive))

    def check(self) -> None:
        with Session(self.engine) as s:
            run = s.get(TrainingRun, self.rid)
            assert run is not None
            ivs = list(
                s.exec(
                    select(UsageInterval)
                    .where(UsageInterval.run_id == self.rid)
                    .order_by(col(UsageInterval.started_at))
                )
            )
            reqs, live = self.bought(s)
            offer = s.exec(select(BurstOffer).where(BurstOffer.run_id == self.rid)).first()
        # Held once: one interval at a time, never two open ones.
        assert sum(1 for iv in ivs if iv.ended_at is None) <= 1, ivs
        # Billed once: one run, one stretch of GPU time (nothing here requeues it).
        assert len(ivs) <= 1, ivs
        # Bought once: never two instances alive for one request.
        assert len(live) <= 1, live
        # Nothing bought unasked: an instance exists only for a taken offer.
        if reqs:
            assert offer is not None and offer.state not in (st.OPEN, st.DECLINED, st.REFUSED)
        if offer is not None and offer.state in (st.DECLINED, st.WITHDRAWN):
            assert reqs == [], "a declined or withdrawn offer bought something"

    def settle(self) -> None:
        """The box freed, time passing: the run ends, the offer closes, nothing leaks."""
        self.act("free")
        deadline = time.monotonic() + SETTLE_S
        while True:
            self.tick()
            self.check()
            with Session(self.engine) as s:
                run = s.get(TrainingRun, self.rid)
                offer = s.exec(select(BurstOffer).where(BurstOffer.run_id == self.rid)).first()
            assert run is not None
            done = run.state in TERMINAL and (offer is None or offer.state in st.FINAL)
            if done:
                break
            assert time.monotonic() < deadline, (run.state, offer and offer.state)
            time.sleep(0.1)
        with Session(self.engine) as s:
            _, live = self.bought(s)
            ivs = list(s.exec(select(UsageInterval).where(UsageInterval.run_id == self.rid)))
        # What the examples reached (`pytest --hypothesis-show-statistics`).
        event(f"offer {offer.state if offer is not None else 'never made'}, run {run.state}")
        assert all(iv.ended_at is not None for iv in ivs)
        if offer is None or offer.state != st.CLOUD:
            # It never ran on the cloud: whatever was bought for it was given back.
            assert live == [], [(h.instance_id, h.state) for h in live]
        else:
            assert [iv.host_id for iv in ivs] == [h.id for h in live]


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(events=hs.lists(hs.sampled_from(EVENTS), min_size=1, max_size=14))
def test_no_order_of_events_holds_bills_or_buys_twice_or_leaks(
    aws_env: None, events: list[str]
) -> None:
    with tempfile.TemporaryDirectory() as tmp, mock_aws():
        engine = make_engine(f"sqlite:///{Path(tmp) / 'gpubot.db'}")
        upgrade(engine)
        try:
            world = World(engine, _build_world(fresh_session(), "inprocess"), Path(tmp) / "hosts")
            for event in events:
                world.act(event)
                world.check()
            world.settle()
        finally:
            engine.dispose()


def test_the_orders_include_a_take_that_runs_on_the_cloud(aws_env: None) -> None:
    """One order spelled out, so the property's examples are known to reach the cloud."""
    with tempfile.TemporaryDirectory() as tmp, mock_aws():
        engine = make_engine(f"sqlite:///{Path(tmp) / 'gpubot.db'}")
        upgrade(engine)
        try:
            world = World(engine, _build_world(fresh_session(), "inprocess"), Path(tmp) / "hosts")
            for event in ("tick", "tick", "tick", "take", "fail", "tick", "restart", "tick"):
                world.act(event)
                world.check()
            deadline = time.monotonic() + SETTLE_S
            while True:
                world.tick()
                world.check()
                with Session(engine) as s:
                    offer = s.exec(select(BurstOffer)).one()
                    run = s.get(TrainingRun, world.rid)
                if run is not None and run.state in TERMINAL:
                    break
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert run is not None and run.state == "succeeded"
            assert offer.state in (st.MOVED, st.CLOUD, st.ACCEPTED)
            assert run.placement["at"] == "aws"
        finally:
            engine.dispose()
