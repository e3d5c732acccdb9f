"""`make bench` part: fair, fifo and per-job, judged, in two worlds side by side, and speed.

Four loads: the real dev trace at --max-gpus 256, and three seeded synthetic ones
(`SYNTHETIC`): a small team (`bot.sim.tracegen`: mostly short one-GPU jobs, daily sweeps)
at --max-gpus 16, two 8-GPU instances, and two held-out loads never tuned on (a
large-job cluster at 64 GPUs and a short-job one at 16). Each synthetic load is drawn
for five seeds (`TEAM_SEEDS`, `LARGE_SEEDS`, `SHORT_SEEDS`); its figures are reported
per seed and as the mean, and its goals are judged on the mean. Beside each, the
packing bound (`bot.sim.bound`): the efficiency on offer to a schedule that makes no
job wait, with instances only in their real sizes, so a goal above it is one that only
waiting can meet. The efficiency goal is a share of it (`BOUND_SHARE`; for a synthetic
load, the mean efficiency over the mean bound), printed as fair/bound beside fair's
queue over fifo's. And beside each efficiency, the same measured only from the first
submission to the last (`arrival_window_efficiency`): a finite trace ends with days of
its longest jobs running alone, a drain a team that keeps submitting never has; the
goals are judged on the whole-trace figure. Three worlds (the simulator's contract, docs/SIMULATOR.md): ``honest`` — no
run time known, half the jobs checkpointable every 30 minutes, preemption in the
worker's steps
(`--estimates none --checkpointable 0.5 --checkpoint-every 1800`); ``honest_none`` — the
same with no job checkpointable; ``exact`` — the first simulator's world (exact run
times, every job checkpointing on the signal, `--checkpointable 1 --checkpoint-every 0
--stop-s 0`). Every schedule is handed to the independent checker
(`tests/sim_checker.py`) with that world's rules, so no figure here is better than a
schedule that was actually feasible.

The speed run: a synthetic trace of 100,000 jobs with the dev trace's statistics —
(user, duration, GPUs) drawn with replacement from its rows, Poisson arrivals at its
rate — seeded, simulated once under `fair` with `gpubot simulate`'s defaults (no run
times, no job checkpointable). At --max-gpus 256 that load is about twice the quota, so
its queue grows without bound: it measures the simulator (long queues are its worst
case), not a policy.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

from bot.domain.scheduling import BurstGate
from bot.sim.bound import arrival_window_efficiency, packing_bound, paid_gpu_time
from bot.sim.output import write_instances, write_schedule
from bot.sim.simulate import (
    TraceJob,
    load_trace,
    parse_trace,
    run_simulation,
)
from bot.sim.tracegen import LARGE_JOBS, SHORT_JOBS, TeamShape, small_team_trace
from provisioning.catalog import Catalog
from tests.sim_checker import check

DEV_TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "trace_dev.csv"
MAX_GPUS = 256
POLICIES = ("fair", "per-job", "fifo")
SYNTH_JOBS = 100_000
SYNTH_SEED = 20240601
# The synthetic loads are judged on the mean over these seeds, not on one draw: one seed
# of a few thousand jobs moves the team's efficiency by several points either way, so a
# change "meeting" a goal on one seed said little. The first seed of each is the one the
# bench used alone before; the others are fixed too, so figures stay comparable.
TEAM_SEEDS = (17, 1, 2, 7, 8)
LARGE_SEEDS = (101, 3, 4, 9, 10)
SHORT_SEEDS = (202, 5, 6, 11, 12)
# Each synthetic load: (its shape, its seeds, its quota in GPUs). The small team at two
# 8-GPU instances; the held-out ones, never tuned on (bot.sim.tracegen names their shapes
# and sources): a large-job cluster and a short-job one.
SYNTHETIC: dict[str, tuple[TeamShape, tuple[int, ...], int]] = {
    "team_16": (TeamShape(), TEAM_SEEDS, 16),
    "large_64": (LARGE_JOBS, LARGE_SEEDS, 64),
    "short_16": (SHORT_JOBS, SHORT_SEEDS, 16),
}
# The efficiency goal (issue 31), the same on every trace: fair within 5% of that trace's
# packing bound. An absolute figure asked some traces for what only making people wait
# could reach (the team's 0.75 against a bound of 0.661) and others for little.
BOUND_SHARE = 0.95
# The figures averaged over seeds (the rest are per seed only).
MEAN_KEYS = (
    "cost_efficiency",
    "checker_cost_efficiency",
    "arrival_window_efficiency",
    "avg_queue_s",
    "p95_queue_s",
    "avg_jct_s",
    "total_cost_usd",
    "gpu_utilization",
    "preemptions",
    # where the paid GPU time went (bot.sim.bound.paid_gpu_time), as fractions of it
    "busy",
    "idle_beside_a_job",
    "idle_with_no_job",
    "done_again",
)
# What the scheduler reaches when it knows more than production can: every run's length
# (the trace's duration as its limit) and the movable half checkpointing on the signal,
# with the same half unable to move. Fair only, beside the goal: where even this falls
# short of BOUND_SHARE of the packing bound, the goal asks for more than placing,
# moving and buying well without an oracle can give, and only making runs wait buys the
# rest (issue 31's note has the figures of the waiting it would take).
ORACLE_WORLD: dict[str, object] = {
    "estimates": "exact",
    "checkpointable_fraction": 0.5,
    "checkpoint_every_s": 0.0,
    "stop_s": 0.0,
}
WORLDS: dict[str, dict[str, object]] = {
    "honest": {"estimates": "none", "checkpointable_fraction": 0.5, "checkpoint_every_s": 1800.0},
    "honest_none": {"estimates": "none", "checkpointable_fraction": 0.0},
    "exact": {
        "estimates": "exact",
        "checkpointable_fraction": 1.0,
        "checkpoint_every_s": 0.0,
        "stop_s": 0.0,
    },
}


def synthetic_trace(base: list[TraceJob], n: int, seed: int) -> list[TraceJob]:
    """n jobs resampled from `base`, arriving as a Poisson process at base's rate."""
    rng = random.Random(seed)
    span = max(j.submit_s for j in base) - min(j.submit_s for j in base)
    rate = len(base) / span if span > 0 else 1.0
    t = 0.0
    out = []
    for k in range(n):
        t += rng.expovariate(rate)
        b = rng.choice(base)
        out.append(TraceJob(f"syn-{k}", b.user, t, b.duration_s, b.gpus, b.gpu_model))
    return out


