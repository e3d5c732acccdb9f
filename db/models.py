"""Every table gpubot keeps. The database is the bot's only memory: a process may
die at any line, so each state change and the notifications it causes are
written in one transaction (the outbox pattern), and the usage intervals are
the ground truth that every cost is computed from.

State names are plain strings (listed beside each column) so that a migration is
never needed to add one; the service owns their meaning.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Index,
    LargeBinary,
    Text,
    UniqueConstraint,
    text,
)
from sqlmodel import Field, SQLModel

from db.types import UTCDateTime

# Reservation states.
RES_WAITING = "waiting"  # in line for GPUs
RES_ACTIVE = "active"  # holds GPUs until ends_at
RES_RELEASED = "released"  # given back by its holder or an admin
RES_EXPIRED = "expired"  # reached ends_at
RES_CANCELLED = "cancelled"  # released while still waiting
RES_OPEN_STATES = (RES_WAITING, RES_ACTIVE)

# Training run states.
RUN_QUEUED = "queued"  # in line for the scheduler
RUN_STARTING = "starting"  # claimed with its GPUs; being started on its host
RUN_RUNNING = "running"
RUN_CANCELLING = "cancelling"  # asked to stop; its process may still be alive
RUN_SUCCEEDED = "succeeded"
RUN_FAILED = "failed"
RUN_CANCELLED = "cancelled"
# A process of the run is (or is about to be) on its host, holding its GPUs.
RUN_ON_HOST = (RUN_STARTING, RUN_RUNNING, RUN_CANCELLING)
RUN_OPEN_STATES = (RUN_QUEUED, *RUN_ON_HOST)

# Host states.
HOST_READY = "ready"
HOST_PENDING = "pending"
HOST_STOPPED = "stopped"
HOST_TERMINATED = "terminated"
HOST_UNREACHABLE = "unreachable"
# The states in which a rented instance is billed as running and counts against the pool.
HOST_BILLED_RUNNING = (HOST_READY, HOST_PENDING, HOST_UNREACHABLE)
# A cluster's node: its scheduler grants its GPUs, not gpubot's grant pass (Host.market).
MARKET_CLUSTER = "cluster"
# A host the team declared that has not answered its first check yet (bot.app.hosts.hostcheck):
# nothing is granted or placed on it until it has.
HOST_CHECKING = "checking"


def _ts(nullable: bool = False) -> Any:
    return Field(default=None, sa_type=UTCDateTime, nullable=nullable)


class User(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    # Slack user id (U…), or the name typed in the shell; unique per workspace.
    key: str = Field(unique=True, index=True, max_length=64)
    display_name: str = Field(max_length=128)
    # "member" or "admin" (admins also come from config; either suffices).
    role: str = Field(default="member", max_length=16)
    # Spend limit per budget_period in USD; None means no limit.
    budget_usd: float | None = None
    budget_period: str = Field(default="week", max_length=8)
    created_at: datetime = _ts()
    # An admin's word on the cloud for this person's runs (bot.app.burst): "ok" (offers
    # taken in advance, within budget) or "never" (never offered); None: offered, asked.
    cloud: str | None = Field(default=None, max_length=8)


class Host(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    # Unique, human-readable name shown in status ("local", "gpu-box-1", "i-0abc…").
    name: str = Field(unique=True, index=True, max_length=128)
    # Which provider manages it: local, ssh, aws, sim.
    provider: str = Field(max_length=16)
    # The cloud's id for it (EC2 instance id); None for machines we do not rent.
    instance_id: str | None = Field(default=None, unique=True, max_length=64)
    instance_type: str | None = Field(default=None, max_length=64)
    # "ondemand", "spot", or "owned" (on-prem and this machine: no hourly bill), or
    # "cluster": a cluster's node, whose GPUs its own scheduler grants (a reservation is a
    # holding job there, a run a batch job): no hourly bill, each use priced at the
    # team's rate for its model.
    market: str = Field(default="owned", max_length=16)
    # ready, pending, checking, stopped, terminated, unreachable.
    state: str = Field(default=HOST_READY, max_length=16)
    # Where SSH reaches it (host name or address) and as whom; empty for the local host.
    address: str = Field(default="", max_length=255)
    ssh_user: str = Field(default="", max_length=64)
    ssh_port: int = 22
    # What the whole host costs per hour while running, in USD (0 for owned).
    hourly_usd: float = 0.0
    # Cloud tags as read back (gpubot:managed, gpubot:owner, …).
    tags: dict[str, str] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    created_at: datetime = _ts()
    updated_at: datetime = _ts()
    # When it last became ready (its bootstrap done, or SSH answering again after a
    # restart); None until then. An instance is idle from here, not from its launch: the
    # idle stop and the scheduler's idle times count as the simulator does, so a
    # never-used instance is not stopped sooner for having booted slowly.
    ready_at: datetime | None = _ts(nullable=True)
    # Health of an SSH host (bot.app.hosts.hostcheck): since when it has not answered (None: it
    # does), why in words ("unreachable: …", "setup failed: …"), how many checks in a
    # row failed, and when the next one may dial it (backing off while it fails).
    down_since: datetime | None = _ts(nullable=True)
    down_reason: str | None = Field(default=None, max_length=300)
    check_failures: int = 0
    next_check_at: datetime | None = _ts(nullable=True)


class Gpu(SQLModel, table=True):
    __table_args__ = (UniqueConstraint("host_id", "index", name="uq_gpu_host_index"),)

    id: int | None = Field(default=None, primary_key=True)
    host_id: int = Field(foreign_key="host.id", index=True)
    # The device index on its host (what CUDA_VISIBLE_DEVICES names).
    index: int
    # Normalized model name ("A100", "H100", …, or "cpu" for a CPU slot).
    model: str = Field(max_length=32)
    memory_gb: float = 0.0
    # False once the host no longer reports it; kept for history.
    present: bool = True
    # Held outside gpubot (a cluster job of someone else's): who, in the cluster's words
    # ("bob, Slurm job 123"); None when free or held through gpubot.
    held_by: str | None = Field(default=None, max_length=128)


class Reservation(SQLModel, table=True):
    __table_args__ = (
        # A person's live reservations (status, App Home, a new reservation's checks) as
        # one range of this index, not every reservation the person ever made; it serves
        # the lookups by person alone as well.
        Index("ix_reservation_user_state", "user_id", "state"),
    )

    id: int | None = Field(default=None, primary_key=True)
    user_id: int = Field(foreign_key="user.id")  # indexed with state (above)
    # What was asked for: a model (None = any) and a count, for how long.
    gpu_model: str | None = Field(default=None, max_length=32)
    gpu_count: int = 1
    duration_s: int
    # waiting, active, released, expired, cancelled.
    state: str = Field(default=RES_WAITING, index=True, max_length=16)
    requested_at: datetime = _ts()
    granted_at: datetime | None = _ts(nullable=True)
    ends_at: datetime | None = _ts(nullable=True)
    ended_at: datetime | None = _ts(nullable=True)
    # When the "ends in 10 minutes" DM went out, so it goes out once.
    warned_at: datetime | None = _ts(nullable=True)
    # Idle detection: when the holder was asked "Keep or Release?" about idle GPUs (None:
    # not asked, or answered), and until when a "Keep" answer silences the question.
    idle_prompted_at: datetime | None = _ts(nullable=True)
    idle_keep_until: datetime | None = _ts(nullable=True)
    host_id: int | None = Field(default=None, foreign_key="host.id")
    # Idempotency key of the request that created it (a retried Slack delivery
    # carries the same key and must not create a second reservation).
    request_key: str | None = Field(default=None, unique=True, max_length=128)
    # Where a cluster holds it: its holding job (id, state, Slurm's reason and expected
    # start, node); empty where gpubot grants it itself.
    external: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    # Where a cluster is to hold it, as its owner asked (`--partition`, `--account`,
    # `--qos`, `--constraint`; bot.providers.slurm checks them): name -> value.
    place: dict[str, str] = Field(
        default_factory=dict,
        sa_column=Column(JSON, nullable=False, server_default=text("'{}'")),
    )


class TrainingRun(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    user_id: int = Field(foreign_key="user.id", index=True)
    # What to run: a shell command, or a built-in recipe name.
    command: str = Field(default="", sa_column=Column(Text, nullable=False))
    recipe: str | None = Field(default=None, max_length=64)
    # Where the code comes from: "git:<url>@<ref>", "path:<dir on host>", "staged:<id>".
    source: str = Field(default="", max_length=1024)
    gpu_count: int = 1
    gpu_model: str | None = Field(default=None, max_length=32)
    # auto, bf16, fp16, fp32 as asked; the runner reports what it chose in metrics.
    precision: str = Field(default="auto", max_length=8)
    spot: bool = False
    # The owner's command checkpoints on SIGTERM and resumes (--checkpoints): movable.
    checkpoints: bool = False
    max_seconds: int | None = None
    priority: int = 0
    # queued, starting, running, succeeded, failed, cancelled, interrupted.
    state: str = Field(default="queued", index=True, max_length=16)
    host_id: int | None = Field(default=None, foreign_key="host.id")
    # Placement details: GPU ids and indexes per host, the remote paths.
    placement: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    submitted_at: datetime = _ts()
    started_at: datetime | None = _ts(nullable=True)
    finished_at: datetime | None = _ts(nullable=True)
    exit_code: int | None = None
    # The runner's last status document and final summary (accuracy, loss, …).
    metrics: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    request_key: str | None = Field(default=None, unique=True, max_length=128)
    # A recipe's own settings as asked (`--lr`, `--batch-size`, `--epochs`), passed to the
    # runner; a sweep variant holds its value here too.
    options: dict[str, Any] = Field(
        default_factory=dict,
        sa_column=Column(JSON, nullable=False, server_default=text("'{}'")),
    )
    # The sweep this run is a variant of (`/gpu run --sweep`): one label for the group.
    sweep: str | None = Field(default=None, index=True, max_length=32)
    # Where a cluster is to run it, as its owner asked (see Reservation.place).
    place: dict[str, str] = Field(
        default_factory=dict,
        sa_column=Column(JSON, nullable=False, server_default=text("'{}'")),
    )
    # `--cloud ok|never` (bot.app.burst): the cloud accepted in advance, or never offered;
    # None: offered, priced, once the wait passes GPUBOT_BURST_AFTER.
    cloud: str | None = Field(default=None, max_length=8)


class UsageInterval(SQLModel, table=True):
    """Who held which GPU from when to when, at what rate: costs come from here only.

    At most one interval per GPU is open (ended_at NULL) at a time; a partial
    unique index makes the database itself refuse a GPU held twice.
    """

    __table_args__ = (
        Index(
            "uq_usage_open_gpu",
            "gpu_id",
            unique=True,
            sqlite_where=text("ended_at IS NULL"),
            postgresql_where=text("ended_at IS NULL"),
        ),
        # Costs' window edges and rebuilds: the closed intervals that end after an instant.
        Index("ix_usageinterval_ended_started", "ended_at", "started_at"),
        # A host's intervals, and its last use (the latest end: dispatch's idle hosts, the
        # idle stop) read as the last entry of the host's range, not from all its rows.
        Index("ix_usageinterval_host_ended", "host_id", "ended_at"),
    )

    id: int | None = Field(default=None, primary_key=True)
    gpu_id: int = Field(foreign_key="gpu.id", index=True)
    host_id: int = Field(foreign_key="host.id")  # indexed with ended_at (above)
    user_id: int = Field(foreign_key="user.id", index=True)
    reservation_id: int | None = Field(default=None, foreign_key="reservation.id", index=True)
    run_id: int | None = Field(default=None, foreign_key="trainingrun.id", index=True)
    started_at: datetime = _ts()
    ended_at: datetime | None = _ts(nullable=True)
    # This GPU's share of the host's hourly price when the interval opened, and its market.
    usd_per_hour: float = 0.0
    market: str = Field(default="owned", max_length=16)


class Notification(SQLModel, table=True):
    """The outbox: written in the same transaction as the change it reports,
    delivered later by the worker, marked sent once. A crash between the two
    loses nothing; `dedupe_key` keeps a retried change from notifying twice."""

    __table_args__ = (
        # The outbox's question is "what is unsent", a few rows among every message ever
        # sent: a partial index holds only those.
        Index(
            "ix_notification_unsent",
            "id",
            sqlite_where=text("sent_at IS NULL"),
            postgresql_where=text("sent_at IS NULL"),
        ),
    )

    id: int | None = Field(default=None, primary_key=True)
    # "dm" (target is a user key), "channel" (target is a channel name or id), or "edit"
    # (a new text for the DM `edit_of` points at; target is its user key).
    kind: str = Field(max_length=16)
    target: str = Field(max_length=128)
    # Plain-text fallback, and the message as a view document (bot.domain.views) to render.
    text: str = Field(sa_column=Column(Text, nullable=False))
    view: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    created_at: datetime = _ts()
    # Not before this time (rate limits, back-off).
    deliver_after: datetime = _ts()
    sent_at: datetime | None = _ts(nullable=True)
    attempts: int = 0
    last_error: str | None = Field(default=None, max_length=500)
    dedupe_key: str | None = Field(default=None, unique=True, max_length=200)
    # A file that goes with the message (a chart PNG), kept in the row itself so that any
    # replica can deliver it; Slack gets it through the two-step external upload.
    attachment: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
    attachment_name: str | None = Field(default=None, max_length=128)
    # What is known of the delivery, so that any process (a restart, another replica) tells
    # a maybe-sent message from one never sent without guessing: the conversation an attempt
    # went to and when it started (committed before the call, cleared when Slack refused
    # it), Slack's ts once the message is known to exist, and the same two facts for the
    # attachment's upload (bot.app.outbox.DeliveryLog).
    attempt_channel: str | None = Field(default=None, max_length=128)
    attempt_started_at: datetime | None = _ts(nullable=True)
    posted_ts: str | None = Field(default=None, max_length=32)
    upload_started_at: datetime | None = _ts(nullable=True)
    uploaded_at: datetime | None = _ts(nullable=True)
    # An edit of an earlier notification (its id): the run's live message, updated in
    # place with chat.update where that message was posted; None for a new message.
    edit_of: int | None = Field(default=None, index=True)


class SlackConversation(SQLModel, table=True):
    """Where a notification target lives in Slack (a channel name's id, a user's DM
    channel), learnt once and kept: a restarted process must know where a maybe-sent
    post went, and conversations.history takes only ids."""

    # "channel" (name is the channel name without '#') or "dm" (name is the user key).
    kind: str = Field(primary_key=True, max_length=16)
    name: str = Field(primary_key=True, max_length=128)
    channel_id: str = Field(max_length=32)
    resolved_at: datetime = _ts()


class DeliveryPause(SQLModel, table=True):
    """Slack answered 429: nobody calls it again before `until` (its Retry-After).
    Stored so that every deliverer, and the next process after a restart, waits too."""

    name: str = Field(primary_key=True, max_length=32)
    until: datetime = _ts()
    reason: str = Field(default="", max_length=200)


class WorkerLock(SQLModel, table=True):
    """Leader lease for the worker where advisory locks do not exist (SQLite)."""

    name: str = Field(primary_key=True, max_length=64)
    holder: str = Field(max_length=128)
    expires_at: datetime = _ts()


class HostPeriod(SQLModel, table=True):
    """One stretch of a host's own bill in one state: the instances' side of every cost.

    A new row opens whenever a host starts running, is stopped, or changes price; the
    previous one closes at that instant. Idle overhead is the running GPU time no usage
    interval covers, plus stopped storage (bot.domain.metering). At most one row per host is
    open; a partial unique index makes the database refuse a second.
    """

    __table_args__ = (
        Index(
            "uq_hostperiod_open_host",
            "host_id",
            unique=True,
            sqlite_where=text("ended_at IS NULL"),
            postgresql_where=text("ended_at IS NULL"),
        ),
        Index("ix_hostperiod_ended_started", "ended_at", "started_at"),
    )

    id: int | None = Field(default=None, primary_key=True)
    host_id: int = Field(foreign_key="host.id", index=True)
    # "running" (billed at usd_per_hour) or "stopped" (billed for storage only).
    state: str = Field(max_length=16)
    started_at: datetime = _ts()
    ended_at: datetime | None = _ts(nullable=True)
    # GPU slots the running price is split over.
    gpus: int = 0
    usd_per_hour: float = 0.0
    storage_usd_per_hour: float = 0.0
    market: str = Field(default="owned", max_length=16)


class GpuSample(SQLModel, table=True):
    """One GPU's utilization at one moment, as the host's telemetry probe saw it.

    Kept as a rolling history, thinned with age (bot.app.watching.utilization): minute samples for the
    recent hours, coarser ones after. `span_s` says how long a sample stands for, so an
    average over thinned history still weighs time correctly.
    """

    __table_args__ = (
        Index("ix_gpusample_host_at", "host_id", "at"),
        # The digest's week of samples, across hosts.
        Index("ix_gpusample_at", "at"),
        # A run's samples since it started (the queue's and the live message's GPU line).
        Index("ix_gpusample_run_at", "run_id", "at"),
    )

    id: int | None = Field(default=None, primary_key=True)
    host_id: int = Field(foreign_key="host.id")
    gpu_index: int
    at: datetime = _ts()
    span_s: int = 60
    util_pct: float = 0.0
    mem_used_mb: float = 0.0
    mem_total_mb: float = 0.0
    temperature_c: float | None = None
    power_w: float | None = None
    # Who held the GPU then (attribution of the sample), if anyone.
    user_id: int | None = Field(default=None, foreign_key="user.id")
    reservation_id: int | None = Field(default=None, foreign_key="reservation.id")
    run_id: int | None = Field(default=None, foreign_key="trainingrun.id")


class PoolLimit(SQLModel, table=True):
    """An admin's cap on one instance type (`/gpu pool`), over the configured defaults."""

    instance_type: str = Field(primary_key=True, max_length=64)
    # None: no cap of that kind.
    max_instances: int | None = None
    max_usd_per_hour: float | None = None
    updated_by: str = Field(default="", max_length=64)
    updated_at: datetime = _ts()


