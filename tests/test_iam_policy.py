"""docs/iam-policy.json: a valid identity policy document, naming only real AWS actions,
that allows every AWS call the code makes — as recorded from the provider's own paths
under moto with a botocore `before-call` hook, and as found by scanning provisioning/'s
source, so a call added later cannot slip past — and that holds the money-spending
actions to the `gpubot:managed` tag."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from provisioning import pricing
from provisioning.aws_doctor import check_aws
from provisioning.base import ProvisioningError
from provisioning.compute import LaunchSpec
from tests.provisioning_aws.conftest import REGION, AwsLab, aws_env, inprocess_lab  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
POLICY_PATH = ROOT / "docs" / "iam-policy.json"
SERVICES = ("ec2", "ssm", "pricing", "sts")
# Calls AWS allows every identity without a policy statement.
NEEDS_NO_PERMISSION = {"sts:GetCallerIdentity"}
_STATEMENT_KEYS = {"Sid", "Effect", "Action", "NotAction", "Resource", "NotResource", "Condition"}
_CONDITION_OPS = re.compile(
    r"^(ForAllValues:|ForAnyValue:)?(StringEquals|StringNotEquals|StringLike|StringNotLike|"
    r"StringEqualsIgnoreCase|ArnLike|ArnEquals|Bool|NumericEquals|NumericLessThan|"
    r"IpAddress|DateGreaterThan|DateLessThan|Null)(IfExists)?$"
)


def load_policy() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(POLICY_PATH.read_text())
    return doc


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def allowed_actions(policy: dict[str, Any]) -> set[str]:
    return {
        a for st in policy["Statement"] if st["Effect"] == "Allow" for a in _as_list(st["Action"])
    }


def statements_for(policy: dict[str, Any], action: str) -> list[dict[str, Any]]:
    return [st for st in policy["Statement"] if action in _as_list(st["Action"])]


def _clients() -> dict[str, Any]:
    # Made only to read botocore's service models: no credentials, no network.
    session = boto3.Session(
        aws_access_key_id="unused", aws_secret_access_key="unused", region_name=REGION
    )
    return {name: session.client(name, region_name=REGION) for name in SERVICES}  # type: ignore[call-overload]


def test_the_policy_is_a_valid_policy_document() -> None:
    policy = load_policy()
    assert set(policy) == {"Version", "Statement"}
    assert policy["Version"] == "2012-10-17"
    assert isinstance(policy["Statement"], list) and policy["Statement"]
    sids = [st.get("Sid") for st in policy["Statement"]]
    assert len(set(sids)) == len(sids), "Sids must be unique"
    operations = {
        c.meta.service_model.signing_name: set(c.meta.service_model.operation_names)
        for c in _clients().values()
    }
    for st in policy["Statement"]:
        assert set(st) <= _STATEMENT_KEYS, st
        assert "Principal" not in st  # an identity policy names no principal
        assert st["Effect"] in ("Allow", "Deny")
        assert re.fullmatch(r"[A-Za-z0-9]+", st["Sid"])
        actions = _as_list(st["Action"])
        assert actions and all(isinstance(a, str) for a in actions)
        for action in actions:
            service, _, op = action.partition(":")
            assert op in operations[service], f"{action} is not an AWS action"
        for arn in _as_list(st["Resource"]):
            assert arn == "*" or re.fullmatch(r"arn:aws:(ec2|ssm):\*:(\*)?:[a-z\-]+/.+", arn), arn
        for op, pairs in st.get("Condition", {}).items():
            assert _CONDITION_OPS.match(op), op
            assert isinstance(pairs, dict) and pairs
            for key, value in pairs.items():
                assert re.fullmatch(r"(aws|ec2):[A-Za-z]+(/[\w:.\-]+)?", key), key
                assert isinstance(value, str | list)


def test_money_spending_actions_are_held_to_the_managed_tag() -> None:
    policy = load_policy()
    for action in ("ec2:StartInstances", "ec2:StopInstances", "ec2:TerminateInstances"):
        for st in statements_for(policy, action):
            assert st["Condition"] == {"StringEquals": {"aws:ResourceTag/gpubot:managed": "true"}}
            assert st["Resource"] == "arn:aws:ec2:*:*:instance/*"
    launch = statements_for(policy, "ec2:RunInstances")
    tagged = [st for st in launch if "Condition" in st]
    assert len(tagged) == 1
    assert tagged[0]["Condition"] == {"StringEquals": {"aws:RequestTag/gpubot:managed": "true"}}
    assert "arn:aws:ec2:*:*:instance/*" in tagged[0]["Resource"]
    for st in launch:
        if "Condition" not in st:  # only what is used, never created, by a launch
            assert not any("instance/" in r or "volume/" in r for r in _as_list(st["Resource"]))
    (tags,) = statements_for(policy, "ec2:CreateTags")
    assert tags["Condition"] == {"StringEquals": {"ec2:CreateAction": "RunInstances"}}
    assert not any(a.startswith("iam:") for a in allowed_actions(policy))  # no instance profile


@pytest.fixture
def recorded(inprocess_lab: AwsLab) -> Iterator[set[str]]:  # noqa: F811
    calls: set[str] = set()

    def record(model: Any, **_: Any) -> None:
        calls.add(f"{model.service_model.signing_name}:{model.name}")

    inprocess_lab.session.events.register("before-call", record)
    yield calls


def _spec(key: str, market: str) -> LaunchSpec:
    return LaunchSpec(
        gpu_model="T4", gpus=1, market=market, owner="U0ALICE01", request_key=key, job_id=key
    )


def test_every_call_the_provider_makes_is_allowed(
    inprocess_lab: AwsLab,  # noqa: F811
    recorded: set[str],
    tmp_path: Path,
) -> None:
    lab = inprocess_lab
    compute = lab.compute()
    ondemand = compute.launch(_spec("req-ondemand", "ondemand"))
    spot = compute.launch(_spec("req-spot", "spot"))
    assert ondemand.instance_id and spot.instance_id
    assert {i.instance_id for i in compute.list_instances()} == {
        ondemand.instance_id,
        spot.instance_id,
    }
    compute.stop(ondemand.instance_id)
    compute.start(ondemand.instance_id)
    compute.terminate(spot.instance_id)
    compute.find_by_request_key("req-spot")
    compute.launched_at(ondemand.instance_id)
    compute.was_spot_interrupted(spot.instance_id)
    compute.get(ondemand.instance_id)
    # `gpubot doctor`'s AWS checks, and the live price refresh.
    checks = check_aws(lab.settings(), session=lab.session)
    assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    # `gpubot prices refresh`: moto has no Price List API (it answers 404), so the refresh
    # fails in plain words, but only after both calls were made.
    with pytest.raises(ProvisioningError):
        pricing.refresh(
            lab.catalog,
            tmp_path / "prices.csv",
            REGION,
            pricing=lab.session.client("pricing", region_name="us-east-1"),
            ec2=lab.ec2(),
        )
    pricing.fetch_spot(lab.ec2(), ["g4dn.xlarge"], REGION)

    assert {
        "ec2:RunInstances",
        "ec2:StopInstances",
        "ec2:StartInstances",
        "ec2:TerminateInstances",
        "ec2:DescribeInstances",
        "ssm:GetParameter",
        "ec2:DescribeSpotPriceHistory",
        "pricing:GetProducts",
    } <= recorded, recorded
    missing = recorded - allowed_actions(load_policy()) - NEEDS_NO_PERMISSION
    assert not missing, f"the code calls {sorted(missing)}, which the IAM policy does not allow"


def source_operations(directory: Path = ROOT / "provisioning") -> set[str]:
    """`service:Operation` for every SDK method provisioning/ calls or paginates.

    Any attribute call whose name is a method of one of the clients counts (`self._ec2.x(`,
    `ec2.x(`, `client.x(`), and so does every `get_paginator("x")`; a name several services
    share counts for each of them, which can only make the check stricter.
    """
    methods: dict[str, set[str]] = {}
    for client in _clients().values():
        prefix = client.meta.service_model.signing_name
        for method, op in client.meta.method_to_api_mapping.items():
            methods.setdefault(method, set()).add(f"{prefix}:{op}")
    found: set[str] = set()
    for path in sorted(directory.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in methods:
                found |= methods[func.attr]
            if (
                isinstance(func, ast.Attribute)
                and func.attr == "get_paginator"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                found |= methods.get(node.args[0].value, set())
    return found


def test_every_sdk_method_in_the_source_is_allowed() -> None:
    found = source_operations()
    assert {"ec2:RunInstances", "ec2:TerminateInstances", "ssm:GetParameter"} <= found
    missing = found - allowed_actions(load_policy()) - NEEDS_NO_PERMISSION
    assert not missing, f"provisioning/ calls {sorted(missing)}: add them to docs/iam-policy.json"


def test_the_scan_would_catch_a_new_call(tmp_path: Path) -> None:
    (tmp_path / "volumes.py").write_text(
        "def grow(self):\n"
        "    self._ec2.create_volume(Size=1, AvailabilityZone='a')\n"
        "    return self._ec2.get_paginator('describe_volumes')\n"
    )
    found = source_operations(tmp_path)
    assert found == {"ec2:CreateVolume", "ec2:DescribeVolumes"}
    assert not found & allowed_actions(load_policy())
