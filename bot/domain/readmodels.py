"""Read models that cross from the service to the views: plain frozen data, built
from the database inside a transaction and safe to use after it closed."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from functools import cached_property


@dataclass(frozen=True)
class GpuState:
    gpu_id: int
    index: int
    model: str
    memory_gb: float
    # Who holds it now (display name), through which reservation, until when.
    holder: str | None = None
    holder_key: str | None = None
    reservation_id: int | None = None
    run_id: int | None = None
    until: datetime | None = None


@dataclass(frozen=True)
class HostState:
    name: str
    provider: str
    state: str
    address: str
    ssh_user: str
    ssh_port: int
    market: str
    hourly_usd: float
    gpus: tuple[GpuState, ...]
    # Set while bot.app.hosts.hostcheck has it marked down: since when, and why in words.
    down_since: datetime | None = None
    down_reason: str | None = None
    # Its provider's word on it in /gpu status ("CPU only: …"), or None.
    note: str | None = None

    @cached_property
    def free(self) -> int:
        """GPUs someone could be given now: only a ready host's count; a booting,
        stopped or unreachable host's GPUs are not free, whoever holds them."""
        if self.state != "ready":
            return 0
        return sum(1 for g in self.gpus if g.holder is None)


@dataclass(frozen=True)
class ReservationInfo:
    id: int
    user_key: str
    user_name: str
    state: str
    gpu_model: str | None
    gpu_count: int
    duration_s: int
    requested_at: datetime
    granted_at: datetime | None = None
    ends_at: datetime | None = None
    ended_at: datetime | None = None
    # Filled when active: where and which devices.
    host: HostState | None = None
    gpu_indexes: tuple[int, ...] = ()
    gpu_models: tuple[str, ...] = ()
    # Filled when waiting: 1-based place in line.
    position: int | None = None
    # How to use what it holds, where its provider says (a cluster's holding job: the
    # `srun --jobid` line); empty: the host's SSH login and CUDA_VISIBLE_DEVICES.
    how: tuple[str, ...] = ()


# Host states whose GPUs are on their way: an instance booting, a declared host that has
# not answered its first check yet.
_STARTING = ("pending", "checking")


@dataclass(frozen=True)
class FleetCounts:
    """The fleet in the counts `/gpu status` sums up in its first line: hosts that are
    ready and their GPUs (all present, and free), GPUs starting up, GPUs away (stopped
    or unreachable). Home reads these grouped in the database instead of a row per GPU."""

    ready_hosts: int = 0
    ready_gpus: int = 0
    free_gpus: int = 0
    starting_gpus: int = 0
    away_gpus: int = 0

    @staticmethod
    def of(hosts: tuple[HostState, ...]) -> FleetCounts:
        """The counts of hosts already read GPU by GPU (the status view's own)."""
        ready = [h for h in hosts if h.state == "ready"]
        return FleetCounts(
            ready_hosts=len(ready),
            ready_gpus=sum(len(h.gpus) for h in ready),
            free_gpus=sum(h.free for h in ready),
            starting_gpus=sum(len(h.gpus) for h in hosts if h.state in _STARTING),
            away_gpus=sum(len(h.gpus) for h in hosts if h.state not in ("ready", *_STARTING)),
        )


@dataclass(frozen=True)
class HomeSnapshot:
    """What App Home shows of the pool: the status's first line (from counts), the
    waiting line and the caller's open reservations, read as the status reads them
    but without a row per GPU; and the caller's cost this week."""

    now: datetime
    fleet: FleetCounts
    waiting: tuple[ReservationInfo, ...]
    mine: tuple[ReservationInfo, ...]
    week_usd: Decimal = Decimal(0)
    tz: str = "UTC"


@dataclass(frozen=True)
class StatusSnapshot:
    now: datetime
    hosts: tuple[HostState, ...]
    waiting: tuple[ReservationInfo, ...]
    mine: tuple[ReservationInfo, ...]
    mine_only: bool = False
    # What an empty pool means on the configured providers (a cloud launches on demand,
    # so "no hosts" there is the normal state before the first request, not a fault).
    empty_pool: str = "No hosts are configured."
    # What the providers say of themselves (a cluster controller that does not answer).
    notes: tuple[str, ...] = ()
    # The team's time zone, for every time shown (bot.domain.timefmt).
    tz: str = "UTC"
