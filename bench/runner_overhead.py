"""What the runner costs over a hand-written torch loop: same model, data and precision.

Two long-lived worker processes, one running `training.loop.train` (with its status file
and checkpoint dir, as the bot runs it) and one a plain loop written the way a user
would (same model, same AdamW, same batches in the same order, same autocast, one
evaluation at the end). The parent alternates them run by run, swapping who goes first
each round, so drift in machine load hits both sides alike; interpreter start-up and
imports happen once per worker and are not counted. Both workers get one intra-op
thread: on a shared 2-core machine two threads make timings swing by orders of
magnitude with whatever else runs. The figure is the median of per-round overheads.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNS = 11
EPOCHS = 40
PRECISION = "fp32"


def _plain_run(epochs: int, precision: str) -> float:
    import contextlib

    import torch
    from torch import nn

    from training.recipes import build_digits_model, load_digits_data

    start = time.perf_counter()
    torch.manual_seed(0)
    data = load_digits_data()
    model = build_digits_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    batch = 64
    n = len(data.train_x)
    steps = n // batch
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def ctx() -> contextlib.AbstractContextManager[object]:
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=dtype)

    model.train()
    for epoch in range(epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch))
        for i in range(steps):
            idx = order[i * batch : (i + 1) * batch]
            with ctx():
                loss = nn.functional.cross_entropy(model(data.train_x[idx]), data.train_y[idx])
            torch.autograd.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad(), ctx():
        correct = int((model(data.test_x).argmax(1) == data.test_y).sum())
    assert correct / len(data.test_x) > 0.9
    return time.perf_counter() - start


def _runner_run(epochs: int, precision: str) -> float:
    from training.loop import TrainConfig, train

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        result = train(
            TrainConfig(
                recipe="digits",
                precision=precision,
                epochs=epochs,
                status_file=Path(tmp) / "status.json",
                checkpoint_dir=Path(tmp) / "ckpt",
                verbose=False,
            )
        )
        elapsed = time.perf_counter() - start
    assert result.exit_code == 0 and result.metrics["test_accuracy"] > 0.9
    return elapsed


def _worker(kind: str, epochs: int, precision: str) -> None:
    import torch

    torch.set_num_threads(1)
    run = _plain_run if kind == "plain" else _runner_run
    for line in sys.stdin:
        if line.strip() != "run":
            break
        print(f"{run(epochs, precision):.6f}", flush=True)


def _start(kind: str, epochs: int, precision: str) -> subprocess.Popen[str]:
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return subprocess.Popen(
        [sys.executable, "-m", "bench.runner_overhead", kind, str(epochs), precision],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=root,
    )


def _time(proc: subprocess.Popen[str]) -> float:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("run\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError("bench worker died")
    return float(line)


def run(runs: int = RUNS, epochs: int = EPOCHS, precision: str = PRECISION) -> dict[str, object]:
    workers = {kind: _start(kind, epochs, precision) for kind in ("plain", "runner")}
    try:
        for proc in workers.values():  # warm-up: first-call costs (dynamo import, caches)
            _time(proc)
        times: dict[str, list[float]] = {"plain": [], "runner": []}
        for i in range(runs):
            order = ("plain", "runner") if i % 2 == 0 else ("runner", "plain")
            for kind in order:
                times[kind].append(_time(workers[kind]))
    finally:
        for proc in workers.values():
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    per_round = [
        100.0 * (r / p - 1.0) for r, p in zip(times["runner"], times["plain"], strict=True)
    ]
    plain_median = statistics.median(times["plain"])
    runner_median = statistics.median(times["runner"])
    return {
        "overhead_pct_median": round(statistics.median(per_round), 2),
        "overhead_pct_of_medians": round(100.0 * (runner_median / plain_median - 1.0), 2),
        "goal_pct": 3.0,
        "plain_s": [round(t, 4) for t in times["plain"]],
        "runner_s": [round(t, 4) for t in times["runner"]],
        "plain_median_s": round(plain_median, 4),
        "runner_median_s": round(runner_median, 4),
        "runs": runs,
        "precision": precision,
        "workload": f"digits MLP, {epochs} epochs, batch 64, CPU, 1 thread; runner with "
        "status file and checkpoint dir (final checkpoint included)",
    }


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] in ("plain", "runner"):
        _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    else:
        import json

        print(json.dumps(run(), indent=2))
