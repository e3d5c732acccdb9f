"""What every provider's `list_instances` promises the bot, held for EC2 and this machine alike."""

from __future__ import annotations

import pytest

from provisioning.aws import Ec2Compute
from provisioning.base import Compute, GpuDevice
from provisioning.compute import LaunchSpec, RentingCompute
from provisioning.hosts import LocalCompute
from tests.provisioning_aws.conftest import AwsLab

HOST_STATES = {"ready", "pending", "stopped", "terminated", "unreachable"}


@pytest.fixture(params=["local", "aws-inprocess", "aws-server"])
def provider(request: pytest.FixtureRequest) -> Compute:
    if request.param == "local":
        return LocalCompute(probe=lambda: [GpuDevice(0, "T4", 15.0), GpuDevice(1, "T4", 15.0)])
    lab: AwsLab = request.getfixturevalue(request.param.replace("aws-", "") + "_lab")
    compute = lab.compute()
    for key, model in (("c1", "T4"), ("c2", "H100")):
        compute.launch(
            LaunchSpec(
                gpu_model=model, gpus=1, market="ondemand", owner="u", request_key=key, job_id=key
            )
        )
    return compute


def test_list_instances_returns_instances_with_gpus(provider: Compute) -> None:
    found = provider.list_instances()
    assert found
    for inst in found:
        assert inst.provider == provider.name
        assert inst.state in HOST_STATES
        assert inst.gpus, inst
        assert [g.index for g in inst.gpus] == list(range(len(inst.gpus)))
        assert all(g.model for g in inst.gpus)
        assert inst.market in ("owned", "ondemand", "spot")
        assert inst.hourly_usd >= 0
        assert (inst.market == "owned") == (inst.hourly_usd == 0)
    assert [i.name for i in provider.list_instances()] == [i.name for i in found]
    assert len({i.name for i in found}) == len(found)


def test_ec2_has_every_method_of_renting_compute(inprocess_lab: AwsLab) -> None:
    """mypy checks the signatures (the annotation below); this checks nothing was left out."""
    compute: RentingCompute = inprocess_lab.compute()
    wanted = {
        name
        for klass in (RentingCompute, Compute)
        for name, value in vars(klass).items()
        if callable(value) and not name.startswith("_")
    }
    assert wanted >= {
        "launch",
        "start",
        "stop",
        "terminate",
        "find_by_request_key",
        "list_instances",
    }
    missing = {name for name in wanted if not callable(getattr(Ec2Compute, name, None))}
    assert not missing
    assert compute.name == "aws"
