"""Drives `gpubot shell` as a subprocess through pipes, as a user's script would."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def shell_env(home: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GPUBOT_", "SLACK_", "DATABASE_URL"))
    }
    env.update(
        GPUBOT_HOME=str(home),
        GPUBOT_LOCAL_SLOTS="1",
        GPUBOT_LOCAL_GPUS="none",
        GPUBOT_TICK_SECONDS="0.2",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def gpubot_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "bot.faces.cli", *args]


class ShellProcess:
    def __init__(self, home: Path, user: str = "alice", **env: str) -> None:
        self.proc = subprocess.Popen(
            gpubot_cmd("shell", "--user", user),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=shell_env(home, **env),
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, pattern: str, timeout: float = 30.0) -> str:
        """Waits for an output line matching `pattern`; returns it."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no line matching {pattern!r}; saw:\n" + "\n".join(self.seen))
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            self.seen.append(line)
            if rx.search(line):
                return line

    def close(self, timeout: float = 30.0) -> tuple[int, str]:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        rc = self.proc.wait(timeout=timeout)
        assert self.proc.stderr is not None
        return rc, self.proc.stderr.read()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def run_shell(home: Path, *args: str, script: str) -> subprocess.CompletedProcess[str]:
    """One piped session: feeds `script`, waits for the exit."""
    return subprocess.run(
        gpubot_cmd("shell", *args),
        input=script,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=shell_env(home),
    )
