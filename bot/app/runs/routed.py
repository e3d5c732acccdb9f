"""Several places' runs as one executor and one host access: each run goes to the
executor of the place it was claimed on (its placement's `at`), each host to the access
of its provider.

Why one facade and not a run service per place: the queue, the logs, cancel and the poll
are the team's, whatever place a run is on, and dispatch and poll already ask one
executor. The cluster among the places (an executor that `places` runs itself) is
handed the runs that wait for the owned GPUs; gpubot's own scheduler places the rest on
the hosts of the other places (bot.app.runs.dispatch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from bot.app.ports import HostAccess, HostSeat, PlaceRequest, seats_for
from bot.app.runs.executor import Look, PrepareCode, RunExecutor
from db.models import TrainingRun

# A run's placement names the place it was claimed on under this key.
AT = "at"


def group_of(placement: Mapping[str, Any]) -> tuple[str, str] | None:
    """The group a run was started in as one (a sweep's job array: its place and job),
    which `/gpu queue` shows as one line and a cancel of the whole signals at once; None
    for a run started alone."""
    if "array_task" not in placement:
        return None
    return (str(placement.get(AT, "")), str(placement.get("job")))


class RoutedAccess:
    """`HostAccess` over the places: a host is reached the way its own provider reaches
    it (`provider_of` reads the host's row)."""

    def __init__(
        self, accesses: Mapping[str, HostAccess], provider_of: Callable[[str], str | None]
    ) -> None:
        self._accesses = dict(accesses)
        self._provider_of = provider_of

    def runner_for(self, host_name: str) -> HostSeat | None:
        access = self._accesses.get(self._provider_of(host_name) or "")
        return access.runner_for(host_name) if access is not None else None

    def seats_for(self, host_name: str) -> list[HostSeat]:
        access = self._accesses.get(self._provider_of(host_name) or "")
        return seats_for(access, host_name) if access is not None else []


class RoutedExecutor:
    """`RunExecutor` over the places' executors, in the team's order."""

    # Mixed: dispatch hands the cluster its runs itself (`cluster`) and schedules the rest.
    places = False

    def __init__(
        self,
        executors: Mapping[str, RunExecutor],
        provider_of: Callable[[str], str | None],
    ) -> None:
        if not executors:
            raise ValueError("no place runs anything")
        self.executors = dict(executors)
        self._first = next(iter(self.executors))
        self._provider_of = provider_of
        clusters = [(n, e) for n, e in self.executors.items() if e.places]
        if len(clusters) > 1:
            raise ValueError("one cluster at a time: " + ", ".join(n for n, _ in clusters))
        self.cluster: tuple[str, RunExecutor] | None = clusters[0] if clusters else None

    def _for_host(self, host: str) -> RunExecutor:
        return self.executors.get(self._provider_of(host) or "", self.executors[self._first])

    def of(self, placement: Mapping[str, Any]) -> RunExecutor:
        """The executor of the place the run was claimed on; by its host's provider for a
        placement from before places were named on it."""
        at = placement.get(AT)
        if isinstance(at, str) and at in self.executors:
            return self.executors[at]
        host = placement.get("host")
        if isinstance(host, str) and host:
            return self._for_host(host)
        if self.cluster is not None:
            return self.cluster[1]
        return self.executors[self._first]

    # --- RunExecutor, each call routed ------------------------------------------------

    def admit(self, request: PlaceRequest) -> str | None:
        """The first place's rules: a run waits there first (the team's order)."""
        return self.executors[self._first].admit(request)

    def runs_dir(self, host: str) -> Path | None:
        return self._for_host(host).runs_dir(host)

    def address(self, host: str) -> str:
        return self._for_host(host).address(host)

    def start(
        self, run: TrainingRun, placement: dict[str, Any], code: PrepareCode
    ) -> dict[str, Any]:
        return self.of(placement).start(run, placement, code)

    def stop_started(self, placement: dict[str, Any]) -> None:
        self.of(placement).stop_started(placement)

    def started(self, placement: dict[str, Any]) -> bool:
        return self.of(placement).started(placement)

    def orphan(self, placement: dict[str, Any]) -> dict[str, Any] | bool | None:
        return self.of(placement).orphan(placement)

    def look(self, placement: dict[str, Any]) -> Look:
        return self.of(placement).look(placement)

    def failed_node(self, placement: dict[str, Any]) -> str | None:
        return self.of(placement).failed_node(placement)

    def signal(self, placement: dict[str, Any], signal: str, *, others_only: bool = False) -> None:
        self.of(placement).signal(placement, signal, others_only=others_only)

    def tail(self, placement: dict[str, Any], lines: int) -> str:
        return self.of(placement).tail(placement, lines)

    def save_checkpoint(self, placement: dict[str, Any], local: Path) -> int:
        return self.of(placement).save_checkpoint(placement, local)

    def forget_attempt(self, placement: dict[str, Any]) -> None:
        self.of(placement).forget_attempt(placement)

    def tend(self, records: Any) -> None:
        for executor in self._distinct():
            executor.tend(records)

    def watch(self, run_id: int, placement: dict[str, Any], figures_due: bool) -> None:
        self.of(placement).watch(run_id, placement, figures_due)

    def keep_watching(self, run_ids: Iterable[int]) -> None:
        ids = list(run_ids)
        for executor in self._distinct():
            executor.keep_watching(ids)

    def ended_at(self, run_id: int, placement: dict[str, Any]) -> datetime | None:
        return self.of(placement).ended_at(run_id, placement)

    def free_mb(self, placement: dict[str, Any]) -> float | None:
        return self.of(placement).free_mb(placement)

    def watched(self, run_id: int, placement: dict[str, Any]) -> bool:
        return self.of(placement).watched(run_id, placement)

    def _distinct(self) -> list[RunExecutor]:
        seen: list[RunExecutor] = []
        for executor in self.executors.values():
            if all(executor is not other for other in seen):
                seen.append(executor)
        return seen
