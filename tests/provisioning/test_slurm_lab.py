"""The test cluster is configured as a lab's (tests/slurm_cluster.py), proved on the real
cluster with Slurm's own tools: what the bot must live with. Memory is a consumable
with no default (a job that asks none holds the whole node), partitions have time
limits, the bot's account acts as a person only through sudo and only with Slurm's
job tools, accounts and QOS are enforced, an urgent job preempts (requeues) a running
one, and sdiag counts what a client costs the controller. Waits are guards against a
hang, never timed checks.
"""

from __future__ import annotations

import os
import pwd
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from tests.provisioning.conftest import RUN_ACCOUNT
from tests.slurm_cluster import (
    BOT_ACCOUNT,
    DEFAULT_ACCOUNT,
    GPU_TYPE,
    GRACE_S,
    HIGH_QOS,
    LAB_GROUP,
    PEOPLE,
    SHARED_ACCOUNT,
    URGENT,
    VISION_ACCOUNT,
    SlurmCluster,
)

GUARD_S = 90.0  # a preemption and a requeue take a grace and two scheduling passes
T = TypeVar("T")
ALICE, BOB = PEOPLE["alice"], PEOPLE["bob"]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the lab's accounts need root")


def until(check: Callable[[], T | None], what: str, guard_s: float = GUARD_S) -> T:
    deadline = time.monotonic() + guard_s
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {guard_s:g} s: {what}")
        time.sleep(0.1)


def sbatch(cluster: SlurmCluster, *args: str, wrap: str = "sleep 300") -> int:
    """A job of root's; its id."""
    done = cluster.command("sbatch", "--parsable", "-o", "/dev/null", *args, "--wrap", wrap)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().split(";")[0])


def as_bot(cluster: SlurmCluster, *argv: str) -> subprocess.CompletedProcess[str]:
    """`argv` run by the bot's own account (not root), as the bot runs Slurm's tools."""
    return cluster.command(
        "runuser", "-u", BOT_ACCOUNT, "--", "env", f"SLURM_CONF={cluster.conf}", *argv
    )


