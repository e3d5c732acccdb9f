"""`GPUBOT_PROVIDERS=slurm,aws`: the lab's real Slurm first (tests/slurm_cluster.py: four
fake A100s, memory counted, people as their own accounts), EC2 on moto (in process) when
the wait is long, its instances reached on a real loopback sshd host.

One bot, both places: bob's job fills the cluster; alice's digits run pends in Slurm's
queue; past GPUBOT_BURST_AFTER (two seconds here) she is offered a p4d.24xlarge with its
price; she takes it, the instance is launched while her job still pends, and once the
instance is ready her job is withdrawn (`scancel --state=PENDING`: Slurm decides, so it is
never both) and the run runs on the instance, billed at its price. And the other way: the
cluster frees first, Slurm starts her job, the offer is withdrawn, nothing is bought.

Real time (Slurm's clock is the machine's): the waits are guards, not speed assertions.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlmodel import Session, col, select

import bot.providers
from bot.app.burst import state as st
from bot.app.burst.offers import Bursts
from bot.app.config import load_settings
from bot.app.fleet import Fleet
from bot.app.hosts import hostcheck
from bot.app.hosts.remote import PreparedHost, RemoteAccess, bootstrap_prepare
from bot.app.places import Wiring
from bot.app.service import GpuService
from bot.domain.clock import SystemClock
from bot.domain.commands import Cancel, Run
from bot.faces.dispatch import handle_text
from bot.faces.runtime import open_database
from bot.providers.base import Parts
from db.models import BurstOffer, Host, LaunchRequest, TrainingRun, UsageInterval
from provisioning.hostshell import HostShell
from provisioning.ssh import SshClient, SshTarget
from tests.core.fleet_helpers import LoopbackResolver, cloud_place, lab_target, notes
from tests.provisioning_aws.conftest import AwsLab
from tests.slurm_cluster import SlurmCluster
from tests.slurm_lab import as_bot_account, lab_env
from tests.ssh_hosts import SshLab

GUARD_S = 240.0  # a guard against a hang, not a speed assertion


class Lab:
    def __init__(
        self, make: Callable[[], GpuService], cluster: SlurmCluster, client: SshClient
    ) -> None:
        self.make = make
        self.cluster = cluster
        self.client = client
        self.restart()

    def restart(self) -> None:
        """The bot made anew on the same database, cluster and cloud (a worker that died)."""
        self.service = self.make()
        fleet = self.service.fleet
        assert isinstance(fleet, Fleet)
        self.fleet = fleet

    def step(self) -> None:
        """The worker's order: offers, poll, dispatch; the fleet's cycle and the upkeep."""
        svc = self.service
        assert svc.bursts is not None
        svc.tick()
        svc.bursts.tick()
        svc.runs.poll()
        svc.runs.dispatch()
        # The host checks, every 15 s in the worker: without them a host that dropped one
        # connection under load stayed unreachable for the rest of the test.
        hostcheck.hostcheck_job(svc)
        self.fleet.refresh()
        for upkeep in svc.upkeep:
            upkeep()

    def until(self, check: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + GUARD_S
        while not check():
            assert time.monotonic() < deadline, f"{what}: not within the guard\n{self.squeue()}"
            self.step()
            time.sleep(0.3)

    def run(self, rid: int) -> TrainingRun:
        with Session(self.service.engine) as s:
            run = s.get(TrainingRun, rid)
            assert run is not None
            return run

    def offer(self, rid: int) -> BurstOffer | None:
        with Session(self.service.engine) as s:
            return s.exec(select(BurstOffer).where(BurstOffer.run_id == rid)).first()

    def launches(self) -> list[LaunchRequest]:
        with Session(self.service.engine) as s:
            return list(s.exec(select(LaunchRequest).order_by(col(LaunchRequest.id))))

    def squeue(self) -> str:
        return self.cluster.command("squeue", "--noheader", "-o", "%i %j %T %u").stdout

    def dms(self, who: str) -> list[str]:
        return notes(self.service.engine, "dm", who)


@pytest.fixture
def lab(
    slurm_cluster: SlurmCluster,
    lab_workdir: Path,
    inprocess_lab: AwsLab,
    ssh: SshLab,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Lab]:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    remote = tmp_path / "remote"

    def prepare(runner: HostShell, target: SshTarget) -> PreparedHost:
        return PreparedHost(root=str(remote), python=sys.executable)

    with as_bot_account(slurm_cluster.conf):
        env = lab_env(
            slurm_cluster.conf,
            lab_workdir,
            tmp_path / "home",
            GPUBOT_SLURM_CACHE_S="0.5",
            GPUBOT_PROVIDERS="slurm,aws",
            GPUBOT_BURST_AFTER="2s",
        )
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        settings = load_settings()
        engine = open_database(settings)
        client = SshClient(connect_timeout=5, command_timeout=60)
        slurm = bot.providers.KINDS["slurm"].from_env(settings, os.environ, client)
        resolver = LoopbackResolver(lab_target(ssh))
        # The cluster prepares its own interpreter (the real preparation, kept between
        # sessions, as tests/provisioning/test_slurm_provider.py has it); only the
        # instances take the shortcut.
        parts = Parts(settings, engine, client, None, bootstrap_prepare, True)

        def make() -> GpuService:
            access = RemoteAccess(engine, client, resolver, prepare=prepare)
            cloud = cloud_place(inprocess_lab.compute(), access)

            def wire(core: GpuService) -> list[Wiring]:
                return [slurm.connect(core, parts), *cloud(core)]

            service = GpuService(engine, settings, SystemClock(), wire)
            assert service.places.names == ("slurm", "aws") and service.bursts is not None
            # Slurm holds reservations itself (holding jobs): they are not offered EC2.
            assert not service.bursts.reservations
            return service

        try:
            yield Lab(make, slurm_cluster, client)
        finally:
            client.close()
            engine.dispose()


def _fill_the_cluster(lab: Lab) -> int:
    """bob's job holds all four A100s."""
    bob = lab.service.actor("bob")
    rid = int(
        lab.service.runs.submit(bob, Run(command=("sleep", "600"), model="A100", gpus=4)).extra[
            "run_id"
        ]
    )
    lab.until(lambda: lab.run(rid).state == "running", "bob's job runs")
    return rid


