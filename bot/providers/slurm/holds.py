"""Reservations on a Slurm cluster: each one a holding job (bot.app.ports.Holder).

`/gpu reserve 2 a100 for 3h` becomes a job of 2 A100s with a 3-hour limit named
`gpubot-res-<id>` that only sleeps: Slurm orders it among the cluster's jobs, and the
reservation is granted when the job runs (its GPUs metered from then, at the team's
rate for the model). While it pends, the reply and `/gpu status` say Slurm's reason and
its expected start. Release and expiry cancel it; extend raises its limit (Slurm may
refuse: the bot's account must be an operator to raise a running job's limit). Slurm
ending it (a preemption, an admin's scancel) ends the reservation, with a DM.

What each reservation's job is lives on the reservation (`external`), so a restarted
bot, or one whose controller stopped answering, reconciles from there: `sync` submits
what never reached Slurm, grants what runs, ends what ended, and cancels holding jobs
whose reservation ended meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlmodel import col, select

from bot.app.ports import PlaceRequest
from bot.app.service.common import end_reservation, reservation_info
from bot.domain import views
from bot.domain.errors import UserError
from bot.domain.timefmt import when
from bot.providers.slurm.cluster import HOLD_PREFIX, ClusterView, gpubot_id, job_name
from bot.providers.slurm.lab import Lab
from db.models import (
    RES_ACTIVE,
    RES_CANCELLED,
    RES_EXPIRED,
    RES_OPEN_STATES,
    RES_RELEASED,
    RES_WAITING,
    Gpu,
    Host,
    Reservation,
    User,
)
from db.session import lock_pool, locked, transaction
from provisioning import shell
from provisioning.hostshell import HostShell
from provisioning.slurm import (
    JobEnd,
    SlurmError,
    SlurmJob,
    SlurmUnavailable,
    StartedLine,
    parse_started,
)
from provisioning.ssh import SshError, SshTarget

if TYPE_CHECKING:
    from bot.app.service import GpuService

log = logging.getLogger(__name__)

# How long a reserve waits for its holding job to run before it answers "waiting": on an
# idle cluster a job starts in about a second, so the reply can say "granted".
HOLD_WAIT_S = 3.0


def pending_words(job: SlurmJob | None, now: datetime, tz: str) -> str:
    """Why a job pends and when Slurm expects to start it, in a sentence's words."""
    if job is None:
        return "submitted to Slurm"
    reason = job.reason if job.reason and job.reason != "None" else "being scheduled"
    start = job.expected_start
    expected = f"; Slurm expects it to start {when(start, now, tz)}" if start is not None else ""
    return f"Slurm job {job.job_id} pends ({reason}){expected}"


