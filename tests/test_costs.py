"""provisioning.costs: the one declaration of what an instance costs, and the GPU share.

The simulator, the scheduler and the bot each once carried their own copy of these
numbers; these tests fail when a copy drifts from the declaration again."""

from __future__ import annotations

import inspect
from decimal import Decimal
from fractions import Fraction

import pytest

from bot.app.config import Settings
from bot.domain.scheduling import SchedulerConfig
from bot.faces.simulate_cli import simulate
from bot.sim.simulate import run_simulation
from provisioning.catalog import Catalog
from provisioning.costs import DEFAULT_COSTS, CloudCosts, gpu_share, storage_usd_per_hour
from provisioning.simulated import SimulatedCloud

COST_FIELDS = ("boot_s", "setup_s", "start_s", "ebs_gb", "ebs_usd_gb_month")


def _defaults(fn: object) -> dict[str, object]:
    params = inspect.signature(fn).parameters  # type: ignore[arg-type]
    out = {}
    for name in COST_FIELDS:
        default = params[name].default
        out[name] = getattr(default, "default", default)  # a typer.Option wraps it
    return out


def test_the_simulator_and_its_cli_read_the_declared_costs() -> None:
    want = {name: getattr(DEFAULT_COSTS, name) for name in COST_FIELDS}
    assert _defaults(SimulatedCloud.__init__) == want
    assert _defaults(run_simulation) == want
    assert _defaults(simulate) == want


def test_the_settings_default_to_the_declared_volume() -> None:
    fields = Settings.model_fields
    assert fields["ebs_gb"].default == DEFAULT_COSTS.ebs_gb
    assert fields["ebs_usd_gb_month"].default == DEFAULT_COSTS.ebs_usd_gb_month


def test_the_schedulers_defaults_match_the_declared_costs() -> None:
    cfg = SchedulerConfig()
    assert (cfg.boot_s, cfg.setup_s, cfg.start_s, cfg.min_bill_s) == (
        DEFAULT_COSTS.boot_s,
        DEFAULT_COSTS.setup_s,
        DEFAULT_COSTS.start_s,
        DEFAULT_COSTS.min_bill_s,
    )
    assert cfg.ebs_usd_s == DEFAULT_COSTS.storage_usd_per_s


def test_the_simulated_cloud_bills_storage_at_the_declared_rate() -> None:
    costs = CloudCosts(ebs_gb=730.0, ebs_usd_gb_month=3.6)
    cloud = SimulatedCloud(Catalog.load(), ebs_gb=730.0, ebs_usd_gb_month=3.6)
    # 730 GB at $3.60 a GB-month over a 730-hour month: $3.60 an hour, $0.001 a second.
    assert costs.storage_usd_per_hour == pytest.approx(3.6)
    assert cloud.ebs_usd_s == costs.storage_usd_per_s == pytest.approx(0.001)


def test_storage_per_hour_uses_a_730_hour_month() -> None:
    assert storage_usd_per_hour(500.0, 0.08) == pytest.approx(40.0 / 730)
    assert DEFAULT_COSTS.storage_usd_per_hour * 730 == pytest.approx(40.0)


def test_gpu_share_splits_the_price_in_the_callers_number_type() -> None:
    as_float = gpu_share(32.77, 8)
    assert as_float == 32.77 / 8 and type(as_float) is float
    as_decimal = gpu_share(Decimal("32.77"), 8)
    assert as_decimal == Decimal("4.09625") and type(as_decimal) is Decimal
    as_fraction = gpu_share(Fraction(10), 3)
    assert as_fraction == Fraction(10, 3) and type(as_fraction) is Fraction


def test_a_machine_without_gpus_is_one_slot_at_the_whole_price() -> None:
    assert gpu_share(2.5, 0) == 2.5
    assert gpu_share(Decimal("3"), 0) == Decimal("3")