class LaunchRequest(SQLModel, table=True):
    """The intent to launch, committed *before* the cloud is called.

    A worker that dies between the cloud's answer and its own commit leaves this row
    pending; on restart, reconcile finds the instance by its request tag (the same key
    is the ClientToken, so asking again cannot launch a second one) and adopts it.
    """

    id: int | None = Field(default=None, primary_key=True)
    request_key: str = Field(unique=True, max_length=128)
    gpu_model: str = Field(max_length=32)
    gpus: int = 1
    market: str = Field(default="ondemand", max_length=16)
    owner: str = Field(max_length=64)
    reservation_id: int | None = Field(default=None, foreign_key="reservation.id")
    run_id: int | None = Field(default=None, foreign_key="trainingrun.id")
    # pending (cloud not yet answered), launched, failed.
    state: str = Field(default="pending", index=True, max_length=16)
    instance_id: str | None = Field(default=None, max_length=64)
    error: str | None = Field(default=None, max_length=500)
    created_at: datetime = _ts()
    updated_at: datetime = _ts()


class BurstOffer(SQLModel, table=True):
    """The cloud offered, priced, to a run or a reservation waiting for the team's own GPUs
    (bot.app.burst): one per request, so one request is never bought twice. Its states are
    bot.app.burst.state's, each left once."""

    id: int | None = Field(default=None, primary_key=True)
    # What it is for: a run or a reservation (exactly one of the two).
    run_id: int | None = Field(default=None, foreign_key="trainingrun.id", unique=True)
    reservation_id: int | None = Field(default=None, foreign_key="reservation.id", unique=True)
    user_id: int = Field(foreign_key="user.id", index=True)
    # The cloud place (its provider's name) and what it would run on.
    place: str = Field(max_length=32)
    instance_type: str = Field(max_length=64)
    # The run's share of the instance an hour, the hours priced, and their product.
    usd_per_hour: float = 0.0
    hours: float = 1.0
    # No `--max`: `hours` is the length assumed, and the offer says so.
    assumed: bool = False
    estimate_usd: float = 0.0
    state: str = Field(default="open", index=True, max_length=16)
    # When the owned side expected to start it, as it said when the offer was made (the
    # cluster's expected start, gpubot's queue estimate): what taking it saves in waiting.
    expected_start: datetime | None = _ts(nullable=True)
    # When it started on the cloud (the digest's waiting saved is expected_start - this).
    cloud_start: datetime | None = _ts(nullable=True)
    # Why it ended as it did, in words (a refusal's figures, a launch's error).
    note: str = Field(default="", sa_column=Column(Text, nullable=False, server_default=""))
    created_at: datetime = _ts()
    decided_at: datetime | None = _ts(nullable=True)