class SlurmHolder:
    """`Holder` of a Slurm cluster's GPUs."""

    def __init__(
        self,
        service: GpuService,
        cluster: ClusterView,
        lab: Lab,
        files: HostShell,
        target: SshTarget,
        *,
        provider: str,
        rates: Mapping[str, float],
        workdir: str,
        hold_wait_s: float = HOLD_WAIT_S,
    ) -> None:
        self.service = service
        self.cluster = cluster
        self.lab = lab
        self.files = files
        self.target = target
        self.provider = provider
        self.rates = dict(rates)
        self.workdir = workdir
        self.hold_wait_s = hold_wait_s
        # Holding jobs the bot cancelled: a shared read older than the cancel still lists
        # them, and must not make it cancel them again (an RPC each tick).
        self._cancelled: set[int] = set()

    @property
    def client(self) -> Any:
        return self.cluster.client

    def _now(self) -> datetime:
        return self.service.clock.now()

    def _cluster_has(self, model: str | None) -> bool:
        snap = self.cluster.read()
        if snap is None:
            return True  # never answered yet: it is what is configured, so it is its
        return any(model is None or model in n.gpus for n in snap.nodes)

    # --- the Holder port --------------------------------------------------------------

    def admit(self, request: PlaceRequest) -> str | None:
        if not self._cluster_has(request.model):
            return None  # not the cluster's: the grant pass says what is wrong
        try:
            plan = self.lab.plan(request)
        except SlurmError:  # the controller is not answering: checked at its submission
            return None
        return self.lab.note(plan, request)

    def hold(self, reservation_id: int) -> str | None:
        return self._hold(reservation_id, tell=False)  # the reserve's reply says it

    def _hold(self, reservation_id: int, *, tell: bool) -> str | None:
        """Submits the holding job and waits a moment for Slurm to run it; `tell`: a
        grant is DMed (a retry after the controller came back: nobody is waiting for a
        reply)."""
        with transaction(self.service.engine, write=False) as s:
            res = s.get(Reservation, reservation_id)
            if res is None or res.state != RES_WAITING or not self._cluster_has(res.gpu_model):
                return None
        try:
            job_id = self._submit(reservation_id)
        except SlurmUnavailable as exc:
            self._note(reservation_id, {"error": f"controller not answering: {exc}"})
            return (
                "Slurm's controller is not answering: the reservation waits here and goes to "
                "Slurm when it answers."
            )
        except SlurmError as exc:
            self._cancel_refused(reservation_id, str(exc))
            raise UserError(f"Slurm refused the reservation: {exc}.") from None
        except UserError as exc:  # the cluster's rules (bot.providers.slurm.lab)
            self._cancel_refused(reservation_id, exc.text)
            raise
        # Its start is learnt from the file the job writes as it starts (no RPC): on an
        # idle cluster that is within a second; then one read says why it pends.
        deadline = time.monotonic() + self.hold_wait_s
        while True:
            started = self._started(reservation_id, job_id)
            if started is not None and self._grant(
                reservation_id, job_id, started.node, started.gpu_indexes, tell=tell
            ):
                return f"Slurm job {job_id} holds them."
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        job = self.cluster.job_now(job_id)
        if job is not None and job.state == "RUNNING":
            node, indexes = self._where(job)
            if node is not None and self._grant(reservation_id, job_id, node, indexes, tell=tell):
                return f"Slurm job {job_id} holds them."
        self._pending(reservation_id, job)
        return (
            f"{pending_words(job, self._now(), self.service.settings.timezone)}; it is granted "
            "when Slurm starts it, and I'll DM you then."
        )

    def let_go(self, reservation_ids: Sequence[int]) -> None:
        with transaction(self.service.engine, write=False) as s:
            jobs = [
                (int(r.external["job"]), r.external.get("as"))
                for r in s.exec(
                    select(Reservation).where(col(Reservation.id).in_(list(reservation_ids)))
                )
                if isinstance((r.external or {}).get("job"), int)
            ]
        for job_id, person in jobs:
            try:
                self.client.cancel(job_id, user=person)
            except SlurmError as exc:  # the next sync cancels it again
                log.warning("could not cancel holding job %s: %s", job_id, exc)
            else:
                self._cancelled.add(job_id)

    def extend(self, reservation_id: int, total_s: int) -> None:
        with transaction(self.service.engine, write=False) as s:
            res = s.get(Reservation, reservation_id)
            job = (res.external or {}).get("job") if res is not None else None
            person = (res.external or {}).get("as") if res is not None else None
        if not isinstance(job, int):
            return
        try:
            self.client.set_time_limit(job, total_s, user=person)
        except SlurmError as exc:
            raise UserError(
                f"Slurm refused to extend holding job {job}: {exc}. The reservation is as it was."
            ) from None

    def sync(self) -> int:
        """From the files jobs write as they start (no RPC) and the shared read of the
        cluster (once a cache period): grants, pending reasons, ends (Slurm's own record
        of the end, from accounting), and holding jobs left behind."""
        snap = self.cluster.read()
        if snap is None:
            return 0
        jobs = {j.job_id: j for j in snap.jobs}
        changed = 0
        with transaction(self.service.engine, write=False) as s:
            open_res = list(
                s.exec(select(Reservation).where(col(Reservation.state).in_(RES_OPEN_STATES)))
            )
            open_ids = {r.id for r in open_res}
        for res in open_res:
            assert res.id is not None
            ext = res.external or {}
            job_id = ext.get("job")
            if not isinstance(job_id, int):
                if res.state == RES_WAITING and ext.get("error"):
                    # The controller is back: submitted now, the owner told when granted.
                    changed += int(self._hold(res.id, tell=True) is not None)
                continue
            job = jobs.get(job_id)
            if res.state == RES_WAITING:
                node: str | None
                started = self._started(res.id, job_id)
                if started is not None:
                    node, indexes = started.node, started.gpu_indexes
                elif job is not None and job.state == "RUNNING":
                    node, indexes = self._where(job)
                else:
                    node, indexes = None, ()
                if node is not None and self._grant(res.id, job_id, node, indexes, tell=True):
                    changed += 1
                    continue
            if job is None and _newer_than(ext.get("submitted"), snap.taken):
                continue  # submitted after the shared read: it is not in it yet
            if job is not None and job.state in ("RUNNING", "COMPLETING", "CONFIGURING"):
                continue
            if job is not None and job.state == "PENDING":
                if res.state == RES_WAITING:
                    self._pending(res.id, job)
                continue
            changed += int(self._ended(res.id, job_id, job))
        # Holding jobs whose reservation ended meanwhile (a release while Slurm was down).
        for job in snap.jobs:
            rid = gpubot_id(job, HOLD_PREFIX)
            if (
                rid is not None
                and rid not in open_ids
                and not job.finished
                and job.job_id not in self._cancelled  # ended since the shared read
            ):
                try:
                    self.client.cancel(job.job_id, user=job.user or None)
                except SlurmError as exc:
                    log.warning("could not cancel holding job %s: %s", job.job_id, exc)
                else:
                    self._cancelled.add(job.job_id)
        return changed

    # --- steps ------------------------------------------------------------------------

    def _started_path(self, reservation_id: int) -> str:
        return f"{self.workdir}/jobs/{job_name('res', reservation_id)}.started"

    def _started(self, reservation_id: int, job_id: int) -> StartedLine | None:
        """The start the holding job wrote (its node and GPUs), if it is this job's."""
        try:
            raw = self.files.read_file(self.target, self._started_path(reservation_id))
        except SshError:
            return None
        line = parse_started(raw.decode("utf-8", "replace")) if raw else None
        return line if line is not None and line.job_id == job_id else None

    def _submit(self, reservation_id: int) -> int:
        with transaction(self.service.engine, write=False) as s:
            res = s.get(Reservation, reservation_id)
            assert res is not None
            owner = s.get(User, res.user_id)
            assert owner is not None
            request = PlaceRequest(
                user_key=owner.key,
                gpus=res.gpu_count,
                model=res.gpu_model,
                seconds=res.duration_s,
                place=dict(res.place or {}),
            )
            who = f"reservation {reservation_id} of {owner.key}"
        plan = self.lab.plan(request)
        started = self._started_path(reservation_id)
        prepare_jobs_dir(self.files, self.target, self.workdir, started)
        spec = self.lab.spec(
            plan,
            name=job_name("res", reservation_id),
            argv=("sleep", str(plan.fit.time_limit_s + 60)),
            workdir=self.workdir,
            who=who,
            gpus=request.gpus,
            model=request.model,
            output="/dev/null",
            started_file=started,
        )
        job_id = int(self.client.submit(spec, self._nodes()))
        self._note(
            reservation_id,
            {
                "job": job_id,
                "state": "PENDING",
                "as": plan.person,
                "partition": plan.fit.partition,
                "submitted": self._now().isoformat(),
            },
        )
        return job_id

    def _nodes(self) -> Any:
        snap = self.cluster.read()
        return list(snap.nodes) if snap is not None else None

    def _note(self, reservation_id: int, external: dict[str, Any]) -> None:
        with transaction(self.service.engine) as s:
            res = locked(s, Reservation, reservation_id)
            if res is not None:
                res.external = external
                s.add(res)

    def _pending(self, reservation_id: int, job: SlurmJob | None) -> None:
        if job is None:
            return
        with transaction(self.service.engine) as s:
            res = locked(s, Reservation, reservation_id)
            if res is None or res.state != RES_WAITING:
                return
            ext = dict(res.external or {})
            start = job.expected_start
            new = {
                **ext,
                "state": job.state,
                "reason": job.reason,
                "expected": start.isoformat() if start else None,
            }
            if new != ext:
                res.external = new
                s.add(res)

    def _cancel_refused(self, reservation_id: int, why: str) -> None:
        with transaction(self.service.engine) as s:
            lock_pool(s)
            res = locked(s, Reservation, reservation_id)
            if res is not None and res.state == RES_WAITING:
                res.external = {"refused": why}
                end_reservation(s, res, RES_CANCELLED, self._now())

    def _where(self, job: SlurmJob) -> tuple[str | None, tuple[int, ...]]:
        """A running job's node and GPU indexes, from the shared read (or one `scontrol
        show job -d` where this Slurm's squeue JSON lacks them)."""
        node, indexes = next(iter(job.gpu_indexes.items()), (None, ()))
        if node is None or not indexes:
            try:
                indexes_map = self.client.gpu_indexes(job.job_id)
            except SlurmError:
                return None, ()
            node, indexes = next(iter(indexes_map.items()), (None, ()))
        return node, tuple(indexes)

    def _grant(
        self,
        reservation_id: int,
        job_id: int,
        node: str,
        indexes: tuple[int, ...],
        *,
        tell: bool = False,
    ) -> bool:
        """The holding job runs: the reservation is granted on its node's GPUs, metered
        from now at the team's rate; `tell`: its owner gets the granted DM."""
        now = self._now()
        with transaction(self.service.engine) as s:
            lock_pool(s)
            res = locked(s, Reservation, reservation_id)
            if res is None or res.state != RES_WAITING:
                return False
            host = s.exec(select(Host).where(Host.name == node)).first()
            if host is None:
                return False
            gpus = list(
                s.exec(select(Gpu).where(Gpu.host_id == host.id, col(Gpu.index).in_(list(indexes))))
            )
            res.state = RES_ACTIVE
            res.granted_at = now
            res.ends_at = now + timedelta(seconds=res.duration_s)
            res.host_id = host.id
            res.external = {
                **(res.external or {}),
                "state": "RUNNING",
                "node": node,
                "how": [f"srun --jobid {job_id} --overlap --pty bash"],
            }
            s.add(res)
            s.flush()
            rate = self.rates.get(gpus[0].model) if gpus else None
            self.service.open_usage(
                s, host, gpus, res.user_id, now, reservation_id=res.id, usd_per_gpu_hour=rate or 0.0
            )
            if tell:
                info = reservation_info(s, res)
                self.service.notify_dm(
                    s,
                    info.user_key,
                    views.granted_view(info, now, self.service.settings.timezone, was_waiting=True),
                    now,
                    dedupe=f"granted:{res.id}",
                )
        return True

    def _ended(self, reservation_id: int, job_id: int, job: SlurmJob | None) -> bool:
        """Slurm ended (or forgot) the holding job: its reservation ends at Slurm's own
        record of the end (accounting: sacct, or the jobcomp file), its owner told why
        when it was not gpubot that ended it."""
        now = self._now()
        end: JobEnd | None = None
        if job is None or job.end_time is None:
            try:
                end = self.client.final_state(job_id)
            except SlurmError as exc:
                log.warning("could not read the end of holding job %s: %s", job_id, exc)
        state = job.state if job is not None else (end.state if end is not None else "ended")
        ended_at = job.end_time if job is not None and job.end_time else None
        if ended_at is None and end is not None:
            ended_at = end.end_time
        by = ""
        if end is not None and end.by.isdigit():
            by = self.client.user_name(int(end.by))
        with transaction(self.service.engine) as s:
            lock_pool(s)
            res = locked(s, Reservation, reservation_id)
            if res is None or res.state not in RES_OPEN_STATES:
                return False
            was_active = res.state == RES_ACTIVE
            at = now if ended_at is None else min(now, max(ended_at, res.granted_at or ended_at))
            due = res.ends_at is not None and res.ends_at <= at + timedelta(seconds=60)
            end_reservation(
                s,
                res,
                RES_EXPIRED if due else (RES_RELEASED if was_active else RES_CANCELLED),
                at,
            )
            if not due:
                info = reservation_info(s, res)
                whom = f" by {by}" if by else ""
                text = (
                    f"Reservation #{res.id} ended: Slurm ended its holding job {job_id} "
                    f"({state}{whom})."
                )
                self.service.notify_dm(
                    s, info.user_key, views.message(text).view, now, dedupe=f"slurm-ended:{res.id}"
                )
        return True


def _newer_than(iso: object, taken: datetime) -> bool:
    """Whether a reservation's submission (its ISO time) came after a shared read."""
    if not isinstance(iso, str):
        return False
    try:
        return datetime.fromisoformat(iso) >= taken
    except ValueError:
        return False


def prepare_jobs_dir(files: HostShell, target: SshTarget, workdir: str, started: str) -> None:
    """`<workdir>/jobs`, where the jobs (the people's accounts) write their started files:
    group-writable and setgid, so it works where the work directory's group holds every
    job account (docs/SLURM.md); a stale file of an earlier attempt is removed."""
    jobs = f"{workdir}/jobs"
    # chmod only where the bot owns it (an admin may have made it so already).
    line = (
        shell.join(["mkdir", "-p", "--", jobs])
        + " && { "
        + shell.join(["chmod", "2770", "--", jobs])
        + " 2>/dev/null || true; } && "
        + shell.join(["rm", "-f", "--", started])
    )
    done = files.run(target, line, timeout=30)
    if not done.ok:
        raise SlurmError(f"cannot prepare {jobs}: {done.stderr.strip()[-200:]}")
