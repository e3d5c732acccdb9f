"""`python -m training.runner` end to end, as separate processes, the way the bot runs it."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.training.conftest import REPO, run_runner, runner_cmd, runner_env
from training.exitcodes import EXIT_DONE, EXIT_PREEMPTED, EXIT_TIME_LIMIT, EXIT_USAGE
from training.status import RunStatus, read_status

# Long enough to interrupt mid-run (~1,300 steps, a few seconds on 2 cores), short enough
# to finish twice in a test.
LONG = ("--recipe", "digits", "--epochs", "60", "--precision", "fp32", "--quiet")


def _final(path: Path) -> RunStatus:
    status = read_status(path)
    assert status is not None, f"no readable status at {path}"
    return status


def _accuracy(status: RunStatus) -> float:
    assert status.summary is not None
    return status.summary.final_metrics["test_accuracy"]


def _sigterm_at(
    args: tuple[str | Path, ...], status_path: Path, step: int, cwd: Path = REPO
) -> tuple[int, str, int]:
    """Starts the runner and sends it SIGTERM once its status file says it is running at
    `step` or later: its exit code, its output, and how often the file was read (each
    read must parse, however often the runner rewrites the file)."""
    proc = subprocess.Popen(
        runner_cmd(*args),
        env=runner_env(),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    polls = 0
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if status_path.exists():
                polled = read_status(status_path)
                assert polled is not None, "a polling reader failed to parse the status file"
                polls += 1
                if polled.state == "running" and polled.step >= step:
                    proc.send_signal(signal.SIGTERM)
                    break
            time.sleep(0.01)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out.decode(), polls


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory: pytest.TempPathFactory) -> RunStatus:
    path = tmp_path_factory.mktemp("fp32") / "status.json"
    done = run_runner("--recipe", "digits", "--precision", "fp32", "--status-file", path)
    assert done.returncode == EXIT_DONE, done.stdout + done.stderr
    return _final(path)


def test_digits_fp32_reaches_95_percent(fp32_run: RunStatus) -> None:
    assert fp32_run.state == "done" and fp32_run.exit_code == EXIT_DONE
    assert _accuracy(fp32_run) >= 0.95
    assert fp32_run.precision == "fp32" and fp32_run.batch_size == 64
    assert fp32_run.samples_per_s is not None and fp32_run.samples_per_s > 0
    assert fp32_run.step == fp32_run.total_steps


def test_digits_bf16_autocast_matches_fp32(tmp_path: Path, fp32_run: RunStatus) -> None:
    path = tmp_path / "status.json"
    done = run_runner("--recipe", "digits", "--precision", "bf16", "--status-file", path)
    assert done.returncode == EXIT_DONE, done.stdout + done.stderr
    bf16 = _final(path)
    assert bf16.precision == "bf16"
    assert _accuracy(bf16) >= 0.95
    assert abs(_accuracy(bf16) - _accuracy(fp32_run)) <= 0.015


def test_auto_precision_says_why(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    done = run_runner("--recipe", "digits", "--epochs", "1", "--status-file", path)
    assert done.returncode == EXIT_DONE, done.stderr
    status = _final(path)
    assert status.precision in ("fp32", "bf16")
    assert status.precision_reason is not None and status.precision_reason.startswith("auto:")
    assert status.precision_reason in done.stdout


def test_sigterm_checkpoints_and_a_restart_resumes_to_the_same_weights(tmp_path: Path) -> None:
    reference_dir = tmp_path / "reference"
    ref = run_runner(*LONG, "--checkpoint-dir", reference_dir, timeout=180)
    assert ref.returncode == EXIT_DONE, ref.stderr

    status_path, ckpt = tmp_path / "status.json", tmp_path / "ckpt"
    args = (*LONG, "--checkpoint-dir", ckpt, "--status-file", status_path, "--status-every", "0.05")
    code, out, polls = _sigterm_at(args, status_path, 150)
    assert code == EXIT_PREEMPTED, out[-3000:]
    stopped = _final(status_path)
    assert stopped.state == "preempted" and stopped.exit_code == EXIT_PREEMPTED
    assert stopped.checkpoint_step is not None and stopped.total_steps is not None
    assert 150 <= stopped.checkpoint_step < stopped.total_steps
    assert polls > 3

    resumed = run_runner(*args, timeout=180)
    assert resumed.returncode == EXIT_DONE, resumed.stderr
    final = _final(status_path)
    assert final.resumed_from_step == stopped.checkpoint_step
    assert final.state == "done" and final.step == final.total_steps
    assert _accuracy(final) >= 0.95
    # Same data order and optimizer state from the checkpoint: bit-identical to no interruption.
    a = torch.load(reference_dir / "latest.pt", weights_only=True)["model"]
    b = torch.load(ckpt / "latest.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_max_minutes_stops_with_a_checkpoint(tmp_path: Path) -> None:
    status_path, ckpt = tmp_path / "status.json", tmp_path / "ckpt"
    done = run_runner(
        "--recipe", "digits", "--epochs", "5000", "--precision", "fp32", "--quiet",
        "--max-minutes", "0.03", "--checkpoint-dir", ckpt, "--status-file", status_path,
    )  # fmt: skip
    assert done.returncode == EXIT_TIME_LIMIT, done.stderr
    status = _final(status_path)
    assert status.state == "time_limit" and status.exit_code == EXIT_TIME_LIMIT
    assert status.checkpoint_step == status.step and 0 < status.step < (status.total_steps or 0)
    assert (ckpt / "latest.pt").exists()


def test_ddp_two_cpu_processes_reach_the_same_accuracy(tmp_path: Path, fp32_run: RunStatus) -> None:
    path = tmp_path / "status.json"
    done = run_runner(
        "--recipe", "digits", "--gpus", "2", "--batch-size", "32", "--precision", "fp32",
        "--status-file", path, "--quiet", timeout=240,
    )  # fmt: skip
    assert done.returncode == EXIT_DONE, done.stdout[-3000:] + done.stderr[-3000:]
    ddp = _final(path)
    assert ddp.world_size == 2 and ddp.effective_batch_size == 64
    assert _accuracy(ddp) >= 0.95
    assert abs(_accuracy(ddp) - _accuracy(fp32_run)) <= 0.015


def test_ddp_ranks_agree_to_stop_on_sigterm_with_a_checkpoint(tmp_path: Path) -> None:
    """The ranks agree on stopping every few steps (not every step): a SIGTERM still
    stops both at one step, with rank 0's checkpoint of that step."""
    status_path, ckpt = tmp_path / "status.json", tmp_path / "ckpt"
    ddp = ("--gpus", "2", "--batch-size", "32", "--status-every", "0.05")
    args = (*LONG, *ddp, "--checkpoint-dir", ckpt, "--status-file", status_path)
    code, out, _ = _sigterm_at(args, status_path, 50)
    assert code == EXIT_PREEMPTED, out[-3000:]
    stopped = _final(status_path)
    assert stopped.state == "preempted" and stopped.world_size == 2
    assert stopped.checkpoint_step == stopped.step
    assert 50 <= stopped.step < (stopped.total_steps or 0)
    saved = torch.load(ckpt / "latest.pt", weights_only=True)
    assert saved["step"] == stopped.step and saved["plan"]["world"] == 2


