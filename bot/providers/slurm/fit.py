"""Which partition, time limit, account, QOS and share of a node a job asks Slurm for.

Pure: what the cluster has (partitions with their limits, nodes with their GPUs, CPUs
and memory, each QOS's MaxWall) and what accounting lets the person use, in; one `Fit`
or a `UserError` that says what is allowed, out. Why it exists: a lab's cluster counts
memory (a job that asks none is given the whole node's and blocks every other job
there), caps its default partition's time (a job longer than MaxTime is accepted and
then pends for ever with `PartitionTimeLimit`), and lets each person use some accounts
and QOS only (a job under another is refused at submit, or worse, pends). Slurm itself
says none of this at submit time on a default configuration (EnforcePartLimits=NO), so
the bot says it at once, before anything waits.

The order of partitions: the one named, else the cluster's default when it allows the
request, else the lowest PriorityTier (a high tier preempts other people's jobs: only
when asked for by name) and, among equals, the shortest MaxTime that allows it (the long
partitions stay for long jobs).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

from bot.domain.durations import format_duration
from bot.domain.errors import UserError
from provisioning.slurm import Associations, SlurmNode, SlurmPartition

# A job with no length asked, where its partition has neither DefaultTime nor MaxTime.
UNLIMITED_DEFAULT_S = 24 * 3600


@dataclass(frozen=True)
class Ask:
    """What a reservation or run asks of the cluster."""

    gpus: int
    model: str | None  # normalized ("A100"); None: any GPU
    seconds: int | None  # None: not said (a run without --max): the partition's default
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    # A run may span nodes (one job of several nodes, the same GPUs on each, under
    # torchrun); a reservation is one node's GPUs.
    across: bool = False


@dataclass(frozen=True)
class Fit:
    partition: str
    time_limit_s: int
    defaulted: bool  # no length asked: the partition's DefaultTime (the reply says so)
    max_time_s: int | None  # the most a job may ask there (partition and QOS); None: none
    # None: the partition's own DefCpuPerGPU/DefMemPerGPU apply (nothing is asked).
    cpus_per_gpu: int | None
    mem_per_gpu_mb: int | None
    account: str | None  # None: Slurm's default for the person
    qos: str | None
    constraint: str | None
    nodes: int = 1  # the job's nodes; its GPUs split evenly over them
    gpus_per_node: int = 0


@dataclass(frozen=True)
class Shares:
    """The admin's settings for a job's share of a node per GPU; None: the node's share."""

    cpus_per_gpu: int | None = None
    mem_per_gpu_mb: int | None = None


def _limit(part: SlurmPartition, qos: str | None, walls: Mapping[str, int | None]) -> int | None:
    """The longest a job may ask in `part` under `qos` (its partition QOS too)."""
    limits = [part.max_time_s]
    for name in (qos, part.qos):
        if name:
            limits.append(walls.get(name))
    known = [x for x in limits if x is not None]
    return min(known) if known else None


def split(gpus: int, capacities: Sequence[int], across: bool) -> tuple[int, int] | None:
    """(nodes, GPUs on each) for `gpus` over nodes holding `capacities` GPUs of the
    model: the fewest nodes, the same number on each (torchrun starts as many workers on
    every node); None when no such split fits. One node only unless `across`."""
    most = len(capacities) if across else 1
    for count in range(1, most + 1):
        if gpus % count:
            continue
        per = gpus // count
        if sum(1 for c in capacities if c >= per) >= count:
            return count, per
    return None


def _words(seconds: int | None) -> str:
    return "no limit" if seconds is None else format_duration(timedelta(seconds=seconds))


