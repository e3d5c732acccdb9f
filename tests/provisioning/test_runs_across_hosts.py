"""A run across hosts: the runner on two isolated hosts (each its own account, behind its
own sshd), torchrun's rendezvous on the first, gloo between them on CPU.

lab-a is the session's `bootstrapped` host; lab-b gets a copy of its prepared root (a
second instance from the same image, `clone_prepared`), which its own bootstrap must find
current. The same run on one node is the yardstick: with the same effective batch the
two must agree (tests/multinode.py says why), and only node 0 writes the result.
`make bench` (bench/multinode.py) times the two against each other on these hosts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from provisioning import shell
from provisioning.bootstrap import UP_TO_DATE, bootstrap
from provisioning.ssh import SshClient
from tests.isolated_hosts import Bootstrapped, clone_prepared, isolated_target, remove_clone
from tests.multinode import EFFECTIVE_BATCH, Node, run_digits
from tests.ssh_hosts import pip_env
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
    print(f"two nodes: {two.wall_s:.1f} s")
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