def as_person(cluster: SlurmCluster, person: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """What the bot's account may do as a person: sudo -n, with the sudoers lines."""
    return as_bot(cluster, "sudo", "-n", "-u", person, "--", *argv)


def job_field(cluster: SlurmCluster, job: int, fmt: str) -> str:
    return cluster.command("squeue", "-h", "-j", str(job), "-o", fmt).stdout.strip()


def state_reason(cluster: SlurmCluster, job: int) -> Callable[[], str | None]:
    return lambda: job_field(cluster, job, "%T %r") or None


def shows(cluster: SlurmCluster, job: int, *wanted: str) -> Callable[[], str | None]:
    def check() -> str | None:
        now = job_field(cluster, job, "%T %r")
        return now if now in wanted else None

    return check


def sacct_row(cluster: SlurmCluster, job: int) -> Callable[[], str | None]:
    """The job's finished accounting row (User|Account|QOS|State), once slurmdbd has it
    whole: a job that ends within a second shows QOS `Unknown` for a moment."""

    def check() -> str | None:
        out = cluster.command(
            "sacct", "-a", "-X", "-n", "-P", "-j", str(job), "-o", "JobID,User,Account,QOS,State"
        ).stdout
        for line in out.splitlines():
            cells = line.split("|")
            finished = cells[-1] not in ("PENDING", "RUNNING")
            if cells[0] == str(job) and finished and cells[3] != "Unknown":
                return "|".join(cells[1:])
        return None

    return check


def test_a_job_that_asks_no_memory_holds_the_whole_node(slurm_cluster: SlurmCluster) -> None:
    gpu = f"--gres=gpu:{GPU_TYPE}:1"
    greedy = sbatch(slurm_cluster, gpu)  # no --mem: given all 2000 MB
    until(shows(slurm_cluster, greedy, "RUNNING None"), f"job {greedy} running")
    blocked = sbatch(slurm_cluster, gpu, "--mem-per-gpu=100")
    until(shows(slurm_cluster, blocked, "PENDING Resources"), f"job {blocked} pending")
    shown = slurm_cluster.command("scontrol", "show", "job", str(greedy)).stdout
    assert re.search(r"^\s*TRES=\S*\bmem=2000M\b", shown, re.M), shown  # the node's all

    slurm_cluster.command("scancel", str(greedy))
    until(shows(slurm_cluster, blocked, "RUNNING None"), f"job {blocked} running")
    beside = sbatch(slurm_cluster, gpu, "--mem-per-gpu=100")
    until(shows(slurm_cluster, beside, "RUNNING None"), f"job {beside} beside {blocked}")


def test_partition_time_limits(slurm_cluster: SlurmCluster) -> None:
    too_long = sbatch(slurm_cluster, "--mem=100", "--time=2:00:00")  # short: 30 min at most
    until(
        shows(slurm_cluster, too_long, "PENDING PartitionTimeLimit"),
        f"job {too_long} pending for its partition's limit (accepted, never started)",
    )
    assert job_field(slurm_cluster, too_long, "%P") == "short"
    in_long = sbatch(slurm_cluster, "--mem=100", "--time=2:00:00", "-p", "long")
    until(shows(slurm_cluster, in_long, "RUNNING None"), f"job {in_long} running in long")
    quick = sbatch(slurm_cluster, "--mem=100")
    assert job_field(slurm_cluster, quick, "%l") == "10:00"  # short's DefaultTime


def test_the_bot_account_submits_as_a_person_through_sudo_and_nothing_else(
    slurm_cluster: SlurmCluster, lab_workdir: Path
) -> None:
    def submit(person: str, *args: str) -> subprocess.CompletedProcess[str]:
        return as_person(
            slurm_cluster,
            person,
            "sbatch",
            "--parsable",
            "--mem-per-gpu=100",
            f"--gres=gpu:{GPU_TYPE}:1",
            f"--chdir={lab_workdir}",
            f"--output={lab_workdir}/%j.out",
            *args,
            "--wrap",
            "id -un; id -Gn",
        )

    done = submit(ALICE, "-A", DEFAULT_ACCOUNT)
    assert done.returncode == 0, done.stderr
    job = int(done.stdout.strip())
    assert until(sacct_row(slurm_cluster, job), f"job {job} in sacct") == (
        f"{ALICE}|{DEFAULT_ACCOUNT}|normal|COMPLETED"
    )
    out = (lab_workdir / f"{job}.out").read_text().split()
    assert out[0] == ALICE and LAB_GROUP in out[1:]
    written = lab_workdir / f"{job}.out"
    assert written.stat().st_uid == pwd.getpwnam(ALICE).pw_uid
    # The bot reads accounting as itself, without sudo.
    mine = as_bot(slurm_cluster, "sacct", "-a", "-X", "-n", "-P", "-j", str(job), "-o", "User")
    assert mine.stdout.split() == [ALICE]

    # Accounts and QOS are the association's: vision is alice's only, high bob's only.
    done = submit(ALICE, "-A", VISION_ACCOUNT)
    assert done.returncode == 0, done.stderr
    refused = submit(BOB, "-A", VISION_ACCOUNT)
    assert refused.returncode != 0 and "Invalid account" in refused.stderr
    done = submit(BOB, f"--qos={HIGH_QOS}")
    assert done.returncode == 0, done.stderr
    refused = submit(ALICE, f"--qos={HIGH_QOS}")
    assert refused.returncode != 0 and "Invalid qos" in refused.stderr
    shared = submit(SHARED_ACCOUNT)
    assert shared.returncode == 0, shared.stderr

    # Only Slurm's job tools, and only as the lab's people: no shell, not root.
    shell = as_person(slurm_cluster, ALICE, "/bin/sh", "-c", "id -un")
    assert shell.returncode != 0 and "password is required" in shell.stderr
    root = as_person(slurm_cluster, "root", "sbatch", "--wrap", "true")
    assert root.returncode != 0 and "password is required" in root.stderr
    env_kept = as_person(slurm_cluster, ALICE, "scontrol", "show", "config")
    assert env_kept.returncode == 0 and str(slurm_cluster.conf) in env_kept.stdout


def test_a_unix_account_without_an_association_is_refused(
    slurm_cluster: SlurmCluster,
) -> None:
    try:
        pwd.getpwnam(RUN_ACCOUNT)
    except KeyError:
        pytest.skip(f"no account {RUN_ACCOUNT} (scripts/run_account.sh creates it)")
    refused = slurm_cluster.command(
        "runuser", "-u", RUN_ACCOUNT, "--", "sbatch", "--mem=100", "--chdir=/tmp",
        "-o", "/dev/null", "--wrap", "true",
    )  # fmt: skip
    assert refused.returncode != 0
    assert "Invalid account or account/partition combination" in refused.stderr


@pytest.mark.parametrize("signal_option", ["", "--signal=B:TERM@120"], ids=["plain", "B-TERM"])
def test_an_urgent_job_preempts_and_requeues_a_long_one(
    slurm_cluster: SlurmCluster, tmp_path: Path, signal_option: str
) -> None:
    """Without --signal the batch script hears nothing until the grace is over (only
    steps get the first SIGTERM); with --signal=B:TERM@T (preempt_send_user_signal) it
    gets SIGTERM as soon as it is selected, then again at the requeue."""
    log = tmp_path / "signals"
    traps = "; ".join(
        f"trap 'echo {sig} $(date +%s.%N) >> {log}' {sig}" for sig in ("TERM", "USR1", "CONT")
    )
    script = (
        f"echo start $(date +%s.%N) restarts=${{SLURM_RESTART_COUNT:-0}} >> {log}; "
        f"{traps}; while :; do sleep 0.1; done"
    )
    args = ["-p", "long", "--requeue", f"--gres=gpu:{GPU_TYPE}:1", "--mem=100"]
    victim = sbatch(slurm_cluster, *args, *([signal_option] if signal_option else []), wrap=script)
    until(lambda: log.exists() and "start" in log.read_text(), f"job {victim} running")
    urgent = sbatch(
        slurm_cluster, "-p", URGENT, f"--gres=gpu:{GPU_TYPE}:4", "--mem=100", wrap="sleep 300"
    )

    def preempt_time() -> int | None:
        """When Slurm selected the job (it says so only during the grace)."""
        shown = slurm_cluster.command(
            "env", "SLURM_TIME_FORMAT=%s", "scontrol", "show", "job", str(victim)
        ).stdout
        found = re.search(r"PreemptTime=(\d+)", shown)
        return int(found.group(1)) if found else None

    preempted_at = until(preempt_time, f"job {victim} selected for preemption")
    until(shows(slurm_cluster, urgent, "RUNNING None"), f"urgent job {urgent} running")
    shown = slurm_cluster.command("scontrol", "show", "job", str(victim)).stdout
    assert "Restarts=1" in shown and "Requeue=1" in shown, shown
    events = [line.split() for line in log.read_text().splitlines()]
    signals = [(name, float(at)) for name, at, *_ in events if name != "start"]
    terms = [at for name, at in signals if name == "TERM"]
    first = min(at for _, at in signals)
    print(
        f"preempted at {preempted_at}: "
        + ", ".join(f"{n} +{t - preempted_at:.2f}" for n, t in signals)
    )
    if signal_option:
        # One TERM within the grace, one at the requeue.
        assert len(terms) == 2 and terms[0] < preempted_at + GRACE_S - 1
    else:
        # Nothing reached the batch script before the grace was over.
        assert len(terms) == 1 and first >= preempted_at + GRACE_S - 1

    slurm_cluster.command("scancel", str(urgent))
    until(lambda: "restarts=1" in log.read_text(), f"job {victim} started again")
    assert job_field(slurm_cluster, victim, "%T") in ("RUNNING", "PENDING")


def test_sdiag_counts_a_clients_rpcs(slurm_cluster: SlurmCluster) -> None:
    """A bench can measure what a client costs the controller: `sdiag -r` zeroes the
    counters, each squeue is one REQUEST_JOB_INFO (and one REQUEST_PARTITION_INFO).
    rl_enable (per-user rate limiting) says nothing at this rate; Slurm 22.05 has no
    rate limiter at all (23.02 added it) and ignores the word."""
    calls = 12
    log = slurm_cluster.root / "log" / "slurmctld.log"
    before = log.stat().st_size
    assert slurm_cluster.command("sdiag", "-r").returncode == 0
    for _ in range(calls):
        done = slurm_cluster.command("runuser", "-u", ALICE, "--", "squeue", "-h")
        assert done.returncode == 0, done.stderr
    stats = slurm_cluster.command("sdiag").stdout
    counts = dict(re.findall(r"^\s*(REQUEST_\w+)\s+\(\s*\d+\)\s+count:(\d+)", stats, re.M))
    assert counts.get("REQUEST_JOB_INFO") == str(calls), stats
    assert counts.get("REQUEST_PARTITION_INFO") == str(calls), stats
    by_user = dict(re.findall(r"^\s*(\S+)\s+\(\s*\d+\)\s+count:(\d+)", stats, re.M))
    assert by_user.get(ALICE) == str(2 * calls), stats
    config = slurm_cluster.command("scontrol", "show", "config").stdout
    assert re.search(r"^SlurmctldParameters\s*=.*\brl_enable\b", config, re.M)
    with log.open("rb") as f:
        f.seek(before)
        assert b"rate limit" not in f.read().lower()
