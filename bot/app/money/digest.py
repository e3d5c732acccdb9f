"""The weekly cost digest: who used what, what it cost, how well it was used, and
what nobody used.

Numbers come from the same places as `/gpu cost`: usage intervals metered by
`bot.domain.metering` (exact micro-dollars), host periods for the instances' bill and the
idle overhead (`bot.app.money.billing`), `GpuSample` rows for utilization. A week is an ISO
week in the team's time zone, from local Monday midnight to the next.

Per person:

* GPU-hours: the GPU time their reservations and runs held in the week.
* Dollars: that time at each GPU's share of its host's price (what `/gpu cost` says).
* Efficiency: the mean utilization of the samples attributed to them, weighted by
  each sample's `span_s` (thinned history weighs right); "n/a" without samples.
* Idle waste: the time their *reservations* held a GPU while it sampled under
  `idle_util_pct`, at that GPU's rate. Runs are left out: a run that idles is a bug
  in the run, not a GPU kept from the team.
* Spot savings: spot time priced on demand (catalog) less what it cost.

A sample counts in the week when its time stamp `at` falls inside it.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, replace
from datetime import date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from sqlmodel import Session, col, select

from bot.app.burst.summary import BurstWeek, burst_line, burst_week
from bot.app.config import Settings, parse_weekly_time
from bot.app.money.advice import Totals, WeekReport, report_blocks, report_csv, report_for
from bot.app.money.billing import WindowCosts, dearest_runs, shown_cents, window_costs
from bot.app.money.billing import host_periods as load_periods
from bot.app.money.prices import priced_catalog
from bot.domain import timefmt, views
from bot.domain.durations import ascii_digits
from bot.domain.errors import UserError
from bot.domain.metering import Window, host_cost, money, to_cents
from db.models import Gpu, GpuSample, Notification, TrainingRun, UsageInterval, User
from db.session import transaction
from provisioning.catalog import Catalog

if TYPE_CHECKING:
    from bot.app.ports import Replayer
    from bot.app.service import GpuService

TOP_RUNS = 5
WEEK_USAGE = "gpubot digest [--week YYYY-Www] [--post] [--csv FILE]"
CSV_HEADER = (
    "week",
    "user",
    "name",
    "gpu_hours",
    "usd",
    "efficiency_pct",
    "idle_waste_usd",
    "spot_savings_usd",
    "last_week_usd",
    "change_usd",
)
_ZERO = Decimal(0)


@dataclass(frozen=True)
class UserLine:
    key: str
    name: str
    gpu_hours: Decimal
    usd: Decimal
    efficiency_pct: float | None  # None: no samples
    idle_waste_usd: Decimal
    spot_savings_usd: Decimal
    last_week_usd: Decimal
    # `usd` split: on the team's own GPUs (owned hosts, a cluster, at its rates) and on
    # bought ones (the cloud's bill).
    owned_usd: Decimal = Decimal(0)
    cloud_usd: Decimal = Decimal(0)

    @property
    def change_usd(self) -> Decimal:
        return self.usd - self.last_week_usd


@dataclass(frozen=True)
class TopRun:
    run_id: int
    user: str  # display name
    what: str  # recipe or command, short
    usd: Decimal


@dataclass(frozen=True)
class Digest:
    week: str  # "2026-W49"
    tz: str
    window: Window
    users: tuple[UserLine, ...]  # dearest first
    top_runs: tuple[TopRun, ...]
    held_usd: Decimal  # all users together
    idle_overhead_usd: Decimal
    instances_usd: Decimal
    last_week_held_usd: Decimal
    # The week's largest wastes and the replay's advice (bot.app.money.advice); None: not asked.
    report: WeekReport | None = None
    # What bursting to the cloud did (bot.app.burst.summary); None: no offer this week.
    bursting: BurstWeek | None = None

    @property
    def both_sides(self) -> bool:
        """Someone used the team's own GPUs and someone bought ones: show them apart."""
        return any(u.owned_usd for u in self.users) and any(u.cloud_usd for u in self.users)

    @property
    def used(self) -> tuple[UserLine, ...]:
        """The people who held a GPU this week: one row each."""
        return tuple(u for u in self.users if u.usd or u.gpu_hours)

    @property
    def unused(self) -> tuple[UserLine, ...]:
        """People in the table only for last week: one line for all of them."""
        return tuple(u for u in self.users if not (u.usd or u.gpu_hours))


