"""The GPU instance catalog: which instance types carry which GPU, and what they cost.

The facts live in a CSV (the shipped snapshot is `provisioning/data/aws_gpu_prices.csv`,
see `shared/prices/README.md` for where every number comes from) rather than in code, so a
price refresh is a data change and a user can point the simulator at their own file with
`--prices`. Everything here is immutable: the scheduler, the simulator and the bot share
one loaded `Catalog` without defensive copies.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

from provisioning.costs import gpu_share

SHIPPED_PRICES: Path = Path(__file__).resolve().parent / "data" / "aws_gpu_prices.csv"

HEADER: tuple[str, ...] = (
    "instance_type",
    "gpu_model",
    "gpus",
    "gpu_mem_gb",
    "vcpus",
    "mem_gb",
    "ondemand_usd_hr",
    "spot_usd_hr",
    "source",
    "as_of",
)


@dataclass(frozen=True)
class InstanceType:
    """One rentable machine shape and its hourly prices."""

    instance_type: str  # the provider's name, e.g. "p4d.24xlarge"
    gpu_model: str  # canonical GPU model, e.g. "A100", "A100-80GB"
    gpus: int  # GPUs on one instance (>= 1)
    gpu_mem_gb: float  # memory of ONE GPU, GB
    vcpus: int  # vCPUs on the instance
    mem_gb: float  # instance RAM, GiB
    ondemand_usd_hr: float  # on-demand price of the whole instance, USD per hour
    spot_usd_hr: float | None  # typical (median) spot price, None where no spot market
    source: str  # where the numbers came from (for display next to any quoted cost)
    as_of: str  # when they were true, as free text

    @property
    def ondemand_per_gpu_hr(self) -> float:
        """The number that matters when one GPU of a multi-GPU instance is wanted."""
        return self.gpu_hourly("ondemand")

    def hourly(self, market: str) -> float:
        """The whole instance's price in a market: spot where one is asked for and quoted,
        else on-demand (a type without a spot market is bought on-demand)."""
        if market == "spot" and self.spot_usd_hr:
            return self.spot_usd_hr
        return self.ondemand_usd_hr

    def gpu_hourly(self, market: str) -> float:
        """One GPU's share of `hourly(market)` (provisioning.costs.gpu_share)."""
        return gpu_share(self.hourly(market), self.gpus)


def _key(text: str) -> str:
    """Folds case and separators so 'a100_80gb', 'A100-80G' and 'a100 80GB' compare equal."""
    folded = re.sub(r"[\s_\-]+", "", text.strip().upper())
    # "80G" is how people write "80GB" in a hurry; only at the end, after digits.
    return re.sub(r"(\d)G$", r"\1GB", folded)


class Catalog:
    """An immutable set of instance types with the look-ups the bot and simulator need."""

    def __init__(self, types: tuple[InstanceType, ...], *, path: Path | None = None) -> None:
        if not types:
            raise ValueError("price catalog has no instance types")
        names = [t.instance_type for t in types]
        if len(set(names)) != len(names):
            raise ValueError("price catalog lists an instance type twice")
        self.types: tuple[InstanceType, ...] = types
        self.path = path
        self._by_name = {t.instance_type: t for t in types}
        self._by_key = {_key(t.gpu_model): t.gpu_model for t in types}

    @classmethod
    def load(cls, path: Path | None = None, *, prefer: Path | None = None) -> Catalog:
        """Reads a prices CSV; `None` means `prefer` when that file exists (the one
        `gpubot prices refresh` writes), else the shipped snapshot.

        A malformed file is a `ValueError` naming the file and the row, because the
        caller (CLI, config check) shows it to a person as one line.
        """
        if path is None and prefer is not None and Path(prefer).is_file():
            path = Path(prefer)
        src = SHIPPED_PRICES if path is None else Path(path)
        try:
            text = src.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read prices file {src}: {exc.strerror or exc}") from exc
        rows = list(csv.reader(text.splitlines()))
        if not rows:
            raise ValueError(f"prices file {src} is empty")
        header = tuple(h.strip() for h in rows[0])
        if header != HEADER:
            raise ValueError(f"prices file {src}: header must be {','.join(HEADER)}")
        types: list[InstanceType] = []
        for lineno, row in enumerate(rows[1:], start=2):
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != len(HEADER):
                raise ValueError(f"prices file {src} line {lineno}: expected {len(HEADER)} fields")
            types.append(_parse_row(row, src, lineno))
        try:
            return cls(tuple(types), path=src)
        except ValueError as exc:
            raise ValueError(f"prices file {src}: {exc}") from exc

    @property
    def source(self) -> str:
        """Provenance of the prices, joined when rows disagree."""
        return "; ".join(sorted({t.source for t in self.types}))

    @property
    def as_of(self) -> str:
        return "; ".join(sorted({t.as_of for t in self.types}))

    @property
    def shipped(self) -> bool:
        """False when the prices come from a refreshed or user-given file, which views say."""
        return self.path is None or self.path.resolve() == SHIPPED_PRICES

    def models(self) -> list[str]:
        """Canonical GPU model names, sorted."""
        return sorted({t.gpu_model for t in self.types})

    def normalize_model(self, text: str) -> str | None:
        """Turns what a user typed ('a100', 'a100_80gb') into a catalog model, or None."""
        if not text or not text.strip():
            return None
        return self._by_key.get(_key(text))

    def for_model(self, model: str) -> list[InstanceType]:
        """Instance types carrying `model` (any spelling), cheapest on-demand first."""
        canon = self.normalize_model(model)
        if canon is None:
            return []
        found = [t for t in self.types if t.gpu_model == canon]
        return sorted(found, key=lambda t: (t.ondemand_usd_hr, t.instance_type))

    def cheapest(self, model: str, gpus: int = 1) -> InstanceType | None:
        """The cheapest instance (by total hourly price) of `model` with >= `gpus` GPUs."""
        fits = [t for t in self.for_model(model) if t.gpus >= gpus]
        return fits[0] if fits else None

    def get(self, instance_type: str) -> InstanceType | None:
        return self._by_name.get(instance_type.strip())

    def __repr__(self) -> str:
        return f"Catalog({len(self.types)} types from {self.path})"


def _parse_row(row: list[str], src: Path, lineno: int) -> InstanceType:
    cells = [c.strip() for c in row]
    where = f"prices file {src} line {lineno}"
    try:
        gpus = int(cells[2])
        vcpus = int(cells[4])
        gpu_mem = float(cells[3])
        mem = float(cells[5])
        ondemand = float(cells[6])
        spot = float(cells[7]) if cells[7] else None
    except ValueError as exc:
        raise ValueError(f"{where}: not a number ({exc})") from exc
    if not cells[0] or not cells[1]:
        raise ValueError(f"{where}: instance_type and gpu_model must not be empty")
    if gpus < 1:
        raise ValueError(f"{where}: gpus must be >= 1")
    if not ondemand > 0 or (spot is not None and not spot > 0):
        raise ValueError(f"{where}: prices must be positive")
    return InstanceType(
        instance_type=cells[0],
        gpu_model=cells[1],
        gpus=gpus,
        gpu_mem_gb=gpu_mem,
        vcpus=vcpus,
        mem_gb=mem,
        ondemand_usd_hr=ondemand,
        spot_usd_hr=spot,
        source=cells[8],
        as_of=cells[9],
    )
