"""Metering against hand-computed bills, and the identity that keeps every dollar attributed:
users' costs plus idle overhead equal what the instances cost, exactly."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from fractions import Fraction
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bot.domain.metering import (
    HostPeriod,
    Usage,
    UsageKind,
    Window,
    cost_by_ref,
    cost_by_user,
    host_cost,
    idle_overhead,
    period_window,
    reading,
    storage_usd_per_hour,
    to_cents,
)

D = Decimal
H = timedelta(hours=1)
# p4d.24xlarge on-demand (us-east-1): 8 A100s; one GPU's share is 32.7726 / 8 = 4.096575.
P4D = D("32.7726")
P4D_SHARE = D("4.096575")


def t(s: str) -> datetime:
    """An instant written in UTC, e.g. t("2026-03-02 10:00")."""
    return datetime.fromisoformat(s).replace(tzinfo=UTC)


def use(
    user: str,
    start: datetime,
    end: datetime | None,
    rate: Decimal,
    gpu: int = 1,
    host: int = 1,
    kind: UsageKind = "reservation",
    ref: int = 1,
) -> Usage:
    return Usage(user, gpu, host, start, end, rate, kind, ref)


def running(
    start: datetime, end: datetime | None, price: Decimal, gpus: int = 1, host: int = 1
) -> HostPeriod:
    return HostPeriod(host, gpus, price, "running", start, end)


ALL = Window(t("2000-01-01 00:00"), t("2100-01-01 00:00"))
LATER = t("2099-01-01 00:00")


# --- hand-computed cases ----------------------------------------------------------------


def test_interval_across_an_hour_boundary_is_clipped_to_the_window() -> None:
    u = [use("ann", t("2026-03-02 10:30"), t("2026-03-02 11:45"), D("3.60"))]
    # 10:30 -> 11:45 is 1.25 h; 1.25 * 3.60 = 4.50
    assert cost_by_user(u, ALL, LATER) == {"ann": D("4.50")}
    # only 11:00 -> 11:45 lies in the 11 o'clock hour: 0.75 * 3.60 = 2.70
    hour = Window(t("2026-03-02 11:00"), t("2026-03-02 12:00"))
    assert cost_by_user(u, hour, LATER) == {"ann": D("2.70")}


def test_interval_across_midnight_counts_only_today() -> None:
    u = [use("ann", t("2026-03-02 22:00"), t("2026-03-03 02:00"), D("2.50"))]
    today = period_window("today", t("2026-03-03 12:00"), "UTC")
    assert today == Window(t("2026-03-03 00:00"), t("2026-03-04 00:00"))
    # 00:00 -> 02:00 on the 3rd: 2 h * 2.50 = 5.00 (the 2 h before midnight were yesterday)
    assert cost_by_user(u, today, t("2026-03-03 12:00")) == {"ann": D("5.00")}


def test_interval_across_the_week_boundary_counts_from_monday() -> None:
    # Sunday 2026-03-08 20:00 -> Monday 2026-03-09 04:00 UTC, on a whole p4d share
    u = [use("ann", t("2026-03-08 20:00"), t("2026-03-09 04:00"), P4D_SHARE)]
    week = period_window("week", t("2026-03-11 09:00"), "UTC")  # a Wednesday
    assert week == Window(t("2026-03-09 00:00"), t("2026-03-16 00:00"))
    # Monday 00:00 -> 04:00: 4 h * 4.096575 = 16.3863
    assert cost_by_user(u, week, t("2026-03-11 09:00")) == {"ann": D("16.3863")}
    # and the week before got the other 4 h, so the two weeks add up to the 8 h held
    before = period_window("week", t("2026-03-08 09:00"), "UTC")
    assert cost_by_user(u, before, t("2026-03-11 09:00")) == {"ann": D("16.3863")}


def test_week_boundary_in_the_team_time_zone() -> None:
    # In Europe/Berlin (UTC+1 in March) the week starts Monday 00:00 local = Sunday 23:00 UTC.
    week = period_window("week", t("2026-03-11 09:00"), "Europe/Berlin")
    assert week.start == t("2026-03-08 23:00")
    u = [use("ann", t("2026-03-08 20:00"), t("2026-03-09 04:00"), D("1.00"))]
    # Sunday 23:00 UTC -> Monday 04:00 UTC: 5 h * 1.00 = 5.00
    assert cost_by_user(u, week, t("2026-03-11 09:00")) == {"ann": D("5.00")}


@pytest.mark.parametrize(
    ("tz", "now", "hours"),
    [
        # Berlin falls back on Sunday 2026-10-25 (03:00 CEST -> 02:00 CET): 7 * 24 + 1
        ("Europe/Berlin", "2026-10-21 12:00", 169),
        # New York falls back on Sunday 2026-11-01 (02:00 EDT -> 01:00 EST): 7 * 24 + 1
        ("America/New_York", "2026-10-28 12:00", 169),
        # Berlin springs forward on Sunday 2026-03-29 (02:00 CET -> 03:00 CEST): 7 * 24 - 1
        ("Europe/Berlin", "2026-03-25 12:00", 167),
        ("UTC", "2026-10-21 12:00", 168),
    ],
)
def test_a_week_with_a_dst_change_is_167_or_169_hours(tz: str, now: str, hours: int) -> None:
    week = period_window("week", t(now), tz)
    assert week.hours == hours
    local = week.start.astimezone(ZoneInfo(tz))
    assert (local.weekday(), local.hour, local.minute) == (0, 0, 0)
    # A GPU held all week at 2.00/h costs hours * 2.00: 169 h -> 338.00, 167 h -> 334.00.
    u = [use("ann", week.start - 10 * H, None, D("2.00"))]
    assert cost_by_user(u, week, week.end + H) == {"ann": D(2 * hours)}


def test_dst_day_and_month_lengths() -> None:
    # Sunday 2026-11-01 in New York is 25 h long (01:00-02:00 happens twice).
    assert period_window("today", t("2026-11-01 12:00"), "America/New_York").hours == 25
    # Sunday 2026-03-29 in Berlin is 23 h long.
    assert period_window("today", t("2026-03-29 12:00"), "Europe/Berlin").hours == 23
    # March 2026 in Berlin: 31 * 24 - 1 = 743 h, from 1 March 00:00 CET = 28 Feb 23:00 UTC.
    march = period_window("month", t("2026-03-15 12:00"), "Europe/Berlin")
    assert (march.start, march.hours) == (t("2026-02-28 23:00"), D(743))
    # An instant just after local midnight belongs to the new local day, not the UTC one:
    # 2026-03-02 23:30 UTC is 00:30 on the 3rd in Berlin.
    day = period_window("today", t("2026-03-02 23:30"), "Europe/Berlin")
    assert day.start == t("2026-03-02 23:00")


def test_run_sharing_an_8_gpu_instance_with_a_reservation() -> None:
    start = t("2026-03-02 10:00")
    periods = [running(start, start + 3 * H, P4D, gpus=8)]
    usages = [
        # ann reserves GPUs 0-1 for the 3 h the instance runs
        *(use("ann", start, start + 3 * H, P4D_SHARE, gpu=g, ref=7) for g in (0, 1)),
        # bob's run uses GPUs 2-5 for 2 h
        *(
            use("bob", start, start + 2 * H, P4D_SHARE, gpu=g, kind="run", ref=42)
            for g in (2, 3, 4, 5)
        ),
    ]
    now = start + 5 * H
    # ann: 2 GPUs * 3 h = 6 GPU-h * 4.096575 = 24.57945
    # bob: 4 GPUs * 2 h = 8 GPU-h * 4.096575 = 32.7726
    assert cost_by_user(usages, ALL, now) == {"ann": D("24.57945"), "bob": D("32.7726")}
    assert cost_by_ref(usages, ALL, now) == {
        ("reservation", 7): D("24.57945"),
        ("run", 42): D("32.7726"),
    }
    # instance: 3 h * 32.7726 = 98.3178
    assert host_cost(periods, ALL, now) == D("98.3178")
    # idle: 8 * 3 = 24 GPU-h run, 14 held -> 10 GPU-h * 4.096575 = 40.96575
    assert idle_overhead(periods, usages, ALL, now) == D("40.96575")
    # 24.57945 + 32.7726 + 40.96575 = 98.3178
    assert D("24.57945") + D("32.7726") + D("40.96575") == D("98.3178")


def test_spot_and_on_demand_shares_of_the_same_instance_type() -> None:
    start = t("2026-03-02 10:00")
    spot_price = D("12.00")  # a p4d at spot: share 12.00 / 8 = 1.50
    periods = [
        running(start, None, P4D, gpus=8, host=1),
        running(start, None, spot_price, gpus=8, host=2),
    ]
    usages = [
        use("ann", start, start + 2 * H, P4D_SHARE, gpu=10, host=1),
        use("bob", start, start + 2 * H, D("1.50"), gpu=20, host=2),
    ]
    now = start + 2 * H
    # ann on-demand: 2 h * 4.096575 = 8.19315; bob on spot: 2 h * 1.50 = 3.00
    assert cost_by_user(usages, ALL, now) == {"ann": D("8.19315"), "bob": D("3.00")}
    # both instances ran 2 h: 2 * 32.7726 + 2 * 12.00 = 65.5452 + 24.00 = 89.5452
    assert host_cost(periods, ALL, now) == D("89.5452")
    # idle: 7 GPUs * 2 h on each: 14 * 4.096575 + 14 * 1.50 = 57.35205 + 21.00 = 78.35205
    assert idle_overhead(periods, usages, ALL, now) == D("78.35205")


def test_stopped_instance_costs_its_storage_as_idle_overhead() -> None:
    start = t("2026-03-02 10:00")
    # 730 GB at 0.10 per GB-month = 73.00 a 730-hour month = 0.10 an hour
    storage = storage_usd_per_hour(D(730), D("0.10"))
    assert storage == D("0.1")
    periods = [
        running(start, start + 2 * H, D("3.60")),
        HostPeriod(1, 1, D("3.60"), "stopped", start + 2 * H, None, storage),
    ]
    usages = [use("ann", start, start + H, D("3.60"))]
    now = start + 12 * H
    # ann: 1 h * 3.60 = 3.60
    assert cost_by_user(usages, ALL, now) == {"ann": D("3.60")}
    # instance: 2 h running * 3.60 + 10 h stopped * 0.10 = 7.20 + 1.00 = 8.20
    assert host_cost(periods, ALL, now) == D("8.20")
    # idle: the unheld running hour 3.60 + all the storage 1.00 = 4.60
    assert idle_overhead(periods, usages, ALL, now) == D("4.60")


def test_storage_rate_of_the_default_volume() -> None:
    # 500 GB * 0.08 = 40.00 a month; 40 / 730 = 0.054794520547945... an hour
    assert storage_usd_per_hour(D(500), D("0.08")) == D("0.054794520548")


def test_open_interval_is_charged_up_to_now_and_nothing_after_now() -> None:
    u = [use("ann", t("2026-03-02 10:00"), None, D("3.60"))]
    # 10:00 -> now 12:15 is 2.25 h * 3.60 = 8.10
    assert cost_by_user(u, ALL, t("2026-03-02 12:15")) == {"ann": D("8.10")}
    # a closed interval that (in the caller's data) ends after now is also cut at now
    closed = [use("ann", t("2026-03-02 10:00"), t("2026-03-02 20:00"), D("3.60"))]
    assert cost_by_user(closed, ALL, t("2026-03-02 12:15")) == {"ann": D("8.10")}
    # an interval that has not started by now costs nothing and its user is absent
    assert cost_by_user(u, ALL, t("2026-03-02 09:00")) == {}


def test_per_second_rounding_telescopes() -> None:
    # 1 s at 1.00/h is 277.7...µ$: each second is rounded to the micro-dollar, yet 3600
    # back-to-back seconds are one hour, exactly 1.00.
    start = t("2026-03-02 10:00")
    sec = timedelta(seconds=1)
    u = [use("ann", start + i * sec, start + (i + 1) * sec, D("1.00")) for i in range(3600)]
    one = cost_by_user(u[:1], ALL, LATER)["ann"]
    assert one in (D("0.000277"), D("0.000278"))
    assert cost_by_user(u, ALL, LATER) == {"ann": D("1.00")}


def test_display_rounds_to_cents_half_up() -> None:
    assert to_cents(D("24.57945")) == D("24.58")
    assert to_cents(D("0.005")) == D("0.01")
    assert to_cents(D("40.964999")) == D("40.96")


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="aware"):
        Window(datetime(2026, 3, 2), t("2026-03-03 00:00"))
    with pytest.raises(ValueError, match="before"):
        use("ann", t("2026-03-02 10:00"), t("2026-03-02 09:00"), D(1))
    with pytest.raises(ValueError, match="non-negative"):
        use("ann", t("2026-03-02 10:00"), None, D(-1))
    with pytest.raises(ValueError, match="time zone"):
        period_window("week", t("2026-03-02 10:00"), "Mars/Olympus")
    with pytest.raises(ValueError, match="period"):
        period_window("year", t("2026-03-02 10:00"), "UTC")  # type: ignore[arg-type]


def test_identity_breaks_when_a_usage_lies_outside_running_time() -> None:
    """The property below is a real check: charging a user for a stopped hour shows up."""
    start = t("2026-03-02 10:00")
    periods = [
        running(start, start + H, D("3.60")),
        HostPeriod(1, 1, D("3.60"), "stopped", start + H, None, D(0)),
    ]
    usages = [use("ann", start, start + 2 * H, D("3.60"))]  # held on into the stopped hour
    now = start + 3 * H
    users = sum(cost_by_user(usages, ALL, now).values(), D(0))
    # ann pays 7.20, the instance cost 3.60, idle is 0
    assert users + idle_overhead(periods, usages, ALL, now) == D("7.20")
    assert host_cost(periods, ALL, now) == D("3.60")


def test_a_gpu_held_twice_is_covered_once() -> None:
    start = t("2026-03-02 10:00")
    periods = [running(start, start + 2 * H, D("3.60"))]
    usages = [
        use("ann", start, start + H, D("3.60")),
        use("bob", start + timedelta(minutes=30), start + H, D("3.60")),
    ]
    # covered 10:00 -> 11:00 once: idle is the second hour, 3.60 (not 3.60 - 1.80)
    assert idle_overhead(periods, usages, ALL, start + 2 * H) == D("3.60")


# --- the identity, on random histories ----------------------------------------------------

BASE = t("2026-03-01 00:00")
SPAN_US = 20 * 24 * 3600 * 10**6  # twenty days, in microseconds
USERS = ("ann", "bob", "cyd", "dee")


def at(us: int) -> datetime:
    return BASE + timedelta(microseconds=us)


HOUR_US = 3600 * 10**6


# Instants are drawn as a coarse step plus a fine offset: plain st.integers over a range
# this wide clusters near its lower end, which would leave most windows empty.
COARSE = st.integers(0, 64)
# on the hour, on a whole second, or on any microsecond
FINE = st.one_of(st.just(0), st.integers(0, 3600).map(lambda s: s * 10**6), st.integers(0, HOUR_US))


def between(draw: st.DrawFn, lo: int, hi: int) -> int:
    return min(hi, lo + (hi - lo) * draw(COARSE) // 64 + draw(FINE))


def some_between(draw: st.DrawFn, lo: int, hi: int, most: int) -> list[int]:
    return sorted({between(draw, lo, hi) for _ in range(draw(st.integers(0, most)))})


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[HostPeriod], list[Usage]]:
    periods: list[HostPeriod] = []
    usages: list[Usage] = []
    ref = 0
    for host in range(draw(st.integers(1, 3))):
        gpus = draw(st.sampled_from([1, 2, 4, 8]))
        share = D(
            draw(
                st.sampled_from([0, 1, 7, 1_500_000, 4_096_575, 12_290_000])
                | st.integers(1, 20_000_000)
            )
        ).scaleb(-6)
        storage = D(draw(st.integers(0, 300_000))).scaleb(-6)
        cuts = some_between(draw, 0, SPAN_US, 5) or [0]
        bounds: list[int | None] = list(cuts)
        if draw(st.booleans()) or len(cuts) == 1:
            bounds.append(None)  # the host is still in its last state
        for a, b in itertools.pairwise(bounds):
            assert a is not None
            state = draw(st.sampled_from(["running", "stopped"]))
            end = None if b is None else at(b)
            if state == "stopped":
                periods.append(HostPeriod(host, gpus, share * gpus, "stopped", at(a), end, storage))
                continue
            periods.append(HostPeriod(host, gpus, share * gpus, "running", at(a), end))
            hi = SPAN_US if b is None else b
            for gpu in range(gpus):
                points = some_between(draw, a, hi, 4)
                pairs: list[tuple[int, int | None]] = list(
                    zip(points[::2], points[1::2], strict=False)
                )
                if b is None and len(points) % 2 == 1 and draw(st.booleans()):
                    pairs.append((points[-1], None))  # still held
                for ua, ub in pairs:
                    ref += 1
                    usages.append(
                        Usage(
                            user=draw(st.sampled_from(USERS)),
                            gpu_id=host * 100 + gpu,
                            host_id=host,
                            start=at(ua),
                            end=None if ub is None else at(ub),
                            usd_per_hour=share,
                            kind=draw(st.sampled_from(["reservation", "run"])),
                            ref_id=ref,
                        )
                    )
    return periods, usages


@st.composite
def windows_and_now(draw: st.DrawFn) -> tuple[Window, datetime, datetime]:
    """A window from before the history to after it, `now` inside the history half the
    time (after all of it otherwise), and an instant to split the window at."""
    lo, hi = sorted(between(draw, -SPAN_US // 10, SPAN_US * 11 // 10) for _ in range(2))
    now = between(draw, 0, SPAN_US) if draw(st.booleans()) else 2 * SPAN_US
    split = between(draw, lo, hi)
    return Window(at(lo), at(hi)), at(now), at(split)


@settings(deadline=None, max_examples=200)
@given(histories(), windows_and_now())
def test_users_plus_idle_equal_the_instances_cost_exactly(
    history: tuple[list[HostPeriod], list[Usage]],
    when: tuple[Window, datetime, datetime],
) -> None:
    periods, usages = history
    window, now, split = when

    users = cost_by_user(usages, window, now)
    idle = idle_overhead(periods, usages, window, now)
    total = host_cost(periods, window, now)
    assert sum(users.values(), D(0)) + idle == total
    assert idle >= 0
    assert all(c >= 0 for c in users.values())
    assert sum(cost_by_ref(usages, window, now).values(), D(0)) == sum(users.values(), D(0))

    # A window split anywhere costs the same as the whole, to the micro-dollar.
    first, second = Window(window.start, split), Window(split, window.end)
    assert host_cost(periods, first, now) + host_cost(periods, second, now) == total
    a, b = cost_by_user(usages, first, now), cost_by_user(usages, second, now)
    for user, cost in users.items():
        assert a.get(user, D(0)) + b.get(user, D(0)) == cost


@settings(max_examples=500, deadline=None)
@given(
    st.fractions(min_value=0, max_value=10_000),
    st.integers(min_value=-(10**17), max_value=10**17),
)
def test_the_integer_meter_reads_as_the_exact_fraction_rounded_half_to_even(
    rate: Fraction, t_us: int
) -> None:
    """The meter's reading is computed in integers (a rebuild over a million intervals
    spent its time building Fractions); it must be round(rate * t / 3600) exactly,
    ties to even included."""
    assert reading(rate, t_us) == round(rate * t_us / 3600)
    half = Fraction(1800 * (2 * t_us + 1), 1) / max(1, abs(t_us))  # often lands on a tie
    assert reading(half, t_us) == round(half * t_us / 3600)
