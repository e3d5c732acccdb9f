"""`/gpu recommend`: which GPU model makes a run cheapest, all told.

Pure: a catalog and a request in, ranked choices and a view out. The cheapest GPU per
hour is often not the cheapest run: a GPU three times as fast at twice the price
finishes the same work for two thirds of the money. So every model that fits the memory
is priced for the *whole run*: the run's hours on the reference GPU, scaled by relative
throughput, times the per-GPU price, times the GPUs.

The estimate is peak-throughput arithmetic, not a benchmark: real speed-ups also depend
on memory bandwidth, interconnect and the model. The view says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bot.domain.commands import Recommend
from bot.domain.errors import UserError
from bot.domain.views import Context, Header, Table, Text, View, as_of_phrase
from provisioning.catalog import Catalog, InstanceType

REFERENCE_MODEL = "A100"

# Dense (no sparsity) bf16 tensor TFLOPS per GPU, from NVIDIA's data sheets for the part
# AWS installs. The one table the estimate rests on; a model missing here is not ranked.
#   H100: H100 SXM5 (p5), 989 bf16 dense (1,979 is the sparse figure).
#   A100, A100-80GB: A100 SXM4 (p4d, p4de), 312.
#   L40S: L40S data sheet, 362 (733 sparse).
#   A10G: AWS's variant of the A10 (g5); NVIDIA publishes no A10G sheet, so the A10's
#         125 (250 sparse) is used; it is likely an upper bound.
#   L4: L4 data sheet, 121 (242 sparse).
#   V100: no bf16 at all; its fp16 tensor figure, 125 (V100 SXM2, p3): runs use fp16.
#   T4: no bf16 at all; its fp16 tensor figure, 65 (g4dn): runs use fp16.
THROUGHPUT_TFLOPS: dict[str, float] = {
    "H100": 989.0,
    "A100": 312.0,
    "A100-80GB": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "L4": 121.0,
    "V100": 125.0,
    "T4": 65.0,
}
FP16_ONLY = frozenset({"V100", "T4"})
THROUGHPUT_SOURCE = (
    "dense bf16 tensor TFLOPS from NVIDIA data sheets (V100, T4: fp16, they have no bf16; "
    "A10G: the A10's figure)"
)
SHOWN = 5


@dataclass(frozen=True)
class Choice:
    """One GPU model priced for the whole run."""

    model: str
    instance: InstanceType  # the type the run would use
    instances: int  # how many of that type the run's GPUs need
    gpus: int
    usd_per_gpu_hr: float
    spot: bool  # priced at spot (False also when spot was asked but the type has none)
    est_hours: float
    est_cost: float
    fits: bool
    mem_total_gb: float  # GPU memory across the run's GPUs


def _pick_type(types: list[InstanceType], gpus: int, spot: bool) -> tuple[InstanceType, int]:
    """The run stays on one instance when a type has enough GPUs (memory split across
    GPUs wants NVLink, not the network); among those, the cheapest per GPU."""

    def per_gpu(t: InstanceType) -> float:
        return t.gpu_hourly("spot" if spot else "ondemand")

    big = [t for t in types if t.gpus >= gpus]
    if big:
        return min(big, key=lambda t: (per_gpu(t), t.gpus, t.instance_type)), 1
    largest = max(types, key=lambda t: (t.gpus, -per_gpu(t)))
    return largest, math.ceil(gpus / largest.gpus)


def rank(catalog: Catalog, cmd: Recommend) -> list[Choice]:
    """Every model with a known throughput, fitting ones first, cheapest run first."""
    gpus = cmd.gpus or 1
    ref = THROUGHPUT_TFLOPS[REFERENCE_MODEL]
    choices: list[Choice] = []
    for model in catalog.models():
        if model not in THROUGHPUT_TFLOPS:
            continue
        itype, count = _pick_type(catalog.for_model(model), gpus, cmd.spot)
        use_spot = cmd.spot and itype.spot_usd_hr is not None
        per_gpu = itype.gpu_hourly("spot" if use_spot else "ondemand")
        hours = cmd.hours * ref / THROUGHPUT_TFLOPS[model]
        mem_total = itype.gpu_mem_gb * gpus
        choices.append(
            Choice(
                model=model,
                instance=itype,
                instances=count,
                gpus=gpus,
                usd_per_gpu_hr=per_gpu,
                spot=use_spot,
                est_hours=hours,
                est_cost=per_gpu * gpus * hours,
                fits=mem_total >= cmd.mem_gb,
                mem_total_gb=mem_total,
            )
        )
    choices.sort(key=lambda c: (not c.fits, c.est_cost, c.est_hours, c.model))
    return choices


def _need(cmd: Recommend) -> str:
    gpus = cmd.gpus or 1
    spread = f" across {gpus} GPUs" if gpus > 1 else " on one GPU"
    return f"{cmd.mem_gb:g} GiB{spread}"


def recommend_view(catalog: Catalog, cmd: Recommend) -> View:
    """The winner, a short table of the alternatives, and why the winner won."""
    choices = rank(catalog, cmd)
    fitting = [c for c in choices if c.fits]
    if not fitting:
        biggest = max((c.instance.gpu_mem_gb for c in choices), default=0.0)
        owners = sorted({c.model for c in choices if c.instance.gpu_mem_gb == biggest})
        gpus = cmd.gpus or 1
        hint = (
            f" Try `--gpus {math.ceil(cmd.mem_gb / biggest)}` to split it."
            if biggest > 0 and math.ceil(cmd.mem_gb / biggest) <= 64
            else ""
        )
        raise UserError(
            f"No GPU in the catalog fits {_need(cmd)}: the largest has {biggest:g} GiB per GPU "
            f"({', '.join(owners)}), {biggest * gpus:g} GiB on {gpus} GPU(s).{hint}"
        )
    win = fitting[0]
    unknown = [m for m in catalog.models() if m not in THROUGHPUT_TFLOPS]
    # The fitting runners-up, plus the cheaper runs that were ruled out by memory: they
    # are the question a reader asks ("why not the T4?").
    shown = (
        fitting[: SHOWN - 1] + [c for c in choices if not c.fits and c.est_cost < win.est_cost][:2]
    )
    shown.sort(key=lambda c: (c.est_cost, c.model))
    rows = tuple(_row(c) for c in shown)
    market = "spot" if cmd.spot else "on-demand"
    gpus = cmd.gpus or 1
    summary = (
        f"Cheapest for {_need(cmd)} and {cmd.hours:g} h on {gpus}× {REFERENCE_MODEL}: "
        f"{win.model} on {_where(win)}, about {win.est_hours:.1f} h and ${win.est_cost:,.2f} "
        f"({market})."
    )
    blocks = (
        Header(f"Recommendation: {win.model}"),
        Text(summary),
        Table(("model", "instance type", "$/GPU-h", "est. hours", "est. cost", "fits?"), rows),
        Text("*Why:* " + _why(win, fitting, choices, cmd)),
        Context(
            f"Hours scale with {THROUGHPUT_SOURCE}, against {REFERENCE_MODEL} = "
            f"{THROUGHPUT_TFLOPS[REFERENCE_MODEL]:g}; peak figures, not a benchmark. "
            f"Cost = $/GPU-h × GPUs × est. hours. Prices: {catalog.source}, as of {as_of_phrase(catalog.as_of)}."
            + (" Spot capacity can be reclaimed mid-run: checkpoint." if cmd.spot else "")
            + (f" Not ranked (no throughput figure): {', '.join(unknown)}." if unknown else "")
        ),
    )
    return View(text=summary, blocks=blocks)


def _where(c: Choice) -> str:
    return (
        f"{c.instances}× {c.instance.instance_type}"
        if c.instances > 1
        else c.instance.instance_type
    )


def _row(c: Choice) -> tuple[str, ...]:
    price = f"${c.usd_per_gpu_hr:.3f}"
    fits = "yes" if c.fits else f"no ({c.mem_total_gb:g} GiB)"
    model = c.model + (" (fp16)" if c.model in FP16_ONLY else "")
    return (model, _where(c), price, f"{c.est_hours:.1f}", f"${c.est_cost:,.2f}", fits)


def _why(win: Choice, fitting: list[Choice], choices: list[Choice], cmd: Recommend) -> str:
    gpus = cmd.gpus or 1
    mem = (
        f"{win.instance.gpu_mem_gb:g} GiB per GPU"
        if gpus == 1
        else f"{gpus}×{win.instance.gpu_mem_gb:g} = {win.mem_total_gb:g} GiB"
    )
    parts = [f"{win.model} fits ({mem} ≥ {cmd.mem_gb:g} GiB)"]
    if len(fitting) > 1:
        nxt = fitting[1]
        parts.append(
            f"its run costs ${win.est_cost:,.2f} against ${nxt.est_cost:,.2f} on {nxt.model}, "
            "the next cheapest that fits"
        )
    else:
        parts.append("it is the only model that fits")
    cheaper_hourly = [c for c in fitting[1:] if c.usd_per_gpu_hr < win.usd_per_gpu_hr]
    if cheaper_hourly:
        slow = min(cheaper_hourly, key=lambda c: c.usd_per_gpu_hr)
        parts.append(
            f"{slow.model} is cheaper per GPU-hour (${slow.usd_per_gpu_hr:.3f} vs "
            f"${win.usd_per_gpu_hr:.3f}) but about {slow.est_hours / win.est_hours:.1f}× "
            "slower, so it costs more in total"
        )
    ruled_out = [c for c in choices if not c.fits and c.est_cost < win.est_cost]
    if ruled_out:
        names = ", ".join(f"{c.model} ({c.instance.gpu_mem_gb:g} GiB)" for c in ruled_out[:3])
        parts.append(f"cheaper but too small: {names}")
    if cmd.spot and not win.spot:
        parts.append(f"{win.instance.instance_type} has no spot price, so on-demand is shown")
    return "; ".join(parts) + "."
