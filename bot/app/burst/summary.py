"""What bursting did over a window, for the weekly digest and `/gpu cost team`: the offers
made and how each ended, what the runs and reservations that went to the cloud cost there,
and how much sooner they started than the owned side expected to start them.

"Waiting saved" is measured, not modelled: an offer keeps the owned side's own estimate
from when it was made (the cluster's expected start, gpubot's queue estimate over the
owned hosts) and the run's start on the cloud; the saving is the first less the second.
A request the owned side gave no start for is counted apart, not guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from sqlmodel import Session, col, select

from bot.app.burst import state as st
from bot.app.watching.runfigures import costs_so_far
from bot.domain.metering import Window, metered_micro, to_cents
from db.models import BurstOffer, UsageInterval


@dataclass(frozen=True)
class BurstWeek:
    offered: int  # offers made in the window
    taken: int  # ... taken (a button, --cloud ok), whoever then started the run
    kept_waiting: int  # ... declined
    owned_first: int  # ... the owned side started the run first (withdrawn, given back)
    refused: int  # ... the budget or the caps could not cover
    on_cloud: int  # runs and reservations that started on the cloud in the window
    cloud_usd: Decimal  # what they cost there
    saved_s: float  # how much sooner they started than the owned side expected
    unknown: int  # runs on the cloud the owned side gave no start for


def burst_week(s: Session, window: Window, now: datetime) -> BurstWeek | None:
    """The window's bursting; None when no offer was made or run on the cloud in it."""
    offers = list(
        s.exec(
            select(BurstOffer).where(
                (col(BurstOffer.created_at) >= window.start)
                & (col(BurstOffer.created_at) < window.end)
                | (col(BurstOffer.cloud_start) >= window.start)
                & (col(BurstOffer.cloud_start) < window.end)
            )
        )
    )
    if not offers:
        return None
    made = [o for o in offers if window.start <= o.created_at < window.end]
    cloud = [
        o
        for o in offers
        if o.cloud_start is not None and window.start <= o.cloud_start < window.end
    ]
    usd = costs_so_far(s, {o.run_id for o in cloud if o.run_id is not None}, now)
    held = _reservation_costs(s, {o.reservation_id for o in cloud if o.reservation_id}, now)
    saved = 0.0
    unknown = 0
    for o in cloud:
        if o.expected_start is None or o.cloud_start is None:
            unknown += 1
            continue
        saved += max(0.0, (o.expected_start - o.cloud_start).total_seconds())
    return BurstWeek(
        offered=len(made),
        taken=sum(1 for o in made if o.state in _TAKEN),
        kept_waiting=sum(1 for o in made if o.state == st.DECLINED),
        owned_first=sum(1 for o in made if o.state in (st.WITHDRAWN, st.OWNED, st.GIVING_BACK)),
        refused=sum(1 for o in made if o.state == st.REFUSED),
        on_cloud=len(cloud),
        cloud_usd=sum(
            (Decimal(str(usd[o.run_id][0])) for o in cloud if o.run_id is not None), Decimal(0)
        )
        + sum(held.values(), Decimal(0)),
        saved_s=saved,
        unknown=unknown,
    )


# The states of an offer its owner took (the owned side may still have started it first).
_TAKEN = (*st.BUYING, st.CLOUD, st.GIVING_BACK, st.OWNED)


def _reservation_costs(s: Session, ids: set[int], now: datetime) -> dict[int, Decimal]:
    """Each reservation's cost so far, metered as the bill meters it."""
    out: dict[int, int] = dict.fromkeys(ids, 0)
    if ids:
        for iv in s.exec(
            select(UsageInterval).where(col(UsageInterval.reservation_id).in_(sorted(ids)))
        ):
            end = iv.ended_at or now
            if iv.reservation_id is not None and end > iv.started_at:
                out[iv.reservation_id] += metered_micro(
                    Decimal(str(iv.usd_per_hour)), iv.started_at, end
                )
    return {k: to_cents(Decimal(v) / 1_000_000) for k, v in out.items()}


def burst_line(b: BurstWeek, cloud: str) -> str:
    """The digest's words for it."""
    hours = b.saved_s / 3600.0
    unknown = f" ({b.unknown} had no expected start there)" if b.unknown else ""
    went = (
        f"{b.on_cloud} request{'s' if b.on_cloud != 1 else ''} went to {cloud} after waiting, "
        f"costing ${b.cloud_usd:,.2f} there and starting {hours:,.1f} h sooner in all than the "
        f"team's own GPUs expected to start them{unknown}."
        if b.on_cloud
        else f"Nothing went to {cloud}."
    )
    return (
        f"*Bursting*: {went} Offers made: {b.offered} ({b.taken} taken, {b.kept_waiting} kept "
        f"waiting, {b.owned_first} started on the team's own GPUs first, {b.refused} over "
        "budget or caps)."
    )
