"""Failures of the AWS side reach the bot as one plain `ProvisioningError`, never an SDK object."""

from __future__ import annotations

import socket

import pytest
from botocore.config import Config

from provisioning.aws import Ec2Compute
from provisioning.base import ProvisioningError
from provisioning.compute import LaunchSpec
from tests.provisioning_aws.conftest import REGION, AwsLab, fresh_session

SPEC = LaunchSpec(
    gpu_model="T4", gpus=1, market="ondemand", owner="bob", request_key="e1", reservation_id="5"
)


def _closed_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.fixture
def no_credentials(aws_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    # Were a request to go out anyway, it would hit a closed loopback port, nothing else.
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_loopback_port()}")


def _settings_lab_free() -> Ec2Compute:
    from provisioning.aws import Ec2Settings

    return Ec2Compute(
        Ec2Settings(region=REGION, subnet_ids=("subnet-1",), ami_id="ami-12345678"),
        session=fresh_session(),
        config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=2),
    )


@pytest.mark.usefixtures("no_credentials")
def test_missing_credentials_is_plain_text() -> None:
    compute = _settings_lab_free()
    for call in (compute.list_instances, lambda: compute.launch(SPEC), lambda: compute.stop("i-1")):
        with pytest.raises(ProvisioningError) as err:
            call()
        text = str(err.value)
        assert "no AWS credentials found" in text
        assert "AWS_ACCESS_KEY_ID" in text and "aws configure" in text
        assert err.value.__cause__ is None and err.value.__context__ is None


def test_unreachable_endpoint_is_plain_text(aws_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"http://127.0.0.1:{_closed_loopback_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", url)
    compute = _settings_lab_free()
    with pytest.raises(ProvisioningError) as err:
        compute.list_instances()
    assert str(err.value).startswith("Cannot list gpubot's EC2 instances: AWS is unreachable at")
    assert "127.0.0.1" in str(err.value)
    assert err.value.__cause__ is None


def test_the_default_client_comes_from_boto3s_own_environment(lab: AwsLab) -> None:
    """No session given: boto3 finds moto by itself (mock_aws, or AWS_ENDPOINT_URL)."""
    compute = Ec2Compute(lab.settings(), lab.catalog)
    inst = compute.launch(SPEC)
    ids = [
        i["InstanceId"]
        for r in lab.ec2().describe_instances()["Reservations"]
        for i in r["Instances"]
    ]
    assert ids == [inst.instance_id]
