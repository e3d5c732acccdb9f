"""EC2 as a provider: GPUs rented by the hour, so nothing here may ever lose track of one.

Every instance gpubot launches carries `gpubot:managed=true`, its owner, what it is for
(`gpubot:reservation` or `gpubot:job`) and the request that asked for it
(`gpubot:request`). That tag set is how the bot finds, after a crash between the
launch call and its own commit, what it already pays for, and how a retried request
gets the instance the first delivery launched instead of a second one. Instances
without the managed tag are invisible here and are never started, stopped or ended.

What a GPU type is (model, count, memory, price) comes from the catalog, never from
`describe_instance_types`: the catalog is what the bot prices and schedules with, and
moto's copy of that API lacks some types (p3.2xlarge).

State mapping, EC2 → the host states of `db.models`:

    pending                 → pending     (booting; not usable, billed from here on)
    running                 → ready       (the VM runs; SSH readiness is the bot's check)
    stopping, stopped       → stopped     (compute no longer billed, the volume is)
    shutting-down, terminated → terminated (gone; never listed, findable by request key)

No SDK object crosses this module's public surface: answers are `Instance`s, and every
botocore failure becomes a `ProvisioningError` whose text is fit for a person.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar, cast

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
    PartialCredentialsError,
)

from provisioning.base import GpuDevice, Instance, ProvisioningError
from provisioning.bootstrap import DEFAULT_METADATA_URL
from provisioning.catalog import Catalog, InstanceType
from provisioning.compute import LaunchSpec

if TYPE_CHECKING:
    from mypy_boto3_ec2.client import EC2Client
    from mypy_boto3_ec2.literals import InstanceTypeType, ResourceTypeType
    from mypy_boto3_ec2.type_defs import (
        FilterTypeDef,
        InstanceTypeDef,
        RunInstancesRequestTypeDef,
        TagSpecificationTypeDef,
        TagTypeDef,
    )
    from mypy_boto3_ssm.client import SSMClient

log = logging.getLogger(__name__)
T = TypeVar("T")

# AWS publishes the newest "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04)" here
# (name rule: the AMI's name without "deep", "learning", "ami"; see the DLAMI guide, "Finding
# the ID of a DLAMI"). It has the NVIDIA driver and CUDA, not a framework: the bot installs
# its own runner, and a base image keeps boot predictable across PyTorch releases.
DLAMI_SSM_PARAMETER = (
    "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
)

TAG_MANAGED = "gpubot:managed"
TAG_OWNER = "gpubot:owner"
TAG_RESERVATION = "gpubot:reservation"
TAG_JOB = "gpubot:job"
TAG_REQUEST = "gpubot:request"

# EC2 state name → db.models host state (see the module docstring).
STATE_MAP: dict[str, str] = {
    "pending": "pending",
    "running": "ready",
    "stopping": "stopped",
    "stopped": "stopped",
    "shutting-down": "terminated",
    "terminated": "terminated",
}
_LIVE_EC2_STATES = ("pending", "running", "stopping", "stopped")

# The zone (or the type in that zone) has no room now: another zone may.
_ZONAL_CAPACITY_CODES = frozenset(
    {
        "InsufficientInstanceCapacity",
        "InsufficientCapacity",
        "InsufficientHostCapacity",
        "InsufficientReservedInstanceCapacity",
        "InsufficientFreeAddressesInSubnet",
        "Unsupported",
        "SpotMaxPriceTooLow",
    }
)
# A quota of the account in the region: no other zone helps, another type (family) may.
_REGIONAL_CAPACITY_CODES = frozenset(
    {
        "InstanceLimitExceeded",
        "VcpuLimitExceeded",
        "MaxSpotInstanceCountExceeded",
    }
)

# How long a (type, zone) where EC2 had no capacity is tried last: capacity comes back in
# minutes (the fleet's own retry waits as long: bot.app.fleet.common.LAUNCH_RETRY_AFTER).
CAPACITY_COOLDOWN_S = 600.0

_CAPACITY_WORDS: dict[str, str] = {
    "InsufficientInstanceCapacity": "no capacity",
    "InsufficientCapacity": "no capacity",
    "InsufficientHostCapacity": "no capacity",
    "InsufficientReservedInstanceCapacity": "no reserved capacity",
    "InsufficientFreeAddressesInSubnet": "subnet has no free addresses",
    "Unsupported": "type not offered there",
    "SpotMaxPriceTooLow": "spot price above our maximum",
    "InstanceLimitExceeded": "account instance limit reached",
    "VcpuLimitExceeded": "account vCPU quota reached",
    "MaxSpotInstanceCountExceeded": "account spot instance limit reached",
}

# Plain words for the refusals a person can act on; anything else keeps AWS's own message.
_ERROR_WORDS: dict[str, str] = {
    "AuthFailure": "AWS did not accept the credentials (check AWS_ACCESS_KEY_ID/AWS_PROFILE)",
    "InvalidClientTokenId": "AWS does not know this access key (check AWS_ACCESS_KEY_ID/AWS_PROFILE)",
    "SignatureDoesNotMatch": "the AWS secret key does not match the access key",
    "ExpiredToken": "the AWS session token has expired; log in again",
    "RequestExpired": "the request expired; check this machine's clock",
    "UnauthorizedOperation": "the AWS identity is not allowed to do this (IAM policy)",
    "AccessDeniedException": "the AWS identity is not allowed to do this (IAM policy)",
    "InvalidKeyPair.NotFound": "the configured key pair does not exist in this region",
    "InvalidSubnetID.NotFound": "a configured subnet does not exist in this region",
    "InvalidSubnet": "a configured subnet is not valid",
    "InvalidGroup.NotFound": "a configured security group does not exist in this region",
    "InvalidAMIID.NotFound": "the AMI does not exist in this region",
    "InvalidAMIID.Malformed": "the AMI id is malformed",
    "InvalidAMIID.Unavailable": "the AMI is not available",
    "InvalidInstanceID.NotFound": "no such instance",
    "InvalidInstanceID.Malformed": "that is not an instance id",
    "IncorrectInstanceState": "the instance is not in a state that allows this",
    "UnsupportedOperation": "EC2 does not support this for that instance",
    "ParameterNotFound": "the SSM parameter for the AMI does not exist in this region",
    "RequestLimitExceeded": "AWS is throttling requests; try again in a minute",
}


@dataclass(frozen=True)
class Ec2Settings:
    """Where and how to launch; read from the bot's config, fixed for the process."""

    region: str
    # One subnet per availability zone, tried in this order when a zone has no capacity.
    subnet_ids: tuple[str, ...]
    security_group_ids: tuple[str, ...] = ()
    # The EC2 key pair whose private key the bot's SSH layer holds; None launches without one.
    key_name: str | None = None
    # A fixed AMI wins over the SSM parameter (pin an image that is known to work).
    ami_id: str | None = None
    ami_ssm_parameter: str = DLAMI_SSM_PARAMETER
    # Root EBS volume, GB (gp3, deleted with the instance so no volume outlives its bill).
    root_volume_gb: int = 200
    # Spot bid = this × the type's on-demand price; 1.0 never pays more than on-demand.
    spot_max_price_factor: float = 1.0
    # Start of every Name tag, so a person in the console sees what is the bot's.
    name_prefix: str = "gpubot"
    # Login user of the AMI (the DLAMI on Ubuntu: "ubuntu").
    ssh_user: str = "ubuntu"
    # The instance metadata service the host agent asks for spot notices: EC2's own
    # address, or its IPv6 one (http://[fd00:ec2::254]) in an IPv6-only subnet. Tests
    # point it at a loopback fake, so the agent's spot watch is the production one.
    metadata_url: str = DEFAULT_METADATA_URL
    # Other catalog models that may serve a request for a model, tried after its own types,
    # e.g. (("A100", "A100-80GB"),). Empty by default: the catalog treats A100 and A100-80GB
    # as different models and the bot grants by exact model, so a substitute launched for an
    # A100 request would be billed while nothing could be granted on it.
    substitute_models: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.region.strip():
            raise ValueError("Ec2Settings.region must not be empty")
        if not self.subnet_ids:
            raise ValueError("Ec2Settings.subnet_ids needs at least one subnet")
        if self.root_volume_gb < 8:
            raise ValueError("Ec2Settings.root_volume_gb must be >= 8")
        if not self.spot_max_price_factor > 0:
            raise ValueError("Ec2Settings.spot_max_price_factor must be positive")
        if not self.metadata_url.startswith(("http://", "https://")):
            raise ValueError("Ec2Settings.metadata_url must be an http:// URL")


