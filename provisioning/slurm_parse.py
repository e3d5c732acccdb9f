"""Slurm's output as plain dataclasses: pure functions, no commands run here.

`provisioning.slurm` runs the commands; this module reads what they print, in both
JSON shapes Slurm has had: 22.05's (plain numbers and strings; what the test cluster
runs, recorded in tests/provisioning/slurm_recorded/) and 23.02+'s (`{"set",
"infinite", "number"}` numbers, state lists, `sinfo` records per node and partition).
Model names follow the catalog's ("A100"), from Slurm's gres types ("a100").
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

from provisioning.hosts import model_from_device_name

NODE_STATES = ("idle", "mixed", "allocated", "drained", "down")
# A job in one of these has ended; Slurm forgets it MinJobAge (default 300 s) later.
FINISHED_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL"}
    | {"DEADLINE", "OUT_OF_MEMORY", "SPECIAL_EXIT", "REVOKED"}
)
_INFINITE = (0xFFFFFFFF, 0xFFFFFFFE)  # Slurm's INFINITE and NO_VAL in 22.05 numbers


@dataclass(frozen=True)
class SlurmNode:
    name: str
    # One of NODE_STATES; `raw_state` keeps Slurm's words ("MIXED+DRAIN").
    state: str
    raw_state: str
    reason: str
    partitions: tuple[str, ...]
    # Normalized model ("A100") → GPUs on the node, and how many jobs hold now.
    gpus: Mapping[str, int] = field(default_factory=dict)
    gpus_used: Mapping[str, int] = field(default_factory=dict)
    # Normalized model → Slurm's gres type ("a100"), what `--gres` must be given.
    gres_types: Mapping[str, str] = field(default_factory=dict)
    cpus: int = 0
    cpus_used: int = 0
    memory_mb: int = 0
    memory_used_mb: int = 0

    @property
    def gpu_count(self) -> int:
        return sum(self.gpus.values())

    def gpus_free(self, model: str | None = None) -> int:
        """GPUs a new job could get here now (none on a drained or down node)."""
        if self.state in ("drained", "down"):
            return 0
        models = [model] if model is not None else list(self.gpus)
        return sum(max(0, self.gpus.get(m, 0) - self.gpus_used.get(m, 0)) for m in models)


@dataclass(frozen=True)
class SlurmJob:
    job_id: int
    name: str
    user: str
    # Slurm's base state in capitals: PENDING, RUNNING, COMPLETING, COMPLETED, …
    state: str
    # Why it pends or ended ("Resources", "Priority", "NonZeroExitCode"); "" for none.
    reason: str
    partition: str
    nodes: tuple[str, ...]
    gpus: int = 0  # over the whole job
    gpu_model: str | None = None  # normalized ("A100"); None when untyped or no GPUs
    gpu_type: str | None = None  # as Slurm names it ("a100")
    # Node → GPU indexes held there (CUDA_VISIBLE_DEVICES on that node); running only.
    gpu_indexes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    time_limit_s: int | None = None  # None: no limit
    submit_time: datetime | None = None
    # Running or ended: when it started. Pending: Slurm's expected start, if it has one.
    start_time: datetime | None = None
    # Running: when its time limit ends it. Ended: when it ended.
    end_time: datetime | None = None
    exit_code: int | None = None  # ended only
    signal: int | None = None  # the signal that ended it, if one did
    restarts: int = 0
    requeue: bool = False
    # A task of a job array (`sbatch --array`): the array's id (the first job's) and the
    # task's index; a pending array's record stands for the tasks in `array_pending`
    # (Slurm keeps them as one until each starts and gets a job id of its own).
    array_job_id: int = 0
    array_task_id: int | None = None
    array_pending: tuple[int, ...] = ()
    array_max_running: int = 0  # the array's throttle (`%K`); 0: none

    @property
    def finished(self) -> bool:
        return self.state in FINISHED_STATES

    @property
    def expected_start(self) -> datetime | None:
        return self.start_time if self.state == "PENDING" else None


@dataclass(frozen=True)
class JobEnd:
    """A finished job's record after squeue has forgotten it (from sacct or jobcomp)."""

    job_id: int
    state: str
    exit_code: int | None
    signal: int | None
    start_time: datetime | None
    end_time: datetime | None
    name: str = ""
    user: str = ""
    partition: str = ""
    nodes: tuple[str, ...] = ()
    source: str = ""  # "sacct" or "jobcomp"
    # Who ended it where Slurm says ("CANCELLED by 1001": the uid, as text).
    by: str = ""
    gpus: int = 0  # GPUs it was allocated (sacct's AllocTRES), 0 where not known


