"""Where an EC2 host's agent asks for spot notices is the bot's setting, not a constant.

EC2's own metadata address (169.254.169.254) by default; GPUBOT_AWS_METADATA_URL points
it elsewhere (IPv6-only subnets; the journey's loopback fake). The setting must reach the
preparation the EC2 wiring hands the fleet, which installs the agent with it.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from bot.app.config import load_settings
from bot.app.hosts.remote import bootstrap_prepare
from bot.faces.runtime import build_runtime
from provisioning.bootstrap import DEFAULT_METADATA_URL
from tests.provisioning_aws.conftest import AwsLab


@pytest.mark.parametrize("url", [None, "http://[fd00:ec2::254]"])
def test_the_ec2_wiring_prepares_hosts_with_the_configured_metadata_url(
    inprocess_lab: AwsLab, tmp_path: Path, url: str | None
) -> None:
    settings = load_settings({"GPUBOT_HOME": str(tmp_path), "GPUBOT_PROVIDER": "aws"})
    overrides = {} if url is None else {"metadata_url": url}
    rt = build_runtime(settings, compute=inprocess_lab.compute(**overrides))
    try:
        assert rt.fleet is not None
        prepare = rt.fleet.access.prepare
        assert isinstance(prepare, functools.partial) and prepare.func is bootstrap_prepare
        assert prepare.keywords == {"cloud": True, "metadata_url": url or DEFAULT_METADATA_URL}
    finally:
        rt.engine.dispose()
