"""A seeded synthetic trace of a small team's GPU jobs, for the bench and the tests.

Why: the dev trace is a large cluster's load (hundreds of GPUs busy); a team that shares
two 8-GPU instances sees something else, and its own history is not public. This draws
one from published shapes of such workloads: run times log-normal with a median of about
5 minutes and a 90th percentile of about 75 minutes (the short-job-dominated clusters of
the Philly and Helios studies: most jobs are debugging runs and sweeps that end within
minutes, a few train for a day); mostly one GPU; jobs arrive in the working day, with a
few sweeps a day in which one person submits tens to hundreds of jobs within minutes.

It is a generator, not a fit: every number is a parameter with the stated default, the
same seed gives the same trace byte for byte, and nothing reads a real trace.
"""

from __future__ import annotations

import csv
import io
import math
import random
from dataclasses import dataclass

HEADER = ("job_id", "user", "submit_time", "duration_s", "gpus", "gpu_type")

# ln(p90 / median) = z90 * sigma for a log-normal
_Z90 = 1.2815515655446004


@dataclass(frozen=True)
class TeamShape:
    """The published shape the generator draws from (see the module docstring)."""

    days: int = 7
    users: int = 6
    jobs_per_day: int = 250  # background and sweeps together, on average
    sweeps_per_day: float = 2.0  # bursts of one user's jobs within minutes
    sweep_jobs: tuple[int, int] = (30, 150)  # jobs in one sweep, uniform
    sweep_spread_s: float = 600.0  # a sweep's submissions spread over this
    median_s: float = 300.0
    p90_s: float = 4500.0
    max_s: float = 3 * 86400.0  # run times are capped (a time limit)
    min_s: float = 10.0
    gpu_mix: tuple[tuple[int, float], ...] = ((1, 0.85), (2, 0.07), (4, 0.05), (8, 0.03))
    day_start_h: float = 8.0  # the working day, when people submit
    day_end_h: float = 20.0


# Held-out shapes: clusters unlike the small team, to check a scheduler change on loads it
# was not tuned on. Both are parameter choices inside what the public studies describe,
# not fits, and are named here so that the bench and a reader build the same trace.
#
# A large-job cluster, after Philly (Jeon et al., "Analysis of Large-Scale Multi-Tenant
# GPU Clusters for DNN Training Workloads", USENIX ATC'19): runs last from minutes to
# days, and multi-GPU jobs are a minority of jobs but most of the GPU time (in the 48 h
# window of ../shared/traces/README.md: 10.7 % of jobs, 53.6 % of GPU-hours; p90 run time
# 78 h). Here: median 40 min, p90 12 h, a third of the jobs on 2-8 GPUs, a dozen users,
# few sweeps; with --max-gpus 64 (eight 8-GPU instances) the quota is often full.
LARGE_JOBS = TeamShape(
    days=14,
    users=12,
    jobs_per_day=70,
    sweeps_per_day=0.5,
    sweep_jobs=(5, 20),
    median_s=2400.0,
    p90_s=43200.0,
    gpu_mix=((1, 0.6), (2, 0.1), (4, 0.15), (8, 0.15)),
)
# A short-job cluster, after Helios (Hu et al., "Characterization and Prediction of Deep
# Learning Workloads in Large-Scale GPU Datacenters", SC'21) and Alibaba PAI (Weng et
# al., "MLaaS in the Wild", NSDI'22): most jobs are short one-GPU debugging runs and
# hyper-parameter sweeps that end within minutes, submitted in bursts. Here: median 90 s,
# p90 20 min, 92 % one GPU, four sweeps a day of up to 300 jobs; --max-gpus 16.
SHORT_JOBS = TeamShape(
    users=8,
    jobs_per_day=800,
    sweeps_per_day=4.0,
    sweep_jobs=(50, 300),
    median_s=90.0,
    p90_s=1200.0,
    max_s=86400.0,
    gpu_mix=((1, 0.92), (2, 0.05), (4, 0.02), (8, 0.01)),
)


def small_team_trace(seed: int = 0, shape: TeamShape | None = None) -> str:
    """The trace as CSV text (the simulator's format); equal seeds give equal text."""
    sh = shape or TeamShape()
    rng = random.Random(seed)
    sigma = math.log(sh.p90_s / sh.median_s) / _Z90
    mu = math.log(sh.median_s)
    users = [f"t{i + 1}" for i in range(sh.users)]
    # some people submit more than others (a Zipf-like split of the background)
    weights = [1.0 / (i + 1) for i in range(sh.users)]
    sizes = [g for g, _ in sh.gpu_mix]
    probs = [p for _, p in sh.gpu_mix]

    def duration() -> float:
        d = math.exp(rng.gauss(mu, sigma))
        return float(round(min(sh.max_s, max(sh.min_s, d))))

    rows: list[tuple[float, str, float, int]] = []  # submit, user, duration, gpus
    day_s = 86400.0
    for day in range(sh.days):
        t0 = day * day_s + sh.day_start_h * 3600.0
        span = (sh.day_end_h - sh.day_start_h) * 3600.0
        n_sweeps = _poisson(rng, sh.sweeps_per_day)
        swept = 0
        for _ in range(n_sweeps):
            who = rng.choice(users)
            n = rng.randint(*sh.sweep_jobs)
            at = t0 + rng.random() * span
            g = rng.choices(sizes, probs)[0] if rng.random() < 0.2 else 1
            for _k in range(n):
                rows.append((at + rng.random() * sh.sweep_spread_s, who, duration(), g))
            swept += n
        background = max(0, _poisson(rng, sh.jobs_per_day) - swept)
        for _ in range(background):
            who = rng.choices(users, weights)[0]
            at = t0 + rng.random() * span
            rows.append((at, who, duration(), rng.choices(sizes, probs)[0]))
    rows.sort()
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(HEADER)
    for i, (at, who, dur, g) in enumerate(rows):
        w.writerow([f"team-{seed}-{i:06d}", who, f"{at:.1f}", f"{dur:.1f}", g, ""])
    return out.getvalue()


def _poisson(rng: random.Random, lam: float) -> int:
    """Knuth's method for small means, a rounded normal for large ones."""
    if lam <= 0:
        return 0
    if lam > 50:
        return max(0, round(rng.gauss(lam, math.sqrt(lam))))
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1
