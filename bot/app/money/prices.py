"""The price catalog the bot quotes and bills from, loaded one way.

Anything that puts a dollar figure in front of someone (`/gpu prices`, `/gpu recommend`,
`/gpu cost team`, the digest, a launch's hourly price, the pool's limits, a provider's
rates) reads `priced_catalog(settings)`: the file `gpubot prices refresh` wrote when there
is one, else the snapshot that ships with the bot. Only two other loads remain, each for
its own reason: an explicit file a person names (`gpubot simulate --prices`, the refresh's
base) and, where no settings are at hand, the shipped snapshot for GPU model *names*
(`a100` → A100), which a refresh does not change.
"""

from __future__ import annotations

from pathlib import Path

from bot.app.config import Settings
from bot.domain.errors import UserError
from provisioning.catalog import Catalog

_loaded: dict[Path, tuple[int, Catalog]] = {}


def priced_catalog(settings: Settings) -> Catalog:
    """The catalog the bot quotes from: the refreshed file (`gpubot prices refresh`) when
    it exists, else the shipped snapshot. Re-read when the file changes, so a refresh
    reaches a running bot without a restart."""
    path = settings.prices_path
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        stamp = -1  # no refreshed file: the shipped one
    cached = _loaded.get(path)
    if cached is None or cached[0] != stamp:
        try:
            cached = (stamp, Catalog.load(prefer=path))
        except ValueError as exc:
            raise UserError(
                f"The refreshed price file is unreadable ({exc}). An admin can run "
                "`gpubot prices refresh` again or delete the file."
            ) from None
        _loaded[path] = cached
    return cached[1]
