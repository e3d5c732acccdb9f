"""The Slurm client against a real one-node cluster (tests/slurm_cluster.py) configured
as a lab's: four fake A100s and 2000 MB counted as a resource (a job must ask for memory,
or it holds the whole node), partitions `short` (default, 30 min at most), `long` and
`urgent`, accounting in slurmdbd with associations enforced. The jobs here are root's
(the bot as root); tests/provisioning/test_slurm_lab.py proves the lab set-up itself.
Each test has the cluster to itself and its jobs are cancelled afterwards. Waits are
guards against a hang, never timed checks.
"""

from __future__ import annotations

import os
import pwd
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest

from provisioning.slurm import JobSpec, SlurmClient, SlurmError, SlurmJob, SlurmUnavailable
from provisioning.ssh import SshClient
from tests.provisioning.conftest import RUN_ACCOUNT, target_for
from tests.slurm_cluster import (
    DEFAULT_PARTITION,
    MEMORY_MB,
    PARTITIONS,
    SHARED_ACCOUNT,
    WIDE,
    SlurmCluster,
)
from tests.ssh_hosts import SshLab

GUARD_S = 60.0
T = TypeVar("T")


def until(check: Callable[[], T | None], what: str, guard_s: float = GUARD_S) -> T:
    """Poll until `check` gives something; a hang fails after `guard_s`, saying what."""
    deadline = time.monotonic() + guard_s
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {guard_s:g} s: {what}")
        time.sleep(0.05)


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster) -> SlurmClient:
    return SlurmClient(conf=str(slurm_cluster.conf), timeout_s=30)


@pytest.fixture
def slurm_as_root(slurm_cluster: SlurmCluster) -> SlurmClient:
    """The bot as root making a job another account's with --uid/--gid (the sudo way is
    the bot's own account's: tests/provisioning/test_slurm_lab.py)."""
    if os.geteuid() != 0:
        pytest.skip("only root may submit jobs as another account")
    return SlurmClient(conf=str(slurm_cluster.conf), timeout_s=30, submit_as="uid")


# What each job asks: with memory a consumable, four of them fit the node's 2000 MB.
JOB_MB = 100


def spec(name: str, argv: tuple[str, ...] = ("sleep", "300"), **kw: object) -> JobSpec:
    values: dict[str, object] = {
        "workdir": "/tmp",
        "time_limit_s": 600,
        "output": "/dev/null",
        "memory_mb": JOB_MB,
    }
    values.update(kw)
    return JobSpec(name=name, argv=argv, **values)  # type: ignore[arg-type]


def job_where(
    slurm: SlurmClient, job_id: int, test: Callable[[SlurmJob], bool]
) -> Callable[[], SlurmJob | None]:
    def check() -> SlurmJob | None:
        job = slurm.job(job_id)
        return job if job is not None and test(job) else None

    return check


def in_state(slurm: SlurmClient, job_id: int, *states: str) -> Callable[[], SlurmJob | None]:
    return job_where(slurm, job_id, lambda j: j.state in states)


def ended(slurm: SlurmClient, job_id: int) -> Callable[[], str | None]:
    """The final state, from squeue while Slurm keeps the job, else from jobcomp."""

    def check() -> str | None:
        job = slurm.job(job_id)
        if job is not None:
            return job.state if job.finished else None
        end = slurm.final_state(job_id)
        return end.state if end is not None else None

    return check


def test_nodes_show_the_clusters_four_a100s_on_each_node(
    slurm: SlurmClient, slurm_cluster: SlurmCluster
) -> None:
    node, second = slurm.nodes()
    assert (node.name, second.name) == slurm_cluster.nodes
    assert node.state == second.state == "idle"
    assert node.gpus == second.gpus == {"A100": 4} and node.gpus_free("A100") == 4
    assert sorted(node.partitions) == sorted([*PARTITIONS, WIDE]) and node.cpus == 8
    assert second.partitions == (WIDE,) or list(second.partitions) == [WIDE]
    assert node.memory_mb == MEMORY_MB
    assert slurm.controller_up()


