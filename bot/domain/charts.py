"""PNG charts for Slack and the shell, drawn with matplotlib's Agg backend.

Only the object API (`Figure` + `FigureCanvasAgg`) is used, never `pyplot`: pyplot
keeps global state that is not thread-safe, and the worker, the command threads of
`gpubot serve` and the shell all draw charts at once. The size is fixed in pixels and
the PNG carries no software/date metadata, so one input always gives one file.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from types import ModuleType
from typing import TYPE_CHECKING

from bot.domain import timefmt

if TYPE_CHECKING:
    from matplotlib.figure import Figure

WIDTH_PX = 1000
HEIGHT_PX = 600
_DPI = 100


def _figure(width_px: int, height_px: int) -> Figure:
    """A figure on the Agg canvas. matplotlib is imported here, on the first chart, not
    with this module: it is some 60 MB of a process's memory, and most processes that
    import the views (a `serve` replica answering commands, the history bench) never
    draw one."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server; set before anything draws
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_px / _DPI, height_px / _DPI), dpi=_DPI)
    FigureCanvasAgg(fig)
    return fig


def _dates() -> ModuleType:
    import matplotlib.dates

    return matplotlib.dates


@dataclass(frozen=True)
class GpuSeries:
    """One GPU's history: a label for the legend and its samples in time order."""

    label: str  # e.g. "gpu-a:3 A100"
    times: Sequence[datetime]  # aware UTC
    util_pct: Sequence[float]
    mem_pct: Sequence[float]  # memory used, % of the GPU's total
    # Longest spacing that still counts as one stretch; wider gaps break the line, so a
    # host that was not sampled for an hour is not drawn as a straight ramp.
    max_gap: timedelta = timedelta(minutes=3)


def _with_gaps(series: GpuSeries) -> tuple[list[datetime], list[float], list[float]]:
    times: list[datetime] = []
    util: list[float] = []
    mem: list[float] = []
    prev: datetime | None = None
    for t, u, m in zip(series.times, series.util_pct, series.mem_pct, strict=True):
        if prev is not None and t - prev > series.max_gap:
            times.append(prev + (t - prev) / 2)
            util.append(math.nan)
            mem.append(math.nan)
        times.append(t)
        util.append(u)
        mem.append(m)
        prev = t
    return times, util, mem


def utilization_chart(
    series: Sequence[GpuSeries],
    *,
    start: datetime,
    end: datetime,
    title: str = "GPU utilization",
    tz: str = "UTC",
) -> bytes:
    """Two panels over one time axis, [start, end]: utilization % above, memory used %
    below, one line per GPU with its legend. Returns the PNG bytes (WIDTH_PX × HEIGHT_PX)."""
    if end <= start:
        raise ValueError("the chart's window must end after it starts")
    fig = _figure(WIDTH_PX, HEIGHT_PX)
    ax_util, ax_mem = fig.subplots(2, 1, sharex=True)
    hours = (end - start).total_seconds() / 3600
    # The team's zone (bot.domain.timefmt), in the title and on the time axis alike.
    zone = timefmt.zone(tz)
    window = f"{timefmt.date_time(start, tz)} – {timefmt.clock(end, tz)}" + (
        f" ({hours:g} h)" if hours < 48 else f" ({hours / 24:.1f} days)"
    )
    fig.suptitle(f"{title}, {window}", fontsize=12)
    for s in series:
        times, util, mem = _with_gaps(s)
        # Single points would be invisible as lines; markers make them show.
        marker = "o" if len(times) < 3 else None
        ax_util.plot(times, util, label=s.label, linewidth=1.4, marker=marker, markersize=3)
        ax_mem.plot(times, mem, label=s.label, linewidth=1.4, marker=marker, markersize=3)
    for ax, what in ((ax_util, "utilization %"), (ax_mem, "memory used %")):
        ax.set_ylim(-2, 102)
        ax.set_ylabel(what)
        ax.grid(True, alpha=0.3)
        ax.set_xlim(start, end)  # matplotlib takes datetimes
    ax_mem.set_xlabel(f"time ({tz})")
    locator = _dates().AutoDateLocator(minticks=4, maxticks=10, tz=zone)
    ax_mem.xaxis.set_major_locator(locator)
    ax_mem.xaxis.set_major_formatter(_dates().ConciseDateFormatter(locator, tz=zone))
    if series:
        ncol = 1 if len(series) <= 8 else 2
        for ax in (ax_util, ax_mem):
            ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, ncol=ncol)
    else:
        ax_util.text(
            0.5, 0.5, "no samples in this window", ha="center", transform=ax_util.transAxes
        )
    fig.subplots_adjust(left=0.07, right=0.78 if len(series) <= 8 else 0.66, top=0.9, bottom=0.1)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, metadata={"Software": None})
    return buf.getvalue()


