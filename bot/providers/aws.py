"""EC2 instances the fleet launches (`GPUBOT_PROVIDER=aws`).

Settings (boto3 reads its own credentials):

    GPUBOT_AWS_REGION          region; else AWS_REGION, else AWS_DEFAULT_REGION
    GPUBOT_AWS_SUBNETS         comma list of subnet ids, one per availability zone
    GPUBOT_AWS_SECURITY_GROUPS comma list of security group ids (optional)
    GPUBOT_AWS_KEY_NAME        the EC2 key pair the bot logs in with
    GPUBOT_AWS_AMI             a fixed AMI id (optional; else the DLAMI SSM parameter)
    GPUBOT_AWS_AMI_PARAMETER   another SSM parameter naming the AMI (optional)
    GPUBOT_AWS_METADATA_URL    the instance metadata service the host agent asks for spot
                               notices (default http://169.254.169.254)

Instances are rented by the second (their host rows carry the market and price), launched,
started, stopped and terminated by the fleet (bot.app.fleet) from the worker; the host rows
are synced by the fleet's first pass, which also waits for SSH and the bootstrap before
calling an instance ready: a web process never needs EC2 credentials.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from bot.app.config import ConfigError, Settings
from bot.app.fleet import CatalogSupply, Fleet
from bot.app.hosts.hostcheck import HostChecker
from bot.app.hosts.remote import RemoteAccess
from bot.app.money.prices import priced_catalog
from bot.app.places import RunParts, Wiring
from bot.app.ports import PlainDisplay, Supply
from bot.app.runs.processes import ProcessExecutor
from bot.domain import views
from bot.providers.base import Parts, Probes, for_hosts
from provisioning.aws import DLAMI_SSM_PARAMETER, Ec2Compute, Ec2Settings, make_session
from provisioning.aws_doctor import check_aws
from provisioning.base import ProvisioningError
from provisioning.bootstrap import DEFAULT_METADATA_URL
from provisioning.catalog import Catalog
from provisioning.checks import Check
from provisioning.hostshell import HostShell
from provisioning.ssh import InstanceResolver

if TYPE_CHECKING:
    from bot.app.service import GpuService

AWS_ENV = (
    "GPUBOT_AWS_REGION",
    "GPUBOT_AWS_SUBNETS",
    "GPUBOT_AWS_SECURITY_GROUPS",
    "GPUBOT_AWS_KEY_NAME",
    "GPUBOT_AWS_AMI",
    "GPUBOT_AWS_AMI_PARAMETER",
    "GPUBOT_AWS_METADATA_URL",
)
_AWS_FIX = (
    "Set GPUBOT_AWS_REGION, GPUBOT_AWS_SUBNETS (subnet ids, comma-separated, one per zone), "
    "GPUBOT_AWS_KEY_NAME and optionally GPUBOT_AWS_SECURITY_GROUPS and GPUBOT_AWS_AMI."
)
# check_aws speaks of Ec2Settings fields; a person sets environment variables.
_FIELD_WORDS = {
    "subnet_ids": "GPUBOT_AWS_SUBNETS",
    "key_name": "GPUBOT_AWS_KEY_NAME",
    "ami_id": "GPUBOT_AWS_AMI",
}


class AwsProvider(PlainDisplay):
    name: ClassVar[str] = "aws"
    label: ClassVar[str] = "AWS"
    owns_hosts: ClassVar[bool] = False

    def __init__(self, compute: Ec2Compute) -> None:
        self._compute = compute

    @classmethod
    def from_env(cls, settings: Settings, env: Mapping[str, str], runner: HostShell) -> AwsProvider:
        # Timed from the bot's side (AWS latency and errors on /metrics); prices from
        # `gpubot prices refresh` when it has run.
        from bot.adapters.metrics import instrument_boto3_session

        try:
            aws = ec2_settings_from_env(env)
            return cls(
                Ec2Compute(
                    aws,
                    priced_catalog(settings),
                    session=instrument_boto3_session(make_session(aws.region)),
                )
            )
        except ProvisioningError as exc:
            raise ConfigError(str(exc)) from None

    @property
    def compute(self) -> Ec2Compute:
        return self._compute

    @property
    def catalog(self) -> Catalog:
        return self._compute.catalog

    @property
    def supply(self) -> Supply:
        return CatalogSupply(self._compute.catalog)

    def connect(self, service: GpuService, parts: Parts) -> Wiring:
        """The pool grows to what the catalog can launch; the fleet buys and stops. An
        instance's bootstrap runs on the host checker's threads, never in the fleet's job."""
        compute = self._compute
        access = RemoteAccess(
            parts.engine,
            parts.runner,
            parts.resolver or InstanceResolver(user=compute.settings.ssh_user, key_path=_ssh_key()),
            prepare=for_hosts(
                parts.prepare, cloud=True, metadata_url=compute.settings.metadata_url
            ),
            # The checker bootstraps; the tick (dispatch, sampling) never waits on one.
            wait_for_prepare=False,
            clock=service.clock,
        )
        executor = ProcessExecutor(access, service.clock, service.nudge, agents=(self.name,))
        fleet = Fleet(service, compute, access, catalog=compute.catalog)
        checker = HostChecker(service, access, (), cloud=compute.name)
        fleet.set_up_off_tick(checker.tick)
        return Wiring(
            self.name,
            label="EC2",
            display=self,
            supply=self.supply,
            runs=RunParts(access, compute.catalog, executor),
            fleet=fleet,
            checker=checker,
        )

    def empty_pool(self) -> str:
        return views.GROWS_ON_DEMAND

    # --- gpubot doctor ------------------------------------------------------------------

    @classmethod
    def wanted(cls, env: Mapping[str, str]) -> bool:
        """Generic AWS credentials in a shell say nothing about gpubot; its own variables do."""
        return any(env.get(v, "").strip() for v in AWS_ENV)

    @classmethod
    def checks(cls, settings: Settings, env: Mapping[str, str], probes: Probes) -> list[Check]:
        try:
            ec2 = ec2_settings_from_env(env)
        except ConfigError as exc:
            return [Check("AWS settings", False, exc.text, _AWS_FIX)]
        found = (probes.aws or check_aws)(ec2)
        return [
            replace(c, detail=_env_words(c.detail), fix=_env_words(c.fix) if not c.ok else "")
            for c in found
        ]