def test_jobs_hold_gpus_pend_for_resources_and_are_ended(slurm: SlurmClient) -> None:
    first = slurm.submit(spec("first", gpus=2, gpu_type="A100"))  # a model name: mapped
    running = until(in_state(slurm, first, "RUNNING"), f"job {first} running")
    second = slurm.submit(spec("second", gpus=2, gpu_type="a100", partition="long", requeue=True))
    until(in_state(slurm, second, "RUNNING"), f"job {second} running")
    third = slurm.submit(spec("third", gpus=1, gpu_type="a100", time_limit_s=120))
    # Its reason comes from the main scheduler, its expected start from the backfill one,
    # a pass later: wait for both (asserting the start at the first sight was a flake).
    waiting = until(
        job_where(slurm, third, lambda j: j.reason == "Resources" and j.expected_start is not None),
        f"job {third} pending for Resources, with an expected start",
    )
    assert waiting.state == "PENDING"

    jobs = {j.job_id: j for j in slurm.jobs()}  # one squeue call: all three
    assert {first, second, third} <= set(jobs)
    node = running.nodes[0]
    a, b = set(jobs[first].gpu_indexes[node]), set(jobs[second].gpu_indexes[node])
    assert len(a) == len(b) == 2 and not a & b and a | b == {0, 1, 2, 3}
    assert slurm.gpu_indexes(first) == jobs[first].gpu_indexes
    inside = slurm.run_in_job(first, ["sh", "-c", "echo $CUDA_VISIBLE_DEVICES"], node=node)
    assert inside.ok and inside.stdout.split() == [",".join(map(str, sorted(a)))]
    assert jobs[first].partition == DEFAULT_PARTITION
    assert (jobs[second].partition, jobs[first].gpu_model, jobs[third].gpus) == ("long", "A100", 1)
    full, _ = slurm.nodes()
    assert full.gpus_used == {"A100": 4} and full.gpus_free() == 0
    assert full.memory_used_mb == 2 * JOB_MB  # the third waits: it holds nothing

    slurm.set_time_limit(first, 20 * 60)  # root may raise it (within short's 30 min)
    until(job_where(slurm, first, lambda j: j.time_limit_s == 1200), "the new limit")

    slurm.cancel(third)
    assert until(ended(slurm, third), f"job {third} ended") == "CANCELLED"
    slurm.cancel(third)  # already over: no error

    slurm.requeue(second)
    until(
        job_where(slurm, second, lambda j: j.restarts >= 1 and j.state in ("PENDING", "RUNNING")),
        f"job {second} back in the queue",
    )


def test_a_signal_reaches_the_program_itself(slurm: SlurmClient, tmp_path: Path) -> None:
    got, ready = tmp_path / "got", tmp_path / "ready"
    loop = f"trap 'echo usr1 > {got}; exit 0' USR1; touch {ready}; while :; do sleep 0.1; done"
    job = slurm.submit(spec("trap", ("sh", "-c", loop), workdir=str(tmp_path)))
    until(ready.exists, f"job {job} running with its trap set")
    slurm.cancel(job, "USR1")
    until(got.exists, "USR1 handled")
    assert got.read_text() == "usr1\n"


def test_refusals_say_what_the_cluster_has(slurm: SlurmClient) -> None:
    with pytest.raises(SlurmError) as eight:
        slurm.submit(spec("eight", gpus=8, gpu_type="A100"))
    assert "no partition has 8 A100 GPUs on one node (the most is 4)" in str(eight.value)
    with pytest.raises(SlurmError) as unknown:
        slurm.submit(spec("h100", gpus=1, gpu_type="H100"))
    assert "the cluster has no H100 GPUs (it has: A100)" in str(unknown.value)
    with pytest.raises(SlurmError) as partition:
        slurm.submit(spec("nope", partition="nope"))
    assert "there is no partition 'nope'; the partitions are long, short, urgent" in str(
        partition.value
    )
    assert not isinstance(eight.value, SlurmUnavailable)


