"""`check_aws` says in words what is missing, and how to fix it, without launching anything."""

from __future__ import annotations

import pytest

from provisioning.aws_doctor import check_aws
from provisioning.checks import Check
from tests.provisioning_aws.conftest import REGION, AwsLab, fresh_session

NAMES = [
    "AWS region",
    "AWS credentials",
    "EC2 subnets",
    "EC2 security groups",
    "EC2 key pair",
    "AMI",
]


def _by_name(checks: list[Check]) -> dict[str, Check]:
    assert [c.name for c in checks] == NAMES
    return {c.name: c for c in checks}


def test_a_complete_setup_is_all_green(lab: AwsLab) -> None:
    checks = _by_name(check_aws(lab.settings(), session=lab.session))
    assert all(c.ok for c in checks.values()), checks
    assert "123456789012" in checks["AWS credentials"].detail
    assert lab.zones[0] in checks["EC2 subnets"].detail
    assert lab.ami_id in checks["AMI"].detail
    assert lab.ec2().describe_instances()["Reservations"] == []


def test_each_missing_piece_is_named_with_a_fix(lab: AwsLab) -> None:
    settings = lab.settings(
        key_name="nobodys-key",
        subnet_ids=("subnet-0000000000000dead",),
        security_group_ids=("sg-0000000000000dead",),
        ami_ssm_parameter="/gpubot/test/missing",
    )
    checks = _by_name(check_aws(settings, session=lab.session))
    assert checks["AWS credentials"].ok and checks["AWS region"].ok
    for name in ("EC2 subnets", "EC2 security groups", "EC2 key pair", "AMI"):
        assert not checks[name].ok, name
        assert checks[name].fix, name
    assert "key pair does not exist" in checks["EC2 key pair"].detail
    assert "nobodys-key" in checks["EC2 key pair"].fix
    assert "SSM parameter" in checks["AMI"].detail


def test_a_pinned_ami_that_does_not_exist_fails(lab: AwsLab) -> None:
    checks = _by_name(check_aws(lab.settings(ami_id="ami-0000dead"), session=lab.session))
    assert not checks["AMI"].ok
    assert "ami-0000dead" in checks["AMI"].detail


def test_a_region_that_does_not_exist_fails(lab: AwsLab) -> None:
    checks = _by_name(check_aws(lab.settings(region="moon-west-1"), session=lab.session))
    assert not checks["AWS region"].ok
    assert "moon-west-1 is not an EC2 region" in checks["AWS region"].detail
    assert all("not checked: the region does not exist" in checks[n].detail for n in NAMES[1:])


def test_without_credentials_the_rest_is_skipped_not_failed_confusingly(
    aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    from provisioning.aws import Ec2Settings

    settings = Ec2Settings(region=REGION, subnet_ids=("subnet-1",), key_name="k")
    checks = _by_name(check_aws(settings, session=fresh_session()))
    creds = checks["AWS credentials"]
    assert not creds.ok and "no AWS credentials found" in creds.detail
    assert "AWS_ACCESS_KEY_ID" in creds.fix
    assert checks["AWS region"].ok
    assert all("not checked" in checks[n].detail for n in NAMES[2:])


def test_a_group_whose_members_cannot_reach_each_other_is_named_with_the_rule(
    lab: AwsLab,
) -> None:
    """Runs across instances meet at node 0 (a port in 29500-29999) and then talk on
    ports gloo and NCCL pick: a group that lets only SSH in from the bot breaks them."""
    ec2 = lab.ec2()
    ssh_only = ec2.create_security_group(GroupName="ssh-only", Description="ssh", VpcId=lab.vpc_id)[
        "GroupId"
    ]
    ec2.authorize_security_group_ingress(
        GroupId=ssh_only, IpProtocol="tcp", FromPort=22, ToPort=22, CidrIp="198.51.100.7/32"
    )
    # The rendezvous port alone is not enough either: gloo and NCCL use ports of their own.
    ec2.authorize_security_group_ingress(
        GroupId=ssh_only,
        IpPermissions=[
            {
                "IpProtocol": "tcp",
                "FromPort": 29500,
                "ToPort": 29999,
                "UserIdGroupPairs": [{"GroupId": ssh_only}],
            }
        ],
    )
    settings = lab.settings(security_group_ids=(ssh_only,))
    check = _by_name(check_aws(settings, session=lab.session))["EC2 security groups"]
    assert not check.ok
    assert "cannot reach each other" in check.detail and "29500" in check.detail
    assert f"--group-id {ssh_only}" in check.fix and f"GroupId={ssh_only}" in check.fix

    # The fix as the doctor words it (what docs/HOSTS.md runs), and it is green.
    ec2.authorize_security_group_ingress(
        GroupId=ssh_only,
        IpPermissions=[
            {
                "IpProtocol": "tcp",
                "FromPort": 0,
                "ToPort": 65535,
                "UserIdGroupPairs": [{"GroupId": ssh_only}],
            }
        ],
    )
    check = _by_name(check_aws(settings, session=lab.session))["EC2 security groups"]
    assert check.ok, check
    # Only the bot reaches SSH from outside: no address range but the bot's is let in.
    [group] = ec2.describe_security_groups(GroupIds=[ssh_only])["SecurityGroups"]
    ranges = {r["CidrIp"] for p in group["IpPermissions"] for r in p.get("IpRanges", [])}
    assert ranges == {"198.51.100.7/32"}
