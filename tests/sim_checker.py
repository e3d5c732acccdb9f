"""An independent judge of `gpubot simulate` output: feasibility and the bill, from files.

It reads only the CSVs (trace, prices, schedule, instances) and the numbers of the
DESIGN.md contract, never `bot.sim.simulate` or `bot.domain.scheduling`, so a bug in the simulator
cannot hide itself here: the figures it reports cannot be better than the schedule it
wrote. Used by the tests and by `bench/simulate.py`; runnable as a script:

    python -m tests.sim_checker TRACE SCHEDULE INSTANCES [--max-gpus N] [--json FIGURES]

A job preempted by the scheduler has one schedule row per segment: the segments must not
overlap each other or start before the submission. The contract's preemption rules:

* only a checkpointable job has more than one segment: int(sha256(job_id)[:8], 16) <
  --checkpointable * 2**32;
* every segment after the first starts with --resume-s of overhead; a segment that was
  preempted ends --stop-s after its signal (checkpoint, exit, the worker's poll), and
  keeps only whole multiples of --checkpoint-every of the work between its overhead and
  the signal (all of it at 0); the last segment does exactly the work left.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

TRACE_HEADER = ["job_id", "user", "submit_time", "duration_s", "gpus", "gpu_type"]
SCHEDULE_HEADER = ["job_id", "user", "instance_ids", "submit_s", "start_s", "end_s", "gpus"]
INSTANCES_HEADER = [
    "instance_id",
    "instance_type",
    "market",
    "launch_s",
    "ready_s",
    "end_s",
    "stopped",
    "usd",
]
PRICES_HEADER = [
    "instance_type",
    "gpu_model",
    "gpus",
    "gpu_mem_gb",
    "vcpus",
    "mem_gb",
    "ondemand_usd_hr",
    "spot_usd_hr",
    "source",
    "as_of",
]
SHIPPED_PRICES = (
    Path(__file__).resolve().parents[1] / "provisioning" / "data" / "aws_gpu_prices.csv"
)
EPS = 1e-6


@dataclass
class Verdict:
    ok: bool = True
    errors: list[str] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)

    def fail(self, msg: str) -> None:
        self.ok = False
        if len(self.errors) < 50:
            self.errors.append(msg)


def _rows(path: Path, header: list[str], v: Verdict) -> list[dict[str, str]]:
    with Path(path).open(newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh)
        got = next(reader, [])
        if got != header:
            v.fail(f"{path}: header {got} != {header}")
            return []
        return [dict(zip(header, r, strict=True)) for r in reader if r]


def _key(text: str) -> str:
    return text.strip().upper().replace("_", "-")


def check(
    trace: Path,
    schedule: Path,
    instances: Path,
    *,
    prices: Path | None = None,
    gpu_type: str = "A100",
    max_gpus: int = 256,
    start_s: float = 60.0,
    ebs_gb: float = 500.0,
    ebs_usd_gb_month: float = 0.08,
    min_bill_s: float = 60.0,
    resume_s: float = 300.0,
    checkpointable: float = 0.0,
    checkpoint_every_s: float = 1800.0,
    stop_s: float = 30.0,
    claimed: Mapping[str, object] | None = None,
) -> Verdict:
    v = Verdict()
    price_rows = _rows(prices or SHIPPED_PRICES, PRICES_HEADER, v)
    types = {r["instance_type"]: r for r in price_rows}
    models = {_key(r["gpu_model"]): r["gpu_model"] for r in price_rows}
    per_gpu_floor: dict[str, float] = {}
    for r in price_rows:
        pg = float(r["ondemand_usd_hr"]) / int(r["gpus"])
        m = r["gpu_model"]
        per_gpu_floor[m] = min(per_gpu_floor.get(m, math.inf), pg)
    default_model = models.get(_key(gpu_type), gpu_type)
    ebs_usd_s = ebs_gb * ebs_usd_gb_month / (730.0 * 3600.0)

    jobs = {r["job_id"]: r for r in _rows(trace, TRACE_HEADER, v)}
    sched = _rows(schedule, SCHEDULE_HEADER, v)
    insts = {r["instance_id"]: r for r in _rows(instances, INSTANCES_HEADER, v)}
    if not v.ok:
        return v

    # ---- instances: windows where work may run, running intervals, the bill
    usable: dict[str, list[tuple[float, float]]] = {}
    running_iv: list[tuple[float, int]] = []  # quota sweep events
    total_usd = 0.0
    paid_gpu_s = 0.0
    for iid, r in insts.items():
        t = types.get(r["instance_type"])
        if t is None:
            v.fail(f"{iid}: unknown instance type {r['instance_type']}")
            continue
        if not r["end_s"]:
            v.fail(f"{iid}: never terminated")
            continue
        launch, ready, end = float(r["launch_s"]), float(r["ready_s"]), float(r["end_s"])
        if not launch <= ready or not launch <= end:
            v.fail(f"{iid}: launch {launch} ready {ready} end {end} out of order")
        stopped: list[tuple[float, float]] = []
        if r["stopped"]:
            for part in r["stopped"].split(";"):
                a, b = (float(x) for x in part.split("-", 1))
                stopped.append((a, b))
        prev = launch
        for a, b in stopped:
            if a < prev - EPS or b < a or b > end + EPS:
                v.fail(f"{iid}: stopped interval {a}-{b} out of order")
            prev = b
        if r["market"] == "spot":
            if not t["spot_usd_hr"]:
                v.fail(f"{iid}: spot market but no spot price")
                continue
            usd_hr = float(t["spot_usd_hr"])
        elif r["market"] == "ondemand":
            usd_hr = float(t["ondemand_usd_hr"])
        else:
            v.fail(f"{iid}: unknown market {r['market']}")
            continue
        gpus = int(t["gpus"])
        # running intervals: launch..a1, b1..a2, ..., bn..end (none if it ended stopped)
        runs: list[tuple[float, float]] = []
        cur = launch
        for a, b in stopped:
            runs.append((cur, a))
            cur = b
        if not (stopped and stopped[-1][1] >= end - EPS):
            runs.append((cur, end))
        usd = sum(max(b - a, min_bill_s) for a, b in runs) * usd_hr / 3600.0
        usd += sum(b - a for a, b in stopped) * ebs_usd_s
        if not math.isclose(usd, float(r["usd"]), rel_tol=1e-6, abs_tol=1e-3):
            v.fail(f"{iid}: usd {r['usd']} but the price file says {usd:.6f}")
        total_usd += usd
        for a, b in runs:
            paid_gpu_s += gpus * (b - a)
            running_iv.append((a, gpus))
            running_iv.append((b, -gpus))
        # usable: ready..first stop, then (restart + start_s)..next stop, ...
        wins: list[tuple[float, float]] = []
        first_end = stopped[0][0] if stopped else end
        wins.append((ready, first_end))
        for idx, (_, b) in enumerate(stopped):
            nxt = stopped[idx + 1][0] if idx + 1 < len(stopped) else end
            if b < end - EPS:
                wins.append((b + start_s, nxt))
        usable[iid] = wins

    running_iv.sort(key=lambda e: (e[0], e[1]))  # ends before starts at one instant
    level = 0
    for t_, d in running_iv:
        level += d
        if level > max_gpus:
            v.fail(f"quota: {level} GPUs running at t={t_} > {max_gpus}")
            break

    # ---- jobs: one row per segment (a preempted job resumes in a later row)
    seen: set[str] = set()
    per_inst: dict[str, list[tuple[float, int]]] = {}
    queue: list[float] = []
    jct: list[float] = []
    busy = 0.0
    ideal = 0.0
    first_submit, last_end = math.inf, -math.inf
    segments: dict[str, list[dict[str, str]]] = {}
    for r in sched:
        segments.setdefault(r["job_id"], []).append(r)
    for jid, rows in segments.items():
        j = jobs.get(jid)
        if j is None:
            v.fail(f"{jid}: not in the trace")
            continue
        seen.add(jid)
        dur, gpus = float(j["duration_s"]), int(j["gpus"])
        model = models.get(_key(j["gpu_type"]), j["gpu_type"]) if j["gpu_type"] else default_model
        submit = float(rows[0]["submit_s"])
        prev_end = submit
        ran = 0.0
        for r in rows:
            start, end = float(r["start_s"]), float(r["end_s"])
            if abs(float(r["submit_s"]) - float(j["submit_time"])) > EPS or r["user"] != j["user"]:
                v.fail(f"{jid}: submit/user differ from the trace")
            if int(r["gpus"]) != gpus:
                v.fail(f"{jid}: gpus {r['gpus']} != trace {gpus}")
            if start < prev_end - EPS or end < start:
                v.fail(f"{jid}: segment {start}-{end} overlaps its submission or last segment")
            prev_end = end
            ran += end - start
            ids = r["instance_ids"].split(";")
            if gpus % len(ids):
                v.fail(f"{jid}: {gpus} GPUs do not split over {len(ids)} instances")
                continue
            per = gpus // len(ids)
            kinds = {insts[i]["instance_type"] for i in ids if i in insts}
            if len(kinds) > 1:
                v.fail(f"{jid}: spans instance types {sorted(kinds)}")
            for iid in ids:
                inst = insts.get(iid)
                if inst is None or iid not in usable:
                    v.fail(f"{jid}: unknown instance {iid}")
                    continue
                t = types[inst["instance_type"]]
                if t["gpu_model"] != model:
                    v.fail(f"{jid}: wants {model}, {iid} has {t['gpu_model']}")
                if not any(a - EPS <= start and end <= b + EPS for a, b in usable[iid]):
                    v.fail(f"{jid}: runs {start}-{end} on {iid} outside its usable windows")
                per_inst.setdefault(iid, []).extend([(start, per), (end, -per)])
        if len(rows) > 1 and not _eligible(jid, checkpointable):
            v.fail(f"{jid}: preempted, but it is not checkpointable at {checkpointable}")
        # every resume re-runs resume_s on the job's GPUs; a preempted segment keeps whole
        # checkpoint periods of its work and holds its GPUs stop_s after the signal
        kept = 0.0
        for idx, r in enumerate(rows[:-1]):
            start, end = float(r["start_s"]), float(r["end_s"])
            resume = resume_s if idx else 0.0
            kept += _kept(end - stop_s - start - resume, checkpoint_every_s)
        last = rows[-1]
        last_work = (
            float(last["end_s"]) - float(last["start_s"]) - (resume_s if len(rows) > 1 else 0.0)
        )
        owed = dur - kept
        if abs(last_work - owed) > 1e-6 * max(1.0, dur) + 1e-6 * len(rows):
            v.fail(
                f"{jid}: its last segment did {last_work}s of work, not the {owed}s left "
                f"after {len(rows) - 1} preemption(s)"
            )
        queue.append(prev_end - submit - ran)
        jct.append(prev_end - submit)
        busy += gpus * dur
        ideal += gpus * dur * per_gpu_floor.get(model, math.inf) / 3600.0
        first_submit = min(first_submit, submit)
        last_end = max(last_end, prev_end)
    for jid, j in jobs.items():
        if jid not in seen and int(j["gpus"]) <= max_gpus:
            v.fail(f"{jid}: never ran")
    for iid, evs in per_inst.items():
        cap = int(types[insts[iid]["instance_type"]]["gpus"])
        evs.sort(key=lambda e: (e[0], e[1]))
        level = 0
        for t_, d in evs:
            level += d
            if level > cap:
                v.fail(f"{iid}: {level} GPUs in use at t={t_} > its {cap}")
                break

    n = len(queue)
    qs = sorted(queue)
    v.figures = {
        "jobs": float(n),
        "total_cost_usd": total_usd,
        "ideal_cost_usd": ideal,
        "cost_efficiency": ideal / total_usd if total_usd > 0 else 0.0,
        "avg_jct_s": sum(jct) / n if n else 0.0,
        "avg_queue_s": sum(queue) / n if n else 0.0,
        "p95_queue_s": qs[max(0, math.ceil(0.95 * n) - 1)] if n else 0.0,
        "gpu_utilization": busy / paid_gpu_s if paid_gpu_s > 0 else 0.0,
        "makespan_s": last_end - first_submit if n else 0.0,
    }
    if claimed is not None:
        for k, mine in v.figures.items():
            theirs = claimed.get(k)
            if not isinstance(theirs, int | float):
                v.fail(f"figure {k} missing from the claimed figures")
            elif not math.isclose(float(theirs), mine, rel_tol=1e-4, abs_tol=1e-2):
                v.fail(f"figure {k}: claimed {theirs}, recomputed {mine}")
    return v


def _eligible(job_id: str, fraction: float) -> bool:
    return int(hashlib.sha256(job_id.encode()).hexdigest()[:8], 16) < fraction * 2**32


def _kept(done_s: float, every_s: float) -> float:
    done = max(0.0, done_s)
    return done if every_s <= 0 else math.floor(done / every_s + 1e-9) * every_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.sim_checker")
    p.add_argument("trace", type=Path)
    p.add_argument("schedule", type=Path)
    p.add_argument("instances", type=Path)
    p.add_argument("--prices", type=Path)
    p.add_argument("--gpu-type", default="A100")
    p.add_argument("--max-gpus", type=int, default=256)
    p.add_argument("--start-s", type=float, default=60.0)
    p.add_argument("--ebs-gb", type=float, default=500.0)
    p.add_argument("--ebs-usd-gb-month", type=float, default=0.08)
    p.add_argument("--resume-s", type=float, default=300.0)
    p.add_argument("--checkpointable", type=float, default=0.0)
    p.add_argument("--checkpoint-every", type=float, default=1800.0)
    p.add_argument("--stop-s", type=float, default=30.0)
    p.add_argument("--json", type=Path, help="figures the simulator claimed")
    a = p.parse_args(argv)
    claimed = json.loads(a.json.read_text()) if a.json else None
    v = check(
        a.trace,
        a.schedule,
        a.instances,
        prices=a.prices,
        gpu_type=a.gpu_type,
        max_gpus=a.max_gpus,
        start_s=a.start_s,
        ebs_gb=a.ebs_gb,
        ebs_usd_gb_month=a.ebs_usd_gb_month,
        resume_s=a.resume_s,
        checkpointable=a.checkpointable,
        checkpoint_every_s=a.checkpoint_every,
        stop_s=a.stop_s,
        claimed=claimed,
    )
    print(json.dumps({"ok": v.ok, "errors": v.errors, "figures": v.figures}, indent=2))
    return 0 if v.ok else 1


if __name__ == "__main__":
    sys.exit(main())