class UsageRollup(SQLModel, table=True):
    """Closed usage, summed per hour (UTC), user, market and instance type, in integer
    micro-dollars: what costs and the digest read for history, so that a window's hours
    read a row per person, market and instance type however many intervals, hosts or runs
    it holds (the runs' own figures are in `RunRollup`).

    Written in the transaction that closes the interval (bot.app.money.rollups), from the same meter
    as `bot.domain.metering` (readings telescope, so hour pieces add up to the whole exactly).
    `covered_micro` is the same time at the host's own GPU share over its billed periods,
    so the idle overhead is the instances' bill less it; `bot.app.money.rollups.rebuild_rollups`
    recomputes every row from the raw intervals.
    """

    __table_args__ = (
        UniqueConstraint("hour", "user_id", "market", "instance_type", name="uq_usagerollup_key"),
    )

    id: int | None = Field(default=None, primary_key=True)
    # Start of the UTC hour the pieces lie in.
    hour: datetime = _ts()
    user_id: int = Field(foreign_key="user.id")
    market: str = Field(default="owned", max_length=16)
    # The host's instance type ("" for machines without one), for spot savings.
    instance_type: str = Field(default="", max_length=64)
    # What the holder pays (at the interval's rate), and GPU-microseconds held.
    micro_usd: int = Field(default=0, sa_type=BigInteger)
    held_us: int = Field(default=0, sa_type=BigInteger)
    # The same time at the host period's GPU share: what it takes off the idle overhead.
    covered_micro: int = Field(default=0, sa_type=BigInteger)


