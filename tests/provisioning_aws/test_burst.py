"""`GPUBOT_PROVIDERS=ssh,aws`: the team's own host first, EC2 (moto, in process) offered
with its price when the wait grows long, the first place to start a run winning.

The owned host and the instances are reached on one real loopback sshd host (the bot's
own user, prepared without a bootstrap, as tests/provisioning_aws/test_fleet.py does):
these tests are about the offer, the money and who wins, not the preparation. The clock
is virtual: "waited 16 minutes" is the clock moved, not a sleep.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.app.burst import state as st
from bot.app.config import Settings
from bot.app.fleet import Fleet
from bot.app.hosts import hostcheck
from bot.app.hosts.remote import PreparedHost, RemoteAccess
from bot.app.money.digest import build_digest, digest_view
from bot.app.places import RunParts, Wiring
from bot.app.service import GpuService
from bot.domain import views
from bot.domain.clock import VirtualClock
from bot.domain.commands import Cancel, Reserve, Run
from bot.domain.metering import money
from bot.faces.dispatch import handle_text
from bot.faces.slack import blocks
from db.models import (
    HOST_TERMINATED,
    BurstOffer,
    Host,
    LaunchRequest,
    Notification,
    Reservation,
    TrainingRun,
    UsageInterval,
)
from provisioning.hostshell import HostShell
from provisioning.ssh import SshClient, SshTarget
from tests.core.fleet_helpers import LoopbackResolver, cloud_place, lab_target, notes
from tests.core.helpers import host
from tests.provisioning_aws.conftest import AwsLab
from tests.ssh_hosts import SshLab

HOUR = timedelta(hours=1)
GUARD_S = 120.0  # a guard against a hang, not a speed assertion


@pytest.fixture(params=["sqlite", "postgres"])
def engine(request: pytest.FixtureRequest) -> Engine:
    result: Engine = request.getfixturevalue(
        f"{'sqlite' if request.param == 'sqlite' else 'pg'}_engine"
    )
    return result


class Team:
    """One bot over two places: `box` (one T4 the team owns, over SSH) and EC2."""

    def __init__(self, engine: Engine, lab: AwsLab, ssh: SshLab, root: Path, **cfg: Any) -> None:
        self.clock = VirtualClock()
        self.client = SshClient(connect_timeout=5, command_timeout=60)

        def prepare(runner: HostShell, target: SshTarget) -> PreparedHost:
            return PreparedHost(root=str(root), python=sys.executable)

        access = RemoteAccess(
            engine, self.client, LoopbackResolver(lab_target(ssh)), prepare=prepare
        )
        self.compute = lab.compute()
        cloud = cloud_place(self.compute, access)

        def wire(core: GpuService) -> list[Wiring]:
            core.sync_hosts([host("box", "T4", 1)])
            owned = Wiring(
                "ssh", label="the team's SSH hosts", runs=RunParts(access, self.compute.catalog)
            )
            return [owned, *cloud(core)]

        settings = Settings(admins=("root",), burst_after_s=15 * 60.0, **cfg)
        self.service = GpuService(engine, settings, self.clock, wire)
        assert self.service.bursts is not None and self.service.places.bursting
        fleet = self.service.fleet
        assert isinstance(fleet, Fleet)
        self.fleet = fleet

    def tick(self) -> None:
        """The worker's order: offers, poll, dispatch."""
        assert self.service.bursts is not None
        self.service.tick()
        self.service.bursts.tick()
        self.service.runs.poll()
        self.service.runs.dispatch()
        # The host checks (the worker's, every 15 s): a host that dropped one connection
        # under load is dialled again by them alone, as in the worker.
        hostcheck.hostcheck_job(self.service)

    def offer(self, run_id: int) -> BurstOffer | None:
        with Session(self.service.engine) as s:
            return s.exec(select(BurstOffer).where(BurstOffer.run_id == run_id)).first()

    def run(self, run_id: int) -> TrainingRun:
        with Session(self.service.engine) as s:
            run = s.get(TrainingRun, run_id)
            assert run is not None
            return run

    def launches(self) -> list[LaunchRequest]:
        with Session(self.service.engine) as s:
            return list(s.exec(select(LaunchRequest).order_by(col(LaunchRequest.id))))

    def until(self, what: str, check: Any) -> None:
        """Ticks, the virtual clock moving 30 s a tick (what runs meanwhile is billed for
        it), until `check`."""
        deadline = time.monotonic() + GUARD_S
        while not check():
            assert time.monotonic() < deadline, f"{what}: not within the guard"
            self.tick()
            self.clock.advance(timedelta(seconds=30))
            time.sleep(0.2)

    def dms(self, user: str) -> list[str]:
        return notes(self.service.engine, "dm", user)