@dataclass(frozen=True)
class SlurmPartition:
    """A partition's limits and job defaults (`scontrol show partition --oneliner`)."""

    name: str
    nodes: tuple[str, ...]
    default: bool = False
    up: bool = True
    max_time_s: int | None = None  # None: no limit
    default_time_s: int | None = None  # None: the partition's MaxTime
    def_mem_per_gpu_mb: int | None = None
    def_cpu_per_gpu: int | None = None
    allow_accounts: tuple[str, ...] = ()  # empty: all
    allow_qos: tuple[str, ...] = ()  # empty: all
    qos: str = ""  # the partition's own QOS, whose limits apply too
    priority_tier: int = 1
    preempt_mode: str = ""


@dataclass(frozen=True)
class Associations:
    """What Slurm's accounting lets one user submit under."""

    accounts: tuple[str, ...]
    default_account: str
    qos: tuple[str, ...]
    default_qos: str


# --- pure parsing --------------------------------------------------------------------


def _num(value: Any) -> int | None:
    """A number in either JSON shape; None for unset and infinite."""
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = int(value)
    return None if number in _INFINITE else number


def _when(value: Any) -> datetime | None:
    epoch = _num(value)
    return datetime.fromtimestamp(epoch, UTC) if epoch else None


def _words(value: Any) -> list[str]:
    """A state: "mixed" (22.05), ["MIXED", "DRAIN"] (23.02+)."""
    if isinstance(value, str):
        return value.upper().replace("+", " ").split()
    if isinstance(value, list):
        return [str(w).upper() for w in value if w]
    return []


def _text(value: Any) -> str:
    if isinstance(value, dict):  # 24.x: {"description": …}
        value = value.get("description", "")
    return "" if value is None else str(value)