class FairShareUsage(SQLModel, table=True):
    """Each user's GPU-seconds, decayed by a half-life, as of `as_of` (Slurm's decayed
    usage): kept up to date as intervals close, so the scheduler never re-reads weeks of
    intervals to order the queue."""

    user_id: int = Field(primary_key=True, foreign_key="user.id")
    decayed_s: float = 0.0
    as_of: datetime = _ts()
    half_life_s: float


class UsageRollupDay(SQLModel, table=True):
    """The hourly rollups summed per UTC day, user, market and instance type, so a month
    reads about a row per person and day however big the fleet or however many runs.
    Kept beside `UsageRollup` in the same transaction; a window's whole UTC days come from
    here, its other whole hours from the hourly rows."""

    __table_args__ = (
        UniqueConstraint("day", "user_id", "market", "instance_type", name="uq_usagerollupday_key"),
    )

    id: int | None = Field(default=None, primary_key=True)
    day: datetime = _ts()
    user_id: int = Field(foreign_key="user.id")
    market: str = Field(default="owned", max_length=16)
    # The host's instance type ("" for machines without one), for spot savings.
    instance_type: str = Field(default="", max_length=64)
    micro_usd: int = Field(default=0, sa_type=BigInteger)
    held_us: int = Field(default=0, sa_type=BigInteger)
    covered_micro: int = Field(default=0, sa_type=BigInteger)