# --- weeks ---------------------------------------------------------------------------------


def parse_week(text: str) -> tuple[int, int]:
    """ "2026-W49" → (2026, 49); a UserError that shows the form otherwise."""
    raw = text.strip().upper()
    year, sep, week = raw.partition("-W")
    if sep and ascii_digits(year) and len(year) == 4 and ascii_digits(week):
        y, w = int(year), int(week)
        try:
            date.fromisocalendar(y, w, 1)
        except ValueError:
            raise UserError(f"{y} has no ISO week {w}.", WEEK_USAGE) from None
        return y, w
    raise UserError(f"`{text}` is not an ISO week; write it like 2026-W49.", WEEK_USAGE)


def week_window(year: int, week: int, tz: str) -> Window:
    zone = ZoneInfo(tz)
    monday = date.fromisocalendar(year, week, 1)
    after = monday + timedelta(days=7)
    return Window(
        datetime(monday.year, monday.month, monday.day, tzinfo=zone),
        datetime(after.year, after.month, after.day, tzinfo=zone),
    )


def last_complete_week(now: datetime, tz: str) -> tuple[int, int]:
    """The ISO week before the one `now` falls in, in the team's time zone."""
    local = now.astimezone(ZoneInfo(tz)).date() - timedelta(days=7)
    year, week, _ = local.isocalendar()
    return year, week


def week_name(year: int, week: int) -> str:
    return f"{year}-W{week:02d}"


# --- the numbers ---------------------------------------------------------------------------


def build_digest(
    s: Session,
    year: int,
    week: int,
    now: datetime,
    settings: Settings,
    catalog: Catalog | None = None,
) -> Digest:
    tz = settings.timezone
    window = week_window(year, week, tz)
    prev = week_window(*_previous(year, week), tz)
    spend = window_costs(s, window, now)
    costs = spend.users()
    last = window_costs(s, prev, now).users()
    savings = spend.savings(catalog) if catalog is not None else {}
    periods = load_periods(s, window)
    users = {u.key: u for u in s.exec(select(User)).all()}
    by_id = {u.id: u for u in users.values()}
    hours = spend.gpu_hours()
    sides = spend.sides()
    eff, waste = _samples(s, window, settings.idle_util_pct, by_id)
    keys = sorted(set(costs) | set(last) | set(hours), key=lambda k: (-costs.get(k, _ZERO), k))
    lines = tuple(
        UserLine(
            key=k,
            name=users[k].display_name if k in users else k,
            gpu_hours=hours.get(k, _ZERO),
            usd=costs.get(k, _ZERO),
            efficiency_pct=eff.get(k),
            idle_waste_usd=waste.get(k, _ZERO),
            spot_savings_usd=savings.get(k, _ZERO),
            last_week_usd=last.get(k, _ZERO),
            owned_usd=sides.get(k, (_ZERO, _ZERO))[0],
            cloud_usd=sides.get(k, (_ZERO, _ZERO))[1],
        )
        for k in keys
    )
    return Digest(
        week=week_name(year, week),
        tz=tz,
        window=window,
        users=lines,
        top_runs=_top_runs(s, spend, users),
        held_usd=sum(costs.values(), _ZERO),
        idle_overhead_usd=spend.idle(periods),
        instances_usd=host_cost(periods, window, now),
        last_week_held_usd=sum(last.values(), _ZERO),
        bursting=burst_week(s, window, now),
    )