@pytest.fixture
def team(engine: Engine, inprocess_lab: AwsLab, ssh: SshLab, tmp_path: Path) -> Iterator[Team]:
    t = Team(engine, inprocess_lab, ssh, tmp_path / "remote")
    try:
        yield t
    finally:
        # The run watchers stop before the database goes (a PostgreSQL schema is dropped).
        t.service.runs.ctx.executor.keep_watching(())
        t.client.close()


def _script(tmp_path: Path) -> Path:
    script = tmp_path / "train.py"
    script.write_text("import training\ntraining.report(step=1, loss=0.5)\nprint('trained')\n")
    return script


def _submit(t: Team, who: str, script: Path, *, cloud: str | None = None) -> int:
    reply = t.service.runs.submit(
        t.service.actor(who),
        Run(command=(sys.executable, str(script)), model="T4", max_duration=HOUR, cloud=cloud),
    )
    return int(reply.extra["run_id"])


def _box_taken(t: Team) -> int:
    """bob holds the team's only T4 for two hours."""
    reply = t.service.reserve(
        t.service.actor("bob"), Reserve(count=1, model="T4", duration=2 * HOUR)
    )
    assert not reply.error
    with Session(t.service.engine) as s:
        return max(r.id or 0 for r in s.exec(select(Reservation)))


def _box_busy(t: Team) -> int:
    """bob's run of unknown length (no --max) holds the team's only T4."""
    bob = t.service.actor("bob")
    # Long enough to outlast the test, short enough not to linger long after it.
    rid = int(t.service.runs.submit(bob, Run(command=("sleep", "120"), model="T4")).extra["run_id"])
    t.until("bob's run holds the box", lambda: t.run(rid).state == "running")
    return rid


def test_a_long_wait_is_offered_ec2_with_its_price_and_taking_it_runs_the_run_there(
    team: Team, tmp_path: Path
) -> None:
    t = team
    bobs = _box_busy(t)
    rid = _submit(t, "alice", _script(tmp_path))
    t.tick()
    status = handle_text(t.service, t.service.actor("alice"), "/gpu status")
    assert (
        "Places, in the team's order: the team's SSH hosts: 0 of 1 free; EC2: 0 of 0 free, "
        "offered, priced, to a run that has waited 15m."
    ) in str(status.view.blocks)
    # Owned first: nothing is bought while she waits under the threshold (bob's run has
    # no known end, so no wait is predicted).
    t.clock.advance(timedelta(minutes=14))
    t.tick()
    assert t.offer(rid) is None and t.launches() == []
    t.clock.advance(timedelta(minutes=2))
    t.tick()
    offer = t.offer(rid)
    assert offer is not None and offer.state == st.OPEN and offer.expected_start is None
    assert offer.instance_type == "g4dn.xlarge" and offer.hours == 1.0 and not offer.assumed
    assert t.launches() == [], "an offer buys nothing"
    (dm,) = [d for d in t.dms("alice") if "waited" in d]
    assert f"Run #{rid} has waited 16m" in dm and "g4dn.xlarge" in dm
    assert "no start is known on them yet" in dm
    assert f"about ${offer.estimate_usd:.2f} for its --max of 1h" in dm
    # The buttons, as Slack gets them: within Block Kit's limits, each a /gpu line.
    view = _offer_view(t, f"run:{rid}")
    actions = [b for b in blocks.message(view)["blocks"] if b["type"] == "actions"]
    (buttons,) = [a["elements"] for a in actions]
    assert [b["text"]["text"] for b in buttons] == [
        f"Run on EC2 now, about ${offer.estimate_usd:.2f}",
        "Keep waiting",
    ]
    assert [b["value"] for b in buttons] == [f"/gpu cloud take {rid}", f"/gpu cloud wait {rid}"]

    taken = handle_text(t.service, t.service.actor("alice"), f"/gpu cloud take {rid}")
    assert not taken.error and "g4dn.xlarge is being bought" in taken.view.text
    again = handle_text(t.service, t.service.actor("alice"), f"/gpu cloud take {rid}")
    assert again.error and "was taken already" in again.view.text
    t.tick()
    (req,) = t.launches()
    assert req.run_id == rid and req.instance_id is not None
    t.fleet.refresh()
    t.until("the run finished on EC2", lambda: t.run(rid).state in ("succeeded", "failed"))
    run = t.run(rid)
    assert run.state == "succeeded" and run.placement["host"] == req.instance_id
    assert run.placement["at"] == "aws"
    t.tick()
    assert (o := t.offer(rid)) is not None and o.state == st.CLOUD
    # Her run was billed at the instance's price, once: one interval, on the instance.
    with Session(t.service.engine) as s:
        ivs = list(s.exec(select(UsageInterval).where(UsageInterval.run_id == rid)))
        inst = s.exec(select(Host).where(Host.instance_id == req.instance_id)).one()
    assert len(ivs) == 1 and ivs[0].host_id == inst.id
    assert ivs[0].usd_per_hour == pytest.approx(inst.hourly_usd)
    # Her cost says which side it was on; the team's says what bursting did.
    _, costs, _ = t.service.costs("week", "alice")
    cost = handle_text(t.service, t.service.actor("alice"), "/gpu cost")
    assert not cost.error
    assert (
        f"Of it, $0.00 on the team's own GPUs (at the team's rates) and {money(costs['alice'])} on EC2"
        in str(cost.view.blocks)
    )
    assert costs["alice"] > 0
    bill = handle_text(t.service, t.service.actor("alice"), "/gpu cost team")
    said = str(bill.view.blocks)
    assert "The team's own GPUs and EC2, per person" in said
    assert f"1 request went to EC2 after waiting, costing {money(costs['alice'])} there" in said
    assert "(1 had no expected start there)" in said and "Offers made: 1 (1 taken" in said
    with Session(t.service.engine) as s:
        now = t.clock.now()
        year, week, _ = now.isocalendar()
        digest = build_digest(s, year, week, now, t.service.settings)
    assert digest.bursting is not None and digest.bursting.on_cloud == 1
    shown = str(digest_view(digest).blocks)
    assert "*Bursting*: 1 request went to the cloud after waiting" in shown
    assert len(t.launches()) == 1
    t.service.runs.cancel(t.service.actor("bob"), Cancel(bobs))


