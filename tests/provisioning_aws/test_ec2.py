"""Ec2Compute against moto: every EC2 path the bot takes, in process and over a socket."""

from __future__ import annotations

from typing import Any

import pytest

from provisioning.aws import (
    CAPACITY_COOLDOWN_S,
    DLAMI_SSM_PARAMETER,
    STATE_MAP,
    TAG_JOB,
    TAG_MANAGED,
    TAG_OWNER,
    TAG_REQUEST,
    TAG_RESERVATION,
    Ec2Compute,
)
from provisioning.base import ProvisioningError
from provisioning.compute import LaunchSpec
from tests.provisioning_aws.conftest import AwsLab
from tests.provisioning_aws.faults import RunInstancesFaults


def spec(
    model: str = "T4",
    gpus: int = 1,
    market: str = "ondemand",
    key: str = "req-1",
    owner: str = "alice",
    reservation_id: str | None = "17",
    job_id: str | None = None,
) -> LaunchSpec:
    return LaunchSpec(
        gpu_model=model,
        gpus=gpus,
        market=market,
        owner=owner,
        request_key=key,
        reservation_id=reservation_id,
        job_id=job_id,
    )


def _raw(lab: AwsLab, instance_id: str) -> dict[str, object]:
    resp = lab.ec2().describe_instances(InstanceIds=[instance_id])
    result: dict[str, object] = resp["Reservations"][0]["Instances"][0]
    return result


@pytest.mark.parametrize(
    ("model", "gpus", "expected"),
    [
        ("A100", 1, "p4d.24xlarge"),
        ("H100", 8, "p5.48xlarge"),
        ("T4", 1, "g4dn.xlarge"),
        ("v100", 2, "p3.8xlarge"),
        # moto's describe_instance_types lacks p3.2xlarge: the GPU facts come from the catalog.
        ("V100", 1, "p3.2xlarge"),
        ("A10G", 1, "g5.xlarge"),
    ],
)
def test_launch_ondemand_picks_the_catalog_type_and_tags_it(
    lab: AwsLab, model: str, gpus: int, expected: str
) -> None:
    inst = lab.compute().launch(spec(model=model, gpus=gpus))
    assert inst.instance_type == expected
    assert inst.provider == "aws" and inst.market == "ondemand"
    assert inst.state in ("pending", "ready")
    itype = lab.catalog.get(expected)
    assert itype is not None
    assert len(inst.gpus) == itype.gpus
    assert {g.model for g in inst.gpus} == {itype.gpu_model}
    assert inst.hourly_usd == itype.ondemand_usd_hr
    raw = _raw(lab, str(inst.instance_id))
    tags = {t["Key"]: t["Value"] for t in raw["Tags"]}  # type: ignore[attr-defined]
    assert tags[TAG_MANAGED] == "true"
    assert tags[TAG_OWNER] == "alice"
    assert tags[TAG_RESERVATION] == "17"
    assert tags[TAG_REQUEST] == "req-1"
    assert tags["Name"] == "gpubot-alice-res-17"
    assert TAG_JOB not in tags
    assert raw["ImageId"] == lab.ami_id
    assert raw["KeyName"] == lab.key_name
    assert raw["SubnetId"] == lab.subnet_ids[0]
    assert raw.get("InstanceLifecycle") is None
    assert inst.tags == tags


def test_root_volume_is_tagged_sized_and_dies_with_the_instance(lab: AwsLab) -> None:
    inst = lab.compute(root_volume_gb=321).launch(spec(job_id="j9", reservation_id=None))
    raw = _raw(lab, str(inst.instance_id))
    mapping = raw["BlockDeviceMappings"][0]  # type: ignore[index]
    assert mapping["DeviceName"] == "/dev/sda1"
    assert mapping["Ebs"]["DeleteOnTermination"] is True
    vol = lab.ec2().describe_volumes(VolumeIds=[mapping["Ebs"]["VolumeId"]])["Volumes"][0]
    assert vol["Size"] == 321
    vtags = {t["Key"]: t["Value"] for t in vol["Tags"]}
    assert vtags[TAG_MANAGED] == "true" and vtags[TAG_JOB] == "j9"


