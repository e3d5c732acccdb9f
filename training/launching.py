"""Starting processes for several-process runs, without torch.

The runner's supervisor (training.runner `_launch`) lives for the whole run next to the
user's command; importing torch there cost about 200 MB a run for nothing it uses (200
command runs did not fit 24 GB: bench `live_runs`, issue 39). What the
supervisor needs from DDP, the torchrun command line, whether this process is a
torchrun worker and the interface towards node 0, is here; training.ddp keeps the parts
that need torch and re-exports these.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


def under_torchrun() -> bool:
    """True inside a torchrun worker: then the runner trains instead of launching."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_command(
    nproc_per_node: int,
    target: list[str],
    *,
    module: bool = False,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "gpubot",
    rdzv_timeout_s: int = 600,
    python: str = sys.executable,
) -> list[str]:
    """The argv that starts `target` as `nproc_per_node` workers on this host.

    `target` is a module and its arguments when `module` is true (``["training.runner",
    ...]``), otherwise a whole command (``["python", "train.py", ...]``), which torchrun
    runs as given (``--no-python``) so the user's interpreter and flags are kept.
    For ``nnodes > 1`` `rdzv_endpoint` (``host:port`` of the node-0 host, reachable from
    all) is required and the same command runs on every host with its own `node_rank`;
    a node that has not joined within `rdzv_timeout_s` fails the rendezvous on every
    host, so a host that never started does not leave the others waiting forever.
    """
    if nproc_per_node < 1 or nnodes < 1:
        raise ValueError("need at least one process per node and one node")
    cmd = [python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}"]
    if nnodes == 1 and rdzv_endpoint is None:
        # Port 0: the store binds a free port itself, so parallel runs cannot collide.
        cmd += [
            "--nnodes=1",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:0",
            "--local-addr=127.0.0.1",
        ]
    else:
        if rdzv_endpoint is None:
            raise ValueError("a multi-host run needs the rendezvous endpoint host:port")
        # The static rendezvous, not c10d's dynamic one: c10d numbers the nodes by sorting
        # their addresses, so global rank 0 (the one writer of the status file and the
        # result) could land on any host; static makes node 0's first process rank 0,
        # on the host the bot reads. Node 0 serves the store at the endpoint.
        cmd += [
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            "--rdzv-backend=static",
            f"--rdzv-endpoint={rdzv_endpoint}",
            f"--rdzv-conf=timeout={rdzv_timeout_s}",
        ]
    cmd += [f"--rdzv-id={rdzv_id}", "--max-restarts=0"]
    if module:
        cmd += ["-m", *target]
    else:
        cmd += ["--no-python", *target]
    return cmd


# Linux ioctls that read an interface's IPv4 address and netmask (netdevice(7)).
_SIOCGIFADDR = 0x8915
_SIOCGIFNETMASK = 0x891B


def interface_towards(host: str, port: int) -> str | None:
    """The network interface this machine reaches `host` through, or None where unknown.

    Gloo (and NCCL's bootstrap) pick their own listening address from the hostname, which
    on a stock Debian/Ubuntu image resolves to 127.0.1.1: the other nodes then dial a
    loopback address and the run hangs in its first collective. The interface that routes
    to node 0 is the one every node can be reached on. IPv4 and Linux only; elsewhere the
    libraries' own choice stands.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))  # UDP: no packet leaves, the kernel only routes
            local = ipaddress.ip_address(probe.getsockname()[0])
    except (OSError, ValueError):
        return None
    try:
        import fcntl
    except ImportError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = name.encode()[:15].ljust(256, b"\0")
            try:
                addr = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)[20:24])
                mask = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFNETMASK, request)[20:24])
            except OSError:
                continue  # no IPv4 address on it
            if local in ipaddress.ip_network(f"{addr}/{mask}", strict=False):
                return name
    return None


@dataclass(frozen=True)
class Probed:
    """A precision chosen for this host's device (training.precision), and the device."""

    precision: str
    reason: str
    device: str


def probe_precision(requested: str, device: str) -> Probed:
    """Chooses the precision of a run the supervisor launches, in a short-lived child.

    Choosing needs torch (the GPU's compute capability, the CPU's AMX), and a supervisor
    that imported it would hold about 200 MB for the whole run; the child holds it for
    the second it takes. An explicit precision on the CPU needs no probe. A probe that
    fails (no torch on the host's interpreter) leaves fp32 and says why, in the reason
    the run's status shows: a command may train without torch.
    """
    if requested != "auto" and device == "cpu":
        return Probed(requested, f"{requested} requested", "cpu")
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "training.precision", requested, device],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return Probed("fp32", f"the device probe could not run ({exc}); fp32", "unknown")
    try:
        said = json.loads(done.stdout.strip().splitlines()[-1])
        return Probed(str(said["precision"]), str(said["reason"]), str(said["device"]))
    except (IndexError, KeyError, TypeError, ValueError):
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        if requested != "auto":
            return Probed(
                requested, f"{requested} requested (the device probe failed: {why})", "unknown"
            )
        return Probed("fp32", f"the device probe failed ({why}); fp32", "unknown")
