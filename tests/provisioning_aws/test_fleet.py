"""The fleet on moto (in process), its hosts reached on a real loopback sshd.

Reuse order, pool limits, idle stop/terminate on a virtual clock, reconcile (adopt an
unrecorded launch, end what vanished), and capacity errors told to the user in words.

A shortcut: the instances map to the default lab (the bot's own user) and are prepared
without a bootstrap; these tests are about the fleet's money and lifecycle. The fleet's
own preparation from nothing on a stranger is tests/provisioning_aws/test_journey.py.
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

from bot.app.fleet import REQ_FAILED, REQ_LAUNCHED, REQ_PENDING
from bot.domain.commands import Release, Reserve, Run
from bot.faces.dispatch import handle_text
from db.models import (
    HOST_PENDING,
    HOST_READY,
    HOST_STOPPED,
    HOST_TERMINATED,
    RES_ACTIVE,
    RES_RELEASED,
    RES_WAITING,
    RUN_QUEUED,
    RUN_RUNNING,
    Gpu,
    Host,
    HostPeriod,
    LaunchRequest,
    Reservation,
    TrainingRun,
)
from provisioning.compute import LaunchSpec
from provisioning.ssh import SshTarget
from tests.core.fleet_helpers import FleetBench, make_fleet
from tests.provisioning_aws.conftest import AwsLab
from tests.provisioning_aws.faults import RunInstancesFaults
from tests.ssh_hosts import SshLab

HOUR = timedelta(hours=1)


@pytest.fixture(params=["sqlite", "postgres"])
def engine(request: pytest.FixtureRequest) -> Engine:
    result: Engine = request.getfixturevalue(
        f"{'sqlite' if request.param == 'sqlite' else 'pg'}_engine"
    )
    return result


@pytest.fixture
def bench(
    engine: Engine, inprocess_lab: AwsLab, ssh: SshLab, tmp_path: Path
) -> Iterator[FleetBench]:
    b = make_fleet(engine, inprocess_lab.compute(), ssh, tmp_path / "remote")
    try:
        yield b
    finally:
        b.client.close()


def managed(lab: AwsLab) -> list[dict[str, Any]]:
    """Every instance in the fake account carrying gpubot's tag, in any state."""
    ec2 = lab.ec2()
    out = []
    for r in ec2.describe_instances(Filters=[{"Name": "tag:gpubot:managed", "Values": ["true"]}])[
        "Reservations"
    ]:
        out.extend(r["Instances"])
    return out


def ec2_state(lab: AwsLab, instance_id: str) -> str:
    resp = lab.ec2().describe_instances(InstanceIds=[instance_id])
    return str(resp["Reservations"][0]["Instances"][0]["State"]["Name"])


def seed(b: FleetBench, key: str = "seed") -> str:
    """An instance the bot launched earlier, synced and SSH-ready."""
    inst = b.fleet.compute.launch(
        LaunchSpec(
            gpu_model="T4",
            gpus=1,
            market="ondemand",
            owner="root",
            request_key=key,
            reservation_id="0",
        )
    )
    b.fleet.refresh()
    assert inst.instance_id is not None
    assert b.host(inst.instance_id).state == HOST_READY
    return inst.instance_id


def reserve(b: FleetBench, who: str, model: str = "T4") -> int:
    b.service.reserve(b.service.actor(who), Reserve(count=1, model=model, duration=2 * HOUR))
    with Session(b.service.engine) as s:
        return max(
            r.id or 0
            for r in s.exec(
                select(Reservation).where(col(Reservation.state).in_((RES_WAITING, RES_ACTIVE)))
            )
        )


def res_state(b: FleetBench, res_id: int) -> Reservation:
    with Session(b.service.engine) as s:
        res = s.get(Reservation, res_id)
        assert res is not None
        return res


