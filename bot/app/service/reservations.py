"""Reservations: reserve (granted at once or put in line), release, extend, and the tick
that expires them, warns before their end and grants the line. Each is one transaction
that takes the pool first (db.session's lock order)."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlalchemy import and_, or_
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from bot.app.access import audit
from bot.app.money import budgets
from bot.app.ports import Actor, Core, PlaceRequest
from bot.app.service.common import (
    TickReport,
    end_reservation,
    owned_reservation,
    released_info,
    reservation_info,
)
from bot.app.service.grants import Grants
from bot.app.watching.held import GpuCount, gpu_counts
from bot.domain import views
from bot.domain.commands import Extend, Release, Reserve
from bot.domain.durations import format_duration
from bot.domain.errors import UserError
from db.models import (
    HOST_READY,
    RES_ACTIVE,
    RES_CANCELLED,
    RES_EXPIRED,
    RES_OPEN_STATES,
    RES_RELEASED,
    RES_WAITING,
    Host,
    Reservation,
    User,
)
from db.session import lock_pool, locked_rows, retrying, transaction

log = logging.getLogger(__name__)


class Reservations:
    """The reservation verbs and their clock."""

    def __init__(self, core: Core, grants: Grants) -> None:
        self.core = core
        # The grant pass these verbs end in, with the GPU counts a reserve already read.
        self.grants = grants

    def reserve(self, actor: Actor, cmd: Reserve, request_key: str | None = None) -> views.Reply:
        """Granted at once, or put in line; a request for a cluster's GPUs is then handed
        to its holder (a Slurm holding job), after the line committed: a cluster answers
        slowly, or not at all while its controller is down, and the pool must not wait."""
        # The place's own rules first (a cluster: who may, which partition allows it),
        # before anything is put in line.
        duration = cmd.duration or self.core.settings.default_duration
        note = self.core.holder.admit(
            PlaceRequest(
                user_key=actor.key,
                gpus=cmd.count,
                model=cmd.model or self.core.settings.default_gpu,
                seconds=int(duration.total_seconds()),
                place=dict(cmd.place),
            )
        )
        reply, waiting = self._put_in_line(actor, cmd, request_key)
        if waiting is None:
            return reply.with_note(note)
        said = self.core.holder.hold(waiting)
        if said is None:
            return reply.with_note(note)
        with transaction(self.core.engine, write=False) as s:
            res = s.get(Reservation, waiting)
            assert res is not None
            info = reservation_info(s, res)
            if res.state == RES_ACTIVE:  # the cluster granted it at once
                now = self.core.clock.now()
                granted = views.granted_view(info, now, self.core.settings.timezone)
                return views.Reply(granted).with_note(note)
            return views.Reply(views.waiting_view(info, (said,))).with_note(note)

    @retrying
    def _put_in_line(
        self, actor: Actor, cmd: Reserve, request_key: str | None
    ) -> tuple[views.Reply, int | None]:
        """The reply, and the reservation's id when it waits (None: granted, or refused)."""
        duration = cmd.duration or self.core.settings.default_duration
        if duration > self.core.settings.max_duration:
            raise UserError(
                f"A reservation can last at most {format_duration(self.core.settings.max_duration)}; "
                f"ask for less, and `/gpu extend` later if you need it.",
                "/gpu reserve [COUNT] [MODEL] [for DURATION]",
            )
        model = cmd.model or self.core.settings.default_gpu
        try:
            with transaction(self.core.engine) as s:
                # The pool first (db.session's lock order): the grant pass below needs it,
                # and a second delivery of this request waits here and then finds the first.
                lock_pool(s)
                if request_key and (prior := self._by_request_key(s, request_key)) is not None:
                    return self._already(s, prior), None
                # The fleet's GPU counts, read once under the pool: for the check and for
                # this request's grant pass.
                counts = gpu_counts(s)
                self._check_feasible(model, cmd.count, counts)
                user = self.core.user_row(s, actor.key, actor.name)
                now = self.core.clock.now()
                # Budget (bot.app.money.budgets): refused here, before it waits or is granted; its
                # estimate from the counts just read (the dearest share of the model).
                estimate = None
                if user.budget_usd is not None:
                    estimate = budgets.reservation_estimate(
                        s, model, cmd.count, int(duration.total_seconds()), counts
                    )
                    budgets.check_budget(
                        s,
                        user,
                        estimate,
                        now,
                        self.core.settings,
                        what=f"Reserving {views.gpu_phrase(cmd.count, model)} for {format_duration(duration)}",
                    )
                res = Reservation(
                    user_id=user.id,  # type: ignore[arg-type]
                    gpu_model=model,
                    gpu_count=cmd.count,
                    duration_s=int(duration.total_seconds()),
                    state=RES_WAITING,
                    requested_at=now,
                    request_key=request_key,
                    place=dict(cmd.place),
                )
                s.add(res)  # written by the grant pass, granted or still waiting
                if estimate is not None:  # its grant below need not check again
                    budgets.checked_request(s, res, estimate, now)
                self.grants.grant_pass(s, now, new=res, counts=counts)
                s.flush()
                info = reservation_info(s, res)
                if res.state == RES_ACTIVE:
                    granted = views.granted_view(info, now, self.core.settings.timezone)
                    return views.Reply(granted), None
                why = self._unready(s, model, cmd.count, counts, now)
                return views.Reply(views.waiting_view(info, why)), res.id
        except IntegrityError:
            if not request_key:
                raise
            # The same request delivered twice at once: the other copy won the insert.
            with transaction(self.core.engine, write=False) as s:
                prior = self._by_request_key(s, request_key)
                if prior is None:
                    raise
                return self._already(s, prior), None

    def _already(self, s: Session, prior: Reservation) -> views.Reply:
        """The reply to a request delivered again: what its first delivery made."""
        return views.Reply(
            views.already_view(
                reservation_info(s, prior), self.core.clock.now(), self.core.settings.timezone
            )
        )

    def _unready(
        self, s: Session, model: str | None, count: int, counts: list[GpuCount], now: datetime
    ) -> tuple[str, ...]:
        """Why hosts that have GPUs for this request grant nothing now (not answered yet,
        or down), in status's words: a reservation left waiting on them says so. Read only
        when it waits, so a granted reserve pays nothing for it."""
        fits: dict[int, int] = {}
        for c in counts:
            if c.host_state != HOST_READY and model in (None, c.model):
                fits[c.host_id] = fits.get(c.host_id, 0) + c.present
        ids = [host_id for host_id, n in fits.items() if n >= count]
        if not ids:
            return ()
        tz = self.core.settings.timezone
        notes = []
        for host in s.exec(select(Host).where(col(Host.id).in_(ids)).order_by(col(Host.id))):
            trouble = views.host_trouble(host.state, host.down_since, host.down_reason, now, tz)
            if trouble is not None:
                notes.append(f"{host.name} is {trouble}.")
        return tuple(notes)

    def _by_request_key(self, s: Session, key: str) -> Reservation | None:
        return s.exec(select(Reservation).where(Reservation.request_key == key)).first()

    def _check_feasible(self, model: str | None, count: int, counts: list[GpuCount]) -> None:
        """Refuses up front what could never be granted, instead of an endless wait.
        From the grouped counts (bot.app.watching.held.gpu_counts) that the reserve's grant pass
        uses too, not the status read model: it runs in every reservation's transaction,
        under the pool lock, so a burst of them waits on its length."""
        if model is not None and self.core.supply.can_have(model, count):
            return
        per_host: dict[int, int] = {}
        seen: set[str] = set()
        for c in counts:
            seen.add(c.model)
            if model is None or c.model == model:
                per_host[c.host_id] = per_host.get(c.host_id, 0) + c.present
        biggest = max(per_host.values(), default=0)
        if biggest >= count:
            return
        have = sorted(seen)
        what = views.gpu_phrase(count, model)
        if biggest == 0:
            models = ", ".join(have) if have else "none"
            raise UserError(
                f"No host here has {model if model else 'any'} GPUs (this pool has: {models}).",
                "/gpu reserve [COUNT] [MODEL] [for DURATION]",
            )
        raise UserError(
            f"No single host has {what}; the most on one host is {biggest}.",
            "/gpu reserve [COUNT] [MODEL] [for DURATION]",
        )

    def release(self, actor: Actor, cmd: Release) -> views.Reply:
        reply, ended = self._release(actor, cmd)
        self.core.holder.let_go(ended)  # a cluster's holding jobs end too (after commit)
        return reply

    @retrying
    def _release(self, actor: Actor, cmd: Release) -> tuple[views.Reply, list[int]]:
        with transaction(self.core.engine) as s:
            # The pool, then each reservation under its lock: what is ended is the state
            # as it is now, never a "waiting" read before a grant pass made it active.
            lock_pool(s)
            user = self.core.user_row(s, actor.key, actor.name)
            now = self.core.clock.now()
            targets = self._targets(
                s,
                actor,
                user,
                cmd.reservation_id,
                verb="release",
                usage="/gpu release [ID|all]",
                none_text="You hold no GPUs and are not waiting for any.",
                all_ok=cmd.all,
            )
            done = []
            for res in targets:
                end_reservation(
                    s, res, RES_RELEASED if res.state == RES_ACTIVE else RES_CANCELLED, now
                )
                if res.user_id == user.id:
                    # The reply names the reservation only: the host and its GPUs are
                    # not read back (two statements of every release).
                    done.append(released_info(res, user))
                    continue
                # An admin's release: its holder gets a DM that says which GPUs.
                info = reservation_info(s, res)
                done.append(info)
                audit(actor, "release", f"reservation #{res.id} of {info.user_key}", session=s)
                self.core.notify_dm(
                    s,
                    info.user_key,
                    views.released_by_admin_dm(info, actor.name),
                    now,
                    dedupe=f"admin-release:{res.id}",
                )
            self.grants.grant_pass(s, now)
            ended = [r.id for r in targets if r.id is not None]
            return views.Reply(views.released_view(done, actor.key)), ended

    def _targets(
        self,
        s: Session,
        actor: Actor,
        user: User,
        reservation_id: int | None,
        *,
        verb: str,
        usage: str,
        none_text: str,
        all_ok: bool | None,
    ) -> list[Reservation]:
        """What a release or an extend acts on, each read under its lock after the pool
        (db.session's lock order), with the same refusals for both: the reservation
        named (it must exist, be the caller's unless an admin asks, and be open), or
        the caller's open ones, at least one and more only when `all_ok` (None: a verb
        that has no `all`, so the refusal does not offer it)."""
        if reservation_id is not None:
            res = owned_reservation(s, actor, user, reservation_id, verb=verb, usage=usage)
            if res.state not in RES_OPEN_STATES:
                raise UserError(f"Reservation #{res.id} is already {res.state}.", usage)
            return [res]
        targets = locked_rows(
            s,
            select(Reservation)
            .where(Reservation.user_id == user.id, col(Reservation.state).in_(RES_OPEN_STATES))
            .order_by(col(Reservation.id)),
        )
        if not targets:
            raise UserError(none_text, usage)
        if len(targets) > 1 and not all_ok:
            ids = ", ".join(f"#{r.id}" for r in targets)
            offer = "say which." if all_ok is None else "say which, or `all`."
            raise UserError(f"You have {len(targets)} reservations ({ids}); {offer}", usage)
        return targets

    @retrying
    def extend(self, actor: Actor, cmd: Extend) -> views.Reply:
        usage = "/gpu extend [ID] DURATION"
        with transaction(self.core.engine) as s:
            # The length decides when it ends and what a grant sets: under the pool, with
            # the row read under its lock (db.session's lock order).
            lock_pool(s)
            user = self.core.user_row(s, actor.key, actor.name)
            now = self.core.clock.now()
            [res] = self._targets(
                s,
                actor,
                user,
                cmd.reservation_id,
                verb="extend",
                usage=usage,
                none_text="You have no reservation to extend.",
                all_ok=None,
            )
            total = timedelta(seconds=res.duration_s) + cmd.duration
            if total > self.core.settings.max_duration:
                left = self.core.settings.max_duration - timedelta(seconds=res.duration_s)
                can = f"at most {format_duration(left)} more" if left > timedelta(0) else "no more"
                raise UserError(
                    f"A reservation can last at most {format_duration(self.core.settings.max_duration)}; "
                    f"#{res.id} can take {can}.",
                    usage,
                )
            # A cluster's holding job is given the time first: its refusal (the bot is
            # not a Slurm operator) leaves the reservation as it was.
            assert res.id is not None
            self.core.holder.extend(res.id, int(total.total_seconds()))
            if res.user_id != user.id:
                holder = s.get(User, res.user_id)
                target = f"reservation #{res.id} of {holder.key if holder else res.user_id}"
                audit(actor, "extend", f"{target} by {format_duration(cmd.duration)}", session=s)
            res.duration_s = int(total.total_seconds())
            if res.state == RES_ACTIVE:
                assert res.granted_at is not None
                res.ends_at = res.granted_at + total
                res.warned_at = None
            s.add(res)
            s.flush()
            info = reservation_info(s, res)
            if res.state == RES_WAITING:
                text = f"Reservation #{res.id} is still waiting; it will last {format_duration(total)} once granted."
                return views.message(text)
            return views.Reply(
                views.extended_view(info, now, self.core.settings.timezone, cmd.duration)
            )

    def tick(self) -> TickReport:
        """A cluster's holds looked at (granted, ended, submitted), then what is due
        ended, what is near warned and what became free granted; the holding jobs of what
        expired end too. Idempotent."""
        self.core.holder.sync()
        report, expired = self._tick()
        if expired:
            self.core.holder.let_go(expired)
        return report

    @retrying
    def _tick(self) -> tuple[TickReport, list[int]]:
        """Ends what is due, warns what is near, grants what became free. Idempotent.

        Most ticks have nothing to do: one indexed read says so without the write
        transaction and the pool lock. What
        becomes due after that read is done by the next tick, as it would be had this
        tick run a moment earlier; a request that starts waiting runs its own grant pass.
        """
        now = self.core.clock.now()
        lead = self.core.settings.expiry_warning
        with transaction(self.core.engine, write=False) as s:
            due = s.exec(
                select(Reservation.id)
                .where(
                    or_(
                        col(Reservation.state) == RES_WAITING,
                        and_(
                            col(Reservation.state) == RES_ACTIVE,
                            or_(
                                col(Reservation.ends_at) <= now,
                                and_(
                                    col(Reservation.warned_at).is_(None),
                                    col(Reservation.ends_at) <= now + lead,
                                ),
                            ),
                        ),
                    )
                )
                .limit(1)
            ).first()
        if due is None:
            return TickReport(expired=0, warned=0, granted=0), []
        with transaction(self.core.engine) as s:
            lock_pool(s)  # expiry frees GPUs: the pool first (db.session's lock order)
            now = self.core.clock.now()
            expired = 0
            ended: list[int] = []
            for res in locked_rows(
                s,
                select(Reservation)
                .where(Reservation.state == RES_ACTIVE, col(Reservation.ends_at) <= now)
                .order_by(col(Reservation.id)),
            ):
                assert res.ends_at is not None
                end_reservation(s, res, RES_EXPIRED, res.ends_at)
                info = reservation_info(s, res)
                self.core.notify_dm(
                    s, info.user_key, views.expired_view(info), now, dedupe=f"expired:{res.id}"
                )
                expired += 1
                if res.id is not None:
                    ended.append(res.id)
            warned = 0
            lead = self.core.settings.expiry_warning
            for res in locked_rows(
                s,
                select(Reservation)
                .where(
                    Reservation.state == RES_ACTIVE,
                    col(Reservation.warned_at).is_(None),
                    col(Reservation.ends_at) <= now + lead,
                )
                .order_by(col(Reservation.id)),
            ):
                assert res.ends_at is not None and res.granted_at is not None
                res.warned_at = now
                s.add(res)
                # A reservation shorter than the warning lead needs no warning: its
                # holder asked for that little time a moment ago.
                if res.ends_at - res.granted_at <= lead:
                    continue
                info = reservation_info(s, res)
                self.core.notify_dm(
                    s,
                    info.user_key,
                    views.expiry_warning_view(info, now, self.core.settings.timezone),
                    now,
                    dedupe=f"warn:{res.id}:{res.ends_at.isoformat()}",
                )
                warned += 1
            granted = self.grants.grant_pass(s, now)
            return TickReport(expired=expired, warned=warned, granted=granted), ended
