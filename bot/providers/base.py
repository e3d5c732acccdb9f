"""What a provider is: one object per place GPUs come from.

A provider owns everything that differs between places: its settings and their parsing
(`from_env`), its doctor checks (`checks`), its supply (the hosts or nodes it lists, and
what it can grow into), how its hosts are reached and its runs are run (what `connect`
puts on the service: the run service with its executor, a fleet, host checks), how its
hosts read in replies (`note`, `called`, `empty_pool`) and its cost basis (rented by the
second, owned, or owned at a configured rate, on each host row it lists). The rest of the
bot asks none of them which provider it is: the composition root (bot.faces.runtime)
makes the configured ones and connects them, and the app sees only ports.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from sqlalchemy.engine import Engine

from bot.app.config import Settings
from bot.app.hosts.remote import Prepare, bootstrap_prepare
from bot.app.places import Wiring
from bot.app.ports import Supply
from bot.domain.readmodels import HostState
from provisioning.aws import Ec2Settings
from provisioning.base import Compute
from provisioning.catalog import Catalog
from provisioning.checks import Check
from provisioning.hostshell import HostShell
from provisioning.ssh import Resolver, SshTarget

if TYPE_CHECKING:
    from bot.app.service import GpuService

# The EC2 checks for one set of settings (default: provisioning's read-only `check_aws`).
AwsProbe = Callable[[Ec2Settings], list[Check]]
# This machine's `python -m training.telemetry --json` document, as text.
NvmlProbe = Callable[[], str]
SSH_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Note(Check):
    """Worth saying but not wrong (no GPU here: the bot offers CPU slots), so it never
    turns the doctor's exit code red; `ok` is always True."""


def guarded(name: str, section: Callable[[], list[Check]]) -> list[Check]:
    """A doctor section that raised is that section's own failure line: the doctor is
    run when something is already broken, and must never crash."""
    try:
        return section()
    except Exception as exc:
        return [
            Check(
                name,
                False,
                f"the check itself failed ({type(exc).__name__}: {exc})",
                "This is a bug in gpubot doctor; please report this line.",
            )
        ]


@dataclass(frozen=True)
class Probes:
    """What `gpubot doctor` hands the providers' checks; tests pass doubles."""

    aws: AwsProbe | None = None
    # The SSH hosts to dial; None: the provider's own (GPUBOT_SSH_HOSTS).
    ssh_targets: Sequence[SshTarget] | None = None
    nvml: NvmlProbe | None = None
    ssh_timeout_s: float = SSH_TIMEOUT_S


@dataclass(frozen=True)
class Parts:
    """What the composition root hands a provider to connect with: the engine, the one
    SSH client, and what tests replace (where hosts are dialled, how a host is prepared)."""

    settings: Settings
    engine: Engine
    runner: HostShell
    resolver: Resolver | None
    prepare: Prepare | None
    # `gpubot shell` (one person at their own terminal) may run runs as itself.
    runs_as_self: bool


def for_hosts(
    prepare: Prepare | None, *, cloud: bool, metadata_url: str | None = None
) -> Prepare | None:
    """The production preparation told which kind of host it prepares (an EC2 instance
    gets the stopping agent, a team's own server a watching one) rather than guessing it
    from the host's name, and on EC2 where the agent asks for spot notices; a test's own
    preparation is passed through as it is."""
    if prepare is bootstrap_prepare:
        if metadata_url is not None:
            return functools.partial(bootstrap_prepare, cloud=cloud, metadata_url=metadata_url)
        return functools.partial(bootstrap_prepare, cloud=cloud)
    return prepare


class Provider(Protocol):
    """One place GPUs come from (this machine, SSH hosts, EC2, a Slurm cluster)."""

    # Its name in GPUBOT_PROVIDER(S) and on its host rows.
    name: ClassVar[str]
    # Its hosts are the team's own machines, which `gpubot hosts forget` may remove.
    owns_hosts: ClassVar[bool]

    @property
    def compute(self) -> Compute:
        """Its hosts (or nodes) as they are now."""
        ...

    @property
    def catalog(self) -> Catalog:
        """The GPU models and prices it knows."""
        ...

    @property
    def supply(self) -> Supply:
        """What its pool can grow into (nothing, for a fixed one)."""
        ...

    def connect(self, service: GpuService, parts: Parts) -> Wiring:
        """Lists its hosts on the service and returns its wiring: how its runs run, its
        holder, fleet, host checks and upkeep (bot.app.places). Called once, by the
        service as it is made; it puts nothing on the service."""
        ...

    def note(self, host: HostState) -> str | None:
        """Its word on one of its hosts in /gpu status, or None."""
        ...

    def called(self, host_name: str, provider: str) -> str:
        """What a sentence calls one of its hosts."""
        ...

    def empty_pool(self) -> str:
        """What /gpu status says when it has no host."""
        ...

    def status_lines(self) -> list[str]:
        """What /gpu status says of the provider itself (its controller not answering)."""
        ...

    def cost_note(self) -> str | None:
        """What /gpu cost adds about its prices (a rate not set), or None."""
        ...


class ProviderKind(Protocol):
    """A provider's class: how it is made from the settings, and its doctor checks,
    which must work (and say what is wrong) when it cannot be made."""

    # (Plain attributes: a class object matches a protocol's attributes, not ClassVars.)
    name: str
    # Its section's name in `gpubot doctor` ("SSH", "AWS").
    label: str
    owns_hosts: bool

    @classmethod
    def from_env(cls, settings: Settings, env: Mapping[str, str], runner: HostShell) -> Provider:
        """Raises ConfigError naming the setting that is missing or wrong."""
        ...

    @classmethod
    def checks(cls, settings: Settings, env: Mapping[str, str], probes: Probes) -> list[Check]:
        """Its lines of `gpubot doctor`: real read-only probes, never raising."""
        ...

    @classmethod
    def wanted(cls, env: Mapping[str, str]) -> bool:
        """Its own variables are set: the doctor checks it even when it is not configured
        (someone meant to use it)."""
        ...
