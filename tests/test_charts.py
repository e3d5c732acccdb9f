"""The charts: real PNGs of the promised size, read back by their IHDR header and by
matplotlib; not blank; the same input gives the same bytes. The digest's cost chart
draws the pixels it drew when `bot.app.money.digest` held its own drawing code."""

from __future__ import annotations

import hashlib
import io
import math
import struct
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import matplotlib
import matplotlib.image
import numpy as np
import pytest

from bot.domain.charts import (
    COST_HEIGHT_PX,
    COST_WIDTH_PX,
    HEIGHT_PX,
    RUN_HEIGHT_PX,
    RUN_WIDTH_PX,
    WIDTH_PX,
    CostBar,
    GpuSeries,
    cost_chart,
    run_curve_chart,
    utilization_chart,
)

END = datetime(2026, 1, 5, 15, 0, tzinfo=UTC)
START = END - timedelta(hours=6)


def series(n_gpus: int = 3, minutes: int = 360) -> list[GpuSeries]:
    times = [START + timedelta(minutes=m) for m in range(minutes)]
    return [
        GpuSeries(
            label=f"gpu-a:{g} A100",
            times=times,
            util_pct=[50 + 45 * math.sin(m / 20 + g) for m in range(minutes)],
            mem_pct=[10.0 * (g + 1) for _ in range(minutes)],
        )
        for g in range(n_gpus)
    ]


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(matplotlib.image.imread(io.BytesIO(data), format="png"))


def test_the_chart_is_a_png_of_the_promised_size() -> None:
    data = utilization_chart(series(), start=START, end=END)
    assert png_size(data) == (WIDTH_PX, HEIGHT_PX) == (1000, 600)
    img = pixels(data)
    assert img.shape[:2] == (600, 1000)


def test_the_chart_is_not_blank_and_shows_the_data() -> None:
    drawn = pixels(utilization_chart(series(), start=START, end=END))
    empty = pixels(utilization_chart([], start=START, end=END))
    assert float(drawn[..., :3].std()) > 0.05

    # Three coloured curves add many non-grey pixels over the empty frame.
    def coloured(img: np.ndarray) -> int:
        rgb = img[..., :3]
        return int(((rgb.max(axis=2) - rgb.min(axis=2)) > 0.2).sum())

    assert coloured(drawn) > coloured(empty) + 2000


def test_the_same_input_gives_the_same_bytes() -> None:
    a = utilization_chart(series(8), start=START, end=END, title="GPU utilization (gpu-a)")
    b = utilization_chart(series(8), start=START, end=END, title="GPU utilization (gpu-a)")
    assert a == b
    assert png_size(utilization_chart(series(12), start=START, end=END)) == (1000, 600)


def test_a_gap_breaks_the_line_and_odd_inputs_still_draw() -> None:
    times = [START + timedelta(minutes=m) for m in (0, 1, 2, 200, 201)]
    gap = GpuSeries("gpu-b:0 H100", times, [10, 20, 30, 40, 50], [1, 2, 3, 4, 5])
    lone = GpuSeries("gpu-b:1 H100", [END - timedelta(minutes=1)], [80], [90])
    assert png_size(utilization_chart([gap, lone], start=START, end=END)) == (1000, 600)
    with pytest.raises(ValueError, match="must end after it starts"):
        utilization_chart([gap], start=END, end=START)


PEOPLE = (
    CostBar("alice", Decimal("21.96"), Decimal("8.24")),
    CostBar("bob", Decimal("10.75"), Decimal("0")),
    # Longer than a label holds (cut to "Maximilian vo…"), and more waste than cost.
    CostBar("Maximilian von Longname", Decimal("3.50"), Decimal("9.99")),
)
COST_TITLE = "GPU cost by person, 2026-W02 ($86.78 in all)"
# sha256 of the decoded RGBA pixels that bot.app.money.digest.digest_chart drew for this input
# before the drawing moved here (commit 27ed1bf), on matplotlib 3.11.2. Text is drawn a
# little differently by other matplotlib releases, so the pin holds for that one only.
COST_PIXELS_BEFORE_THE_MOVE = "b1cb828c9cf1ebdb3ce9863443b7bcadd924e8ebc0d2a93fec6fa21d01c2fbd6"


def test_the_cost_chart_draws_the_pixels_the_digest_drew() -> None:
    if matplotlib.__version__ != "3.11.2":
        pytest.skip(f"pixels pinned on matplotlib 3.11.2, this is {matplotlib.__version__}")
    png = cost_chart(PEOPLE, Decimal("50.57"), COST_TITLE)
    drawn = pixels(png)
    assert drawn.shape[:2] == (COST_HEIGHT_PX, COST_WIDTH_PX) == (480, 960)
    rgba = (drawn * 255).round().astype(np.uint8)
    assert hashlib.sha256(rgba.tobytes()).hexdigest() == COST_PIXELS_BEFORE_THE_MOVE


def test_the_cost_chart_is_fixed_size_deterministic_and_carries_no_software_stamp() -> None:
    a = cost_chart(PEOPLE, Decimal("50.57"), COST_TITLE)
    assert a == cost_chart(PEOPLE, Decimal("50.57"), COST_TITLE)
    assert png_size(a) == (COST_WIDTH_PX, COST_HEIGHT_PX)
    assert b"Software" not in a and b"matplotlib" not in a
    # No people, no overhead: still a chart of the same size, and not the same picture.
    empty = cost_chart((), Decimal(0), "GPU cost by person, 2026-W03 ($0.00 in all)")
    assert png_size(empty) == (COST_WIDTH_PX, COST_HEIGHT_PX) and empty != a


def test_a_runs_curve_is_fixed_size_deterministic_and_needs_two_points() -> None:
    exploded = [
        {"step": 4.0, "loss": 1.4e19},
        {"step": 24.0, "loss": 2.8e9},
        {"step": 330.0, "loss": 7.7e4, "test_accuracy": 0.1},
    ]
    png = run_curve_chart(exploded, "Run #2: loss by step")
    assert png is not None and png_size(png) == (RUN_WIDTH_PX, RUN_HEIGHT_PX)
    assert run_curve_chart(exploded, "Run #2: loss by step") == png
    assert b"matplotlib" not in png
    assert run_curve_chart([{"step": 1.0, "loss": 2.3}], "one point") is None
