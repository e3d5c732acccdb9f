"""`gpubot simulate --owned-gpus N --burst-after S` (issue 37, part 3): the team's own GPUs
first, the cloud bought for a run only once it has waited S, by the same `BurstGate` the
worker is to apply; and what the threshold costs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bot.domain.durations import parse_threshold
from bot.domain.scheduling import BurstGate
from bot.faces.cli import app
from bot.sim.simulate import (
    OWNED_TYPE,
    SimInputError,
    SimResult,
    TraceJob,
    parse_trace,
    run_simulation,
)
from provisioning.catalog import Catalog

CATALOG = Catalog.load()
HEADER = "job_id,user,submit_time,duration_s,gpus,gpu_type"


def trace(rows: list[str]) -> list[TraceJob]:
    return parse_trace([HEADER, *rows], CATALOG, "A100")


# Eight owned A100s (one host), then a burst of work that needs more than them: three
# 8-GPU jobs at once, and small ones behind them.
BUSY = trace(
    [
        "a,u1,0,7200,8,A100",
        "b,u2,10,7200,8,A100",
        "c,u3,20,7200,8,A100",
        "d,u1,30,600,1,A100",
        "e,u2,4000,600,2,A100",
    ]
)


def simulate(after_s: float | None, owned: int = 8) -> SimResult:
    return run_simulation(BUSY, owned_gpus=owned, burst=BurstGate(after_s), max_gpus=64)


def on_cloud(res: SimResult) -> dict[str, list[float]]:
    """Each job's segments that ran on a bought instance: their start times."""
    out: dict[str, list[float]] = {}
    for row in res.schedule:
        if any(not i.startswith("owned-") for i in row.instance_ids):
            out.setdefault(row.job_id, []).append(row.start_s)
    return out


def test_never_buys_nothing_and_everything_waits_for_the_owned_gpus() -> None:
    res = simulate(None)
    assert res.total_cost_usd == 0 and res.instances == () and res.burst_jobs == 0
    assert res.jobs == len(BUSY) and not on_cloud(res)
    # One owned host of 8: the three 8-GPU jobs run one after another.
    starts = sorted(r.start_s for r in res.schedule if r.gpus == 8)
    assert starts[1] >= starts[0] + 7200 and starts[2] >= starts[1] + 7200


def test_no_run_is_bought_for_before_it_has_waited_the_threshold() -> None:
    after = 1800.0
    res = simulate(after)
    bought = on_cloud(res)
    assert bought, "two 8-GPU jobs cannot fit the one owned host: they must burst"
    submit = {j.job_id: j.submit_s for j in BUSY}
    ready = {r.instance_id: r.launch_s for r in res.instances}
    for job, starts in bought.items():
        assert min(starts) >= submit[job] + after
    # Every instance was launched for a run that had waited the threshold by then.
    assert all(t >= min(submit.values()) + after for t in ready.values())
    assert res.total_cost_usd > 0 and res.burst_jobs == len(bought)


def test_at_once_buys_without_waiting_and_costs_at_least_as_much_as_waiting() -> None:
    now, later, never = simulate(0.0), simulate(1800.0), simulate(None)
    assert on_cloud(now) and min(min(s) for s in on_cloud(now).values()) < 1800
    assert now.avg_queue_s < later.avg_queue_s < never.avg_queue_s
    assert now.total_cost_usd >= later.total_cost_usd >= never.total_cost_usd == 0


def test_owned_hosts_are_never_stopped_bought_or_billed() -> None:
    res = simulate(600.0, owned=12)  # a host of 8 and one of 4
    owned_rows = [r for r in res.schedule if any(i.startswith("owned-") for i in r.instance_ids)]
    assert owned_rows
    assert all(r.instance_type != OWNED_TYPE for r in res.instances)
    assert res.owned_gpus == 12 and res.burst_after_s == 600.0
    assert {"owned_gpus", "burst_after_s", "burst_jobs", "cloud_gpu_h"} <= set(res.figures())
    # Without owned GPUs the --json object is exactly the design's.
    assert "owned_gpus" not in run_simulation(BUSY, max_gpus=64).figures()


def test_what_cannot_fit_the_owned_gpus_is_rejected_when_the_cloud_is_never_offered() -> None:
    res = run_simulation(
        trace(["big,u1,0,600,16,A100", "small,u1,0,600,1,A100", "t4,u2,0,60,1,T4"]),
        owned_gpus=8,
        burst=BurstGate(None),
    )
    assert {j for j, _ in res.rejected} == {"big", "t4"}
    assert "the cloud is never offered" in dict(res.rejected)["big"]


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"burst": BurstGate(60.0)}, "--burst-after needs --owned-gpus"),
        ({"owned_gpus": 8, "policy": "fifo"}, "--policy fair"),
        ({"owned_gpus": -1}, "--owned-gpus must be 0 or more"),
        ({"owned_gpus": 8, "burst": BurstGate(float("nan"))}, "--burst-after must be"),
    ],
)
def test_bad_combinations_are_plain_errors(kwargs: dict[str, object], says: str) -> None:
    with pytest.raises(SimInputError, match=says):
        run_simulation(BUSY, **kwargs)  # type: ignore[arg-type]


def test_the_threshold_reads_as_the_bot_writes_durations() -> None:
    assert parse_threshold("never") is None and parse_threshold("0") == 0.0
    assert parse_threshold("90s") == 90.0 and parse_threshold("15m") == 900.0
    with pytest.raises(ValueError, match="like 90s"):
        parse_threshold("soon")
    gate = BurstGate(900.0)
    assert not gate.open_for(899.0) and gate.open_for(900.0) and gate.opens_at(100.0) == 1000.0
    assert not BurstGate(None).open_for(1e9) and BurstGate(None).opens_at(0.0) is None


def test_the_command_line_prints_the_burst_figures(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("\n".join([HEADER, "a,u1,0,7200,8,A100", "b,u2,10,7200,8,A100"]) + "\n")
    runner = CliRunner()
    base = ["simulate", "--trace", str(path), "--max-gpus", "64", "--owned-gpus", "8"]
    shown = runner.invoke(app, [*base, "--burst-after", "30m"])
    assert shown.exit_code == 0, shown.output
    assert "burst            after 30 min: 1 jobs ran on the cloud" in shown.output
    figures = json.loads(runner.invoke(app, [*base, "--burst-after", "never", "--json"]).output)
    assert figures["burst_jobs"] == 0 and figures["burst_after_s"] is None
    bad = runner.invoke(app, [*base, "--burst-after", "soon"])
    assert bad.exit_code == 2 and "--burst-after wants a duration" in bad.output
