"""One snapshot of this host's GPUs: `python -m training.telemetry --json`.

The bot runs this on each GPU host (locally or over SSH) and reads the JSON back with
`parse_snapshot`, so the probe and its reader live in one file in `training`, the
package copied to every host and the only one allowed to know pynvml. It needs
nothing but the standard library and nvidia-ml-py (module `pynvml`).

Order of preference, each step only where the one before is unavailable:

1. NVML through nvidia-ml-py: exact, cheap, and it lists processes per GPU.
2. `nvidia-smi --query-gpu=... --format=csv,noheader,nounits` (and
   `--query-compute-apps`), for hosts with a driver but no Python bindings.
3. Nothing: the snapshot says "no NVIDIA driver" in plain words and the command
   still exits 0, because a GPU-less host is a fact to report, not a failure.

A metric that a GPU does not support (power on many cards, `[N/A]` from nvidia-smi)
is None, never a crash: one odd GPU must not blind the bot to the others.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from typing import Any, Literal, Protocol, TypeVar

# Bump only for a change an older reader would misread (a renamed or re-meant field);
# adding a field does not need it, since readers ignore what they do not know.
SCHEMA_VERSION = 1

Source = Literal["nvml", "nvidia-smi", "none"]
NO_DRIVER = "no NVIDIA driver"

_MIB = 1024 * 1024


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_mb: int | None  # GPU memory it holds, MiB; None where the driver will not say


@dataclass(frozen=True)
class GpuSnapshot:
    index: int  # the device index (what CUDA_VISIBLE_DEVICES names)
    uuid: str  # "GPU-…": stable across reboots, unlike the index
    name: str  # as the driver reports it, e.g. "NVIDIA A100-SXM4-40GB"
    util_pct: int | None  # busy share of the last sample period, 0-100
    mem_used_mb: int | None  # MiB
    mem_total_mb: int | None  # MiB
    temp_c: int | None
    power_w: float | None  # draw now
    power_limit_w: float | None  # the enforced limit
    processes: tuple[GpuProcess, ...] = ()


@dataclass(frozen=True)
class HostSnapshot:
    taken_at: datetime  # aware, UTC
    source: Source  # which probe answered
    gpus: tuple[GpuSnapshot, ...]
    # None when all went well; otherwise what went wrong, in words a user can act on
    # (with source "none": why there are no GPUs; otherwise a partial failure).
    error: str | None = None

    def to_json(self) -> str:
        doc: dict[str, Any] = {"schema_version": SCHEMA_VERSION, **asdict(self)}
        doc["taken_at"] = self.taken_at.astimezone(UTC).isoformat()
        return json.dumps(doc)


# --- the NVML seam ----------------------------------------------------------------------


class Nvml(Protocol):
    """The few pynvml calls used here. The real module satisfies it; tests pass a
    recorded-snapshot double with the same names."""

    NVML_TEMPERATURE_GPU: int
    NVMLError: type[Exception]
    NVMLError_NotSupported: type[Exception]

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetName(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...  # .gpu (%)
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...  # .used, .total (bytes)
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int: ...
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int: ...  # milliwatts
    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int: ...  # milliwatts
    def nvmlDeviceGetComputeRunningProcesses(
        self, handle: Any
    ) -> list[Any]: ...  # .pid, .usedGpuMemory


class NvmlUnavailable(Exception):
    """NVML cannot be used here (no bindings, no library, no driver): try the next probe."""


def load_pynvml() -> Nvml:
    try:
        import pynvml
    except ImportError as exc:
        raise NvmlUnavailable("nvidia-ml-py is not installed") from exc
    module: Nvml = pynvml
    return module


T = TypeVar("T")


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def snapshot_nvml(nvml: Nvml, now: datetime) -> HostSnapshot:
    """Raises NvmlUnavailable when NVML will not start, so the caller can fall back."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:  # LibraryNotFound, DriverNotLoaded, NoPermission, …
        raise NvmlUnavailable(f"NVML: {exc}") from exc
    problems: list[str] = []
    try:
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML: {exc}") from exc
        gpus = []
        for i in range(count):
            try:
                gpus.append(_nvml_gpu(nvml, i, problems))
            except nvml.NVMLError as exc:  # the GPU itself is gone (GpuIsLost, …)
                problems.append(f"GPU {i}: {exc}")
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()
    return HostSnapshot(now, "nvml", tuple(gpus), "; ".join(problems) or None)