def test_reuse_running_then_launch_then_start_a_stopped_one(
    bench: FleetBench, inprocess_lab: AwsLab
) -> None:
    b = bench
    first = seed(b)
    # 1. A running instance with a free GPU: the grant pass uses it; nothing is bought.
    alice = reserve(b, "alice")
    assert res_state(b, alice).state == RES_ACTIVE
    assert b.fleet.provision() == []
    assert len(managed(inprocess_lab)) == 1

    # 2. No free T4 and nothing stopped: one launch, told by DM, recorded before/after.
    bob = reserve(b, "bob")
    assert res_state(b, bob).state == RES_WAITING
    done = b.fleet.provision()
    assert len(done) == 1 and done[0].startswith("launched ")
    second = done[0].split()[1]
    assert [r.request_key for r in b.requests()] == [f"res-{bob}-0"]
    assert b.requests()[0].state == REQ_LAUNCHED and b.requests()[0].instance_id == second
    assert b.host(second).state == HOST_PENDING  # not granted on before SSH answers
    (dm,) = b.dms("bob")
    assert "launching g4dn.xlarge in us-east-1a" in dm and "ready in ~" in dm
    # Asking again while it boots launches nothing more.
    assert b.fleet.provision() == []
    assert len(managed(inprocess_lab)) == 2
    # SSH answers: ready, and the normal grant pass gives bob his GPU.
    b.fleet.refresh()
    assert b.host(second).state == HOST_READY
    b.service.tick()
    assert res_state(b, bob).state == RES_ACTIVE
    assert res_state(b, bob).host_id == b.host(second).id

    # 3. Bob is done; the idle instance is stopped after idle_stop_after.
    b.service.release(b.service.actor("bob"), Release(reservation_id=bob))
    b.clock.advance(timedelta(minutes=14))
    assert b.fleet.idle() == []
    b.clock.advance(timedelta(minutes=2))
    assert b.fleet.idle() == [f"stopped {second}"]
    assert b.host(second).state == HOST_STOPPED
    assert ec2_state(inprocess_lab, second) in ("stopping", "stopped")
    assert any(second in note and "Stopped idle instance" in note for note in b.channel())

    # 4. Carol waits for a T4: the stopped instance is started, not a new one launched.
    carol = reserve(b, "carol")
    assert res_state(b, carol).state == RES_WAITING
    assert b.fleet.provision() == [f"started {second} for reservation {carol}"]
    assert "starting a stopped T4 instance" in b.dms("carol")[0]
    assert len(managed(inprocess_lab)) == 2
    b.fleet.refresh()
    b.service.tick()
    assert res_state(b, carol).state == RES_ACTIVE
    assert res_state(b, carol).host_id == b.host(second).id
    assert first != second
    # Each instance was prepared once, before its first grant; a restart keeps its disk.
    assert b.prepared == [first, second]


def test_pool_limit_refuses_a_launch_in_plain_words(
    bench: FleetBench, inprocess_lab: AwsLab
) -> None:
    b = bench
    seed(b)
    root = b.service.actor("root")
    # Members may look, not change; admins change.
    refused = handle_text(b.service, b.service.actor("dave"), "/gpu pool set g4dn.xlarge max=1")
    assert refused.error and "Only an admin" in refused.view.text
    ok = handle_text(b.service, root, "/gpu pool set g4dn.xlarge max=1")
    assert not ok.error and "g4dn.xlarge" in ok.view.text
    shown = handle_text(b.service, b.service.actor("dave"), "/gpu pool")
    assert not shown.error
    assert "g4dn.xlarge: 1 running, 0 stopped" in shown.view.text

    reserve(b, "alice")
    bob = reserve(b, "bob")
    assert b.fleet.provision() == []
    (dm,) = b.dms("bob")
    assert "may not launch" in dm
    assert "at most 1 g4dn.xlarge instance and 1 is running" in dm
    assert len(managed(inprocess_lab)) == 1
    assert b.requests() == []
    # The same refusal is not repeated every pass.
    b.fleet.provision()
    assert len(b.dms("bob")) == 1
    # A spend cap speaks in dollars.
    handle_text(b.service, root, "/gpu pool set g4dn.xlarge max=5 spend=0.60")
    b.service.release(b.service.actor("bob"), Release(reservation_id=bob))
    reserve(b, "erin")
    b.fleet.provision()
    (dm,) = b.dms("erin")
    assert "at most $0.60/h on g4dn.xlarge; $0.53/h runs now" in dm
    assert len(managed(inprocess_lab)) == 1