def _previous(year: int, week: int) -> tuple[int, int]:
    y, w, _ = (date.fromisocalendar(year, week, 1) - timedelta(days=7)).isocalendar()
    return y, w


def _samples(
    s: Session, window: Window, idle_pct: float, by_id: dict[int | None, User]
) -> tuple[dict[str, float], dict[str, Decimal]]:
    """Efficiency per user (span-weighted mean utilization) and idle waste in dollars
    (reservation samples under the idle threshold, at the held GPU's rate)."""
    rows = s.exec(
        select(GpuSample).where(
            col(GpuSample.at) >= window.start,
            col(GpuSample.at) < window.end,
            col(GpuSample.user_id).is_not(None),
        )
    ).all()
    rates: dict[tuple[int, int, int], Decimal] = {}
    res_ids = {r.reservation_id for r in rows if r.reservation_id is not None}
    if res_ids:
        for iv, gpu in s.exec(
            select(UsageInterval, Gpu)
            .join(Gpu, col(Gpu.id) == col(UsageInterval.gpu_id))
            .where(col(UsageInterval.reservation_id).in_(res_ids))
        ).all():
            assert iv.reservation_id is not None
            rates[(iv.reservation_id, iv.host_id, gpu.index)] = Decimal(str(iv.usd_per_hour))
    weighted: dict[str, float] = {}
    spans: dict[str, float] = {}
    waste: dict[str, Decimal] = {}
    for r in rows:
        user = by_id.get(r.user_id)
        if user is None or r.span_s <= 0:
            continue
        weighted[user.key] = weighted.get(user.key, 0.0) + r.util_pct * r.span_s
        spans[user.key] = spans.get(user.key, 0.0) + r.span_s
        if r.reservation_id is not None and r.util_pct < idle_pct:
            rate = rates.get((r.reservation_id, r.host_id, r.gpu_index), _ZERO)
            waste[user.key] = waste.get(user.key, _ZERO) + rate * r.span_s / 3600
    eff = {k: weighted[k] / spans[k] for k in spans if spans[k] > 0}
    return eff, waste


def _top_runs(s: Session, spend: WindowCosts, users: dict[str, User]) -> tuple[TopRun, ...]:
    top = dearest_runs(s, spend, TOP_RUNS)
    columns: tuple[Any, ...] = (
        TrainingRun.id,
        TrainingRun.user_id,
        TrainingRun.recipe,
        TrainingRun.command,
    )
    known = {
        run_id: (user_id, (recipe and f"recipe {recipe}") or views.command_phrase(command))
        for run_id, user_id, recipe, command in s.exec(
            select(*columns).where(col(TrainingRun.id).in_([run_id for run_id, _ in top]))
        )
    }
    by_id = {u.id: u for u in users.values()}
    out = []
    for run_id, usd in top:
        user_id, what = known.get(run_id, (None, "?"))
        owner = by_id.get(user_id)
        name = owner.display_name if owner is not None else "?"
        out.append(TopRun(run_id=run_id, user=name, what=_clip(what, 40), usd=usd))
    return tuple(out)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


# --- what it looks like ----------------------------------------------------------------


def _change(d: Decimal) -> str:
    c = to_cents(d)
    return f"+${c:,.2f}" if c > 0 else (f"−${-c:,.2f}" if c < 0 else "±$0.00")


def _against_last_week(d: Decimal) -> str:
    """`$12.40 more held than last week`; `the same as last week`, never `±$0.00`."""
    c = to_cents(d)
    if c == 0:
        return "the same held as last week"
    return f"${abs(c):,.2f} {'more' if c > 0 else 'less'} held than last week"


def _eff(p: float | None) -> str:
    return "n/a" if p is None else f"{p:.0f}%"


def _span(d: Digest) -> str:
    return f"{timefmt.days(d.window.start, d.window.end, d.tz, year=True)}, {d.tz}"