def _pending_job(lab: Lab, rid: int) -> int:
    lab.until(lambda: isinstance(lab.run(rid).placement.get("job"), int), "handed to Slurm")
    job = int(lab.run(rid).placement["job"])
    assert re.search(rf"^{job} gpubot-run-{rid} PENDING", lab.squeue(), re.M), lab.squeue()
    return job


def test_alice_takes_ec2_her_job_leaves_slurms_queue_and_the_run_is_billed_at_ec2s_price(
    lab: Lab,
) -> None:
    bobs = _fill_the_cluster(lab)
    alice = lab.service.actor("alice")
    ask = Run(recipe="digits", model="A100", max_duration=timedelta(minutes=10))
    rid = int(lab.service.runs.submit(alice, ask).extra["run_id"])
    job = _pending_job(lab, rid)
    assert lab.offer(rid) is None and lab.launches() == []
    lab.until(lambda: lab.offer(rid) is not None, "the offer")
    offer = lab.offer(rid)
    assert offer is not None and offer.state == st.OPEN
    assert offer.instance_type == "p4d.24xlarge" and offer.hours == pytest.approx(1 / 6)
    (plan,) = [d for d in lab.dms("alice") if "p4d.24xlarge" in d]
    # Past the threshold, or at once where Slurm's own expected start is that far off;
    # either way with what Slurm says of the pending job.
    assert f"Run #{rid} has waited" in plan or f"Run #{rid} would wait about" in plan, plan
    assert (
        "Their queue says: Slurm job" in plan
        and " pends (" in plan
        and f"about ${offer.estimate_usd:.2f}" in plan
    )
    assert lab.launches() == [], "an offer buys nothing"

    taken = handle_text(lab.service, alice, f"/gpu cloud take {rid}")
    assert not taken.error, taken.view.text
    lab.until(lambda: lab.run(rid).state in ("succeeded", "failed"), "the run ended")
    run = lab.run(rid)
    (req,) = lab.launches()
    assert run.state == "succeeded", run.metrics
    assert run.placement["at"] == "aws" and run.placement["host"] == req.instance_id
    assert f"gpubot-run-{rid}" not in lab.squeue()
    assert (
        lab.cluster.command("sacct", "-X", "-n", "-P", "-j", str(job), "-o", "State")
        .stdout.strip()
        .startswith("CANCELLED")
    )
    lab.until(lambda: (o := lab.offer(rid)) is not None and o.state == st.CLOUD, "settled")
    with Session(lab.service.engine) as s:
        inst = s.exec(select(Host).where(Host.instance_id == req.instance_id)).one()
        ivs = list(s.exec(select(UsageInterval).where(UsageInterval.run_id == rid)))
    assert [iv.host_id for iv in ivs] == [inst.id]
    assert ivs[0].usd_per_hour == pytest.approx(inst.hourly_usd / 8)
    _, costs, _ = lab.service.costs("today", "alice")
    assert costs["alice"] > 0
    said = str(handle_text(lab.service, alice, "/gpu cost today").view.blocks)
    assert "on the team's own GPUs (at the team's rates) and $" in said and " on EC2" in said
    lab.service.runs.cancel(lab.service.actor("bob"), Cancel(bobs))