def test_a_wait_the_owned_side_predicts_long_is_offered_at_once_and_what_it_saved_counted(
    team: Team, tmp_path: Path
) -> None:
    """bob's reservation holds the box for two hours: alice's wait is predicted from its
    end, so the offer comes at once, and taking it saves about those two hours."""
    t = team
    _box_taken(t)
    rid = _submit(t, "alice", _script(tmp_path))
    t.tick()
    offer = t.offer(rid)
    assert offer is not None and offer.state == st.OPEN and offer.expected_start is not None
    (dm,) = [d for d in t.dms("alice") if f"Run #{rid} would wait" in d]
    assert f"Run #{rid} would wait about 2h for the team's own T4 GPUs" in dm
    assert "expected to start on them" in dm and "(in 2h)" in dm
    handle_text(t.service, t.service.actor("alice"), f"/gpu cloud take {rid}")
    t.tick()
    t.fleet.refresh()
    t.until("the run finished on EC2", lambda: t.run(rid).state == "succeeded")
    t.until("settled", lambda: (o := t.offer(rid)) is not None and o.state == st.CLOUD)
    o = t.offer(rid)
    assert o is not None and o.expected_start is not None and o.cloud_start is not None
    saved_h = (o.expected_start - o.cloud_start).total_seconds() / 3600
    assert saved_h == pytest.approx(2, abs=0.05)
    said = str(handle_text(t.service, t.service.actor("bob"), "/gpu cost team").view.blocks)
    assert f"starting {saved_h:,.1f} h sooner in all" in said


def test_the_owned_host_freeing_first_withdraws_the_offer_and_buys_nothing(
    team: Team, tmp_path: Path
) -> None:
    t = team
    res = _box_taken(t)
    rid = _submit(t, "alice", _script(tmp_path))
    t.clock.advance(timedelta(minutes=16))
    t.tick()
    assert (o := t.offer(rid)) is not None and o.state == st.OPEN
    t.service.release(t.service.actor("bob"), _release(res))
    t.until("the run started on the box", lambda: t.run(rid).placement.get("host") == "box")
    t.tick()
    assert (o := t.offer(rid)) is not None and o.state == st.WITHDRAWN
    assert any(
        f"Run #{rid} started on the team's SSH hosts" in d and "nothing was bought" in d
        for d in t.dms("alice")
    )
    late = handle_text(t.service, t.service.actor("alice"), f"/gpu cloud take {rid}")
    assert late.error and "offer for run" in late.view.text
    assert t.launches() == []