class RunRollup(SQLModel, table=True):
    """A run's closed usage summed per UTC hour, in integer micro-dollars (the same pieces
    as `UsageRollup`'s, kept beside them), for the hours of a window that are not whole UTC
    days (`RunRollupDay` has those): what a view of runs reads (the digest's dearest runs
    of a week), so that the team's rows stay a row per person however many runs there
    were. Its owner is the run's."""

    __table_args__ = (UniqueConstraint("hour", "run_id", name="uq_runrollup_key"),)

    id: int | None = Field(default=None, primary_key=True)
    hour: datetime = _ts()
    run_id: int = Field(foreign_key="trainingrun.id")
    micro_usd: int = Field(default=0, sa_type=BigInteger)
    held_us: int = Field(default=0, sa_type=BigInteger)


class RunRollupDay(SQLModel, table=True):
    """A run's hourly rollups summed per UTC day: a week's runs are about a row each. The
    dearest runs of a window are summed from an index that holds the cost too, so that
    the database reads the index alone (7,500 runs in a week of a busy team)."""

    __table_args__ = (
        UniqueConstraint("day", "run_id", name="uq_runrollupday_key"),
        Index("ix_runrollupday_cost", "day", "run_id", "micro_usd"),
    )

    id: int | None = Field(default=None, primary_key=True)
    day: datetime = _ts()
    run_id: int = Field(foreign_key="trainingrun.id")
    micro_usd: int = Field(default=0, sa_type=BigInteger)
    held_us: int = Field(default=0, sa_type=BigInteger)


