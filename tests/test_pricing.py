"""`gpubot prices refresh`: AWS prices into a catalog CSV the bot then prefers.

moto has no Price List API, so `get_products` is answered by botocore's `Stubber` (in
process) or by a small loopback server speaking its JSON protocol (for the CLI, which
builds its own clients). The answers are shaped like real ones: each PriceList entry is a
JSON *string* with product.attributes and terms.OnDemand/Reserved. Spot history comes
from moto (in process and as a server); its prices are placeholders, so those tests
check the plumbing, and a Stubber-fed test checks the arithmetic.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import boto3
import pytest
from botocore.stub import ANY, Stubber
from moto import mock_aws
from moto.server import ThreadedMotoServer
from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from bot.faces.cli import app
from bot.faces.dispatch import handle_text
from bot.faces.terminal import render
from provisioning.base import ProvisioningError
from provisioning.catalog import SHIPPED_PRICES, Catalog
from provisioning.pricing import fetch_spot, ondemand_price, refresh, to_csv
from tests.core.helpers import actor, host, make_service
from tests.provisioning_aws.conftest import fake_aws_env

REGION = "us-east-1"
NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)

# What AWS is made to answer: new on-demand prices for most types; none for g6e.xlarge.
NEW_ONDEMAND = {
    "p5.48xlarge": "49.5360000000",  # cheaper than the snapshot's 55.04
    "p4d.24xlarge": "21.9576420000",  # unchanged: not reported
    "p4de.24xlarge": "27.4470500000",
    "p3.2xlarge": "3.0600000000",
    "p3.8xlarge": "12.2400000000",
    "g5.xlarge": "1.0060000000",
    "g5.12xlarge": "5.6720000000",
    "g6.xlarge": "0.8048000000",
    "g4dn.xlarge": "0.5260000000",
}
SILENT = "g6e.xlarge"


def _aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_aws_env(
        monkeypatch,
        tmp_path,
        also_unset=("AWS_ENDPOINT_URL_PRICING", "GPUBOT_PRICES_FILE", "GPUBOT_CONFIG"),
    )
    monkeypatch.setenv("GPUBOT_HOME", str(tmp_path / "home"))


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _aws_env(monkeypatch, tmp_path)


def price_entry(instance_type: str, usd: str, **attrs: str) -> str:
    """One PriceList entry as the API sends it: a JSON string, reserved terms and all."""
    sku = "SKU" + instance_type.replace(".", "").upper()[:10]
    attributes = {
        "servicecode": "AmazonEC2",
        "servicename": "Amazon Elastic Compute Cloud",
        "instanceType": instance_type,
        "instanceFamily": "GPU instance",
        "location": "US East (N. Virginia)",
        "locationType": "AWS Region",
        "regionCode": REGION,
        "operatingSystem": "Linux",
        "tenancy": "Shared",
        "preInstalledSw": "NA",
        "capacitystatus": "Used",
        "licenseModel": "No License required",
        "marketoption": "OnDemand",
        "operation": "RunInstances",
        "usagetype": f"BoxUsage:{instance_type}",
        "vcpu": "192",
        "memory": "2048 GiB",
        "gpu": "8",
        "currentGeneration": "Yes",
        **attrs,
    }
    doc = {
        "product": {"productFamily": "Compute Instance", "attributes": attributes, "sku": sku},
        "serviceCode": "AmazonEC2",
        "terms": {
            "OnDemand": {
                f"{sku}.JRTCKXETXF": {
                    "priceDimensions": {
                        f"{sku}.JRTCKXETXF.6YS6EN2CT7": {
                            "unit": "Hrs",
                            "endRange": "Inf",
                            "description": f"${usd} per On Demand Linux {instance_type} Hour",
                            "appliesTo": [],
                            "rateCode": f"{sku}.JRTCKXETXF.6YS6EN2CT7",
                            "beginRange": "0",
                            "pricePerUnit": {"USD": usd},
                        }
                    },
                    "sku": sku,
                    "effectiveDate": "2026-11-01T00:00:00Z",
                    "offerTermCode": "JRTCKXETXF",
                    "termAttributes": {},
                }
            },
            # A reserved term's hourly rate is lower: it must never be taken for on-demand.
            "Reserved": {
                f"{sku}.4NA7Y494T4": {
                    "priceDimensions": {
                        f"{sku}.4NA7Y494T4.6YS6EN2CT7": {
                            "unit": "Hrs",
                            "description": "Linux/UNIX (Amazon VPC), 1yr, No Upfront",
                            "pricePerUnit": {"USD": "0.0100000000"},
                            "appliesTo": [],
                            "rateCode": f"{sku}.4NA7Y494T4.6YS6EN2CT7",
                            "beginRange": "0",
                            "endRange": "Inf",
                        }
                    },
                    "sku": sku,
                    "effectiveDate": "2026-11-01T00:00:00Z",
                    "offerTermCode": "4NA7Y494T4",
                    "termAttributes": {
                        "LeaseContractLength": "1yr",
                        "OfferingClass": "standard",
                        "PurchaseOption": "No Upfront",
                    },
                }
            },
        },
        "version": "20261120180000",
        "publicationDate": "2026-11-20T18:00:00Z",
    }
    return json.dumps(doc)


def _entries(instance_type: str) -> list[str]:
    usd = NEW_ONDEMAND.get(instance_type)
    return [] if usd is None else [price_entry(instance_type, usd)]


def _filters(instance_type: str) -> list[dict[str, str]]:
    return [
        {"Type": "TERM_MATCH", "Field": "location", "Value": "US East (N. Virginia)"},
        {"Type": "TERM_MATCH", "Field": "instanceType", "Value": instance_type},
        {"Type": "TERM_MATCH", "Field": "operatingSystem", "Value": "Linux"},
        {"Type": "TERM_MATCH", "Field": "tenancy", "Value": "Shared"},
        {"Type": "TERM_MATCH", "Field": "preInstalledSw", "Value": "NA"},
        {"Type": "TERM_MATCH", "Field": "capacitystatus", "Value": "Used"},
    ]


def _stub_pricing(client: Any, catalog: Catalog) -> Stubber:
    """One get_products exchange per catalog type; p5's answer comes on a second page."""
    stub = Stubber(client)
    for t in catalog.types:
        params = {"ServiceCode": "AmazonEC2", "Filters": _filters(t.instance_type)}
        params["FormatVersion"] = "aws_v1"
        if t.instance_type == "p5.48xlarge":
            stub.add_response(
                "get_products",
                {"FormatVersion": "aws_v1", "PriceList": [], "NextToken": "t2"},
                params,
            )
            stub.add_response(
                "get_products",
                {"FormatVersion": "aws_v1", "PriceList": _entries(t.instance_type)},
                {**params, "NextToken": "t2"},
            )
        else:
            stub.add_response(
                "get_products",
                {"FormatVersion": "aws_v1", "PriceList": _entries(t.instance_type)},
                params,
            )
    stub.activate()
    return stub