def test_launch_spot_sets_market_options_and_reports_spot(lab: AwsLab) -> None:
    seen: list[dict[str, object]] = []

    def record(params: dict[str, dict[str, object]], **_: object) -> None:
        seen.append(dict(params["body"]))

    lab.session.events.register("before-call.ec2.RunInstances", record)
    compute = lab.compute(spot_max_price_factor=0.5)
    inst = compute.launch(spec(model="A10G", market="spot"))
    assert inst.market == "spot"
    itype = lab.catalog.get("g5.xlarge")
    assert itype is not None and itype.spot_usd_hr is not None
    assert inst.hourly_usd == itype.spot_usd_hr
    assert _raw(lab, str(inst.instance_id))["InstanceLifecycle"] == "spot"
    body = seen[-1]
    kinds = {
        v
        for k, v in body.items()
        if k.startswith("TagSpecification.") and k.endswith(".ResourceType")
    }
    assert kinds == {"instance", "volume", "network-interface", "spot-instances-request"}
    assert body["InstanceMarketOptions.MarketType"] == "spot"
    assert (
        body["InstanceMarketOptions.SpotOptions.MaxPrice"] == f"{itype.ondemand_usd_hr * 0.5:.4f}"
    )
    assert [i.market for i in compute.list_instances()] == ["spot"]


def test_list_instances_sees_only_managed_live_instances(lab: AwsLab) -> None:
    compute = lab.compute()
    ec2 = lab.ec2()
    stranger = ec2.run_instances(
        ImageId=lab.ami_id,
        InstanceType="g4dn.xlarge",
        MinCount=1,
        MaxCount=1,
        SubnetId=lab.subnet_ids[0],
        TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": "Name", "Value": "x"}]}],
    )["Instances"][0]["InstanceId"]
    not_true = ec2.run_instances(
        ImageId=lab.ami_id,
        InstanceType="g4dn.xlarge",
        MinCount=1,
        MaxCount=1,
        TagSpecifications=[
            {"ResourceType": "instance", "Tags": [{"Key": TAG_MANAGED, "Value": "false"}]}
        ],
    )["Instances"][0]["InstanceId"]
    a = compute.launch(spec(key="a"))
    b = compute.launch(spec(key="b", model="L4"))
    gone = compute.launch(spec(key="c"))
    compute.terminate(str(gone.instance_id))
    listed = {i.instance_id: i for i in compute.list_instances()}
    assert set(listed) == {a.instance_id, b.instance_id}
    assert stranger not in listed and not_true not in listed
    assert listed[b.instance_id].gpus[0].model == "L4"
    # And what gpubot did not launch, it never touches.
    for verb in (compute.stop, compute.start, compute.terminate):
        with pytest.raises(
            ProvisioningError, match="no instance with that id is managed by gpubot"
        ):
            verb(stranger)
    assert _raw(lab, stranger)["State"]["Name"] == "running"  # type: ignore[index]


def test_stop_start_terminate_round_trip(lab: AwsLab) -> None:
    compute = lab.compute()
    inst = compute.launch(spec())
    iid = str(inst.instance_id)
    assert compute.stop(iid).state == "stopped"
    assert [i.state for i in compute.list_instances()] == ["stopped"]
    assert compute.stop(iid).state == "stopped"  # stopping a stopped one is a no-op
    started = compute.start(iid)
    assert started.state in ("pending", "ready")
    assert compute.start(iid).state in ("pending", "ready")
    ended = compute.terminate(iid)
    assert ended.state == "terminated"
    assert compute.terminate(iid).state == "terminated"  # ending twice is fine
    assert compute.list_instances() == []
    with pytest.raises(ProvisioningError, match=r"it is terminated"):
        compute.start(iid)
    found = compute.get(iid)
    assert found is not None and found.state == "terminated"


