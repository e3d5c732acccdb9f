"""Slurm's output read into dataclasses, from outputs recorded on the test cluster.

The files in slurm_recorded/ were made by its record.py on Slurm 22.05.8 (Debian 12):
jobs running with GPUs, pending on Resources, failed with exit 3, cancelled while held;
a drained node; refusals; a controller that is down. Slurm 23.02+ changed the JSON's
shapes (numbers as {"set", "infinite", "number"}, states as lists, sinfo as records per
node and partition): `_as_v0040` rewrites the recording into that shape, field by field
as documented, since no such Slurm runs here.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from provisioning.catalog import Catalog
from provisioning.slurm import JobSpec, batch_line, explain_denial, explain_refusal
from provisioning.slurm_parse import (
    expand_hostlist,
    format_duration,
    gres_type_for,
    load_json,
    node_state,
    parse_array_tasks,
    parse_gpu_gres,
    parse_indexes,
    parse_job_gpu_indexes,
    parse_jobcomp,
    parse_jobs,
    parse_nodes,
    parse_sacct,
    parse_sacct_attempts,
)

RECORDED = Path(__file__).parent / "slurm_recorded"


def _doc(name: str) -> dict[str, Any]:
    doc, errors = load_json((RECORDED / name).read_text())
    assert errors == []
    return doc


def _stderr(name: str) -> str:
    said: dict[str, str] = json.loads((RECORDED / "stderr.json").read_text())
    return said[name]


def test_jobs_of_every_state_read_from_squeue_json() -> None:
    jobs = {j.job_id: j for j in parse_jobs(_doc("squeue.json"))}
    running = jobs[1]
    assert running.name == "train | lr=0.1"  # a name with a separator is safe in JSON
    assert (running.state, running.reason, running.partition) == ("RUNNING", "", "gpu")
    assert (running.gpus, running.gpu_model, running.gpu_type) == (2, "A100", "a100")
    assert running.gpu_indexes == {"vm": (0, 1)}
    assert running.nodes == ("vm",) and running.user == "root"
    assert running.time_limit_s == 600 and running.requeue
    assert running.start_time is not None and running.end_time is not None
    assert (running.end_time - running.start_time).total_seconds() == 600
    assert running.exit_code is None and not running.finished
    assert jobs[2].partition == "short" and jobs[2].gpu_indexes == {"vm": (2, 3)}

    pending = jobs[3]
    assert (pending.state, pending.reason, pending.gpus) == ("PENDING", "Resources", 1)
    assert pending.nodes == () and pending.gpu_indexes == {}
    # Slurm's expected start: when job 2 (5 minutes) ends.
    assert pending.expected_start == jobs[2].end_time

    failed = jobs[4]
    assert (failed.state, failed.exit_code, failed.signal) == ("FAILED", 3, None)
    assert failed.reason == "NonZeroExitCode" and failed.finished and failed.gpus == 0
    cancelled = jobs[5]
    assert cancelled.state == "CANCELLED" and cancelled.finished
    assert running.expected_start is None


def test_nodes_read_from_sinfo_json_with_gpus_by_model_and_in_use() -> None:
    [node] = parse_nodes(_doc("sinfo.json"))
    assert (node.name, node.state, node.partitions) == ("vm", "mixed", ("gpu", "short"))
    assert node.gpus == {"A100": 4} and node.gpus_used == {"A100": 4}
    assert node.gres_types == {"A100": "a100"} and node.gpus_free() == 0
    assert (node.cpus, node.cpus_used, node.memory_mb) == (8, 2, 2000)

    [drained] = parse_nodes(_doc("sinfo_drained.json"))
    assert (drained.state, drained.raw_state, drained.reason) == (
        "drained",
        "MIXED+DRAIN",
        "fan broken",
    )
    assert drained.gpus_used == {"A100": 4} and drained.gpus_free() == 0
    doc = _doc("sinfo_drained.json")
    doc["nodes"][0]["gres_used"] = "gpu:a100:1(IDX:2)"
    [unused] = parse_nodes(doc)
    assert unused.gpus_used == {"A100": 1} and unused.gpus_free() == 0  # drained: none
    doc["nodes"][0]["state_flags"] = []
    [mixed] = parse_nodes(doc)
    assert mixed.state == "mixed" and mixed.gpus_free("A100") == 3


def test_a_controller_that_is_down_is_an_error_not_an_empty_cluster() -> None:
    """22.05 exits 0 here with an empty list: only `errors` tells it from an idle cluster."""
    for name in ("squeue_down.json", "sinfo_down.json"):
        _, errors = load_json((RECORDED / name).read_text())
        assert errors and "Unspecified error" in errors[0]
    assert load_json("slurm_load_jobs error: …")[1] != []


def test_gpu_indexes_from_scontrol_show_job_detail() -> None:
    text = (RECORDED / "scontrol_show_job_d.txt").read_text()
    assert parse_job_gpu_indexes(text) == {"vm": (0, 1)}
    two_nodes = (
        "   JOB_GRES=gpu:a100:4\n     Nodes=g[01-02] CPU_IDs=0-1 Mem=0 GRES=gpu:a100:2(IDX:1,3)\n"
    )
    assert parse_job_gpu_indexes(two_nodes) == {"g01": (1, 3), "g02": (1, 3)}


def test_final_states_from_the_jobcomp_file() -> None:
    text = (RECORDED / "jobcomp.txt").read_text()
    failed = parse_jobcomp(text, 4)
    assert failed is not None
    assert (failed.state, failed.exit_code, failed.signal, failed.source) == (
        "FAILED",
        3,
        None,
        "jobcomp",
    )
    assert failed.nodes == ("vm",) and failed.partition == "gpu" and failed.name == "d"
    assert failed.start_time is not None and failed.end_time is not None
    cancelled = parse_jobcomp(text, 1)
    assert cancelled is not None and cancelled.name == "train | lr=0.1"
    assert cancelled.state == "CANCELLED" and cancelled.user == "root"
    assert parse_jobcomp(text, 999) is None
    # A requeued job has a line per end: the last one is its final state.
    twice = "JobId=9 Name=x JobState=NODE_FAIL ExitCode=0:0\nJobId=9 Name=x JobState=COMPLETED ExitCode=0:0\n"
    again = parse_jobcomp(twice, 9)
    assert again is not None and again.state == "COMPLETED" and again.exit_code == 0


def test_final_state_from_sacct_with_epoch_times() -> None:
    text = "12|train|alice|gpu|CANCELLED by 0|0:15|1796402083|1796402090|g[01-02]\n"
    end = parse_sacct(text, 12)
    assert end is not None
    assert (end.state, end.exit_code, end.signal, end.user) == ("CANCELLED", None, 15, "alice")
    assert end.nodes == ("g01", "g02") and end.source == "sacct"
    assert end.end_time == datetime.fromtimestamp(1796402090, UTC)
    assert parse_sacct(text, 13) is None


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [
        ("gpu:a100:4", [(["a100"], 4, ())]),
        ("gpu:a100:4(S:0-1),tmpsize:7T", [(["a100"], 4, ())]),
        ("gpu:a100:2(IDX:0-1)", [(["a100"], 2, (0, 1))]),
        (
            "gpu:a100:3(IDX:0,2-3),gpu:v100:0(IDX:N/A)",
            [(["a100"], 3, (0, 2, 3)), (["v100"], 0, ())],
        ),
        ("gres:gpu:a100:2", [(["a100"], 2, ())]),
        ("gres/gpu:l40s=1", [(["l40s"], 1, ())]),
        ("gpu:2", [([None], 2, ())]),
        ("gpu", [([None], 1, ())]),
        ("", []),
        ("(null)", []),
    ],
)
def test_gres_strings(
    spec: str, parsed: list[tuple[list[str | None], int, tuple[int, ...]]]
) -> None:
    assert [([g.type], g.count, g.indexes) for g in parse_gpu_gres(spec)] == parsed


def test_hostlists_and_index_lists() -> None:
    assert expand_hostlist("gpu[01-03,07],login") == ("gpu01", "gpu02", "gpu03", "gpu07", "login")
    assert expand_hostlist("r[1-2]n[1-2]") == ("r1n1", "r1n2", "r2n1", "r2n2")
    assert expand_hostlist("") == () and expand_hostlist("(null)") == ()
    assert parse_indexes("0-1,3") == (0, 1, 3) and parse_indexes("N/A") == ()


def test_node_states_normalized() -> None:
    assert node_state(["IDLE"]) == "idle"
    assert node_state(["MIXED"]) == "mixed"
    assert node_state(["ALLOCATED", "COMPLETING"]) == "allocated"
    assert node_state(["IDLE", "DRAIN"]) == "drained"
    assert node_state(["IDLE", "NOT_RESPONDING"]) == "down"
    assert node_state(["DOWN", "DRAIN"]) == "down"


def test_models_follow_the_catalog() -> None:
    catalog = Catalog.load()
    doc = _doc("sinfo.json")
    doc["nodes"][0]["gres"] = "gpu:a100_80gb:2,gpu:h100:2"
    [node] = parse_nodes(doc, catalog.normalize_model)
    assert node.gpus == {"A100-80GB": 2, "H100": 2}
    assert gres_type_for("A100-80GB", [node]) == "a100_80gb"
    assert gres_type_for("h100", [node]) == "h100"
    assert gres_type_for("T4", [node]) is None


def test_durations_are_slurm_time_limits() -> None:
    assert format_duration(3 * 3600) == "0-03:00:00"
    assert format_duration(61) == "0-00:02:00"  # Slurm counts whole minutes: round up
    assert format_duration(2 * 86400 + 60) == "2-00:01:00"


def test_refusals_in_words() -> None:
    [node] = parse_nodes(_doc("sinfo.json"))
    spec = JobSpec(name="r", argv=("true",), workdir="/tmp", time_limit_s=60)
    eight = explain_refusal(_stderr("eight_gpus"), _with(spec, gpus=8, gpu_type="a100"), [node])
    assert eight == "no partition has 8 A100 GPUs on one node (the most is 4)"
    in_short = explain_refusal(
        _stderr("eight_gpus"), _with(spec, gpus=8, gpu_type="A100", partition="short"), [node]
    )
    assert in_short == "partition short has 8 A100 GPUs on one node (the most is 4)"
    unknown = explain_refusal(_stderr("unknown_type"), _with(spec, gpus=1, gpu_type="h100"), [node])
    assert unknown == "the cluster has no H100 GPUs (it has: A100)"
    partition = explain_refusal(_stderr("bad_partition"), _with(spec, partition="nope"), [node])
    assert partition == "there is no partition 'nope'; the partitions are gpu, short"
    uid = explain_refusal(_stderr("uid_not_root"), _with(spec, user="alice"), [node])
    assert uid.startswith("the bot cannot submit jobs as alice: Slurm allows that only to root")
    other = explain_refusal(
        "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy\n",
        spec,
        [node],
    )
    assert other == "Slurm refused the job: Job violates accounting/QOS policy"


def test_denials_say_what_the_bot_needs() -> None:
    for case in ("timelimit_not_operator", "timelimit_not_owner", "scancel_not_owner"):
        said = explain_denial(_stderr(case))
        assert said.startswith("the bot's account is not a Slurm operator"), case
        assert "adminlevel=operator" in said
    assert (
        explain_denial(_stderr("requeue_not_requeueable")) == "Job is pending execution for job 3"
    )


def test_the_batch_script_execs_the_words_as_given() -> None:
    line = batch_line(["python", "-c", "print('hi')"], {"RUN": "a b"})
    assert line.endswith("; exec env RUN='a b' python -c 'print('\"'\"'hi'\"'\"')'")
    assert batch_line(["true"], {}).endswith("; exec true")


def _with(spec: JobSpec, **changes: Any) -> JobSpec:
    from dataclasses import replace

    return replace(spec, **changes)


# --- Slurm 23.02+ shapes ---------------------------------------------------------------


def _number(value: int) -> dict[str, Any]:
    return {"set": True, "infinite": False, "number": value}


def _as_v0040(job: dict[str, Any]) -> dict[str, Any]:
    """A 22.05 job in the data_parser v0.0.40 shape (24.x): numbers wrapped, states as
    lists, "gres/" for "gres:", and the exit code split into status, code and signal."""
    new = dict(job)
    for key in ("start_time", "end_time", "submit_time", "time_limit", "job_id", "restart_cnt"):
        new[key] = _number(job[key])
    new["job_state"] = [job["job_state"]]
    new["tres_per_node"] = job["tres_per_node"].replace("gres:", "gres/")
    status = job["exit_code"]
    new["exit_code"] = {
        "status": ["SIGNALED" if status & 0x7F else "EXITED"],
        "return_code": _number(status >> 8),
        "signal": {"id": _number(status & 0x7F), "name": ""},
    }
    return new


def test_jobs_in_the_newer_json_shape_read_the_same() -> None:
    doc = _doc("squeue.json")
    old = parse_jobs(doc)
    new = parse_jobs({"jobs": [_as_v0040(j) for j in doc["jobs"]]})
    assert new == old
    unlimited = _as_v0040(doc["jobs"][0])
    unlimited["time_limit"] = {"set": True, "infinite": True, "number": 0}
    assert parse_jobs({"jobs": [unlimited]})[0].time_limit_s is None


def test_nodes_in_the_newer_sinfo_records_read_the_same() -> None:
    """24.x `sinfo -N --json`: one record per node and partition."""
    [old] = parse_nodes(_doc("sinfo.json"))
    records = [
        {
            "partition": {"name": partition},
            "node": {"state": ["MIXED"]},
            "nodes": {"nodes": ["vm"]},
            "gres": {"total": "gpu:a100:4", "used": "gpu:a100:4(IDX:0-3)"},
            "cpus": {"total": 8, "allocated": 2},
            "memory": {"maximum": 2000, "allocated": 0},
            "reason": "",
        }
        for partition in ("gpu", "short")
    ]
    [new] = parse_nodes({"sinfo": records})
    assert new == old


def test_each_start_of_a_requeued_job_from_sacct_d() -> None:
    """`sacct -D` lists a job Slurm requeued once per start, oldest first: the earlier
    one with how it ended and on which nodes (both of a two-node job)."""
    text = (
        "7|gpubot-run-3|alice|wide|NODE_FAIL|0:0|1796402083|1796402120|vm,vm-b|gres/gpu=8\n"
        "7|gpubot-run-3|alice|wide|PENDING|0:0|Unknown|Unknown|None assigned|\n"
        "8|other|bob|wide|COMPLETED|0:0|1796402083|1796402090|vm|\n"
    )
    first, now = parse_sacct_attempts(text, 7)
    assert (first.state, first.nodes, first.gpus) == ("NODE_FAIL", ("vm", "vm-b"), 8)
    assert first.end_time == datetime.fromtimestamp(1796402120, UTC)
    assert now.state == "PENDING" and now.end_time is None
    assert parse_sacct(text, 7) == now  # the job's last record is its current one
    assert parse_sacct_attempts(text, 9) == []


def test_a_job_arrays_pending_record_and_started_tasks() -> None:
    """As squeue --json showed `sbatch --array=0-5%2` here: one record for the tasks not
    started (`0-5%2`, the throttle apart), then a record per task as each starts; the
    24.x shape wraps the numbers and leaves an unset task id unset."""
    base = _doc("squeue.json")["jobs"][0]
    pending = {
        **base,
        "job_id": 50,
        "array_job_id": 50,
        "array_task_id": None,
        "array_task_string": "2-5%2",
        "array_max_tasks": 2,
    }
    task = {**base, "job_id": 51, "array_job_id": 50, "array_task_id": 0, "array_task_string": ""}
    old = parse_jobs({"jobs": [pending, task]})
    assert (old[0].array_job_id, old[0].array_task_id, old[0].array_pending) == (
        50,
        None,
        (2, 3, 4, 5),
    )
    assert old[0].array_max_running == 2
    assert (old[1].job_id, old[1].array_job_id, old[1].array_task_id) == (51, 50, 0)
    assert old[1].array_pending == ()
    wrapped = []
    for job in (pending, task):
        new = _as_v0040(job)
        new["array_job_id"] = _number(job["array_job_id"])
        new["array_max_tasks"] = _number(job.get("array_max_tasks", 0))
        tid = job["array_task_id"]
        new["array_task_id"] = _number(tid) if tid is not None else {"set": False, "number": 0}
        wrapped.append(new)
    assert parse_jobs({"jobs": wrapped}) == old


@pytest.mark.parametrize(
    ("text", "tasks"),
    [
        ("0-5%2", (0, 1, 2, 3, 4, 5)),
        ("[2-4]", (2, 3, 4)),
        ("1,3-5", (1, 3, 4, 5)),
        ("0-9:4", (0, 4, 8)),
        ("7", (7,)),
        ("", ()),
        ("N/A", ()),
    ],
)
def test_array_index_lists(text: str, tasks: tuple[int, ...]) -> None:
    assert parse_array_tasks(text) == tasks


def test_an_array_tasks_end_from_sacct_by_its_own_id_or_as_array_task() -> None:
    """As `sacct -j 50` showed here: JobIDRaw first (a started task's own id), JobID last
    (`50_0`); the tasks cancelled before they started are the array's own record, named
    `50_[4-5%2]`, or `50` when every task left was cancelled together."""
    text = (
        "51|gpubot-sweep-7|alice|short|COMPLETED|0:0|1796402083|1796402090|vm|"
        "billing=1,cpu=1,gres/gpu=1|50_0\n"
        "50|gpubot-sweep-7|alice|short|CANCELLED by 0|0:0|None|1796402095|None assigned||"
        "50_[4-5%2]\n"
    )
    ran = parse_sacct(text, 51)
    assert ran is not None and (ran.state, ran.gpus, ran.job_id) == ("COMPLETED", 1, 51)
    assert parse_sacct(text, 50, "50_0") == ran
    never = parse_sacct(text, 50, "50_4")
    assert never is not None and (never.state, never.job_id) == ("CANCELLED", 50)
    assert parse_sacct(text, 50, "50_3") is None
    together = (
        "50|gpubot-sweep-7|alice|short|CANCELLED by 0|0:0|None|1796402095|None assigned||50\n"
    )
    found = parse_sacct(together, 50, "50_2")
    assert found is not None and found.state == "CANCELLED"


def test_array_refusals_in_words() -> None:
    spec = JobSpec(
        name="gpubot-sweep-7",
        argv=("true",),
        workdir="/tmp",
        time_limit_s=60,
        array="0-99%4",
        user="gpubot-bob",
    )
    limit = explain_refusal(
        "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy "
        "(job submit limit, user's size and/or time limits)\n",
        spec,
        [],
    )
    assert limit.startswith("its 100 jobs are more than gpubot-bob may have queued at once")
    assert "MaxSubmitJobs" in limit
    size = explain_refusal(
        "sbatch: error: Batch job submission failed: Invalid job array specification\n",
        spec,
        [],
    )
    assert size.startswith("the cluster takes job arrays of fewer tasks than 100")
