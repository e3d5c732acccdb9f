"""Slurm: how long a job takes to run, and what reading Slurm costs the bot.

On the test cluster (tests/slurm_cluster.py: two nodes of 4 fake A100s; started here
unless a test session has it, whose lease this bench then waits for):

- submit -> RUNNING: `sbatch` of a 1-GPU job until `squeue` says RUNNING (polled every
  POLL_S), on the idle cluster; median of RUNS. Side by side, the same for a job over
  both nodes (partition wide, 4 GPUs on each). The bot's reserve -> granted adds its
  own poll cadence on top; the goal for that is < 3 s, most of it Slurm's.
- a sweep of 100 one-GPU runs as one job array (`--array=0-99%8`, what the bot submits)
  beside 100 separate `sbatch` calls: submission time, first task RUNNING, 8 RUNNING.
- one `jobs()` (one `squeue --json` and its parsing) with the cluster's own few jobs,
  and the same call's command alone.

The bot's own figures (bot.providers.slurm):
- reserve -> granted on the idle test cluster: `/gpu reserve 1 a100` until its reply
  says "Reserved" (the holding job runs); median of RUNS. Goal < 3 s.
- `/gpu status` with 50 nodes (8 A100s each) and 1,000 jobs in squeue, 200 of them
  others' running jobs: p99 over STATUSES calls (goal < 100 ms), and how many times
  Slurm was read meanwhile (the cluster is read at most once per cache period).

Without the cluster (no root, no Slurm), for the status bench:
- parsing a synthetic `squeue --json` of 1,000 jobs and `sinfo --json` of 50 nodes
  (8 A100s each), built from the recorded 22.05 output (tests/provisioning/
  slurm_recorded/) so every field is Slurm's own; median and p99 of PARSES.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from provisioning.slurm import JobSpec, SlurmClient
from provisioning.slurm_parse import load_json, parse_jobs, parse_nodes
from tests.slurm_cluster import GPUS, WIDE, SlurmClusterUnavailable, running_cluster

RUNS = 10
POLL_S = 0.02
PARSES = 30
GOAL_S = 3.0
GUARD_S = 60.0
RECORDED = Path(__file__).resolve().parent.parent / "tests" / "provisioning" / "slurm_recorded"


def synthetic_squeue(jobs: int = 1000, nodes: int = 50) -> str:
    """`squeue --json` of a busy cluster: each node's 8 GPUs held by 4 running jobs, the
    rest pending (Resources, Priority), as 22.05 prints them."""
    recorded = json.loads((RECORDED / "squeue.json").read_text())
    by_state = {j["job_state"]: j for j in recorded["jobs"]}
    out = []
    for i in range(jobs):
        running = i < nodes * 4
        job = copy.deepcopy(by_state["RUNNING" if running else "PENDING"])
        job.update(job_id=1000 + i, name=f"gpubot-run-{i}", user_name=f"user{i % 40}")
        if running:
            node, slot = divmod(i, 4)
            job["nodes"] = f"gpu{node:02d}"
            job["gres_detail"] = [f"gpu:a100:2(IDX:{2 * slot}-{2 * slot + 1})"]
            job["tres_per_node"] = "gres:gpu:a100:2"
        else:
            job["state_reason"] = "Resources" if i % 2 else "Priority"
        out.append(job)
    return json.dumps({"meta": recorded["meta"], "errors": [], "jobs": out})


def synthetic_sinfo(nodes: int = 50) -> str:
    recorded = json.loads((RECORDED / "sinfo.json").read_text())
    template = recorded["nodes"][0]
    out = []
    for n in range(nodes):
        node = copy.deepcopy(template)
        node.update(
            name=f"gpu{n:02d}",
            hostname=f"gpu{n:02d}",
            state="allocated",
            gres="gpu:a100:8(S:0-1)",
            gres_used="gpu:a100:8(IDX:0-7)",
        )
        out.append(node)
    return json.dumps({"meta": recorded["meta"], "errors": [], "nodes": out})


def _timed(fn: Any, times: int) -> dict[str, float]:
    took = []
    for _ in range(times):
        t0 = time.perf_counter()
        fn()
        took.append(time.perf_counter() - t0)
    took.sort()
    return {
        "median_ms": round(statistics.median(took) * 1000, 2),
        "p99_ms": round(took[min(len(took) - 1, int(len(took) * 0.99))] * 1000, 2),
    }


def _parsing() -> dict[str, object]:
    jobs_text, nodes_text = synthetic_squeue(), synthetic_sinfo()
    jobs = parse_jobs(load_json(jobs_text)[0])
    nodes = parse_nodes(load_json(nodes_text)[0])
    assert len(jobs) == 1000 and len(nodes) == 50 and nodes[0].gpus == {"A100": 8}
    return {
        "squeue_1000_jobs": {
            "bytes": len(jobs_text),
            **_timed(lambda: parse_jobs(load_json(jobs_text)[0]), PARSES),
        },
        "sinfo_50_nodes": {
            "bytes": len(nodes_text),
            **_timed(lambda: parse_nodes(load_json(nodes_text)[0]), PARSES),
        },
    }


def _on_cluster() -> dict[str, object]:
    with running_cluster() as cluster, cluster.lease():
        slurm = SlurmClient(conf=str(cluster.conf), timeout_s=30)
        nodes = slurm.nodes()
        gaps, submits, wide = [], [], []

        def to_running(spec: JobSpec) -> tuple[float, float]:
            t0 = time.perf_counter()
            job = slurm.submit(spec, nodes)
            sbatch = time.perf_counter() - t0
            deadline = time.monotonic() + GUARD_S
            while (found := slurm.job(job)) is None or found.state != "RUNNING":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"job {job} did not run within {GUARD_S:g} s")
                time.sleep(POLL_S)
            gap = time.perf_counter() - t0
            slurm.cancel(job)
            cluster.cancel_all()  # idle again: each run starts on an empty cluster
            return sbatch, gap

        for i in range(RUNS):
            spec = JobSpec(
                name=f"bench-{i}",
                argv=("sleep", "300"),
                workdir="/tmp",
                time_limit_s=600,
                gpus=1,
                gpu_type="A100",
                output="/dev/null",
                mem_per_gpu_mb=100,  # memory is counted: a job asking none takes the node's
            )
            sbatch, gap = to_running(spec)
            submits.append(sbatch)
            gaps.append(gap)
            # Side by side: a run over both nodes (4 GPUs on each, partition `wide`).
            both = dataclasses.replace(
                spec, name=f"bench-wide-{i}", gpus=GPUS, nodes=2, partition=WIDE
            )
            wide.append(to_running(both)[1])
        array = _array_side_by_side(slurm, cluster, nodes, spec)
        # The cluster's own jobs for the read: 2 running, 2 pending.
        for i in range(4):
            slurm.submit(
                JobSpec(
                    f"load-{i}",
                    ("sleep", "300"),
                    "/tmp",
                    600,
                    gpus=2,
                    output="/dev/null",
                    mem_per_gpu_mb=100,
                ),
                nodes,
            )
        count = len(slurm.jobs())
        argv = ["squeue", "--all", "--states=all", "--json"]
        return {
            "submit_to_running": {
                "median_s": round(statistics.median(gaps), 3),
                "max_s": round(max(gaps), 3),
                "runs": [round(g, 3) for g in gaps],
                "sbatch_median_s": round(statistics.median(submits), 3),
            },
            "submit_to_running_two_nodes": {
                "median_s": round(statistics.median(wide), 3),
                "max_s": round(max(wide), 3),
                "runs": [round(g, 3) for g in wide],
                "what": f"--nodes=2 --ntasks-per-node=1, {GPUS} GPUs on each, partition {WIDE}",
            },
            "array_of_100": array,
            "jobs_call": {"jobs": count, **_timed(slurm.jobs, 20)},
            "squeue_command": _timed(lambda: slurm.run(argv), 20),
        }


ARRAY = 100


def _array_side_by_side(
    slurm: SlurmClient, cluster: Any, nodes: list[Any], one: JobSpec
) -> dict[str, object]:
    """A sweep of ARRAY one-GPU runs as the bot submits it on Slurm (one `sbatch
    --array=0-99%8`) beside ARRAY separate sbatch calls (what it did before): the
    submission's time, and the time until the first task and until 8 tasks (both nodes'
    GPUs, partition wide) are RUNNING; the rest wait for those. Once each, on the idle
    cluster. `one`: the one-GPU job of the submit-to-running figure."""
    spec = dataclasses.replace(one, name="bench-array", partition=WIDE)
    wanted = 2 * GPUS

    def running(ids: set[int], array: int | None) -> int:
        return sum(
            1
            for j in slurm.jobs()
            if j.state == "RUNNING" and (j.job_id in ids or (array and j.array_job_id == array))
        )

    def until(count: Any) -> tuple[float, float]:
        first = full = None
        deadline = time.monotonic() + GUARD_S
        while full is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{wanted} tasks did not run within {GUARD_S:g} s")
            n = count()
            now = time.perf_counter()
            if n >= 1 and first is None:
                first = now
            if n >= wanted:
                full = now
            time.sleep(POLL_S)
        assert first is not None
        return first, full

    out: dict[str, object] = {}
    t0 = time.perf_counter()
    array = slurm.submit(dataclasses.replace(spec, array=f"0-{ARRAY - 1}%{wanted}"), nodes)
    submitted = time.perf_counter() - t0
    first, full = until(lambda: running(set(), array))
    out["one_array"] = {
        "sbatch_calls": 1,
        "submit_s": round(submitted, 3),
        "first_running_s": round(first - t0, 3),
        f"{wanted}_running_s": round(full - t0, 3),
    }
    cluster.cancel_all()
    t0 = time.perf_counter()
    ids = {
        slurm.submit(dataclasses.replace(spec, name=f"bench-one-{i}"), nodes) for i in range(ARRAY)
    }
    submitted = time.perf_counter() - t0
    first, full = until(lambda: running(ids, None))
    out["separate_jobs"] = {
        "sbatch_calls": ARRAY,
        "submit_s": round(submitted, 3),
        "first_running_s": round(first - t0, 3),
        f"{wanted}_running_s": round(full - t0, 3),
    }
    cluster.cancel_all()
    return out


STATUSES = 300
STATUS_GOAL_MS = 100.0


class _Recorded:
    """A SlurmClient double that answers with the synthetic cluster, counting reads."""

    def __init__(self) -> None:
        self.reads = 0
        self._nodes = parse_nodes(load_json(synthetic_sinfo())[0])
        jobs = parse_jobs(load_json(synthetic_squeue())[0])
        # Others' jobs, not gpubot's: their GPUs show as held by their Slurm user.
        self._jobs = [dataclasses.replace(j, name=f"train-{j.job_id}") for j in jobs]
        self.where = "on this machine"

    def nodes(self) -> list[Any]:
        self.reads += 1
        return list(self._nodes)

    def jobs(self) -> list[Any]:
        return list(self._jobs)


def _settings(home: Path, status_cache_s: float) -> Any:
    from bot.app.config import Settings

    return Settings(home=home, status_cache_s=status_cache_s)


def _status_at_scale(status_cache_s: float) -> dict[str, object]:
    """`/gpu status` over a 50-node cluster with 1,000 jobs, read from the database; the
    cluster read through the provider's cache as the worker's upkeep reads it.
    `status_cache_s` 0: every status reads the database (no status cache)."""
    from bot.app.service import GpuService
    from bot.domain.clock import SystemClock
    from bot.domain.commands import Status
    from bot.providers import Parts
    from bot.providers.slurm import SlurmProvider
    from db.migrate import upgrade
    from db.session import make_engine
    from provisioning.local_runner import LocalRunner

    with tempfile.TemporaryDirectory(prefix="gpubot-bench-slurm-") as tmp:
        home = Path(tmp)
        engine = make_engine(f"sqlite:///{home / 'gpubot.db'}")
        upgrade(engine)
        settings = _settings(home, status_cache_s)
        client = _Recorded()
        provider = SlurmProvider(settings, {}, LocalRunner(), client=client)  # type: ignore[arg-type]
        parts = Parts(settings, engine, LocalRunner(), None, None, False)
        service = GpuService(
            engine, settings, SystemClock(), lambda core: [provider.connect(core, parts)]
        )
        actor = service.actor("alice")
        first = service.status(actor, Status()).view.text
        reads = client.reads
        took = _timed(lambda: service.status(actor, Status()), STATUSES)
        engine.dispose()
    return {
        "nodes": 50,
        "jobs": 1000,
        "first_line": first,
        "status": took,
        "slurm_reads_during": client.reads - reads,
        "statuses": STATUSES,
    }


def _reserve_to_granted() -> dict[str, object]:
    """`/gpu reserve 1 a100` on the idle test cluster until its reply says Reserved, by
    the lab's bot account as alice (submitted through sudo, granted from the file the
    holding job writes as it starts)."""
    from bench import environment
    from bot.app.config import load_settings
    from bot.domain.commands import Release, Reserve
    from bot.faces.runtime import build_runtime
    from tests.slurm_lab import as_bot_account, lab_directory, lab_env

    took = []
    with (
        running_cluster() as cluster,
        cluster.lease(),
        tempfile.TemporaryDirectory(prefix="gpubot-bench-slurm-") as tmp,
        lab_directory() as workdir,
        as_bot_account(cluster.conf),
    ):
        with environment(**lab_env(cluster.conf, workdir, Path(tmp) / "home")):
            rt = build_runtime(load_settings())
        svc = rt.service
        alice = svc.actor("alice")
        for _ in range(RUNS):
            t0 = time.perf_counter()
            text = svc.reserve(alice, Reserve(1, "A100", timedelta(minutes=20))).view.text
            took.append(time.perf_counter() - t0)
            if not text.startswith("Reserved"):
                raise RuntimeError(f"not granted at once on an idle cluster: {text}")
            svc.release(alice, Release(all=True))
            cluster.cancel_all()
        rt.engine.dispose()
    return {
        "median_s": round(statistics.median(took), 3),
        "max_s": round(max(took), 3),
        "runs": [round(t, 3) for t in took],
    }


# What the bot costs the controller, read with sdiag: its info RPCs a minute while its
# worker runs with 0, 10 and 100 of its jobs live (runs that wait: 4 run, the rest pend),
# no Slack traffic. Goal: the same at each (the shared read, not a read per job), <= 20.
LIVE = (0, 10, 100)
RPC_WINDOW_S = 60.0
RPC_GOAL_A_MINUTE = 20
INFO_RPCS = (
    "REQUEST_JOB_INFO",
    "REQUEST_JOB_INFO_SINGLE",
    "REQUEST_JOB_USER_INFO",
    "REQUEST_NODE_INFO",
    "REQUEST_NODE_INFO_SINGLE",
    "REQUEST_PARTITION_INFO",
    "REQUEST_JOB_ALLOCATION_INFO",
    "REQUEST_JOB_STEP_INFO",
    "REQUEST_RESOURCE_ALLOCATION",
)


def sdiag_counts(text: str) -> tuple[dict[str, int], dict[str, int]]:
    """`sdiag`'s RPC counts by message type and by user."""
    types: dict[str, int] = {}
    users: dict[str, int] = {}
    section = ""
    for line in text.splitlines():
        if "by message type" in line:
            section = "type"
        elif "by user" in line:
            section = "user"
        elif "Pending RPC" in line or "by ave_time" in line:
            section = ""
        m = re.match(r"\s+(\S+)\s+\(\s*\d+\)\s+count:(\d+)", line)
        if m and section:
            (types if section == "type" else users)[m.group(1)] = int(m.group(2))
    return types, users


