"""The places GPUs come from, as the service holds them: each provider's wiring, in the
team's order, frozen when the service is made.

A provider's `connect` (bot.providers) returns one `Wiring`: how its runs are run (their
host access, catalog and executor), who holds the GPUs of the reservations it grants (a
cluster's holder), what it can grow into (a cloud's supply), its fleet, its host checker,
its periodic upkeep and its words for its hosts. The composition root (bot.faces.runtime)
hands the service the providers' connects; the service calls them once, while it is
being made, and keeps what they return as `Places`. Nothing is put on the service
afterwards, and nobody asks whether a part "is set yet": a place without a holder has
`NoHolder`, one that cannot run has none of the run parts, and `Places` says so.

`Places` routes what has a key to the place it belongs to: a host's words, its checks and
its shell by the host's provider, a started run by the place it was claimed on
(bot.app.runs.routed). Several places that run: the owned ones in the team's order, at
most one of them a cluster whose own scheduler places runs, and at most one cloud that
buys machines (its fleet); a run waits on the owned places first and is offered the
cloud, priced, when the wait grows long (bot.app.burst). Two clusters, two clouds or two
holders of reservations at once are refused here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from bot.app.ports import (
    FIXED_POOL,
    Holder,
    HostAccess,
    HostDisplay,
    NoHolder,
    PlainDisplay,
    Provisioner,
    Supply,
)
from bot.domain.durations import format_seconds
from bot.domain.readmodels import HostState
from provisioning.catalog import Catalog

if TYPE_CHECKING:
    from bot.app.runs.executor import RunExecutor


class Checker(Protocol):
    """A place's host checks (bot.app.hosts.hostcheck.HostChecker): the worker hands out the
    due ones every few seconds and returns at once."""

    def tick(self) -> object: ...


@dataclass(frozen=True)
class RunParts:
    """How a place runs training runs: its hosts' shells, the models and prices its
    scheduler knows, and where claimed runs run (process groups on the hosts `access`
    reaches when `executor` is None)."""

    access: HostAccess
    catalog: Catalog
    executor: RunExecutor | None = None
    # Why runs are not accepted there at all (bot.app.runs.context.RunContext.refusal).
    refusal: str | None = None


@dataclass(frozen=True)
class Wiring:
    """One place, connected: what its provider's `connect` returns."""

    # The provider's name: the `provider` of the host rows it lists.
    name: str
    # How people name the place in a sentence ("EC2", "the Slurm cluster"); its name if "".
    label: str = ""
    # How its hosts read in replies (the provider itself, which is a HostDisplay).
    display: HostDisplay = field(default_factory=PlainDisplay)
    supply: Supply = FIXED_POOL
    runs: RunParts | None = None
    # Who holds the GPUs of reservations it grants (a cluster's jobs); nobody where
    # gpubot grants its GPUs itself.
    holder: Holder = field(default_factory=NoHolder)
    # The cloud side (launch, reuse, reconcile, idle stop) of a place that buys machines
    # (bot.app.fleet.Fleet).
    fleet: Provisioner | None = None
    checker: Checker | None = None
    # Its periodic upkeep (a cluster's nodes and others' holds re-read), which the worker
    # runs every few seconds (bot.faces.worker).
    upkeep: tuple[Callable[[], object], ...] = ()


class ConflictingPlaces(ValueError):
    """Two places would both decide what only one may decide today."""


T = TypeVar("T")


def _one(wirings: Sequence[Wiring], what: str, pick: Callable[[Wiring], T | None]) -> T | None:
    found = [(w.name, got) for w in wirings if (got := pick(w)) is not None]
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise ConflictingPlaces(
            f"{names} each bring {what}; one place at a time does until places are ordered"
        )
    return found[0][1] if found else None


