"""The whole journey in one test (the long one): `/gpu run --recipe digits` on an empty EC2
pool, to the bill.

EC2 is a moto server on 127.0.0.1 (`server_lab`: boto3 reaches it over a socket through
AWS_ENDPOINT_URL, as the bot's own process would); the instance it launches is reached on
lab-b, an isolated sshd host: its own unix account, its home emptied for this test, only
the system python3. The fleet prepares it with the production preparation
(`bootstrap_prepare` as the EC2 wiring passes it: cloud, stopping agent), so the journey
pays for a bootstrap from nothing itself: venv, torch and the rest of the `train` extra
(offline, from the shared wheel cache: the one difference from production), the code and
the host agent. The session's `bootstrapped` fixture prepares lab-a, not this host.

The agent runs in its EC2 form: the instance metadata address (Ec2Settings.metadata_url)
points at a loopback fake of IMDSv2, so its spot watch asks it as it asks EC2's; nothing
dials 169.254.169.254.

Time is the virtual clock: the run takes wall time on the host, the clock is advanced by
the test, and nothing is asserted about how long anything took.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
import torch
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.app.config import Settings
from bot.app.fleet import CatalogSupply, Fleet
from bot.app.hosts.hostcheck import HostChecker
from bot.app.hosts.remote import RemoteAccess, bootstrap_prepare
from bot.app.money.billing import IDLE_ROW, shown_cents, team_bill
from bot.app.places import RunParts, Wiring
from bot.app.service import GpuService
from bot.app.watching.utilization import CollectReport, collect
from bot.domain.clock import VirtualClock
from bot.domain.metering import Window, to_cents
from bot.faces.dispatch import handle_text
from db.models import (
    HOST_READY,
    HOST_STOPPED,
    HOST_TERMINATED,
    GpuSample,
    Host,
    HostPeriod,
    LaunchRequest,
    TrainingRun,
)
from provisioning.bootstrap import (
    BOOTSTRAP_VERSION,
    MARKER_NAME,
    agent_supervisor_alive,
    torch_requirement,
    train_requirements,
)
from provisioning.ssh import SshClient, SshTarget
from tests.core.fleet_helpers import LoopbackResolver, notes
from tests.isolated_hosts import emptied
from tests.provisioning_aws.conftest import AwsLab
from tests.ssh_hosts import SshLab, pip_env
from tests.training.test_agent import FakeImds
from training.precision import choose_precision
from training.telemetry import NO_DRIVER

pytestmark = [
    pytest.mark.journey,
    pytest.mark.skipif(sys.platform != "linux", reason="isolated hosts are Linux accounts"),
]


def _managed(lab: AwsLab) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    resp = lab.ec2().describe_instances(
        Filters=[{"Name": "tag:gpubot:managed", "Values": ["true"]}]
    )
    for r in resp["Reservations"]:
        out.extend(r["Instances"])
    return out


def _host(engine: Engine, name: str) -> Host:
    with Session(engine) as s:
        return s.exec(select(Host).where(Host.name == name)).one()


@pytest.fixture
def new_host(isolated_lab: SshLab) -> Iterator[SshTarget]:
    """lab-b as a new instance: nothing of its account runs, its home is empty."""
    with emptied(isolated_lab, "lab-b") as target:
        yield target


@pytest.fixture
def client() -> Iterator[SshClient]:
    c = SshClient(connect_timeout=5, command_timeout=120)
    try:
        yield c
    finally:
        c.close()


def test_run_digits_on_an_empty_ec2_pool_from_launch_to_terminate_and_the_bill(
    server_lab: AwsLab,
    isolated_lab: SshLab,
    new_host: SshTarget,
    imds: FakeImds,
    sqlite_engine: Engine,
    client: SshClient,
) -> None:
    engine = sqlite_engine
    compute = server_lab.compute()
    clock = VirtualClock()
    home = isolated_lab.hosts["lab-b"].root
    assert list(home.iterdir()) == []  # a new machine: nothing of ours, nothing at all
    # What the EC2 wiring (bot.faces.runtime) prepares an instance with, its metadata
    # address the loopback fake's; `env` points pip at the wheel cache (the suite is
    # offline), where production gives its index or proxy the same way.
    prepare = functools.partial(bootstrap_prepare, cloud=True, env=pip_env(), metadata_url=imds.url)
    access = RemoteAccess(
        engine, client, LoopbackResolver(new_host), prepare=prepare, wait_for_prepare=False
    )

    def wire(core: GpuService) -> list[Wiring]:
        # Wired as bot.providers.aws wires EC2: the instance's bootstrap runs on the host
        # checker's threads, handed out by the fleet's pass, never inside it.
        fleet = Fleet(core, compute, access, catalog=compute.catalog)
        checker = HostChecker(core, access, (), cloud=compute.name)
        fleet.set_up_off_tick(checker.tick)
        return [
            Wiring(
                compute.name,
                supply=CatalogSupply(compute.catalog),
                runs=RunParts(access, compute.catalog),
                fleet=fleet,
                checker=checker,
            )
        ]

    svc = GpuService(engine, Settings(admins=("root",)), clock, wire)
    runs = svc.runs
    fleet = svc.fleet
    checker = svc.places.checker(compute.name)
    assert isinstance(fleet, Fleet) and isinstance(checker, HostChecker)
    assert _managed(server_lab) == []
    started_at = clock.now()

    # 1. The command. An empty cloud pool has no model to default to for a script, and
    # says so (a recipe, which runs anywhere, would take the cheapest: tests/core/test_runs).
    bare = handle_text(svc, svc.actor("alice"), "/gpu run -- python train.py")
    assert bare.error and "Say which GPU model to run on (`--gpu MODEL`)" in str(bare.view)
    reply = handle_text(svc, svc.actor("alice"), "/gpu run --recipe digits --gpu T4")
    assert not reply.error, reply.view
    with Session(engine) as s:
        run = s.exec(select(TrainingRun)).one()
    rid = run.id
    assert rid is not None

    # 2. The scheduler asks for a launch; the fleet makes it, tagged, on the moto server.
    runs.dispatch()
    with Session(engine) as s:
        (req,) = s.exec(select(LaunchRequest)).all()
    assert req.run_id == rid and req.instance_id is not None
    iid = req.instance_id
    (inst,) = _managed(server_lab)
    tags = {t["Key"]: t["Value"] for t in inst["Tags"]}
    assert inst["InstanceId"] == iid
    assert tags["gpubot:managed"] == "true"
    assert tags["gpubot:owner"] == "alice" and tags["gpubot:job"] == str(rid)

    # 3. Ready once SSH answers and the host is prepared: the fleet's pass handed the
    # setup to the checker, which bootstrapped it from nothing (venv, the train extra,
    # code, marker) and started the host agent, while the pass itself returned at once.
    fleet.refresh()
    assert _host(engine, iid).state != HOST_READY  # the pass did not wait for the setup
    deadline = time.monotonic() + 900  # a guard against a hang, not a speed goal
    while _host(engine, iid).state != HOST_READY:
        assert time.monotonic() < deadline, f"never set up: {_host(engine, iid).state}"
        results = checker.wait(timeout=900)
        assert all(r.ok or r.booting for r in results), results
        if any(r.booting for r in results):
            clock.advance(timedelta(seconds=15))  # SSH not answering yet: checked again
        fleet.refresh()
    prepared = access.prepared(iid)
    assert prepared is not None
    root = home / ".gpubot"
    assert prepared.root == str(root)
    assert prepared.python == str(root / "venv" / "bin" / "python")
    assert prepared.code_dir is not None and prepared.code_dir.startswith(str(root))
    marker = json.loads((root / MARKER_NAME).read_text())
    assert marker["version"] == BOOTSTRAP_VERSION
    # torch from the pinned wheel, in a venv of the host's own python3 (not the bot's).
    pinned = torch_requirement(train_requirements()).split("==")[1]
    assert str(marker["torch"]).startswith(pinned)
    assert marker["base_python"] == "python3" and not marker["system_site_packages"]
    # The agent in its EC2 form: it stops the instance when the bot is gone (sudo, as the
    # AMI's user) and watches the metadata service, here the fake.
    assert marker["agent"]["stop_command"] == "sudo -n shutdown -h now"
    assert marker["agent"]["imds_endpoint"] == imds.url
    assert agent_supervisor_alive(client, new_host, prepared.root)

    # 4. Placed and run there; telemetry asked for while it runs.
    util_reports: list[CollectReport] = []
    deadline = time.monotonic() + 600  # a guard against a hang, not a speed goal
    while True:
        runs.poll()
        runs.dispatch()
        with Session(engine) as s:
            got = s.get(TrainingRun, rid)
            assert got is not None
            run = got
            if run.state == "running":
                util_reports.append(collect(svc))
            if run.state in ("succeeded", "failed", "cancelled"):
                break
        assert time.monotonic() < deadline, "the run did not finish"
        clock.advance(timedelta(seconds=30))
        time.sleep(0.5)
    assert run.state == "succeeded", run.metrics
    assert run.placement is not None and run.placement["host"] == iid

    # 5. Telemetry: the host was asked with its own interpreter and answered; lab-a is a
    # CPU machine, so the probe reports no NVIDIA driver and no GpuSample row is stored (a
    # missing reading is never stored as an idle GPU).
    assert util_reports, "the run was never seen running"
    assert all(r.failed == () for r in util_reports)
    assert any(r.no_driver == (iid,) for r in util_reports)
    with Session(engine) as s:
        assert s.exec(select(GpuSample)).all() == []
    # What the team is told instead, in words; and the run's own telemetry, read from its
    # status file on the host, is kept with the run.
    util = handle_text(svc, svc.actor("alice"), f"/gpu util {iid}")
    assert f"{iid}: {NO_DRIVER} on {iid}, so there is nothing to sample" in util.view.text
    # The host is this machine's CPU: auto picks what the runner picks for it (bf16 where
    # the CPU has AMX units, fp32 elsewhere), not a precision this test assumed.
    auto = choose_precision("auto", torch.device("cpu")).precision
    assert float(run.metrics["samples_per_s"]) > 0 and run.metrics["precision"] == auto

    # The agent asked the metadata service as on EC2 (a token, then the spot notice) and
    # heard no notice; its heartbeat, which the bot reads, says so.
    assert ("PUT", "/latest/api/token", "21600") in imds.requests
    assert any(
        r[:2] == ("GET", "/latest/meta-data/spot/instance-action") and r[2] == imds.token
        for r in imds.requests
    ), imds.requests
    heartbeat = json.loads((root / "agent" / "heartbeat.json").read_text())
    assert heartbeat["seen"]["imds"] == "no notice" and heartbeat["limits"]["stops_host"]

    # 6. The result DM: the accuracy the host measured and what the run cost.
    dms = notes(engine, "dm", "alice")
    assert any("launching g4dn.xlarge" in dm and iid in dm for dm in dms), dms
    final = next(dm for dm in dms if dm.startswith(f"Run #{rid} (recipe digits) finished"))
    accuracy = re.search(r"test_accuracy (\d+\.\d+)%", final)
    assert accuracy is not None and float(accuracy.group(1)) >= 90.0, final
    dm_cost = re.search(r"cost \$(\d+\.\d\d)\.", final)
    assert dm_cost is not None and Decimal(dm_cost.group(1)) > 0, final

    # 7. Idle: stopped after idle_stop_after, terminated after idle_terminate_after.
    assert fleet.idle() == []
    clock.advance(svc.settings.idle_stop_after)
    assert fleet.idle() == [f"stopped {iid}"]
    assert _host(engine, iid).state == HOST_STOPPED
    clock.advance(timedelta(days=3, hours=1))
    assert fleet.idle() == [f"terminated {iid}"]
    assert _host(engine, iid).state == HOST_TERMINATED
    (inst,) = _managed(server_lab)
    assert inst["State"]["Name"] in ("shutting-down", "terminated")

    # 8. The bill: what alice held plus what nobody held is what the instance cost.
    clock.advance(timedelta(hours=1))
    with Session(engine) as s:
        periods = s.exec(select(HostPeriod).order_by(col(HostPeriod.id))).all()
        assert [p.state for p in periods][-1] == "stopped" and periods[-1].ended_at is not None
        bill = team_bill(s, Window(started_at - timedelta(hours=1), clock.now()), clock.now())
    assert bill.instances > 0 and bill.idle > 0
    assert set(bill.users) == {"alice"}
    # Exactly, in micro-dollars; and alice's share is what her DM said.
    assert bill.held + bill.idle == bill.instances
    assert to_cents(bill.users["alice"]) == Decimal(dm_cost.group(1))

    # And as the team reads it: the rows add up to the instances' bill to the cent.
    shown = handle_text(svc, svc.actor("root"), "/gpu cost team month")
    words = re.search(
        r"the instances cost \$([\d.]+): \$([\d.]+) held by 1 person \+ \$([\d.]+) idle",
        shown.view.text,
    )
    assert words is not None, shown.view.text
    total, held, idle = (Decimal(g) for g in words.groups())
    assert total == to_cents(bill.instances) and held + idle == total
    # The rows are rounded together (largest remainder, billing.shown_cents) so that they
    # add up to the instances' bill: alice's row is her exact share so rounded, which is
    # the cent above her DM's own rounding when her remainder is the larger one (CI saw
    # $0.05 against $0.04: the run's length, and so the remainders, vary with the machine).
    rows, _ = shown_cents(
        {"user:alice": bill.users["alice"], IDLE_ROW: bill.idle}, bill.instances, absorb=IDLE_ROW
    )
    assert held == rows["user:alice"]
    assert abs(held - Decimal(dm_cost.group(1))) <= Decimal("0.01")
    checker.close()
