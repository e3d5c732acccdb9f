"""The grant pass: waiting reservations granted in order while GPUs allow, by best fit,
with the budget checked at the grant; and the usage intervals that start the clock on
a GPU for a reservation or a run (bot.app.ports.Core)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime, timedelta
from decimal import Decimal

from sqlalchemy import func, insert
from sqlmodel import Session, col, select

from bot.app.money import budgets
from bot.app.ports import Core, GpuRef
from bot.app.service.common import (
    GRANTED,
    FreeGpu,
    PricedHost,
    ShownHost,
    end_reservation,
    pick_gpus,
    reservation_info,
    to_host_state,
)
from bot.app.watching.held import GpuCount, free_gpus, gpu_counts
from bot.domain import views
from bot.domain.errors import UserError
from db.models import (
    HOST_READY,
    MARKET_CLUSTER,
    RES_ACTIVE,
    RES_CANCELLED,
    RES_WAITING,
    Gpu,
    Reservation,
    UsageInterval,
)
from db.session import core, lock_pool, locked_rows
from provisioning.costs import gpu_share

log = logging.getLogger(__name__)

_INSERT_INTERVAL = insert(UsageInterval.__table__)  # type: ignore[attr-defined]
_ANYONE_WAITING = select(Reservation.id).where(Reservation.state == RES_WAITING).limit(1)


class Grants:
    """GPUs given out, and metered from that instant."""

    def __init__(self, core: Core) -> None:
        self.core = core

    def grant_pass(
        self,
        s: Session,
        now: datetime,
        new: Reservation | None = None,
        counts: list[GpuCount] | None = None,
    ) -> int:
        """Grants waiting reservations in order while GPUs allow; returns how many.

        A request that cannot be granted blocks later requests for the same GPUs
        (first come, first served per model); a later request for another model
        may go ahead. `new` is a reserve's own request, added to the session but not
        yet written: it is last in line, its reply says the result (so it gets no DM),
        and it is inserted as it ends up (granted or waiting), never inserted waiting
        and then updated. `counts` are the fleet's GPU counts when the caller read them
        already under the pool (a reserve).
        """
        # Serializes grant passes; the callers took it already, first (db.session).
        lock_pool(s)
        # Most ticks and every release with nobody in line: one indexed query, no fleet.
        # A reserve (`new`) has just put its own request in line, so it skips that.
        if new is None and core(s).execute(_ANYONE_WAITING).first() is None:
            return 0
        # How many GPUs each ready host has free, per model, in one grouped query
        # (bot.app.watching.held.gpu_counts): best fit needs no more to choose a host, and only the
        # chosen host's free GPUs are then read. The tick and each reserve stay flat as the
        # fleet grows: reading (and weighing) every GPU of a hundred hosts was most of a
        # reserve's time.
        free: dict[tuple[int, str], int] = {}  # (host, model): free GPUs, in fit order
        present: dict[int, int] = {}  # a host's price is shared by these
        for c in counts if counts is not None else gpu_counts(s):
            # A cluster's nodes are granted by its scheduler (a holding job), not here.
            if c.host_state == HOST_READY and c.market != MARKET_CLUSTER:
                present[c.host_id] = present.get(c.host_id, 0) + c.present
                free[(c.host_id, c.model)] = c.free
        # Each waiting row is read under its lock (ids in order) before it is granted:
        # an extend or a cancel that committed meanwhile is seen, not written over. The
        # new request goes last and is not written early by the pass's reads (no
        # autoflush): each grant flushes itself.
        with s.no_autoflush:
            waiting = sorted(
                locked_rows(
                    s,
                    select(Reservation)
                    .where(Reservation.state == RES_WAITING)
                    .order_by(col(Reservation.id)),
                ),
                key=lambda r: (r.requested_at, r.id or 0),
            )
            if new is not None:
                waiting.append(new)
            blocked_models: set[str | None] = set()
            granted = 0
            for res in waiting:
                if (
                    None in blocked_models
                    or res.gpu_model in blocked_models
                    or (res.gpu_model is None and blocked_models)
                ):
                    continue
                choice = pick_gpus(free, res.gpu_model, res.gpu_count)
                if choice is None:
                    blocked_models.add(res.gpu_model)
                    continue
                host_id, gpu_model = choice
                # The chosen host, and its free GPUs of that model by index (what this
                # pass granted already is flushed, so not among them).
                host, free_here = free_gpus(s, host_id, gpu_model)
                assert host is not None, "the counts and the GPUs disagree"
                # Budget (bot.app.money.budgets): a grant that would go over is cancelled, with a DM.
                rate = Decimal(str(gpu_share(host.hourly_usd, present[host_id])))
                refusal = budgets.grant_refusal(
                    s, res, rate * res.gpu_count, now, self.core.settings
                )
                if refusal is not None:
                    if res is new:
                        raise UserError(refusal)
                    end_reservation(s, res, RES_CANCELLED, now)
                    info = reservation_info(s, res)
                    text = f"Reservation #{res.id} was cancelled, not granted: {refusal}"
                    self.core.notify_dm(
                        s,
                        info.user_key,
                        views.message(text).view,
                        now,
                        dedupe=f"budget-cancel:{res.id}",
                    )
                    continue
                picked = [
                    FreeGpu(gpu_id, gpu_model, index)
                    for gpu_id, index in free_here[: res.gpu_count]
                ]
                assert len(picked) == res.gpu_count, "the counts and the GPUs disagree"
                self._grant(s, res, host, picked, now, present[host_id])
                free[(host_id, gpu_model)] -= res.gpu_count
                granted += 1
                if res is not new:
                    info = reservation_info(s, res)
                    self.core.notify_dm(
                        s,
                        info.user_key,
                        views.granted_view(
                            info, now, self.core.settings.timezone, was_waiting=True
                        ),
                        now,
                        dedupe=f"granted:{res.id}",
                    )
        return granted

    def _grant(
        self,
        s: Session,
        res: Reservation,
        host: ShownHost,
        gpus: list[FreeGpu],
        now: datetime,
        present: int,
    ) -> None:
        assert host.id is not None
        res.state = RES_ACTIVE
        res.granted_at = now
        res.ends_at = now + timedelta(seconds=res.duration_s)
        res.host_id = host.id
        s.add(res)
        if res.id is None:  # a reserve's new request: inserted granted, for its id
            s.flush()
        assert res.id is not None
        self.open_usage(s, host, gpus, res.user_id, now, reservation_id=res.id, gpu_count=present)
        # What `reservation_info` would read back for this reservation: its host (held here, as the
        # session keeps only weak references) and its GPUs' indexes and models.
        s.info.setdefault(GRANTED, {})[res.id] = (
            to_host_state(host, []),
            sorted((g.index, g.model) for g in gpus),
        )
        s.flush()

    def open_usage(
        self,
        s: Session,
        host: PricedHost,
        gpus: Sequence[GpuRef],
        user_id: int,
        now: datetime,
        *,
        reservation_id: int | None = None,
        run_id: int | None = None,
        gpu_count: int | None = None,
        usd_per_gpu_hour: float | None = None,
    ) -> None:
        """Starts the clock on these GPUs for a reservation or a run: each at its share
        of the host's hourly price, in the host's market, or at `usd_per_gpu_hour` (a
        cluster's use, priced at the team's rate for the model: no machine bill to
        share). The partial unique index refuses a GPU that is already held. A caller
        that has counted the host's present GPUs already (the grant pass) passes
        `gpu_count`, sparing the count query."""
        assert host.id is not None
        if usd_per_gpu_hour is not None:
            per_gpu = usd_per_gpu_hour
        else:
            if gpu_count is None:
                gpu_count = self.gpu_count(s, host.id)
            per_gpu = gpu_share(host.hourly_usd, gpu_count)
        rows = []
        for g in gpus:
            assert g.id is not None
            rows.append(
                {
                    "gpu_id": g.id,
                    "host_id": host.id,
                    "user_id": user_id,
                    "reservation_id": reservation_id,
                    "run_id": run_id,
                    "started_at": now,
                    "ended_at": None,
                    "usd_per_hour": per_gpu,
                    "market": host.market,
                }
            )
        if rows:
            # Through the connection (Core): nothing in the transaction reads these back
            # as objects, and the ORM's unit of work for them cost more CPU than the
            # INSERT, in every grant and every run's start.
            s.connection().execute(_INSERT_INTERVAL, rows)

    def gpu_count(self, s: Session, host_id: int) -> int:
        """The host's present GPUs, among which its price is shared; public because runs
        meter their GPUs by the same share (bot.app.ports.Core)."""
        n = s.exec(
            select(func.count())
            .select_from(Gpu)
            .where(Gpu.host_id == host_id, col(Gpu.present).is_(True))
        ).one()
        return int(n)
