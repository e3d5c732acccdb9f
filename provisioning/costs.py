"""What renting a GPU machine costs, in time and money: the one declaration.

The simulator's cloud (`provisioning.simulated`), `gpubot simulate`'s options, the bot's
settings and its messages all read these numbers here, so that a change to what EC2
charges or how long it takes is made once and the simulator and the bot cannot drift
apart. The scheduler's own knobs (`bot.domain.scheduling.SchedulerConfig`) start from the same
figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import TypeVar

# AWS prices monthly rates (EBS GB-month) on a 730-hour month; the bill, the simulator
# and the bot's messages all prorate storage by it. An int, so Decimal arithmetic keeps it.
HOURS_PER_MONTH = 730


@dataclass(frozen=True)
class CloudCosts:
    """The lifecycle costs of one rented instance (EC2's, by default).

    The defaults are what a fresh GPU instance takes on EC2 with the gpubot bootstrap:
    a couple of minutes to SSH, five to install the venv, a minute to restart a stopped
    one; a 500 GB gp3 root volume; and EC2's per-second billing with a one-minute minimum.
    """

    boot_s: float = 120.0  # launch → SSH-ready
    setup_s: float = 300.0  # bootstrap of a fresh instance
    start_s: float = 60.0  # restart of a stopped instance → usable
    min_bill_s: float = 60.0  # minimum billed seconds per running interval
    ebs_gb: float = 500.0  # the root volume, billed while the instance is stopped
    ebs_usd_gb_month: float = 0.08  # its price, USD per GB-month

    @property
    def storage_usd_per_hour(self) -> float:
        """What a stopped instance costs an hour: its volume, prorated per hour."""
        return storage_usd_per_hour(self.ebs_gb, self.ebs_usd_gb_month)

    @property
    def storage_usd_per_s(self) -> float:
        """The same, per second (the simulator's clock)."""
        return self.ebs_gb * self.ebs_usd_gb_month / (HOURS_PER_MONTH * 3600.0)


DEFAULT_COSTS = CloudCosts()


def storage_usd_per_hour(ebs_gb: float, ebs_usd_gb_month: float) -> float:
    """A volume priced per GB-month, per hour (730-hour month)."""
    return ebs_gb * ebs_usd_gb_month / HOURS_PER_MONTH


Money = TypeVar("Money", float, Decimal, Fraction)


def gpu_share(hourly: Money, gpus: int) -> Money:
    """One GPU's share of its machine's hourly price: the price split evenly over its GPUs.

    Every GPU slot of a machine is metered at this share, so a machine with nobody on it
    costs exactly its price in idle slots. A machine with no GPUs is one slot (all of its
    price). The arithmetic stays in the caller's number type (float for display and
    estimates, Decimal for budgets, Fraction for the exact bill), so each caller's
    figures are what they were.
    """
    return hourly / max(1, gpus)