def test_ondemand_price_reads_the_ondemand_term_only() -> None:
    entries = [price_entry("p5.48xlarge", "49.5360000000")]
    assert ondemand_price(entries, "p5.48xlarge") == pytest.approx(49.536)
    # A Capacity Block offer that slipped past the filters loses to the plain one.
    block = price_entry("p5.48xlarge", "31.4640000000", marketoption="CapacityBlock")
    assert ondemand_price([block, *entries], "p5.48xlarge") == pytest.approx(49.536)
    assert ondemand_price([], "p5.48xlarge") is None
    assert ondemand_price(["not json", price_entry("g5.xlarge", "1.0")], "p5.48xlarge") is None
    # Malformed entries are skipped, not raised: the good one still counts.
    odd = ["[]", '{"product": 3}', json.dumps({"product": {"attributes": {}}, "terms": 1})]
    assert ondemand_price([*odd, *entries], "p5.48xlarge") == pytest.approx(49.536)


def test_refresh_writes_a_loadable_catalog_with_the_fetched_prices(
    aws_env: None, tmp_path: Path
) -> None:
    base = Catalog.load()
    out = tmp_path / "prices.csv"
    with mock_aws():
        session = boto3.Session(region_name=REGION)
        pricing = session.client("pricing", region_name="us-east-1")
        ec2 = session.client("ec2", region_name=REGION)
        stub = _stub_pricing(pricing, base)
        moto_history = ec2.describe_spot_price_history(
            InstanceTypes=[t.instance_type for t in base.types],  # type: ignore[misc]
            ProductDescriptions=["Linux/UNIX"],
        )["SpotPriceHistory"]
        result = refresh(base, out, REGION, pricing=pricing, ec2=ec2, now=NOW)
        stub.assert_no_pending_responses()

    new = Catalog.load(out)
    assert [t.instance_type for t in new.types] == [t.instance_type for t in base.types]
    p5 = new.get("p5.48xlarge")
    assert p5 is not None and p5.ondemand_usd_hr == pytest.approx(49.536)
    assert p5.gpu_model == "H100" and p5.gpus == 8 and p5.gpu_mem_gb == 80.0  # facts kept
    assert p5.as_of == "2026-11-30T12:00:00Z"
    assert "AWS Price List API" in p5.source

    # Spot: moto's prices are placeholders; the plumbing must carry them through as the
    # cheapest zone's price per type, and leave types moto does not offer as they were.
    moto_spot: dict[str, float] = {}
    for rec in moto_history:
        price = float(rec["SpotPrice"])
        moto_spot[rec["InstanceType"]] = min(price, moto_spot.get(rec["InstanceType"], price))
    assert moto_spot, "moto offered no spot history for any catalog type"
    for t in new.types:
        old = base.get(t.instance_type)
        assert old is not None
        if t.instance_type in moto_spot:
            assert t.spot_usd_hr == pytest.approx(moto_spot[t.instance_type])
        else:
            assert t.spot_usd_hr == old.spot_usd_hr
    assert result.spot_answered == len(moto_spot)

    # The type AWS was silent about keeps its on-demand price, and the report says so.
    g6e, old_g6e = new.get(SILENT), base.get(SILENT)
    assert g6e is not None and old_g6e is not None
    assert g6e.ondemand_usd_hr == old_g6e.ondemand_usd_hr
    assert any(line.startswith(f"{SILENT} on-demand") for line in result.kept)
    if SILENT not in moto_spot:
        assert g6e == old_g6e  # nothing answered: the whole old row, provenance included
    else:
        assert "on-demand kept from skypilot" in g6e.source
    assert result.ondemand_answered == len(NEW_ONDEMAND)

    report = "\n".join(result.lines())
    assert "p5.48xlarge on-demand: $55.04/h → $49.536/h" in report
    assert "p3.2xlarge on-demand" not in report  # unchanged prices are not listed
    assert f"{SILENT} on-demand $1.861/h (from skypilot-org" in report
    # The shipped snapshot is untouched.
    assert Catalog.load().get("p5.48xlarge") == base.get("p5.48xlarge")


