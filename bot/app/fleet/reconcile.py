"""Cloud → database: the cloud's live instances synced into host rows (a running one is
ready only once SSH answers and it is prepared), launches that a crash left unrecorded
adopted by their request key, and hosts whose instance vanished ended with what they
held (reservations end, runs go back in line, each owner told)."""

from __future__ import annotations

import logging
from dataclasses import replace

from sqlmodel import col, select

from bot.app.fleet.common import (
    PENDING_GRACE,
    REQ_PENDING,
    FleetContext,
    ReconcileReport,
    mark_failed,
    mark_launched,
    text_view,
)
from bot.app.money.billing import note_host_state
from bot.app.watching.held import end_held
from db.models import (
    HOST_PENDING,
    HOST_READY,
    HOST_TERMINATED,
    HOST_UNREACHABLE,
    RES_ACTIVE,
    RES_RELEASED,
    RUN_CANCELLED,
    RUN_CANCELLING,
    RUN_QUEUED,
    RUN_RUNNING,
    RUN_STARTING,
    Host,
    LaunchRequest,
    Reservation,
    TrainingRun,
    User,
)
from db.session import lock_pool, locked_rows, retrying, transaction
from provisioning.base import Instance

log = logging.getLogger(__name__)


class Reconciler:
    """What the cloud has, made true in the database."""

    def __init__(self, ctx: FleetContext) -> None:
        self.ctx = ctx

    def refresh(self) -> list[Instance]:
        """Syncs the cloud's live instances into host rows; returns them as listed.

        A running instance becomes a ready host only once SSH answers and the host is
        prepared (bootstrap, once per host and process); until then it is pending (billed,
        not grantable), or down after a failed setup. A host already ready is not probed
        again. With an off-tick setup (`ctx.setup`, bot.app.hosts.hostcheck) nothing is dialled
        here: the instance stays as the setup left it and the setup pool is nudged, so a
        70 s bootstrap never holds the fleet's lock; without one (tests about something
        else) the instance is prepared here, inline.
        """
        live = self.ctx.compute.list_instances()
        with transaction(self.ctx.engine, write=False) as s:
            known = {
                h.instance_id: h.state
                for h in s.exec(select(Host).where(Host.provider == self.ctx.compute.name))
                if h.instance_id
            }
        synced = []
        for inst in live:
            was = known.get(inst.instance_id or "")
            if inst.state == HOST_READY and was != HOST_READY:
                if self.ctx.setup is None:
                    if not self.ctx.access.reachable(inst):
                        inst = replace(inst, state=HOST_PENDING)
                elif self.ctx.access.prepared(inst.name) is None:
                    inst = replace(
                        inst, state=HOST_UNREACHABLE if was == HOST_UNREACHABLE else HOST_PENDING
                    )
            synced.append(inst)
        if synced:
            self.ctx.service.sync_hosts(synced)
        if self.ctx.setup is not None:
            self.ctx.setup()
        return live

    def reconcile(self) -> ReconcileReport:
        """Cloud vs database: adopt what we launched but did not record, end what vanished."""
        live = self.refresh()
        now = self.ctx.service.clock.now()
        live_ids = {i.instance_id for i in live if i.instance_id}
        adopted: list[str] = []
        failed: list[str] = []
        with transaction(self.ctx.engine, write=False) as s:
            pending = list(s.exec(select(LaunchRequest).where(LaunchRequest.state == REQ_PENDING)))
        for req in pending:
            inst = self.ctx.compute.find_by_request_key(req.request_key)
            if inst is not None:
                if inst.state != HOST_TERMINATED and inst.instance_id not in live_ids:
                    self.ctx.service.sync_hosts([replace(inst, state=HOST_PENDING)])
                mark_launched(self.ctx, req.request_key, inst, adopted=True)
                adopted.append(inst.instance_id or inst.name)
                log.warning(
                    "adopted %s, launched for %s but never recorded (a crash?)",
                    inst.instance_id,
                    req.request_key,
                )
            elif now - req.created_at > PENDING_GRACE:
                mark_failed(
                    self.ctx, req.request_key, "no instance was launched (the worker stopped)"
                )
                failed.append(req.request_key)
        lost: list[str] = []
        with transaction(self.ctx.engine, write=False) as s:
            gone = [
                h
                for h in s.exec(
                    select(Host).where(
                        Host.provider == self.ctx.compute.name, Host.state != HOST_TERMINATED
                    )
                )
                if h.instance_id and h.instance_id not in live_ids
            ]
        for host in gone:
            # A listing can lag a launch (describe is eventually consistent on EC2): ask
            # for the one instance before declaring it gone.
            assert host.instance_id is not None
            again = self.ctx.compute.get(host.instance_id)
            if again is not None and again.state != HOST_TERMINATED:
                continue
            self._lost(host.name)
            lost.append(host.instance_id or host.name)
        return ReconcileReport(adopted=tuple(adopted), lost=tuple(lost), failed=tuple(failed))

    @retrying
    def _lost(self, host_name: str) -> None:
        """The cloud ended this instance (spot reclaim, someone in the console): whatever
        held it is over — reservations end, runs go back in line, each owner is told."""
        with transaction(self.ctx.engine) as s:
            # Usage closes and states end here: the pool first, then every row read after
            # it is current (db.session's lock order).
            lock_pool(s)
            now = self.ctx.service.clock.now()
            host = s.exec(select(Host).where(Host.name == host_name)).one()
            if host.state == HOST_TERMINATED:
                return
            host.state = HOST_TERMINATED
            host.updated_at = now
            s.add(host)
            s.flush()
            note_host_state(s, host, now, self.ctx.settings)
            what = f"{host.instance_id} ({host.instance_type})"
            for res in locked_rows(
                s,
                select(Reservation)
                .where(Reservation.host_id == host.id, Reservation.state == RES_ACTIVE)
                .order_by(col(Reservation.id)),
            ):
                end_held(s, now, reservation_id=res.id)
                res.state = RES_RELEASED
                res.ended_at = now
                s.add(res)
                owner = s.get(User, res.user_id)
                assert owner is not None
                text = (
                    f"Your reservation #{res.id} has ended: its instance {what} was terminated "
                    "by the cloud. `/gpu reserve` asks again."
                )
                self.ctx.service.notify_dm(
                    s, owner.key, text_view(text), now, dedupe=f"fleet-lost-res:{res.id}"
                )
            # Under their locks: a cancel that landed meanwhile is seen, not overwritten.
            for run in locked_rows(
                s,
                select(TrainingRun)
                .where(
                    TrainingRun.host_id == host.id,
                    col(TrainingRun.state).in_((RUN_STARTING, RUN_RUNNING, RUN_CANCELLING)),
                )
                .order_by(col(TrainingRun.id)),
            ):
                end_held(s, now, run_id=run.id)
                owner = s.get(User, run.user_id)
                assert owner is not None
                if run.state == RUN_CANCELLING:
                    run.state = RUN_CANCELLED
                    run.finished_at = now
                    text = f"Run #{run.id} is cancelled: its instance {what} was terminated."
                else:
                    run.state = RUN_QUEUED
                    run.started_at = None
                    run.host_id = None
                    # A checkpoint the worker already copied off (bot.app.hosts.agentwatch) goes with it.
                    resume = run.placement.get("resume_from")
                    run.placement = {"resume_from": resume} if resume else {}
                    start = (
                        "It resumes from the checkpoint saved off that instance."
                        if resume
                        else "It starts again from the beginning (or its last checkpoint, "
                        "if it saves them elsewhere)."
                    )
                    text = (
                        f"Run #{run.id} is back in line: its instance {what} was terminated by "
                        f"the cloud. {start}"
                    )
                s.add(run)
                self.ctx.service.notify_dm(
                    s,
                    owner.key,
                    text_view(text),
                    now,
                    dedupe=f"fleet-lost-run:{run.id}:{host.instance_id}",
                )
            # Anything else still open on it (a safety net): nobody can hold a GPU that is gone.
            end_held(s, now, host_id=host.id)
        log.warning("host %s: its instance is gone from the cloud; marked terminated", host_name)
