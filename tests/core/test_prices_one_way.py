"""The price catalog is loaded one way (bot.app.money.prices): whatever shows or bills a
dollar figure reads the refreshed file when there is one. The digest and the team's bill
once read the shipped snapshot while `/gpu prices` quoted the refreshed file."""

from __future__ import annotations

import re
from pathlib import Path

from bot.app.config import Settings
from bot.app.money.prices import priced_catalog
from provisioning.catalog import HEADER, SHIPPED_PRICES, Catalog

ROOT = Path(__file__).resolve().parents[2]

# The loads that are not `priced_catalog`, each for a reason bot.app.money.prices gives.
ALLOWED = {
    "bot/app/money/prices.py": "the one way itself",
    "bot/sim/simulate.py": "an explicit --prices file",
    "bot/faces/simulate_cli.py": "an explicit --prices file",
    "bot/faces/cli.py": "the refresh's base file",
    "bot/faces/dispatch.py": "model names only",
    "bot/app/service/__init__.py": "model names only (the run service where no place runs)",
    "bot/domain/commands.py": "model names only",
    "bot/providers/ssh.py": "model names only",
}


def test_nothing_in_the_bot_loads_prices_another_way() -> None:
    found = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "bot").rglob("*.py")
        if re.search(r"Catalog\.load\(", path.read_text())
    }
    assert found <= set(ALLOWED), sorted(found - set(ALLOWED))


def test_a_refreshed_file_reaches_the_priced_catalog_without_a_restart(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    shipped = Catalog.load()
    assert priced_catalog(settings).path == SHIPPED_PRICES
    rows = SHIPPED_PRICES.read_text().splitlines()
    assert tuple(rows[0].split(",")) == HEADER
    first = rows[1].split(",")
    price = HEADER.index("ondemand_usd_hr")
    first[price] = f"{float(first[price]) * 2:.4f}"
    settings.prices_path.write_text("\n".join([rows[0], ",".join(first), *rows[2:]]) + "\n")
    refreshed = priced_catalog(settings)
    assert refreshed.path == settings.prices_path
    kind = first[HEADER.index("instance_type")]
    was, now = shipped.get(kind), refreshed.get(kind)
    assert was is not None and now is not None
    assert abs(now.ondemand_usd_hr - 2 * was.ondemand_usd_hr) < 1e-3