def test_spot_is_the_latest_price_of_the_cheapest_standard_zone(aws_env: None) -> None:
    ec2 = boto3.Session(region_name=REGION).client("ec2", region_name=REGION)
    old, new = NOW - timedelta(hours=3), NOW - timedelta(minutes=5)

    def rec(zone: str, price: str, at: datetime, product: str = "Linux/UNIX") -> dict[str, Any]:
        return {
            "AvailabilityZone": zone,
            "InstanceType": "p4d.24xlarge",
            "ProductDescription": product,
            "SpotPrice": price,
            "Timestamp": at,
        }

    history = [
        rec("us-east-1a", "2.4700", old),  # superseded by the newer 9.10 in the same zone
        rec("us-east-1a", "9.1000", new),
        rec("us-east-1b", "8.1900", new),
        rec("us-east-1-atl-2a", "1.0000", new),  # a Local Zone: not launchable by default
        rec("us-east-1c", "0.5000", new, product="Windows"),
        rec("us-east-1d", "8.0001", old),
    ]
    with Stubber(ec2) as stub:
        stub.add_response(
            "describe_spot_price_history",
            {"SpotPriceHistory": history},
            {
                "InstanceTypes": ["p4d.24xlarge", "g5.xlarge"],
                "ProductDescriptions": ["Linux/UNIX"],
                "StartTime": ANY,
            },
        )
        spot = fetch_spot(ec2, ["p4d.24xlarge", "g5.xlarge"], REGION)
    assert spot == {"p4d.24xlarge": pytest.approx(8.0001)}