def _judged(
    trace: Path,
    jobs: list[TraceJob],
    max_gpus: int,
    world: dict[str, object],
    d: Path,
    policies: tuple[str, ...] = POLICIES,
) -> dict[str, dict[str, object]]:
    """Every policy on one trace in one world, each schedule checked by its rules."""
    catalog = Catalog.load()
    out: dict[str, dict[str, object]] = {}
    rules = {
        "checkpointable": world.get("checkpointable_fraction", 0.0),
        "checkpoint_every_s": world.get("checkpoint_every_s", 1800.0),
        "stop_s": world.get("stop_s", 30.0),
    }
    for policy in policies:
        res = run_simulation(
            jobs,
            policy=policy,
            catalog=catalog,
            max_gpus=max_gpus,
            **world,  # type: ignore[arg-type]
        )
        sched, insts = d / f"{policy}-schedule.csv", d / f"{policy}-instances.csv"
        write_schedule(sched, res.schedule)
        write_instances(insts, res.instances)
        verdict = check(
            trace,
            sched,
            insts,
            max_gpus=max_gpus,
            claimed=res.figures(),
            **rules,  # type: ignore[arg-type]
        )
        f = res.figures()
        f.update(
            {
                # beside cost_efficiency: without the drain after the last submission,
                # which production never has (bot.sim.bound.arrival_window_efficiency)
                "arrival_window_efficiency": round(
                    arrival_window_efficiency(res, jobs, catalog), 6
                ),
                **{
                    k: v for k, v in paid_gpu_time(res, jobs).figures().items() if k != "paid_gpu_h"
                },
                "instances": len(res.instances),
                "preemptions": res.preemptions,
                "rejected": len(res.rejected),
                "sim_wall_s": round(res.wall_s, 3),
                "checker_ok": verdict.ok,
                "checker_errors": verdict.errors[:5],
                "checker_cost_efficiency": round(verdict.figures["cost_efficiency"], 6),
            }
        )
        out[policy] = f
    return out


Table = dict[str, dict[str, dict[str, object]]]  # world -> policy -> figures


def _mean(tables: list[Table]) -> Table:
    """Each world's and policy's MEAN_KEYS averaged over the seeds' tables."""
    out: Table = {}
    for world, policies in tables[0].items():
        out[world] = {}
        for policy in policies:
            rows = [t[world][policy] for t in tables]
            out[world][policy] = {
                k: round(sum(_num(r[k]) for r in rows) / len(rows), 6) for k in MEAN_KEYS
            }
    return out


