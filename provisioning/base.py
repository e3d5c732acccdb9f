"""The provisioning boundary: a small protocol over plain dataclasses.

Nothing from boto3 or fabric crosses it — the bot sees `Instance` and
`GpuDevice`, never an SDK dict — so providers can be swapped (this machine,
static SSH hosts, EC2, the simulator) and tested against one contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class ProvisioningError(Exception):
    """A provider could not do what was asked; the message is fit for a user."""


@dataclass(frozen=True)
class GpuDevice:
    # Device index on its host: the number CUDA_VISIBLE_DEVICES takes.
    index: int
    # Normalized model ("A100", "H100", "T4", …) or "cpu" for a CPU slot.
    model: str
    # Memory per device in GB (0 for a CPU slot).
    memory_gb: float = 0.0


@dataclass(frozen=True)
class Instance:
    # Stable name the bot shows and keys hosts on ("local", "gpu-box-1", "i-0abc…").
    name: str
    # The provider that owns it: "local", "ssh", "aws", "sim".
    provider: str
    # ready, pending, stopped, terminated, unreachable (see db.models HOST_*).
    state: str
    gpus: tuple[GpuDevice, ...]
    # The cloud's own id (EC2 instance id); None for machines we do not rent.
    instance_id: str | None = None
    instance_type: str | None = None
    # "ondemand", "spot", or "owned" (no hourly bill).
    market: str = "owned"
    # Price of the whole instance per running hour, USD.
    hourly_usd: float = 0.0
    # How to reach it over SSH; empty address means "this machine, no SSH".
    address: str = ""
    ssh_user: str = ""
    ssh_port: int = 22
    tags: dict[str, str] = field(default_factory=dict)


class Compute(Protocol):
    """What the bot may ask of a provider. Later providers add launch/stop/terminate."""

    name: str

    def list_instances(self) -> list[Instance]:
        """Every instance this provider manages, as it is now."""
        ...
