"""Running a child process (a user's command, or torchrun) on the run's behalf.

The child gets its own process group, so a SIGTERM for the run reaches the user's whole
process tree (dataloader workers included) and nothing of it is left holding the GPU.
While it runs, the supervisor keeps the status file's heartbeat fresh and its log tail
current; the child's own `training.report` calls fill in step, loss and metrics in the
same file (the status file's lock keeps the two writers from erasing each other).
When it ends, the supervisor writes the final state and exit code, because a user
script that crashed cannot be trusted to have done so.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO

from training.exitcodes import (
    EXIT_DONE,
    EXIT_FAILED,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_TIME_LIMIT,
)
from training.status import TERMINAL_STATES, RunStatus, StatusFile, Summary

_OOM_MARKERS = ("CUDA out of memory", "OutOfMemoryError", "CUBLAS_STATUS_ALLOC_FAILED")
_STATE_CODES = {"done": EXIT_DONE, "preempted": EXIT_PREEMPTED, "time_limit": EXIT_TIME_LIMIT}


@dataclass
class SupervisorConfig:
    heartbeat_s: float = 5.0
    """How often the heartbeat is refreshed while the child is quiet."""
    tail_lines: int = 20
    max_minutes: float | None = None
    kill_after_s: float = 90.0
    """Grace between the forwarded SIGTERM and SIGKILL: a spot notice gives two minutes."""
    child_owns_state: bool = False
    """True when the child is our own recipe (under torchrun): it writes the final state."""


class _Tail:
    """Copies the child's output to ours and keeps its last lines for the status file."""

    def __init__(self, stream: IO[bytes], keep: int) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self.changed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: IO[bytes]) -> None:
        out = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else None
        for raw in iter(stream.readline, b""):
            if out is not None:
                out.write(raw)
                out.flush()
            else:
                sys.stdout.write(raw.decode("utf-8", "replace"))
            with self._lock:
                self.lines.append(raw.decode("utf-8", "replace").rstrip("\r\n")[-500:])
                self.changed = True
        stream.close()

    def snapshot(self) -> list[str]:
        with self._lock:
            self.changed = False
            return list(self.lines)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def supervise(
    cmd: list[str],
    *,
    env: dict[str, str],
    status_path: Path | None,
    initial: RunStatus,
    config: SupervisorConfig | None = None,
) -> int:
    """Run `cmd` to its end; returns the runner's exit code (see `training.exitcodes`)."""
    cfg = config or SupervisorConfig()
    status = StatusFile(status_path) if status_path is not None else None
    wall_start = time.time()
    initial.started_at = initial.started_at or wall_start
    if status is not None:
        status.reset(initial)
    try:
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
    except OSError as error:
        message = f"could not start {cmd[0]!r}: {error}"
        print(f"[gpubot] {message}", file=sys.stderr, flush=True)
        if status is not None:
            status.update(state="failed", error=message, exit_code=EXIT_FAILED)
        return EXIT_FAILED
    assert proc.stdout is not None
    tail = _Tail(proc.stdout, cfg.tail_lines)

    forwarded: list[int] = []
    kill_at = [float("inf")]

    def forward(signum: int, frame: FrameType | None) -> None:
        forwarded.append(signum)
        _signal_group(proc, signal.SIGTERM)
        kill_at[0] = min(kill_at[0], time.monotonic() + cfg.kill_after_s)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    deadline = (
        time.monotonic() + cfg.max_minutes * 60.0 if cfg.max_minutes is not None else float("inf")
    )
    timed_out = False
    try:
        while True:
            now = time.monotonic()
            wait = min(cfg.heartbeat_s, max(0.0, deadline - now), max(0.0, kill_at[0] - now))
            try:
                proc.wait(timeout=max(wait, 0.05))
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if now >= deadline and not timed_out:
                timed_out = True
                _signal_group(proc, signal.SIGTERM)
                kill_at[0] = min(kill_at[0], now + cfg.kill_after_s)
            if now >= kill_at[0]:
                _signal_group(proc, signal.SIGKILL)
            if status is not None:
                status.update(log_tail=tail.snapshot())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    tail.join(timeout=5.0)
    rc = proc.returncode
    child_code = 128 - rc if rc < 0 else rc
    lines = tail.snapshot()

    current = status.read() if status is not None else None
    if cfg.child_owns_state and current is not None and current.state in TERMINAL_STATES:
        state = current.state
        code = _STATE_CODES.get(state, current.exit_code or EXIT_FAILED)
        if state == "failed" and code == EXIT_DONE:
            code = EXIT_FAILED
        reason = current.error
    elif timed_out:
        state, code, reason = "time_limit", EXIT_TIME_LIMIT, None
    elif forwarded:
        state, code, reason = "preempted", EXIT_PREEMPTED, None
    elif child_code == EXIT_DONE:
        state, code, reason = "done", EXIT_DONE, None
    elif child_code in (EXIT_PREEMPTED, EXIT_TIME_LIMIT):
        state = "preempted" if child_code == EXIT_PREEMPTED else "time_limit"
        code, reason = child_code, None
    elif any(marker in line for line in lines for marker in _OOM_MARKERS):
        state, code = "failed", EXIT_OOM
        reason = f"out of GPU memory (exit code {child_code}): {_last_line(lines)}"
    else:
        state, code = "failed", child_code if child_code != EXIT_DONE else EXIT_FAILED
        reason = f"exited with code {child_code}: {_torchrun_cause(lines) or _last_line(lines)}"

    if status is not None:

        def finish(s: RunStatus) -> None:
            s.state = state
            s.exit_code = code
            s.error = reason
            s.log_tail = lines
            if s.summary is None or not cfg.child_owns_state:
                s.summary = Summary(
                    final_metrics=dict(s.metrics),
                    final_loss=s.loss,
                    wall_s=time.time() - wall_start,
                    steps=s.step,
                    samples_per_s=s.samples_per_s,
                )
            if state == "done":
                s.eta_s = 0.0

        status.update(finish)
    if reason:
        print(f"[gpubot] {state}: {reason}", file=sys.stderr, flush=True)
    return code


# torchrun's failure report ends in a "Root Cause" block of "key : value" lines framed
# by rules; its last line is a rule, which says nothing.
_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_ROOT_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


def _torchrun_cause(lines: list[str]) -> str | None:
    """ "worker rank R exited with code N" from torchrun's report, or None without one."""
    rank = code = None
    for line in lines:
        if (m := _ROOT_RANK.match(line)) is not None:
            rank = m.group(1)
        elif (m := _ROOT_EXIT.match(line)) is not None:
            code = m.group(1)
    if code is None:
        return None
    who = f"worker rank {rank}" if rank is not None else "a worker"
    return f"{who} exited with code {code}"


def _last_line(lines: list[str]) -> str:
    for line in reversed(lines):
        if line.strip():
            return line.strip()
    return "(no output)"
