"""Helpers for the runner's tests: run `python -m training.runner` as the bot would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def runner_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.pop("GPUBOT_STATUS_FILE", None)
    env.pop("GPUBOT_PRECISION", None)
    # One intra-op thread: these models are tiny, and with two threads a busy neighbour
    # process on a 2-core machine slows torch's thread barriers down by 50x.
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def runner_cmd(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "training.runner", *map(str, args)]


def run_runner(
    *args: str | Path, timeout: float = 120, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        runner_cmd(*args),
        env=runner_env(),
        cwd=cwd or REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def python_exe() -> str:
    return sys.executable