class RunTime(SQLModel, table=True):
    """How long a finished run ran, all its segments together, as the run-time estimates
    count it (bot.app.runtimes): written when the run ends, so the estimates never
    re-read a month of runs and their metrics."""

    run_id: int = Field(primary_key=True, foreign_key="trainingrun.id")
    user_id: int = Field(foreign_key="user.id")
    gpus: int
    finished_at: datetime = Field(sa_type=UTCDateTime, nullable=False, index=True)
    ran_s: float


class RunEstimate(SQLModel, table=True):
    """The run-time predictions of one (user, GPUs), as the finished runs of the last 30
    days make them (bot.domain.scheduling.RunHistory): a queued run's expected length and
    a running run's stepped predicted ends, so that the worker's tick reads the rows of
    the runs it weighs, not the runs behind them.

    The row (0, 0) is everybody's, the fallback of a (user, GPUs) with too few runs of its
    own, and the bookkeeping: every run end adds one to `version`, and the predictions are
    current while `computed_version` equals it and the clock is in [as_of, valid_until)
    (until the oldest run they count leaves the 30 days)."""

    user_id: int = Field(primary_key=True)  # 0: everybody's
    gpus: int = Field(primary_key=True)
    # A queued run's expected length (None: nothing to go on).
    first_s: float | None = None
    # The stepped predicted run times, in order: a run that has run a while ends at the
    # first of them it has not reached.
    ends_s: list[float] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    version: int = 0
    computed_version: int = -1
    as_of: datetime | None = _ts(nullable=True)
    valid_until: datetime | None = _ts(nullable=True)