def test_a_budget_that_cannot_cover_the_estimate_is_said_and_nothing_launches(
    team: Team, tmp_path: Path
) -> None:
    t = team
    _box_taken(t)
    rid = _submit(t, "alice", _script(tmp_path))
    budget = handle_text(t.service, t.service.actor("root"), "/gpu budget @alice 0.10/week")
    assert not budget.error, budget.view.text
    t.clock.advance(timedelta(minutes=16))
    t.tick()
    offer = t.offer(rid)
    assert offer is not None and offer.state == st.REFUSED
    (dm,) = [d for d in t.dms("alice") if "waited" in d]
    assert "over your weekly GPU budget of $0.10" in dm and "keeps waiting" in dm
    taken = handle_text(t.service, t.service.actor("alice"), f"/gpu cloud take {rid}")
    assert taken.error and "Nothing was bought" in taken.view.text
    for _ in range(3):
        t.tick()
    assert t.launches() == []


def test_cloud_never_is_never_offered_and_cloud_ok_takes_it_in_advance(
    team: Team, tmp_path: Path
) -> None:
    t = team
    _box_taken(t)
    never = _submit(t, "alice", _script(tmp_path), cloud="never")
    ok = _submit(t, "carol", _script(tmp_path), cloud="ok")
    t.clock.advance(timedelta(minutes=16))
    t.tick()
    assert t.offer(never) is None
    taken = t.offer(ok)
    assert taken is not None and taken.state in st.BUYING
    assert any("You took it in advance" in d for d in t.dms("carol"))
    t.tick()
    assert [r.run_id for r in t.launches()] == [ok]


def test_what_was_bought_for_a_run_the_owned_host_started_first_is_given_back(
    team: Team, tmp_path: Path
) -> None:
    t = team
    res = _box_taken(t)
    rid = _submit(t, "alice", _script(tmp_path))
    t.clock.advance(timedelta(minutes=16))
    t.tick()
    handle_text(t.service, t.service.actor("alice"), f"/gpu cloud take {rid}")
    t.tick()
    (req,) = t.launches()
    assert req.instance_id is not None
    # The box frees while the instance still boots: the box starts it first.
    t.service.release(t.service.actor("bob"), _release(res))
    t.until("the run started on the box", lambda: t.run(rid).placement.get("host") == "box")
    t.until("the offer settled", lambda: (o := t.offer(rid)) is not None and o.state == st.OWNED)
    with Session(t.service.engine) as s:
        inst = s.exec(select(Host).where(Host.instance_id == req.instance_id)).one()
    assert inst.state == HOST_TERMINATED
    assert any(f"Run #{rid} started on the team's SSH hosts first" in d for d in t.dms("alice"))
    assert len(t.launches()) == 1


def _offer_view(t: Team, key: str) -> views.View:
    """The plan's DM as it was written for the outbox (`run:12`, `res:3`)."""
    with Session(t.service.engine) as s:
        (note,) = s.exec(
            select(Notification).where(col(Notification.dedupe_key).endswith(f"burst-offer:{key}"))
        )
    return views.View.from_dict(note.view)


def _release(res_id: int) -> Any:
    from bot.domain.commands import Release

    return Release(res_id)


