"""Spend limits per person, checked before money is committed.

A budget is a limit per calendar week or month in the team's time zone. What counts
against it is what was *spent* in the current period (usage intervals, metered by
`bot.domain.metering` exactly as `/gpu cost` shows it), plus what is already *committed*
(the rest of each active reservation at its rate; a running run up to its `--max`,
or one more hour when it has none; what is waiting or queued at its estimated
rate), plus the new request. Over the limit → the request is refused with the
numbers; from 80% → one DM per period.

Two requests of one person that each fit but together do not must not both pass:
each check runs inside the transaction that commits the request, and holds the
person's user row (`SELECT … FOR NO KEY UPDATE` on PostgreSQL; SQLite's `BEGIN
IMMEDIATE` already lets one writer in at a time) until that transaction ends, so the
second check sees the first request. It follows `db.session`'s lock order: a request,
grant or dispatch holds the pool (the GPU rows) before it checks, and `/gpu budget`
locks the one user row and nothing after it, so no cycle can form.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import and_, bindparam, cast, literal, null, union_all
from sqlalchemy.orm.attributes import set_committed_value
from sqlmodel import Session, col, select

from bot.app.access import audit
from bot.app.config import Settings
from bot.app.money.billing import window_costs
from bot.app.money.rollups import closed_in
from bot.app.outbox import enqueue
from bot.app.watching.held import GpuCount, gpu_counts
from bot.domain import timefmt, views
from bot.domain.commands import Budget
from bot.domain.errors import UserError
from bot.domain.metering import Window, money, period_window
from db.models import (
    RES_ACTIVE,
    RES_WAITING,
    RUN_ON_HOST,
    RUN_QUEUED,
    Reservation,
    TrainingRun,
    UsageInterval,
    User,
)
from db.session import core, retrying, transaction
from db.types import UTCDateTime
from provisioning.costs import gpu_share

if TYPE_CHECKING:
    from bot.app.ports import Actor, Core

USAGE = "/gpu budget [@user AMOUNT[/week|/month]|off]"
WARN_AT = Decimal("0.8")
# A run without --max is assumed to need this much more, whatever it has run so far.
RUN_WITHOUT_MAX = timedelta(hours=1)
_HOUR_S = Decimal(3600)


@dataclass(frozen=True)
class BudgetStatus:
    """Where one person stands in the current period."""

    limit: Decimal | None  # None: no budget
    period: str  # "week" or "month"
    window: Window  # the current period
    spent: Decimal  # metered so far this period
    committed: Decimal  # still to come from what they hold, wait for, or queued

    @property
    def used(self) -> Decimal:
        return self.spent + self.committed


def _usd(x: float) -> Decimal:
    return Decimal(str(x))


def _hours(seconds: float) -> Decimal:
    return Decimal(str(max(0.0, seconds))) / _HOUR_S


def gpu_rate(s: Session, model: str | None, counts: Sequence[GpuCount] | None = None) -> Decimal:
    """The per-GPU price a request for `model` may be charged: the dearest share among
    the hosts that carry it (a waiting request does not know yet where it will land, so
    it is counted at the most it could cost). From the fleet's counts per host and model
    (`held.gpu_counts`, which carry each host's price): a reserve has read them already
    under the pool, so its estimate costs no statement; otherwise they are read here."""
    rows = counts if counts is not None else gpu_counts(s)
    hosts: dict[int, tuple[float, int, bool]] = {}
    for c in rows:
        hourly, n, has = hosts.get(c.host_id, (c.hourly_usd, 0, False))
        hosts[c.host_id] = (hourly, n + c.present, has or model is None or c.model == model)
    shares = {(hourly, n) for hourly, n, has in hosts.values() if has and n}
    return max((gpu_share(_usd(hourly), n) for hourly, n in shares), default=Decimal(0))


def reservation_estimate(
    s: Session,
    model: str | None,
    count: int,
    duration_s: int,
    counts: Sequence[GpuCount] | None = None,
) -> Decimal:
    return gpu_rate(s, model, counts) * count * _hours(duration_s)


def run_estimate(s: Session, model: str | None, gpus: int, max_seconds: int | None) -> Decimal:
    return _run_estimate(gpu_rate(s, model), gpus, max_seconds)


def _run_estimate(rate: Decimal, gpus: int, max_seconds: int | None) -> Decimal:
    seconds = max_seconds if max_seconds else RUN_WITHOUT_MAX.total_seconds()
    return rate * gpus * _hours(seconds)


def committed_usd(
    s: Session,
    user_id: int,
    now: datetime,
    *,
    skip_reservation: int | None = None,
    skip_run: int | None = None,
) -> Decimal:
    """What this person's open reservations and runs will still cost from `now` on.

    One query for both, each with the rates of what it holds now (`_open_holdings`), and
    the fleet's counts once when something waits or is queued (its estimate): it was a
    query per reservation and per run, and one per waiting one."""
    rates: dict[str | None, Decimal] = {}
    counts: list[GpuCount] = []

    def rate_of(model: str | None) -> Decimal:
        if model not in rates:
            if not counts:  # read once, and only when something waits or is queued
                counts.extend(gpu_counts(s))
            rates[model] = gpu_rate(s, model, counts)
        return rates[model]

    total = Decimal(0)
    for (kind, ref), (row, rate) in _open_holdings(s, user_id).items():
        if kind == "res":
            if ref == skip_reservation:
                continue
            if row.state == RES_ACTIVE and row.ends_at is not None:
                total += rate * _hours((row.ends_at - now).total_seconds())
            elif row.state == RES_WAITING:
                total += rate_of(row.gpu_model) * row.gpu_count * _hours(row.seconds)
            continue
        if ref == skip_run:
            continue
        if row.state == RUN_QUEUED:
            total += _run_estimate(rate_of(row.gpu_model), row.gpu_count, row.seconds)
            continue
        if row.seconds and row.started_at is not None:
            left = (row.started_at + timedelta(seconds=row.seconds) - now).total_seconds()
        else:
            left = RUN_WITHOUT_MAX.total_seconds()
        total += rate * _hours(left)
    return total


def _open_holdings(s: Session, user_id: int) -> dict[tuple[str, int], tuple[Any, Decimal]]:
    """The person's open reservations ("res", id) and runs ("run", id), each with the
    summed rate of the GPUs it holds now (its open intervals), in one statement built once
    (`_holdings_stmt`): a row of (kind, id, state, ends_at, started_at, model, count,
    seconds: a reservation's length or a run's --max) per interval held, or one with no
    rate."""
    out: dict[tuple[str, int], tuple[Any, Decimal]] = {}
    for row in s.connection().execute(_holdings_stmt(), {"b_user": user_id}):
        key = (row.kind, row.ref)
        _, rate = out.setdefault(key, (row, Decimal(0)))
        if row.usd_per_hour is not None:
            out[key] = (row, rate + _usd(row.usd_per_hour))
    return out


@functools.cache
def _holdings_stmt() -> Any:
    """The open reservations and runs of one person (bound as `b_user`) with their rates.
    The person is matched as `user_id + 0`, which no index answers, so that the open
    states' index does: SQLite, which keeps no statistics, otherwise read every run the
    person ever had through the user's index (20 ms of a reserve with a year of runs)."""
    held = col(UsageInterval.ended_at).is_(None)
    user: Any = bindparam("b_user")
    res_cols: tuple[Any, ...] = (
        literal("res").label("kind"),
        col(Reservation.id).label("ref"),
        col(Reservation.state).label("state"),
        col(Reservation.ends_at).label("ends_at"),
        cast(null(), UTCDateTime).label("started_at"),
        col(Reservation.gpu_model).label("gpu_model"),
        col(Reservation.gpu_count).label("gpu_count"),
        col(Reservation.duration_s).label("seconds"),
        col(UsageInterval.usd_per_hour).label("usd_per_hour"),
    )
    run_cols: tuple[Any, ...] = (
        literal("run"),
        TrainingRun.id,
        TrainingRun.state,
        cast(null(), UTCDateTime),
        TrainingRun.started_at,
        TrainingRun.gpu_model,
        TrainingRun.gpu_count,
        TrainingRun.max_seconds,
        UsageInterval.usd_per_hour,
    )
    reservations = (
        select(*res_cols)
        .join(
            UsageInterval,
            and_(col(UsageInterval.reservation_id) == col(Reservation.id), held),
            isouter=True,
        )
        .where(
            col(Reservation.state).in_((RES_ACTIVE, RES_WAITING)),
            col(Reservation.user_id) + 0 == user,
        )
    )
    runs = (
        select(*run_cols)
        .join(
            UsageInterval,
            and_(col(UsageInterval.run_id) == col(TrainingRun.id), held),
            isouter=True,
        )
        .where(
            col(TrainingRun.state).in_((*RUN_ON_HOST, RUN_QUEUED)),
            col(TrainingRun.user_id) + 0 == user,
        )
    )
    return union_all(reservations, runs)


def spent_usd(s: Session, user: User, window: Window, now: datetime) -> Decimal:
    """What the person spent in the window up to `now`, from their own rollup rows and
    what they hold now. Kept in the transaction for the same window and instant while no
    interval closes in it (bot.app.money.rollups.closed_in): a reserve checks the budget, then
    its grant checks it again, and the spend cannot have changed in between (what is
    opened at `now` has cost nothing yet)."""
    assert user.id is not None
    key = (user.id, window.start, window.end, now, closed_in(s))
    spent: dict[Any, Decimal] = _this_transaction(s, _SPENT, dict)
    if key not in spent:
        spent[key] = window_costs(s, window, now, user.id).users().get(user.key, Decimal(0))
    return spent[key]


_SPENT = "gpubot.budget_spent"  # Session.info: spend by (user, window, now, closed)
_LOCKED = "gpubot.budget_locked"  # Session.info: the users whose rows this one holds
T = TypeVar("T")


def _this_transaction(s: Session, key: str, make: Callable[[], T]) -> T:
    """What the session keeps under `key` for its current transaction only (a session
    used for several transactions starts each afresh: a lock ends with its transaction)."""
    now = s.get_transaction()
    kept = s.info.get(key)
    if kept is None or kept[0] is not now:
        kept = s.info[key] = (now, make())
    value: T = kept[1]
    return value


def budget_status(
    s: Session,
    user: User,
    now: datetime,
    settings: Settings,
    *,
    skip_reservation: int | None = None,
    skip_run: int | None = None,
) -> BudgetStatus:
    assert user.id is not None
    period = user.budget_period if user.budget_period in ("week", "month") else "week"
    window = period_window(period, now, settings.timezone)  # type: ignore[arg-type]
    return BudgetStatus(
        limit=None if user.budget_usd is None else _usd(user.budget_usd),
        period=period,
        window=window,
        spent=spent_usd(s, user, window, now),
        committed=committed_usd(
            s, user.id, now, skip_reservation=skip_reservation, skip_run=skip_run
        ),
    )


def lock_user(s: Session, user: User) -> None:
    """Holds the person's row until the transaction ends, and re-reads their limit, in
    one statement (once per transaction: a grant checks again after the reserve did).

    On SQLite the write transaction (`BEGIN IMMEDIATE`, db.session) is the lock already.
    """
    locked: set[int | None] = _this_transaction(s, _LOCKED, set)
    if user.id in locked:
        return
    limit, period = core(s).execute(_lock_user_stmt(), {"b_user": user.id}).one()
    # What another transaction committed before the lock was granted: the person's limit.
    set_committed_value(user, "budget_usd", limit)
    set_committed_value(user, "budget_period", period)
    locked.add(user.id)


@functools.cache
def _lock_user_stmt() -> Any:
    """The person's limit, their row held until the transaction ends. NO KEY UPDATE on
    PostgreSQL: serializes budget checks without blocking inserts that merely point at
    the user (a reservation, a usage interval, a GPU sample). As Core, built once: the
    ORM's refresh of the whole row cost more CPU than the statement."""
    columns: tuple[Any, ...] = (User.budget_usd, User.budget_period)
    return (
        select(*columns).where(col(User.id) == bindparam("b_user")).with_for_update(key_share=True)
    )


def _resets(window: Window, tz: str) -> str:
    return timefmt.stamp(window.end, tz)


def check_budget(
    s: Session,
    user: User,
    add_usd: Decimal | float,
    now: datetime,
    settings: Settings,
    *,
    what: str = "This",
    skip_reservation: int | None = None,
    skip_run: int | None = None,
) -> None:
    """Refuses (UserError) a request that would take `user` over their budget; from 80%
    writes one DM per period. Call it inside the transaction that commits the request,
    before anything is granted, placed or launched. `skip_*` leaves out of "committed"
    the request being checked, when it is already a row (a grant, a dispatch)."""
    if user.budget_usd is None:
        return
    lock_user(s, user)
    if user.budget_usd is None:
        return
    add = add_usd if isinstance(add_usd, Decimal) else _usd(add_usd)
    st = budget_status(s, user, now, settings, skip_reservation=skip_reservation, skip_run=skip_run)
    assert st.limit is not None
    after = st.used + add
    if after > st.limit:
        raise UserError(
            f"{what} would take you over your {st.period}ly GPU budget of {money(st.limit)}: "
            f"you have spent {money(st.spent)} this {st.period}, {money(st.committed)} is "
            f"committed to what you hold or queued, and this needs about {money(add)}. "
            f"Your budget resets {_resets(st.window, settings.timezone)}. Release something, "
            "ask for less, or ask an admin to raise it."
        )
    if after >= st.limit * WARN_AT:
        pct = int(after / st.limit * 100) if st.limit else 100
        text = (
            f"Heads-up: you are at {pct}% of your {st.period}ly GPU budget "
            f"({money(after)} of {money(st.limit)}, counting what you hold and queued). "
            f"It resets {_resets(st.window, settings.timezone)}; past 100% new requests are refused."
        )
        _dm(
            s,
            user.key,
            views.View(text=text, blocks=(views.Text(text),)),
            now,
            f"budget-80:{user.id}:{st.period}:{st.window.start.isoformat()}",
        )


def grant_refusal(
    s: Session, res: Reservation, usd_per_hour: Decimal, now: datetime, settings: Settings
) -> str | None:
    """At grant time: why granting `res` at this rate (all its GPUs together) would go
    over its holder's budget, or None when it fits. The waiting estimate of `res` is
    replaced by its real cost.

    A request checked when it was made, in this transaction (`checked_request`), fits:
    nothing closed since (so the same spend), it was counted at the dearest price its
    GPUs have anywhere (at least this rate), and what else its holder has committed can
    only have gone down (a waiting one granted is counted at its own price, at most the
    dearest; one cancelled not at all). The check is not run twice for one reserve."""
    add = usd_per_hour * _hours(res.duration_s)
    checked = _checked(s).get(id(res))
    if checked is not None and checked[:3] == (res, now, closed_in(s)) and add <= checked[3]:
        return None
    user = s.get(User, res.user_id)  # loaded already: no query
    assert user is not None
    if user.budget_usd is None:
        return None
    if res.id is None:
        s.flush()  # the check names it and leaves it out of what is committed
    try:
        check_budget(
            s,
            user,
            add,
            now,
            settings,
            what=f"Granting reservation #{res.id}",
            skip_reservation=res.id,
        )
    except UserError as exc:
        return exc.reason
    return None


def checked_request(s: Session, res: Reservation, estimate: Decimal, now: datetime) -> None:
    """Notes that the request `res` was checked against its holder's budget at `now`,
    counted at `estimate` (`reservation_estimate`), before it was added: its grant in this
    transaction need not check again (`grant_refusal`)."""
    _checked(s)[id(res)] = (res, now, closed_in(s), estimate)


_CHECKED = "gpubot.budget_checked"  # Session.info: requests checked when made


def _checked(s: Session) -> dict[int, tuple[Reservation, datetime, int, Decimal]]:
    made: dict[int, tuple[Reservation, datetime, int, Decimal]] = _this_transaction(
        s, _CHECKED, dict
    )
    return made


def run_refusal(
    s: Session, run: TrainingRun, usd_per_hour: Decimal, now: datetime, settings: Settings
) -> str | None:
    """At dispatch: why starting `run` at this rate would go over budget, or None."""
    user = s.get(User, run.user_id)
    assert user is not None
    seconds = run.max_seconds or int(RUN_WITHOUT_MAX.total_seconds())
    try:
        check_budget(
            s,
            user,
            usd_per_hour * _hours(seconds),
            now,
            settings,
            what=f"Starting run #{run.id}",
            skip_run=run.id,
        )
    except UserError as exc:
        return exc.reason
    return None


def _dm(s: Session, user_key: str, view: views.View, now: datetime, dedupe: str) -> None:
    enqueue(s, "dm", user_key, view, now, dedupe)


# --- /gpu budget -------------------------------------------------------------------------


def budget_view(name: str, st: BudgetStatus, tz: str, mine: bool) -> views.View:
    whose = "Your" if mine else f"{name}'s"
    if st.limit is None:
        text = (
            f"{whose} GPU spend has no budget. This {st.period}: {money(st.spent)} spent, "
            f"{money(st.committed)} committed."
        )
        return views.View(text=text, blocks=(views.Text(text),))
    left = st.limit - st.used
    text = (
        f"{whose} GPU budget: {money(st.limit)} per {st.period}. Spent {money(st.spent)}, "
        f"committed {money(st.committed)}, "
        + (f"{money(left)} left" if left >= 0 else f"{money(-left)} over")
        + f"; it resets {_resets(st.window, tz)}."
    )
    items = (
        ("limit", f"{money(st.limit)} / {st.period}"),
        ("spent", money(st.spent)),
        ("committed", money(st.committed)),
        ("left", money(left)),
        ("resets", _resets(st.window, tz)),
    )
    return views.View(
        text=text,
        blocks=(
            views.Text(text),
            views.Fields(items),
            views.Context(
                "Committed: the rest of what you hold at its rate, runs up to their --max "
                "(one more hour without one), and what waits or is queued at the dearest "
                "matching GPU price. Past the limit new requests are refused."
            ),
        ),
    )


@retrying
def budget_command(service: Core, actor: Actor, cmd: Budget) -> views.Reply:
    """`/gpu budget`: show your own; `@user` shows theirs (an admin, or yourself);
    `@user 200/week` or `@user off` sets or clears it (admins only)."""
    target = cmd.user.key.strip().lstrip("@") if cmd.user is not None else actor.key
    changing = cmd.clear or cmd.amount_usd is not None
    if changing and not actor.admin:
        raise UserError("Only an admin can set or clear a budget.")
    if not changing and target != actor.key and not actor.admin:
        raise UserError("Only an admin can see someone else's budget; `/gpu budget` shows yours.")
    now = service.clock.now()
    tz = service.settings.timezone
    with transaction(service.engine, write=changing) as s:
        if changing:
            user = service.user_row(s, target)
            lock_user(s, user)
            user.budget_usd = None if cmd.clear else cmd.amount_usd
            user.budget_period = cmd.period
            s.add(user)
            limit = "none" if cmd.clear else f"${cmd.amount_usd:g}/{cmd.period}"
            audit(actor, "budget", f"{user.key} to {limit}", session=s)
            s.flush()
        else:
            found = s.exec(select(User).where(User.key == target)).first()
            if found is None:
                raise UserError(
                    f"I do not know `{target}` yet; they have never used gpubot.", USAGE
                )
            user = found
        st = budget_status(s, user, now, service.settings)
        view = budget_view(user.display_name, st, tz, mine=user.key == actor.key)
    if changing:
        what = (
            f"Budget for {user.display_name} removed."
            if cmd.clear
            else f"Budget for {user.display_name} set to {money(_usd(cmd.amount_usd or 0))} per {cmd.period}."
        )
        view = views.View(text=f"{what} {view.text}", blocks=(views.Text(what), *view.blocks))
    return views.Reply(view)