def _num(x: object) -> float:
    return float(x) if isinstance(x, int | float) else float("nan")


def _goals(t: Table, bound: float) -> dict[str, bool]:
    """The issue's goals on one table (a trace's figures, or a synthetic load's means),
    `bound` its packing bound (for a load, the mean of its seeds' bounds)."""
    fair, fifo = t["honest"]["fair"], t["honest"]["fifo"]
    fair0, fifo0 = t["honest_none"]["fair"], t["honest_none"]["fifo"]
    return {
        f"fair_ge_{BOUND_SHARE}_of_packing_bound": _num(fair["checker_cost_efficiency"])
        >= BOUND_SHARE * bound,
        "fair_queue_le_third_of_fifo": _num(fair["avg_queue_s"]) <= _num(fifo["avg_queue_s"]) / 3,
        "none_checkpointable_no_worse_than_fifo": _num(fair0["cost_efficiency"])
        >= _num(fifo0["cost_efficiency"])
        and _num(fair0["avg_queue_s"]) <= _num(fifo0["avg_queue_s"]),
    }


def _oracle(trace: Path, jobs: list[TraceJob], max_gpus: int, d: Path) -> tuple[float, float]:
    """Fair's checked efficiency and average queue in ORACLE_WORLD (an infeasible
    schedule's efficiency counts 0)."""
    f = _judged(trace, jobs, max_gpus, ORACLE_WORLD, d, ("fair",))["fair"]
    eff = _num(f["checker_cost_efficiency"]) if f["checker_ok"] else 0.0
    return eff, _num(f["avg_queue_s"])


def _fifo_queue(t: Table) -> float:
    return _num(t["honest"]["fifo"]["avg_queue_s"])


def _over(t: Table, bound: float) -> float:
    """Fair's checked efficiency in the honest world as a share of the packing bound."""
    eff = _num(t["honest"]["fair"]["checker_cost_efficiency"])
    return round(eff / bound, 4) if bound > 0 else float("nan")