def test_launched_at_is_an_aware_time_near_now(lab: AwsLab) -> None:
    from datetime import UTC, datetime, timedelta

    compute = lab.compute()
    before = datetime.now(UTC) - timedelta(seconds=5)
    inst = compute.launch(spec())
    when = compute.launched_at(str(inst.instance_id))
    assert when is not None and when.tzinfo is not None
    assert before <= when <= datetime.now(UTC) + timedelta(seconds=5)
    assert compute.launched_at("i-0123456789abcdef0") is None


def test_a_spot_instance_is_never_stopped_only_ended(lab: AwsLab) -> None:
    compute = lab.compute()
    inst = compute.launch(spec(market="spot"))
    with pytest.raises(ProvisioningError, match="spot instance, which can only be terminated"):
        compute.stop(str(inst.instance_id))
    assert _raw(lab, str(inst.instance_id))["State"]["Name"] in ("pending", "running")  # type: ignore[index]


@pytest.mark.parametrize("key", ["slack-retry-1", "x" * 300 + "#é!"])
def test_same_request_key_launches_once(lab: AwsLab, key: str) -> None:
    compute = lab.compute()
    first = compute.launch(spec(key=key))
    # A second process (the bot restarted) sees the same cloud, not this object's memory.
    again = lab.compute().launch(spec(key=key))
    assert again.instance_id == first.instance_id
    assert len(compute.list_instances()) == 1
    found = compute.find_by_request_key(key)
    assert found is not None and found.instance_id == first.instance_id
    assert compute.find_by_request_key("never-sent") is None
    other = compute.launch(spec(key="slack-retry-2"))
    assert other.instance_id != first.instance_id


def test_a_request_whose_instance_ended_is_not_relaunched_silently(lab: AwsLab) -> None:
    compute = lab.compute()
    inst = compute.launch(spec(key="k"))
    compute.terminate(str(inst.instance_id))
    with pytest.raises(ProvisioningError, match=r"already launched .* since ended"):
        compute.launch(spec(key="k"))
    assert compute.list_instances() == []


def test_client_token_is_stable_per_attempt_and_fits_ec2s_limit(lab: AwsLab) -> None:
    tokens: list[str] = []

    def record(params: dict[str, dict[str, str]], **_: object) -> None:
        tokens.append(params["body"]["ClientToken"])

    lab.session.events.register("before-call.ec2.RunInstances", record)
    lab.compute().launch(spec(key="t1"))
    lab.compute().launch(spec(key="t2"))
    assert len(tokens) == 2 and tokens[0] != tokens[1]
    assert all(len(t) <= 64 and t.isascii() for t in tokens)
    assert (
        _raw(lab, str(lab.compute().find_by_request_key("t1").instance_id))[  # type: ignore[union-attr]
            "ClientToken"
        ]
        == tokens[0]
    )


def test_capacity_error_in_zone_one_launches_in_zone_two(lab: AwsLab) -> None:
    faults = RunInstancesFaults(
        lambda itype, subnet: (
            "InsufficientInstanceCapacity" if subnet == lab.subnet_ids[0] else None
        )
    )
    lab.on_run_instances(faults)
    inst = lab.compute().launch(spec(model="A100"))
    raw = _raw(lab, str(inst.instance_id))
    assert raw["SubnetId"] == lab.subnet_ids[1]
    assert raw["Placement"]["AvailabilityZone"] == lab.zones[1]  # type: ignore[index]
    assert faults.attempts == [
        ("p4d.24xlarge", lab.subnet_ids[0]),
        ("p4d.24xlarge", lab.subnet_ids[1]),
    ]


