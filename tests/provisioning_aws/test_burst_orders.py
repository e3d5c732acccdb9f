"""The offer of the cloud under random orders of what can happen to it (issue 37's Done
when (e)): the owned host frees, the owners take or decline their offers, a launch fails,
the run is cancelled, the reservation released, the bot restarts, time passes, in any
order. Whatever the order, nothing is held twice, billed twice or left running for nobody.

Two requests compete for the one owned T4 that bob holds: alice's run and carol's
reservation, each offered EC2.

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
from typing import Any

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
    HOST_BILLED_RUNNING,
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

EVENTS = ("tick", "tick", "free", "take", "wait", "fail", "cancel", "release", "restart")
TERMINAL = ("succeeded", "failed", "cancelled", "released", "expired")
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
        carol = self.svc.actor("carol")
        assert not self.svc.reserve(carol, Reserve(1, "T4", timedelta(minutes=30))).error
        with Session(self.engine) as s:
            self.res_id = max(r.id or 0 for r in s.exec(select(Reservation)))

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
        svc.fleet.cycle()
        self.failing = False

    def act(self, event: str) -> None:
        svc, alice = self.svc, self.svc.actor("alice")
        if event == "tick":
            self.tick()
        elif event == "free":
            with Session(self.engine) as s:
                held = s.exec(
                    select(Reservation).where(
                        Reservation.state == RES_ACTIVE, Reservation.id != self.res_id
                    )
                ).first()
            if held is not None:
                svc.release(svc.actor("bob"), Release(held.id))
        elif event in ("take", "wait"):
            handle_text(svc, alice, f"/gpu cloud {event} {self.rid}")
            handle_text(svc, svc.actor("carol"), f"/gpu cloud {event} res {self.res_id}")
        elif event == "fail":
            self.failing = True
        elif event == "cancel":
            handle_text(svc, alice, f"/gpu cancel {self.rid}")
        elif event == "release":
            handle_text(svc, svc.actor("carol"), f"/gpu release {self.res_id}")
        elif event == "restart":
            self.build()

    # --- what must hold -------------------------------------------------------------

    def requests(self) -> tuple[tuple[str, int], ...]:
        return (("run", self.rid), ("res", self.res_id))

    def read(self, s: Session, kind: str, ref: int) -> Seen:
        """One request as the database has it: its state, GPU time, launches and offer."""
        is_run = kind == "run"
        row: Any = s.get(TrainingRun if is_run else Reservation, ref)
        used = UsageInterval.run_id if is_run else UsageInterval.reservation_id
        bought = LaunchRequest.run_id if is_run else LaunchRequest.reservation_id
        offered = BurstOffer.run_id if is_run else BurstOffer.reservation_id
        ivs = list(s.exec(select(UsageInterval).where(used == ref)))
        reqs = list(s.exec(select(LaunchRequest).where(bought == ref)))
        ids = [r.instance_id for r in reqs if r.instance_id]
        # Billed as running: a stopped instance costs its disk only, and is ended by policy.
        alive = select(Host).where(
            col(Host.instance_id).in_(ids), col(Host.state).in_(HOST_BILLED_RUNNING)
        )
        offer = s.exec(select(BurstOffer).where(offered == ref)).first()
        return Seen(row.state, ivs, reqs, list(s.exec(alive)), offer)

    def check(self) -> None:
        with Session(self.engine) as s:
            seen = [self.read(s, kind, ref) for kind, ref in self.requests()]
        for x in seen:
            # Held once: its one GPU under one open interval at most.
            assert sum(1 for iv in x.ivs if iv.ended_at is None) <= 1, x.ivs
            # Billed once: one stretch of GPU time (nothing here requeues or regrants it).
            assert len(x.ivs) <= 1, x.ivs
            # Bought once: never two instances running for one request.
            assert len(x.live) <= 1, x.live
            # Nothing bought unasked: an instance exists only for a taken offer.
            if x.reqs:
                assert x.offer is not None
                assert x.offer.state not in (st.OPEN, st.DECLINED, st.REFUSED)
            if x.offer is not None and x.offer.state in (st.DECLINED, st.WITHDRAWN):
                assert x.reqs == [], "a declined or withdrawn offer bought something"

    def settle(self) -> None:
        """The box freed, time passing: both end, the offers close, nothing leaks."""
        self.act("free")
        deadline = time.monotonic() + SETTLE_S
        while True:
            self.tick()
            self.check()
            with Session(self.engine) as s:
                seen = [self.read(s, kind, ref) for kind, ref in self.requests()]
            over = all(x.state in TERMINAL for x in seen)
            if over and all(x.offer is None or x.offer.state in st.FINAL for x in seen):
                break
            assert time.monotonic() < deadline, [(x.state, x.offer and x.offer.state) for x in seen]
            time.sleep(0.05)
        for (kind, _), x in zip(self.requests(), seen, strict=True):
            # What the examples reached (`pytest --hypothesis-show-statistics`).
            event(f"{kind}: offer {x.offer.state if x.offer else 'never made'}, {x.state}")
            assert all(iv.ended_at is not None for iv in x.ivs)
            if x.offer is None or x.offer.state != st.CLOUD:
                # It never started on the cloud: whatever was bought for it was given back.
                assert x.live == [], [(h.instance_id, h.state) for h in x.live]
            else:
                # It started on the cloud: its GPU time was on an instance, never the box.
                with Session(self.engine) as s:
                    on = {s.get(Host, iv.host_id).provider for iv in x.ivs}  # type: ignore[union-attr]
                assert on <= {"aws"}, on


@dataclass
class Seen:
    state: str
    ivs: list[UsageInterval]
    reqs: list[LaunchRequest]
    live: list[Host]
    offer: BurstOffer | None


@settings(
    max_examples=12,
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
                    offer = s.exec(select(BurstOffer).where(BurstOffer.run_id == world.rid)).one()
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