def test_a_launch_that_would_break_the_owners_budget_is_not_made(
    bench: FleetBench, inprocess_lab: AwsLab
) -> None:
    b = bench
    seed(b)
    reserve(b, "alice")  # holds the one T4
    bob = reserve(b, "bob")
    assert res_state(b, bob).state == RES_WAITING
    # The budget comes after the request: only the launch can catch it.
    ok = handle_text(b.service, b.service.actor("root"), "/gpu budget @bob 0.50/week")
    assert not ok.error, ok.view.text
    assert b.fleet.provision() == []
    (dm,) = b.dms("bob")
    assert "Launching an instance for your reservation" in dm and "$0.50" in dm
    assert b.requests() == []
    assert len(managed(inprocess_lab)) == 1
    # Told once, not on every pass; with room in the budget the launch goes ahead.
    b.fleet.provision()
    assert len(b.dms("bob")) == 1
    handle_text(b.service, b.service.actor("root"), "/gpu budget @bob 50/week")
    assert b.fleet.provision() != []
    assert len(managed(inprocess_lab)) == 2


def test_idle_instance_is_stopped_then_terminated_with_channel_notes(
    bench: FleetBench, inprocess_lab: AwsLab
) -> None:
    b = bench
    iid = seed(b)
    alice = reserve(b, "alice")
    # Held: never idle, however long.
    b.clock.advance(timedelta(minutes=90))
    assert b.fleet.idle() == []
    b.service.release(b.service.actor("alice"), Release(reservation_id=alice))
    # Idle counts from the release (the last usage), not from the launch.
    b.clock.advance(timedelta(minutes=10))
    assert b.fleet.idle() == []
    b.clock.advance(timedelta(minutes=5))
    assert b.fleet.idle() == [f"stopped {iid}"]
    # The bill follows: a stopped period (storage only) is open now.
    with Session(b.service.engine) as s:
        period = s.exec(select(HostPeriod).where(col(HostPeriod.ended_at).is_(None))).one()
    assert period.state == "stopped" and period.storage_usd_per_hour > 0
    b.clock.advance(timedelta(days=2, hours=23))
    assert b.fleet.idle() == []
    b.clock.advance(timedelta(hours=1))
    assert b.fleet.idle() == [f"terminated {iid}"]
    assert ec2_state(inprocess_lab, iid) in ("shutting-down", "terminated")
    assert b.host(iid).state == HOST_TERMINATED
    notes = b.channel()
    assert len(notes) == 2
    assert notes[0].startswith(f"Stopped idle instance {iid}") and "15m" in notes[0]
    assert notes[1].startswith(f"Terminated instance {iid}") and "3d" in notes[1]
    # Running the pass again changes and posts nothing.
    assert b.fleet.idle() == []
    assert len(b.channel()) == 2