def _nvml_gpu(nvml: Nvml, i: int, problems: list[str]) -> GpuSnapshot:
    handle = nvml.nvmlDeviceGetHandleByIndex(i)

    def field(what: str, read: Callable[[], T]) -> T | None:
        try:
            return read()
        except nvml.NVMLError_NotSupported:
            return None  # this GPU has no such sensor: normal, not worth a word
        except nvml.NVMLError as exc:
            problems.append(f"GPU {i} {what}: {exc}")
            return None

    util = field("utilization", lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
    mem = field("memory", lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
    power = field("power", lambda: nvml.nvmlDeviceGetPowerUsage(handle))
    limit = field("power limit", lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle))
    procs = field("processes", lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle))
    return GpuSnapshot(
        index=i,
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        name=_text(nvml.nvmlDeviceGetName(handle)),
        util_pct=None if util is None else int(util.gpu),
        mem_used_mb=None if mem is None else int(mem.used) // _MIB,
        mem_total_mb=None if mem is None else int(mem.total) // _MIB,
        temp_c=field(
            "temperature",
            lambda: int(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
        ),
        power_w=None if power is None else power / 1000,
        power_limit_w=None if limit is None else limit / 1000,
        processes=tuple(
            GpuProcess(
                pid=int(p.pid),
                # pynvml gives None where the driver reports "not available" (WDDM, MIG)
                used_mb=None if p.usedGpuMemory is None else int(p.usedGpuMemory) // _MIB,
            )
            for p in procs or ()
        ),
    )


# --- the nvidia-smi fallback --------------------------------------------------------------

GPU_QUERY = (
    "index,uuid,name,utilization.gpu,memory.used,memory.total,"
    "temperature.gpu,power.draw,power.limit"
)
APPS_QUERY = "pid,used_memory,gpu_uuid"
_FORMAT = "--format=csv,noheader,nounits"


class SmiUnavailable(Exception):
    """nvidia-smi is absent or cannot reach a driver; the message says which."""


SmiRunner = Callable[[Sequence[str]], str]


def run_nvidia_smi(args: Sequence[str]) -> str:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise SmiUnavailable("nvidia-smi not found")
    try:
        proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SmiUnavailable(f"nvidia-smi: {exc}") from exc
    if proc.returncode != 0:
        # e.g. "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
        said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise SmiUnavailable(f"nvidia-smi: {said[0] if said else f'exit {proc.returncode}'}")
    return proc.stdout


def _smi_value(text: str) -> str | None:
    """nvidia-smi writes `[N/A]`, `[Not Supported]`, `N/A`, `[Unknown Error]` for gaps."""
    text = text.strip()
    if not text or text.startswith("[") or text.upper() == "N/A":
        return None
    return text


def _smi_float(text: str) -> float | None:
    value = _smi_value(text)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _smi_int(text: str) -> int | None:
    value = _smi_float(text)
    return None if value is None else round(value)


def parse_smi_gpus(text: str) -> list[GpuSnapshot]:
    """Parses `nvidia-smi --query-gpu=GPU_QUERY --format=csv,noheader,nounits`."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 9 or not parts[0].isdigit():
            continue
        # A name may hold commas; the fields around it are fixed.
        index, uuid, *name, util, used, total, temp, power, limit = parts
        out.append(
            GpuSnapshot(
                index=int(index),
                uuid=uuid,
                name=",".join(name),
                util_pct=_smi_int(util),
                mem_used_mb=_smi_int(used),
                mem_total_mb=_smi_int(total),
                temp_c=_smi_int(temp),
                power_w=_smi_float(power),
                power_limit_w=_smi_float(limit),
            )
        )
    return out


def parse_smi_apps(text: str) -> dict[str, tuple[GpuProcess, ...]]:
    """Parses `nvidia-smi --query-compute-apps=APPS_QUERY ...`, by GPU uuid."""
    found: dict[str, list[GpuProcess]] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[0].isdigit():
            continue
        pid, used, uuid = parts
        found.setdefault(uuid, []).append(GpuProcess(pid=int(pid), used_mb=_smi_int(used)))
    return {uuid: tuple(procs) for uuid, procs in found.items()}


def snapshot_smi(run: SmiRunner, now: datetime) -> HostSnapshot:
    """Raises SmiUnavailable when nvidia-smi cannot list the GPUs."""
    gpus = parse_smi_gpus(run([f"--query-gpu={GPU_QUERY}", _FORMAT]))
    error = None
    try:
        apps = parse_smi_apps(run([f"--query-compute-apps={APPS_QUERY}", _FORMAT]))
    except SmiUnavailable as exc:
        apps, error = {}, f"processes: {exc}"
    with_procs = tuple(replace(g, processes=apps.get(g.uuid, ())) for g in gpus)
    return HostSnapshot(now, "nvidia-smi", with_procs, error)


# --- the probe ------------------------------------------------------------------------


def take_snapshot(
    *,
    load_nvml: Callable[[], Nvml] = load_pynvml,
    run_smi: SmiRunner = run_nvidia_smi,
    clock: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> HostSnapshot:
    """NVML, else nvidia-smi, else a snapshot that says why there is nothing."""
    now = clock()
    try:
        return snapshot_nvml(load_nvml(), now)
    except NvmlUnavailable as exc:
        nvml_reason = str(exc)
    try:
        return snapshot_smi(run_smi, now)
    except SmiUnavailable as exc:
        smi_reason = str(exc)
    return HostSnapshot(now, "none", (), f"{NO_DRIVER} ({nvml_reason}; {smi_reason})")


# --- the reader (bot side) --------------------------------------------------------------


def _opt(doc: dict[str, Any], key: str, kind: type[T]) -> T | None:
    value = doc.get(key)
    if value is None:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{key}: expected {kind.__name__}, got {value!r}")
    return value


def _req(doc: dict[str, Any], key: str, kind: type[T]) -> T:
    value = _opt(doc, key, kind)
    if value is None:
        raise ValueError(f"{key}: missing")
    return value


def parse_snapshot(text: str) -> HostSnapshot | None:
    """The probe's JSON back as a snapshot; None for anything this reader cannot trust
    (not JSON, another schema version, a field of the wrong type), so a host running an
    older or newer probe shows as "no telemetry" rather than as wrong numbers."""
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict) or doc.get("schema_version") != SCHEMA_VERSION:
            return None
        source = _req(doc, "source", str)
        if source not in ("nvml", "nvidia-smi", "none"):
            return None
        taken_at = datetime.fromisoformat(_req(doc, "taken_at", str))
        if taken_at.tzinfo is None:
            return None
        gpus = []
        for g in _req(doc, "gpus", list):
            if not isinstance(g, dict):
                return None
            procs = []
            for p in g.get("processes") or []:
                if not isinstance(p, dict):
                    return None
                procs.append(GpuProcess(pid=_req(p, "pid", int), used_mb=_opt(p, "used_mb", int)))
            gpus.append(
                GpuSnapshot(
                    index=_req(g, "index", int),
                    uuid=_req(g, "uuid", str),
                    name=_req(g, "name", str),
                    util_pct=_opt(g, "util_pct", int),
                    mem_used_mb=_opt(g, "mem_used_mb", int),
                    mem_total_mb=_opt(g, "mem_total_mb", int),
                    temp_c=_opt(g, "temp_c", int),
                    power_w=_opt(g, "power_w", float),
                    power_limit_w=_opt(g, "power_limit_w", float),
                    processes=tuple(procs),
                )
            )
        return HostSnapshot(
            taken_at=taken_at.astimezone(UTC),
            source=source,  # type: ignore[arg-type]  # checked against Source above
            gpus=tuple(gpus),
            error=_opt(doc, "error", str),
        )
    except ValueError:  # json.JSONDecodeError and bad isoformat are ValueErrors too
        return None


# --- the command line ---------------------------------------------------------------------


def _describe(snap: HostSnapshot) -> str:
    def num(value: float | None, unit: str = "") -> str:
        return "n/a" if value is None else f"{value:g}{unit}"

    def pair(used: float | None, total: float | None, unit: str) -> str:
        if used is None and total is None:
            return "n/a"
        return f"{num(used)}/{num(total)} {unit}"

    if not snap.gpus:
        return snap.error or "no NVIDIA GPU found"
    lines = []
    for g in snap.gpus:
        lines.append(
            f"{g.index}: {g.name}  util {num(g.util_pct, '%')}"
            f"  mem {pair(g.mem_used_mb, g.mem_total_mb, 'MiB')}  temp {num(g.temp_c, ' C')}"
            f"  power {pair(g.power_w, g.power_limit_w, 'W')}"
        )
        lines.extend(f"   pid {p.pid}  {num(p.used_mb, ' MiB')}" for p in g.processes)
    if snap.error:
        lines.append(f"(partial: {snap.error})")
    lines.append(f"(from {snap.source} at {snap.taken_at.isoformat(timespec='seconds')})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m training.telemetry",
        description=(
            "One snapshot of this host's NVIDIA GPUs: utilization, memory, temperature,\n"
            "power, and the processes on each GPU with the memory they hold.\n"
            "Reads NVML (nvidia-ml-py) where it loads, else parses nvidia-smi; with\n"
            "neither it says 'no NVIDIA driver' and still exits 0.\n"
            "gpubot runs this on every GPU host and reads the --json document back."
        ),
        epilog=(
            "examples:\n"
            "  python -m training.telemetry          a table to read\n"
            "  python -m training.telemetry --json   the document gpubot parses\n"
            "\n"
            f"JSON (schema_version {SCHEMA_VERSION}):\n"
            "  {schema_version, taken_at, source: nvml|nvidia-smi|none, error,\n"
            "   gpus: [{index, uuid, name, util_pct, mem_used_mb, mem_total_mb, temp_c,\n"
            "           power_w, power_limit_w, processes: [{pid, used_mb}]}]}\n"
            "  MiB, degrees C, watts; a value the GPU does not report is null;\n"
            "  error says what went wrong (with source none: why there are no GPUs)."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print the JSON document instead")
    args = parser.parse_args(argv)
    snap = take_snapshot()
    print(snap.to_json() if args.json else _describe(snap))
    return 0


if __name__ == "__main__":
    sys.exit(main())
