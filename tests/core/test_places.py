"""The places as the service holds them (bot.app.places): made once while the service is
made, frozen after, and each host's words and checks routed to its own place."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
from sqlalchemy.engine import Engine

from bot.app.config import Settings
from bot.app.fleet import CatalogSupply
from bot.app.places import ConflictingPlaces, Places, RunParts, Wiring
from bot.app.ports import FIXED_POOL, PlaceRequest, PlainDisplay
from bot.app.service import NO_RUNS, GpuService
from bot.domain.clock import VirtualClock
from bot.domain.commands import Run
from bot.domain.errors import UserError
from bot.domain.readmodels import HostState
from provisioning.catalog import Catalog
from tests.core.helpers import actor, host, make_service, runs_here


class Words(PlainDisplay):
    def __init__(self, name: str) -> None:
        self.name = name

    def called(self, host_name: str, provider: str) -> str:
        return f"{self.name}:{host_name}"

    def status_lines(self) -> list[str]:
        return [f"{self.name} is fine"]

    def empty_pool(self) -> str:
        return f"{self.name} has nothing"


class Ticks:
    def __init__(self) -> None:
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1


class Holds:
    """A holder that is not the null one (a cluster's)."""

    def admit(self, request: PlaceRequest) -> str | None:
        return "held by the cluster"

    def hold(self, reservation_id: int) -> str | None:
        return None

    def let_go(self, reservation_ids: Sequence[int]) -> None:
        return None

    def extend(self, reservation_id: int, total_s: int) -> None:
        return None

    def sync(self) -> int:
        return 0


def test_each_host_is_worded_and_checked_by_its_own_place() -> None:
    owned, cloud = Ticks(), Ticks()
    jobs: list[str] = []
    places = Places(
        [
            Wiring(
                "ssh",
                display=Words("ssh"),
                checker=owned,
                upkeep=(lambda: jobs.append("ssh"),),
            ),
            Wiring(
                "aws",
                display=Words("aws"),
                supply=CatalogSupply(Catalog.load()),
                checker=cloud,
                upkeep=(lambda: jobs.append("aws"),),
            ),
        ]
    )
    assert places.names == ("ssh", "aws")
    assert places.display.called("box", "ssh") == "ssh:box"
    assert places.display.called("i-1", "aws") == "aws:i-1"
    # A host of a provider no longer configured reads as its name.
    assert places.display.called("old", "slurm") == "old"
    gone = HostState("old", "slurm", "ready", "", "", 22, "owned", 0.0, ())
    assert places.display.note(gone) is None
    assert places.display.status_lines() == ["ssh is fine", "aws is fine"]
    assert places.display.empty_pool() == "aws has nothing"
    assert places.checker("ssh") is owned and places.checker("aws") is cloud
    assert places.checker("slurm") is None
    assert places.checkers == (owned, cloud)
    for job in places.upkeep:
        job()
    assert jobs == ["ssh", "aws"]
    # What the places together can grow into: the cloud's models, not the fixed pool's.
    model = Catalog.load().models()[0]
    assert places.supply.can_have(model, 1) and places.supply.offered() == sorted(
        Catalog.load().models()
    )
    assert not Places([Wiring("ssh")]).supply.can_have(model, 1)


def test_what_one_place_decides_is_refused_from_two() -> None:
    catalog = Catalog.load()
    runs = RunParts(access=PlainAccess(), catalog=catalog)
    # Two places that run are routed by the service's host lookup; without one, refused.
    with pytest.raises(ConflictingPlaces, match="ssh, local each run training runs"):
        Places([Wiring("ssh", runs=runs), Wiring("local", runs=runs)])
    with pytest.raises(ConflictingPlaces, match="a holder of reservations"):
        Places([Wiring("slurm", holder=Holds()), Wiring("slurm2", holder=Holds())])
    with pytest.raises(ConflictingPlaces, match="named twice"):
        Places([Wiring("ssh"), Wiring("ssh")])
    one = Places([Wiring("slurm", holder=Holds()), Wiring("ssh", runs=runs)])
    assert isinstance(one.holder, Holds) and one.runs is runs and one.fleet is None
    assert not one.bursting


def test_owned_places_and_a_cloud_after_them_are_routed_and_burst() -> None:
    """`ssh,aws`: one routed run part (each host by its provider, each run by its place),
    the cloud's catalog, and the cloud offered after the owned place; the cloud first, or
    two clusters, are refused."""
    from bot.app.runs.routed import RoutedAccess, RoutedExecutor

    owned_catalog, cloud_catalog = Catalog.load(), Catalog.load()
    owned = RunParts(access=Reached("box"), catalog=owned_catalog)
    cloud = RunParts(access=Reached("i-1"), catalog=cloud_catalog)
    providers = {"box": "ssh", "i-1": "aws"}
    made: list[object] = []

    def executor_for(access: object) -> Any:
        made.append(access)
        return _exec(False)

    wirings = [Wiring("ssh", runs=owned), Wiring("aws", runs=cloud, fleet=Buys())]
    places = Places(wirings, provider_of=providers.get, executor_for=executor_for)
    assert places.bursting and places.cloud is wirings[1] and places.owned == (wirings[0],)
    assert places.runs is not None and places.runs.catalog is cloud_catalog
    assert isinstance(places.runs.access, RoutedAccess)
    assert isinstance(places.runs.executor, RoutedExecutor)
    assert cast(object, places.runs.access.runner_for("box")) == "box"
    assert cast(object, places.runs.access.runner_for("i-1")) == "i-1"
    assert places.runs.access.runner_for("gone") is None
    assert made == [owned.access, cloud.access]
    with pytest.raises(ConflictingPlaces, match="goes last"):
        Places(wirings[::-1], provider_of=providers.get, executor_for=executor_for)
    # This machine refusing runs (`gpubot serve` without a run account) takes none beside
    # places that do: its hosts are not routed to.
    refusing = Wiring("local", runs=RunParts(Reached("here"), owned_catalog, refusal="no"))
    three = Places([refusing, *wirings], provider_of=providers.get, executor_for=executor_for)
    assert three.runs is not None and three.runs.refusal is None
    assert isinstance(three.runs.executor, RoutedExecutor)
    assert set(three.runs.executor.executors) == {"ssh", "aws"}
    alone = Places([refusing], provider_of=providers.get, executor_for=executor_for)
    assert alone.runs is refusing.runs
    clusters = [Wiring(n, runs=RunParts(PlainAccess(), owned_catalog, _exec(True))) for n in "ab"]
    with pytest.raises(ConflictingPlaces, match="one cluster at a time"):
        Places(clusters, provider_of=providers.get, executor_for=executor_for)


@dataclass
class Reached:
    name: str

    def runner_for(self, host_name: str) -> Any:
        return host_name if host_name == self.name else None


@dataclass
class Exec:
    places: bool


def _exec(places: bool) -> Any:
    """An executor as routing sees it: whether it places runs itself."""
    return Exec(places)


class Buys:
    """A place that buys machines (its fleet), as the places see it."""

    def provision_run(self, run_id: int, instance_type: str | None = None) -> str | None:
        return None

    def cycle(self) -> None:
        return None

    def provision_for(
        self, run_id: int, instance_type: str, price_cap: float, *, in_cluster: bool
    ) -> str | None:
        return None

    def give_back(self, kind: str, ref: int) -> bool:
        return True

    def pool_refusal(self, instance_type: str) -> str | None:
        return None


class PlainAccess:
    def runner_for(self, host_name: str) -> None:
        return None


def test_the_service_is_wired_while_it_is_made_and_not_after(sqlite_engine: Engine) -> None:
    seen: list[GpuService] = []

    def wire(core: GpuService) -> list[Wiring]:
        # A provider lists its hosts as it connects: the service's parts are there.
        core.sync_hosts([host("box", "A100", 1)])
        seen.append(core)
        return [Wiring("ssh", display=Words("ssh"), supply=FIXED_POOL)]

    svc = GpuService(sqlite_engine, Settings(), VirtualClock(), wire)
    assert seen == [svc] and svc.places.names == ("ssh",)
    assert svc.display.called("box", "ssh") == "ssh:box"
    for slot in ("runs", "holder", "fleet", "supply", "display", "upkeep"):
        with pytest.raises(AttributeError):
            setattr(svc, slot, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        svc.places.wirings[0].checker = Ticks()  # type: ignore[misc]


def test_a_bot_no_place_runs_for_says_so_for_run_and_shows_an_empty_line(
    sqlite_engine: Engine,
) -> None:
    svc, _ = make_service(sqlite_engine, [host("box", "A100", 1)])
    assert svc.places.runs is None
    with pytest.raises(UserError) as refused:
        svc.runs.submit(actor(svc, "alice"), Run(recipe="digits"))
    assert refused.value.text.startswith(NO_RUNS)
    assert svc.runs.dispatch() == 0 and svc.runs.poll() == 0


def test_a_place_that_runs_gives_the_service_its_runs(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    svc, _ = make_service(sqlite_engine, [host("box", "A100", 1)], places=runs_here(tmp_path))
    assert svc.places.runs is not None and svc.runs.access is svc.places.runs.access
