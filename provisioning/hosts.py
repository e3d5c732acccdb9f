"""Hosts the team already has: this machine, and static SSH hosts (an on-prem GPU server).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from provisioning import shell
from provisioning.base import GpuDevice, Instance, ProvisioningError
from provisioning.hostshell import HostShell
from provisioning.ssh import SshTarget, parse_address

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
        if proc.returncode != 0:
            return []
        return parse_inventory(proc.stdout)
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError, KeyError, ValueError) as exc:
        log.warning("GPU probe failed, treating this machine as GPU-less: %s", exc)
        return []


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


# --- static SSH hosts -------------------------------------------------------------------

# `/4xA100` or `/4xA100+2xT4` after an address: the GPUs a host has, as declared by the
# person who configured it (an on-prem box does not report its own hardware to a cloud API).
_GPU_PART = re.compile(r"^(\d{1,3})\s*[x×]\s*([A-Za-z0-9][A-Za-z0-9\-]*)$")


class HostEntryError(ValueError):
    """A GPUBOT_SSH_HOSTS entry does not parse; the message names the entry."""


@dataclass(frozen=True)
class StaticHost:
    """One configured host: how to reach it and the GPUs it was declared with."""

    # The name the bot shows and keys the host row on (the address when none is given).
    name: str
    target: SshTarget
    gpus: tuple[GpuDevice, ...] = ()


def parse_gpu_spec(
    text: str, normalize: Callable[[str], str | None] | None = None
) -> tuple[GpuDevice, ...]:
    """`4xA100+2xT4` → six devices, indexes in order; `normalize` maps spellings to the catalog."""
    devices: list[GpuDevice] = []
    for part in (p.strip() for p in text.split("+")):
        m = _GPU_PART.match(part)
        if m is None:
            raise HostEntryError(f"{part!r} is not COUNTxMODEL (e.g. 4xA100)")
        count, model = int(m.group(1)), m.group(2)
        if count < 1:
            raise HostEntryError(f"{part!r} declares no GPUs")
        canon = normalize(model) if normalize is not None else None
        name = canon or ("cpu" if model.lower() in {"cpu", "cpus"} else model.upper())
        first = len(devices)
        devices.extend(GpuDevice(index=first + i, model=name) for i in range(count))
    return tuple(devices)


def parse_host_entries(
    raw: str,
    *,
    default_user: str = "root",
    key_path: str | None = None,
    normalize: Callable[[str], str | None] | None = None,
) -> tuple[StaticHost, ...]:
    """GPUBOT_SSH_HOSTS: comma-separated `[name=][user@]host[:port][/COUNTxMODEL[+…]]`.

    The GPU part is optional: without it the host's GPUs are probed over SSH with
    `training.inventory` when the provider is built with a runner. Names must be unique,
    because the host rows (and everything billed to them) are keyed on them.
    """
    out: list[StaticHost] = []
    seen: set[str] = set()
    for entry in (e.strip() for e in raw.split(",")):
        if not entry:
            continue
        label, sep, rest = entry.partition("=")
        if not sep:
            label, rest = "", entry
        address, slash, gpu_text = rest.strip().partition("/")
        user, host, port = parse_address(address.strip())
        if not host:
            raise HostEntryError(f"GPUBOT_SSH_HOSTS: {entry!r} names no host")
        try:
            gpus = parse_gpu_spec(gpu_text, normalize) if slash else ()
        except HostEntryError as exc:
            raise HostEntryError(f"GPUBOT_SSH_HOSTS: {entry!r}: {exc}") from None
        if slash and not gpus:
            raise HostEntryError(f"GPUBOT_SSH_HOSTS: {entry!r} has an empty GPU list after /")
        name = label.strip() or host
        if name in seen:
            raise HostEntryError(f"GPUBOT_SSH_HOSTS: the name {name!r} is used twice")
        seen.add(name)
        target = SshTarget(
            host=host,
            port=port or 22,
            user=user or default_user,
            key_path=key_path,
            name=label.strip(),
        )
        out.append(StaticHost(name=name, target=target, gpus=gpus))
    return tuple(out)


def parse_inventory(output: str) -> list[GpuDevice]:
    """The JSON of `python -m training.inventory --json` as devices (empty when it has none)."""
    data = json.loads(output)
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


class StaticHostsCompute:
    """Machines the team owns and reaches over SSH: listed as configured, never rented.

    A host with declared GPUs is listed with them and `market="owned"` (no hourly bill).
    One without is probed once over SSH (`python3 -m training.inventory --json`, which
    needs the training package there: bootstrap puts it in place); a host that cannot be
    reached is listed `unreachable` with no GPUs rather than left out, so the status shows
    it and nothing is granted on it.
    """

    name = "ssh"

    def __init__(
        self,
        hosts: Sequence[StaticHost],
        runner: HostShell | None = None,
        *,
        inventory_command: str = shell.join(["python3", "-m", "training.inventory", "--json"]),
        probe_timeout_s: float = 60.0,
    ) -> None:
        self.hosts = tuple(hosts)
        self._runner = runner
        self._inventory_command = inventory_command
        self._probe_timeout_s = probe_timeout_s
        self._probed: dict[str, tuple[GpuDevice, ...]] = {}

    def targets(self) -> dict[str, SshTarget]:
        """Host name → where to dial it: the map a `StaticResolver` serves."""
        return {
            h.name: h.target if h.target.name else replace(h.target, name=h.name)
            for h in self.hosts
        }

    def _gpus(self, host: StaticHost) -> tuple[GpuDevice, ...] | None:
        if host.gpus:
            return host.gpus
        if host.name in self._probed:
            return self._probed[host.name]
        if self._runner is None:
            return ()
        try:
            result = self._runner.run(
                host.target, self._inventory_command, timeout=self._probe_timeout_s
            )
        except ProvisioningError as exc:
            log.warning("cannot reach %s to list its GPUs: %s", host.name, exc)
            return None
        if not result.ok:
            log.warning(
                "GPU inventory on %s failed (exit %s): %s",
                host.name,
                result.exit_code,
                result.stderr.strip()[-200:],
            )
            return None
        try:
            found = tuple(parse_inventory(result.stdout))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("GPU inventory on %s is not JSON: %s", host.name, exc)
            return None
        self._probed[host.name] = found
        return found

    def list_instances(self) -> list[Instance]:
        out = []
        for h in self.hosts:
            gpus = self._gpus(h)
            out.append(
                Instance(
                    name=h.name,
                    provider="ssh",
                    state="ready" if gpus is not None else "unreachable",
                    gpus=gpus or (),
                    market="owned",
                    address=h.target.host,
                    ssh_user=h.target.user,
                    ssh_port=h.target.port,
                )
            )
        return out