def digest_view(d: Digest) -> views.View:
    parts = {f"user:{u.key}": u.usd for u in d.users}
    parts["idle"] = d.idle_overhead_usd
    shown, total = shown_cents(parts, d.instances_usd, absorb="idle")
    gpu_h = sum((u.gpu_hours for u in d.users), _ZERO)
    held = sum((shown[f"user:{u.key}"] for u in d.users), _ZERO)
    people = len(d.used)
    text = (
        f"GPU digest {d.week} ({_span(d)}): the instances cost ${total:,.2f}; "
        f"${held:,.2f} held by {people} {'person' if people == 1 else 'people'} over "
        f"{gpu_h:,.1f} GPU-hours, ${shown['idle']:,.2f} idle overhead "
        f"({_against_last_week(d.held_usd - d.last_week_held_usd)})."
    )
    rows = tuple(
        (
            u.name,
            f"{u.gpu_hours:,.1f}",
            f"${shown[f'user:{u.key}']:,.2f}",
            _change(u.change_usd),
            _eff(u.efficiency_pct),
            money(u.idle_waste_usd),
            money(u.spot_savings_usd) if u.spot_savings_usd else "",
        )
        for u in d.used
    )
    blocks: list[views.Block] = [views.Header(f"GPU digest {d.week}"), views.Text(text)]
    if rows:
        blocks.append(
            views.Table(
                ("who", "GPU-h", "cost", "vs last wk", "util", "idle waste", "spot saved"), rows
            )
        )
    else:
        blocks.append(views.Text("Nobody held a GPU this week."))
    if d.unused:
        blocks.append(views.Text(_unused_line(d.unused)))
    if d.both_sides:
        blocks.append(
            views.Table(
                ("who", "own GPUs", "cloud"),
                tuple((u.name, money(u.owned_usd), money(u.cloud_usd)) for u in d.used),
            )
        )
    if d.bursting is not None:
        blocks.append(views.Text(burst_line(d.bursting, "the cloud")))
    blocks.append(
        views.Fields(
            (
                ("held by people", f"${held:,.2f}"),
                ("idle overhead", f"${shown['idle']:,.2f}"),
                ("instances", f"${total:,.2f}"),
                ("spot saved", money(sum((u.spot_savings_usd for u in d.users), _ZERO))),
            )
        )
    )
    if d.report is not None:
        blocks.extend(report_blocks(d.report))
    if d.top_runs:
        blocks.append(views.Text("*Top runs by cost*"))
        blocks.append(
            views.Table(
                ("run", "who", "what", "cost"),
                tuple((f"#{r.run_id}", r.user, r.what, money(r.usd)) for r in d.top_runs),
            )
        )
    blocks.append(
        views.Context(
            "util: mean GPU utilization of the samples attributed to each person, weighted by "
            "time; idle waste: reserved GPU time under the idle threshold, at its rate; idle "
            "overhead: GPUs running with nobody on them, and stopped instances' storage."
        )
    )
    return views.View(text=text, blocks=tuple(blocks))


def _unused_line(unused: tuple[UserLine, ...]) -> str:
    """ "13 people used nothing (they held $412.10 last week)": one line, not a row each."""
    n = len(unused)
    last = sum((u.last_week_usd for u in unused), _ZERO)
    who = "1 person" if n == 1 else f"{n} people"
    return f"{who} used nothing this week ({money(last)} held last week)."


def chart_bars(d: Digest) -> tuple[list[tuple[str, Decimal, Decimal]], str]:
    """What the chart draws, as data (so a test can hold it to the text): a bar per person
    who used something (name, dollars, idle waste) and the title, which counts the rest as
    the text's one line does."""
    people = [(u.name, u.usd, u.idle_waste_usd) for u in d.used]
    title = f"GPU cost by person, {d.week} ({money(d.instances_usd)} in all)"
    if d.unused:
        n = len(d.unused)
        title += f"; {n} {'person' if n == 1 else 'people'} used nothing"
    return people, title