def test_throttling_is_a_plain_error_and_nothing_is_written(aws_env: None, tmp_path: Path) -> None:
    base = Catalog.load()
    out = tmp_path / "prices.csv"
    session = boto3.Session(region_name=REGION)
    pricing = session.client("pricing", region_name="us-east-1")
    ec2 = session.client("ec2", region_name=REGION)
    with Stubber(pricing) as stub:
        stub.add_response(
            "get_products",
            {"FormatVersion": "aws_v1", "PriceList": _entries("p5.48xlarge")},
            {
                "ServiceCode": "AmazonEC2",
                "Filters": _filters("p5.48xlarge"),
                "FormatVersion": "aws_v1",
            },
        )
        stub.add_client_error(
            "get_products",
            service_error_code="ThrottlingException",
            service_message="Rate exceeded",
            http_status_code=400,
        )
        with pytest.raises(ProvisioningError) as err:
            refresh(base, out, REGION, pricing=pricing, ec2=ec2, now=NOW)
    assert str(err.value) == (
        "Cannot read on-demand prices from the AWS Price List API: AWS is throttling "
        "requests; try again in a minute (Rate exceeded)."
    )
    assert err.value.__context__ is None and err.value.__cause__ is None
    assert not out.exists() and not list(tmp_path.glob(".prices-*"))


def test_a_bad_region_is_refused_before_any_call(tmp_path: Path) -> None:
    with pytest.raises(ProvisioningError, match="not an AWS region name"):
        refresh(Catalog.load(), tmp_path / "p.csv", "Virginia")
    assert not (tmp_path / "p.csv").exists()


# --- the command line, against loopback endpoints ----------------------------------


class _FakePricing(BaseHTTPRequestHandler):
    """The Price List API's JSON protocol, answering from NEW_ONDEMAND, or throttling."""

    throttle: ClassVar[bool] = False
    calls: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        target = self.headers.get("X-Amz-Target", "")
        type(self).calls.append(target)
        if type(self).throttle:
            self._send(400, {"__type": "ThrottlingException", "message": "Rate exceeded"})
            return
        if target != "AWSPriceListService.GetProducts":
            self._send(400, {"__type": "InvalidParameterException", "message": target})
            return
        itype = next(f["Value"] for f in body["Filters"] if f["Field"] == "instanceType")
        self._send(200, {"FormatVersion": "aws_v1", "PriceList": _entries(itype)})

    def _send(self, status: int, doc: dict[str, Any]) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/x-amz-json-1.1")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-amzn-RequestId", "00000000-0000-0000-0000-000000000000")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        return