def aws_error_text(exc: Exception, action: str) -> str:
    """One plain sentence for an SDK failure; also used by the doctor."""
    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return (
            f"Cannot {action}: no AWS credentials found. Set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or run `aws configure`."
        )
    if isinstance(exc, NoRegionError):
        return f"Cannot {action}: no AWS region is configured."
    if isinstance(exc, EndpointConnectionError):
        url = str(exc.kwargs.get("endpoint_url", "the AWS endpoint"))
        return (
            f"Cannot {action}: AWS is unreachable at {url}. Check the network, "
            "or AWS_ENDPOINT_URL if it is set."
        )
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", "Unknown"))
        message = str(err.get("Message", "")).strip()
        words = _ERROR_WORDS.get(code) or _CAPACITY_WORDS.get(code)
        if words:
            return f"Cannot {action}: {words}" + (f" ({message})" if message else "") + "."
        return f"Cannot {action}: AWS said {code}" + (f": {message}" if message else "") + "."
    if isinstance(exc, BotoCoreError):
        return f"Cannot {action}: the AWS client failed ({exc})."
    return f"Cannot {action}: {exc}."


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _guard(action: str, call: Callable[[], T]) -> T:
    """Runs one SDK call; any SDK failure becomes a `ProvisioningError` with no SDK object in it.

    The error is raised after the `except` block has finished, so neither `__cause__` nor
    `__context__` holds the botocore exception (and its raw response dict); the log has it.
    """
    try:
        return call()
    except (BotoCoreError, ClientError) as exc:
        text = aws_error_text(exc, action)
        log.warning("%s", text, exc_info=True)
    raise ProvisioningError(text)


