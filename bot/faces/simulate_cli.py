"""`gpubot simulate`: the command line of the simulator (bot.sim.simulate), here among the
faces because it reads settings and, with `--history`, the team's runs from the
database (bot.app.money.history_trace) — which the simulator itself must never import."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from bot.domain.durations import parse_threshold
from bot.domain.scheduling import BurstGate
from bot.sim.output import summary_table, write_instances, write_schedule
from bot.sim.simulate import (
    DEFAULT_STOP_S,
    SimInputError,
    TraceJob,
    parse_trace,
    run_simulation,
)
from provisioning.catalog import Catalog
from provisioning.costs import DEFAULT_COSTS


def _fail(msg: str) -> typer.Exit:
    typer.echo(f"gpubot simulate: error: {msg}", err=True)
    return typer.Exit(code=2)


def simulate(
    trace: Path | None = typer.Option(
        None, "--trace", help="job trace CSV: job_id,user,submit_time,duration_s,gpus,gpu_type"
    ),
    history: str | None = typer.Option(
        None,
        "--history",
        help="instead of --trace: the team's own runs of the last DURATION (e.g. 30d), "
        "from the bot's database, as they ran",
    ),
    policy: str = typer.Option("fair", "--policy", help="fair | per-job | fifo"),
    prices: Path | None = typer.Option(None, "--prices", help="prices CSV (default: shipped)"),
    gpu_type: str = typer.Option("A100", "--gpu-type", help="model for rows without gpu_type"),
    max_gpus: int = typer.Option(256, "--max-gpus", help="quota of GPUs running at once"),
    schedule_out: Path | None = typer.Option(None, "--schedule-out", help="write the schedule"),
    instances_out: Path | None = typer.Option(
        None, "--instances-out", help="write the instances and their bills"
    ),
    json_out: bool = typer.Option(False, "--json", help="print the figures as one JSON object"),
    boot_s: float = typer.Option(DEFAULT_COSTS.boot_s, "--boot-s", help="launch to SSH-ready, s"),
    setup_s: float = typer.Option(
        DEFAULT_COSTS.setup_s, "--setup-s", help="bootstrap of a fresh instance, s"
    ),
    start_s: float = typer.Option(
        DEFAULT_COSTS.start_s, "--start-s", help="restart of a stopped instance, s"
    ),
    ebs_gb: float = typer.Option(
        DEFAULT_COSTS.ebs_gb, "--ebs-gb", help="volume size billed while stopped"
    ),
    ebs_usd_gb_month: float = typer.Option(
        DEFAULT_COSTS.ebs_usd_gb_month, "--ebs-usd-gb-month", help="volume price, USD per GB-month"
    ),
    preempt: bool = typer.Option(
        True,
        "--preempt/--no-preempt",
        help="fair: checkpoint-and-move runs (fair-share preemption, defragmentation, "
        "consolidation); a moved job has a schedule row per segment",
    ),
    resume_s: float = typer.Option(
        300.0, "--resume-s", help="what each preemption costs the job: checkpoint + reload, s"
    ),
    estimates: str = typer.Option(
        "none", "--estimates", help="none: run times unknown to the scheduler | exact"
    ),
    checkpointable_fraction: float = typer.Option(
        0.0,
        "--checkpointable",
        help="fraction F of jobs that may be preempted: sha256(job_id)[:8] < F * 2**32",
    ),
    checkpoint_every_s: float = typer.Option(
        1800.0,
        "--checkpoint-every",
        help="a preempted job keeps whole multiples of this much work, s (0: on the signal)",
    ),
    stop_s: float = typer.Option(
        DEFAULT_STOP_S,
        "--stop-s",
        help="signal to free GPUs of a preemption (checkpoint, exit, poll), s",
    ),
    owned_gpus: int = typer.Option(
        0,
        "--owned-gpus",
        help="the team's own GPUs of --gpu-type, always up at $0; the cloud (--max-gpus "
        "more) is bought for a run only past --burst-after",
    ),
    burst_after: str | None = typer.Option(
        None,
        "--burst-after",
        help="with --owned-gpus: how long a run waits for owned GPUs before the cloud is "
        "bought for it: 90s, 15m, 1h, 0 (at once) or never (default 15m, the bot's)",
    ),
) -> None:
    """Replay a job trace through the scheduler on a simulated cloud and report its cost."""
    import json

    if (trace is None) == (history is None):
        raise _fail("give either --trace FILE or --history DURATION")
    source: Path | list[TraceJob]
    if history is not None:
        source = _history_jobs(history, prices, gpu_type)
    else:
        assert trace is not None
        source = trace
    burst = None
    if burst_after is not None:
        try:
            burst = BurstGate(parse_threshold(burst_after))
        except ValueError as exc:
            raise _fail(f"--burst-after {exc}") from None
    try:
        res = run_simulation(
            source,
            policy=policy,
            prices=prices,
            gpu_type=gpu_type,
            max_gpus=max_gpus,
            boot_s=boot_s,
            setup_s=setup_s,
            start_s=start_s,
            ebs_gb=ebs_gb,
            ebs_usd_gb_month=ebs_usd_gb_month,
            preempt=preempt,
            resume_s=resume_s,
            estimates=estimates,
            checkpointable_fraction=checkpointable_fraction,
            checkpoint_every_s=checkpoint_every_s,
            stop_s=stop_s,
            owned_gpus=owned_gpus,
            burst=burst,
        )
    except SimInputError as exc:
        raise _fail(str(exc)) from None
    try:
        if schedule_out is not None:
            write_schedule(schedule_out, res.schedule)
        if instances_out is not None:
            write_instances(instances_out, res.instances)
    except OSError as exc:
        raise _fail(f"cannot write output: {exc.strerror or exc}") from None
    if res.rejected:
        first = res.rejected[0]
        more = f" and {len(res.rejected) - 1} more" if len(res.rejected) > 1 else ""
        print(f"gpubot simulate: rejected {first[0]} ({first[1]}){more}", file=sys.stderr)
    if json_out:
        typer.echo(json.dumps(res.figures()))
    else:
        typer.echo(summary_table(res))


def _history_jobs(window: str, prices: Path | None, gpu_type: str) -> list[TraceJob]:
    """The team's runs of the last `window` from the configured database, as a trace."""
    from datetime import UTC, datetime

    from bot.app.config import ConfigError, load_settings
    from bot.app.money.history_trace import history_trace
    from bot.domain.durations import parse_duration
    from bot.faces.runtime import open_database

    span = parse_duration(window)
    if span is None:
        raise _fail(f"--history wants a duration like 30d, not {window!r}")
    try:
        settings = load_settings()
    except ConfigError as exc:
        raise _fail(exc.text) from None
    engine = open_database(settings)
    now = datetime.now(UTC)
    text, skipped = history_trace(engine, now - span, now)
    if skipped:
        print(
            f"gpubot simulate: {skipped} run(s) left out (no GPU model, or never ran)",
            file=sys.stderr,
        )
    try:
        catalog = Catalog.load(prices)
        model = catalog.normalize_model(gpu_type) or gpu_type
        return parse_trace(text.splitlines(), catalog, model, f"history {window}")
    except (SimInputError, ValueError) as exc:
        raise _fail(str(exc)) from None