def test_reconcile_adopts_an_unrecorded_launch_and_leaves_foreign_instances_alone(
    bench: FleetBench, inprocess_lab: AwsLab
) -> None:
    b = bench
    seed(b)
    reserve(b, "alice")
    bob = reserve(b, "bob")
    # What a worker killed after the launch call leaves: the intent, and an instance.
    now = b.clock.now()
    with Session(b.service.engine) as s:
        s.add(
            LaunchRequest(
                request_key=f"res-{bob}-0",
                gpu_model="T4",
                owner="bob",
                reservation_id=bob,
                state=REQ_PENDING,
                created_at=now,
                updated_at=now,
            )
        )
        s.commit()
    # While it is pending, no second launch happens for bob.
    assert b.fleet.provision() == []
    orphan = b.fleet.compute.launch(
        LaunchSpec(
            gpu_model="T4",
            gpus=1,
            market="ondemand",
            owner="bob",
            request_key=f"res-{bob}-0",
            reservation_id=str(bob),
        )
    )
    # Someone else's machine in the same account: no gpubot tags.
    ec2 = inprocess_lab.ec2()
    foreign = ec2.run_instances(
        ImageId=inprocess_lab.ami_id,
        MinCount=1,
        MaxCount=1,
        InstanceType="g4dn.xlarge",
        SubnetId=inprocess_lab.subnet_ids[0],
    )["Instances"][0]["InstanceId"]

    report = b.fleet.reconcile()
    assert report.adopted == (orphan.instance_id,)
    (req,) = b.requests()
    assert req.state == REQ_LAUNCHED and req.instance_id == orphan.instance_id
    assert orphan.instance_id is not None
    assert b.host(orphan.instance_id).state == HOST_READY  # SSH answered on loopback
    assert any("is booting" in dm for dm in b.dms("bob"))
    b.service.tick()
    assert res_state(b, bob).state == RES_ACTIVE
    # Nothing launched twice, the foreign instance untouched and unknown to the bot.
    assert len(managed(inprocess_lab)) == 2
    assert b.fleet.reconcile().adopted == ()
    b.clock.advance(timedelta(days=5))
    b.fleet.idle()
    assert ec2_state(inprocess_lab, foreign) == "running"
    with Session(b.service.engine) as s:
        assert s.exec(select(Gpu).where(Gpu.host_id == -1)).all() == []
    assert all(h != foreign for h in _host_names(b))


def _host_names(b: FleetBench) -> list[str]:
    from db.models import Host

    with Session(b.service.engine) as s:
        return [h.name for h in s.exec(select(Host))]


def test_reconcile_marks_a_vanished_instance_terminated_and_tells_its_users(
    bench: FleetBench, inprocess_lab: AwsLab, tmp_path: Path
) -> None:
    b = bench
    iid = seed(b)
    alice = reserve(b, "alice")
    assert res_state(b, alice).state == RES_ACTIVE
    # A second instance runs bob's training run.
    other = seed(b, key="seed-2")
    now = b.clock.now()
    with Session(b.service.engine) as s:
        bob = b.service.user_row(s, "bob")
        host = b.host(other)
        run = TrainingRun(
            user_id=bob.id,  # type: ignore[arg-type]
            command="python train.py",
            gpu_model="T4",
            state=RUN_RUNNING,
            host_id=host.id,
            placement={"host": other, "pgid": 4242},
            submitted_at=now,
            started_at=now,
        )
        s.add(run)
        s.flush()
        gpu = s.exec(select(Gpu).where(Gpu.host_id == host.id)).one()
        b.service.open_usage(s, host, [gpu], bob.id, now, run_id=run.id)  # type: ignore[arg-type]
        run_id = run.id
        s.commit()
    # The cloud ends both behind the bot's back (a spot reclaim, someone in the console).
    inprocess_lab.ec2().terminate_instances(InstanceIds=[iid, other])
    b.clock.advance(timedelta(minutes=3))
    report = b.fleet.reconcile()
    assert sorted(report.lost) == sorted([iid, other])
    assert b.host(iid).state == HOST_TERMINATED and b.host(other).state == HOST_TERMINATED
    res = res_state(b, alice)
    assert res.state == RES_RELEASED and res.ended_at == b.clock.now()
    assert any(f"reservation #{alice} has ended" in dm and iid in dm for dm in b.dms("alice"))
    with Session(b.service.engine) as s:
        after = s.get(TrainingRun, run_id)
        assert after is not None and after.state == RUN_QUEUED and after.host_id is None
    assert any(f"Run #{run_id} is back in line" in dm for dm in b.dms("bob"))
    # Billing closed: no open period on either host.
    with Session(b.service.engine) as s:
        assert s.exec(select(HostPeriod).where(col(HostPeriod.ended_at).is_(None))).all() == []
    # Idempotent: a second pass finds nothing new to do or say.
    assert b.fleet.reconcile().lost == ()
    assert len(b.dms("alice")) == 1