def test_a_zone_that_just_had_no_capacity_is_tried_last_until_its_cooldown_ends(
    lab: AwsLab,
) -> None:
    """Issue 37: a capacity error moves to the next type or zone at once, with a cooldown on
    the one that failed; the next request does not ask the refusing zone first again, yet
    still asks it when nothing else is left, and asks it first once the cooldown is over."""
    now = [1000.0]
    full = {lab.subnet_ids[0]}
    faults = RunInstancesFaults(
        lambda itype, subnet: "InsufficientInstanceCapacity" if subnet in full else None
    )
    lab.on_run_instances(faults)  # before the client is made: it copies the hooks
    compute = Ec2Compute(lab.settings(), lab.catalog, session=lab.session, monotonic=lambda: now[0])
    first = compute.launch(spec(model="A100", key="r1"))
    assert _raw(lab, str(first.instance_id))["SubnetId"] == lab.subnet_ids[1]
    faults.attempts.clear()
    compute.launch(spec(model="A100", key="r2"))
    assert faults.attempts == [("p4d.24xlarge", lab.subnet_ids[1])]  # not zone one first
    # Zone two fills up too: zone one, though cooling down, is still asked (last).
    full.add(lab.subnet_ids[1])
    faults.attempts.clear()
    with pytest.raises(ProvisioningError):
        compute.launch(spec(model="A100", key="r3"))
    assert faults.attempts == [
        ("p4d.24xlarge", lab.subnet_ids[1]),
        ("p4d.24xlarge", lab.subnet_ids[0]),
    ]
    # Ten minutes on, zone one has capacity again and is first in line again.
    full.clear()
    now[0] += CAPACITY_COOLDOWN_S + 1
    faults.attempts.clear()
    again = compute.launch(spec(model="A100", key="r4"))
    assert faults.attempts == [("p4d.24xlarge", lab.subnet_ids[0])]
    assert _raw(lab, str(again.instance_id))["SubnetId"] == lab.subnet_ids[0]


def test_no_capacity_for_a_type_anywhere_falls_to_the_next_type_that_fits(lab: AwsLab) -> None:
    faults = RunInstancesFaults(
        lambda itype, subnet: "InsufficientInstanceCapacity" if itype == "p3.2xlarge" else None
    )
    lab.on_run_instances(faults)
    inst = lab.compute().launch(spec(model="V100", gpus=1))
    assert inst.instance_type == "p3.8xlarge"
    assert len(inst.gpus) == 4
    assert [a[0] for a in faults.attempts] == ["p3.2xlarge", "p3.2xlarge", "p3.8xlarge"]


def test_a_regional_quota_skips_the_other_zones_of_that_type(lab: AwsLab) -> None:
    faults = RunInstancesFaults(
        lambda itype, subnet: "VcpuLimitExceeded" if itype == "g5.xlarge" else None
    )
    lab.on_run_instances(faults)
    inst = lab.compute().launch(spec(model="A10G"))
    assert inst.instance_type == "g5.12xlarge"
    assert faults.attempts == [("g5.xlarge", lab.subnet_ids[0]), ("g5.12xlarge", lab.subnet_ids[0])]


def test_a100_does_not_become_a100_80gb_unless_configured(lab: AwsLab) -> None:
    """The catalog keeps A100 and A100-80GB apart; a p4de for an A100 request is opt-in."""
    faults = RunInstancesFaults(
        lambda itype, subnet: "InsufficientInstanceCapacity" if itype == "p4d.24xlarge" else None
    )
    lab.on_run_instances(faults)
    with pytest.raises(ProvisioningError) as err:
        lab.compute().launch(spec(model="A100"))
    assert "p4de" not in str(err.value)
    assert lab.compute().list_instances() == []
    inst = lab.compute(substitute_models=(("A100", "A100-80GB"),)).launch(spec(model="a100"))
    assert inst.instance_type == "p4de.24xlarge"
    assert {g.model for g in inst.gpus} == {"A100-80GB"}


