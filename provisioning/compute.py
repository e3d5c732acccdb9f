"""What a provider that rents machines adds to `base.Compute`: launch, start, stop, terminate.

These belong next to `Compute` in `base.py` (see the report that brought this file); they
live here until then so that the EC2 provider and the simulated cloud can share one
request shape, and the bot can be written against the protocol instead of a class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from provisioning.base import Compute, Instance

MARKETS: tuple[str, ...] = ("ondemand", "spot")


@dataclass(frozen=True)
class LaunchSpec:
    """One request for a new machine, as the bot states it (never in a provider's terms)."""

    # Catalog GPU model ("A100", "H100", "T4", …; any spelling the catalog normalizes).
    gpu_model: str
    # GPUs wanted on ONE instance; the provider picks the cheapest type that has at least this many.
    gpus: int
    # "ondemand" or "spot". Spot may be reclaimed at any time: an expected event, not a failure.
    market: str
    # Who the instance is for (the user key); written on the instance so a forgotten one has an owner.
    owner: str
    # The idempotency key of the request that asked for it (a Slack retry carries the same one):
    # launching twice with one key returns the first instance.
    request_key: str
    # Exactly one of these says what the money is spent on.
    reservation_id: str | None = None
    job_id: str | None = None
    # Instance types the provider may pick from (the bot's pool limits allow only these);
    # empty: any type of the catalog that fits.
    instance_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Programming errors, not user errors: the bot builds specs from parsed commands.
        if self.gpus < 1:
            raise ValueError("LaunchSpec.gpus must be >= 1")
        if self.market not in MARKETS:
            raise ValueError(f"LaunchSpec.market must be one of {', '.join(MARKETS)}")
        if not self.owner.strip():
            raise ValueError("LaunchSpec.owner must not be empty")
        if not self.request_key.strip():
            raise ValueError("LaunchSpec.request_key must not be empty")
        if (self.reservation_id is None) == (self.job_id is None):
            raise ValueError("LaunchSpec needs exactly one of reservation_id and job_id")


class RentingCompute(Compute, Protocol):
    """A provider whose machines cost money per hour, so the bot can start and end them."""

    def launch(self, spec: LaunchSpec) -> Instance:
        """A new instance for `spec` (or the one already launched for its request_key)."""
        ...

    def find_by_request_key(self, request_key: str) -> Instance | None:
        """The instance launched for that request, in any state; None if there is none."""
        ...

    def get(self, instance_id: str) -> Instance | None:
        """One of its instances in any state (ended ones while the cloud still shows them);
        None when the cloud does not know it (or it is not the bot's)."""
        ...

    def start(self, instance_id: str) -> Instance: ...

    def stop(self, instance_id: str) -> Instance: ...

    def terminate(self, instance_id: str) -> Instance: ...
