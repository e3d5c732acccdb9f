"""Live AWS prices for the catalog: on-demand from the Price List API, spot from EC2's
spot price history, written as a catalog CSV in the shipped format.

The shipped snapshot (`provisioning/data/aws_gpu_prices.csv`) ages: AWS cut the p4/p5
prices once already. `gpubot prices refresh` asks AWS for today's numbers for exactly the
instance types the catalog knows (the GPU facts — model, count, memory — stay as they
are: the Price List's free-text GPU attributes are less exact than the catalog's), and
writes a new file whose `source` and `as_of` say what was fetched and when. A type AWS
does not answer for keeps its old row and old provenance, and the report says so, so a
partial answer never silently drops a type the scheduler relies on.

Spot here is the *cheapest standard zone's current* price (Local Zones excluded: an
account cannot launch there by default), not the shipped file's median over zones: it is
what the bot would pay if it launched now.

Every SDK failure becomes a `ProvisioningError` in plain words (see `aws_error_text`),
raised before anything is written.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from provisioning.aws import aws_error_text, make_session
from provisioning.base import ProvisioningError
from provisioning.catalog import HEADER, Catalog, InstanceType

if TYPE_CHECKING:
    from mypy_boto3_ec2.client import EC2Client
    from mypy_boto3_ec2.literals import InstanceTypeType
    from mypy_boto3_pricing.client import PricingClient
    from mypy_boto3_pricing.type_defs import FilterTypeDef

log = logging.getLogger(__name__)

# The Price List API answers from a few regions only; us-east-1 serves every region's prices.
PRICING_ENDPOINT_REGION = "us-east-1"
DEFAULT_REGION = "us-east-1"  # the shipped catalog's region

# Price List `location` names of the regions that carry GPU instances. A region not here
# is asked for by its `regionCode` attribute, which the EC2 price list also carries.
LOCATIONS: dict[str, str] = {
    "us-east-1": "US East (N. Virginia)",
    "us-east-2": "US East (Ohio)",
    "us-west-1": "US West (N. California)",
    "us-west-2": "US West (Oregon)",
    "ca-central-1": "Canada (Central)",
    "sa-east-1": "South America (Sao Paulo)",
    "eu-west-1": "EU (Ireland)",
    "eu-west-2": "EU (London)",
    "eu-west-3": "EU (Paris)",
    "eu-central-1": "EU (Frankfurt)",
    "eu-north-1": "EU (Stockholm)",
    "eu-south-1": "EU (Milan)",
    "ap-northeast-1": "Asia Pacific (Tokyo)",
    "ap-northeast-2": "Asia Pacific (Seoul)",
    "ap-northeast-3": "Asia Pacific (Osaka)",
    "ap-southeast-1": "Asia Pacific (Singapore)",
    "ap-southeast-2": "Asia Pacific (Sydney)",
    "ap-south-1": "Asia Pacific (Mumbai)",
    "me-south-1": "Middle East (Bahrain)",
    "af-south-1": "Africa (Cape Town)",
}

# A refresh is interactive: fail in seconds, retry throttling a little (standard mode backs off).
PRICING_CLIENT_CONFIG = Config(
    connect_timeout=5,
    read_timeout=30,
    retries={"mode": "standard", "total_max_attempts": 3},
)

# The Price List API's own refusals, in the words `aws_error_text` uses for EC2's.
_PRICING_WORDS: dict[str, str] = {
    "ThrottlingException": "AWS is throttling requests; try again in a minute",
    "AccessDeniedException": (
        "the AWS identity may not read prices (it needs pricing:GetProducts and "
        "ec2:DescribeSpotPriceHistory)"
    ),
    "InternalErrorException": "the AWS Price List service failed; try again later",
    "ExpiredNextTokenException": "the price list changed while it was read; try again",
}

_REGION_RE = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d$")


@dataclass(frozen=True)
class PriceChange:
    """One price that differs from the catalog's before the refresh."""

    instance_type: str
    what: str  # "on-demand" or "spot"
    old: float | None  # None: the catalog had no spot price
    new: float