def test_the_cluster_frees_before_she_answers_so_slurm_runs_it_and_nothing_is_bought(
    lab: Lab,
) -> None:
    bobs = _fill_the_cluster(lab)
    alice = lab.service.actor("alice")
    rid = int(
        lab.service.runs.submit(
            alice, Run(command=("sleep", "1"), model="A100", max_duration=timedelta(minutes=5))
        ).extra["run_id"]
    )
    _pending_job(lab, rid)
    lab.until(lambda: lab.offer(rid) is not None, "the offer")
    lab.service.runs.cancel(lab.service.actor("bob"), Cancel(bobs))
    lab.until(lambda: lab.run(rid).state == "succeeded", "her run ran on the cluster")
    lab.until(lambda: (o := lab.offer(rid)) is not None and o.state == st.WITHDRAWN, "withdrawn")
    assert any(f"Run #{rid} started on the Slurm cluster" in d for d in lab.dms("alice"))
    assert lab.launches() == []
    late = handle_text(lab.service, alice, f"/gpu cloud take {rid}")
    assert late.error


class Died(Exception):
    """The worker, gone between its cancel of the job and the move it was making."""


def test_a_worker_that_dies_after_withdrawing_the_job_finishes_the_move_when_back(
    lab: Lab, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The withdrawal is written before the job is cancelled: the bot that comes back
    finds it and moves the run, rather than reading the cancelled job as the run's end."""
    bobs = _fill_the_cluster(lab)
    alice = lab.service.actor("alice")
    ask = Run(command=("true",), model="A100", max_duration=timedelta(minutes=10))
    rid = int(lab.service.runs.submit(alice, ask).extra["run_id"])
    job = _pending_job(lab, rid)
    lab.until(lambda: lab.offer(rid) is not None, "the offer")
    assert not handle_text(lab.service, alice, f"/gpu cloud take {rid}").error

    def die(*_: object) -> None:
        raise Died()

    with monkeypatch.context() as patched, pytest.raises(Died):
        patched.setattr(Bursts, "_move", die)
        lab.until(lambda: False, "the worker dies in the move")
    offer = lab.offer(rid)
    assert offer is not None and offer.state == st.MOVING
    state = lab.cluster.command("sacct", "-X", "-n", "-P", "-j", str(job), "-o", "State")
    assert state.stdout.strip().startswith("CANCELLED")
    assert lab.run(rid).state == "starting"
    lab.restart()
    lab.until(lambda: lab.run(rid).state in ("succeeded", "failed", "cancelled"), "the run")
    run = lab.run(rid)
    assert run.state == "succeeded" and run.placement["at"] == "aws", run.metrics
    lab.until(lambda: (o := lab.offer(rid)) is not None and o.state == st.CLOUD, "settled")
    lab.service.runs.cancel(lab.service.actor("bob"), Cancel(bobs))