# --- the weekly digest's cost chart -------------------------------------------------------

COST_WIDTH_PX = 960
COST_HEIGHT_PX = 480
_LABEL_CHARS = 14  # longer names are cut with "…": the labels are rotated under narrow bars


@dataclass(frozen=True)
class CostBar:
    """One person's week: what their GPU time cost, and the part of it their reserved
    GPUs sat idle (drawn on top, lighter; never more than `usd`)."""

    name: str
    usd: Decimal
    idle_waste_usd: Decimal


def _label(name: str) -> str:
    return name if len(name) <= _LABEL_CHARS else name[: _LABEL_CHARS - 1] + "…"


def cost_chart(people: Sequence[CostBar], idle_overhead_usd: Decimal, title: str) -> bytes:
    """A PNG of dollars per person (the part lost to idle reserved GPUs stacked on top
    in a lighter shade) and the team's idle overhead as its own bar, last; fixed size
    (COST_WIDTH_PX × COST_HEIGHT_PX)."""
    fig = _figure(COST_WIDTH_PX, COST_HEIGHT_PX)
    ax = fig.add_subplot()
    names = [p.name for p in people] + ["idle overhead"]
    waste = [float(min(p.idle_waste_usd, p.usd)) for p in people] + [0.0]
    used = [float(p.usd) - w for p, w in zip(people, waste, strict=False)] + [0.0]
    idle = [0.0] * len(people) + [float(idle_overhead_usd)]
    xs = list(range(len(names)))
    ax.bar(xs, used, color="#2b6cb0", label="GPU time used")
    ax.bar(xs, waste, bottom=used, color="#90cdf4", label="reserved but idle")
    ax.bar(xs, idle, color="#a0aec0", label="idle overhead (nobody held)")
    ax.set_xticks(xs, [_label(n) for n in names], rotation=30, ha="right")
    ax.set_ylabel("USD")
    ax.set_title(title)
    for x, top in zip(
        xs, (u + w + i for u, w, i in zip(used, waste, idle, strict=True)), strict=True
    ):
        ax.annotate(f"${top:,.0f}", (x, top), ha="center", va="bottom", fontsize="small")
    ax.legend(loc="upper left", fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    # No bbox="tight": it would change the pixel size with the labels.
    fig.savefig(buf, format="png", dpi=_DPI, metadata={"Software": None})
    return buf.getvalue()


# --- a run's curve --------------------------------------------------------------------------

RUN_WIDTH_PX = 800
RUN_HEIGHT_PX = 400


def run_curve_chart(history: Sequence[dict[str, float]], title: str) -> bytes | None:
    """Loss against steps (log scale when it spans more than 100x, as a diverging run's
    does), and any accuracy the run reported on a second axis (0–100%). None when the run
    reported fewer than two points: a single dot says nothing a sentence cannot."""
    steps = [p["step"] for p in history if "loss" in p]
    losses = [p["loss"] for p in history if "loss" in p]
    acc_key = next((k for p in history for k in sorted(p) if "acc" in k and k != "step"), None)
    acc = [(p["step"], p[acc_key]) for p in history if acc_key and acc_key in p]
    if len(steps) < 2 and len(acc) < 2:
        return None
    fig = _figure(RUN_WIDTH_PX, RUN_HEIGHT_PX)
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("step")
    if len(steps) >= 2:
        ax.plot(steps, losses, color="#c53030", linewidth=1.5, label="loss")
        positive = [v for v in losses if v > 0]
        if positive and len(positive) == len(losses) and max(positive) > 100 * min(positive):
            ax.set_yscale("log")
        ax.set_ylabel("loss")
        ax.grid(True, alpha=0.3)
    if acc and acc_key is not None:
        ax2 = ax.twinx()
        ax2.plot(
            [a for a, _ in acc],
            [100 * v for _, v in acc],
            color="#2b6cb0",
            linewidth=1.5,
            marker="o" if len(acc) < 3 else None,  # a final accuracy alone is one dot
            label=acc_key,
        )
        last_step, last_acc = acc[-1]
        ax2.annotate(
            f"{acc_key} {last_acc:.1%}",
            (last_step, 100 * last_acc),
            textcoords="offset points",
            xytext=(-8, 6),
            ha="right",
            color="#2b6cb0",
            fontsize="small",
        )
        ax2.set_ylim(-2, 102)
        ax2.set_ylabel(f"{acc_key} %")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, metadata={"Software": None})
    return buf.getvalue()
