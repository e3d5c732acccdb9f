"""What the use cases are written against, so that the arrows between them point one way.

`GpuService` (bot.app.service) is the core: reservations, the grant pass, usage metering and
the outbox. Runs (bot.app.runs), the host watch (bot.app.hosts.agentwatch), budgets (bot.app.money.budgets) and
the fleet build on it, and the core holds the runs and the fleet the runtime hangs on it.
Each side names what it needs of the other here, as a Protocol, instead of importing the
other's module: that mutual import was the `service ↔ runs ↔ fleet ↔ budgets ↔
agentwatch` cycle. `Actor`, the value every use case takes, lives here for the same
reason (bot.app.access and bot.app.money.budgets need it and sit below the service).

Sync code, no I/O here; the implementations are the real classes (GpuService, Fleet,
LocalAccess, bot.app.hosts.remote.RemoteAccess), whose tests use them directly.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from bot.domain.errors import UserError
from provisioning import shell

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from sqlalchemy.engine import Engine
    from sqlmodel import Session

    from bot.app.config import Settings
    from bot.app.money.history_trace import HistoryRun
    from bot.domain import views
    from bot.domain.clock import Clock
    from bot.domain.readmodels import HostState
    from bot.domain.scheduling import SchedulerConfig
    from db.models import Host, User
    from provisioning.hostshell import HostShell
    from provisioning.ssh import SshTarget


class GpuRef(Protocol):
    """A GPU as far as starting its clock needs: its id (a `db.models.Gpu`, or a plain
    row the grant pass read, so that no ORM object is loaded just to be pointed at)."""

    @property
    def id(self) -> int | None: ...


@dataclass(frozen=True)
class Actor:
    """Who is asking: their key (Slack id or shell name) and whether they are an admin."""

    key: str
    name: str
    admin: bool = False


# A cluster's run before its queue has said anything of it: handed over by dispatch, or
# submitted with no read of the queue since. The bursting offer waits for more (the
# cluster's own reason and expected start), and the plan never quotes these.
STAGE_HANDED = "handed to the cluster"
STAGE_SUBMITTED = "submitted to Slurm"
STAGES_UNREAD = frozenset({STAGE_HANDED, STAGE_SUBMITTED})


@dataclass(frozen=True)
class Interpreter:
    """The python that runs `training` on a host, and the directory holding that code when
    the python does not have it installed (the bootstrap's uploaded copy). Every command
    line that starts `python -m training.…` is built from it, so a host's interpreter is
    data handed out by the place that prepared the host, never a rewrite of a line."""

    python: str
    code_dir: str | None = None

    def module(self, module: str, *args: str) -> str:
        """`python -m module args` as one shell line (provisioning.shell quotes each word)."""
        return shell.join([self.python, "-m", module, *args])

    def env(self) -> dict[str, str]:
        """What the line needs in its environment: the code directory on PYTHONPATH."""
        return {"PYTHONPATH": self.code_dir} if self.code_dir else {}


def bot_python() -> Interpreter:
    """This machine as the bot runs it: the bot's own interpreter, `training` beside it."""
    return Interpreter(sys.executable)


@dataclass(frozen=True)
class HostSeat:
    """One host as the use cases reach it: the runner and its target, the directory where
    runs live there, and the interpreter for `training`. The interpreter is a function
    because preparing it may wait for first use (the local run account: a failure then
    fails that run or probe with the reason, and a log read never prepares anything);
    it may raise SshError saying why."""

    runner: HostShell
    target: SshTarget
    runs_dir: Path
    interpreter: Callable[[], Interpreter] = bot_python
    # The host's GPU index of each GPU this seat's commands see, in their order, where
    # they may see one job's GPUs alone, renumbered from 0 (a step inside a Slurm job on
    # a cluster with ConstrainDevices); empty: they see the host's own numbering.
    gpu_map: tuple[int, ...] = ()


class HostAccess(Protocol):
    """How to reach a host's shell: the local runner for this machine, SSH for the rest."""

    def runner_for(self, host_name: str) -> HostSeat | None:
        """The host's seat; None when it cannot be reached (or is not prepared) now."""
        ...


@runtime_checkable
class JobSeats(Protocol):
    """A host reached through the jobs on it (a cluster's node: a command runs as a step
    inside one job and may see that job's GPUs alone): a seat per job, so that every
    held GPU is seen (the utilization sampler)."""

    def seats_for(self, host_name: str) -> list[HostSeat]:
        """One seat per job of the bot's running there; empty when none runs now."""
        ...


def seats_for(access: HostAccess, host_name: str) -> list[HostSeat]:
    """Every seat that together sees the host's held GPUs: one per job where the access
    reaches a host through its jobs, else the host's one seat."""
    if isinstance(access, JobSeats):
        return access.seats_for(host_name)
    seat = access.runner_for(host_name)
    return [seat] if seat is not None else []


class Provisioner(Protocol):
    """Buys or starts an instance for a queued run (bot.app.fleet.Fleet, when a cloud
    provider is configured): the scheduler's Launch/Start, carried out by runs."""

    def provision_run(self, run_id: int, instance_type: str | None = None) -> str | None:
        """What was done, in words, or None when nothing was."""
        ...

    def cycle(self) -> None:
        """The worker's periodic pass: reconcile, provision, readiness, idle stop."""
        ...

    # --- for a run whose owner took the cloud's offer (bot.app.burst) ---

    def provision_for(
        self, run_id: int, instance_type: str, price_cap: float, *, in_cluster: bool
    ) -> str | None:
        """Buys for the run: `instance_type` first, nothing dearer a GPU-hour than
        `price_cap`; `in_cluster`: it still waits in a cluster's queue."""
        ...

    def give_back(self, kind: str, ref: int) -> bool:
        """Ends what was bought for a run ("run") or reservation ("res") that another place
        started first; True when done."""
        ...

    def pool_refusal(self, instance_type: str) -> str | None:
        """Why the pool's caps allow no more of `instance_type` now; None if one fits."""
        ...


class Supply(Protocol):
    """What the pool can have beyond the hosts it has now. A fixed pool (this machine,
    static SSH hosts) can have nothing more, so a request no host fits is refused up
    front; a cloud can launch a model its catalog sells, so such a request waits."""

    def can_have(self, model: str, gpus: int) -> bool:
        """True when `gpus` GPUs of `model` on one machine can be had later."""
        ...

    def can_run(self, model: str, gpus: int) -> bool:
        """True when a run of `gpus` GPUs of `model` can be had later, on one machine or
        on several of one type (a run spans hosts under torchrun; a reservation cannot)."""
        ...

    def offered(self) -> list[str]:
        """The GPU models the pool can grow into, sorted (none for a fixed pool): what a
        request that named no model is told to choose from when nothing runs yet."""
        ...


class FixedPool:
    """The Supply of a pool of hosts that never grows."""

    def can_have(self, model: str, gpus: int) -> bool:
        return False

    def can_run(self, model: str, gpus: int) -> bool:
        return False

    def offered(self) -> list[str]:
        return []


FIXED_POOL = FixedPool()


@dataclass(frozen=True)
class PlaceRequest:
    """A reservation or run as its place is asked to admit it, before it is put in line."""

    user_key: str  # the person (Slack id, or the shell's name)
    gpus: int
    model: str | None
    seconds: int | None  # None: not said (a run without --max)
    place: Mapping[str, str]  # Reserve.place / Run.place: partition, account, qos, constraint
    kind: str = "reservation"  # or "run"


def refuse_place_options(request: PlaceRequest) -> str | None:
    """Where nothing but a cluster takes place options: a request that names one is
    refused with this line (a silent no-op would be a run somewhere it was not asked)."""
    if not request.place:
        return None
    flags = ", ".join(f"`--{name}`" for name in request.place)
    raise UserError(
        f"{flags} is for a Slurm cluster, and this bot's GPUs are not on one: "
        "leave it out and ask again."
    )


class Holder(Protocol):
    """How GPUs are held for a reservation and let go where a cluster's own scheduler
    grants them (a Slurm holding job). The grant pass grants what gpubot grants itself;
    a reservation for a cluster's GPUs is handed to its holder, which grants it when the
    cluster does. Every call is made outside a transaction: a cluster answers slowly,
    or not at all while its controller is down."""

    def admit(self, request: PlaceRequest) -> str | None:
        """Checks a reservation before it is put in line: raises UserError when the place
        will not take it as asked (the person is not allowed there, no partition allows
        it); returns a note for the reply, or None."""
        ...

    def hold(self, reservation_id: int) -> str | None:
        """A reservation just put in line (committed): handed to the cluster when it has
        such GPUs, perhaps granted at once; returns what its reply adds (the job, the
        cluster's reason, its expected start), or None when it is not the cluster's."""
        ...

    def let_go(self, reservation_ids: Sequence[int]) -> None:
        """Reservations that just ended (released, expired): their holding jobs end."""
        ...

    def extend(self, reservation_id: int, total_s: int) -> None:
        """Its holding job may run `total_s` in all; raises UserError when the cluster
        refuses (the reservation is then left as it was)."""
        ...

    def sync(self) -> int:
        """The tick's look at the cluster: a holding job that runs grants its reservation
        (with a DM), one that ended ends it, one not yet submitted (the controller was
        down) is submitted, one whose reservation ended is cancelled. Returns how many
        reservations changed."""
        ...


class NoHolder:
    """The Holder of a pool gpubot grants itself: nothing is held elsewhere."""

    def admit(self, request: PlaceRequest) -> str | None:
        return refuse_place_options(request)

    def hold(self, reservation_id: int) -> str | None:
        return None

    def let_go(self, reservation_ids: Sequence[int]) -> None:
        return None

    def extend(self, reservation_id: int, total_s: int) -> None:
        return None

    def sync(self) -> int:
        return 0


class HostDisplay(Protocol):
    """How the providers' hosts read in replies: each provider words its own."""

    def note(self, host: HostState) -> str | None:
        """A word on a host in /gpu status (a CPU-only server, a Slurm node's state), or None."""
        ...

    def called(self, host_name: str, provider: str) -> str:
        """What a sentence calls the host: "this machine" for the local one, else its name."""
        ...

    def empty_pool(self) -> str:
        """What /gpu status says when there is no host at all."""
        ...

    def status_lines(self) -> list[str]:
        """What /gpu status says of the providers themselves (a cluster controller that
        does not answer), under its hosts."""
        ...

    def cost_note(self) -> str | None:
        """What /gpu cost adds about prices (a cluster's rate not set), or None."""
        ...


class PlainDisplay:
    """Hosts read as their names, with no notes: a runtime with no provider's words
    (tests of the use cases alone), and the words a provider does not change (each
    provider inherits these and words only what is its own)."""

    def note(self, host: HostState) -> str | None:
        return None

    def called(self, host_name: str, provider: str) -> str:
        return host_name

    def empty_pool(self) -> str:
        return "No hosts are configured."

    def status_lines(self) -> list[str]:
        return []

    def cost_note(self) -> str | None:
        return None


class Core(Protocol):
    """The part of `GpuService` that runs, the host watch and budgets use: its engine,
    settings and clock, users, GPU holdings and the outbox; and the fleet of the place
    that buys machines, if any (bot.app.places)."""

    def place_lines(self, hosts: Sequence[HostState]) -> list[str]:
        """Where several places are: each, in the team's order, with what is free there."""
        ...

    @property
    def engine(self) -> Engine: ...

    @property
    def settings(self) -> Settings: ...

    @property
    def clock(self) -> Clock: ...

    @property
    def fleet(self) -> Provisioner | None: ...

    @property
    def supply(self) -> Supply: ...

    @property
    def display(self) -> HostDisplay: ...

    @property
    def holder(self) -> Holder: ...

    def user_row(
        self, s: Session, key: str, name: str | None = None, *, rename: bool = False
    ) -> User:
        """The user with this key, created on first sight (named `name`); renamed only
        with `rename` (GpuService.user_row)."""
        ...

    def gpu_count(self, s: Session, host_id: int) -> int:
        """How many GPUs the host has now (its price is shared among them)."""
        ...

    def open_usage(
        self,
        s: Session,
        host: Host,
        gpus: Sequence[GpuRef],
        user_id: int,
        now: datetime,
        *,
        reservation_id: int | None = None,
        run_id: int | None = None,
        gpu_count: int | None = None,
        usd_per_gpu_hour: float | None = None,
    ) -> None:
        """Starts the clock on these GPUs for a reservation or a run; `gpu_count` is the
        host's present GPUs when the caller has counted them already; `usd_per_gpu_hour`
        a price of the use itself (a cluster's rate) instead of a share of the host's."""
        ...

    def grant_pass(self, s: Session, now: datetime) -> int:
        """Grants waiting reservations while GPUs allow; returns how many."""
        ...

    def notify_dm(
        self,
        s: Session,
        user_key: str,
        view: views.View,
        now: datetime,
        dedupe: str | None,
        attachment: tuple[str, bytes] | None = None,
    ) -> None:
        """Queues a DM in the caller's transaction."""
        ...

    def nudge(self) -> None:
        """Asks this process's worker for a tick now (GpuService.nudge)."""
        ...


# --- the week's replay (bot.app.money.advice) -------------------------------------------------


@dataclass(frozen=True)
class ReplayOutcome:
    """What one replay costs and how long its runs waited (the simulator's figures)."""

    usd: float  # every simulated instance's bill
    avg_queue_s: float
    p95_queue_s: float
    jobs: int  # runs that ran (a run the quota can never fit is left out)
    rejected: int


class Replayer(Protocol):
    """Replays runs through the scheduler on a simulated cloud under `config`.

    Why a port: the simulator (bot.sim) is a sibling of the app that only the faces may
    import; the digest's advice asks it "what if" with one setting changed, and the
    faces hand it the real one (bot.faces.replay)."""

    def __call__(
        self,
        jobs: Sequence[HistoryRun],
        config: SchedulerConfig,
        *,
        ebs_gb: float,
        ebs_usd_gb_month: float,
    ) -> ReplayOutcome: ...