@dataclass(frozen=True)
class RefreshResult:
    """What a refresh fetched, what it changed, and what it kept for lack of an answer."""

    types: tuple[InstanceType, ...]  # the new catalog rows, in the old order
    changes: tuple[PriceChange, ...]
    kept: tuple[str, ...]  # one plain line per price AWS did not answer for
    region: str
    as_of: str  # when the prices were fetched, ISO 8601 UTC
    ondemand_answered: int
    spot_answered: int

    def lines(self) -> list[str]:
        """The report a person reads after `gpubot prices refresh`."""
        n = len(self.types)
        out = [
            f"AWS answered {self.ondemand_answered} of {n} on-demand and {self.spot_answered} "
            f"of {n} spot prices for {self.region} (as of {self.as_of})."
        ]
        if self.changes:
            out.append(f"{len(self.changes)} price(s) changed:")
            out += [
                f"  {c.instance_type} {c.what}: {_money(c.old)} → {_money(c.new)}"
                for c in self.changes
            ]
        else:
            out.append("No price changed.")
        if self.kept:
            out.append("Kept from the old catalog (AWS did not answer):")
            out += [f"  {line}" for line in self.kept]
        return out


def _money(value: float | None) -> str:
    return "none" if value is None else f"${_number(value)}/h"


def _number(value: float) -> str:
    """Six decimals without trailing zeros: exact enough for a price, never exponent form."""
    return f"{value:.6f}".rstrip("0").rstrip(".")


def _pricing_error_text(exc: Exception, action: str) -> str:
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        words = _PRICING_WORDS.get(str(err.get("Code", "")))
        if words:
            message = str(err.get("Message", "")).strip()
            return f"Cannot {action}: {words}" + (f" ({message})" if message else "") + "."
    return aws_error_text(exc, action)


def _filters(instance_type: str, region: str) -> list[FilterTypeDef]:
    where: FilterTypeDef = (
        {"Type": "TERM_MATCH", "Field": "location", "Value": LOCATIONS[region]}
        if region in LOCATIONS
        else {"Type": "TERM_MATCH", "Field": "regionCode", "Value": region}
    )
    fixed = {
        "instanceType": instance_type,
        "operatingSystem": "Linux",
        "tenancy": "Shared",
        "preInstalledSw": "NA",
        "capacitystatus": "Used",
    }
    return [where] + [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in fixed.items()]


def ondemand_price(entries: Iterable[str], instance_type: str) -> float | None:
    """The hourly USD on-demand price in a `get_products` PriceList, or None.

    Each entry is a JSON document (a string, as the API sends it). With the filters of
    `_filters` one product normally matches; where several do (a Capacity Block offer,
    a licensed variant), the plain on-demand, no-license one wins, then the lowest price.
    """
    plain: list[float] = []
    other: list[float] = []
    for raw in entries:
        try:
            prices, is_plain = _entry_prices(json.loads(raw), instance_type)
        except (TypeError, ValueError, AttributeError):
            # Not JSON, or not shaped like a price list entry: one bad entry must not
            # cost the others (nor show a person a traceback).
            log.warning("a price list entry for %s is malformed; skipped", instance_type)
            continue
        (plain if is_plain else other).extend(prices)
    found = plain or other
    return min(found) if found else None


def _entry_prices(doc: dict[str, Any], instance_type: str) -> tuple[list[float], bool]:
    attrs = doc["product"]["attributes"]
    if attrs.get("instanceType", instance_type) != instance_type:
        return [], False
    prices: list[float] = []
    for term in doc.get("terms", {}).get("OnDemand", {}).values():
        for dim in term.get("priceDimensions", {}).values():
            usd = dim.get("pricePerUnit", {}).get("USD")
            if str(dim.get("unit", "Hrs")).lower() not in {"hrs", "hours"} or usd is None:
                continue
            price = float(usd)
            if price > 0 and price != float("inf"):  # 0: a reservation's placeholder line
                prices.append(price)
    is_plain = attrs.get("marketoption", "OnDemand") == "OnDemand" and attrs.get(
        "licenseModel", "No License required"
    ) in {"No License required", "NA"}
    return prices, is_plain


