"""Who each person is on the cluster, and what their jobs ask Slurm for.

A lab's admin lets a bot on the cluster only if nobody gets more through it than their
own account would give them: every job runs as the person who asked (their unix account,
GPUBOT_SLURM_USERS), or as a shared unprivileged account the admin names for people
without one (GPUBOT_SLURM_SHARED_ACCOUNT); never as root, never as the bot. A person with
neither is refused before anything is put in line. Every job carries who asked in its
comment, so an admin traces any job to a Slack person (`squeue -o %k`, `sacct -o Comment`).

What a job asks (bot.providers.slurm.fit): a partition whose limits allow its length and
that has its GPUs, CPUs and memory per GPU (a node's share, or the admin's settings, or
the partition's own defaults), the account and QOS the person may use. Checked at once,
so a request the cluster would leave pending for ever is refused with what is allowed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

from bot.app.ports import PlaceRequest
from bot.domain.durations import format_duration
from bot.domain.errors import UserError
from bot.providers.slurm.cluster import ClusterView
from bot.providers.slurm.fit import Ask, Fit, Shares, choose
from provisioning.slurm import JobSpec, SlurmError

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Plan:
    person: str  # the unix account the job runs as
    fit: Fit


class Lab:
    """The people map and the job shape of one cluster."""

    def __init__(
        self,
        cluster: ClusterView,
        *,
        users: Mapping[str, str],
        shared: str | None = None,
        accounts: Mapping[str, str] | None = None,
        shares: Shares = Shares(),
        signal: str | None = "B:TERM@120",
        partitions: Collection[str] = (),
    ) -> None:
        self.cluster = cluster
        self.users = dict(users)
        self.shared = shared
        self.accounts = dict(accounts or {})
        self.shares = shares
        self.signal = signal
        self.partitions = tuple(partitions)

    def person(self, user_key: str) -> str:
        """The account `user_key`'s jobs run as; UserError when they have none."""
        found = self.users.get(user_key) or self.shared
        if not found:
            raise UserError(
                "You have no account on the Slurm cluster, so I cannot run anything there "
                "for you. An admin maps Slack people to cluster accounts "
                f"(GPUBOT_SLURM_USERS={user_key}=your-unix-name), or names a shared account "
                "for people without one (GPUBOT_SLURM_SHARED_ACCOUNT)."
            )
        return found

    def plan(self, request: PlaceRequest) -> Plan:
        """The account and job shape for `request`, or UserError saying what is allowed."""
        person = self.person(request.user_key)
        place = dict(request.place)
        ask = Ask(
            gpus=request.gpus,
            model=request.model,
            seconds=request.seconds,
            partition=place.get("partition"),
            account=place.get("account") or self.accounts.get(request.user_key),
            qos=place.get("qos"),
            constraint=place.get("constraint"),
            across=request.kind == "run",
        )
        snap = self.cluster.read()
        nodes = list(snap.nodes) if snap is not None else []
        no_walls: dict[str, int | None] = {}
        fit = choose(
            ask,
            self.cluster.partition_limits(),
            nodes,
            usable=self.partitions,
            assoc=self._accounting(lambda: self.cluster.associations(person), None),
            walls=self._accounting(self.cluster.qos_walls, no_walls),
            shares=self.shares,
        )
        return Plan(person, fit)

    def _accounting(self, read: Callable[[], T], unknown: T) -> T:
        """Accounting's answer, or `unknown` (nothing checked) when slurmdbd cannot be
        asked now: Slurm itself still refuses a job under an account not the person's."""
        try:
            return read()
        except SlurmError as exc:
            log.warning("Slurm's accounting cannot be read now: %s", exc)
            return unknown

    def note(self, plan: Plan, request: PlaceRequest) -> str | None:
        """What the reply says of the choice: the time a run without --max gets."""
        fit = plan.fit
        if fit.defaulted:
            return (
                f"No --max: Slurm gives it partition {fit.partition}'s default time, "
                f"{format_duration(timedelta(seconds=fit.time_limit_s))}; ask `--max` for longer."
            )
        return None

    def spec(
        self,
        plan: Plan,
        *,
        name: str,
        argv: tuple[str, ...],
        workdir: str,
        who: str,
        gpus: int,
        model: str | None,
        **extra: object,
    ) -> JobSpec:
        """The job as the plan shapes it; `who` goes into its comment."""
        fit = plan.fit
        values: dict[str, object] = {
            "name": name,
            "argv": argv,
            "workdir": workdir,
            "time_limit_s": fit.time_limit_s,
            "gpus": gpus,
            "gpu_type": model,
            "partition": fit.partition,
            "user": plan.person,
            "cpus_per_gpu": fit.cpus_per_gpu,
            "mem_per_gpu_mb": fit.mem_per_gpu_mb,
            "account": fit.account,
            "qos": fit.qos,
            "constraint": fit.constraint,
            "comment": f"gpubot: {who}",
        }
        values.update(extra)
        return JobSpec(**values)  # type: ignore[arg-type]