def _rpcs_a_minute() -> dict[str, object]:
    """The bot's worker (the real one: tick, poll, dispatch, the providers' upkeep, the
    utilization sample) as the lab's bot account, GPUBOT_SLURM_CACHE_S at its default."""
    from bench import environment
    from bot.app.config import load_settings
    from bot.domain.commands import Run
    from bot.faces.runtime import build_runtime
    from bot.faces.worker import Worker
    from tests.slurm_lab import as_bot_account, lab_directory, lab_env

    levels: dict[str, object] = {}
    with running_cluster() as cluster, cluster.lease():
        for live in LIVE:
            cluster.cancel_all()
            with (
                tempfile.TemporaryDirectory(prefix="gpubot-bench-slurm-") as tmp,
                lab_directory() as workdir,
                as_bot_account(cluster.conf),
                environment(**lab_env(cluster.conf, workdir, Path(tmp) / "home")),
            ):
                rt = build_runtime(load_settings())
                runs = rt.service.runs
                assert runs is not None
                for i in range(live):
                    who = rt.service.actor("alice" if i % 2 else "bob")
                    runs.submit(
                        who,
                        Run(
                            command=("sleep", "900"),
                            model="A100",
                            max_duration=timedelta(minutes=20),
                        ),
                    )
                deadline = time.monotonic() + 600
                while runs.dispatch() or _unsubmitted(rt):
                    if time.monotonic() > deadline:
                        raise RuntimeError("the bench's runs were not all handed to Slurm")
                    time.sleep(0.2)
                worker = Worker(rt.service, None, rt.settings.tick_seconds)
                worker.start()
                try:
                    time.sleep(5)  # past the submissions' own reads
                    cluster.command("sdiag", "-r")
                    time.sleep(RPC_WINDOW_S)
                    types, users = sdiag_counts(cluster.command("sdiag").stdout)
                finally:
                    worker.stop()
                    rt.engine.dispose()
            scale = 60.0 / RPC_WINDOW_S
            info = {k: round(v * scale, 1) for k, v in types.items() if k in INFO_RPCS}
            levels[str(live)] = {
                "info_rpcs_a_minute": round(sum(info.values()), 1),
                "by_type": info,
                "all_rpcs_a_minute_by_user": {k: round(v * scale, 1) for k, v in users.items()},
            }
        log = (cluster.root / "log" / "slurmctld.log").read_text(errors="replace")
    limited = [ln for ln in log.splitlines() if "rate limit" in ln.lower()]
    return {
        "window_s": RPC_WINDOW_S,
        "goal_a_minute": RPC_GOAL_A_MINUTE,
        "levels": levels,
        "rate_limit_log_lines": len(limited),
    }