def choose(
    ask: Ask,
    partitions: Sequence[SlurmPartition],
    nodes: Sequence[SlurmNode],
    *,
    usable: Collection[str] = (),
    assoc: Associations | None = None,
    walls: Mapping[str, int | None] | None = None,
    shares: Shares = Shares(),
) -> Fit:
    """The fit for `ask`, or UserError naming what the person may use instead.

    `usable`: the partitions the bot may use (GPUBOT_SLURM_PARTITIONS; empty: all);
    `assoc`: what accounting lets the person use (None: no accounting, nothing checked);
    `walls`: each QOS's MaxWall."""
    walls = walls or {}
    account = ask.account or (assoc.default_account if assoc else None) or None
    if assoc is not None:
        if account and account not in assoc.accounts:
            raise UserError(
                f"You may not use Slurm account `{account}`; yours: "
                f"{', '.join(assoc.accounts) or 'none'} (default {assoc.default_account or 'none'})."
            )
        if ask.qos and ask.qos not in assoc.qos:
            raise UserError(
                f"You may not use QOS `{ask.qos}`; yours: {', '.join(assoc.qos) or 'none'}."
            )
    named = [p for p in partitions if not usable or p.name in usable]
    if ask.partition is not None:
        if not any(p.name == ask.partition for p in named):
            have = ", ".join(p.name for p in named) or "none"
            raise UserError(
                f"There is no partition `{ask.partition}` to use; the partitions: {have}."
            )
        named = [p for p in named if p.name == ask.partition]

    def spread(part: SlurmPartition) -> tuple[int, int] | None:
        here = [n for n in nodes if n.name in part.nodes or part.name in n.partitions]
        caps = [n.gpus.get(ask.model, 0) if ask.model else n.gpu_count for n in here]
        return split(ask.gpus, caps, ask.across)

    def has_gpus(part: SlurmPartition) -> bool:
        return spread(part) is not None

    def allowed(part: SlurmPartition) -> bool:
        if part.allow_accounts and account and account not in part.allow_accounts:
            return False
        qos = ask.qos or (assoc.default_qos if assoc else None)
        return not (part.allow_qos and qos and qos not in part.allow_qos)

    gpu_parts = [p for p in named if p.up and has_gpus(p)]
    if not gpu_parts:
        raise UserError(_no_gpus(ask, nodes, [p for p in named if p.up]))
    open_parts = [p for p in gpu_parts if allowed(p)]
    if not open_parts:
        raise UserError(
            f"Account `{account}` may not use partition{'s' if len(gpu_parts) > 1 else ''} "
            f"{', '.join(p.name for p in gpu_parts)} for these GPUs."
        )
    qos_for_limit = ask.qos or (assoc.default_qos if assoc else None)

    def fits(part: SlurmPartition) -> bool:
        if ask.seconds is None:
            return True
        limit = _limit(part, qos_for_limit, walls)
        return limit is None or ask.seconds <= limit

    order = sorted(
        open_parts,
        key=lambda p: (
            (spread(p) or (1, 0))[0],  # one node where a partition allows it
            not p.default,
            p.priority_tier,
            p.max_time_s if p.max_time_s is not None else 10**12,
            p.name,
        ),
    )
    # A high tier preempts others' jobs: only where it is the default or asked for.
    lowest = min(p.priority_tier for p in order)
    candidates = [p for p in order if ask.partition or p.default or p.priority_tier == lowest]
    chosen = next((p for p in candidates if fits(p)), None)
    if chosen is None:
        best = max(
            candidates,
            key=lambda p: _limit(p, qos_for_limit, walls) or 10**12,
        )
        longest = _limit(best, qos_for_limit, walls)
        asked = format_duration(timedelta(seconds=ask.seconds or 0))
        raise UserError(
            f"No partition allows {asked}: the longest allowed is {_words(longest)} "
            f"(partition `{best.name}`). Ask for less, and extend later if you need it."
        )
    limit = _limit(chosen, qos_for_limit, walls)
    if ask.seconds is not None:
        seconds, defaulted = ask.seconds, False
    else:
        default = chosen.default_time_s or limit or UNLIMITED_DEFAULT_S
        seconds, defaulted = (min(default, limit) if limit else default), True
    here = [n for n in nodes if n.name in chosen.nodes or chosen.name in n.partitions]
    with_gpus = [n for n in here if (n.gpus.get(ask.model, 0) if ask.model else n.gpu_count) > 0]
    cpus = shares.cpus_per_gpu
    mem = shares.mem_per_gpu_mb
    if chosen.def_cpu_per_gpu is not None and cpus is None:
        cpus = None  # the partition's own default applies
    elif cpus is None and with_gpus:
        cpus = max(1, min(n.cpus // max(1, n.gpu_count) for n in with_gpus))
    if chosen.def_mem_per_gpu_mb is not None and mem is None:
        mem = None
    elif mem is None and with_gpus:
        mem = max(1, min(n.memory_mb // max(1, n.gpu_count) for n in with_gpus))
    nodes_used, per_node = spread(chosen) or (1, ask.gpus)
    return Fit(
        nodes=nodes_used,
        gpus_per_node=per_node,
        partition=chosen.name,
        time_limit_s=seconds,
        defaulted=defaulted,
        max_time_s=limit,
        cpus_per_gpu=cpus,
        mem_per_gpu_mb=mem,
        account=ask.account,
        qos=ask.qos,
        constraint=ask.constraint,
    )


def _no_gpus(ask: Ask, nodes: Sequence[SlurmNode], parts: Sequence[SlurmPartition]) -> str:
    """Why no partition has the GPUs asked for, with what the cluster does have."""
    where = f"Partition `{ask.partition}`" if ask.partition else "The cluster"
    here = [n for n in nodes if any(n.name in p.nodes or p.name in n.partitions for p in parts)]
    models = sorted({m for n in here for m in n.gpus})
    if ask.model is not None and ask.model not in models:
        return f"{where} has no {ask.model} GPUs (it has: {', '.join(models) or 'no GPUs'})."
    most = max((n.gpus.get(ask.model, 0) if ask.model else n.gpu_count for n in here), default=0)
    label = f"{ask.gpus} {ask.model} GPUs" if ask.model else f"{ask.gpus} GPUs"
    if not ask.across:
        return f"{where} has no node with {label} (the most on one node is {most})."
    return (
        f"{where} cannot hold {label}, on one node (the most is {most}) or split evenly "
        f"over {len(here)} node{'s' if len(here) != 1 else ''} (a run across nodes has the "
        "same GPUs on each): ask for fewer, or a number its nodes divide."
    )