def fetch_ondemand(
    client: PricingClient, instance_types: Sequence[str], region: str
) -> dict[str, float]:
    """On-demand USD per hour for each type AWS lists in `region` (Linux, shared tenancy)."""
    prices: dict[str, float] = {}
    paginator = client.get_paginator("get_products")
    for itype in instance_types:
        entries: list[str] = []
        pages = paginator.paginate(
            ServiceCode="AmazonEC2",
            Filters=_filters(itype, region),
            FormatVersion="aws_v1",
        )
        for page in pages:
            entries += page.get("PriceList", [])
        price = ondemand_price(entries, itype)
        if price is not None:
            prices[itype] = price
    return prices


def fetch_spot(client: EC2Client, instance_types: Sequence[str], region: str) -> dict[str, float]:
    """The current Linux spot price per type in its cheapest standard zone of `region`.

    `StartTime=now` makes EC2 return, per zone, the price in effect now (the last change
    before it); the latest record per (type, zone) is that price.
    """
    zone_re = re.compile(rf"^{re.escape(region)}[a-z]$")
    latest: dict[tuple[str, str], tuple[datetime, float]] = {}
    paginator = client.get_paginator("describe_spot_price_history")
    pages = paginator.paginate(
        InstanceTypes=[_as_instance_type(t) for t in instance_types],
        ProductDescriptions=["Linux/UNIX"],
        StartTime=datetime.now(UTC),
    )
    for page in pages:
        for rec in page.get("SpotPriceHistory", []):
            itype = str(rec.get("InstanceType", ""))
            zone = str(rec.get("AvailabilityZone", ""))
            # "Linux/UNIX (Amazon VPC)" is the same product priced for VPC launches.
            if not str(rec.get("ProductDescription", "")).startswith("Linux/UNIX"):
                continue
            if itype not in instance_types or not zone_re.match(zone):
                continue
            try:
                price = float(rec.get("SpotPrice", ""))
            except ValueError:
                continue
            if not price > 0:
                continue
            stamp = rec.get("Timestamp") or datetime.min.replace(tzinfo=UTC)
            prior = latest.get((itype, zone))
            if prior is None or stamp >= prior[0]:
                latest[(itype, zone)] = (stamp, price)
    cheapest: dict[str, float] = {}
    for (itype, _zone), (_stamp, price) in latest.items():
        cheapest[itype] = min(price, cheapest.get(itype, price))
    return cheapest


def _as_instance_type(name: str) -> InstanceTypeType:
    # The stubs list every EC2 type as a Literal; ours come from a data file.
    return name  # type: ignore[return-value]


def merge(
    base: Catalog,
    ondemand: dict[str, float],
    spot: dict[str, float],
    region: str,
    as_of: str,
) -> RefreshResult:
    """The new rows: fetched prices where AWS answered, the old row's where it did not."""
    rows: list[InstanceType] = []
    changes: list[PriceChange] = []
    kept: list[str] = []
    for old in base.types:
        name = old.instance_type
        od = ondemand.get(name)
        sp = spot.get(name)
        if od is None:
            kept.append(
                f"{name} on-demand {_money(old.ondemand_usd_hr)} "
                f"(from {old.source}, as of {old.as_of})"
            )
        if sp is None:
            kept.append(
                f"{name} spot {_money(old.spot_usd_hr)} (from {old.source}, as of {old.as_of})"
            )
        if od is None and sp is None:
            rows.append(old)
            continue
        if od is not None and sp is not None:
            source = f"AWS Price List API + EC2 spot history ({region})"
        elif od is not None:
            source = f"AWS Price List API ({region}); spot kept from {old.source}"
        else:
            source = f"EC2 spot history ({region}); on-demand kept from {old.source}"
        new = replace(
            old,
            ondemand_usd_hr=od if od is not None else old.ondemand_usd_hr,
            spot_usd_hr=sp if sp is not None else old.spot_usd_hr,
            source=source,
            as_of=as_of,
        )
        if od is not None and not _same(od, old.ondemand_usd_hr):
            changes.append(PriceChange(name, "on-demand", old.ondemand_usd_hr, od))
        if sp is not None and (old.spot_usd_hr is None or not _same(sp, old.spot_usd_hr)):
            changes.append(PriceChange(name, "spot", old.spot_usd_hr, sp))
        rows.append(new)
    return RefreshResult(
        types=tuple(rows),
        changes=tuple(changes),
        kept=tuple(kept),
        region=region,
        as_of=as_of,
        ondemand_answered=sum(1 for t in base.types if t.instance_type in ondemand),
        spot_answered=sum(1 for t in base.types if t.instance_type in spot),
    )


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 5e-7 * max(1.0, abs(b))