@pytest.fixture
def fake_pricing() -> Iterator[tuple[str, type[_FakePricing]]]:
    handler = type("Pricing", (_FakePricing,), {"throttle": False, "calls": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def moto_ec2(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("MOTO_EC2_LOAD_DEFAULT_AMIS", "false")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host_, port = server.get_host_and_port()
    try:
        yield f"http://{host_}:{port}"
    finally:
        server.stop()


def test_cli_refresh_writes_the_file_the_bot_then_quotes(
    aws_env: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fake_pricing: tuple[str, type[_FakePricing]],
    moto_ec2: str,
    sqlite_engine: Engine,
) -> None:
    url, handler = fake_pricing
    monkeypatch.setenv("AWS_ENDPOINT_URL_PRICING", url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_EC2", moto_ec2)
    result = CliRunner().invoke(app, ["prices", "refresh"])
    assert result.exit_code == 0, result.output
    written = tmp_path / "home" / "prices.csv"
    assert f"Wrote {written}." in result.stdout
    assert "p5.48xlarge on-demand: $55.04/h → $49.536/h" in result.stdout
    assert f"{SILENT} on-demand $1.861/h" in result.stdout
    assert len(handler.calls) == len(Catalog.load().types)

    # Catalog.load prefers the refreshed file when told where it is, else the shipped one.
    preferred = Catalog.load(prefer=written)
    assert preferred.path == written and not preferred.shipped
    assert preferred.get("p5.48xlarge") == Catalog.load(written).get("p5.48xlarge")
    fallback = Catalog.load(prefer=tmp_path / "absent.csv")
    assert fallback.path == SHIPPED_PRICES and fallback.shipped

    # /gpu prices quotes it and says it is refreshed; /gpu recommend prices with it too.
    svc, _ = make_service(sqlite_engine, [host("one", "A100", 1)], home=tmp_path / "home")
    text = render(handle_text(svc, actor(svc, "alice"), "/gpu prices h100").view)
    assert "$49.54" in text and "Using refreshed prices" in text
    assert "As of: 20" in text and "AWS Price List API" in text
    text = render(handle_text(svc, actor(svc, "alice"), "/gpu recommend --mem 70 --hours 10").view)
    assert "$6.192" in text  # 49.536 / 8 GPUs, not the snapshot's $6.880
    shipped, _ = make_service(sqlite_engine, [host("one", "A100", 1)], home=tmp_path / "other")
    text = render(handle_text(shipped, actor(shipped, "alice"), "/gpu prices h100").view)
    assert "$55.04" in text and "Using refreshed prices" not in text


def test_cli_throttled_exits_1_in_plain_words_and_writes_nothing(
    aws_env: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fake_pricing: tuple[str, type[_FakePricing]],
) -> None:
    url, handler = fake_pricing
    handler.throttle = True
    monkeypatch.setenv("AWS_ENDPOINT_URL_PRICING", url)
    out = tmp_path / "p.csv"
    result = CliRunner().invoke(app, ["prices", "refresh", "--out", str(out)])
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        "gpubot: Cannot read on-demand prices from the AWS Price List API: AWS is throttling "
        "requests; try again in a minute (Rate exceeded)."
    )
    assert "Traceback" not in result.output and not out.exists()
    assert len(handler.calls) == 3  # the client retried throttling, then gave up


def test_cli_without_credentials_or_network_says_so(
    aws_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    result = CliRunner().invoke(app, ["prices", "refresh"])
    assert result.exit_code == 1
    assert "no AWS credentials found" in result.stderr and "Traceback" not in result.output

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_ENDPOINT_URL_PRICING", "http://127.0.0.1:9")  # discard: refused
    result = CliRunner().invoke(app, ["prices", "refresh"])
    assert result.exit_code == 1
    assert "AWS is unreachable at http://127.0.0.1:9" in result.stderr
    assert not (tmp_path / "home" / "prices.csv").exists()


def test_the_written_csv_round_trips(tmp_path: Path) -> None:
    base = Catalog.load()
    path = tmp_path / "same.csv"
    path.write_text(to_csv(base.types))
    assert Catalog.load(path).types == base.types


def test_cli_help_lists_the_refresh_command() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0 and "prices" in result.stdout
    result = CliRunner().invoke(app, ["prices", "--help"])
    assert result.exit_code == 0 and "refresh" in result.stdout
