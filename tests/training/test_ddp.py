"""The torchrun command lines the runner builds (the runs themselves are in test_runner)."""

from __future__ import annotations

import pytest

from training.ddp import interface_towards, torchrun_command


def test_single_host_rendezvous_stays_on_loopback() -> None:
    cmd = torchrun_command(2, ["training.runner", "--recipe", "digits"], module=True, python="py")
    assert cmd[:3] == ["py", "-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in cmd and "--rdzv-endpoint=127.0.0.1:0" in cmd
    assert cmd[-4:] == ["-m", "training.runner", "--recipe", "digits"]


def test_multi_host_uses_the_callers_endpoint() -> None:
    cmd = torchrun_command(
        8,
        ["python", "train.py"],
        nnodes=2,
        node_rank=1,
        rdzv_endpoint="node0.lab.example:29400",
        rdzv_id="job7",
    )
    assert "--nnodes=2" in cmd and "--node-rank=1" in cmd
    assert "--rdzv-endpoint=node0.lab.example:29400" in cmd and "--rdzv-id=job7" in cmd
    # Static: the node rank decides the global ranks, so rank 0 (the one writer of the
    # result) runs on node 0, whose status file the bot reads.
    assert "--rdzv-backend=static" in cmd and "--rdzv-conf=timeout=600" in cmd
    assert cmd[-3:] == ["--no-python", "python", "train.py"]
    with pytest.raises(ValueError, match="rendezvous"):
        torchrun_command(8, ["python", "train.py"], nnodes=2)


def test_the_interface_towards_node_0_is_the_one_that_routes_there() -> None:
    """Gloo listens on it instead of the hostname's address (127.0.1.1 on stock images)."""
    assert interface_towards("127.0.0.4", 29400) == "lo"
    assert interface_towards("::1", 29400) is None  # IPv6: left to the libraries
