"""The places as the service holds them (bot.app.places): made once while the service is
made, frozen after, and each host's words and checks routed to its own place."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

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
    with pytest.raises(ConflictingPlaces, match="ssh, local each bring training runs"):
        Places([Wiring("ssh", runs=runs), Wiring("local", runs=runs)])
    with pytest.raises(ConflictingPlaces, match="a holder of reservations"):
        Places([Wiring("slurm", holder=Holds()), Wiring("slurm2", holder=Holds())])
    with pytest.raises(ConflictingPlaces, match="named twice"):
        Places([Wiring("ssh"), Wiring("ssh")])
    one = Places([Wiring("slurm", holder=Holds()), Wiring("ssh", runs=runs)])
    assert isinstance(one.holder, Holds) and one.runs is runs and one.fleet is None


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