@lru_cache(maxsize=4096)
def expand_hostlist(expr: str) -> tuple[str, ...]:
    """ "gpu[01-03,07],login" → the names, zero padding kept ("(null)" and "" → none)."""
    if not expr or expr in ("(null)", "None"):
        return ()
    names: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(expr + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            names.extend(_expand_one(expr[start:i]))
            start = i + 1
    return tuple(n for n in names if n)


def _expand_one(name: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", name)
    if m is None:
        return [name]
    head, tail = name[: m.start()], name[m.end() :]
    out: list[str] = []
    for part in m.group(1).split(","):
        lo, _, hi = part.partition("-")
        width = len(lo)
        for n in range(int(lo), int(hi or lo) + 1):
            out.extend(_expand_one(f"{head}{n:0{width}d}{tail}"))
    return out


def parse_indexes(text: str) -> tuple[int, ...]:
    """ "0-1,3" → (0, 1, 3); "N/A" → ()."""
    found: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if lo.isdigit():
            found.extend(range(int(lo), int(hi if hi.isdigit() else lo) + 1))
    return tuple(found)


@dataclass(frozen=True)
class Gres:
    type: str | None
    count: int
    indexes: tuple[int, ...] = ()


_GRES_ITEMS = re.compile(r",(?![^(]*\))")
_GPU_GRES = re.compile(r"(?:gres[:/])?gpu(?::([^:=(]+?))?(?:[:=](\d+)[KMG]?)?(?:\((.*)\))?")
_IDX = re.compile(r"IDX:([^)]*)")


@lru_cache(maxsize=4096)
def parse_gpu_gres(spec: str) -> tuple[Gres, ...]:
    """The GPU entries of a gres string: "gpu:a100:4(S:0-1),tmp:7T", "gpu:a100:2(IDX:0-1)",
    "gres:gpu:a100:2" (22.05 tres_per_node), "gres/gpu:a100=2", "gpu:2", "gpu". Cached:
    a busy cluster's squeue repeats a few strings a thousand times."""
    out: list[Gres] = []
    for item in _GRES_ITEMS.split(spec or ""):
        m = _GPU_GRES.fullmatch(item.strip())
        if m is None:
            continue
        gres_type, count, detail = m.groups()
        if gres_type is not None and gres_type.isdigit() and count is None:
            gres_type, count = None, gres_type  # "gpu:2"
        idx = _IDX.search(detail or "")
        indexes = parse_indexes(idx.group(1)) if idx else ()
        out.append(Gres(gres_type, int(count) if count is not None else 1, indexes))
    return tuple(out)


@lru_cache(maxsize=256)
def model_of(gres_type: str | None, normalize: Callable[[str], str | None] | None = None) -> str:
    """Slurm's type ("a100", "a100_80gb") as the catalog's model ("A100", "A100-80GB")."""
    if not gres_type:
        return "unknown"
    if normalize is not None and (found := normalize(gres_type)):
        return found
    return model_from_device_name(gres_type).upper()


def node_state(words: Sequence[str]) -> str:
    """Slurm's base state and flags → one of NODE_STATES."""
    flags = set(words)
    if flags & {"DOWN", "NOT_RESPONDING", "FAIL", "FAILING", "NO_RESPOND", "UNKNOWN", "FUTURE"}:
        return "down"
    if flags & {"DRAIN", "DRAINED", "DRAINING", "MAINTENANCE", "MAINT", "INVALID", "INVAL"}:
        return "drained"
    if flags & {"ALLOCATED", "ALLOC"}:
        return "allocated"
    if "MIXED" in flags:
        return "mixed"
    return "idle"


def _gpu_totals(
    spec: str, normalize: Callable[[str], str | None] | None
) -> tuple[dict[str, int], dict[str, str]]:
    counts: dict[str, int] = {}
    types: dict[str, str] = {}
    for g in parse_gpu_gres(spec):
        model = model_of(g.type, normalize)
        counts[model] = counts.get(model, 0) + g.count
        if g.type:
            types[model] = g.type
    return counts, types


def load_json(text: str) -> tuple[dict[str, Any], list[str]]:
    """A `--json` document and its errors. Check them: with the controller down, 22.05's
    squeue and sinfo exit 0 with `"errors": [...]` and an empty list, which read as an
    empty cluster (every job gone) by anyone who looks only at the list."""
    try:
        doc = json.loads(text)
    except ValueError:
        return {}, [f"not JSON: {text.strip()[:200]!r}"]
    if not isinstance(doc, dict):
        return {}, [f"not a JSON object: {text.strip()[:200]!r}"]
    errors = []
    for e in doc.get("errors") or []:
        if isinstance(e, dict):
            words = [str(e[k]) for k in ("description", "error") if e.get(k)]
            errors.append(": ".join(words) or "unspecified error")
        else:
            errors.append(str(e))
    return doc, errors


def parse_nodes(
    doc: Mapping[str, Any], normalize: Callable[[str], str | None] | None = None
) -> list[SlurmNode]:
    """`sinfo -N --json`: 22.05's list of nodes, or 23.02+'s node×partition records."""
    merged: dict[str, dict[str, Any]] = {}
    for n in doc.get("nodes") or []:
        flags = _words(n.get("state")) + _words(n.get("state_flags"))
        merged[n["name"]] = {
            "words": flags,
            "reason": _text(n.get("reason")),
            "partitions": list(n.get("partitions") or []),
            "gres": n.get("gres") or "",
            "gres_used": n.get("gres_used") or "",
            "cpus": _num(n.get("cpus")) or 0,
            "cpus_used": _num(n.get("alloc_cpus")) or 0,
            "memory": _num(n.get("real_memory")) or 0,
            "memory_used": _num(n.get("alloc_memory")) or 0,
        }
    for r in doc.get("sinfo") or []:
        partition = (r.get("partition") or {}).get("name", "")
        for name in (r.get("nodes") or {}).get("nodes") or []:
            entry = merged.setdefault(
                name,
                {
                    "words": _words((r.get("node") or {}).get("state")),
                    "reason": _text(r.get("reason")),
                    "partitions": [],
                    "gres": (r.get("gres") or {}).get("total", ""),
                    "gres_used": (r.get("gres") or {}).get("used", ""),
                    "cpus": _num((r.get("cpus") or {}).get("total")) or 0,
                    "cpus_used": _num((r.get("cpus") or {}).get("allocated")) or 0,
                    "memory": _num((r.get("memory") or {}).get("maximum")) or 0,
                    "memory_used": _num((r.get("memory") or {}).get("allocated")) or 0,
                },
            )
            if partition and partition not in entry["partitions"]:
                entry["partitions"].append(partition)
    nodes = []
    for name, e in merged.items():
        gpus, types = _gpu_totals(e["gres"], normalize)
        used, _ = _gpu_totals(e["gres_used"], normalize)
        nodes.append(
            SlurmNode(
                name=name,
                state=node_state(e["words"]),
                raw_state="+".join(e["words"]),
                reason=e["reason"],
                partitions=tuple(e["partitions"]),
                gpus=gpus,
                gpus_used={m: c for m, c in used.items() if m in gpus},
                gres_types=types,
                cpus=e["cpus"],
                cpus_used=e["cpus_used"],
                memory_mb=e["memory"],
                memory_used_mb=e["memory_used"],
            )
        )
    return sorted(nodes, key=lambda n: n.name)


def _exit_status(value: Any) -> tuple[int | None, int | None]:
    """(exit code, signal): 22.05 gives the raw wait status (768 = exit 3, 15 = SIGTERM)."""
    if isinstance(value, dict):  # 23.02+: {"return_code": …, "signal": {"id": …}}
        signal = _num((value.get("signal") or {}).get("id"))
        return _num(value.get("return_code")), signal or None
    status = _num(value)
    if status is None:
        return None, None
    if status & 0x7F:
        return None, status & 0x7F
    return status >> 8, None


def _job_gpus(j: Mapping[str, Any], node_count: int) -> tuple[int, str | None]:
    """GPUs asked for over the whole job, and their type."""
    for key, times in (
        ("tres_per_job", 1),
        ("tres_per_node", node_count),
        ("tres_per_task", _num(j.get("tasks")) or 1),
    ):
        found = parse_gpu_gres(_text(j.get(key)))
        if found:
            return sum(g.count for g in found) * max(1, times), found[0].type
    for key in ("tres_alloc_str", "tres_req_str"):  # "…,gres/gpu=2,gres/gpu:a100=2"
        typed = re.findall(r"gres/gpu:([^=,]+)=(\d+)", _text(j.get(key)))
        total = re.search(r"gres/gpu=(\d+)", _text(j.get(key)))
        if total:
            return int(total.group(1)), typed[0][0] if typed else None
    return 0, None


def job_from_json(
    j: Mapping[str, Any], normalize: Callable[[str], str | None] | None = None
) -> SlurmJob:
    words = _words(j.get("job_state"))
    state = words[0] if words else "UNKNOWN"
    nodes = expand_hostlist(_text(j.get("nodes")))
    gpus, gpu_type = _job_gpus(j, max(1, len(nodes), _num(j.get("node_count")) or 0))
    indexes: dict[str, tuple[int, ...]] = {}
    if state in ("RUNNING", "COMPLETING", "SUSPENDED"):
        for node, detail in zip(nodes, j.get("gres_detail") or [], strict=False):
            indexes[node] = tuple(i for g in parse_gpu_gres(detail) for i in g.indexes)
    code, signal = _exit_status(j.get("exit_code"))
    finished = state in FINISHED_STATES
    limit = _num(j.get("time_limit"))
    reason = _text(j.get("state_reason"))
    return SlurmJob(
        job_id=int(_num(j.get("job_id")) or 0),
        name=_text(j.get("name")),
        user=_text(j.get("user_name")) or str(_num(j.get("user_id"))),
        state=state,
        reason="" if reason == "None" else reason,
        partition=_text(j.get("partition")),
        nodes=nodes,
        gpus=gpus,
        gpu_model=model_of(gpu_type, normalize) if gpus else None,
        gpu_type=gpu_type,
        gpu_indexes=indexes,
        time_limit_s=limit * 60 if limit is not None else None,
        submit_time=_when(j.get("submit_time")),
        start_time=_when(j.get("start_time")),
        end_time=_when(j.get("end_time")),
        exit_code=code if finished else None,
        signal=signal if finished else None,
        restarts=_num(j.get("restart_cnt")) or 0,
        requeue=bool(j.get("requeue")),
        array_job_id=_num(j.get("array_job_id")) or 0,
        array_task_id=_num(j.get("array_task_id")),
        array_pending=parse_array_tasks(_text(j.get("array_task_string"))),
        array_max_running=_num(j.get("array_max_tasks")) or 0,
    )


def parse_array_tasks(text: str) -> tuple[int, ...]:
    """`0-5%2`, `[2-5]`, `1,3-9:2` (Slurm's array index lists, throttle and step) →
    the indexes."""
    body = text.strip().strip("[]").partition("%")[0]
    found: list[int] = []
    for part in body.split(","):
        span, _, step = part.strip().partition(":")
        first, _, last = span.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            continue
        stride = int(step) if step.isdigit() and int(step) > 0 else 1
        found.extend(range(int(first), int(last or first) + 1, stride))
    return tuple(found)


def parse_jobs(
    doc: Mapping[str, Any], normalize: Callable[[str], str | None] | None = None
) -> list[SlurmJob]:
    """`squeue --json`, both shapes: an array's started tasks each a job (with their
    array id and index), its pending ones one record; heterogeneous jobs are plain jobs."""
    return [job_from_json(j, normalize) for j in doc.get("jobs") or []]


def parse_job_gpu_indexes(text: str) -> dict[str, tuple[int, ...]]:
    """`scontrol show job -d N`: "Nodes=gpu[1-2] CPU_IDs=0-3 Mem=0 GRES=gpu:a100:2(IDX:0-1)"."""
    found: dict[str, tuple[int, ...]] = {}
    for m in re.finditer(r"^\s*Nodes=(\S+) .*?GRES=(\S*)", text, re.MULTILINE):
        held = tuple(i for g in parse_gpu_gres(m.group(2)) for i in g.indexes)
        for node in expand_hostlist(m.group(1)):
            found[node] = held
    return found


# The keys of a jobcomp/filetxt line, in order: a value (a job name) may hold spaces.
_JOBCOMP_KEYS = (
    "JobId|UserId|GroupId|Name|JobState|Partition|TimeLimit|StartTime|EndTime|NodeList|"
    "NodeCnt|ProcCnt|WorkDir|ReservationName|Tres|Account|QOS|WcKey|Cluster|SubmitTime|"
    "EligibleTime|ArrayJobId|ArrayTaskId|DerivedExitCode|ExitCode"
)
_JOBCOMP_SPLIT = re.compile(rf" (?=(?:{_JOBCOMP_KEYS})=)")


def _local_time(text: str) -> datetime | None:
    """Slurm's "2026-12-04T16:24:08", in the controller's zone (taken as this machine's)."""
    if not text or text in ("Unknown", "None", "N/A"):
        return None
    if text.isdigit():
        return datetime.fromtimestamp(int(text), UTC)
    try:
        return datetime.fromisoformat(text).astimezone(UTC)
    except ValueError:
        return None


def _code_pair(text: str) -> tuple[int | None, int | None]:
    """Slurm's "3:0" (exit code : signal)."""
    code, _, sig = text.partition(":")
    exit_code = int(code) if code.isdigit() else None
    signal = int(sig) if sig.isdigit() and int(sig) else None
    return (None if signal else exit_code), signal


def parse_jobcomp(text: str, job_id: int) -> JobEnd | None:
    """The last jobcomp/filetxt line of `job_id` (a requeued job has one per end)."""
    end: JobEnd | None = None
    for line in text.splitlines():
        fields: dict[str, str] = {}
        for part in _JOBCOMP_SPLIT.split(line.strip()):
            key, eq, value = part.partition("=")
            if eq:
                fields[key] = value
        if fields.get("JobId") != str(job_id):
            continue
        code, signal = _code_pair(fields.get("ExitCode", ""))
        end = JobEnd(
            job_id=job_id,
            state=fields.get("JobState", "UNKNOWN").split(" ")[0],
            exit_code=code,
            signal=signal,
            start_time=_local_time(fields.get("StartTime", "")),
            end_time=_local_time(fields.get("EndTime", "")),
            name=fields.get("Name", ""),
            user=fields.get("UserId", "").split("(")[0],
            partition=fields.get("Partition", ""),
            nodes=expand_hostlist(fields.get("NodeList", "")),
            source="jobcomp",
        )
    return end


def parse_sacct(text: str, job_id: int, ref: str | None = None) -> JobEnd | None:
    """`sacct -X -n -P -o JobIDRaw,JobName,User,Partition,State,ExitCode,Start,End,
    NodeList[,AllocTRES[,JobID]]` with SLURM_TIME_FORMAT=%s (epoch times): the job's last
    record. `ref`: an array task as JobID shows it ("123_4"), matched as well."""
    ends = parse_sacct_attempts(text, job_id, ref)
    return ends[-1] if ends else None


def _names_task(raw: str, shown: str, ref: str) -> bool:
    """Whether a record of `sacct -j ARRAY` is the task `ref` ("12_4"): the task's own
    ("12_4"), or the array's record of tasks that never started ("12_[4-5%2]"; "12"
    once all of them were cancelled together)."""
    array, _, task = ref.partition("_")
    if shown == ref:
        return True
    if raw != array:
        return False
    if shown == array:
        return True
    inside = shown.removeprefix(f"{array}_")
    return inside.startswith("[") and int(task) in parse_array_tasks(inside)


def parse_sacct_attempts(text: str, job_id: int, ref: str | None = None) -> list[JobEnd]:
    """Every record of the job, oldest first: with `sacct -D` one per start of a requeued
    job (each earlier one ended REQUEUED, PREEMPTED or NODE_FAIL, with its nodes)."""
    ends: list[JobEnd] = []
    for line in text.splitlines():
        cells = line.split("|")
        if len(cells) < 9:
            continue
        if ref is not None:
            if len(cells) < 11 or not _names_task(cells[0], cells[10], ref):
                continue
        elif cells[0] != str(job_id):
            continue
        code, signal = _code_pair(cells[5])
        state, _, by = cells[4].partition(" by ")  # "CANCELLED by 0"
        gpus = re.search(r"gres/gpu=(\d+)", cells[9]) if len(cells) > 9 else None
        end = JobEnd(
            job_id=int(cells[0]) if cells[0].isdigit() else job_id,
            state=state.split(" ")[0],
            by=by.strip(),
            gpus=int(gpus.group(1)) if gpus else 0,
            exit_code=code,
            signal=signal,
            start_time=_local_time(cells[6]),
            end_time=_local_time(cells[7]),
            name=cells[1],
            user=cells[2],
            partition=cells[3],
            nodes=expand_hostlist(cells[8]),
            source="sacct",
        )
        ends.append(end)
    return ends


def parse_time_s(text: str) -> int | None:
    """Slurm's "2-00:00:00", "1:00:00", "30:00" (MM:SS), "30" (minutes) in seconds;
    None for UNLIMITED, INFINITE, NONE and empty."""
    text = text.strip()
    if not text or text.upper() in ("UNLIMITED", "INFINITE", "NONE", "(NULL)", "N/A"):
        return None
    days, _, rest = text.rpartition("-") if "-" in text else ("", "", text)
    parts = rest.split(":")
    if not all(p.isdigit() for p in parts) or (days and not days.isdigit()):
        return None
    nums = [int(p) for p in parts]
    if len(nums) == 1:
        seconds = nums[0] * 60 if not days else nums[0] * 3600
    elif len(nums) == 2:
        seconds = nums[0] * 60 + nums[1] if not days else nums[0] * 3600 + nums[1] * 60
    else:
        seconds = nums[0] * 3600 + nums[1] * 60 + nums[2]
    return int(days or 0) * 86400 + seconds


def _mb(text: str) -> int | None:
    m = re.fullmatch(r"(\d+)([KMGT]?)", text.strip().upper())
    if m is None:
        return None
    scale = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[m.group(2)]
    return max(1, int(int(m.group(1)) * scale))


def _listed(text: str) -> tuple[str, ...]:
    if text.upper() in ("ALL", "", "(NULL)"):
        return ()
    return tuple(w for w in text.split(",") if w)


def parse_partitions(text: str) -> list[SlurmPartition]:
    """`scontrol show partition --oneliner`: one partition a line of KEY=VALUE words."""
    out = []
    for line in text.splitlines():
        fields: dict[str, str] = {}
        for word in line.split():
            key, eq, value = word.partition("=")
            if eq:
                fields[key] = value
        name = fields.get("PartitionName")
        if not name:
            continue
        # 22.05: "JobDefaults=DefMemPerGPU=100,DefCpuPerGPU=2" (or "(null)"); newer
        # versions also print DefMemPerGPU as a word of its own.
        pairs = fields.get("JobDefaults", "").split(",")
        defaults = dict(p.split("=", 1) for p in pairs if "=" in p)
        mem = fields.get("DefMemPerGPU") or defaults.get("DefMemPerGPU", "")
        cpu = fields.get("DefCpuPerGPU") or defaults.get("DefCpuPerGPU", "")
        tier = fields.get("PriorityTier", "1")
        out.append(
            SlurmPartition(
                name=name,
                nodes=expand_hostlist(fields.get("Nodes", "")),
                default=fields.get("Default", "NO").upper() == "YES",
                up=fields.get("State", "UP").upper() == "UP",
                max_time_s=parse_time_s(fields.get("MaxTime", "")),
                default_time_s=parse_time_s(fields.get("DefaultTime", "")),
                def_mem_per_gpu_mb=_mb(mem) if mem and mem.upper() != "UNLIMITED" else None,
                def_cpu_per_gpu=int(cpu) if cpu.isdigit() else None,
                allow_accounts=_listed(fields.get("AllowAccounts", "ALL")),
                allow_qos=_listed(fields.get("AllowQos", "ALL")),
                qos="" if fields.get("QoS", "N/A") in ("N/A", "(null)") else fields.get("QoS", ""),
                priority_tier=int(tier) if tier.isdigit() else 1,
                preempt_mode=fields.get("PreemptMode", ""),
            )
        )
    return out


def parse_associations(assoc: str, default: str) -> Associations:
    """`sacctmgr -n -P show assoc where users=U format=Account,Partition,QOS,DefaultQOS`
    and `sacctmgr -n -P show user U format=DefaultAccount`."""
    accounts: list[str] = []
    qos: list[str] = []
    default_qos = ""
    for line in assoc.splitlines():
        cells = line.split("|")
        if len(cells) < 4 or not cells[0]:
            continue
        if cells[0] not in accounts:
            accounts.append(cells[0])
        for q in cells[2].split(","):
            if q and q not in qos:
                qos.append(q)
        default_qos = default_qos or cells[3]
    default_account = next((ln.strip() for ln in default.splitlines() if ln.strip()), "")
    return Associations(
        accounts=tuple(accounts),
        default_account=default_account or (accounts[0] if accounts else ""),
        qos=tuple(qos),
        default_qos=default_qos or ("normal" if "normal" in qos else (qos[0] if qos else "")),
    )


def format_duration(seconds: int) -> str:
    """Slurm's D-HH:MM:SS, rounded up to whole minutes (Slurm's own granularity)."""
    minutes = max(1, -(-int(seconds) // 60))
    days, rest = divmod(minutes, 1440)
    return f"{days}-{rest // 60:02d}:{rest % 60:02d}:00"


def gres_type_for(model: str, nodes: Iterable[SlurmNode]) -> str | None:
    """The cluster's gres type for `model` ("A100" or "a100"), None when no node has it."""
    want = model.strip().lower()
    for node in nodes:
        for m, t in node.gres_types.items():
            if want in (m.lower(), t.lower()):
                return t
    return None
