"""What the bot knows of a Slurm cluster: its nodes and jobs, read at most once a period.

Every use (status, the holds' and runs' looks, the watchers) reads the cluster through
one `ClusterView`, which asks Slurm (`sinfo`, one `squeue`) only when its copy is older
than `cache_s`: a burst of `/gpu status` or a dozen running runs cost the controller one
read a period, not one each. A controller that does not answer is remembered (since
when, why), the copy is kept as it was, and everything that reads it says so; nothing is
lost, and what changed meanwhile is reconciled at the next read that works.

`sync_hosts` writes the nodes as host rows (market "cluster": the cluster grants their
GPUs) and the GPUs held by other people's jobs as theirs (`Gpu.held_by`), only when they
changed since the last write.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import datetime
from typing import TypeVar, cast

from sqlalchemy.engine import Engine
from sqlmodel import col, select

from db.models import HOST_READY, HOST_UNREACHABLE, MARKET_CLUSTER, Gpu, Host
from db.session import transaction
from provisioning.base import GpuDevice, Instance
from provisioning.slurm import (
    Associations,
    SlurmClient,
    SlurmError,
    SlurmJob,
    SlurmNode,
    SlurmPartition,
    SlurmUnavailable,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

# How long a read that changes seldom (partitions, accounting's associations and QOS)
# serves: an admin's change is seen within this.
SLOW_S = 300.0

# Job names that are gpubot's: a reservation's holding job, a run's batch job.
HOLD_PREFIX = "gpubot-res-"
RUN_PREFIX = "gpubot-run-"
# A sweep's job array, named after its first run (each task is one run of the sweep).
SWEEP_PREFIX = "gpubot-sweep-"
GPUBOT_PREFIXES = (HOLD_PREFIX, RUN_PREFIX, SWEEP_PREFIX)


def job_name(kind: str, ident: int) -> str:
    return f"{HOLD_PREFIX if kind == 'res' else RUN_PREFIX}{ident}"


def gpubot_id(job: SlurmJob, prefix: str) -> int | None:
    """The reservation's or run's id a job of gpubot's is named after; None for others'."""
    rest = job.name.removeprefix(prefix)
    return int(rest) if job.name.startswith(prefix) and rest.isdigit() else None


# A read that takes longer than this (a healthy slurmctld answers squeue and sinfo in a
# fraction of a second) says the controller is busy: the next waits SLOW_READ_FACTOR times
# as long as it took (the cache's own time at least).
SLOW_READ_S = 2.0
SLOW_READ_FACTOR = 10
# While the controller does not answer, reads wait cache_s, then 2×, 4×, … up to this ×.
BACKOFF_MAX = 8


@dataclass(frozen=True)
class Snapshot:
    nodes: tuple[SlurmNode, ...]
    jobs: tuple[SlurmJob, ...]
    at: float  # time.monotonic() of the read
    taken: datetime  # the bot's clock at the read: a job submitted later is not in it


class ClusterView:
    """The cluster's nodes and jobs, cached for `cache_s`; `partitions` limits the nodes
    to those partitions (empty: every partition with GPUs)."""

    def __init__(
        self,
        client: SlurmClient,
        *,
        cache_s: float,
        partitions: Collection[str] = (),
        clock: Callable[[], datetime],
    ) -> None:
        self.client = client
        self.cache_s = cache_s
        self.partitions = tuple(partitions)
        self.clock = clock
        self._snap: Snapshot | None = None
        self._lock = threading.Lock()
        # Since when (the bot's clock) and why the controller has not answered; None: it does.
        self.down_since: datetime | None = None
        self.down_reason: str = ""
        self._synced: tuple[object, ...] | None = None
        self._kept: dict[str, tuple[float, object]] = {}
        self._ttl = cache_s  # cache_s, or longer after a slow read
        self._failures = 0  # reads in a row the controller did not answer
        self._retry_at = 0.0  # time.monotonic() before which a down controller is not asked

    def read(self, *, fresh: bool = False) -> Snapshot | None:
        """The cluster as last read, read again when older than its time to live (or
        `fresh`); None when it has never answered. The time to live is `cache_s`, longer
        while the controller is slow (SLOW_READ_S: SLOW_READ_FACTOR × the read's own time),
        and while it does not answer the reads back off (doubling from `cache_s` up to
        BACKOFF_MAX × `cache_s`), fresh ones too: a struggling slurmctld is not hammered."""
        with self._lock:
            snap = self._snap
            now = time.monotonic()
            if self.down_since is not None and now < self._retry_at:
                return snap
            if snap is not None and not fresh and now - snap.at < self._ttl:
                return snap
            taken = self.clock()
            try:
                nodes = [n for n in self.client.nodes() if self._ours(n)]
                jobs = self.client.jobs()
            except SlurmUnavailable as exc:
                self._failures += 1
                wait = self.cache_s * min(2 ** (self._failures - 1), BACKOFF_MAX)
                self._retry_at = time.monotonic() + wait
                if self.down_since is None:
                    self.down_since = self.clock()
                    log.warning("the Slurm controller is not answering: %s", exc)
                self.down_reason = str(exc)
                return snap
            took = time.monotonic() - now
            if self.down_since is not None:
                log.warning("the Slurm controller answers again")
            self.down_since, self.down_reason, self._failures = None, "", 0
            self._ttl = self.cache_s
            if took > SLOW_READ_S:
                self._ttl = max(self.cache_s, SLOW_READ_FACTOR * took)
                log.info(
                    "the Slurm controller took %.1f s to answer; next read in %.0f s",
                    took,
                    self._ttl,
                )
            self._snap = Snapshot(tuple(nodes), tuple(jobs), time.monotonic(), taken)
            return self._snap

    def _slow(self, key: str, ttl_s: float, read: Callable[[], T]) -> T:
        """A read that changes seldom (partitions, accounting), kept `ttl_s`; a read
        that fails leaves the last copy in use."""
        now = time.monotonic()
        with self._lock:
            held = self._kept.get(key)
        if held is not None and now - held[0] < ttl_s:
            return cast(T, held[1])
        try:
            value = read()
        except SlurmError:
            if held is not None:
                return cast(T, held[1])
            raise
        with self._lock:
            self._kept[key] = (now, value)
        return value

    def partition_limits(self) -> list[SlurmPartition]:
        """The partitions and their limits (read once every SLOW_S)."""
        return self._slow("partitions", SLOW_S, self.client.partitions)

    def associations(self, user: str) -> Associations | None:
        """What accounting lets `user` use (sacctmgr: slurmdbd, not the controller)."""
        return self._slow(f"assoc:{user}", SLOW_S, lambda: self.client.associations(user))

    def qos_walls(self) -> dict[str, int | None]:
        return self._slow("qos", SLOW_S, self.client.qos_limits)

    def _ours(self, node: SlurmNode) -> bool:
        if not node.gpus:
            return False
        return not self.partitions or bool(set(node.partitions) & set(self.partitions))

    def job(self, job_id: int, *, fresh: bool = False) -> SlurmJob | None:
        snap = self.read(fresh=fresh)
        if snap is None:
            return None
        return next((j for j in snap.jobs if j.job_id == job_id), None)

    def job_now(self, job_id: int) -> SlurmJob | None:
        """One job as Slurm has it now (one job-info RPC; the shared read is not
        renewed): to confirm what a file said, or why a job just submitted pends."""
        try:
            return self.client.job(job_id)
        except SlurmError as exc:
            log.warning("could not read Slurm job %s: %s", job_id, exc)
            return None

    def forget(self) -> None:
        """The next read asks Slurm (after the bot changed something there)."""
        with self._lock:
            self._snap = None

    # --- the cluster as host rows ---------------------------------------------------------

    def instances(self, provider: str) -> list[Instance]:
        """The nodes as hosts: ready while Slurm can run jobs there, unreachable while
        it is drained or down; each GPU by the index Slurm gives it (the node's GPUs of
        each type in turn)."""
        snap = self.read()
        if snap is None:
            return []
        out = []
        for node in snap.nodes:
            gpus: list[GpuDevice] = []
            for model, count in node.gpus.items():
                gpus += [GpuDevice(index=len(gpus) + i, model=model) for i in range(count)]
            out.append(
                Instance(
                    name=node.name,
                    provider=provider,
                    state=HOST_UNREACHABLE if node.state in ("drained", "down") else HOST_READY,
                    gpus=tuple(gpus),
                    market=MARKET_CLUSTER,
                    address=node.name,
                    tags={"slurm_state": node.raw_state, "slurm_reason": node.reason},
                )
            )
        return out

    def foreign_holds(self) -> dict[tuple[str, int], str]:
        """(node, GPU index) → who holds it, for the running jobs that are not gpubot's."""
        snap = self.read()
        held: dict[tuple[str, int], str] = {}
        if snap is None:
            return held
        for job in snap.jobs:
            if job.state != "RUNNING" or job.name.startswith(GPUBOT_PREFIXES):
                continue
            for node, indexes in job.gpu_indexes.items():
                for index in indexes:
                    held[(node, index)] = f"{job.user} (Slurm job {job.job_id})"
        return held

    def sync_hosts(
        self, engine: Engine, provider: str, sync: Callable[[list[Instance]], None]
    ) -> bool:
        """The nodes and others' holds written to the database when they changed since
        the last write (`sync` is the service's `sync_hosts`); True when written."""
        snap = self.read()
        if snap is None:
            return False
        instances = self.instances(provider)
        held = self.foreign_holds()
        signature = (
            tuple((i.name, i.state, tuple((g.index, g.model) for g in i.gpus)) for i in instances),
            tuple(sorted(held.items())),
            tuple((n.name, n.reason) for n in snap.nodes),
        )
        if signature == self._synced:
            return False
        sync(instances)
        with transaction(engine) as s:
            for host in s.exec(
                select(Host).where(Host.provider == provider, col(Host.state) != "terminated")
            ):
                node = next((n for n in snap.nodes if n.name == host.name), None)
                down = node is not None and node.state in ("drained", "down")
                reason = (
                    f"Slurm: {node.state}" + (f" ({node.reason})" if node and node.reason else "")
                    if node
                    else None
                )
                if down and host.down_reason != reason:
                    host.down_reason = reason
                    host.down_since = host.down_since or self.clock()
                    s.add(host)
                elif not down and host.down_since is not None:
                    host.down_since, host.down_reason = None, None
                    s.add(host)
                for gpu in s.exec(select(Gpu).where(Gpu.host_id == host.id)):
                    who = held.get((host.name, gpu.index))
                    if gpu.held_by != who:
                        gpu.held_by = who
                        s.add(gpu)
        self._synced = signature
        return True


__all__ = [
    "GPUBOT_PREFIXES",
    "HOLD_PREFIX",
    "RUN_PREFIX",
    "SWEEP_PREFIX",
    "ClusterView",
    "SlurmError",
    "Snapshot",
    "gpubot_id",
    "job_name",
]
