"""The states of a burst offer (db.models.BurstOffer) and the two questions dispatch asks
of them, kept apart from the offers' own module so that runs can ask without importing
what makes offers."""

from __future__ import annotations

from sqlmodel import Session, col, select

from db.models import BurstOffer, Reservation, TrainingRun

# Made, DM'd with its buttons, not answered yet: the run keeps its place on the owned side.
OPEN = "open"
# Taken (a button, or `--cloud ok`): the cloud side is bought; the first place to start it wins.
ACCEPTED = "accepted"
# Kept waiting on the owned GPUs, as its owner asked.
DECLINED = "declined"
# The run started on the owned side, was cancelled or ended before an answer.
WITHDRAWN = "withdrawn"
# Its owner's budget cannot cover the estimate: offered with the figures, nothing bought.
REFUSED = "refused"
# Its cluster job is being withdrawn for the instance bought for it: written before the
# cancel, so a worker that dies in between finds it and finishes the move (the poll
# leaves such a run alone meanwhile, its job's cancel not being its end).
MOVING = "moving"
# Taken out of the cluster's queue for the instance bought for it (gpubot places it there).
MOVED = "moved"
# It started on the cloud.
CLOUD = "cloud"
# The owned side started it first: what was bought for it is being given back.
GIVING_BACK = "giving_back"
# ... and was given back.
OWNED = "owned"

# The states in which the cloud may be bought for the run.
BUYING = (ACCEPTED, MOVING, MOVED)
# The states in which gpubot's scheduler, not the cluster, places the run.
ON_CLOUD = (MOVED, CLOUD)
# The states an offer does not leave.
FINAL = (DECLINED, WITHDRAWN, REFUSED, CLOUD, OWNED)


def taken(s: Session, run_id: int) -> tuple[str, float] | None:
    """The instance type offered and the most a GPU-hour may cost, where the run's owner
    took the offer (the cloud may be bought for it now); None otherwise."""
    offer = s.exec(select(BurstOffer).where(BurstOffer.run_id == run_id)).first()
    if offer is None or offer.state not in BUYING:
        return None
    run = s.get(TrainingRun, run_id)
    gpus = max(1, run.gpu_count if run is not None else 1)
    return offer.instance_type, offer.usd_per_hour / gpus


def taken_reservations(s: Session) -> dict[int, tuple[str, float]]:
    """Each reservation whose owner took the offer: the type offered and the most a
    GPU-hour may cost (the fleet buys for it now, and for no other waiting reservation of
    a model the owned places have)."""
    out: dict[int, tuple[str, float]] = {}
    for offer, res in s.exec(
        select(BurstOffer, Reservation)
        .join(Reservation, col(Reservation.id) == col(BurstOffer.reservation_id))
        .where(col(BurstOffer.state).in_(BUYING))
    ):
        assert res.id is not None
        out[res.id] = (offer.instance_type, offer.usd_per_hour / max(1, res.gpu_count))
    return out


def moving(s: Session) -> set[int]:
    """The runs whose cluster job is being withdrawn for the cloud."""
    return _runs(s, (MOVING,))


def on_cloud(s: Session) -> set[int]:
    """The runs gpubot's scheduler places on the cloud (they left the cluster's queue)."""
    return _runs(s, ON_CLOUD)


def _runs(s: Session, states: tuple[str, ...]) -> set[int]:
    found = s.exec(select(BurstOffer.run_id).where(col(BurstOffer.state).in_(states)))
    return {i for i in found if i is not None}
