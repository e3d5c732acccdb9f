"""docs/HOSTS.md "AWS from zero", run as it stands against moto, then checked by the doctor.

The shell block is the documentation: the test extracts it, runs it with the AWS CLI
pointed at a moto server on 127.0.0.1 (AWS_ENDPOINT_URL), and checks what it made the way
the bot will use it. Only what moto cannot hold is given from outside: the AMI behind the
SSM parameter (moto reserves /aws/, so the parameter lives under a test name).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bot.providers.aws import ec2_settings_from_env
from provisioning.aws_doctor import check_aws
from tests.provisioning_aws.conftest import AMI_PARAMETER, _reset_server, fresh_session

ROOT = Path(__file__).resolve().parents[2]
BOT_IP = "198.51.100.7"
# A region of two zones: the block's per-zone loop is the same, with a third of the CLI calls.
ZONED_REGION = "us-west-1"


def doc_block() -> str:
    text = (ROOT / "docs" / "HOSTS.md").read_text()
    section = text.split("## AWS from zero", 1)[1]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match is not None, "the AWS from zero section has no sh block"
    return match.group(1)


@pytest.fixture
def aws_cli() -> str:
    found = shutil.which("aws")
    if found is None:
        pytest.skip("the AWS CLI is not installed (pip install awscli)")
    return found


def test_aws_from_zero_as_documented_gives_a_doctor_with_nothing_to_fix(
    aws_env: None,
    moto_server: str,
    aws_cli: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _reset_server(moto_server)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    session = fresh_session()
    ec2: Any = session.client("ec2", region_name=ZONED_REGION)
    ami = ec2.register_image(
        Name="Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20261201",
        RootDeviceName="/dev/sda1",
        BlockDeviceMappings=[{"DeviceName": "/dev/sda1", "Ebs": {"VolumeSize": 8}}],
    )["ImageId"]
    session.client("ssm", region_name=ZONED_REGION).put_parameter(
        Name=AMI_PARAMETER, Value=ami, Type="String"
    )

    env = {
        **os.environ,
        "REGION": ZONED_REGION,
        "BOT_IP": BOT_IP,
        "KEY": str(tmp_path / "gpubot"),
        "DLAMI_PARAM": AMI_PARAMETER,
    }
    done = subprocess.run(
        ["bash", "-c", doc_block()],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    settings = dict(
        line.split("=", 1) for line in done.stdout.splitlines() if line.startswith("GPUBOT_")
    )
    assert settings["GPUBOT_PROVIDER"] == "aws"
    assert "Deep Learning Base OSS Nvidia Driver GPU AMI" in done.stdout

    # One subnet per zone, in a VPC of their own.
    zones = [z["ZoneName"] for z in ec2.describe_availability_zones()["AvailabilityZones"]]
    subnets = settings["GPUBOT_AWS_SUBNETS"].split(",")
    found = ec2.describe_subnets(SubnetIds=subnets)["Subnets"]
    assert sorted(s["AvailabilityZone"] for s in found) == sorted(zones)
    assert all(s["MapPublicIpOnLaunch"] for s in found)
    # From outside, the bot alone, on SSH alone; inside, the group's members reach each
    # other on all TCP (a run across instances: its rendezvous, gloo and NCCL).
    sg = settings["GPUBOT_AWS_SECURITY_GROUPS"]
    [group] = ec2.describe_security_groups(GroupIds=[sg])["SecurityGroups"]
    assert sorted(
        (
            p["IpProtocol"],
            p["FromPort"],
            p["ToPort"],
            [r["CidrIp"] for r in p["IpRanges"]],
            [g["GroupId"] for g in p["UserIdGroupPairs"]],
        )
        for p in group["IpPermissions"]
    ) == [("tcp", 0, 65535, [], [sg]), ("tcp", 22, 22, [f"{BOT_IP}/32"], [])]
    # The key pair holds the bot's key.
    [pair] = ec2.describe_key_pairs(KeyNames=["gpubot"])["KeyPairs"]
    assert pair["KeyName"] == "gpubot" and Path(settings["GPUBOT_SSH_KEY"]).is_file()
    # The policy from docs/iam-policy.json, on the bot's user.
    iam: Any = session.client("iam", region_name=ZONED_REGION)
    [attached] = iam.list_attached_user_policies(UserName="gpubot")["AttachedPolicies"]
    assert attached["PolicyName"] == "gpubot"

    checks = check_aws(ec2_settings_from_env(settings), session=session)
    failing = [(c.name, c.detail, c.fix) for c in checks if not c.ok]
    assert failing == []
    assert {c.name for c in checks} >= {"EC2 subnets", "EC2 security groups", "EC2 key pair", "AMI"}