def test_all_capacity_gone_is_one_plain_sentence_naming_what_was_tried(lab: AwsLab) -> None:
    faults = RunInstancesFaults(lambda itype, subnet: "InsufficientInstanceCapacity")
    lab.on_run_instances(faults)
    with pytest.raises(ProvisioningError) as err:
        lab.compute().launch(spec(model="H100", gpus=8, market="spot"))
    text = str(err.value)
    assert text.startswith("AWS has no spot capacity for 8× H100 in us-east-1 right now.")
    assert "p5.48xlarge in us-east-1a (no capacity)" in text
    assert "p5.48xlarge in us-east-1b (no capacity)" in text
    assert "on-demand instead of spot" in text
    assert "{" not in text and "ClientError" not in text
    assert err.value.__cause__ is None and err.value.__context__ is None
    assert lab.compute().list_instances() == []


def test_no_type_of_that_size_is_a_plain_error(lab: AwsLab) -> None:
    with pytest.raises(ProvisioningError, match=r"No instance type in the catalog has 2× T4"):
        lab.compute().launch(spec(model="T4", gpus=2))
    with pytest.raises(ProvisioningError, match="Models on offer: A100"):
        lab.compute().launch(spec(model="B200"))


def test_other_refusals_stop_at_once_in_plain_words(lab: AwsLab) -> None:
    faults = RunInstancesFaults(lambda itype, subnet: "UnauthorizedOperation")
    lab.on_run_instances(faults)
    with pytest.raises(ProvisioningError, match="not allowed to do this") as err:
        lab.compute().launch(spec())
    assert len(faults.attempts) == 1
    assert err.value.__cause__ is None


def test_ami_from_ssm_or_pinned_and_plain_errors_when_missing(lab: AwsLab) -> None:
    inst = lab.compute(ami_id=lab.ami_id, ami_ssm_parameter="/nope").launch(spec(key="p"))
    assert _raw(lab, str(inst.instance_id))["ImageId"] == lab.ami_id
    with pytest.raises(ProvisioningError, match="SSM parameter for the AMI does not exist"):
        lab.compute(ami_ssm_parameter="/aws/service/nothing/here").launch(spec(key="q"))
    with pytest.raises(ProvisioningError, match="ami-12345678"):
        lab.compute(ami_id="ami-12345678").launch(spec(key="r"))
    assert DLAMI_SSM_PARAMETER.startswith("/aws/service/deeplearning/ami/x86_64/")


def test_missing_subnet_is_a_plain_error(lab: AwsLab) -> None:
    with pytest.raises(ProvisioningError, match="subnet"):
        lab.compute(subnet_ids=("subnet-0deadbeef0000000",)).launch(spec())


def test_spot_interruption_is_recognised_not_a_failure(lab: AwsLab) -> None:
    compute = lab.compute()
    inst = compute.launch(spec(market="spot"))
    iid = str(inst.instance_id)
    assert compute.was_spot_interrupted(iid) is False

    def reclaimed(parsed: dict[str, list[dict[str, list[dict[str, object]]]]], **_: object) -> None:
        # What EC2 reports after it takes a spot instance back (moto cannot).
        for res in parsed.get("Reservations", []):
            for raw in res["Instances"]:
                raw["State"] = {"Code": 48, "Name": "terminated"}
                raw["StateReason"] = {
                    "Code": "Server.SpotInstanceTermination",
                    "Message": "Server.SpotInstanceTermination: Spot instance termination",
                }

    lab.session.events.register("after-call.ec2.DescribeInstances", reclaimed)
    compute = lab.compute()
    assert compute.was_spot_interrupted(iid) is True
    found = compute.get(iid)
    assert found is not None and found.state == "terminated"