def test_capacity_errors_are_told_to_the_user_and_retried_later(
    sqlite_engine: Engine, inprocess_lab: AwsLab, ssh: SshLab, tmp_path: Path
) -> None:
    # The hook goes on the session before the provider makes its client.
    faults = RunInstancesFaults(refuse=lambda itype, subnet: None)
    inprocess_lab.on_run_instances(faults)
    b = make_fleet(sqlite_engine, inprocess_lab.compute(), ssh, tmp_path / "remote")
    seed(b)
    faults.refuse = lambda itype, subnet: "InsufficientInstanceCapacity"
    reserve(b, "alice")
    bob = reserve(b, "bob")
    assert b.fleet.provision() == []
    (dm,) = b.dms("bob")
    assert "could not launch" in dm
    assert "no on-demand capacity for 1× T4" in dm and "us-east-1a" in dm and "us-east-1b" in dm
    assert "try again in 10m" in dm
    (req,) = b.requests()
    assert req.state == REQ_FAILED and "capacity" in (req.error or "")
    # Not retried at once (every pass would cost API calls and a DM).
    attempts = len(faults.attempts)
    assert b.fleet.provision() == []
    assert len(faults.attempts) == attempts
    # After the back-off it tries again with a new request key; capacity is back.
    faults.refuse = lambda itype, subnet: None
    b.clock.advance(timedelta(minutes=11))
    done = b.fleet.provision()
    assert len(done) == 1 and done[0].endswith(f"for reservation {bob}")
    assert [r.request_key for r in b.requests()] == [f"res-{bob}-0", f"res-{bob}-1"]
    assert len(managed(inprocess_lab)) == 2
    b.client.close()


def test_a_queued_run_gets_an_instance_launched_and_runs_there(
    bench: FleetBench, inprocess_lab: AwsLab, tmp_path: Path
) -> None:
    """The scheduler's Launch for a run goes through the fleet: one launch (job-tagged),
    and the run is placed there once SSH answers."""
    b = bench
    seed(b)
    reserve(b, "alice")  # the one T4 is taken for 2h
    runs = b.service.runs
    script = tmp_path / "train.py"
    script.write_text("import training\ntraining.report(step=1, loss=0.5)\nprint('trained')\n")
    rid = runs.submit(
        b.service.actor("bob"), Run(command=(sys.executable, str(script)), model="T4")
    ).extra["run_id"]
    assert runs.dispatch() == 0
    (req,) = b.requests()
    assert req.request_key == f"run-{rid}-0" and req.run_id == rid and req.state == REQ_LAUNCHED
    launched = req.instance_id
    assert launched is not None
    tags = {t["Key"]: t["Value"] for t in managed(inprocess_lab)[-1]["Tags"]}
    assert tags["gpubot:job"] == str(rid) and tags["gpubot:owner"] == "bob"
    assert any("your run #" in dm and "launching g4dn.xlarge" in dm for dm in b.dms("bob"))
    # Asked again while it boots: nothing more is bought.
    assert runs.dispatch() == 0
    assert len(managed(inprocess_lab)) == 2
    b.fleet.refresh()
    assert b.host(launched).state == HOST_READY
    deadline = time.monotonic() + 120
    while True:
        runs.poll()
        runs.dispatch()
        with Session(b.service.engine) as s:
            run = s.get(TrainingRun, rid)
            assert run is not None
            if run.state in ("succeeded", "failed"):
                break
        assert time.monotonic() < deadline, "the run did not finish"
        time.sleep(0.3)
    assert run.state == "succeeded" and run.placement["host"] == launched
    assert len(managed(inprocess_lab)) == 2