def digest_chart(d: Digest) -> bytes:
    """The digest's PNG (drawn by `bot.domain.charts.cost_chart`): each person's dollars with
    their idle waste on top, then the team's idle overhead."""
    # matplotlib takes most of a second to import: only code that draws loads it.
    from bot.domain.charts import CostBar, cost_chart

    people, title = chart_bars(d)
    return cost_chart([CostBar(*bar) for bar in people], d.idle_overhead_usd, title)


def digest_csv(d: Digest) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(CSV_HEADER)
    for u in d.used:
        w.writerow(
            (
                d.week,
                u.key,
                u.name,
                f"{u.gpu_hours:.4f}",
                f"{to_cents(u.usd)}",
                "" if u.efficiency_pct is None else f"{u.efficiency_pct:.1f}",
                f"{to_cents(u.idle_waste_usd)}",
                f"{to_cents(u.spot_savings_usd)}",
                f"{to_cents(u.last_week_usd)}",
                f"{to_cents(u.change_usd)}",
            )
        )
    if d.unused:  # the text's one line, as one row: no user key, the count in the name
        last = sum((u.last_week_usd for u in d.unused), _ZERO)
        n = len(d.unused)
        who = f"{n} {'person' if n == 1 else 'people'} used nothing"
        was, change = f"{to_cents(last)}", f"{to_cents(-last)}"
        w.writerow((d.week, "", who, "0.0000", "0.00", "", "0.00", "0.00", was, change))
    return out.getvalue()


def digest_report_csv(d: Digest) -> str:
    """The wastes and the advice (bot.app.money.advice.report_csv); empty when not asked."""
    return "" if d.report is None else report_csv(d.week, d.report)


# --- running it ----------------------------------------------------------------------------


def digest_for(
    service: GpuService, week: str | None = None, replay: Replayer | None = None
) -> Digest:
    """The week's digest; with `replay` (the faces hand it the simulator) also its largest
    wastes and what one setting would have saved (bot.app.money.advice)."""
    now = service.clock.now()
    year, wk = parse_week(week) if week else last_complete_week(now, service.settings.timezone)
    catalog = priced_catalog(service.settings)
    with transaction(service.engine, write=False) as s:
        d = build_digest(s, year, wk, now, service.settings, catalog)
    if replay is None:
        return d
    totals = Totals(d.instances_usd, d.held_usd, d.idle_overhead_usd)
    report = report_for(service.engine, service.settings, d.window, now, catalog, replay, totals)
    return replace(d, report=report)


def post_digest(service: GpuService, d: Digest) -> bool:
    """Queues the digest for the channel with its chart; once per week (dedupe key), so a
    second `--post` or a second worker's firing changes nothing. False: already queued."""
    key = f"digest:{d.week}"
    with transaction(service.engine, write=False) as s:
        if s.exec(select(Notification.id).where(Notification.dedupe_key == key)).first():
            return False
    service.notify_channel(
        digest_view(d), dedupe=key, attachment=(f"gpu-digest-{d.week}.png", digest_chart(d))
    )
    return True


def digest_job(service: GpuService, replay: Replayer | None = None) -> None:
    """The worker's weekly firing: the previous ISO week's digest, to the channel."""
    post_digest(service, digest_for(service, replay=replay))


def digest_trigger(settings: Settings) -> dict[str, object]:
    """APScheduler cron arguments for `digest_at` in the team's time zone."""
    day, hour, minute = parse_weekly_time(settings.digest_at)
    names = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
    return {
        "day_of_week": names[day],
        "hour": hour,
        "minute": minute,
        "timezone": settings.timezone,
    }


def write_csv(d: Digest, path: Path) -> Path | None:
    """Writes the people's CSV to `path` and, when the digest has its report, the wastes
    and advice beside it (`<stem>-advice.csv`); returns that second path."""
    path.write_text(digest_csv(d), encoding="utf-8")
    if d.report is None:
        return None
    extra = path.with_name(f"{path.stem}-advice{path.suffix or '.csv'}")
    extra.write_text(digest_report_csv(d), encoding="utf-8")
    return extra
