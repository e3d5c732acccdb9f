"""The telemetry probe: NVML on a recorded-snapshot double (real pynvml where a GPU is),
nvidia-smi output as the driver prints it, and the host with neither."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pynvml
import pytest

from tests.training.conftest import REPO, runner_env
from training.telemetry import (
    NO_DRIVER,
    GpuProcess,
    GpuSnapshot,
    HostSnapshot,
    Nvml,
    NvmlUnavailable,
    SmiUnavailable,
    parse_smi_apps,
    parse_smi_gpus,
    parse_snapshot,
    run_nvidia_smi,
    snapshot_nvml,
    take_snapshot,
)

NOW = datetime(2026, 3, 2, 10, 0, tzinfo=UTC)
MIB = 1024 * 1024


# --- the recorded-snapshot double ---------------------------------------------------------


@dataclass
class _Util:
    gpu: int
    memory: int


@dataclass
class _Mem:
    total: int
    used: int
    free: int


@dataclass
class _Proc:
    pid: int
    usedGpuMemory: int | None


@dataclass
class RecordedGpu:
    """One GPU as pynvml reported it; an exception instance stands for a call that raised."""

    name: bytes | str
    uuid: str
    util: _Util | Exception
    mem: _Mem
    temp: int | Exception
    power_mw: int | Exception
    limit_mw: int | Exception
    procs: list[_Proc] | Exception = field(default_factory=list)


class RecordedNvml:
    """The pynvml calls the probe makes, answered from a recording, raising pynvml's own
    exception classes where the real library raised them."""

    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported

    def __init__(self, gpus: list[RecordedGpu], init_error: Exception | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.initialised = 0

    @staticmethod
    def _answer(value: Any) -> Any:
        if isinstance(value, Exception):
            raise value
        return value

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> RecordedGpu:
        return self.gpus[index]

    def nvmlDeviceGetName(self, handle: RecordedGpu) -> str | bytes:
        return handle.name

    def nvmlDeviceGetUUID(self, handle: RecordedGpu) -> str:
        return handle.uuid

    def nvmlDeviceGetUtilizationRates(self, handle: RecordedGpu) -> _Util:
        result: _Util = self._answer(handle.util)
        return result

    def nvmlDeviceGetMemoryInfo(self, handle: RecordedGpu) -> _Mem:
        return handle.mem

    def nvmlDeviceGetTemperature(self, handle: RecordedGpu, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        result: int = self._answer(handle.temp)
        return result

    def nvmlDeviceGetPowerUsage(self, handle: RecordedGpu) -> int:
        result: int = self._answer(handle.power_mw)
        return result

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: RecordedGpu) -> int:
        result: int = self._answer(handle.limit_mw)
        return result

    def nvmlDeviceGetComputeRunningProcesses(self, handle: RecordedGpu) -> list[_Proc]:
        result: list[_Proc] = self._answer(handle.procs)
        return result


def recorded_two_gpus() -> RecordedNvml:
    """An A100 with two training processes (one whose memory the driver would not say) and
    a T4-like card that does not report power."""
    return RecordedNvml(
        [
            RecordedGpu(
                name=b"NVIDIA A100-SXM4-40GB",
                uuid="GPU-3f4a6b2c-0d1e-4a5b-8c9d-0e1f2a3b4c5d",
                util=_Util(gpu=87, memory=41),
                mem=_Mem(total=40960 * MIB, used=31744 * MIB + 12345, free=0),
                temp=61,
                power_mw=312456,
                limit_mw=400000,
                procs=[_Proc(4242, 30720 * MIB), _Proc(4243, None)],
            ),
            RecordedGpu(
                name="Tesla T4",
                uuid="GPU-9a8b7c6d-5e4f-4a3b-9c2d-1e0f9a8b7c6d",
                util=_Util(gpu=0, memory=0),
                mem=_Mem(total=15360 * MIB, used=3 * MIB, free=0),
                temp=34,
                power_mw=pynvml.NVMLError_NotSupported(),
                limit_mw=pynvml.NVMLError_NotSupported(),
            ),
        ]
    )


EXPECTED_NVML = HostSnapshot(
    taken_at=NOW,
    source="nvml",
    gpus=(
        GpuSnapshot(
            index=0,
            uuid="GPU-3f4a6b2c-0d1e-4a5b-8c9d-0e1f2a3b4c5d",
            name="NVIDIA A100-SXM4-40GB",
            util_pct=87,
            mem_used_mb=31744,  # bytes floored to whole MiB
            mem_total_mb=40960,
            temp_c=61,
            power_w=312.456,  # milliwatts to watts
            power_limit_w=400.0,
            processes=(GpuProcess(4242, 30720), GpuProcess(4243, None)),
        ),
        GpuSnapshot(
            index=1,
            uuid="GPU-9a8b7c6d-5e4f-4a3b-9c2d-1e0f9a8b7c6d",
            name="Tesla T4",
            util_pct=0,
            mem_used_mb=3,
            mem_total_mb=15360,
            temp_c=34,
            power_w=None,
            power_limit_w=None,
            processes=(),
        ),
    ),
    error=None,
)


def test_the_recorded_double_has_the_shape_of_pynvml() -> None:
    # Every call the probe makes exists in the real module with the double's name.
    for name in dir(RecordedNvml):
        if name.startswith("nvml") or name.startswith("NVML"):
            assert hasattr(pynvml, name), name


def test_nvml_snapshot_of_two_gpus() -> None:
    nvml = recorded_two_gpus()
    assert snapshot_nvml(nvml, NOW) == EXPECTED_NVML
    assert nvml.initialised == 0  # shut down again


def test_unexpected_nvml_error_on_one_field_is_reported_not_fatal() -> None:
    nvml = recorded_two_gpus()
    nvml.gpus[1].temp = pynvml.NVMLError_Unknown()
    nvml.gpus[0].procs = pynvml.NVMLError_NoPermission()
    snap = snapshot_nvml(nvml, NOW)
    assert snap.gpus[1].temp_c is None
    assert snap.gpus[1].mem_total_mb == 15360  # the rest of that GPU is still read
    assert snap.gpus[0].processes == ()
    assert (
        snap.error == "GPU 0 processes: Insufficient Permissions; GPU 1 temperature: Unknown Error"
    )


def test_a_lost_gpu_is_left_out_and_named() -> None:
    class LosesGpu1(RecordedNvml):
        def nvmlDeviceGetHandleByIndex(self, index: int) -> RecordedGpu:
            if index == 1:
                raise pynvml.NVMLError_GpuIsLost()
            return super().nvmlDeviceGetHandleByIndex(index)

    snap = snapshot_nvml(LosesGpu1(recorded_two_gpus().gpus), NOW)
    assert [g.index for g in snap.gpus] == [0]
    assert snap.error == "GPU 1: GPU is lost"


def test_nvml_that_starts_but_cannot_count_falls_back() -> None:
    class CannotCount(RecordedNvml):
        def nvmlDeviceGetCount(self) -> int:
            raise pynvml.NVMLError_Unknown()

    nvml = CannotCount([])
    snap = take_snapshot(load_nvml=lambda: nvml, run_smi=recorded_smi, clock=lambda: NOW)
    assert (snap.source, len(snap.gpus)) == ("nvidia-smi", 3)
    assert nvml.initialised == 0


# --- nvidia-smi, as the driver prints it ----------------------------------------------------

# `nvidia-smi --query-gpu=index,uuid,name,utilization.gpu,memory.used,memory.total,
#  temperature.gpu,power.draw,power.limit --format=csv,noheader,nounits` on a mixed box:
# an A100 under load, a T4 whose power is not supported, and a GeForce with no limit.
SMI_GPUS = """\
0, GPU-3f4a6b2c-0d1e-4a5b-8c9d-0e1f2a3b4c5d, NVIDIA A100-SXM4-40GB, 87, 31744, 40960, 61, 312.45, 400.00
1, GPU-9a8b7c6d-5e4f-4a3b-9c2d-1e0f9a8b7c6d, Tesla T4, 0, 3, 15360, 34, [Not Supported], [Not Supported]
2, GPU-0011aabb-2233-4ccd-8eef-445566778899, NVIDIA GeForce RTX 3090, [N/A], 0, 24576, 40, 21.07, [N/A]
"""
# `nvidia-smi --query-compute-apps=pid,used_memory,gpu_uuid --format=csv,noheader,nounits`
SMI_APPS = """\
4242, 30720, GPU-3f4a6b2c-0d1e-4a5b-8c9d-0e1f2a3b4c5d
4243, [N/A], GPU-3f4a6b2c-0d1e-4a5b-8c9d-0e1f2a3b4c5d
977, 512, GPU-0011aabb-2233-4ccd-8eef-445566778899
"""


def test_nvidia_smi_gpu_lines() -> None:
    gpus = parse_smi_gpus(SMI_GPUS)
    assert [g.index for g in gpus] == [0, 1, 2]
    a100, t4, geforce = gpus
    assert a100 == GpuSnapshot(
        0,
        "GPU-3f4a6b2c-0d1e-4a5b-8c9d-0e1f2a3b4c5d",
        "NVIDIA A100-SXM4-40GB",
        87,
        31744,
        40960,
        61,
        312.45,
        400.0,
    )
    assert (t4.power_w, t4.power_limit_w, t4.temp_c) == (None, None, 34)
    assert (geforce.util_pct, geforce.power_w, geforce.power_limit_w) == (None, 21.07, None)


def test_nvidia_smi_skips_what_is_not_a_gpu_line() -> None:
    # A header (someone dropped `noheader`), a blank line and a driver message.
    text = "index, uuid, name, utilization.gpu [%], ...\n\nNo devices were found\n"
    assert parse_smi_gpus(text) == []
    assert parse_smi_gpus("1, GPU-x, Odd, Name, 5, 1, 2, 3, 4.0, 5.0\n")[0].name == "Odd,Name"


def test_nvidia_smi_apps_by_gpu() -> None:
    apps = parse_smi_apps(SMI_APPS + "No running processes found\n")
    assert apps == {
        "GPU-3f4a6b2c-0d1e-4a5b-8c9d-0e1f2a3b4c5d": (
            GpuProcess(4242, 30720),
            GpuProcess(4243, None),
        ),
        "GPU-0011aabb-2233-4ccd-8eef-445566778899": (GpuProcess(977, 512),),
    }


def recorded_smi(args: Sequence[str]) -> str:
    if args[0].startswith("--query-gpu="):
        return SMI_GPUS
    if args[0].startswith("--query-compute-apps="):
        return SMI_APPS
    raise AssertionError(args)


def no_nvml_library() -> Nvml:
    return RecordedNvml([], init_error=pynvml.NVMLError_LibraryNotFound())


def test_falls_back_to_nvidia_smi_where_nvml_is_missing() -> None:
    snap = take_snapshot(load_nvml=no_nvml_library, run_smi=recorded_smi, clock=lambda: NOW)
    assert snap.source == "nvidia-smi"
    assert snap.error is None
    assert [len(g.processes) for g in snap.gpus] == [2, 0, 1]
    assert snap.gpus[0].processes == (GpuProcess(4242, 30720), GpuProcess(4243, None))


def test_fallback_keeps_the_gpus_when_only_the_process_query_fails() -> None:
    def apps_fail(args: Sequence[str]) -> str:
        if args[0].startswith("--query-compute-apps="):
            raise SmiUnavailable("nvidia-smi: Unknown Error")
        return SMI_GPUS

    snap = take_snapshot(load_nvml=no_nvml_library, run_smi=apps_fail, clock=lambda: NOW)
    assert (snap.source, len(snap.gpus)) == ("nvidia-smi", 3)
    assert snap.error == "processes: nvidia-smi: Unknown Error"


def test_driver_not_loaded_and_no_nvidia_smi_says_both() -> None:
    def absent(args: Sequence[str]) -> str:
        raise SmiUnavailable("nvidia-smi not found")

    nvml = RecordedNvml([], init_error=pynvml.NVMLError_DriverNotLoaded())
    snap = take_snapshot(load_nvml=lambda: nvml, run_smi=absent, clock=lambda: NOW)
    assert snap.error == "no NVIDIA driver (NVML: Driver Not Loaded; nvidia-smi not found)"


def test_neither_nvml_nor_nvidia_smi_says_no_driver() -> None:
    def absent(args: Sequence[str]) -> str:
        raise SmiUnavailable("nvidia-smi not found")

    def no_bindings() -> Nvml:
        raise NvmlUnavailable("nvidia-ml-py is not installed")

    snap = take_snapshot(load_nvml=no_bindings, run_smi=absent, clock=lambda: NOW)
    assert snap == HostSnapshot(
        NOW, "none", (), "no NVIDIA driver (nvidia-ml-py is not installed; nvidia-smi not found)"
    )


# --- the real nvidia-smi runner, against a stand-in executable on PATH --------------------


def fake_nvidia_smi(directory: Path, body: str) -> None:
    exe = directory / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(0o755)


def test_run_nvidia_smi_reads_the_executable_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "gpus.csv").write_text(SMI_GPUS)
    fake_nvidia_smi(tmp_path, f'case "$1" in --query-gpu=*) cat "{tmp_path}/gpus.csv";; esac')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert parse_smi_gpus(run_nvidia_smi(["--query-gpu=x", "--format=csv"]))[1].name == "Tesla T4"


def test_run_nvidia_smi_turns_a_driver_failure_into_its_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    msg = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    fake_nvidia_smi(tmp_path, f'echo "{msg}"; exit 9')
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SmiUnavailable, match="couldn't communicate"):
        run_nvidia_smi(["--query-gpu=index", "--format=csv"])
    snap = take_snapshot(load_nvml=no_nvml_library)
    assert snap.source == "none"
    assert snap.error is not None and snap.error.startswith(NO_DRIVER)
    assert msg in snap.error


# --- the command, as the bot runs it on a host ------------------------------------------------


def _has_nvidia_driver() -> bool:
    if shutil.which("nvidia-smi"):
        return True
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


needs_no_driver = pytest.mark.skipif(
    _has_nvidia_driver(), reason="this machine has an NVIDIA driver; the no-driver path needs none"
)


def telemetry(*args: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = runner_env()
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        [sys.executable, "-m", "training.telemetry", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


@needs_no_driver
def test_command_on_a_host_without_a_driver() -> None:
    proc = telemetry("--json")
    assert proc.returncode == 0, proc.stderr
    snap = parse_snapshot(proc.stdout)
    assert snap is not None
    assert (snap.source, snap.gpus) == ("none", ())
    assert snap.error is not None and snap.error.startswith("no NVIDIA driver")
    plain = telemetry()
    assert plain.returncode == 0
    assert plain.stdout.startswith("no NVIDIA driver (")


@needs_no_driver
def test_command_falls_back_to_nvidia_smi_end_to_end(tmp_path: Path) -> None:
    (tmp_path / "gpus.csv").write_text(SMI_GPUS)
    (tmp_path / "apps.csv").write_text(SMI_APPS)
    fake_nvidia_smi(
        tmp_path,
        f'case "$1" in --query-gpu=*) cat "{tmp_path}/gpus.csv";;'
        f' --query-compute-apps=*) cat "{tmp_path}/apps.csv";; *) exit 2;; esac',
    )
    proc = telemetry("--json", path=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    snap = parse_snapshot(proc.stdout)
    assert snap is not None, proc.stdout + proc.stderr
    assert snap.source == "nvidia-smi"
    assert [g.name for g in snap.gpus] == [
        "NVIDIA A100-SXM4-40GB",
        "Tesla T4",
        "NVIDIA GeForce RTX 3090",
    ]
    assert snap.gpus[2].processes == (GpuProcess(977, 512),)
    table = telemetry(path=f"{tmp_path}{os.pathsep}{os.environ['PATH']}").stdout
    assert "1: Tesla T4  util 0%  mem 3/15360 MiB  temp 34 C  power n/a" in table
    assert "   pid 4243  n/a\n" in table
    assert (
        "2: NVIDIA GeForce RTX 3090  util n/a  mem 0/24576 MiB  temp 40 C  power 21.07/n/a W"
        in table
    )


def test_help_teaches_the_command() -> None:
    proc = telemetry("--help")
    assert proc.returncode == 0
    for words in ("--json", "nvidia-smi", "no NVIDIA driver", "schema_version", "processes"):
        assert words in proc.stdout


# --- the JSON document --------------------------------------------------------------------


@pytest.mark.parametrize(
    "snap",
    [
        EXPECTED_NVML,
        HostSnapshot(NOW, "none", (), "no NVIDIA driver (x; y)"),
        HostSnapshot(NOW, "nvidia-smi", tuple(parse_smi_gpus(SMI_GPUS)), "processes: z"),
    ],
)
def test_json_round_trip(snap: HostSnapshot) -> None:
    text = snap.to_json()
    assert json.loads(text)["schema_version"] == 1
    assert parse_snapshot(text) == snap


def test_reader_ignores_fields_it_does_not_know() -> None:
    doc = json.loads(EXPECTED_NVML.to_json())
    doc["hostname"] = "gpu-box-1"
    doc["gpus"][0]["fan_pct"] = 30
    assert parse_snapshot(json.dumps(doc)) == EXPECTED_NVML


def test_power_written_as_a_whole_number_reads_as_float() -> None:
    doc = json.loads(EXPECTED_NVML.to_json())
    doc["gpus"][0]["power_limit_w"] = 400
    snap = parse_snapshot(json.dumps(doc))
    assert snap is not None and snap.gpus[0].power_limit_w == 400.0


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.update(schema_version=2),
        lambda d: d.pop("schema_version"),
        lambda d: d.update(source="rocm"),
        lambda d: d.update(taken_at="2026-03-02T10:00:00"),  # naive
        lambda d: d.update(taken_at="yesterday"),
        lambda d: d.update(gpus="none"),
        lambda d: d["gpus"][0].update(util_pct="87%"),
        lambda d: d["gpus"][0].update(index=True),
        lambda d: d["gpus"][0].pop("uuid"),
        lambda d: d["gpus"][0]["processes"][0].update(pid=None),
    ],
)
def test_reader_refuses_what_it_cannot_trust(change: Any) -> None:
    doc = json.loads(EXPECTED_NVML.to_json())
    change(doc)
    assert parse_snapshot(json.dumps(doc)) is None


@pytest.mark.parametrize("text", ["", "not json", "[]", "null", '{"schema_version": 1}'])
def test_reader_refuses_garbage(text: str) -> None:
    assert parse_snapshot(text) is None


# --- the real NVML ------------------------------------------------------------------------


def _used_mb(snap: HostSnapshot) -> int:
    return sum(g.mem_used_mb or 0 for g in snap.gpus)


@pytest.mark.gpu
def test_real_nvml_snapshot() -> None:
    import torch

    snap = take_snapshot()
    assert snap.source == "nvml", snap.error
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        assert len(snap.gpus) == torch.cuda.device_count()
    for g in snap.gpus:
        assert g.uuid.startswith("GPU-")
        assert g.mem_total_mb is not None and g.mem_total_mb > 0
        assert g.util_pct is None or 0 <= g.util_pct <= 100
        assert g.power_limit_w is None or g.power_limit_w > 0
    # 1 GiB on the GPU shows up in NVML's memory figures. (Which pids NVML lists depends
    # on the container's pid namespace, so this process need not appear by its own pid.)
    x = torch.ones(256 * MIB, device="cuda")
    torch.cuda.synchronize()
    held = take_snapshot()
    assert _used_mb(held) >= _used_mb(snap) + 900
    ours = [p for g in held.gpus for p in g.processes if p.pid == os.getpid()]
    assert all(p.used_mb is None or p.used_mb >= 1024 for p in ours)
    del x
    assert parse_snapshot(held.to_json()) == held
