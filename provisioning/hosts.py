"""Hosts the team already has: this machine (and, in a later issue, static SSH hosts).

The local host reads its GPUs by running `training.inventory`, the same probe the
bot runs over SSH on a remote host, so this package never imports pynvml. With
no NVIDIA GPU it offers `slots` CPU slots, modelled "cpu", so the whole flow
works on a laptop.
"""

from __future__ import annotations

import getpass
import json
import logging
import re
import socket
import subprocess
import sys
from collections.abc import Callable

from provisioning.base import GpuDevice, Instance

log = logging.getLogger(__name__)

# Device-name fragments to catalog model names; the first match wins, so the
# more specific names come first.
_MODEL_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"H200", "H200"),
    (r"H100", "H100"),
    (r"A100.*80\s*GB|A100-SXM4-80|A100 80", "A100-80GB"),
    (r"A100", "A100"),
    (r"A10G", "A10G"),
    (r"L40S", "L40S"),
    (r"\bL4\b", "L4"),
    (r"V100", "V100"),
    (r"\bT4\b", "T4"),
)


def model_from_device_name(name: str, memory_mb: int = 0) -> str:
    """Maps "NVIDIA A100-SXM4-80GB" to "A100-80GB"; an unknown card keeps a cleaned name."""
    for pattern, model in _MODEL_PATTERNS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            if model == "A100" and memory_mb > 60 * 1024:
                return "A100-80GB"
            return model
    cleaned = re.sub(r"^(NVIDIA|Tesla|GeForce)\s+", "", name.strip(), flags=re.IGNORECASE)
    return cleaned[:32] or "unknown"


def probe_local_gpus(timeout_s: float = 30.0) -> list[GpuDevice]:
    """Runs the inventory probe in a child process: NVML state never leaks into the bot."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "training.inventory", "--json"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        data = json.loads(proc.stdout) if proc.returncode == 0 else {"gpus": []}
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
        log.warning("GPU probe failed, treating this machine as GPU-less: %s", exc)
        return []
    out = []
    for g in data.get("gpus", []):
        memory_mb = int(g.get("memory_mb", 0))
        out.append(
            GpuDevice(
                index=int(g["index"]),
                model=model_from_device_name(str(g.get("name", "")), memory_mb),
                memory_gb=round(memory_mb / 1024, 1),
            )
        )
    return out


class LocalCompute:
    """This machine as the one host. It is owned, not rented: it costs nothing per hour."""

    name = "local"

    def __init__(
        self,
        slots: int = 1,
        probe: Callable[[], list[GpuDevice]] = probe_local_gpus,
    ) -> None:
        self._slots = slots
        self._probe = probe
        self._cached: Instance | None = None

    def list_instances(self) -> list[Instance]:
        if self._cached is None:
            gpus = tuple(self._probe())
            if not gpus:
                gpus = tuple(GpuDevice(index=i, model="cpu") for i in range(self._slots))
            self._cached = Instance(
                name="local",
                provider="local",
                state="ready",
                gpus=gpus,
                address=socket.gethostname(),
                ssh_user=_current_user(),
            )
        return [self._cached]


def _current_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return ""