def _unsubmitted(rt: Any) -> bool:
    from sqlmodel import Session, select

    from db.models import TrainingRun

    with Session(rt.engine) as s:
        return any("job" not in r.placement for r in s.exec(select(TrainingRun)))


def run() -> dict[str, object]:
    out: dict[str, object] = {"goal_s": GOAL_S, "poll_s": POLL_S, "parse": _parsing()}
    out["status_at_scale"] = _status_at_scale(1.0)
    out["status_at_scale_uncached"] = _status_at_scale(0.0)
    try:
        out["cluster"] = _on_cluster()
        out["reserve_to_granted"] = _reserve_to_granted()
        out["controller_rpcs"] = _rpcs_a_minute()
    except SlurmClusterUnavailable as exc:
        out["cluster"] = {"skipped": str(exc)}
    return out


def headline(figures: dict[str, object]) -> list[str]:
    lines = []
    cluster = figures.get("cluster")
    if isinstance(cluster, dict) and "submit_to_running" in cluster:
        s, j = cluster["submit_to_running"], cluster["jobs_call"]
        lines.append(
            f"submit -> RUNNING median {s['median_s']} s, max {s['max_s']} s "
            f"(goal for reserve -> granted < {GOAL_S:g} s); jobs() with {j['jobs']} jobs "
            f"median {j['median_ms']} ms"
        )
        if "submit_to_running_two_nodes" in cluster:
            w = cluster["submit_to_running_two_nodes"]
            lines.append(
                f"two-node job submit -> RUNNING median {w['median_s']} s, max {w['max_s']} s"
            )
        if "array_of_100" in cluster:
            one, apart = (
                cluster["array_of_100"]["one_array"],
                cluster["array_of_100"]["separate_jobs"],
            )
            lines.append(
                f"sweep of {ARRAY}: one array submitted in {one['submit_s']} s, first task "
                f"RUNNING at {one['first_running_s']} s; {ARRAY} sbatch calls took "
                f"{apart['submit_s']} s, first RUNNING at {apart['first_running_s']} s"
            )
    elif isinstance(cluster, dict):
        lines.append(f"cluster: skipped: {cluster.get('skipped')}")
    parse = figures.get("parse")
    if isinstance(parse, dict):
        q, n = parse["squeue_1000_jobs"], parse["sinfo_50_nodes"]
        lines.append(
            f"parse squeue of 1,000 jobs median {q['median_ms']} ms (p99 {q['p99_ms']}), "
            f"sinfo of 50 nodes median {n['median_ms']} ms (p99 {n['p99_ms']})"
        )
    granted = figures.get("reserve_to_granted")
    if isinstance(granted, dict):
        lines.append(
            f"/gpu reserve -> granted median {granted['median_s']} s, max {granted['max_s']} s "
            f"(goal < {GOAL_S:g} s)"
        )
    rpcs = figures.get("controller_rpcs")
    if isinstance(rpcs, dict):
        levels = rpcs["levels"]
        assert isinstance(levels, dict)
        said = ", ".join(f"{n} live: {v['info_rpcs_a_minute']}" for n, v in levels.items())
        lines.append(
            f"slurmctld info RPCs a minute from the bot's worker ({said}; goal constant and "
            f"<= {rpcs['goal_a_minute']}); rate-limit lines in slurmctld.log: "
            f"{rpcs['rate_limit_log_lines']}"
        )
    for key, how in (("status_at_scale", "cached 1 s"), ("status_at_scale_uncached", "no cache")):
        scale = figures.get(key)
        if isinstance(scale, dict):
            st = scale["status"]
            assert isinstance(st, dict)
            lines.append(
                f"/gpu status ({how}), 50 nodes and 1,000 jobs: median {st['median_ms']} ms, "
                f"p99 {st['p99_ms']} ms (goal < {STATUS_GOAL_MS:g}); Slurm read "
                f"{scale['slurm_reads_during']} times in {scale['statuses']} statuses"
            )
    return lines