def test_a_job_sees_only_the_environment_it_was_given(
    slurm: SlurmClient,
    slurm_cluster: SlurmCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    secret = "xoxb-slurm-secret-30517"
    monkeypatch.setenv("SLACK_BOT_TOKEN", secret)
    monkeypatch.setenv("SBATCH_PARTITION", "long")  # the bot's own Slurm settings stay its own
    word = 'it\'s $(not run) `neither` "quoted"\n*'
    out = tmp_path / "out.txt"
    job = slurm.submit(
        spec(
            "env",
            ("sh", "-c", 'env; printf "[%s]" "$1"', "sh", word),
            env={"RUN_FLAVOR": "a b $c"},
            output=str(out),
            workdir=str(tmp_path),
        )
    )
    stored = list(slurm_cluster.state_dir.glob(f"hash.*/job.{job}/*"))
    assert stored, "the job's saved script and environment"
    for path in stored:
        assert secret not in path.read_text(errors="replace"), path
    assert until(ended(slurm, job), f"job {job} ended") == "COMPLETED"
    text = out.read_text()
    assert "RUN_FLAVOR=a b $c\n" in text and f"[{word}]" in text
    assert secret not in text and "SLACK_BOT_TOKEN" not in text
    for name in ("PYTEST_CURRENT_TEST", "GPUBOT_SSH_LOOPBACK_ONLY", "VIRTUAL_ENV"):
        assert f"\n{name}=" not in f"\n{text}", name  # the test process's own variables
    assert f"SLURM_JOB_PARTITION={DEFAULT_PARTITION}" in text
    assert f"SLURM_MEM_PER_NODE={JOB_MB}" in text  # what it asked, not the node's 2000 MB
    assert "\nHOME=/root\n" in f"\n{text}" and "\nUSER=root\n" in f"\n{text}"


def test_a_forgotten_job_still_has_its_final_state(
    slurm: SlurmClient, slurm_cluster: SlurmCluster
) -> None:
    job = slurm.submit(spec("exit7", ("sh", "-c", "exit 7")))
    until(lambda: slurm.job(job) is None, f"job {job} forgotten (MinJobAge)")
    assert job not in {j.job_id for j in slurm.jobs()}
    end = until(lambda: slurm.final_state(job), f"job {job} in accounting")
    assert (end.state, end.exit_code, end.source, end.name) == ("FAILED", 7, "sacct", "exit7")
    assert (end.user, end.partition) == ("root", DEFAULT_PARTITION)
    # The jobcomp file, the fallback where there is no sacct, has it too.
    lines = slurm_cluster.jobcomp.read_text().splitlines()
    assert any(ln.startswith(f"JobId={job} ") and "JobState=FAILED" in ln for ln in lines)
    assert slurm.final_state(job + 1000) is None


def test_jobs_run_as_another_account_when_the_bot_is_root(
    slurm_as_root: SlurmClient, lab_workdir: Path
) -> None:
    slurm = slurm_as_root
    account = pwd.getpwnam(SHARED_ACCOUNT)
    out = lab_workdir / "id.txt"
    argv = ("sh", "-c", 'id -un; id -gn; echo "$HOME"')
    job = slurm.submit(
        spec("as", argv, user=SHARED_ACCOUNT, output=str(out), workdir=str(lab_workdir))
    )
    assert until(ended(slurm, job), f"job {job} ended") == "COMPLETED"
    assert out.read_text().split() == [SHARED_ACCOUNT, SHARED_ACCOUNT, account.pw_dir]
    assert out.stat().st_uid == account.pw_uid
    end = until(lambda: slurm.final_state(job), f"job {job} in accounting")
    assert end.user == SHARED_ACCOUNT


def test_an_account_slurm_does_not_know_is_refused(
    slurm_as_root: SlurmClient, lab_workdir: Path
) -> None:
    """AccountingStorageEnforce=associations: a unix account with no Slurm association
    (the run account of scripts/run_account.sh) cannot submit, even through root."""
    slurm = slurm_as_root
    try:
        pwd.getpwnam(RUN_ACCOUNT)
    except KeyError:
        pytest.skip(f"no account {RUN_ACCOUNT} (scripts/run_account.sh creates it)")
    with pytest.raises(SlurmError, match="Invalid account") as refused:
        slurm.submit(spec("stranger", user=RUN_ACCOUNT, workdir=str(lab_workdir)))
    assert not isinstance(refused.value, SlurmUnavailable)


def test_a_controller_that_does_not_answer_is_said_and_loses_nothing(
    slurm: SlurmClient, slurm_cluster: SlurmCluster
) -> None:
    before = slurm.submit(spec("survivor", gpus=1, gpu_type="a100"))
    until(in_state(slurm, before, "RUNNING"), f"job {before} running")
    quick = SlurmClient(conf=str(slurm_cluster.conf), timeout_s=3)
    with slurm_cluster.controller_down():
        assert not quick.controller_up()
        with ThreadPoolExecutor(4) as pool:
            # Within the timeout; and without one (clients give up after ~9 s here),
            # from 22.05's JSON that exits 0 with an error and an empty list.
            reads: list[Future[Any]] = [
                pool.submit(quick.jobs),
                pool.submit(quick.nodes),
                pool.submit(slurm.jobs),
            ]
            submit = pool.submit(quick.submit, spec("lost"))
            for call in reads:
                with pytest.raises(SlurmUnavailable, match="not answering"):
                    call.result()
            with pytest.raises(SlurmUnavailable):
                submit.result()
    assert slurm.controller_up()
    job = slurm.job(before)
    assert job is not None and job.state == "RUNNING"
    after = slurm.submit(spec("after"))
    until(in_state(slurm, after, "RUNNING"), f"job {after} running")


@pytest.fixture
def ssh_slurm(ssh_lab: SshLab, slurm_cluster: SlurmCluster) -> Iterator[SlurmClient]:
    """The client on a login node: a loopback sshd logged into as the bot's own user."""
    runner = SshClient(connect_timeout=5, command_timeout=30)
    try:
        yield SlurmClient(
            conf=str(slurm_cluster.conf), login=target_for(ssh_lab, "gpu-a"), runner=runner
        )
    finally:
        runner.close()


def test_the_same_client_over_ssh_to_a_login_node(
    ssh_slurm: SlurmClient, slurm: SlurmClient, tmp_path: Path
) -> None:
    node, second = ssh_slurm.nodes()
    assert node.gpus == second.gpus == {"A100": 4}
    out = tmp_path / "ssh.txt"
    argv = ("sh", "-c", 'echo "ran $RUN_ID"; echo "$SLURM_CONF"')
    job = ssh_slurm.submit(spec("ssh", argv, env={"RUN_ID": "7 '8'"}, output=str(out), gpus=1))
    assert until(ended(ssh_slurm, job), f"job {job} ended") == "COMPLETED"
    assert out.read_text().splitlines()[0] == "ran 7 '8'"
    assert slurm.job(job) is not None or slurm.final_state(job) is not None
    # SSH passes no SLURM_CONF: without it in the command, the login node's tools are lost.
    assert ssh_slurm.login is not None and ssh_slurm.runner is not None
    lost = SlurmClient(conf="", login=ssh_slurm.login, runner=ssh_slurm.runner)
    with pytest.raises(SlurmError, match="find no configuration"):
        lost.jobs()