def to_csv(types: Sequence[InstanceType]) -> str:
    """The shipped file's format, so `Catalog.load` and `--prices` read it unchanged."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(HEADER)
    for t in types:
        writer.writerow(
            [
                t.instance_type,
                t.gpu_model,
                t.gpus,
                _number(t.gpu_mem_gb),
                t.vcpus,
                _number(t.mem_gb),
                _number(t.ondemand_usd_hr),
                "" if t.spot_usd_hr is None else _number(t.spot_usd_hr),
                t.source,
                t.as_of,
            ]
        )
    return buf.getvalue()


def write_catalog(types: Sequence[InstanceType], path: Path) -> None:
    """Atomic: a bot reading the file mid-refresh sees the old one or the new one, whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".prices-", suffix=".csv", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            fh.write(to_csv(types))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def refresh(
    base: Catalog,
    out: Path,
    region: str = DEFAULT_REGION,
    *,
    pricing: PricingClient | None = None,
    ec2: EC2Client | None = None,
    now: datetime | None = None,
) -> RefreshResult:
    """Fetches both prices for every type of `base`, writes `out`, and says what changed.

    Raises `ProvisioningError` (plain words, nothing written) on any AWS failure, and
    when AWS answered for no type at all: a file of only old rows would claim a refresh
    that did not happen.
    """
    region = region.strip().lower()
    if not _REGION_RE.match(region):
        raise ProvisioningError(f"`{region}` is not an AWS region name like us-east-1.")
    names = [t.instance_type for t in base.types]
    fetched_at = (now or datetime.now(UTC)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    action = "read AWS prices"
    try:
        if pricing is None or ec2 is None:
            session = make_session(region)
            if pricing is None:
                pricing = session.client(
                    "pricing", region_name=PRICING_ENDPOINT_REGION, config=PRICING_CLIENT_CONFIG
                )
            if ec2 is None:
                ec2 = session.client("ec2", region_name=region, config=PRICING_CLIENT_CONFIG)
        action = "read on-demand prices from the AWS Price List API"
        ondemand = fetch_ondemand(pricing, names, region)
        action = "read spot prices from EC2"
        spot = fetch_spot(ec2, names, region)
    except (BotoCoreError, ClientError) as exc:
        text = _pricing_error_text(exc, action)
        # INFO, not WARNING: with no logging set up (the CLI), Python's last-resort handler
        # would print WARNINGs with their traceback; the caller shows `text` itself.
        log.info("%s", text, exc_info=True)
    else:
        if not ondemand and not spot:
            raise ProvisioningError(
                f"AWS answered no price for any of the {len(names)} catalog types in {region}; "
                "nothing was written."
            )
        result = merge(base, ondemand, spot, region, fetched_at)
        try:
            write_catalog(result.types, out)
        except OSError as exc:
            raise ProvisioningError(f"Cannot write {out}: {exc.strerror or exc}.") from None
        return result
    # Raised outside the except block so no botocore object rides along as __context__.
    raise ProvisioningError(text)
