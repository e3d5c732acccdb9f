"""What every part of the run service shares: its ports and settings (RunContext), how
this machine's runs are reached (LocalAccess), the fleet as plain columns, and the
scheduler's view of a booting or stopped host. The parts (submit, board, dispatch,
poll, records) each hold one RunContext; bot.app.runs.RunService composes them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import func
from sqlmodel import Session, col, select

from bot.app.access import RunGate, StaticMembership
from bot.app.config import Settings
from bot.app.ports import Core, HostAccess, HostSeat, Interpreter, bot_python
from bot.app.runs.executor import RunExecutor
from bot.app.runs.processes import ProcessExecutor
from bot.app.runs.routed import RoutedExecutor
from bot.app.runs.starts import OffTickStarts
from bot.domain.scheduling import LAS_AFTER_S, FleetInstance, InstanceState, SchedulerConfig
from db.models import HOST_PENDING, HOST_STOPPED, Gpu, Host
from provisioning.catalog import Catalog
from provisioning.hostshell import HostShell
from provisioning.ssh import SshTarget

log = logging.getLogger(__name__)

RECIPES = ("digits",)
# A run claimed but not started within this long is presumed orphaned by a crash.
STARTING_GRACE = timedelta(seconds=90)
USAGE_RUN = "/gpu run [--gpus N] [--gpu MODEL] [--precision auto|bf16|fp16|fp32] [--max DURATION] [--spot] [--git URL[@REF] | --path DIR] [--recipe NAME [--lr LR] [--batch-size N] [--epochs N] [--sweep lr=V1,V2]] -- COMMAND"


@dataclass
class RunContext:
    """The ports and knobs the parts share. `gate` and `allow_file_git` are set after
    construction (the Slack app puts in a gate that knows user groups; tests allow
    file:// git URLs), so the parts read them here rather than copying them."""

    core: Core
    access: HostAccess
    catalog: Catalog
    config: SchedulerConfig
    gate: RunGate
    # Where claimed runs run (bot.app.runs.executor): process groups on the hosts that
    # `access` reaches, or a cluster's batch jobs when the provider gives that executor.
    executor: RunExecutor
    # Why runs are not accepted here at all (`gpubot serve` on this machine without
    # GPUBOT_RUN_AS), or None: submit says it, dispatch starts nothing, and what ran
    # already is still polled and shown.
    refusal: str | None = None
    # file:// git URLs: tests only (a bare repository in tmp); never in production.
    allow_file_git: bool = False
    # Starts that upload code, off the tick (bot.app.runs.starts): dispatch hands them
    # out, poll leaves a run alone while its start is in flight.
    starts: OffTickStarts = field(default_factory=OffTickStarts)
    # Owned places and a cloud after them (bot.app.places.Places.bursting): the cloud is
    # bought for a run only once its owner took the offer (bot.app.burst).
    bursting: bool = False

    @property
    def engine(self) -> Any:
        return self.core.engine

    @property
    def cluster(self) -> tuple[str, RunExecutor] | None:
        """The place whose own scheduler places runs (a Slurm cluster), by name ("" for the
        only place), or None: gpubot's scheduler places every run."""
        if isinstance(self.executor, RoutedExecutor):
            return self.executor.cluster
        return ("", self.executor) if self.executor.places else None

    @property
    def schedules(self) -> bool:
        """Whether gpubot's own scheduler places runs on some place's hosts."""
        return isinstance(self.executor, RoutedExecutor) or not self.executor.places

    @property
    def run_places(self) -> frozenset[str] | None:
        """The places runs may be placed at, by name, where several are routed (the hosts
        of a place that refuses runs are not among them); None: every host's."""
        if isinstance(self.executor, RoutedExecutor):
            return frozenset(self.executor.executors)
        return None

    def places_itself(self, placement: dict[str, Any]) -> bool:
        """Whether the place a run was claimed on places it itself (a cluster)."""
        if isinstance(self.executor, RoutedExecutor):
            return self.executor.of(placement).places
        return self.executor.places

    @classmethod
    def build(
        cls,
        core: Core,
        access: HostAccess,
        catalog: Catalog,
        refusal: str | None = None,
        executor: RunExecutor | None = None,
        bursting: bool = False,
    ) -> RunContext:
        return cls(
            bursting=bursting,
            core=core,
            access=access,
            catalog=catalog,
            config=scheduler_config(core.settings, catalog),
            gate=RunGate(core.settings, StaticMembership()),
            refusal=refusal,
            executor=executor or ProcessExecutor(access, core.clock, core.nudge),
        )


@dataclass
class LocalAccess:
    """This machine only: runs live under $GPUBOT_HOME/runs (or the run account's home),
    started with the bot's interpreter unless `interpreter` names another (the run
    account's, bot.faces.runtime, prepared on first use)."""

    runner: HostShell
    target: SshTarget
    runs_dir: Path
    interpreter: Callable[[], Interpreter] = bot_python

    def runner_for(self, host_name: str) -> HostSeat | None:
        if host_name != self.target.name:  # the one host it reaches: this machine
            return None
        return HostSeat(self.runner, self.target, self.runs_dir, self.interpreter)


@dataclass(frozen=True)
class FleetHost:
    """What the queue needs of a host that is not terminated: plain columns and its
    present GPUs counted by model, not ORM objects (the queue and App Home read the
    whole fleet on every call; building a Host and eight Gpu objects per host was most
    of their time at a hundred hosts)."""

    id: int
    name: str
    state: str
    hourly_usd: float
    created_at: datetime | None
    down_since: datetime | None
    down_reason: str | None
    models: dict[str, int]  # present GPUs by model, models sorted
    # The scheduler's instance type (its type, or its provider for a static host): a run
    # over several hosts takes hosts of one kind.
    kind: str = ""
    # Its place (its provider's name).
    provider: str = ""

    @property
    def gpus(self) -> int:
        return sum(self.models.values())


def read_fleet(s: Session) -> list[FleetHost]:
    """Every host not terminated, by name (the database's collation, as the down hosts
    are listed), with its present GPUs by model: two queries of plain columns whatever
    the size of the fleet."""
    host_columns: tuple[Any, ...] = (
        Host.id,
        Host.name,
        Host.state,
        Host.hourly_usd,
        Host.created_at,
        Host.down_since,
        Host.down_reason,
        Host.instance_type,
        Host.provider,
    )
    hosts = s.exec(
        select(*host_columns).where(Host.state != "terminated").order_by(col(Host.name))
    ).all()
    counts: dict[int, dict[str, int]] = {}
    gpu_columns: tuple[Any, ...] = (Gpu.host_id, Gpu.model, func.count())
    for host_id, model, n in s.exec(
        select(*gpu_columns)
        .where(col(Gpu.present).is_(True))
        .group_by(col(Gpu.host_id), col(Gpu.model))
    ):
        counts.setdefault(host_id, {})[model] = int(n)
    return [
        FleetHost(
            id=hid,
            name=name,
            state=state,
            hourly_usd=hourly,
            created_at=created,
            down_since=down_since,
            down_reason=reason,
            models=dict(sorted(counts.get(hid, {}).items())),
            kind=itype or provider,
            provider=provider,
        )
        for hid, name, state, hourly, created, down_since, reason, itype, provider in hosts
    ]


def scheduler_config(settings: Settings, catalog: Catalog) -> SchedulerConfig:
    """The worker's scheduler knobs from Settings, so that `gpubot simulate` and the worker
    can be run with the same ones: idle stop and terminate as the fleet applies them, the
    stopped volume's price, and a quota no larger than the pools allow (each type's
    instance cap times its GPUs, the largest; bot.app.fleet enforces the exact caps when it
    buys). No run time is known here, so least attained service is on (LAS_AFTER_S)."""
    biggest = max((t.gpus for t in catalog.types), default=8)
    ebs_usd_s = settings.ebs_gb * settings.ebs_usd_gb_month / (730.0 * 3600.0)
    return SchedulerConfig(
        policy="fair",
        max_gpus=max(1, settings.pool_max_instances * biggest),
        idle_stop_s=settings.idle_stop_after.total_seconds(),
        terminate_after_s=settings.terminate_after.total_seconds(),
        ebs_usd_s=ebs_usd_s,
        las_after_s=LAS_AFTER_S,
    )


def host_view(
    *,
    name: str,
    state: str,
    instance_type: str | None,
    market: str,
    usd_hr: float,
    since_s: float,
    restarted: bool,
    now: float,
    catalog: Catalog,
    config: SchedulerConfig,
) -> FleetInstance | None:
    """A booting or stopped instance as the scheduler sees it, from its host row.

    Why: a scheduler that sees only ready hosts launches again for every run queued while
    the first instance boots (the simulator, which sees the booting one, waits for it).
    `since_s` is when it entered its state (its open billed period's start). A pending
    host launched then is usable boot + setup later; one restarted then (`restarted`: it
    was ready before, so it is set up) is usable `start_s` later, as the simulator's cloud
    restarts one, and not at once. A stopped one has been stopped since `since_s`. Its
    GPUs come from the catalog (the host reports them only once it is up); a type the
    catalog does not know is left out."""
    t = catalog.get(instance_type) if instance_type else None
    if t is None:
        return None
    st: InstanceState
    if state == HOST_PENDING:
        st = "pending"
        boot = config.start_s if restarted else config.boot_s + config.setup_s
        ready = max(now, since_s + boot)
        stopped_since = None
    elif state == HOST_STOPPED:
        st, ready, stopped_since = "stopped", since_s, since_s
    else:
        return None
    return FleetInstance(
        instance_id=name,
        instance_type=t.instance_type,
        gpu_model=t.gpu_model,
        gpus=t.gpus,
        usd_hr=usd_hr or t.ondemand_usd_hr,
        market="spot" if market == "spot" else "ondemand",
        state=st,
        ready_at_s=ready,
        stopped_since_s=stopped_since,
    )