def run() -> dict[str, object]:
    trace = DEV_TRACE
    if not trace.exists():
        trace = Path("/work/shared/traces/trace_dev.csv")
    catalog = Catalog.load()
    out: dict[str, object] = {"trace": str(trace), "max_gpus": MAX_GPUS}
    feasible = True
    goals: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        # parsed once: the simulations, the drain figure and the bound all read it
        dev_jobs = load_trace(trace, catalog, "A100")
        dev: Table = {name: _judged(trace, dev_jobs, MAX_GPUS, w, d) for name, w in WORLDS.items()}
        feasible &= all(bool(f["checker_ok"]) for w in dev.values() for f in w.values())
        bound = packing_bound(dev_jobs, catalog, MAX_GPUS)
        oracle, oracle_q = _oracle(trace, dev_jobs, MAX_GPUS, d)
        out["dev_256"] = {
            **dev,
            "packing_bound": bound.figures(),
            "fair_over_bound": _over(dev, bound.efficiency_bound),
            "oracle_fair_over_bound": round(oracle / bound.efficiency_bound, 4),
            "oracle_queue_over_fifo": round(oracle_q / _fifo_queue(dev), 4),
        }
        goals["dev_256"] = _goals(dev, bound.efficiency_bound)
        out["burst_dev"] = burst_table(dev_jobs)
        for key, (shape, seeds, gpus) in SYNTHETIC.items():
            per_seed: dict[str, object] = {}
            tables: list[Table] = []
            bounds: list[float] = []
            oracles: list[tuple[float, float]] = []
            over_h: list[float] = []
            for seed in seeds:
                path = d / f"{key}-{seed}.csv"
                path.write_text(small_team_trace(seed, shape))
                jobs = parse_trace(path.read_text().splitlines(), catalog, "A100")
                table = {name: _judged(path, jobs, gpus, w, d) for name, w in WORLDS.items()}
                feasible &= all(bool(f["checker_ok"]) for w in table.values() for f in w.values())
                b = packing_bound(jobs, catalog, gpus)
                bounds.append(b.efficiency_bound)
                oracles.append(_oracle(path, jobs, gpus, d))
                over_h.append(b.over_quota_s / 3600.0)
                tables.append(table)
                per_seed[str(seed)] = {
                    "jobs": len(jobs),
                    "packing_bound": b.figures(),
                    "fair_over_bound": _over(table, b.efficiency_bound),
                    "goals": _goals(table, b.efficiency_bound),
                    **table,
                }
            mean = _mean(tables)
            mean_bound = sum(bounds) / len(bounds)
            out[key] = {
                "seeds": list(seeds),
                "max_gpus": gpus,
                "mean": {
                    **mean,
                    "packing_bound": round(mean_bound, 6),
                    # the goal's figure: the mean efficiency over the mean bound
                    "fair_over_bound": _over(mean, mean_bound),
                    "oracle_fair_over_bound": round(
                        sum(e for e, _ in oracles) / len(oracles) / mean_bound, 4
                    ),
                    "oracle_queue_over_fifo": round(
                        sum(q for _, q in oracles) / len(oracles) / _fifo_queue(mean), 4
                    ),
                    # how long the no-wait schedule of the bound would exceed the quota:
                    # the quota makes jobs wait then, so the bound does not bind there
                    "no_wait_over_quota_h": round(sum(over_h) / len(over_h), 2),
                },
                "per_seed": per_seed,
            }
            goals[key] = {
                "judged_on": f"mean over seeds {', '.join(map(str, seeds))}",
                **_goals(mean, mean_bound),
            }

    base = dev_jobs
    jobs_big = synthetic_trace(base, SYNTH_JOBS, SYNTH_SEED)
    t0, c0 = time.perf_counter(), time.process_time()
    # `gpubot simulate`'s defaults: the honest world with no job checkpointable
    big = run_simulation(jobs_big, policy="fair", catalog=catalog, max_gpus=MAX_GPUS)
    wall = time.perf_counter() - t0
    out["synthetic_100k"] = {
        "jobs": big.jobs,
        "policy": "fair",
        "world": "defaults (--estimates none --checkpointable 0)",
        "seed": SYNTH_SEED,
        "runs": 1,
        "wall_s": round(wall, 2),
        "cpu_s": round(time.process_time() - c0, 2),  # cost on an idle machine
        "preemptions": big.preemptions,
        "cost_efficiency": big.cost_efficiency,
        "avg_queue_s": big.avg_queue_s,
    }
    out["goals"] = {
        "all_schedules_feasible": feasible,
        **goals,
        "sim_100k_under_60s": wall < 60.0,
    }
    return out


# The burst table (issue 37, part 3): the dev trace with the team owning half the cloud's
# quota of A100s, the cloud bought for a run that has waited BURST_AFTER (None: never).
BURST_OWNED_GPUS = 128
BURST_AFTER: tuple[tuple[str, float | None], ...] = (
    ("0", 0.0),
    ("15m", 900.0),
    ("1h", 3600.0),
    ("never", None),
)


def burst_table(jobs: list[TraceJob]) -> dict[str, object]:
    """Cost (the cloud's bill; the owned GPUs are $0) and waits of the dev trace at each
    threshold, with `gpubot simulate`'s defaults otherwise; beside them the cloud-only
    pool of the same quota. Each row is `gpubot simulate --trace trace_dev.csv --max-gpus
    256 --owned-gpus 128 --burst-after X`."""
    rows: dict[str, object] = {}
    for name, after in BURST_AFTER:
        res = run_simulation(
            jobs, max_gpus=MAX_GPUS, owned_gpus=BURST_OWNED_GPUS, burst=BurstGate(after)
        )
        rows[name] = {**res.figures(), "rejected": len(res.rejected)}
    cloud = run_simulation(jobs, max_gpus=MAX_GPUS)
    return {
        "owned_gpus": BURST_OWNED_GPUS,
        "max_gpus": MAX_GPUS,
        "rows": rows,
        "cloud_only": {**cloud.figures(), "rejected": len(cloud.rejected)},
    }


