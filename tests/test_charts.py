"""The utilization chart: a real PNG of the promised size, read back by its IHDR header
and by matplotlib; not blank; the same input gives the same bytes."""

from __future__ import annotations

import io
import math
import struct
from datetime import UTC, datetime, timedelta

import matplotlib.image
import numpy as np
import pytest

from bot.charts import HEIGHT_PX, WIDTH_PX, GpuSeries, utilization_chart

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
