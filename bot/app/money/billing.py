"""The instances' side of the bill: one `HostPeriod` row per stretch of a host's state.

Usage intervals say who held which GPU; these rows say what the machines themselves
cost while running (at their price) or stopped (their storage). Idle overhead is the
difference, computed from both sides in `bot.domain.metering`. Every change of a host's state
or price goes through `note_host_state`, inside the transaction that changes the host,
so the history can never disagree with the host row.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from decimal import ROUND_FLOOR, Decimal
from fractions import Fraction

from sqlmodel import Session, col, func, select

from bot.app.config import Settings
from bot.app.money.usage_window import WindowUsage, rolled_run_costs, window_usage
from bot.domain import timefmt
from bot.domain.metering import HostPeriod as MeteredPeriod
from bot.domain.metering import (
    Usage,
    Window,
    cost_by_ref,
    cost_by_user,
    host_cost,
    idle_overhead,
    storage_usd_per_hour,
    to_cents,
)
from bot.domain.views import Block, Context, Fields, Header, Table, Text, View
from db.models import (
    HOST_CHECKING,
    HOST_PENDING,
    HOST_READY,
    HOST_STOPPED,
    HOST_UNREACHABLE,
    MARKET_CLUSTER,
    Gpu,
    Host,
    HostPeriod,
    UsageInterval,
    User,
)
from provisioning.catalog import Catalog
from provisioning.costs import gpu_share

_CENT = Decimal("0.01")

# An unreachable host is still billed: the cloud does not know we cannot reach it.
_RUNNING_STATES = (HOST_READY, HOST_PENDING, HOST_CHECKING, HOST_UNREACHABLE)
# Only rented machines (bought by the second: on demand or spot) have a volume the team
# pays for while stopped; owned ones (the team's servers, a cluster) have no bill.
_RENTED_MARKETS = ("ondemand", "spot")


def billed_state(host: Host) -> str | None:
    """ "running", "stopped", or None (terminated: no bill at all)."""
    if host.state in _RUNNING_STATES:
        return "running"
    if host.state == HOST_STOPPED:
        return "stopped"
    return None


def storage_rate(host: Host, settings: Settings) -> float:
    if host.market not in _RENTED_MARKETS:
        return 0.0
    return float(
        storage_usd_per_hour(Decimal(str(settings.ebs_gb)), Decimal(str(settings.ebs_usd_gb_month)))
    )


def note_host_state(s: Session, host: Host, now: datetime, settings: Settings) -> None:
    """Closes the host's open period and opens one for its current state when anything
    billed changed (state, GPU count, price, market). Idempotent: calling it again with
    nothing changed writes nothing. `host` must be flushed (it needs its id)."""
    assert host.id is not None, "flush the host before noting its state"
    state = billed_state(host)
    gpus = s.exec(
        select(func.count())
        .select_from(Gpu)
        .where(Gpu.host_id == host.id, col(Gpu.present).is_(True))
    ).one()
    storage = storage_rate(host, settings)
    current = s.exec(
        select(HostPeriod).where(HostPeriod.host_id == host.id, col(HostPeriod.ended_at).is_(None))
    ).first()
    if current is not None:
        same = (
            current.state == state
            and current.gpus == gpus
            and current.usd_per_hour == host.hourly_usd
            and current.storage_usd_per_hour == storage
            and current.market == host.market
        )
        if same:
            return
        current.ended_at = max(now, current.started_at)
        s.add(current)
        s.flush()  # the open-period index must see it closed before the next opens
    if state is None:
        return
    s.add(
        HostPeriod(
            host_id=host.id,
            state=state,
            started_at=now,
            gpus=int(gpus),
            usd_per_hour=host.hourly_usd,
            storage_usd_per_hour=storage,
            market=host.market,
        )
    )


def host_periods(s: Session, window: Window) -> list[MeteredPeriod]:
    """Every period that overlaps the window, as `bot.domain.metering` takes them.

    Asked as two questions, each answered by an index: the open periods (a partial
    index) and the closed ones that end inside or after the window."""
    open_rows = s.exec(
        select(HostPeriod).where(
            col(HostPeriod.ended_at).is_(None), col(HostPeriod.started_at) < window.end
        )
    ).all()
    closed_rows = s.exec(
        select(HostPeriod).where(
            col(HostPeriod.ended_at) > window.start, col(HostPeriod.started_at) < window.end
        )
    ).all()
    rows = sorted([*open_rows, *closed_rows], key=lambda p: (p.host_id, p.started_at))
    return [
        MeteredPeriod(
            host_id=p.host_id,
            gpus=p.gpus,
            usd_per_hour=Decimal(str(p.usd_per_hour)),
            state="running" if p.state == "running" else "stopped",
            start=p.started_at,
            end=p.ended_at,
            storage_usd_per_hour=Decimal(str(p.storage_usd_per_hour)),
        )
        for p in rows
    ]


# --- the team's bill: users, idle overhead, instances ---------------------------------


# The markets of GPUs the team does not rent by the hour: its own hosts, a cluster's nodes.
OWNED_MARKETS = ("owned", MARKET_CLUSTER)


@dataclass(frozen=True)
class MeteredUsage:
    """A usage interval as metering takes it, with what the savings need beside it."""

    usage: Usage
    market: str  # "ondemand", "spot" or "owned": the host's market when it opened
    instance_type: str | None  # to look up the on-demand price a spot interval saved on


def load_usages(s: Session, window: Window, user_id: int | None = None) -> list[MeteredUsage]:
    """Every usage interval that overlaps the window (one user's, when given), raw: for
    checks and tools. Costs read `window_costs`, which takes history from the rollups."""
    q = (
        select(UsageInterval, User, Host)
        .join(User, col(User.id) == col(UsageInterval.user_id))
        .join(Host, col(Host.id) == col(UsageInterval.host_id))
        .where(
            col(UsageInterval.started_at) < window.end,
            col(UsageInterval.ended_at).is_(None) | (col(UsageInterval.ended_at) > window.start),
        )
        .order_by(col(UsageInterval.id))
    )
    if user_id is not None:
        q = q.where(UsageInterval.user_id == user_id)
    return [
        MeteredUsage(
            usage=Usage(
                user=u.key,
                gpu_id=iv.gpu_id,
                host_id=iv.host_id,
                start=iv.started_at,
                end=iv.ended_at,
                usd_per_hour=Decimal(str(iv.usd_per_hour)),
                kind="run" if iv.run_id is not None else "reservation",
                ref_id=iv.run_id or iv.reservation_id or 0,
            ),
            market=iv.market,
            instance_type=h.instance_type,
        )
        for iv, u, h in s.exec(q).all()
    ]


@dataclass(frozen=True)
class WindowCosts:
    """A window's usage costs, from the rollups for closed whole hours and the raw
    intervals for the rest (bot.app.money.usage_window.window_usage), added up exactly."""

    window: Window
    now: datetime
    part: WindowUsage

    @property
    def raw(self) -> list[MeteredUsage]:
        return [MeteredUsage(r.usage, r.market, r.instance_type) for r in self.part.raw]

    @property
    def raw_usages(self) -> list[Usage]:
        return [r.usage for r in self.part.raw]

    def users(self) -> dict[str, Decimal]:
        """Each user's cost (as `bot.domain.metering.cost_by_user` over every interval)."""
        micro: dict[str, int] = {}
        for r in self.part.rolled:
            micro[r.user] = micro.get(r.user, 0) + r.micro_usd
        raw = cost_by_user(self.raw_usages, self.window, self.now)
        out = {k: Decimal(m).scaleb(-6) for k, m in micro.items()}
        for k, v in raw.items():
            out[k] = out.get(k, Decimal(0)) + v
        return {k: out[k] for k in sorted(out)}

    def sides(self) -> dict[str, tuple[Decimal, Decimal]]:
        """Each user's cost split as (the team's own GPUs, bought ones): the owned hosts'
        and a cluster's use at the team's rates beside the cloud's bill (issue 37: owned
        use and cloud bill side by side). The two add up to `users()` exactly."""
        micro: dict[str, list[int]] = {}
        for r in self.part.rolled:
            micro.setdefault(r.user, [0, 0])[0 if r.market in OWNED_MARKETS else 1] += r.micro_usd
        out = {k: (Decimal(a).scaleb(-6), Decimal(b).scaleb(-6)) for k, (a, b) in micro.items()}
        for side in (0, 1):
            part = [r.usage for r in self.part.raw if (r.market in OWNED_MARKETS) == (side == 0)]
            for k, v in cost_by_user(part, self.window, self.now).items():
                owned, cloud = out.get(k, (Decimal(0), Decimal(0)))
                out[k] = (owned + v, cloud) if side == 0 else (owned, cloud + v)
        return {k: out[k] for k in sorted(out)}

    def gpu_hours(self) -> dict[str, Decimal]:
        us: dict[str, int] = {}
        for r in self.part.rolled:
            us[r.user] = us.get(r.user, 0) + r.held_us
        end_cap = min(self.window.end, self.now)
        for u in self.raw_usages:
            a = max(u.start, self.window.start)
            b = min(u.end or end_cap, end_cap)
            if b > a:
                us[u.user] = us.get(u.user, 0) + (b - a) // timedelta(microseconds=1)
        return {k: Decimal(v) / Decimal(3_600_000_000) for k, v in us.items()}

    def idle(self, periods: list[MeteredPeriod]) -> Decimal:
        """The idle overhead: the instances' bill less the GPU time held on it (the raw
        part metered by `bot.domain.metering.idle_overhead`, the rolled-up part as kept)."""
        raw = idle_overhead(periods, self.raw_usages, self.window, self.now)
        return raw - Decimal(self.part.covered_micro).scaleb(-6)

    def savings(self, catalog: Catalog) -> dict[str, Decimal]:
        """`spot_savings` over the raw part, plus the rolled-up spot hours at the on-demand
        share (to the micro-dollar per user and instance type: a display figure)."""
        out = spot_savings(self.raw, self.window, self.now, catalog)
        for r in self.part.rolled:
            if r.market != "spot" or r.instance_type is None:
                continue
            t = catalog.get(r.instance_type)
            if t is None:
                continue
            ondemand = gpu_share(Fraction(Decimal(str(t.ondemand_usd_hr))), t.gpus)
            would = round(ondemand * r.held_us / 3600)
            out[r.user] = out.get(r.user, Decimal(0)) + Decimal(would - r.micro_usd).scaleb(-6)
        return out


def window_costs(
    s: Session, window: Window, now: datetime, user_id: int | None = None
) -> WindowCosts:
    return WindowCosts(window, now, window_usage(s, window, user_id))


def dearest_runs(s: Session, costs: WindowCosts, n: int) -> list[tuple[int, Decimal]]:
    """The `n` runs that cost most in the window (run id, cost), dearest first, then by
    id: the runs' own rollups for the window's whole hours (summed in the database, not
    from the team's rows) plus the raw part (open intervals, edges off the hour). A run
    with no raw part that is not among the n + (runs with one) dearest rolled-up runs
    cannot be among the n dearest in all."""
    runs = [u for u in costs.raw_usages if u.kind == "run"]
    total = {run_id: usd for (_, run_id), usd in cost_by_ref(runs, costs.window, costs.now).items()}
    for run_id, micro in rolled_run_costs(s, costs.window, top=n + len(total), runs=set(total)):
        total[run_id] = total.get(run_id, Decimal(0)) + Decimal(micro).scaleb(-6)
    return sorted(total.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


def spot_savings(
    usages: Iterable[MeteredUsage], window: Window, now: datetime, catalog: Catalog
) -> dict[str, Decimal]:
    """Per user: what their spot GPU time would have cost on demand, less what it cost.

    Only intervals on a spot market whose instance type the catalog knows count; the
    on-demand side is metered exactly like the real one, so the saving is exact too.
    """
    paid: list[Usage] = []
    list_price: list[Usage] = []
    for m in usages:
        if m.market != "spot" or m.instance_type is None:
            continue
        t = catalog.get(m.instance_type)
        if t is None:
            continue
        ondemand = gpu_share(Decimal(str(t.ondemand_usd_hr)), t.gpus)
        paid.append(m.usage)
        list_price.append(replace(m.usage, usd_per_hour=ondemand))
    actual = cost_by_user(paid, window, now)
    would = cost_by_user(list_price, window, now)
    return {user: would[user] - actual.get(user, Decimal(0)) for user in would}


@dataclass(frozen=True)
class TeamBill:
    """`/gpu cost team` and the digest's totals: who held what, and what nobody held."""

    window: Window
    users: dict[str, Decimal]  # user key -> cost of the GPU time they held
    names: dict[str, str]  # user key -> display name
    idle: Decimal  # running GPU time nobody held, plus stopped storage
    instances: Decimal  # what the instances themselves cost
    savings: dict[str, Decimal]  # user key -> spot savings (only users with spot time)

    @property
    def held(self) -> Decimal:
        return sum(self.users.values(), Decimal(0))

    @property
    def balanced(self) -> bool:
        """True when the usage intervals and the host periods tell the same story."""
        return self.held + self.idle == self.instances


def team_bill(
    s: Session, window: Window, now: datetime, catalog: Catalog | None = None
) -> TeamBill:
    costs = window_costs(s, window, now)
    periods = host_periods(s, window)
    names = {u.key: u.display_name for u in s.exec(select(User)).all()}
    users = costs.users()
    return TeamBill(
        window=window,
        users=users,
        names={k: names.get(k, k) for k in users},
        idle=costs.idle(periods),
        instances=host_cost(periods, window, now),
        savings=costs.savings(catalog) if catalog is not None else {},
    )


def shown_cents(
    parts: dict[str, Decimal], total: Decimal, absorb: str | None = None
) -> tuple[dict[str, Decimal], Decimal]:
    """Cents to show for each part and for the total, such that the shown parts add up
    to the shown total whenever the exact parts add up to the exact total.

    Rounding each part on its own can leave the column a cent off its total; here the
    total is rounded and the cents are handed out by largest remainder (Hamilton), so
    what a reader adds up by hand is what the bill says. When the parts do not add up
    exactly (records disagree), each is rounded on its own and nothing is hidden. On a
    tie the `absorb` part (the idle overhead) gives way, so a person's row shows what
    their own `/gpu cost` says.
    """
    if sum(parts.values(), Decimal(0)) != total:
        return {k: to_cents(v) for k, v in parts.items()}, to_cents(total)
    shown_total = to_cents(total)
    floors = {k: v.quantize(_CENT, rounding=ROUND_FLOOR) for k, v in parts.items()}
    left = int((shown_total - sum(floors.values(), Decimal(0))) / _CENT)
    by_remainder = sorted(parts, key=lambda k: (-(parts[k] - floors[k]), k == absorb, k))
    for k in by_remainder[:left]:
        floors[k] += _CENT
    return floors, shown_total


IDLE_ROW = "idle overhead"


def team_cost_view(bill: TeamBill, period: str, tz: str) -> View:
    """`/gpu cost team`: each person, the idle overhead, and what the instances cost.

    The rows are shown so that they add up to the instances' bill to the cent; where the
    records disagree (a usage outside any billed period) the gap is said, not hidden.
    """
    label = {"today": "today", "week": "this week", "month": "this month"}.get(period, period)
    span = f"{timefmt.days(bill.window.start, bill.window.end, tz)}, {tz}"
    parts = {f"user:{k}": v for k, v in bill.users.items()}
    parts[IDLE_ROW] = bill.idle
    shown, total = shown_cents(parts, bill.instances, absorb=IDLE_ROW)
    order = sorted(bill.users, key=lambda k: (-bill.users[k], k))
    with_savings = any(v > 0 for v in bill.savings.values())
    columns: tuple[str, ...] = ("who", "cost", "spot saved") if with_savings else ("who", "cost")

    def row(name: str, usd: Decimal, saved: Decimal | None) -> tuple[str, ...]:
        cells: tuple[str, ...] = (name, f"${usd:,.2f}")
        if with_savings:
            cells += (f"${to_cents(saved):,.2f}" if saved else "",)
        return cells

    rows = [row(bill.names.get(k, k), shown[f"user:{k}"], bill.savings.get(k)) for k in order]
    saved_total = sum(bill.savings.values(), Decimal(0))
    held = sum((shown[f"user:{k}"] for k in order), Decimal(0))
    totals = (
        ("held by people", f"${held:,.2f}"),
        ("idle overhead", f"${shown[IDLE_ROW]:,.2f}"),
        ("instances", f"${total:,.2f}"),
    )
    text = (
        f"Team GPU cost {label} ({span}): the instances cost ${total:,.2f}: "
        f"${held:,.2f} held by {len(order)} "
        f"{'person' if len(order) == 1 else 'people'} + ${shown[IDLE_ROW]:,.2f} idle overhead."
    )
    notes = [
        "Idle overhead: GPUs running with nobody holding them, and stopped instances' storage.",
        "Each person pays every GPU-second they held at its share of the host's hourly price.",
    ]
    if with_savings:
        notes.append(
            f"Spot saved ${to_cents(saved_total):,.2f} against the same instance types on demand."
        )
    if not bill.balanced:
        gap = bill.instances - bill.held - bill.idle
        notes.append(
            f"Usage and instance records differ by ${gap:,.6f} (GPU time held outside a billed "
            "period, or a price changed mid-reservation); the rows do not add up exactly."
        )
    blocks: tuple[Block, ...] = (
        Header(f"GPU cost {label}"),
        Text(text),
    )
    if rows:
        blocks += (Table(columns, tuple(rows)),)
    blocks += (Fields(totals), Context(" ".join(notes)))
    return View(text=text, blocks=blocks)