def headline(figures: dict[str, object]) -> list[str]:
    """The honest world's fair and fifo beside the packing bound, per trace: efficiency
    (checked) / average queue; a synthetic load's means first, then each seed's."""

    def cell(t: dict[str, object], policy: str) -> str:
        # efficiency (checked) / queue, then in brackets the efficiency without the
        # drain after the last submission (bot.sim.bound.arrival_window_efficiency)
        f = t["honest"][policy]  # type: ignore[index]
        return (
            f"{_num(f['checker_cost_efficiency']):.3f}/{_num(f['avg_queue_s']):,.0f}s"
            f" [{_num(f.get('arrival_window_efficiency')):.3f}]"
        )

    def met(goals: object) -> str:
        g = goals if isinstance(goals, dict) else {}
        return " ".join(f"{k}={'yes' if v else 'NO'}" for k, v in g.items() if k != "judged_on")

    def share(t: dict[str, object]) -> str:
        # the goal's figure: fair's efficiency over the packing bound, and fair's queue
        # over fifo's (goals: >= BOUND_SHARE and <= 1/3)
        fair, fifo = t["honest"]["fair"], t["honest"]["fifo"]  # type: ignore[index]
        q = _num(fair["avg_queue_s"]) / _num(fifo["avg_queue_s"])
        line = f"fair/bound {_num(t.get('fair_over_bound')):.3f}  queue/fifo's {q:.2f}"
        if "oracle_fair_over_bound" in t:
            line += (
                f" (with run times known: {_num(t.get('oracle_fair_over_bound')):.3f}"
                f" / {_num(t.get('oracle_queue_over_fifo')):.2f})"
            )
        return line

    lines = [
        "honest world (--estimates none --checkpointable 0.5 --checkpoint-every 1800): "
        "efficiency/queue [efficiency from first to last submission]; goals: fair/bound "
        f">= {BOUND_SHARE}, queue/fifo's <= 0.33; in brackets after them, the same two "
        "with every run time known and the movable half checkpointing on the signal"
    ]
    all_goals = figures.get("goals", {})
    assert isinstance(all_goals, dict)
    dev = figures.get("dev_256")
    if isinstance(dev, dict):
        pb = dev["packing_bound"]
        lines.append(
            f"  dev_256: {share(dev)}  fair {cell(dev, 'fair')}  fifo {cell(dev, 'fifo')}  "
            f"packing bound {_num(pb['efficiency_bound']):.3f} "
            f"(no-wait over quota {_num(pb['over_quota_s']) / 3600:.0f} h; exact-world "
            f"fair {_num(dev['exact']['fair']['checker_cost_efficiency']):.3f})  "
            f"| {met(all_goals.get('dev_256'))}"
        )
    for key in SYNTHETIC:
        t = figures.get(key)
        if not isinstance(t, dict):
            continue
        mean = t["mean"]
        lines.append(
            f"  {key} mean of {len(t['seeds'])} seeds: {share(mean)}  fair {cell(mean, 'fair')}  "
            f"fifo {cell(mean, 'fifo')}  packing bound {_num(mean['packing_bound']):.3f} "
            f"(no-wait over quota {_num(mean['no_wait_over_quota_h']):.0f} h; exact-world "
            f"fair {_num(mean['exact']['fair']['checker_cost_efficiency']):.3f})  "
            f"| {met(all_goals.get(key))}"
        )
        paid = mean["honest"]["fair"]
        lines.append(
            f"    fair's paid GPU time: busy {_num(paid['busy']):.3f} (done again "
            f"{_num(paid['done_again']):.3f}), idle beside a job "
            f"{_num(paid['idle_beside_a_job']):.3f}, idle with no job "
            f"{_num(paid['idle_with_no_job']):.3f}"
        )
        for seed, s in t["per_seed"].items():
            lines.append(
                f"    seed {seed:>4}: {share(s)}  fair {cell(s, 'fair')}  "
                f"fifo {cell(s, 'fifo')}  "
                f"packing bound {_num(s['packing_bound']['efficiency_bound']):.3f}"
            )
    burst = figures.get("burst_dev")
    if isinstance(burst, dict):
        lines.append(
            f"  burst, dev trace, {burst['owned_gpus']} owned A100s + the cloud up to "
            f"{burst['max_gpus']}: threshold  cloud bill  avg wait  p95 wait  jobs on the cloud"
        )
        rows = dict(burst["rows"])
        rows["cloud, no own"] = burst["cloud_only"]
        for name, r in rows.items():
            lines.append(
                f"    {name:>13}  ${_num(r['total_cost_usd']):>10,.0f}  "
                f"{_num(r['avg_queue_s']) / 3600:>6.2f} h  {_num(r['p95_queue_s']) / 3600:>6.2f} h"
                f"  {r.get('burst_jobs', r['jobs'])}"
            )
    big = figures.get("synthetic_100k")
    wall = _num(big.get("wall_s")) if isinstance(big, dict) else float("nan")
    lines.append(f"  feasible: {all_goals.get('all_schedules_feasible')}  100k jobs: {wall:.1f}s")
    return lines


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