USER_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    import training
    print("env", os.environ["GPUBOT_PRECISION"], os.environ.get("GPUBOT_CHECKPOINT_DIR"), flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    steps = int(sys.argv[1])
    for step in range(1, steps + 1):
        training.report(step=step, loss=1.0 / step, total_steps=steps, accuracy=step / steps)
        time.sleep(0.02)
        if stop:
            print("saving and stopping", flush=True)
            sys.exit(75)
    if len(sys.argv) > 2:
        raise RuntimeError(sys.argv[2])
    print("finished", flush=True)
    """
)


@pytest.fixture
def user_script(tmp_path: Path) -> Path:
    script = tmp_path / "train.py"
    script.write_text(USER_SCRIPT)
    return script


def test_user_command_reports_through_the_runner(tmp_path: Path, user_script: Path) -> None:
    path = tmp_path / "status.json"
    done = run_runner(
        "--precision", "bf16", "--status-file", path, "--checkpoint-dir", tmp_path / "ck",
        "--", sys.executable, user_script, "20", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == EXIT_DONE, done.stderr
    status = _final(path)
    assert status.kind == "command" and status.state == "done" and status.exit_code == 0
    assert status.step == 20 and status.total_steps == 20 and status.metrics["accuracy"] == 1.0
    assert status.precision == "bf16"
    assert any(line.startswith("env bf16 ") and line.endswith("ck") for line in status.log_tail)
    assert status.log_tail[-1] == "finished"


def test_a_command_runs_supervisor_never_loads_torch(tmp_path: Path) -> None:
    """The supervisor lives as long as the run: with torch loaded it held about 200 MB a
    run, and a host with many command runs live ran out of memory (issue 39). The
    precision is chosen in a short-lived probe instead, and still said."""
    seen = tmp_path / "parent_maps"
    probe = (
        "import os, sys; open(sys.argv[1], 'w').write(open(f'/proc/{os.getppid()}/maps').read())"
    )
    path = tmp_path / "status.json"
    done = run_runner(
        "--status-file", path, "--", sys.executable, "-c", probe, seen, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == EXIT_DONE, done.stderr
    maps = seen.read_text()
    assert "python" in maps  # it was the supervisor's map that was read
    assert "libtorch" not in maps and "torch/lib" not in maps
    status = _final(path)
    assert status.precision == "fp32" and status.device == "cpu"
    assert status.precision_reason is not None and status.precision_reason.startswith("auto: ")


def test_user_command_failure_is_reported_with_its_log(tmp_path: Path, user_script: Path) -> None:
    path = tmp_path / "status.json"
    done = run_runner(
        "--status-file",
        path,
        "--",
        sys.executable,
        user_script,
        "3",
        "boom at the end",
        cwd=tmp_path,
    )
    assert done.returncode == 1
    status = _final(path)
    assert status.state == "failed" and status.exit_code == 1
    assert status.error is not None and "RuntimeError: boom at the end" in status.error
    assert status.step == 3


def test_sigterm_is_forwarded_to_the_user_command(tmp_path: Path, user_script: Path) -> None:
    path = tmp_path / "status.json"
    args = ("--status-file", path, "--", sys.executable, user_script, "100000")
    code, out, _ = _sigterm_at(args, path, 5, cwd=tmp_path)
    assert code == EXIT_PREEMPTED, out[-3000:]
    assert "saving and stopping" in out
    status = _final(path)
    assert status.state == "preempted" and status.exit_code == EXIT_PREEMPTED
    assert status.step >= 5 and "saving and stopping" in status.log_tail


def test_help_teaches_and_bad_usage_is_a_usage_error() -> None:
    shown = run_runner("--help", timeout=30)
    assert shown.returncode == 0
    for needle in ("--recipe", "GPUBOT_PRECISION", "training.report", "75", "resume", "torchrun"):
        assert needle in shown.stdout
    neither = run_runner("--precision", "bf16", timeout=30)
    both = run_runner("--recipe", "digits", "--", "python", "x.py", timeout=30)
    assert neither.returncode == both.returncode == EXIT_USAGE
    assert "exactly one" in both.stderr


@pytest.mark.gpu
def test_cuda_auto_batch_probes_memory_and_scales_lr(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    done = run_runner(
        "--recipe", "digits", "--device", "cuda", "--batch-size", "auto",
        "--effective-batch", "1024", "--status-file", path, "--quiet",
    )  # fmt: skip
    assert done.returncode == EXIT_DONE, done.stderr
    status = _final(path)
    assert status.batch_reason is not None and "tried" in status.batch_reason
    assert status.batch_size is not None and status.effective_batch_size is not None
    assert status.effective_batch_size >= 1024
    assert status.lr == pytest.approx(1e-3 * status.effective_batch_size / 64)
    assert status.peak_gpu_mem_bytes is not None and status.peak_gpu_mem_bytes > 0
    assert status.precision == choose_cuda_precision()


def choose_cuda_precision() -> str:
    major, _ = torch.cuda.get_device_capability(0)
    return "bf16" if major >= 8 else "fp16" if major == 7 else "fp32"


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_mixed_precision_digits(tmp_path: Path, precision: str) -> None:
    path = tmp_path / "status.json"
    done = run_runner(
        "--recipe", "digits", "--device", "cuda", "--precision", precision,
        "--batch-size", "64", "--status-file", path, "--quiet",
    )  # fmt: skip
    assert done.returncode == EXIT_DONE, done.stderr
    status = _final(path)
    assert _accuracy(status) >= 0.95
    assert not [w for w in status.warnings if "collapsed" in w or "in a row" in w]