def make_session(region: str) -> boto3.Session:
    """A session from boto3's own environment (AWS_PROFILE, AWS_ENDPOINT_URL, …)."""
    return _guard("set up the AWS client", lambda: boto3.Session(region_name=region))


# Short timeouts and bounded retries: a slash command's follow-up should fail in seconds,
# not hang for minutes on a dead endpoint; standard mode retries throttling sensibly.
CLIENT_CONFIG = Config(
    connect_timeout=5,
    read_timeout=30,
    retries={"mode": "standard", "max_attempts": 4},
)


class Ec2Compute:
    """gpubot's instances on EC2. Tests inject a session (or clients) pointed at moto."""

    name = "aws"

    def __init__(
        self,
        settings: Ec2Settings,
        catalog: Catalog | None = None,
        *,
        session: boto3.Session | None = None,
        ec2: EC2Client | None = None,
        ssm: SSMClient | None = None,
        config: Config | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        # (instance type, subnet or "*" for the region, market) -> until when it is tried
        # last: where EC2 just said "no capacity" (CAPACITY_COOLDOWN_S).
        self._cold: dict[tuple[str, str, str], float] = {}
        self._monotonic = monotonic
        self.catalog = catalog if catalog is not None else Catalog.load()
        sess = session if session is not None else make_session(settings.region)
        cfg = config if config is not None else CLIENT_CONFIG
        self._ec2: EC2Client = (
            ec2
            if ec2 is not None
            else _guard(
                "set up the EC2 client",
                lambda: sess.client("ec2", region_name=settings.region, config=cfg),
            )
        )
        self._ssm: SSMClient = (
            ssm
            if ssm is not None
            else _guard(
                "set up the SSM client",
                lambda: sess.client("ssm", region_name=settings.region, config=cfg),
            )
        )
        self._ami: tuple[str, str] | None = None  # (image id, root device name), resolved once
        self._zones: dict[str, str] | None = None  # subnet id → availability zone

    # --- reading -----------------------------------------------------------------

    def list_instances(self) -> list[Instance]:
        """Every live instance gpubot launched, whoever launched it (this process or a dead one)."""
        found = self._describe(
            [
                {"Name": f"tag:{TAG_MANAGED}", "Values": ["true"]},
                {"Name": "instance-state-name", "Values": list(_LIVE_EC2_STATES)},
            ],
            "list gpubot's EC2 instances",
        )
        return [self._to_instance(raw) for raw in found]

    def find_by_request_key(self, request_key: str) -> Instance | None:
        """The instance launched for `request_key`, live ones first, then the newest ended one."""
        found = self._describe(
            [
                {"Name": f"tag:{TAG_MANAGED}", "Values": ["true"]},
                {"Name": f"tag:{TAG_REQUEST}", "Values": [_request_tag(request_key)]},
            ],
            "look up the instance for a request",
        )
        if not found:
            return None
        if len(found) > 1:
            # Should not happen (see launch); say so loudly, since each copy costs money.
            log.error(
                "request %s has %d instances: %s",
                request_key,
                len(found),
                ", ".join(str(r.get("InstanceId")) for r in found),
            )
        live = [r for r in found if r.get("State", {}).get("Name") in _LIVE_EC2_STATES]
        pick = live or sorted(found, key=lambda r: str(r.get("LaunchTime", "")), reverse=True)
        return self._to_instance(pick[0])

    def get(self, instance_id: str) -> Instance | None:
        """One managed instance in any state (terminated ones too, while EC2 still shows them)."""
        raw = self._describe_one(instance_id)
        return None if raw is None else self._to_instance(raw)

    def launched_at(self, instance_id: str) -> datetime | None:
        """When EC2 started billing it (its last start): an adopted instance's cost begins here.

        Not on `Instance` yet (base.py is shared); reconcile needs it to attribute the
        seconds between a crashed launch and its adoption, the idle policy to age a host.
        """
        raw = self._describe_one(instance_id)
        if raw is None:
            return None
        when = raw.get("LaunchTime")
        if not isinstance(when, datetime):
            return None
        return when if when.tzinfo is not None else when.replace(tzinfo=UTC)

    def zone(self, instance_id: str) -> str | None:
        """The availability zone it runs in, for telling its owner where it went."""
        raw = self._describe_one(instance_id)
        if raw is None:
            return None
        return str(raw.get("Placement", {}).get("AvailabilityZone", "")) or None

    def was_spot_interrupted(self, instance_id: str) -> bool:
        """True when AWS reclaimed this spot instance: the run should be requeued, not failed."""
        raw = self._describe_one(instance_id)
        if raw is None:
            return False
        code = str(raw.get("StateReason", {}).get("Code", ""))
        return code.startswith("Server.SpotInstance")

    # --- acting ----------------------------------------------------------------------

    def launch(self, spec: LaunchSpec) -> Instance:
        """Launches for `spec`, or returns what an earlier delivery of the same request launched.

        Two guards against paying twice: the request tag, looked up first (it survives a
        crash of this process between the call and the bot's commit), and a ClientToken
        derived from the request and the attempt, which lets EC2 itself collapse a retry
        that races ahead of describe's eventual consistency. The token differs per
        (type, subnet) attempt because EC2 rejects one token with changed parameters.
        """
        prior = self.find_by_request_key(spec.request_key)
        if prior is not None:
            if prior.state != "terminated":
                return prior
            raise ProvisioningError(
                f"Request {spec.request_key} already launched {prior.instance_id}, which has "
                "since ended; a new launch needs a new request."
            )
        types = self._candidate_types(spec)
        if not types:
            raise ProvisioningError(
                f"No instance type in the catalog has {spec.gpus}× {spec.gpu_model}. "
                f"Models on offer: {', '.join(self.catalog.models())}."
            )
        image_id, root_device = self._resolve_ami()
        zones = self._subnet_zones()
        tried: list[str] = []
        failed_types: set[str] = set()
        for itype, subnet in self._options(types, spec, zones):
            if itype.instance_type in failed_types:
                continue  # a regional refusal (a quota) for this type: no other zone helps
            where = f"{itype.instance_type} in {zones.get(subnet, subnet)}"
            outcome = self._attempt(spec, itype, subnet, image_id, root_device, where)
            if isinstance(outcome, str):
                until = self._monotonic() + CAPACITY_COOLDOWN_S
                if outcome in _ZONAL_CAPACITY_CODES:
                    tried.append(f"{where} ({_CAPACITY_WORDS[outcome]})")
                    self._cold[(itype.instance_type, subnet, spec.market)] = until
                    log.info("launch %s: %s, trying the next option", where, outcome)
                    continue
                tried.append(f"{itype.instance_type} ({_CAPACITY_WORDS[outcome]})")
                self._cold[(itype.instance_type, "*", spec.market)] = until
                failed_types.add(itype.instance_type)
                log.info("launch %s: %s, trying the next type", where, outcome)
                continue
            log.info(
                "launched %s (%s) for %s, request %s",
                outcome.get("InstanceId"),
                where,
                spec.owner,
                spec.request_key,
            )
            return self._to_instance(outcome)
        market = "spot" if spec.market == "spot" else "on-demand"
        raise ProvisioningError(
            f"AWS has no {market} capacity for {spec.gpus}× {spec.gpu_model} in "
            f"{self.settings.region} right now. Tried: {'; '.join(tried)}. Try again later, "
            + ("or on-demand instead of spot, " if spec.market == "spot" else "")
            + "or ask for another GPU model."
        )

    def start(self, instance_id: str) -> Instance:
        """Starts a stopped instance: the cheaper path when the team already owns its disk."""
        raw = self._managed(instance_id, "start")
        state = _ec2_state(raw)
        if state in ("pending", "running"):
            return self._to_instance(raw)
        if state not in ("stopped", "stopping"):
            raise ProvisioningError(
                f"Cannot start {instance_id}: it is {state}; only a stopped instance can start."
            )
        _guard(f"start {instance_id}", lambda: self._ec2.start_instances(InstanceIds=[instance_id]))
        return self._refresh(instance_id, raw)

    def stop(self, instance_id: str) -> Instance:
        """Stops an idle on-demand instance: compute billing ends, its disk (and setup) stays."""
        raw = self._managed(instance_id, "stop")
        state = _ec2_state(raw)
        if state in ("stopping", "stopped"):
            return self._to_instance(raw)
        if state not in ("pending", "running"):
            raise ProvisioningError(f"Cannot stop {instance_id}: it is {state}.")
        if raw.get("InstanceLifecycle") == "spot":
            # A one-time spot instance cannot be stopped on EC2; the idle policy must end it.
            raise ProvisioningError(
                f"Cannot stop {instance_id}: it is a spot instance, which can only be terminated."
            )
        _guard(f"stop {instance_id}", lambda: self._ec2.stop_instances(InstanceIds=[instance_id]))
        return self._refresh(instance_id, raw)

    def terminate(self, instance_id: str) -> Instance:
        """Ends an instance for good (its root volume goes with it). Ending an ended one is fine."""
        raw = self._managed(instance_id, "terminate")
        if _ec2_state(raw) in ("shutting-down", "terminated"):
            return self._to_instance(raw)
        _guard(
            f"terminate {instance_id}",
            lambda: self._ec2.terminate_instances(InstanceIds=[instance_id]),
        )
        return self._refresh(instance_id, raw)

    # --- internals ---------------------------------------------------------------------

    def _candidate_types(self, spec: LaunchSpec) -> list[InstanceType]:
        """The model's own types that fit (cheapest first), then any configured substitutes."""
        models = [spec.gpu_model]
        canon = self.catalog.normalize_model(spec.gpu_model)
        for wanted, substitute in self.settings.substitute_models:
            if canon is not None and self.catalog.normalize_model(wanted) == canon:
                models.append(substitute)
        allowed = set(spec.instance_types)
        out: list[InstanceType] = []
        for model in models:
            for t in self.catalog.for_model(model):
                if allowed and t.instance_type not in allowed:
                    continue
                if t.gpus >= spec.gpus and t not in out:
                    out.append(t)
        return out

    def _attempt(
        self,
        spec: LaunchSpec,
        itype: InstanceType,
        subnet: str,
        image_id: str,
        root_device: str,
        where: str,
    ) -> InstanceTypeDef | str:
        """The launched instance, or the capacity error code that says to look elsewhere."""
        try:
            return self._run_one(spec, itype, subnet, image_id, root_device)
        except ClientError as exc:
            code = _error_code(exc)
            if code in _ZONAL_CAPACITY_CODES or code in _REGIONAL_CAPACITY_CODES:
                return code
            text = aws_error_text(exc, f"launch {where}")
            log.warning("%s", text, exc_info=True)
        except BotoCoreError as exc:
            text = aws_error_text(exc, f"launch {where}")
            log.warning("%s", text, exc_info=True)
        raise ProvisioningError(text)

    def _run_one(
        self,
        spec: LaunchSpec,
        itype: InstanceType,
        subnet: str,
        image_id: str,
        root_device: str,
    ) -> InstanceTypeDef:
        tags = self._tags(spec, itype)
        # Everything the call creates carries the tags, so a console search for
        # gpubot:managed finds every piece that costs money (moto keeps only the first two).
        kinds = ["instance", "volume", "network-interface"]
        if spec.market == "spot":
            kinds.append("spot-instances-request")
        specs: list[TagSpecificationTypeDef] = [
            {"ResourceType": cast("ResourceTypeType", kind), "Tags": tags} for kind in kinds
        ]
        token = _client_token(spec.request_key, itype.instance_type, subnet, spec.market)
        kwargs: RunInstancesRequestTypeDef = {
            "MinCount": 1,
            "MaxCount": 1,
            "ImageId": image_id,
            "InstanceType": cast("InstanceTypeType", itype.instance_type),
            "SubnetId": subnet,
            "ClientToken": token,
            "TagSpecifications": specs,
            "BlockDeviceMappings": [
                {
                    "DeviceName": root_device,
                    "Ebs": {
                        "VolumeSize": self.settings.root_volume_gb,
                        "VolumeType": "gp3",
                        "DeleteOnTermination": True,
                    },
                }
            ],
            # IMDSv2 only: the instance runs teammates' code.
            "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled"},
        }
        if self.settings.security_group_ids:
            kwargs["SecurityGroupIds"] = list(self.settings.security_group_ids)
        if self.settings.key_name:
            kwargs["KeyName"] = self.settings.key_name
        if spec.market == "spot":
            max_price = itype.ondemand_usd_hr * self.settings.spot_max_price_factor
            kwargs["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {
                    "MaxPrice": f"{max_price:.4f}",
                    "SpotInstanceType": "one-time",
                    "InstanceInterruptionBehavior": "terminate",
                },
            }
        resp = self._ec2.run_instances(**kwargs)
        return resp["Instances"][0]

    def _tags(self, spec: LaunchSpec, itype: InstanceType) -> list[TagTypeDef]:
        purpose = (
            (TAG_RESERVATION, str(spec.reservation_id))
            if spec.reservation_id is not None
            else (TAG_JOB, str(spec.job_id))
        )
        kind = "res" if purpose[0] == TAG_RESERVATION else "job"
        name = f"{self.settings.name_prefix}-{_tag_safe(spec.owner)}-{kind}-{_tag_safe(purpose[1])}"
        pairs = [
            ("Name", name[:255]),
            (TAG_MANAGED, "true"),
            (TAG_OWNER, spec.owner[:255]),
            (purpose[0], purpose[1][:255]),
            (TAG_REQUEST, _request_tag(spec.request_key)),
            ("gpubot:gpu-model", itype.gpu_model),
        ]
        return [{"Key": k, "Value": v} for k, v in pairs]

    def _resolve_ami(self) -> tuple[str, str]:
        """The image and its root device name (the DLAMI's is /dev/sda1, others differ)."""
        if self._ami is not None:
            return self._ami
        image_id = self.settings.ami_id
        if not image_id:
            name = self.settings.ami_ssm_parameter
            param = _guard(
                f"read the AMI id from SSM parameter {name}",
                lambda: self._ssm.get_parameter(Name=name),
            )
            image_id = str(param.get("Parameter", {}).get("Value", "")).strip()
            if not image_id.startswith("ami-"):
                raise ProvisioningError(
                    f"SSM parameter {self.settings.ami_ssm_parameter} does not hold an AMI id."
                )
        wanted = image_id
        images = _guard(
            f"look up AMI {wanted}",
            lambda: self._ec2.describe_images(ImageIds=[wanted]).get("Images", []),
        )
        if not images:
            raise ProvisioningError(
                f"AMI {image_id} is not visible in {self.settings.region}; set ami_id to an "
                "image of this region or fix the SSM parameter."
            )
        root = str(images[0].get("RootDeviceName") or "/dev/sda1")
        self._ami = (image_id, root)
        return self._ami

    def _options(
        self, types: Sequence[InstanceType], spec: LaunchSpec, zones: dict[str, str]
    ) -> list[tuple[InstanceType, str]]:
        """Every (type, subnet) to try, in the preferred order (the candidate types, each
        in its zones' order), with those where EC2 said "no capacity" (or a quota) within
        CAPACITY_COOLDOWN_S moved to the end: the next request goes elsewhere at once
        instead of asking the zone that just refused, and still asks it when nothing else
        is left. Kept in this process; a restart forgets it, at the cost of one refusal."""
        now = self._monotonic()
        self._cold = {k: until for k, until in self._cold.items() if until > now}
        warm: list[tuple[InstanceType, str]] = []
        cold: list[tuple[InstanceType, str]] = []
        for itype in types:
            for subnet in self._subnets_for(itype, spec, zones):
                t = itype.instance_type
                refused = (t, subnet, spec.market) in self._cold or (
                    t,
                    "*",
                    spec.market,
                ) in self._cold
                (cold if refused else warm).append((itype, subnet))
        return warm + cold

    def _subnets_for(
        self, itype: InstanceType, spec: LaunchSpec, zones: dict[str, str]
    ) -> list[str]:
        """The configured subnets, for spot in order of their zone's current spot price.

        Spot prices differ by zone (often by a third), so the cheapest zone is tried first;
        a zone with no price (no spot market there) goes last, and ties keep the configured
        order. A failed price lookup is not a failed launch: the configured order stands.
        """
        subnets = list(self.settings.subnet_ids)
        if spec.market != "spot":
            return subnets
        prices = self._spot_prices(itype.instance_type)
        if not prices:
            return subnets
        rank = {subnet: i for i, subnet in enumerate(subnets)}
        return sorted(
            subnets,
            key=lambda sn: (prices.get(zones.get(sn, ""), float("inf")), rank[sn]),
        )

    def _spot_prices(self, instance_type: str) -> dict[str, float]:
        """Zone → the latest Linux spot price for the type (empty when EC2 would not say)."""
        try:
            resp = self._ec2.describe_spot_price_history(
                InstanceTypes=[instance_type],  # type: ignore[list-item]
                ProductDescriptions=["Linux/UNIX"],
                StartTime=datetime.now(UTC),
            )
        except (BotoCoreError, ClientError) as exc:
            log.warning(
                "spot prices for %s unavailable, zones in configured order: %s", instance_type, exc
            )
            return {}
        latest: dict[str, tuple[datetime, float]] = {}
        for rec in resp.get("SpotPriceHistory", []):
            zone = str(rec.get("AvailabilityZone", ""))
            try:
                price = float(rec.get("SpotPrice", ""))
            except ValueError:
                continue
            stamp = rec.get("Timestamp") or datetime.min.replace(tzinfo=UTC)
            if zone and (zone not in latest or stamp > latest[zone][0]):
                latest[zone] = (stamp, price)
        return {zone: price for zone, (_, price) in latest.items()}

    def _subnet_zones(self) -> dict[str, str]:
        """Zone names for messages; a subnet that does not exist fails here, in plain words."""
        if self._zones is None:
            ids = list(self.settings.subnet_ids)
            resp = _guard(
                "look up the configured subnets",
                lambda: self._ec2.describe_subnets(SubnetIds=ids),
            )
            self._zones = {
                str(s.get("SubnetId")): str(s.get("AvailabilityZone", "")) for s in resp["Subnets"]
            }
        return self._zones

    def _describe(self, filters: Sequence[FilterTypeDef], action: str) -> list[InstanceTypeDef]:
        def read_all() -> list[InstanceTypeDef]:
            out: list[InstanceTypeDef] = []
            paginator = self._ec2.get_paginator("describe_instances")
            for page in paginator.paginate(Filters=list(filters)):
                for reservation in page.get("Reservations", []):
                    out.extend(reservation.get("Instances", []))
            return out

        return _guard(action, read_all)

    def _describe_one(self, instance_id: str) -> InstanceTypeDef | None:
        """The instance if it exists and is gpubot's; None otherwise."""
        try:
            resp = self._ec2.describe_instances(InstanceIds=[instance_id])
        except ClientError as exc:
            if _error_code(exc) in ("InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed"):
                return None
            text = aws_error_text(exc, f"look up {instance_id}")
            log.warning("%s", text, exc_info=True)
            resp = None
        except BotoCoreError as exc:
            text = aws_error_text(exc, f"look up {instance_id}")
            log.warning("%s", text, exc_info=True)
            resp = None
        if resp is None:
            raise ProvisioningError(text)
        for reservation in resp.get("Reservations", []):
            for raw in reservation.get("Instances", []):
                if _tag_dict(raw).get(TAG_MANAGED) == "true":
                    return raw
        return None

    def _managed(self, instance_id: str, verb: str) -> InstanceTypeDef:
        """Refuses to touch what gpubot did not launch: someone else's machine is not ours to end."""
        raw = self._describe_one(instance_id)
        if raw is None:
            raise ProvisioningError(
                f"Cannot {verb} {instance_id}: no instance with that id is managed by gpubot "
                f"in {self.settings.region}."
            )
        return raw

    def _refresh(self, instance_id: str, fallback: InstanceTypeDef) -> Instance:
        raw = self._describe_one(instance_id)
        return self._to_instance(raw if raw is not None else fallback)

    def _to_instance(self, raw: InstanceTypeDef) -> Instance:
        itype_name = str(raw.get("InstanceType", ""))
        itype = self.catalog.get(itype_name)
        market = "spot" if raw.get("InstanceLifecycle") == "spot" else "ondemand"
        if itype is None:
            # Still listed: an instance we cannot price is still one we must not forget.
            log.warning(
                "instance %s has type %s, unknown to the catalog", raw.get("InstanceId"), itype_name
            )
            gpus: tuple[GpuDevice, ...] = ()
            hourly = 0.0
        else:
            gpus = tuple(
                GpuDevice(index=i, model=itype.gpu_model, memory_gb=itype.gpu_mem_gb)
                for i in range(itype.gpus)
            )
            hourly = itype.ondemand_usd_hr
            if market == "spot" and itype.spot_usd_hr is not None:
                hourly = itype.spot_usd_hr
        instance_id = str(raw.get("InstanceId", ""))
        return Instance(
            name=instance_id,
            provider=self.name,
            state=STATE_MAP.get(_ec2_state(raw), "pending"),
            gpus=gpus,
            instance_id=instance_id,
            instance_type=itype_name or None,
            market=market,
            hourly_usd=hourly,
            address=str(raw.get("PublicIpAddress") or raw.get("PrivateIpAddress") or ""),
            ssh_user=self.settings.ssh_user,
            tags=_tag_dict(raw),
        )


def _ec2_state(raw: InstanceTypeDef) -> str:
    return str(raw.get("State", {}).get("Name", "pending"))


def _tag_dict(raw: InstanceTypeDef | dict[str, Any]) -> dict[str, str]:
    return {str(t.get("Key")): str(t.get("Value", "")) for t in raw.get("Tags", [])}


def _request_tag(request_key: str) -> str:
    """The key itself when it fits a tag value (readable in the console), else its hash."""
    key = request_key.strip()
    if len(key) <= 200 and re.fullmatch(r"[\w.:/=+\-@ ]+", key):
        return key
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def _client_token(request_key: str, instance_type: str, subnet: str, market: str) -> str:
    """At most 64 ASCII characters, as EC2 requires; same attempt, same token."""
    digest = hashlib.sha256(f"{request_key}|{instance_type}|{subnet}|{market}".encode()).hexdigest()
    return f"gpubot-{digest[:48]}"


def _tag_safe(text: str) -> str:
    return re.sub(r"[^\w.\-@]+", "_", text.strip())[:64] or "_"
