"""A run across hosts: the runner on two isolated hosts (each its own account, behind its
own sshd), torchrun's rendezvous on the first, gloo between them on CPU.

lab-a is the session's `bootstrapped` host; lab-b gets a copy of its prepared root (a
second instance from the same image, `clone_prepared`), which its own bootstrap must find
current. The same run on one node is the yardstick: with the same effective batch the
two must agree (tests/multinode.py says why), and only node 0 writes the result.
`make bench` (bench/multinode.py) times the two against each other on these hosts.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlmodel import Session, col, select

from bot.app.config import load_settings
from bot.app.hosts.remote import PreparedHost
from bot.app.runs import RunService
from bot.app.runs.context import STARTING_GRACE
from bot.domain.commands import Run
from bot.faces.runtime import Runtime, build_runtime
from db.models import Host, Notification, TrainingRun, UsageInterval
from provisioning import shell
from provisioning.bootstrap import UP_TO_DATE, bootstrap
from provisioning.hostshell import HostShell
from provisioning.ssh import SshClient, SshTarget
from tests.isolated_hosts import Bootstrapped, clone_prepared, isolated_target, remove_clone
from tests.multinode import EFFECTIVE_BATCH, Node, run_digits
from tests.runtime_helpers import checked
from tests.ssh_hosts import SshLab, pip_env
from training.loop import TrainConfig, train
from training.recipes import load_digits_data

EPOCHS = 8


@pytest.fixture(scope="module")
def client() -> Iterator[SshClient]:
    c = SshClient(connect_timeout=5, command_timeout=60)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def two_nodes(bootstrapped: Bootstrapped, client: SshClient) -> Iterator[list[Node]]:
    lab = bootstrapped.lab
    # The first import compiles torch's bytecode (the bootstrap skips that): once, on
    # lab-a, before the copy, rather than on both nodes at once on a 2-core machine.
    warm = client.run(
        bootstrapped.target,
        shell.join([bootstrapped.report.venv_python, "-c", "import torch, sklearn.datasets"]),
        timeout=300,
    )
    assert warm.ok, warm.stderr
    # lab-a as this bootstrap makes it: a test before this one may have prepared it
    # through the bot (with a host agent, another marker), and the copy must be what
    # lab-b's own bootstrap below finds current (a no-op), whatever ran first.
    again = bootstrap(client, bootstrapped.target, remote_root="~/.gpubot", env=pip_env())
    assert again.root == bootstrapped.report.root
    copy = clone_prepared(lab, "lab-a", "lab-b")
    try:
        target_b = isolated_target(lab, "lab-b")
        prepared_b = bootstrap(client, target_b, remote_root="~/.gpubot", env=pip_env())
        assert prepared_b.noop and prepared_b.steps == (UP_TO_DATE,)
        assert prepared_b.root == str(copy)  # its own home, its own venv
        yield [Node(bootstrapped.target, bootstrapped.report), Node(target_b, prepared_b)]
    finally:
        # lab-b as the other tests expect it: nothing of this test left in its home.
        remove_clone(copy)


def test_digits_on_two_hosts_reaches_the_accuracy_of_one(
    two_nodes: list[Node], client: SshClient, tmp_path: Path
) -> None:
    two = run_digits(client, two_nodes, "two-nodes", epochs=EPOCHS)
    for result in two.results:
        assert result.ok, result.stdout[-2000:] + result.stderr[-2000:]
    head, other = two.statuses
    assert head is not None and other is not None
    assert head.state == other.state == "done"
    assert head.world_size == other.world_size == 2
    # One run, one result: node 1 holds no rank 0, so its status file has no metrics.
    assert other.metrics == {} and head.metrics.get("test_accuracy") is not None

    # The yardstick: the same run on one node, here in-process (the same runner code and
    # torch wheel; a third remote start would cost the suite ~15 s and show nothing more).
    one = train(
        TrainConfig(
            recipe="digits",
            device="cpu",
            seed=0,
            epochs=EPOCHS,
            effective_batch=EFFECTIVE_BATCH,
            status_file=tmp_path / "one-node.json",
            verbose=False,
        )
    )
    assert one.state == "done" and one.metrics["test_accuracy"] >= 0.9
    assert two.accuracy is not None
    # The same 64 samples and learning rate at every step, the same initial weights
    # (seed 0; DDP broadcasts rank 0's): only the order of float additions differs
    # (gloo's all-reduce of two half-batch means). One test image of slack for that.
    one_sample = 1 / len(load_digits_data().test_y)
    assert two.accuracy >= one.metrics["test_accuracy"] - one_sample - 1e-9


# --- the bot: one run over two static hosts ------------------------------------------------
#
# On the default lab (gpu-a, gpu-b: the bot's own machine over sshd, each with its own
# root), without a bootstrap: these tests are about dispatch and poll, the run above
# about what two strangers train.

ALL_REDUCE = (
    "import torch, torch.distributed as dist, training\n"
    "dist.init_process_group('gloo')\n"
    "t = torch.tensor([float(dist.get_rank() + 1)])\n"
    "dist.all_reduce(t)\n"
    "training.report(step=1, loss=float(t))\n"
    "dist.destroy_process_group()\n"
)
# Node 1 fails at once; node 0 would wait far longer than the test, unless stopped.
NODE_1_FAILS = (
    "import os, sys, time\n"
    "if os.environ['GROUP_RANK'] == '1':\n"
    "    print('node 1 gives up', flush=True)\n"
    "    sys.exit(3)\n"
    "time.sleep(600)\n"
)
HOURLY_USD = 3.6  # each host's price, as an owned host has none: $0.001 a second


def _bot(
    ssh_lab: SshLab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, client: SshClient
) -> Runtime:
    monkeypatch.setenv("GPUBOT_PROVIDER", "ssh")
    monkeypatch.setenv("GPUBOT_HOME", str(tmp_path))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("GPUBOT_SSH_KEY", str(ssh_lab.client_key))
    entries = [
        f"{name}={ssh_lab.user}@{host.address}:{host.port}/1xcpu"
        for name, host in sorted(ssh_lab.hosts.items())
    ]
    monkeypatch.setenv("GPUBOT_SSH_HOSTS", ",".join(entries))

    def prepare(runner: HostShell, target: SshTarget) -> PreparedHost:
        # Each host its own root (both are this machine): node files never share a path.
        return PreparedHost(root=str(tmp_path / "remote" / target.name), python=sys.executable)

    rt = checked(build_runtime(load_settings(), ssh=client, prepare=prepare))
    with Session(rt.engine) as s:
        for host in s.exec(select(Host)):
            host.hourly_usd = HOURLY_USD
            s.add(host)
        s.commit()
    return rt


def _runs(rt: Runtime) -> RunService:
    assert rt.service.runs is not None
    return rt.service.runs


def _run_to_the_end(rt: Runtime, rid: int, limit_s: float = 180) -> TrainingRun:
    runs = _runs(rt)
    deadline = time.monotonic() + limit_s
    while True:
        runs.poll()
        runs.dispatch()
        with Session(rt.engine) as s:
            run = s.get(TrainingRun, rid)
            assert run is not None
            if run.state in ("succeeded", "failed", "cancelled"):
                return run
        assert time.monotonic() < deadline, f"run {rid} did not end: {run.state} {run.placement}"
        time.sleep(0.3)


def _result_dms(rt: Runtime, rid: int) -> list[Notification]:
    with Session(rt.engine) as s:
        return list(
            s.exec(select(Notification).where(Notification.dedupe_key == f"run-finished:{rid}"))
        )


def test_a_run_larger_than_any_host_runs_once_across_two(
    ssh_lab: SshLab,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    client: SshClient,
    loopback_rendezvous: None,  # its xdist group: one run across the lab at a time
) -> None:
    rt = _bot(ssh_lab, tmp_path, monkeypatch, client)
    script = tmp_path / "allreduce.py"
    script.write_text(ALL_REDUCE)
    alice = rt.service.actor("alice")
    # Two CPU slots where each host has one: no longer refused, placed on both.
    reply = _runs(rt).submit(alice, Run(command=(sys.executable, str(script)), gpus=2, model="cpu"))
    rid = reply.extra["run_id"]
    run = _run_to_the_end(rt, rid)
    assert run.state == "succeeded", run.metrics
    nodes = run.placement["nodes"]
    assert [n["host"] for n in nodes] == ["gpu-a", "gpu-b"] and run.placement["host"] == "gpu-a"
    assert run.placement["rdzv"].startswith(f"{ssh_lab.hosts['gpu-a'].address}:")
    # The two nodes were one process group: ranks 0 and 1 summed to 1 + 2 (node 0's report).
    assert run.metrics["loss"] == 3.0
    # One result, one DM; its cost is both hosts' usage summed.
    assert len(_result_dms(rt, rid)) == 1
    with Session(rt.engine) as s:
        intervals = list(s.exec(select(UsageInterval).where(UsageInterval.run_id == rid)))
        host_names = {h.id: h.name for h in s.exec(select(Host))}
    assert sorted(host_names[iv.host_id] for iv in intervals) == ["gpu-a", "gpu-b"]
    assert all(iv.ended_at is not None for iv in intervals)
    each = [
        iv.usd_per_hour * (iv.ended_at - iv.started_at).total_seconds() / 3600  # type: ignore[operator]
        for iv in intervals
    ]
    assert all(c > 0 for c in each)
    assert run.metrics["cost_usd"] == pytest.approx(sum(each), abs=1e-4)
    assert "started on 2 hosts (gpu-a, gpu-b)" in _started_text(rt, rid)
    rt.engine.dispose()


def _started_text(rt: Runtime, rid: int) -> str:
    with Session(rt.engine) as s:
        row = s.exec(
            select(Notification).where(Notification.dedupe_key == f"run-started:{rid}")
        ).one()
        return row.text


def test_one_node_failing_ends_the_others_and_fails_the_run(
    ssh_lab: SshLab,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    client: SshClient,
    loopback_rendezvous: None,  # its xdist group: one run across the lab at a time
) -> None:
    rt = _bot(ssh_lab, tmp_path, monkeypatch, client)
    script = tmp_path / "fails.py"
    script.write_text(NODE_1_FAILS)
    alice = rt.service.actor("alice")
    reply = _runs(rt).submit(alice, Run(command=(sys.executable, str(script)), gpus=2, model="cpu"))
    rid = reply.extra["run_id"]
    started = time.monotonic()
    # The worker dies after starting both nodes, before it records them: the next poll
    # after the grace adopts the run whole (every node's group) instead of starting it twice.
    dispatcher = _runs(rt).dispatcher

    def worker_dies(*args: object) -> None:
        raise RuntimeError("worker died")

    dispatcher._mark_started = worker_dies  # type: ignore[method-assign,assignment]
    try:
        with pytest.raises(RuntimeError, match="worker died"):
            _runs(rt).dispatch()
    finally:
        del dispatcher._mark_started  # the class's own again
    with Session(rt.engine) as s:
        claimed = s.get(TrainingRun, rid)
        assert claimed is not None and claimed.state == "starting"
        assert "pgid" not in claimed.placement and len(claimed.placement["nodes"]) == 2
        assert claimed.started_at is not None
        claimed.started_at -= STARTING_GRACE + timedelta(seconds=1)
        s.add(claimed)
        s.commit()
    _runs(rt).poll()
    with Session(rt.engine) as s:
        adopted = s.get(TrainingRun, rid)
        assert adopted is not None and adopted.state == "running"
        assert all(isinstance(n.get("pgid"), int) for n in adopted.placement["nodes"])
    run = _run_to_the_end(rt, rid, limit_s=120)
    assert time.monotonic() - started < 120  # node 0 did not sleep its 600 s out
    assert run.state == "failed"
    error = run.metrics["summary"]["error"]
    assert error.startswith(
        "node 1 on gpu-b failed: exited with code 1: worker rank 1 exited with code 3"
    ), error
    assert len(_result_dms(rt, rid)) == 1
    # Node 0's process group is gone on its host, not left sleeping.
    node0 = run.placement["nodes"][0]
    assert not client.is_alive(_target(ssh_lab, "gpu-a"), int(node0["pgid"]))
    with Session(rt.engine) as s:
        open_ivs = s.exec(
            select(UsageInterval).where(
                UsageInterval.run_id == rid, col(UsageInterval.ended_at).is_(None)
            )
        ).all()
    assert open_ivs == []  # both hosts' GPUs given back
    rt.engine.dispose()


def _target(lab: SshLab, name: str) -> SshTarget:
    host = lab.hosts[name]
    return SshTarget(
        host=host.address, port=host.port, user=lab.user, key_path=str(lab.client_key), name=name
    )
