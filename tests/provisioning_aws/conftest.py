"""An EC2 account on moto, in this process (`mock_aws`) and as a server on 127.0.0.1.

`lab` is parametrized over both: the in-process mock patches botocore, while the server
is reached through `AWS_ENDPOINT_URL` over a real socket, which is how the bot's own
process finds moto in the end-to-end tests. Both get the same world: a VPC with one
subnet in each of two zones, a security group, a key pair, an AMI and the SSM parameter
that names it (moto's SSM has no Deep Learning AMI parameter, and reserves /aws/).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import boto3
import botocore.loaders
import botocore.session
import pytest
from moto import mock_aws
from moto.server import ThreadedMotoServer

from provisioning.aws import Ec2Compute, Ec2Settings
from provisioning.catalog import Catalog
from tests.ssh_hosts import SshLab, running_lab

REGION = "us-east-1"
# moto refuses to create parameters under /aws/ (reserved, as on AWS), so the lab's DLAMI
# parameter lives under a name of ours, given to the provider the way a user would.
AMI_PARAMETER = "/gpubot/test/dlami/ami-id"

# Credentials and endpoints that could leak in from the developer's shell.
_AWS_VARS = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_EC2",
    "AWS_ENDPOINT_URL_SSM",
    "AWS_ENDPOINT_URL_STS",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN",
    # A proxy would carry the loopback calls to moto somewhere else.
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "http_proxy",
    "https_proxy",
    "ALL_PROXY",
    "all_proxy",
)


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    fake_aws_env(monkeypatch, tmp_path)


def fake_aws_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, also_unset: tuple[str, ...] = ()
) -> None:
    """Fake credentials, one region, no shared config, and never the instance metadata service."""
    for var in (*_AWS_VARS, *also_unset):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    # The metadata service lives at 169.254.169.254: not loopback, never to be dialled.
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # Else moto loads thousands of public AMIs and describe_images costs seconds.
    monkeypatch.setenv("MOTO_EC2_LOAD_DEFAULT_AMIS", "false")


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """One moto server for the session (starting it is slow); each test resets its state."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOTO_EC2_LOAD_DEFAULT_AMIS", "false")
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.stop()


def _reset_server(url: str) -> None:
    req = urllib.request.Request(f"{url}/moto-api/reset", method="POST", data=b"")
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with direct.open(req, timeout=10) as resp:
        resp.read()


# Parsing EC2's service model costs about a second per botocore session; the loader caches
# it, so every test's fresh session (fresh event hooks, nothing shared) borrows this one.
_LOADER = botocore.loaders.create_loader()


def fresh_session() -> boto3.Session:
    core = botocore.session.get_session()
    core.register_component("data_loader", _LOADER)
    return boto3.Session(botocore_session=core, region_name=REGION)


@dataclass
class AwsLab:
    """The fake account, and how to build providers and clients that talk to it."""

    mode: str
    session: boto3.Session
    vpc_id: str
    subnet_ids: tuple[str, ...]
    zones: tuple[str, ...]
    security_group_id: str
    key_name: str
    ami_id: str
    catalog: Catalog = field(default_factory=Catalog.load)

    def ec2(self) -> Any:
        return self.session.client("ec2", region_name=REGION)

    def settings(self, **overrides: Any) -> Ec2Settings:
        values: dict[str, Any] = {
            "region": REGION,
            "subnet_ids": self.subnet_ids,
            "security_group_ids": (self.security_group_id,),
            "key_name": self.key_name,
            "ami_ssm_parameter": AMI_PARAMETER,
        }
        values.update(overrides)
        return Ec2Settings(**values)

    def compute(self, **overrides: Any) -> Ec2Compute:
        return Ec2Compute(self.settings(**overrides), self.catalog, session=self.session)

    def on_run_instances(self, handler: Callable[..., Any]) -> None:
        """A `before-call` hook on RunInstances: moto has no fault injection of its own."""
        self.session.events.register("before-call.ec2.RunInstances", handler)


# Imported rather than created: moto would generate an RSA key per test, for nothing.
_PUBLIC_KEY = (
    b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpPJOiiR4GEgG18rqYXLuekbcTWtnDmCR1w2CInjJnZ gpubot-test"
)


def _build_world(session: boto3.Session, mode: str) -> AwsLab:
    ec2: Any = session.client("ec2", region_name=REGION)
    ssm: Any = session.client("ssm", region_name=REGION)
    vpc = ec2.create_vpc(CidrBlock="10.7.0.0/16")["Vpc"]["VpcId"]
    zones = (f"{REGION}a", f"{REGION}b")
    subnets = tuple(
        ec2.create_subnet(VpcId=vpc, CidrBlock=f"10.7.{i}.0/24", AvailabilityZone=zone)["Subnet"][
            "SubnetId"
        ]
        for i, zone in enumerate(zones, start=1)
    )
    sg = ec2.create_security_group(GroupName="gpubot-test", Description="ssh", VpcId=vpc)["GroupId"]
    # Its members reach each other on all TCP (runs across instances), as docs/HOSTS.md sets it.
    ec2.authorize_security_group_ingress(
        GroupId=sg,
        IpPermissions=[
            {
                "IpProtocol": "tcp",
                "FromPort": 0,
                "ToPort": 65535,
                "UserIdGroupPairs": [{"GroupId": sg}],
            }
        ],
    )
    ec2.import_key_pair(KeyName="gpubot-test", PublicKeyMaterial=_PUBLIC_KEY)
    ami = ec2.register_image(
        Name="Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) test",
        RootDeviceName="/dev/sda1",
        BlockDeviceMappings=[{"DeviceName": "/dev/sda1", "Ebs": {"VolumeSize": 8}}],
    )["ImageId"]
    ssm.put_parameter(Name=AMI_PARAMETER, Value=ami, Type="String")
    return AwsLab(
        mode=mode,
        session=session,
        vpc_id=vpc,
        subnet_ids=subnets,
        zones=zones,
        security_group_id=sg,
        key_name="gpubot-test",
        ami_id=ami,
    )


@pytest.fixture
def inprocess_lab(aws_env: None) -> Iterator[AwsLab]:
    with mock_aws():
        yield _build_world(fresh_session(), "inprocess")


@pytest.fixture
def server_lab(
    aws_env: None, moto_server: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[AwsLab]:
    _reset_server(moto_server)
    # boto3 reads this itself: the code under test needs no test-only wiring.
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    yield _build_world(fresh_session(), "server")


@pytest.fixture(params=["inprocess", "server"])
def lab(request: pytest.FixtureRequest) -> AwsLab:
    """Both ways of running moto: the provider must behave the same against each."""
    result: AwsLab = request.getfixturevalue(f"{request.param}_lab")
    return result


@pytest.fixture(scope="module")
def ssh(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SshLab]:
    """Loopback sshd hosts for a module whose instances are reached on them (moto's
    addresses are never dialled): one lab per module, started once."""
    name = request.module.__name__.rpartition(".")[2].removeprefix("test_")
    with running_lab(tmp_path_factory.mktemp(f"sshd-{name}")) as lab:
        yield lab