def test_a_user_termination_is_not_a_spot_interruption(lab: AwsLab) -> None:
    compute = lab.compute()
    inst = compute.launch(spec(market="spot"))
    compute.terminate(str(inst.instance_id))
    assert compute.was_spot_interrupted(str(inst.instance_id)) is False
    assert compute.was_spot_interrupted("i-0123456789abcdef0") is False


def test_state_mapping_covers_every_ec2_state() -> None:
    assert set(STATE_MAP) == {
        "pending",
        "running",
        "stopping",
        "stopped",
        "shutting-down",
        "terminated",
    }
    assert set(STATE_MAP.values()) <= {"ready", "pending", "stopped", "terminated"}


def test_launch_spec_rejects_what_the_bot_must_never_send() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        spec(reservation_id=None, job_id=None)
    with pytest.raises(ValueError, match="exactly one"):
        spec(reservation_id="1", job_id="2")
    with pytest.raises(ValueError, match="market"):
        spec(market="reserved")
    with pytest.raises(ValueError, match="gpus"):
        spec(gpus=0)
    with pytest.raises(ValueError, match="request_key"):
        spec(key=" ")


def _spot_history(prices: dict[str, str]) -> Any:
    """A before-call hook answering DescribeSpotPriceHistory (moto's prices are placeholders)."""
    from datetime import UTC, datetime, timedelta

    from botocore.awsrequest import AWSResponse
    from botocore.compat import HTTPHeaders

    now = datetime.now(UTC)

    def answer(**_: object) -> tuple[AWSResponse, dict[str, object]]:
        history: list[dict[str, object]] = []
        for zone, price in prices.items():
            # An older, higher record per zone: only the latest one counts.
            history.append(
                {
                    "AvailabilityZone": zone,
                    "SpotPrice": "9.9",
                    "Timestamp": now - timedelta(hours=3),
                }
            )
            history.append({"AvailabilityZone": zone, "SpotPrice": price, "Timestamp": now})
        http = AWSResponse("https://ec2.test/", 200, HTTPHeaders(), None)
        return http, {"SpotPriceHistory": history, "ResponseMetadata": {"HTTPStatusCode": 200}}

    return answer


def test_spot_tries_the_zone_with_the_cheapest_spot_price_first(lab: AwsLab) -> None:
    zone_a, zone_b = lab.zones
    lab.session.events.register(
        "before-call.ec2.DescribeSpotPriceHistory",
        _spot_history({zone_a: "0.31", zone_b: "0.17"}),
    )
    faults = RunInstancesFaults(lambda itype, subnet: None)
    lab.on_run_instances(faults)
    compute = lab.compute()
    spot = compute.launch(spec(model="T4", market="spot", key="spot-1"))
    assert faults.attempts[0] == ("g4dn.xlarge", lab.subnet_ids[1])
    assert _raw(lab, str(spot.instance_id))["Placement"]["AvailabilityZone"] == zone_b  # type: ignore[index]
    # On-demand keeps the configured order: the spot price says nothing about it.
    compute.launch(spec(model="T4", key="od-1"))
    assert faults.attempts[-1] == ("g4dn.xlarge", lab.subnet_ids[0])


def test_spot_prices_unavailable_leave_the_configured_order(lab: AwsLab) -> None:
    def refuse(params: dict[str, object], **_: object) -> Any:
        from botocore.awsrequest import AWSResponse
        from botocore.compat import HTTPHeaders

        http = AWSResponse("https://ec2.test/", 403, HTTPHeaders(), None)
        return http, {
            "Error": {"Code": "UnauthorizedOperation", "Message": "not allowed"},
            "ResponseMetadata": {"HTTPStatusCode": 403},
        }

    lab.session.events.register("before-call.ec2.DescribeSpotPriceHistory", refuse)
    faults = RunInstancesFaults(lambda itype, subnet: None)
    lab.on_run_instances(faults)
    lab.compute().launch(spec(model="T4", market="spot", key="spot-2"))
    assert faults.attempts[0] == ("g4dn.xlarge", lab.subnet_ids[0])
