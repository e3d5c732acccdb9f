"""The providers: the one place that knows them by name.

`KINDS` lists every provider by the name GPUBOT_PROVIDER (or the list GPUBOT_PROVIDERS)
gives it; `configured` makes the ones the settings name, `checks` runs their doctor
lines. The composition root (bot.faces.runtime) hands their `connect` to the service,
which keeps what each returns (bot.app.places); nothing else asks which one it is.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

from bot.app.config import ConfigError, Settings
from bot.app.money.prices import priced_catalog
from bot.app.places import Wiring
from bot.app.ports import FIXED_POOL, PlainDisplay, Supply
from bot.providers.aws import AwsProvider
from bot.providers.base import Note, Parts, Probes, Provider, ProviderKind, guarded
from bot.providers.local import LocalProvider
from bot.providers.slurm import SlurmProvider
from bot.providers.ssh import SshProvider
from provisioning.aws import Ec2Compute
from provisioning.base import Compute
from provisioning.catalog import Catalog
from provisioning.checks import Check
from provisioning.hosts import LocalCompute, StaticHostsCompute
from provisioning.hostshell import HostShell

if TYPE_CHECKING:
    from bot.app.service import GpuService

__all__ = [
    "KINDS",
    "Note",
    "Parts",
    "Probes",
    "Provider",
    "checks",
    "configured",
    "for_compute",
    "names",
    "owners",
]

KINDS: dict[str, ProviderKind] = {
    kind.name: kind for kind in (LocalProvider, SshProvider, AwsProvider, SlurmProvider)
}


def names(settings: Settings) -> tuple[str, ...]:
    """The providers the settings name, in order (owned ones first is the team's call);
    a ConfigError names one that is not known."""
    wanted = settings.providers or (settings.provider,)
    unknown = [n for n in wanted if n not in KINDS]
    if unknown:
        known = ", ".join(KINDS)
        variable = "GPUBOT_PROVIDERS" if settings.providers else "GPUBOT_PROVIDER"
        raise ConfigError(f"{variable}={','.join(wanted)}: {unknown[0]} is not one of {known}")
    return wanted


def configured(settings: Settings, env: Mapping[str, str], runner: HostShell) -> list[Provider]:
    """The providers the settings name, each made from its settings."""
    return [KINDS[name].from_env(settings, env, runner) for name in names(settings)]


def checks(settings: Settings, env: Mapping[str, str], probes: Probes) -> list[Check]:
    """Each configured provider's doctor lines (a name that is not known is one line),
    and those of a provider whose own variables are set though it is not configured."""
    try:
        wanted = list(names(settings))
    except ConfigError as exc:
        return [Check("Provider", False, exc.text, f"Use one of {', '.join(KINDS)}.")]
    configured_ = ",".join(wanted)
    wanted += [name for name, kind in KINDS.items() if name not in wanted and kind.wanted(env)]
    out: list[Check] = [
        Check(kind.label, True, f"not used (GPUBOT_PROVIDER={configured_})")
        for name, kind in KINDS.items()
        if name not in wanted
    ]
    for name in wanted:
        kind = KINDS[name]
        out += guarded(kind.label, lambda kind=kind: kind.checks(settings, env, probes))  # type: ignore[misc]
    return out


def owners(settings: Settings) -> tuple[str, ...]:
    """The providers whose hosts are the team's own machines (`gpubot hosts forget`)."""
    return tuple(n for n, kind in KINDS.items() if kind.owns_hosts)


class _Listed(PlainDisplay):
    """A provider made from a compute a test handed the runtime, with no way to run
    anything: its hosts, reservations only."""

    name: ClassVar[str] = "listed"
    owns_hosts: ClassVar[bool] = False

    def __init__(self, settings: Settings, compute: Compute) -> None:
        self._compute = compute
        self._catalog = priced_catalog(settings)

    @property
    def compute(self) -> Compute:
        return self._compute

    @property
    def catalog(self) -> Catalog:
        return self._catalog

    @property
    def supply(self) -> Supply:
        return FIXED_POOL

    def connect(self, service: GpuService, parts: Parts) -> Wiring:
        service.sync_hosts(self._compute.list_instances())
        return Wiring(self.name, display=self)


@functools.singledispatch
def for_compute(compute: Compute, settings: Settings) -> Provider:
    """The provider of a compute handed to the runtime (tests): by the compute's type."""
    return _Listed(settings, compute)


@for_compute.register
def _(compute: LocalCompute, settings: Settings) -> Provider:
    return LocalProvider(settings, compute)


@for_compute.register
def _(compute: StaticHostsCompute, settings: Settings) -> Provider:
    return SshProvider(settings, compute)


@for_compute.register
def _(compute: Ec2Compute, settings: Settings) -> Provider:
    return AwsProvider(compute)