def test_the_runtime_takes_owned_places_then_the_cloud_and_refuses_the_cloud_first(
    inprocess_lab: AwsLab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The composition root from the environment, as `gpubot serve` starts: `ssh,aws` is
    the team's SSH host first and EC2 after it; `aws,ssh` is refused at start, saying
    the order it wants."""
    from bot.app.config import ConfigError, load_settings
    from bot.faces.runtime import build_runtime
    from tests.provisioning_aws.conftest import REGION

    key = tmp_path / "id_test"
    key.write_text("not a key: nothing is dialled here\n")
    key.chmod(0o600)
    lab = inprocess_lab
    env = {
        "GPUBOT_HOME": str(tmp_path / "home"),
        "GPUBOT_PROVIDERS": "ssh,aws",
        "GPUBOT_SSH_HOSTS": "box=127.0.0.1:1/1xT4",
        "GPUBOT_SSH_KEY": str(key),
        "GPUBOT_AWS_REGION": REGION,
        "GPUBOT_AWS_SUBNETS": ",".join(lab.subnet_ids),
        "GPUBOT_AWS_SECURITY_GROUPS": lab.security_group_id,
        "GPUBOT_AWS_KEY_NAME": lab.key_name,
        "GPUBOT_AWS_AMI": lab.ami_id,
    }
    monkeypatch.delenv("DATABASE_URL", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    rt = build_runtime(load_settings())
    try:
        svc = rt.service
        assert svc.places.names == ("ssh", "aws") and svc.bursts is not None
        said = str(handle_text(svc, svc.actor("alice"), "/gpu status").view.blocks)
        assert "Places, in the team's order: the team's SSH hosts: " in said
        assert "EC2: 0 of 0 free, offered, priced, to a run that has waited 15m." in said
    finally:
        rt.engine.dispose()
    monkeypatch.setenv("GPUBOT_PROVIDERS", "aws,ssh")
    with pytest.raises(ConfigError, match=r"aws buys machines, so it goes last.*=ssh,aws"):
        build_runtime(load_settings())


def test_a_reservation_is_offered_ec2_and_held_wherever_gpus_free_first(team: Team) -> None:
    """A reservation gpubot grants itself: nothing is bought while it waits; one whose
    model no owned host has is offered at once and bought when taken, and granted on the
    instance; one for the box is offered by the box's expected end, taken, and the box
    freeing first gets it, the instance bought for it given back."""
    t = team
    res_box = _box_taken(t)
    carol = t.service.actor("carol")
    assert not t.service.reserve(carol, Reserve(count=1, model="V100", duration=HOUR)).error
    t4 = t.service.reserve(carol, Reserve(count=1, model="T4", duration=HOUR))
    assert not t4.error
    v100, mine = sorted(_waiting_reservations(t))
    t.fleet.cycle()
    assert t.launches() == [], "nothing is bought for a reservation unasked"
    t.tick()
    offers = {o.reservation_id: o for o in _offers(t)}
    assert set(offers) == {v100, mine} and all(o.state == st.OPEN for o in offers.values())
    said = "\n".join(t.dms("carol"))
    assert f"Reservation #{v100} would wait for good for the team's own V100 GPUs" in said
    assert f"Reservation #{mine} would wait about 2h for the team's own T4 GPUs" in said
    assert f"/gpu cloud take res {v100}" in str(_offer_view(t, f"res:{v100}").blocks)
    for rid in (v100, mine):
        taken = handle_text(t.service, carol, f"/gpu cloud take res {rid}")
        assert not taken.error, taken.view.text
    t.fleet.cycle()
    bought = {r.reservation_id: r for r in t.launches()}
    assert set(bought) == {v100, mine}
    # The box frees before the T4 instance is ready: the box's reservation gets it.
    t.service.release(t.service.actor("bob"), _release(res_box))
    t.until("the T4 reservation held", lambda: _res(t, mine).state == "active")
    assert _host_of(t, mine) == "box"
    t.fleet.refresh()
    t.until("the V100 reservation held", lambda: _res(t, v100).state == "active")
    t.until(
        "settled",
        lambda: {o.reservation_id: o.state for o in _offers(t)} == {v100: st.CLOUD, mine: st.OWNED},
    )
    with Session(t.service.engine) as s:
        given = s.exec(select(Host).where(Host.instance_id == bought[mine].instance_id)).one()
    assert given.state == HOST_TERMINATED
    assert any(
        f"Reservation #{mine} started on the team's SSH hosts first" in d for d in t.dms("carol")
    )


def _waiting_reservations(t: Team) -> list[int]:
    with Session(t.service.engine) as s:
        return [
            r.id or 0 for r in s.exec(select(Reservation).where(Reservation.state == "waiting"))
        ]


def _offers(t: Team) -> list[BurstOffer]:
    with Session(t.service.engine) as s:
        return list(s.exec(select(BurstOffer).order_by(col(BurstOffer.id))))


def _res(t: Team, res_id: int) -> Reservation:
    with Session(t.service.engine) as s:
        res = s.get(Reservation, res_id)
        assert res is not None
        return res


def _host_of(t: Team, res_id: int) -> str:
    with Session(t.service.engine) as s:
        res = s.get(Reservation, res_id)
        host = s.get(Host, res.host_id) if res is not None and res.host_id else None
        return host.name if host is not None else ""
