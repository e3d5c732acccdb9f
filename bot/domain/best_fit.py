"""Best fit: the one rule for which host a request for N GPUs lands on.

The grant pass places a reservation on free GPUs with it, and the fleet uses it to decide
whether a waiting reservation is already covered by free or booting supply before it
buys any; both must agree, or the fleet would launch an instance for a reservation the
grant pass then places elsewhere. Pure: callers say what each place has free.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

Place = TypeVar("Place")


def best_fit(free: Iterable[tuple[Place, int]], need: int) -> Place | None:
    """The place with the fewest free GPUs that still holds `need`; on a tie, the first.

    Filling the tightest hole keeps the big holes open for big requests (a 1-GPU request
    on an 8-GPU host with 8 free would leave an 8-GPU request nowhere to go). The first
    place wins a tie, so callers decide the order (hosts by id, GPUs by index) and the
    choice is the same on every run. None when no place has `need` free.
    """
    best: tuple[Place, int] | None = None
    for place, n in free:
        if n >= need and (best is None or n < best[1]):
            best = (place, n)
    return None if best is None else best[0]