def _ssh_key() -> str | None:
    key = os.environ.get("GPUBOT_SSH_KEY", "").strip()
    return str(Path(key).expanduser()) if key else None


def _split(raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def ec2_settings_from_env(env: Mapping[str, str]) -> Ec2Settings:
    """The EC2 settings from the environment; a ConfigError names what is missing."""
    region = next(
        (
            env[v].strip()
            for v in ("GPUBOT_AWS_REGION", "AWS_REGION", "AWS_DEFAULT_REGION")
            if env.get(v, "").strip()
        ),
        "",
    )
    if not region:
        raise ConfigError("no AWS region: set GPUBOT_AWS_REGION (or AWS_REGION/AWS_DEFAULT_REGION)")
    subnets = _split(env.get("GPUBOT_AWS_SUBNETS", ""))
    if not subnets:
        raise ConfigError("GPUBOT_AWS_SUBNETS is not set: the bot needs a subnet to launch into")
    try:
        return Ec2Settings(
            region=region,
            subnet_ids=subnets,
            security_group_ids=_split(env.get("GPUBOT_AWS_SECURITY_GROUPS", "")),
            key_name=env.get("GPUBOT_AWS_KEY_NAME", "").strip() or None,
            ami_id=env.get("GPUBOT_AWS_AMI", "").strip() or None,
            ami_ssm_parameter=env.get("GPUBOT_AWS_AMI_PARAMETER", "").strip()
            or DLAMI_SSM_PARAMETER,
            metadata_url=env.get("GPUBOT_AWS_METADATA_URL", "").strip() or DEFAULT_METADATA_URL,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _env_words(text: str) -> str:
    for field_name, var in _FIELD_WORDS.items():
        text = re.sub(rf"\b{field_name}\b", var, text)
    return text
