"""`gpubot doctor`'s AWS part: what is missing before the bot can rent a GPU, in plain words.

Each check is a real read-only call (nothing is launched, nothing costs money), so a
green doctor means the launch path's prerequisites exist in that account and region,
not merely that the config file parses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from provisioning.aws import CLIENT_CONFIG, Ec2Settings, aws_error_text, make_session
from provisioning.base import ProvisioningError
from provisioning.checks import Check


def check_aws(settings: Ec2Settings, *, session: boto3.Session | None = None) -> list[Check]:
    """Runs every check it can even after a failure, so one run lists everything missing.

    The region is checked first and offline: with a region that does not exist every
    other call would go to an endpoint that does not exist either.
    """
    try:
        sess = session if session is not None else make_session(settings.region)
    except ProvisioningError as exc:
        return [Check("AWS client", False, str(exc), "Check the AWS settings in the environment.")]
    checks = [_safely("AWS region", lambda: _region_known(settings))]
    if not checks[0].ok:
        return checks + _skipped("the region does not exist", "Fix the region first.")
    checks.append(_safely("AWS credentials", lambda: _credentials(sess, settings)))
    if not checks[1].ok:
        return checks + _skipped("the AWS credentials do not work", "Fix the credentials first.")
    ec2: Any = sess.client("ec2", region_name=settings.region, config=CLIENT_CONFIG)
    ssm: Any = sess.client("ssm", region_name=settings.region, config=CLIENT_CONFIG)
    checks[0] = _safely("AWS region", lambda: _region_zones(ec2, settings))
    checks.append(_safely("EC2 subnets", lambda: _subnets(ec2, settings)))
    checks.append(_safely("EC2 security groups", lambda: _security_groups(ec2, settings)))
    checks.append(_safely("EC2 key pair", lambda: _key_pair(ec2, settings)))
    checks.append(_safely("AMI", lambda: _ami(ec2, ssm, settings)))
    return checks


_LATER = ("EC2 subnets", "EC2 security groups", "EC2 key pair", "AMI")


def _skipped(why: str, fix: str) -> list[Check]:
    names = ("AWS credentials", *_LATER) if "region" in why else _LATER
    return [Check(name, False, f"not checked: {why}", fix) for name in names]


def _safely(name: str, check: Callable[[], Check]) -> Check:
    """The doctor is what people run when things are broken: it must never crash itself."""
    try:
        return check()
    except (BotoCoreError, ClientError) as exc:
        return Check(name, False, aws_error_text(exc, f"check {name}"), "")
    except Exception as exc:
        return Check(name, False, f"the check itself failed: {exc}", "Report this as a bug.")


def _credentials(sess: boto3.Session, settings: Ec2Settings) -> Check:
    name = "AWS credentials"
    try:
        sts: Any = sess.client("sts", region_name=settings.region, config=CLIENT_CONFIG)
        ident = sts.get_caller_identity()
    except (BotoCoreError, ClientError) as exc:
        return Check(
            name,
            False,
            aws_error_text(exc, "check who the bot is on AWS"),
            "Set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE for the bot's process.",
        )
    return Check(name, True, f"account {ident.get('Account')} as {ident.get('Arn')}")


def _region_known(settings: Ec2Settings) -> Check:
    known = boto3.Session().get_available_regions("ec2")
    if known and settings.region not in known:
        return Check(
            "AWS region",
            False,
            f"{settings.region} is not an EC2 region",
            "Set the region to one like us-east-1 or eu-west-1.",
        )
    return Check("AWS region", True, settings.region)


def _region_zones(ec2: Any, settings: Ec2Settings) -> Check:
    zones = ec2.describe_availability_zones().get("AvailabilityZones", [])
    names = ", ".join(sorted(str(z.get("ZoneName")) for z in zones))
    return Check("AWS region", True, f"{settings.region} (zones {names})")


def _subnets(ec2: Any, settings: Ec2Settings) -> Check:
    name = "EC2 subnets"
    fix = "Set subnet_ids to subnets of this region, one per availability zone."
    try:
        found = ec2.describe_subnets(SubnetIds=list(settings.subnet_ids)).get("Subnets", [])
    except (BotoCoreError, ClientError) as exc:
        return Check(name, False, aws_error_text(exc, "find the configured subnets"), fix)
    zones = [str(s.get("AvailabilityZone")) for s in found]
    detail = ", ".join(f"{s.get('SubnetId')} in {s.get('AvailabilityZone')}" for s in found)
    if len(set(zones)) < len(zones):
        return Check(
            name,
            True,
            f"{detail}; some share a zone, so a full zone is retried in vain",
        )
    return Check(name, True, detail)


def _security_groups(ec2: Any, settings: Ec2Settings) -> Check:
    name = "EC2 security groups"
    if not settings.security_group_ids:
        # AWS's default group lets its own members in on everything: runs across hosts work.
        return Check(name, True, "none configured: the VPC's default group applies")
    fix = "Create a group that allows SSH (tcp/22) from the bot, and set its id."
    try:
        groups = ec2.describe_security_groups(GroupIds=list(settings.security_group_ids))
    except (BotoCoreError, ClientError) as exc:
        return Check(name, False, aws_error_text(exc, "find the security groups"), fix)
    found = groups.get("SecurityGroups", [])
    if not members_reach_each_other(found):
        first = settings.security_group_ids[0]
        return Check(
            name,
            False,
            f"{', '.join(settings.security_group_ids)}: instances of these groups cannot reach "
            "each other, so a run across instances cannot meet at its rendezvous (node 0, "
            "a port in 29500-29999) nor talk over gloo or NCCL",
            "Let the group's members in on all TCP: aws ec2 authorize-security-group-ingress "
            f"--group-id {first} --ip-permissions "
            f"'IpProtocol=tcp,FromPort=0,ToPort=65535,UserIdGroupPairs=[{{GroupId={first}}}]' "
            '(docs/HOSTS.md, "AWS from zero").',
        )
    return Check(name, True, ", ".join(settings.security_group_ids))


def members_reach_each_other(groups: list[dict[str, Any]]) -> bool:
    """Whether an instance in these groups lets in, on every TCP port, the instances of one
    of them: torchrun's static rendezvous listens on node 0 at a port in 29500-29999, and
    gloo and NCCL then open ports of their own choosing, so a rule for one port is not
    enough. A rule naming the group itself (a self-reference) is the usual way."""
    ids = {g.get("GroupId") for g in groups}
    for group in groups:
        for perm in group.get("IpPermissions", []):
            pairs = perm.get("UserIdGroupPairs", [])
            if not any(pair.get("GroupId") in ids for pair in pairs):
                continue
            proto = str(perm.get("IpProtocol"))
            if proto == "-1":
                return True
            low, high = perm.get("FromPort", -1), perm.get("ToPort", -1)
            if proto in ("tcp", "6") and low <= 1 and high >= 65535:
                return True
    return False


def _key_pair(ec2: Any, settings: Ec2Settings) -> Check:
    name = "EC2 key pair"
    fix = (
        f"Create or import a key pair named {settings.key_name!r} in {settings.region} "
        "(aws ec2 import-key-pair), or set key_name to an existing one."
    )
    if not settings.key_name:
        return Check(
            name, False, "no key pair configured: the bot could not log in", "Set key_name."
        )
    try:
        ec2.describe_key_pairs(KeyNames=[settings.key_name])
    except (BotoCoreError, ClientError) as exc:
        return Check(name, False, aws_error_text(exc, f"find key pair {settings.key_name}"), fix)
    return Check(name, True, settings.key_name)


def _ami(ec2: Any, ssm: Any, settings: Ec2Settings) -> Check:
    name = "AMI"
    image_id = settings.ami_id
    source = "configured ami_id"
    if not image_id:
        source = f"SSM parameter {settings.ami_ssm_parameter}"
        try:
            image_id = str(ssm.get_parameter(Name=settings.ami_ssm_parameter)["Parameter"]["Value"])
        except (BotoCoreError, ClientError) as exc:
            return Check(
                name,
                False,
                aws_error_text(exc, f"read {source}"),
                "Set ami_id to a GPU image of this region, or allow ssm:GetParameter.",
            )
    try:
        images = ec2.describe_images(ImageIds=[image_id]).get("Images", [])
    except (BotoCoreError, ClientError) as exc:
        return Check(name, False, aws_error_text(exc, f"find {image_id}"), "Fix ami_id.")
    if not images:
        return Check(name, False, f"{image_id} (from {source}) is not visible", "Fix ami_id.")
    return Check(name, True, f"{image_id} ({images[0].get('Name', '')}) from {source}")