class Places:
    """The connected places, in the team's order (owned ones first is the team's call)."""

    def __init__(
        self,
        wirings: Sequence[Wiring],
        *,
        provider_of: Callable[[str], str | None] | None = None,
        executor_for: Callable[[HostAccess], RunExecutor] | None = None,
    ) -> None:
        """`provider_of` (a host's name -> its row's provider) and `executor_for` (the
        process-group executor over an access, for a place that brings none) are what
        several places that run need to be routed; one place needs neither."""
        names = [w.name for w in wirings]
        if len(set(names)) != len(names):
            raise ConflictingPlaces(f"a place is named twice: {', '.join(names)}")
        self.wirings: tuple[Wiring, ...] = tuple(wirings)
        self._by_name = {w.name: w for w in self.wirings}
        clouds = [w for w in self.wirings if w.fleet is not None]
        if clouds and clouds[-1] is not self.wirings[-1]:
            order = ",".join([*(n for n in names if n != clouds[-1].name), clouds[-1].name])
            raise ConflictingPlaces(
                f"{clouds[-1].name} buys machines, so it goes last: the order is the team's, "
                f"owned places first (GPUBOT_PROVIDERS={order})"
            )
        # The place that buys machines, and the owned places that run before it.
        self.cloud: Wiring | None = clouds[-1] if clouds else None
        self.owned: tuple[Wiring, ...] = tuple(
            w for w in self.wirings if w.fleet is None and w.runs is not None
        )
        self.runs: RunParts | None = _runs(self.wirings, provider_of, executor_for)
        self.holder: Holder = (
            _one(
                self.wirings,
                "a holder of reservations",
                lambda w: None if isinstance(w.holder, NoHolder) else w.holder,
            )
            or NoHolder()
        )
        self.fleet: Provisioner | None = _one(self.wirings, "a fleet", lambda w: w.fleet)
        self.supply: Supply = _AnySupply(tuple(w.supply for w in self.wirings))
        self.display: HostDisplay = _Words(self)
        self.upkeep: tuple[Callable[[], object], ...] = tuple(
            job for w in self.wirings for job in w.upkeep
        )
        self.checkers: tuple[Checker, ...] = tuple(
            w.checker for w in self.wirings if w.checker is not None
        )

    @property
    def bursting(self) -> bool:
        """Owned places that run, and a cloud after them: a run that waits long on the
        owned ones is offered the cloud (bot.app.burst)."""
        return self.cloud is not None and self.cloud.runs is not None and bool(self.owned)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(w.name for w in self.wirings)

    def of(self, provider: str) -> Wiring | None:
        """The place a host row's `provider` names, or None (a host of a provider that is
        no longer configured)."""
        return self._by_name.get(provider)

    def lines(self, hosts: Sequence[HostState], burst_after_s: float | None) -> list[str]:
        """`/gpu status` where there are several places: each in the team's order, with
        its GPUs free now, and when the cloud is offered to a run that waits."""
        if len(self.wirings) < 2:
            return []
        parts = []
        for w in self.wirings:
            mine = [h for h in hosts if h.provider == w.name and h.state == "ready"]
            free = sum(h.free for h in mine)
            total = sum(len(h.gpus) for h in mine)
            said = f"{self.label(w.name)}: {free} of {total} free"
            if w is self.cloud and self.bursting:
                after = (
                    "never offered (GPUBOT_BURST_AFTER=never)"
                    if burst_after_s is None
                    else f"offered, priced, to a run that has waited {format_seconds(burst_after_s)}"
                )
                said += f", {after}"
            elif w is self.cloud:
                said += ", grows on demand"
            parts.append(said)
        return ["Places, in the team's order: " + "; ".join(parts) + "."]

    def label(self, provider: str) -> str:
        """The place as a sentence names it ("started on the Slurm cluster")."""
        place = self.of(provider)
        return (place.label or place.name) if place is not None else provider

    def checker(self, provider: str) -> Checker | None:
        place = self.of(provider)
        return place.checker if place is not None else None


def _runs(
    wirings: Sequence[Wiring],
    provider_of: Callable[[str], str | None] | None,
    executor_for: Callable[[HostAccess], RunExecutor] | None,
) -> RunParts | None:
    """The places' run parts as one: each host reached by its provider, each run by the
    place it was claimed on, prices from the cloud's catalog (the owned GPUs' models
    are its models too, and only the cloud is bought from it)."""
    running = [w for w in wirings if w.runs is not None]
    # A place that refuses runs (this machine without a run account, under `gpubot serve`)
    # takes none beside places that do: its hosts are not routed to, so nothing is
    # started there as the bot's own user; where every place refuses, the first says why.
    willing = [w for w in running if w.runs is not None and w.runs.refusal is None]
    running = willing or running[:1]
    if len(running) <= 1:
        return running[0].runs if running else None
    if provider_of is None or executor_for is None:
        raise ConflictingPlaces(
            ", ".join(w.name for w in running) + " each run training runs; routing them "
            "needs the service's host lookup"
        )
    from bot.app.runs.routed import RoutedAccess, RoutedExecutor

    parts = {w.name: w.runs for w in running if w.runs is not None}
    executors = {
        name: p.executor if p.executor is not None else executor_for(p.access)
        for name, p in parts.items()
    }
    try:
        executor = RoutedExecutor(executors, provider_of)
    except ValueError as exc:
        raise ConflictingPlaces(str(exc)) from None
    cloud = next((w for w in running if w.fleet is not None), None)
    catalog = (cloud or running[0]).runs.catalog  # type: ignore[union-attr]
    return RunParts(
        access=RoutedAccess({n: p.access for n, p in parts.items()}, provider_of),
        catalog=catalog,
        executor=executor,
    )


class _AnySupply:
    """What the places together can grow into: what any of them can."""

    def __init__(self, supplies: tuple[Supply, ...]) -> None:
        self._supplies = supplies

    def can_have(self, model: str, gpus: int) -> bool:
        return any(s.can_have(model, gpus) for s in self._supplies)

    def can_run(self, model: str, gpus: int) -> bool:
        return any(s.can_run(model, gpus) for s in self._supplies)

    def offered(self) -> list[str]:
        return sorted({m for s in self._supplies for m in s.offered()})


class _Words:
    """`HostDisplay` over the places: each host worded by its own provider."""

    def __init__(self, places: Places) -> None:
        self._places = places

    def _of(self, provider: str) -> HostDisplay | None:
        place = self._places.of(provider)
        return place.display if place is not None else None

    def note(self, host: HostState) -> str | None:
        own = self._of(host.provider)
        return own.note(host) if own is not None else None

    def called(self, host_name: str, provider: str) -> str:
        own = self._of(provider)
        return own.called(host_name, provider) if own is not None else host_name

    def empty_pool(self) -> str:
        wirings = self._places.wirings
        return wirings[-1].display.empty_pool() if wirings else "No hosts are configured."

    def status_lines(self) -> list[str]:
        return [line for w in self._places.wirings for line in w.display.status_lines()]

    def cost_note(self) -> str | None:
        notes = [n for w in self._places.wirings if (n := w.display.cost_note()) is not None]
        return " ".join(notes) or None
