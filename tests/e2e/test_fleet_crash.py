"""A worker killed between EC2's answer to a launch and its own commit pays for nothing twice.

Real processes on a shared SQLite file, EC2 as a moto *server* on 127.0.0.1 reached
through AWS_ENDPOINT_URL: the first process is frozen right after `launch` returned and
killed with SIGKILL; then a real `gpubot worker` starts, reconciles, adopts the instance
(its pending `LaunchRequest` becomes launched, a host row appears) and launches nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
from sqlmodel import Session, select

from bot.app.config import Settings
from bot.app.service import GpuService
from bot.domain.clock import SystemClock
from bot.domain.commands import Reserve
from db.migrate import upgrade
from db.models import RES_ACTIVE, RES_WAITING, Host, LaunchRequest, Reservation
from db.session import make_engine
from provisioning.compute import LaunchSpec
from tests.provisioning_aws.conftest import (  # noqa: F401  (fixtures)
    AMI_PARAMETER,
    REGION,
    AwsLab,
    aws_env,
    moto_server,
    server_lab,
)

ROOT = Path(__file__).resolve().parents[2]


def child_env(home: Path, lab: AwsLab, endpoint: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GPUBOT_", "SLACK_", "DATABASE_URL", "AWS_"))
    }
    env.update(
        GPUBOT_HOME=str(home),
        DATABASE_URL=f"sqlite:///{home / 'gpubot.db'}",
        GPUBOT_PROVIDER="aws",
        GPUBOT_TICK_SECONDS="1",
        GPUBOT_AWS_REGION=REGION,
        GPUBOT_AWS_SUBNETS=",".join(lab.subnet_ids),
        GPUBOT_AWS_SECURITY_GROUPS=lab.security_group_id,
        GPUBOT_AWS_KEY_NAME=lab.key_name,
        GPUBOT_AWS_AMI_PARAMETER=AMI_PARAMETER,
        GPUBOT_SSH_LOOPBACK_ONLY="1",
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION=REGION,
        AWS_EC2_METADATA_DISABLED="true",
        AWS_SHARED_CREDENTIALS_FILE=str(home / "no-credentials"),
        AWS_CONFIG_FILE=str(home / "no-config"),
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(ROOT),
    )
    return env


def managed_ids(lab: AwsLab) -> list[str]:
    out: list[str] = []
    for r in lab.ec2().describe_instances(
        Filters=[{"Name": "tag:gpubot:managed", "Values": ["true"]}]
    )["Reservations"]:
        out.extend(i["InstanceId"] for i in r["Instances"])
    return sorted(out)


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path


def _wait_for(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_worker_killed_after_launch_is_reconciled_without_a_second_instance(
    server_lab: AwsLab,  # noqa: F811
    moto_server: str,  # noqa: F811
    home: Path,
) -> None:
    lab = server_lab
    engine = make_engine(f"sqlite:///{home / 'gpubot.db'}")
    upgrade(engine)
    service = GpuService(engine, Settings(home=home), SystemClock())
    # The team already has one T4 instance, held by alice; bob waits for a T4.
    seed = lab.compute().launch(
        LaunchSpec(
            gpu_model="T4",
            gpus=1,
            market="ondemand",
            owner="alice",
            request_key="seed",
            reservation_id="0",
        )
    )
    # Booted and SSH-checked earlier (this test never dials; moto's address is not real).
    service.sync_hosts([replace(seed, state="ready")])
    service.reserve(service.actor("alice"), Reserve(1, "T4", timedelta(hours=2)))
    service.reserve(service.actor("bob"), Reserve(1, "T4", timedelta(hours=2)))
    with Session(engine) as s:
        states = [r.state for r in s.exec(select(Reservation).order_by(Reservation.id))]  # type: ignore[arg-type]
    assert states == [RES_ACTIVE, RES_WAITING]

    env = child_env(home, lab, moto_server)
    marker = home / "launched"
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.e2e.fleet_crash_child", str(marker)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_for(lambda: marker.exists() or child.poll() is not None, 60, "the launch")
        assert child.poll() is None, child.stdout.read().decode() if child.stdout else ""
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    launched = marker.read_text()
    assert launched.startswith("i-")
    # The crash left the intent and an instance, but no record of the instance.
    with Session(engine) as s:
        (req,) = s.exec(select(LaunchRequest)).all()
        assert req.state == "pending" and req.instance_id is None
        assert s.exec(select(Host).where(Host.instance_id == launched)).first() is None
    assert managed_ids(lab) == sorted([seed.instance_id or "", launched])

    worker = subprocess.Popen(
        [sys.executable, "-m", "bot.faces.cli", "worker"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:

        def adopted() -> bool:
            with Session(engine) as s:
                r = s.exec(select(LaunchRequest)).one()
                return r.state == "launched"

        _wait_for(adopted, 60, "reconcile to adopt the instance")
        # Let a few more fleet passes run: none may launch again for bob.
        time.sleep(7)
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(10)
    output = worker.stdout.read().decode() if worker.stdout else ""
    assert "worker job fleet failed" not in output, output
    assert "adopted " + launched in output, output
    with Session(engine) as s:
        (req,) = s.exec(select(LaunchRequest)).all()
        assert req.state == "launched" and req.instance_id == launched, output
        host = s.exec(select(Host).where(Host.instance_id == launched)).one()
        assert host.provider == "aws" and host.tags.get("gpubot:request") == req.request_key
    assert managed_ids(lab) == sorted([seed.instance_id or "", launched]), output
    engine.dispose()