@pytest.mark.parametrize(
    ("model", "gpus", "itype", "count"),
    [
        ("A100", 16, "p4d.24xlarge", 2),  # the case: 16 GPUs on 8-GPU instances
        # Eight 1-GPU p3.2xlarge would break the pool's cap of 4 per type: two p3.8xlarge.
        ("V100", 8, "p3.8xlarge", 2),
    ],
)
def test_a_run_larger_than_any_instance_gets_instances_of_one_type(
    bench: FleetBench, inprocess_lab: AwsLab, model: str, gpus: int, itype: str, count: int
) -> None:
    """More GPUs than any one instance type holds: the run is taken (not refused as
    needing one machine), and the scheduler's Launches buy instances of one type that
    hold it in equal shares, once each; a reservation that size is still refused."""
    b = bench
    runs = b.service.runs
    rid = runs.submit(
        b.service.actor("bob"), Run(command=(sys.executable, "-c", "pass"), gpus=gpus, model=model)
    ).extra["run_id"]
    assert runs.dispatch() == 0
    reqs = b.requests()
    assert [(r.run_id, r.state, r.gpus) for r in reqs] == [
        (rid, REQ_LAUNCHED, gpus // count)
    ] * count
    with Session(b.service.engine) as s:
        hosts = [s.exec(select(Host).where(Host.name == r.instance_id)).one() for r in reqs]
    assert [h.instance_type for h in hosts] == [itype] * count
    # Asked again while they boot: nothing more is bought.
    assert runs.dispatch() == 0
    assert len(b.requests()) == count == len(managed(inprocess_lab))
    too_big = handle_text(b.service, b.service.actor("alice"), f"/gpu reserve {gpus} {model}")
    assert too_big.error and "No single host has" in too_big.view.text


def test_an_empty_cloud_pool_takes_reservations_and_launches_for_them(
    bench: FleetBench, inprocess_lab: AwsLab
) -> None:
    b = bench
    # No host at all: the reservation waits instead of being refused...
    alice = reserve(b, "alice")
    assert res_state(b, alice).state == RES_WAITING
    # ...but what no instance type can hold is still refused up front.
    too_big = handle_text(b.service, b.service.actor("alice"), "/gpu reserve 16 T4")
    assert too_big.error and "No host here has T4" in too_big.view.text
    (done,) = b.fleet.provision()
    assert done.endswith(f"for reservation {alice}")
    b.fleet.refresh()
    b.service.tick()
    assert res_state(b, alice).state == RES_ACTIVE
    assert len(managed(inprocess_lab)) == 1


def test_an_instance_that_never_answers_ssh_is_stopped_with_a_note(
    engine: Engine, inprocess_lab: AwsLab, ssh: SshLab, tmp_path: Path
) -> None:
    # Loopback, but nothing listens there: the instance boots and SSH never answers.
    dead = SshTarget(host="127.0.0.9", port=1, user=ssh.user, key_path=str(ssh.client_key))
    b = make_fleet(engine, inprocess_lab.compute(), ssh, tmp_path / "remote", target=dead)
    try:
        alice = reserve(b, "alice")
        (done,) = b.fleet.provision()
        iid = done.split()[1]
        b.fleet.refresh()
        assert b.host(iid).state == HOST_PENDING
        b.service.tick()
        assert res_state(b, alice).state == RES_WAITING  # never granted on it
        assert b.prepared == []
        b.clock.advance(timedelta(minutes=29))
        assert b.fleet.idle() == []
        b.clock.advance(timedelta(minutes=1))
        assert b.fleet.idle() == [f"stopped {iid}"]
        (note,) = b.channel()
        assert "never became reachable over SSH" in note
        assert ec2_state(inprocess_lab, iid) in ("stopping", "stopped")
    finally:
        b.client.close()
