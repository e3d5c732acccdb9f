"""The catalog is what every quoted cost rests on, so its look-ups are pinned here."""

from __future__ import annotations

from pathlib import Path

import pytest

from provisioning.catalog import HEADER, SHIPPED_PRICES, Catalog, InstanceType


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return Catalog.load()


def test_shipped_file_matches_the_shared_snapshot() -> None:
    shared = Path("/work/shared/prices/aws_gpu_prices.csv")
    if not shared.exists():
        pytest.skip("shared prices not present on this machine")
    assert SHIPPED_PRICES.read_text() == shared.read_text()


def test_load_shipped(catalog: Catalog) -> None:
    p4d = catalog.get("p4d.24xlarge")
    assert isinstance(p4d, InstanceType)
    assert p4d.gpu_model == "A100"
    assert p4d.gpus == 8
    assert p4d.ondemand_usd_hr == pytest.approx(21.957642)
    assert p4d.spot_usd_hr == pytest.approx(8.0001)
    assert p4d.ondemand_per_gpu_hr == pytest.approx(21.957642 / 8)
    assert "skypilot" in catalog.source
    assert catalog.as_of
    assert catalog.get("nope.large") is None


def test_models(catalog: Catalog) -> None:
    want = ["H100", "A100", "A100-80GB", "V100", "A10G", "L4", "L40S", "T4"]
    assert catalog.models() == sorted(want)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("a100", "A100"),
        ("A100", "A100"),
        ("h100", "H100"),
        ("a100-80gb", "A100-80GB"),
        ("a100-80g", "A100-80GB"),
        ("a100_80gb", "A100-80GB"),
        ("A100 80GB", "A100-80GB"),
        ("a10g", "A10G"),
        ("l40s", "L40S"),
        (" t4 ", "T4"),
        ("a200", None),
        ("", None),
        ("80gb", None),
    ],
)
def test_normalize_model(catalog: Catalog, text: str, want: str | None) -> None:
    assert catalog.normalize_model(text) == want


def test_for_model_sorted_by_price(catalog: Catalog) -> None:
    v100 = catalog.for_model("v100")
    assert [t.instance_type for t in v100] == ["p3.2xlarge", "p3.8xlarge"]
    assert catalog.for_model("a200") == []


def test_cheapest_respects_gpu_count(catalog: Catalog) -> None:
    assert catalog.cheapest("A100") is not None
    assert catalog.cheapest("A100", 1).instance_type == "p4d.24xlarge"  # type: ignore[union-attr]
    assert catalog.cheapest("a10g", 1).instance_type == "g5.xlarge"  # type: ignore[union-attr]
    assert catalog.cheapest("a10g", 2).instance_type == "g5.12xlarge"  # type: ignore[union-attr]
    assert catalog.cheapest("a10g", 5) is None
    assert catalog.cheapest("nope") is None


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "prices.csv"
    path.write_text(text)
    return path


def test_load_from_path_with_empty_spot(tmp_path: Path) -> None:
    row = "x.large,A100,2,40,8,64,5.0,,here,today"
    cat = Catalog.load(_write(tmp_path, ",".join(HEADER) + "\n" + row + "\n"))
    t = cat.get("x.large")
    assert t is not None and t.spot_usd_hr is None and t.ondemand_per_gpu_hr == 2.5


@pytest.mark.parametrize(
    "body",
    [
        "",
        "a,b,c\n",
        ",".join(HEADER) + "\n",
        ",".join(HEADER) + "\nx.large,A100,two,40,8,64,5.0,,s,t\n",
        ",".join(HEADER) + "\nx.large,A100,0,40,8,64,5.0,,s,t\n",
        ",".join(HEADER) + "\nx.large,A100,1,40,8,64,-1,,s,t\n",
        ",".join(HEADER) + "\nx.large,A100,1,40,8,64\n",
        ",".join(HEADER) + "\nx,A100,1,40,8,64,1,,s,t\nx,A100,1,40,8,64,1,,s,t\n",
    ],
)
def test_malformed_file_is_value_error(tmp_path: Path, body: str) -> None:
    with pytest.raises(ValueError, match="prices file"):
        Catalog.load(_write(tmp_path, body))


def test_missing_file_is_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        Catalog.load(tmp_path / "absent.csv")
