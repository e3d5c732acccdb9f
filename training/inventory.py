"""Which NVIDIA GPUs this host has: `python -m training.inventory --json`.

It lives in `training` because that is the one package allowed to know pynvml
and the one copied to every GPU host; the bot runs it locally or over SSH and
reads the JSON, so the same probe serves this machine and remote hosts.
Order of preference: NVML (nvidia-ml-py), then `nvidia-smi`, then nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str  # as the driver reports it, e.g. "NVIDIA A100-SXM4-40GB"
    memory_mb: int


def _from_nvml() -> list[GpuInfo] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, …
        return None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            if isinstance(name, bytes):
                name = name.decode()
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            out.append(GpuInfo(index=i, name=str(name), memory_mb=int(mem.total) // (1024 * 1024)))
        return out
    finally:
        pynvml.nvmlShutdown()


def parse_nvidia_smi(text: str) -> list[GpuInfo]:
    """Parses `nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits`."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not parts[0].isdigit():
            continue
        try:
            memory = int(float(parts[-1]))
        except ValueError:
            continue
        out.append(GpuInfo(index=int(parts[0]), name=",".join(parts[1:-1]), memory_mb=memory))
    return out


def _from_nvidia_smi() -> list[GpuInfo] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run(
            [exe, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return parse_nvidia_smi(proc.stdout)


def list_gpus() -> list[GpuInfo]:
    for probe in (_from_nvml, _from_nvidia_smi):
        found = probe()
        if found is not None:
            return found
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m training.inventory",
        description="List this host's NVIDIA GPUs (NVML, else nvidia-smi).",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (the bot reads this)")
    args = parser.parse_args(argv)
    gpus = list_gpus()
    if args.json:
        print(json.dumps({"gpus": [asdict(g) for g in gpus]}))
    elif not gpus:
        print("no NVIDIA GPU found (no driver, or no device)")
    else:
        for g in gpus:
            print(f"{g.index}: {g.name} ({g.memory_mb} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
