"""`gpubot simulate` end to end: the CLI contract, the simulated cloud's bill, the policies,
and every schedule judged by the independent checker."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from bot.domain.scheduling import IDLE_STOP_S, Place
from bot.faces.simulate_cli import simulate
from bot.sim.output import INSTANCES_HEADER, SCHEDULE_HEADER, write_instances, write_schedule
from bot.sim.simulate import (
    FIGURE_KEYS,
    SimInputError,
    SimResult,
    TraceJob,
    load_trace,
    parse_trace,
    run_simulation,
)
from bot.sim.tracegen import TeamShape, small_team_trace
from provisioning.catalog import Catalog
from provisioning.simulated import QuotaExceeded, SimulatedCloud
from tests.sim_checker import check

DEV_TRACE = Path("/work/shared/traces/trace_dev.csv")
HEADER = "job_id,user,submit_time,duration_s,gpus,gpu_type"

# A small mixed trace: a sweep of 1-GPU runs, a periodic short job, multi-GPU runs, a
# multi-host run, an explicit model, and a quiet gap long enough for idle stops.
SMALL = (
    "\n".join(
        [
            HEADER,
            *(f"s{k},alice,{10 + k},{3600 + 60 * k},1," for k in range(12)),
            *(f"p{k},bob,{600 * k},70,1," for k in range(10)),
            "m1,carol,100,7200,4,",
            "m2,carol,200,5400,8,a100",
            "big,dave,300,3000,16,",
            "g1,erin,50,1800,1,A10G",
            "late1,alice,40000,600,1,",
            "late2,bob,40030,900,2,",
        ]
    )
    + "\n"
)


@pytest.fixture()
def small_trace(tmp_path: Path) -> Path:
    path = tmp_path / "small.csv"
    path.write_text(SMALL)
    return path


def _app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """gpubot (test harness)."""

    app.command("simulate")(simulate)
    return app


def _invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(_app(), ["simulate", *args])
    return result.exit_code, result.stdout, result.stderr


# The research world of the first simulator: exact run times, every job checkpoints on
# the signal and frees its GPUs at once (`--estimates exact --checkpointable 1
# --checkpoint-every 0 --stop-s 0`).
LEGACY: dict[str, Any] = {
    "estimates": "exact",
    "checkpointable_fraction": 1.0,
    "checkpoint_every_s": 0.0,
    "stop_s": 0.0,
}


def _judge(
    trace: Path, res: SimResult, d: Path, max_gpus: int = 256, **world: Any
) -> dict[str, float]:
    write_schedule(d / f"s-{res.policy}.csv", res.schedule)
    write_instances(d / f"i-{res.policy}.csv", res.instances)
    v = check(
        trace,
        d / f"s-{res.policy}.csv",
        d / f"i-{res.policy}.csv",
        max_gpus=max_gpus,
        checkpointable=world.get("checkpointable_fraction", 0.0),
        checkpoint_every_s=world.get("checkpoint_every_s", 1800.0),
        stop_s=world.get("stop_s", 30.0),
        claimed=res.figures(),
    )
    assert v.ok, v.errors
    return v.figures


# ---------------------------------------------------------------- CLI contract


def test_cli_writes_files_with_the_contract_headers(small_trace: Path, tmp_path: Path) -> None:
    sched, insts = tmp_path / "sched.csv", tmp_path / "inst.csv"
    code, out, err = _invoke(
        "--trace",
        str(small_trace),
        "--policy",
        "fair",
        "--json",
        "--schedule-out",
        str(sched),
        "--instances-out",
        str(insts),
    )
    assert code == 0, err
    figures = json.loads(out)
    assert tuple(figures) == FIGURE_KEYS
    assert figures["policy"] == "fair" and figures["jobs"] == 28
    with sched.open() as fh:
        assert tuple(next(csv.reader(fh))) == SCHEDULE_HEADER
    with insts.open() as fh:
        assert tuple(next(csv.reader(fh))) == INSTANCES_HEADER
    assert (
        sched.read_text().splitlines()[0] == "job_id,user,instance_ids,submit_s,start_s,end_s,gpus"
    )
    assert (
        insts.read_text().splitlines()[0]
        == "instance_id,instance_type,market,launch_s,ready_s,end_s,stopped,usd"
    )
    v = check(small_trace, sched, insts, claimed=figures)
    assert v.ok, v.errors
    big = next(r for r in csv.DictReader(sched.open()) if r["job_id"] == "big")
    assert len(big["instance_ids"].split(";")) == 2


def test_cli_summary_without_json(small_trace: Path) -> None:
    code, out, _ = _invoke("--trace", str(small_trace), "--policy", "fifo")
    assert code == 0
    assert "cost efficiency" in out and "policy           fifo" in out


def test_cli_options_change_the_run(small_trace: Path) -> None:
    runs = {}
    for boot in ("120", "900"):
        code, out, err = _invoke(
            "--trace",
            str(small_trace),
            "--json",
            "--boot-s",
            boot,
            "--setup-s",
            "0",
            "--start-s",
            "30",
            "--ebs-gb",
            "100",
            "--ebs-usd-gb-month",
            "0.1",
            "--max-gpus",
            "64",
        )
        assert code == 0, err
        runs[boot] = json.loads(out)
    assert runs["900"]["avg_queue_s"] > runs["120"]["avg_queue_s"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--trace", "/nonexistent/trace.csv"], "cannot read trace"),
        (["--trace", "{bad_header}"], "header must be"),
        (["--trace", "{bad_number}"], "line 2"),
        (["--trace", "{bad_type}"], "unknown gpu_type"),
        (["--trace", "{small}", "--policy", "lottery"], "unknown policy"),
        (["--trace", "{small}", "--gpu-type", "a200"], "unknown GPU type"),
        (["--trace", "{small}", "--prices", "/nonexistent/prices.csv"], "cannot read prices"),
        (["--trace", "{small}", "--prices", "{bad_header}"], "prices file"),
        (["--trace", "{small}", "--max-gpus", "0"], "--max-gpus"),
        (["--trace", "{small}", "--boot-s", "-1"], "--boot-s"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(
    args: list[str], needle: str, small_trace: Path, tmp_path: Path
) -> None:
    files = {
        "small": small_trace,
        "bad_header": tmp_path / "bh.csv",
        "bad_number": tmp_path / "bn.csv",
        "bad_type": tmp_path / "bt.csv",
    }
    files["bad_header"].write_text("a,b,c\n1,2,3\n")
    files["bad_number"].write_text(HEADER + "\nj,u,soon,10,1,\n")
    files["bad_type"].write_text(HEADER + "\nj,u,0,10,1,TPUv9\n")
    argv = [a.format(**{k: str(v) for k, v in files.items()}) for a in args]
    code, out, err = _invoke(*argv)
    assert code != 0
    assert "Traceback" not in err + out
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert needle in lines[0]


def test_a_job_larger_than_the_quota_is_rejected_and_named(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(HEADER + "\nok,u,0,100,1,\nhuge,u,0,100,64,\n")
    code, out, err = _invoke("--trace", str(trace), "--max-gpus", "32", "--json")
    assert code == 0
    assert json.loads(out)["jobs"] == 1
    assert "rejected huge" in err


# ---------------------------------------------------------------- the simulated cloud


def test_cloud_bills_per_second_with_a_minimum_and_storage_while_stopped() -> None:
    cat = Catalog.load()
    cloud = SimulatedCloud(
        cat, max_gpus=16, boot_s=100, setup_s=200, start_s=50, ebs_gb=730, ebs_usd_gb_month=3.6
    )  # storage: 1 USD per GB-hour/730
    iid = cloud.launch("g5.xlarge")
    assert cloud.usable_at(iid) == 300
    cloud.advance_to(10)
    cloud.terminate(iid)
    assert cloud.cost(iid) == pytest.approx(60 * 1.006 / 3600)  # the 60 s minimum
    j = cloud.launch("g5.xlarge")
    cloud.advance_to(1000)
    cloud.stop(j)
    cloud.advance_to(4600)  # one hour stopped: 730 GB * 3.6 / 730 h = 3.6 USD
    t = cloud.start(j)
    assert t == 4650
    cloud.advance_to(4700)
    cloud.terminate(j)
    want = (990 + 100) * 1.006 / 3600 + 3.6
    assert cloud.cost(j) == pytest.approx(want)
    rec = {r.instance_id: r for r in cloud.records()}[j]
    assert rec.stopped == ((1000.0, 4600.0),) and rec.end_s == 4700


def test_cloud_enforces_the_quota_on_running_gpus_only() -> None:
    cloud = SimulatedCloud(Catalog.load(), max_gpus=8)
    a = cloud.launch("p4d.24xlarge")
    with pytest.raises(QuotaExceeded):
        cloud.launch("g5.xlarge")
    cloud.stop(a)
    b = cloud.launch("g5.xlarge")  # a stopped instance holds no quota
    with pytest.raises(QuotaExceeded):
        cloud.start(a)
    cloud.terminate(b)
    cloud.start(a)
    with pytest.raises(ValueError):
        cloud.advance_to(-1)


# ---------------------------------------------------------------- policies, judged


@pytest.mark.parametrize("policy", ["fair", "per-job", "fifo"])
def test_small_trace_is_feasible_under_every_policy(
    policy: str, small_trace: Path, tmp_path: Path
) -> None:
    res = run_simulation(small_trace, policy=policy, max_gpus=32)
    assert res.jobs == 28 and not res.rejected
    _judge(small_trace, res, tmp_path, max_gpus=32)


def test_per_job_gives_every_job_its_own_instances(small_trace: Path) -> None:
    res = run_simulation(small_trace, policy="per-job", max_gpus=32)
    hosts = [i for s in res.schedule for i in s.instance_ids]
    assert len(hosts) == len(set(hosts)) == len(res.instances)


def test_fifo_keeps_a_fixed_fleet_and_serves_in_order(small_trace: Path) -> None:
    res = run_simulation(small_trace, policy="fifo", max_gpus=32)
    assert {r.launch_s for r in res.instances} == {0.0}
    last_end = max(s.end_s for s in res.schedule)
    assert {r.end_s for r in res.instances} == {last_end}
    by_submit = sorted(res.schedule, key=lambda s: (s.submit_s, s.job_id))
    starts = [s.start_s for s in by_submit]
    assert starts == sorted(starts)


def test_fair_beats_the_baselines_on_cost(small_trace: Path) -> None:
    cost = {
        p: run_simulation(small_trace, policy=p, max_gpus=32).total_cost_usd
        for p in ("fair", "per-job", "fifo")
    }
    assert cost["fair"] < cost["per-job"] and cost["fair"] < cost["fifo"]


def test_fair_stops_idle_instances_and_restarts_them(tmp_path: Path) -> None:
    trace = tmp_path / "gap.csv"
    trace.write_text(HEADER + "\na,u,0,600,1,\nb,u,5000,600,1,\n")
    # the worker's idle stop by default (IDLE_STOP_S, 15 min), the ski-rental break-even
    # (2 min with the default costs) when asked for
    for idle, after in ((IDLE_STOP_S, 900.0), (None, 120.0)):
        res = run_simulation(trace, policy="fair", idle_stop_s=idle)
        assert len(res.instances) == 1
        rec = res.instances[0]
        assert rec.stopped and rec.stopped[0][0] == pytest.approx(420 + 600 + after)
        b = next(s for s in res.schedule if s.job_id == "b")
        assert b.start_s == pytest.approx(5060)  # start_s after the restart, no setup
        _judge(trace, res, tmp_path)


def test_run_simulation_rejects_unknown_policy(small_trace: Path) -> None:
    with pytest.raises(SimInputError):
        run_simulation(small_trace, policy="nope")


def test_an_idle_stop_of_zero_is_refused_not_looped_on() -> None:
    """At 0 s an instance is "idle too long" the moment it is ready: decide stopped it and
    restarted another for the run, every tick, and the replay never ended. The worker's
    Settings refuse 0 (GPUBOT_IDLE_STOP_AFTER must be positive); so does the simulator."""
    jobs = [TraceJob("a", "u", 0.0, 600.0, 1, "A100")]
    with pytest.raises(SimInputError, match="idle stop"):
        run_simulation(jobs, policy="fair", idle_stop_s=0.0)
    assert run_simulation(jobs, policy="fair", idle_stop_s=1.0).jobs == 1


# ---------------------------------------------------------------- the checker can fail


def test_checker_catches_tampered_schedules(small_trace: Path, tmp_path: Path) -> None:
    res = run_simulation(small_trace, policy="fair", max_gpus=32)
    write_schedule(tmp_path / "s.csv", res.schedule)
    write_instances(tmp_path / "i.csv", res.instances)
    rows = list(csv.DictReader((tmp_path / "s.csv").open()))
    inst_rows = list(csv.DictReader((tmp_path / "i.csv").open()))

    def judged(srows: list[dict[str, str]], irows: list[dict[str, str]]) -> list[str]:
        for name, data, header in (
            ("s2.csv", srows, SCHEDULE_HEADER),
            ("i2.csv", irows, INSTANCES_HEADER),
        ):
            with (tmp_path / name).open("w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=list(header), lineterminator="\n")
                w.writeheader()
                w.writerows(data)
        return check(small_trace, tmp_path / "s2.csv", tmp_path / "i2.csv", max_gpus=32).errors

    assert judged(rows, inst_rows) == []
    early = [dict(r) for r in rows]
    early[0]["start_s"] = str(float(early[0]["submit_s"]) - 1)
    early[0]["end_s"] = str(float(early[0]["end_s"]) - float(early[0]["start_s"]) - 1)
    assert judged(early, inst_rows)
    crowd = [dict(r) for r in rows]
    target = crowd[0]["instance_ids"].split(";")[0]
    for r in crowd:
        r["instance_ids"] = target
    assert any("GPUs in use" in e or "usable" in e for e in judged(crowd, inst_rows))
    cheap = [dict(r) for r in inst_rows]
    cheap[0]["usd"] = "0.01"
    assert any("usd" in e for e in judged(rows, cheap))
    missing = rows[1:]
    assert any("never ran" in e for e in judged(missing, inst_rows))
    short = [dict(r) for r in rows]
    short[0]["end_s"] = str(float(short[0]["end_s"]) - 5)
    assert any("of work, not the" in e for e in judged(short, inst_rows))


def test_checker_catches_a_quota_breach(small_trace: Path, tmp_path: Path) -> None:
    res = run_simulation(small_trace, policy="fair", max_gpus=32)
    write_schedule(tmp_path / "s.csv", res.schedule)
    write_instances(tmp_path / "i.csv", res.instances)
    v = check(small_trace, tmp_path / "s.csv", tmp_path / "i.csv", max_gpus=8)
    assert any("quota" in e for e in v.errors)


# ---------------------------------------------------------------- the real trace


@pytest.mark.skipif(not DEV_TRACE.exists(), reason="shared trace not present")
@pytest.mark.parametrize("policy", ["fair", "per-job", "fifo"])
def test_dev_trace_is_feasible(policy: str, tmp_path: Path) -> None:
    res = run_simulation(DEV_TRACE, policy=policy, max_gpus=256, **LEGACY)
    assert res.jobs == 851 and not res.rejected
    figures = _judge(DEV_TRACE, res, tmp_path, **LEGACY)
    if policy == "fair":
        assert figures["cost_efficiency"] >= 0.85
    honest = run_simulation(DEV_TRACE, policy=policy, max_gpus=256, checkpointable_fraction=0.5)
    _judge(DEV_TRACE, honest, tmp_path, checkpointable_fraction=0.5)


# ---------------------------------------------------------------- preemption


def _next_slot(t: float, period_s: float = 300.0) -> float:
    """The first preemption slot (SchedulerConfig.preempt_period_s) starting at or after t."""
    return math.ceil(t / period_s) * period_s


def _hog_trace(tmp_path: Path) -> Path:
    """One user fills the quota with day-long runs; another arrives an hour later."""
    rows = [HEADER]
    rows += [f"hog-{k},hog,{k}.0,86400.0,1," for k in range(8)]
    rows += ["late-0,late,3600.0,7200.0,1,"]
    p = tmp_path / "hog.csv"
    p.write_text("\n".join(rows) + "\n")
    return p


def test_a_late_user_preempts_a_hog_and_the_hog_resumes(tmp_path: Path) -> None:
    trace = _hog_trace(tmp_path)
    res = run_simulation(trace, policy="fair", max_gpus=8, **LEGACY)
    figures = _judge(trace, res, tmp_path, max_gpus=8, **LEGACY)
    late = [s for s in res.schedule if s.job_id == "late-0"]
    assert len(late) == 1
    # it waited one provisioning time (boot + setup), then for the next preemption look
    # (once per preempt_period_s, as the worker's first tick of each slot), not the hog's day
    assert late[0].start_s == pytest.approx(_next_slot(late[0].submit_s + 420.0))
    segments: dict[str, list[float]] = {}
    for s in res.schedule:
        segments.setdefault(s.job_id, []).append(s.end_s - s.start_s)
    resumed = [k for k, v in segments.items() if len(v) > 1]
    assert len(resumed) == 1 and resumed[0].startswith("hog-")
    # the work is done once; the resume costs --resume-s more on its GPU
    assert sum(segments[resumed[0]]) == pytest.approx(86400.0 + 300.0)
    assert res.preemptions == 1
    # and without preemption the late run waits for a hog to end
    off = run_simulation(trace, policy="fair", max_gpus=8, preempt=False, **LEGACY)
    _judge(trace, off, tmp_path, max_gpus=8, **LEGACY)
    assert all(
        len([s for s in off.schedule if s.job_id == j]) == 1
        for j in {s.job_id for s in off.schedule}
    )
    late_off = next(s for s in off.schedule if s.job_id == "late-0")
    assert late_off.start_s - late_off.submit_s > 80_000
    # the hog's resumed job waited for the late run's two hours: fewer jobs waited less
    assert off.avg_queue_s > figures["avg_queue_s"]


def test_cli_preempt_flags(tmp_path: Path) -> None:
    trace = _hog_trace(tmp_path)
    out = tmp_path / "s.csv"
    code, stdout, _ = _invoke(
        "--trace",
        str(trace),
        "--max-gpus",
        "8",
        "--resume-s",
        "60",
        "--schedule-out",
        str(out),
        "--checkpointable",
        "1",
    )
    assert code == 0 and "preemptions      1" in stdout
    with out.open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 10  # nine jobs, one of them in two segments
    code, stdout, _ = _invoke(
        "--trace", str(trace), "--max-gpus", "8", "--no-preempt", "--checkpointable", "1"
    )
    assert code == 0 and "preemptions      0" in stdout
    # the default: no job checkpoints, so none is ever preempted
    code, stdout, _ = _invoke("--trace", str(trace), "--max-gpus", "8")
    assert code == 0 and "preemptions      0" in stdout
    for bad in (["--checkpointable", "1.5"], ["--estimates", "oracle"], ["--stop-s", "-1"]):
        code, _, stderr = _invoke("--trace", str(trace), *bad)
        assert code == 2 and bad[0] in stderr
    code, _, stderr = _invoke("--trace", str(trace), "--resume-s", "-1")
    assert code == 2 and "--resume-s" in stderr


def test_a_preemption_takes_the_workers_steps_and_loses_unsaved_work(tmp_path: Path) -> None:
    """Honest preemption: the hog holds its GPUs --stop-s after the signal, the late run
    starts at the decision after, and the hog keeps only whole checkpoint periods."""
    trace = tmp_path / "hog2.csv"
    trace.write_text(
        _hog_trace(tmp_path).read_text().replace("late-0,late,3600.0", "late-0,late,4500.0")
    )
    world: dict[str, Any] = {"checkpointable_fraction": 1.0, "checkpoint_every_s": 1800.0}
    res = run_simulation(trace, policy="fair", max_gpus=8, stop_s=30.0, **world)
    _judge(trace, res, tmp_path, max_gpus=8, stop_s=30.0, **world)
    late = next(s for s in res.schedule if s.job_id == "late-0")
    rows: dict[str, list[Any]] = {}
    for s in res.schedule:
        rows.setdefault(s.job_id, []).append(s)
    hog = next(v for k, v in rows.items() if len(v) > 1)
    first, second = hog
    signal = first.end_s - 30.0
    assert late.start_s == pytest.approx(first.end_s)  # the GPUs it waited for
    assert late.start_s == pytest.approx(_next_slot(late.submit_s + 420.0) + 30.0)
    kept = (signal - first.start_s) // 1800.0 * 1800.0
    assert kept < signal - first.start_s  # some work was lost, and done again
    assert second.end_s - second.start_s == pytest.approx(86400.0 - kept + 300.0)


def test_only_checkpointable_jobs_are_preempted_by_the_hash_rule(tmp_path: Path) -> None:
    import hashlib

    trace = _hog_trace(tmp_path)
    f = 0.5
    eligible = {
        f"hog-{k}"
        for k in range(8)
        if int(hashlib.sha256(f"hog-{k}".encode()).hexdigest()[:8], 16) < f * 2**32
    }
    assert 0 < len(eligible) < 8  # the rule splits this trace, so the test can fail
    res = run_simulation(trace, policy="fair", max_gpus=8, checkpointable_fraction=f)
    _judge(trace, res, tmp_path, max_gpus=8, checkpointable_fraction=f)
    moved = {s.job_id for s in res.schedule if s.job_id.startswith("hog-")}
    moved = {j for j in moved if sum(1 for s in res.schedule if s.job_id == j) > 1}
    assert moved and moved <= eligible
    none = run_simulation(trace, policy="fair", max_gpus=8)
    assert none.preemptions == 0


def test_a_replayed_runs_own_checkpoints_and_spot_override_the_contracts_stand_ins(
    tmp_path: Path,
) -> None:
    """A replay of the team's history says per run whether it checkpoints (TraceJob
    .checkpoints, instead of the hash rule) and whether it ran on spot."""
    catalog = Catalog.load(None)
    jobs = load_trace(_hog_trace(tmp_path), catalog, "A100")
    mine = {"hog-0", "hog-3"}  # the only ones that checkpoint, whatever their hash says
    marked = [replace(j, checkpoints=j.job_id in mine) for j in jobs]
    res = run_simulation(marked, policy="fair", max_gpus=8, checkpointable_fraction=1.0)
    moved = {s.job_id for s in res.schedule if s.job_id.startswith("hog-")}
    moved = {j for j in moved if sum(1 for s in res.schedule if s.job_id == j) > 1}
    assert moved and moved <= mine
    # A run that ran on spot runs on spot capacity, at its price.
    one = [replace(jobs[0], submit_s=0.0)]
    od = run_simulation(one, policy="fair", max_gpus=8)
    sp = run_simulation([replace(one[0], spot=True)], policy="fair", max_gpus=8)
    assert [r.market for r in od.instances] == ["ondemand"]
    assert [r.market for r in sp.instances] == ["spot"]
    t = catalog.get(sp.instances[0].instance_type)
    assert t is not None and t.spot_usd_hr is not None
    assert sp.total_cost_usd < od.total_cost_usd
    assert sp.total_cost_usd / od.total_cost_usd == pytest.approx(
        t.spot_usd_hr / t.ondemand_usd_hr, rel=1e-3
    )


# ---------------------------------------------------------------- no oracle


def _team_jobs(days: int = 1, seed: int = 3) -> list[TraceJob]:
    text = small_team_trace(seed, TeamShape(days=days))
    return parse_trace(text.splitlines(), Catalog.load(None), "A100")


def test_the_scheduler_is_non_clairvoyant() -> None:
    """Tripling the run time of the jobs that arrive after noon changes no decision made
    before the first of them would have ended: the scheduler never saw a run time."""
    jobs = _team_jobs()
    cut = 12 * 3600.0
    later = {j.job_id for j in jobs if j.submit_s >= cut}
    assert later and len(later) < len(jobs)
    longer = [replace(j, duration_s=3 * j.duration_s) if j.job_id in later else j for j in jobs]

    def decisions(trace: list[TraceJob]) -> tuple[list[tuple[float, list[Any]]], SimResult]:
        seen: list[tuple[float, list[Any]]] = []
        res = run_simulation(
            trace,
            policy="fair",
            max_gpus=16,
            checkpointable_fraction=0.5,
            on_decision=lambda t, acts: seen.append((t, acts)),
        )
        return seen, res

    base, res = decisions(jobs)
    ends = [s.end_s for s in res.schedule if s.job_id in later]
    first_end = min(ends)
    assert first_end > cut
    before = [d for d in base if d[0] < first_end]
    other, _ = decisions(longer)
    assert len(before) > 10  # the window holds real decisions, so the test can fail
    assert [d for d in other if d[0] < first_end] == before

    # the window holds decisions over the lengthened jobs themselves (placed, running)
    placed_later = {
        a.run_id for t, acts in before for a in acts if isinstance(a, Place) and a.run_id in later
    }
    assert placed_later


def test_the_team_trace_is_seeded_and_has_the_published_shape() -> None:
    a = small_team_trace(7)
    assert a == small_team_trace(7) and a != small_team_trace(8)
    jobs = parse_trace(a.splitlines(), Catalog.load(None), "A100")
    durs = sorted(j.duration_s for j in jobs)
    median, p90 = durs[len(durs) // 2], durs[int(0.9 * len(durs))]
    assert 200 <= median <= 450 and 3000 <= p90 <= 7000
    assert sum(j.gpus == 1 for j in jobs) / len(jobs) > 0.75
    per_day = len(jobs) / TeamShape().days
    assert 150 <= per_day <= 400


@pytest.mark.skipif(not DEV_TRACE.exists(), reason="shared trace not present")
def test_dev_trace_without_an_oracle_beats_fifo() -> None:
    """The honest world (no run times; half the jobs checkpoint every 30 minutes): fair's
    average queue is at most a third of fifo's; with no job checkpointable fair is still
    no worse than fifo on cost efficiency or queue. (Efficiency 0.85 is not reached yet:
    the bench reports it.)"""
    fifo = run_simulation(DEV_TRACE, policy="fifo", max_gpus=256)
    half = run_simulation(DEV_TRACE, policy="fair", max_gpus=256, checkpointable_fraction=0.5)
    none = run_simulation(DEV_TRACE, policy="fair", max_gpus=256)
    assert half.avg_queue_s <= fifo.avg_queue_s / 3
    assert half.cost_efficiency > 0.8
    assert none.cost_efficiency >= fifo.cost_efficiency
    assert none.avg_queue_s <= fifo.avg_queue_s
