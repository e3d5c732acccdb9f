"""`/gpu recommend`: the grammar, the arithmetic (checked by hand), and the reply.

The catalogs here are small and made up so that every expected number can be worked
out on paper from the throughput table (A100 312, H100 989, L4 121, T4 65 TFLOPS).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

from bot.app.money.recommend import THROUGHPUT_TFLOPS, rank, recommend_view
from bot.domain.commands import VERBS, Recommend, parse
from bot.domain.errors import UserError
from bot.faces.dispatch import handle_text
from bot.faces.terminal import render
from provisioning.catalog import HEADER, Catalog, InstanceType
from tests.core.helpers import actor, host, make_service

USAGE = "Usage: " + VERBS["recommend"].usage


def it(
    name: str, model: str, gpus: int, mem: float, usd: float, spot: float | None = None
) -> InstanceType:
    return InstanceType(name, model, gpus, mem, 8 * gpus, 60.0 * gpus, usd, spot, "test", "now")


A100 = it("a100.8x", "A100", 8, 40.0, 24.0, 8.0)  # $3.00/GPU-h, spot $1.00
A100_80 = it("a100-80.8x", "A100-80GB", 8, 80.0, 32.0)  # $4.00/GPU-h, no spot market
H100 = it("h100.8x", "H100", 8, 80.0, 64.0, 24.0)  # $8.00/GPU-h, spot $3.00
T4 = it("t4.1x", "T4", 1, 16.0, 0.60, 0.20)  # $0.60/GPU-h
L4 = it("l4.1x", "L4", 1, 24.0, 0.80, 0.40)  # $0.80/GPU-h


def cat(*types: InstanceType) -> Catalog:
    return Catalog(types)


def rec(text: str) -> Recommend:
    cmd = parse(text)
    assert isinstance(cmd, Recommend)
    return cmd


# --- grammar ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("recommend --mem 40 --hours 10", Recommend(40.0, 10.0)),
        ("/gpu recommend --hours 10 --mem 40", Recommend(40.0, 10.0)),
        ("recommend --mem=40GB --hours=90m --gpus 2 --spot", Recommend(40.0, 1.5, 2, True)),
        ("recommend --mem 12.5g --hours 2h --GPUS=4", Recommend(12.5, 2.0, 4)),
        ("recommend --spot --mem 80 --hours 1h30m", Recommend(80.0, 1.5, None, True)),
    ],
)
def test_forms_people_type(text: str, expected: Recommend) -> None:
    assert parse(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("recommend", "Say how much GPU memory the run needs"),
        ("recommend --hours 3", "Say how much GPU memory the run needs"),
        ("recommend --mem 40", "Say how long the run takes on A100s"),
        ("recommend --mem lots --hours 3", "--mem must be a number of GiB above 0"),
        ("recommend --mem 0 --hours 3", "--mem must be a number of GiB above 0"),
        ("recommend --mem 40 --hours 0", "--hours must be a time above 0"),
        ("recommend --mem 40 --hours soon", "--hours must be a time above 0"),
        ("recommend --mem 40 --hours 3 --gpus 0", "--gpus must be between 1 and 64"),
        ("recommend --mem 40 --hours 3 --gpus 65", "--gpus must be between 1 and 64"),
        ("recommend --mem 40 --hours 3 --gpus two", "--gpus must be a whole number"),
        ("recommend --mem 40 --mem 50 --hours 3", "`--mem` is given twice"),
        ("recommend --mem 40 --hours 3 --spot=yes", "`--spot` takes no value"),
        ("recommend --mem 40 --hours", "`--hours` needs a value"),
        ("recommend --mem 40 --hours 3 a100", "`a100` is not an option here"),
        ("recommend --mem nan --hours inf", "--mem must be a number of GiB above 0"),
    ],
)
def test_bad_input_says_what_is_wrong_with_the_usage(text: str, reason: str) -> None:
    with pytest.raises(UserError) as err:
        parse(text)
    assert err.value.text.startswith(reason)
    assert err.value.text.endswith(USAGE)


def test_help_explains_the_verb_and_its_reference() -> None:
    spec = VERBS["recommend"]
    assert "A100" in spec.details and spec.examples
    for example in spec.examples:
        assert isinstance(parse(example), Recommend)


# --- the arithmetic ----------------------------------------------------------------------


def test_memory_that_only_an_80gb_gpu_fits() -> None:
    a100 = it("a100.8x", "A100", 8, 40.0, 16.0)  # $2.00/GPU-h: the cheapest run, too small
    catalog = cat(a100, A100_80, H100, T4)
    choices = rank(catalog, rec("recommend --mem 60 --hours 10"))
    fitting = [c.model for c in choices if c.fits]
    assert fitting == ["H100", "A100-80GB"]
    h100, a80 = choices[0], choices[1]
    # H100: 10 h × 312/989 = 3.1547 h on one GPU at $8.00 → $25.24.
    assert h100.est_hours == pytest.approx(10 * 312 / 989)
    assert h100.est_cost == pytest.approx(8.0 * 10 * 312 / 989)
    # A100-80GB: as fast as the reference, 10 h at $4.00 → $40.00.
    assert a80.est_hours == pytest.approx(10.0) and a80.est_cost == pytest.approx(40.0)
    text = render(recommend_view(catalog, rec("recommend --mem 60 --hours 10")))
    assert text.startswith("Recommendation: H100")
    assert "H100 fits (80 GiB per GPU ≥ 60 GiB)" in text
    assert "$25.24 against $40.00 on A100-80GB" in text
    # The A100 run ($20.00) is cheaper but 40 GiB cannot hold 60 GiB; the T4's ($28.80)
    # is dearer anyway and is left out of the table.
    assert "cheaper but too small: A100 (40 GiB)." in text
    assert "$20.00" in text and "no (40 GiB)" in text and "T4 (fp16)" not in text


def test_a_fast_dear_gpu_beats_a_cheap_slow_one_overall() -> None:
    catalog = cat(T4, H100)
    cmd = rec("recommend --mem 12 --hours 10")
    t4 = next(c for c in rank(catalog, cmd) if c.model == "T4")
    # T4 (fp16 65): 10 × 312/65 = 48 h at $0.60 → $28.80; H100: $25.24 (above).
    assert t4.est_hours == pytest.approx(48.0) and t4.est_cost == pytest.approx(28.80)
    assert rank(catalog, cmd)[0].model == "H100"
    text = render(recommend_view(catalog, cmd))
    assert "T4 is cheaper per GPU-hour ($0.600 vs $8.000) but about 15.2× slower" in text
    assert "T4 (fp16)" in text  # the table says it is not a bf16 figure
    assert "48.0" in text and "$28.80" in text and "$25.24" in text
    assert text.index("H100 ") < text.index("T4 (fp16)")  # cheapest run first


def test_gpus_split_the_memory() -> None:
    catalog = cat(A100, A100_80)
    with pytest.raises(UserError) as err:  # 120 GiB on one GPU: nothing holds it
        recommend_view(catalog, rec("recommend --mem 120 --hours 5"))
    assert err.value.text == (
        "No GPU in the catalog fits 120 GiB on one GPU: the largest has 80 GiB per GPU "
        "(A100-80GB), 80 GiB on 1 GPU(s). Try `--gpus 2` to split it."
    )
    # Two GPUs: A100 has 2×40 = 80 GiB (no); A100-80GB 160 GiB: 2 × $4 × 5 h = $40.
    two = rank(catalog, rec("recommend --mem 120 --hours 5 --gpus 2"))
    assert [(c.model, c.fits, round(c.est_cost, 2)) for c in two] == [
        ("A100-80GB", True, 40.0),
        ("A100", False, 30.0),
    ]
    text = render(recommend_view(catalog, rec("recommend --mem 120 --hours 5 --gpus 2")))
    assert "A100-80GB fits (2×80 = 160 GiB ≥ 120 GiB)" in text and "no (80 GiB)" in text
    # Three GPUs: A100 now holds 120 GiB and its run is cheaper: 3 × $3 × 5 h = $45 vs $60.
    three = rank(catalog, rec("recommend --mem 120 --hours 5 --gpus 3"))
    assert [(c.model, c.fits, round(c.est_cost, 2)) for c in three] == [
        ("A100", True, 45.0),
        ("A100-80GB", True, 60.0),
    ]


def test_gpus_beyond_one_instance_span_several() -> None:
    choice = rank(cat(L4), rec("recommend --mem 40 --hours 1 --gpus 2"))[0]
    # 2 GPUs on 1-GPU instances: two of them; 1 × 312/121 h each at $0.80 × 2 GPUs.
    assert (choice.instance.instance_type, choice.instances) == ("l4.1x", 2)
    assert choice.fits and choice.est_cost == pytest.approx(0.80 * 2 * 312 / 121)
    assert "2× l4.1x" in render(
        recommend_view(cat(L4), rec("recommend --mem 40 --hours 1 --gpus 2"))
    )


def test_spot_prices_where_there_is_a_spot_market() -> None:
    catalog = cat(A100, A100_80, H100)
    choices = {c.model: c for c in rank(catalog, rec("recommend --mem 30 --hours 10 --spot"))}
    assert choices["A100"].spot and choices["A100"].usd_per_gpu_hr == pytest.approx(1.0)
    assert choices["H100"].usd_per_gpu_hr == pytest.approx(3.0)
    # No spot market: its on-demand price stands, marked as such.
    assert not choices["A100-80GB"].spot and choices["A100-80GB"].usd_per_gpu_hr == 4.0
    # A100 spot: 10 h × $1 = $10; H100 spot: 3.1547 h × $3 = $9.46, the winner.
    assert rank(catalog, rec("recommend --mem 30 --hours 10 --spot"))[0].model == "H100"


def test_no_model_fits_even_split() -> None:
    with pytest.raises(UserError) as err:
        recommend_view(cat(T4, L4), rec("recommend --mem 5000 --hours 1"))
    assert err.value.text.startswith("No GPU in the catalog fits 5000 GiB on one GPU")
    assert "`--gpus" not in err.value.text  # 209 GPUs: beyond what one request may ask


def test_every_shipped_model_has_a_throughput() -> None:
    assert set(Catalog.load().models()) <= set(THROUGHPUT_TFLOPS)
    # A model from some other catalog is named as unranked, not silently dropped.
    odd = it("mi.8x", "MI300X", 8, 192.0, 1.0)
    text = render(recommend_view(cat(A100, odd), rec("recommend --mem 10 --hours 1")))
    assert text.startswith("Recommendation: A100")
    assert "Not ranked (no throughput figure): MI300X." in text


# --- through the dispatcher ---------------------------------------------------------------


def _write_catalog(path: Path, *types: InstanceType) -> None:
    lines = [",".join(HEADER)]
    for t in types:
        spot = "" if t.spot_usd_hr is None else str(t.spot_usd_hr)
        lines.append(
            f"{t.instance_type},{t.gpu_model},{t.gpus},{t.gpu_mem_gb},{t.vcpus},{t.mem_gb},"
            f"{t.ondemand_usd_hr},{spot},{t.source},{t.as_of}"
        )
    path.write_text("\n".join(lines) + "\n")


def test_through_handle_text(sqlite_engine: Engine, tmp_path: Path) -> None:
    _write_catalog(tmp_path / "prices.csv", T4, H100, A100)
    svc, _ = make_service(sqlite_engine, [host("one", "A100", 1)], home=tmp_path)
    reply = handle_text(svc, actor(svc, "alice"), "/gpu recommend --mem 12 --hours 10")
    assert not reply.error and reply.ephemeral
    text = render(reply.view)
    assert text.startswith("Recommendation: H100")
    assert "Cheapest for 12 GiB on one GPU and 10 h on 1× A100: H100 on h100.8x" in text
    assert "about 3.2 h and $25.24 (on-demand)" in text
    assert "Prices: test, as of now." in text

    bad = handle_text(svc, actor(svc, "alice"), "/gpu recommend --mem 40")
    assert bad.error and bad.view.text.endswith(USAGE)
    none = handle_text(svc, actor(svc, "alice"), "/gpu recommend --mem 100 --hours 1")
    assert none.error and none.view.text.startswith("No GPU in the catalog fits 100 GiB")

    # The shipped catalog (no refreshed file) answers too.
    plain, _ = make_service(sqlite_engine, [host("one", "A100", 1)], home=tmp_path / "empty")
    reply = handle_text(plain, actor(plain, "bob"), "/gpu recommend --mem 70 --hours 10")
    assert not reply.error and "p5.48xlarge" in render(reply.view)


def test_a_broken_refreshed_file_is_a_plain_error(sqlite_engine: Engine, tmp_path: Path) -> None:
    (tmp_path / "prices.csv").write_text("not,a,catalog\n")
    svc, _ = make_service(sqlite_engine, [host("one", "A100", 1)], home=tmp_path)
    reply = handle_text(svc, actor(svc, "alice"), "/gpu recommend --mem 10 --hours 1")
    assert reply.error and reply.view.text.startswith("The refreshed price file is unreadable")
    assert "ref " not in reply.view.text
