"""What the runner costs over a hand-written torch loop: same model, data and precision.

`training.loop.train` (with its status file and checkpoint dir, as the bot runs it) is
set against a plain loop written the way a user would (same model, same AdamW, same
batch and learning rate, same autocast, one evaluation at the end). Two CPU cases:

* ``cpu``: the recipe's reference batch (64), where a step is mostly arithmetic.
* ``cpu_launch_bound``: batch 8, where a step is mostly torch's per-op dispatch: the
  regime of a small model on a GPU, whose step is milliseconds of kernel launches, and
  where every op and Python statement the runner adds to a step shows.

For each, two long-lived worker processes, one per side; the parent alternates them run
by run, swapping who goes first each round, so drift in machine load hits both alike;
interpreter start-up and imports happen once per worker and are not counted. Both
workers get one intra-op thread: on a shared 2-core machine two threads make timings
swing by orders of magnitude with whatever else runs. The figures are the median of
per-round ratios and the ratio of medians.

Beside the times, `count_per_step` counts what a step asks of torch, which no machine's
noise moves: aten ops per step (on a GPU each is a kernel launch, view ops aside) and
host reads per step (``.item()``, ``.tolist()``, ``float(t)``...: on a GPU each waits
for the device to finish everything queued). Counts are the difference of two runs of
different lengths, so set-up, the final evaluation and the checkpoint cancel out; the
runner's status timer is set beyond the run, since its writes are not per-step work.
``tests/training/test_overhead.py`` holds the runner to these counts.

``python -m bench.runner_overhead gpu OUT.json`` is the GPU comparison that
``scripts/gpu_check.sh`` runs (digits, bf16, batch 512, 3,000 steps, each whole call
timed, median of 5 rounds alternating a plain loop, the plain loop with ``loss.item()``
every step, and `training.loop.train`); without a GPU, ``--allow-cpu`` runs a few steps
on the CPU, so the script can be checked anywhere.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

RUNS: Final = 15
PRECISION: Final = "fp32"
GOAL_PCT: Final = 3.0
"""The CPU cases' goal: the runner within this much of the plain loop."""
GPU_GOAL_RATIO: Final = 1.05
HOST_READS: Final = frozenset(
    {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu"}
)
"""Tensor methods that bring a value to the host: on a GPU each waits for the device."""


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    epochs: int
    count_epochs: tuple[int, int]
    """Two run lengths whose difference gives the per-step counts."""


CASES: Final = (
    Case("cpu", batch=64, epochs=40, count_epochs=(2, 4)),
    Case("cpu_launch_bound", batch=8, epochs=6, count_epochs=(1, 2)),
)


def _lr(batch: int) -> float:
    """The runner's learning rate at this batch: the recipe's, scaled linearly."""
    from training.recipes import get_recipe

    recipe = get_recipe("digits")
    return recipe.base_lr * batch / recipe.reference_batch


def plain_run(
    epochs: int,
    batch: int,
    precision: str,
    device: str = "cpu",
    *,
    item_every_step: bool = False,
    min_accuracy: float = 0.8,
) -> int:
    """A user's loop over the digits recipe's model and data; returns the steps taken."""
    import torch
    from torch import nn

    from training.recipes import build_digits_model, load_digits_data

    dev = torch.device(device)
    torch.manual_seed(0)
    data = load_digits_data().to(dev)
    model = build_digits_model().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=_lr(batch), weight_decay=0.0)
    n = len(data.train_x)
    steps = n // batch
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    generator = torch.Generator(device=dev).manual_seed(0)

    def ctx() -> contextlib.AbstractContextManager[object]:
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(dev.type, dtype=dtype)

    model.train()
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator, device=dev)
        for i in range(steps):
            idx = order[i * batch : (i + 1) * batch]
            with ctx():
                loss = nn.functional.cross_entropy(model(data.train_x[idx]), data.train_y[idx])
            torch.autograd.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if item_every_step:
                loss.item()
    model.eval()
    with torch.no_grad(), ctx():
        correct = int((model(data.test_x).argmax(1) == data.test_y).sum())
    accuracy = correct / len(data.test_x)
    assert accuracy >= min_accuracy, f"plain loop reached only {accuracy:.3f}"
    return epochs * steps


def runner_run(
    epochs: int,
    batch: int,
    precision: str,
    device: str = "cpu",
    *,
    workdir: Path | None = None,
    min_accuracy: float = 0.8,
    status_every_s: float = 2.0,
) -> int:
    """`training.loop.train` as the bot runs it (status file, checkpoint dir); its steps.

    The files go to a fresh directory under `workdir` (a fresh checkpoint dir: an old
    checkpoint would be resumed), which the caller removes once the timing is over, so
    that deleting them is not timed."""
    from training.loop import TrainConfig, train

    with contextlib.ExitStack() as stack:
        root = workdir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        run_dir = Path(tempfile.mkdtemp(dir=root))
        result = train(
            TrainConfig(
                recipe="digits",
                precision=precision,
                epochs=epochs,
                batch_size=batch,
                device=device,
                status_file=run_dir / "status.json",
                checkpoint_dir=run_dir / "ckpt",
                status_every_s=status_every_s,
                verbose=False,
            )
        )
    accuracy = result.metrics.get("test_accuracy", 0.0)
    assert result.exit_code == 0 and accuracy >= min_accuracy, result
    return result.step


# -- what a step asks of torch -------------------------------------------------------------


@dataclass
class Tally:
    ops: collections.Counter[str]
    reads: collections.Counter[str]
    views: set[str]
    """Ops seen that only make a view or mark a profiler range: no kernel on a GPU."""


@contextlib.contextmanager
def counting() -> Iterator[Tally]:
    """Counts every aten op (by name) and every host read made inside the block."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    tally = Tally(collections.Counter(), collections.Counter(), set())

    class Ops(TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __torch_dispatch__(
            self,
            func: Any,
            types: Any,
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
        ) -> Any:
            name = str(func.overloadpacket)
            tally.ops[name] += 1
            if func.is_view or func.namespace != "aten":
                tally.views.add(name)
            return func(*args, **(kwargs or {}))

    class Reads(TorchFunctionMode):
        def __torch_function__(
            self,
            func: Any,
            types: Any,
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
        ) -> Any:
            name = getattr(func, "__name__", "")
            if name in HOST_READS:
                tally.reads[name] += 1
            return func(*args, **(kwargs or {}))

    with Reads(), Ops():  # type: ignore[no-untyped-call]
        yield tally


def count_per_step(
    kind: str,
    batch: int,
    precision: str,
    epochs: tuple[int, int],
    device: str = "cpu",
) -> dict[str, Any]:
    """Aten ops and host reads per step of `kind` ("plain" or "runner"), from the
    difference of runs of `epochs[0]` and `epochs[1]` epochs. ``compute_ops_per_step``
    leaves out views (``detach``, ``t``, ``slice``...), which launch no kernel."""
    run: Callable[[int], int]
    if kind == "plain":
        run = lambda e: plain_run(e, batch, precision, device, min_accuracy=0.0)  # noqa: E731
    else:
        run = lambda e: runner_run(  # noqa: E731
            e, batch, precision, device, min_accuracy=0.0, status_every_s=1e9
        )
    runs = []
    for e in epochs:
        with counting() as tally:
            steps = run(e)
        runs.append((steps, tally))
    (short_steps, short), (long_steps, long) = runs
    steps = long_steps - short_steps
    ops = long.ops.copy()
    ops.subtract(short.ops)
    reads = long.reads.copy()
    reads.subtract(short.reads)
    views = short.views | long.views
    compute = sum(v for k, v in ops.items() if k not in views)
    return {
        "ops_per_step": round(ops.total() / steps, 2),
        "compute_ops_per_step": round(compute / steps, 2),
        "host_reads_per_step": round(reads.total() / steps, 3),
        "by_op": {k: round(v / steps, 3) for k, v in ops.most_common() if v},
        "reads": {k: round(v / steps, 3) for k, v in reads.most_common() if v},
        "steps": [short_steps, long_steps],
    }


# -- the CPU bench ---------------------------------------------------------------------------


def _worker(kind: str, epochs: int, batch: int, precision: str) -> None:
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as workdir:
        for line in sys.stdin:
            if line.strip() != "run":
                break
            start, cpu_start = time.perf_counter(), time.process_time()
            if kind == "plain":
                plain_run(epochs, batch, precision)
            else:
                runner_run(epochs, batch, precision, workdir=Path(workdir))
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            print(f"{wall:.6f} {cpu:.6f}", flush=True)


def _command(*args: object) -> tuple[list[str], dict[str, str], str]:
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return [sys.executable, "-m", "bench.runner_overhead", *map(str, args)], env, root


def _start(kind: str, case: Case, precision: str) -> subprocess.Popen[str]:
    cmd, env, root = _command("worker", kind, case.epochs, case.batch, precision)
    return subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=root
    )


def _time(proc: subprocess.Popen[str]) -> tuple[float, float]:
    """One run's wall time and the worker's CPU time for it."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("run\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError("bench worker died")
    wall, cpu = line.split()
    return float(wall), float(cpu)


def _counts(kind: str, case: Case, precision: str) -> dict[str, Any]:
    """In a process of its own, as the timed workers run."""
    cmd, env, root = _command("count", kind, case.batch, precision, *case.count_epochs)
    done = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, check=True)
    counts: dict[str, Any] = json.loads(done.stdout)
    return counts


def _time_case(case: Case, runs: int, precision: str) -> dict[str, Any]:
    workers = {kind: _start(kind, case, precision) for kind in ("plain", "runner")}
    try:
        for proc in workers.values():  # warm-up: first-call costs (dynamo import, caches)
            _time(proc)
        times: dict[str, list[tuple[float, float]]] = {"plain": [], "runner": []}
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
    figures: dict[str, Any] = {}
    for i, clock in enumerate(("wall", "cpu")):
        plain = [t[i] for t in times["plain"]]
        runner = [t[i] for t in times["runner"]]
        ratios = [r / p for r, p in zip(runner, plain, strict=True)]
        figures[clock] = {
            "ratio_median": round(statistics.median(ratios), 4),
            "ratio_of_medians": round(statistics.median(runner) / statistics.median(plain), 4),
            "plain_s": [round(t, 4) for t in plain],
            "runner_s": [round(t, 4) for t in runner],
        }
    return {
        **figures,
        "runs": runs,
        "workload": f"digits MLP, {case.epochs} epochs, batch {case.batch}, {precision}, "
        "CPU, 1 thread; runner with status file and checkpoint dir (final checkpoint "
        "included)",
    }


def run(runs: int = RUNS, precision: str = PRECISION) -> dict[str, object]:
    figures: dict[str, object] = {"goal_pct": GOAL_PCT, "precision": precision}
    for case in CASES:
        figures[case.name] = {
            **_time_case(case, runs, precision),
            "counts": {kind: _counts(kind, case, precision) for kind in ("plain", "runner")},
        }
    return figures


def headline(figures: dict[str, object]) -> list[str]:
    lines = []
    for case in CASES:
        f: dict[str, Any] = figures[case.name]  # type: ignore[assignment]
        counts = f["counts"]
        lines.append(
            f"{case.name} (batch {case.batch}): runner/plain {f['wall']['ratio_median']:.3f} "
            f"wall, {f['cpu']['ratio_median']:.3f} CPU time (medians of rounds; goal <= "
            f"{1 + GOAL_PCT / 100:.2f}); per step "
            f"{counts['runner']['ops_per_step']:g} vs {counts['plain']['ops_per_step']:g} "
            f"aten ops ({counts['runner']['compute_ops_per_step']:g} vs "
            f"{counts['plain']['compute_ops_per_step']:g} not views), "
            f"{counts['runner']['host_reads_per_step']:g} vs "
            f"{counts['plain']['host_reads_per_step']:g} host reads"
        )
    return lines


# -- the GPU comparison (scripts/gpu_check.sh) ---------------------------------------------


def gpu_compare(allow_cpu: bool) -> tuple[dict[str, Any], int]:
    """The figures and the exit status: 0 when the runner is within the goal; without a
    GPU, 3, or with `allow_cpu` a tiny run on the CPU that only checks the script."""
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not allow_cpu:
        return {"error": "no CUDA device (--allow-cpu runs a few steps on the CPU)"}, 3
    tiny = not cuda
    device = "cuda" if cuda else "cpu"
    if tiny:  # on a shared CPU two threads swing timings by orders of magnitude
        torch.set_num_threads(1)
    precision, batch = "bf16", 512
    steps, rounds, warm_steps = (20, 2, 4) if tiny else (3000, 5, 100)
    from training.recipes import load_digits_data

    steps_per_epoch = len(load_digits_data().train_x) // batch
    epochs = steps // steps_per_epoch

    def timed(fn: Callable[[], int]) -> float:
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    accuracy = 0.0 if tiny else 0.9  # 3,000 steps reach ~0.97: below 0.9 something broke
    times: dict[str, list[float]] = {"plain": [], "plain_item": [], "runner": []}
    with tempfile.TemporaryDirectory(prefix="runner-overhead-") as tmp:
        workdir = Path(tmp)
        kinds: dict[str, Callable[[int, float], int]] = {
            "plain": lambda e, a: plain_run(e, batch, precision, device, min_accuracy=a),
            "plain_item": lambda e, a: plain_run(
                e, batch, precision, device, item_every_step=True, min_accuracy=a
            ),
            "runner": lambda e, a: runner_run(
                e, batch, precision, device, workdir=workdir, min_accuracy=a
            ),
        }
        for fn in kinds.values():  # warm-up: CUDA context, cuBLAS handles, imports
            fn(max(1, warm_steps // steps_per_epoch), 0.0)
        names = list(kinds)
        for r in range(rounds):
            for kind in names[r % 3 :] + names[: r % 3]:  # each kind leads in turn
                times[kind].append(timed(functools.partial(kinds[kind], epochs, accuracy)))
    medians = {kind: statistics.median(ts) for kind, ts in times.items()}
    ratio = medians["runner"] / medians["plain"]
    per_round = [r / p for r, p in zip(times["runner"], times["plain"], strict=True)]
    figures: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "workload": f"digits MLP, {precision}, batch {batch}, {epochs * steps_per_epoch} "
        f"steps, whole call timed (data, model, training, evaluation; the runner with "
        f"status file and checkpoint dir), median of {rounds} alternating rounds",
        "seconds": {kind: [round(t, 4) for t in ts] for kind, ts in times.items()},
        "median_s": {kind: round(m, 4) for kind, m in medians.items()},
        "ratio_runner_to_plain": round(ratio, 4),
        "ratio_runner_to_plain_per_round_median": round(statistics.median(per_round), 4),
        "ratio_item_to_plain": round(medians["plain_item"] / medians["plain"], 4),
        "goal_ratio": GPU_GOAL_RATIO,
        "meets_goal": ratio <= GPU_GOAL_RATIO,
        "counts": {
            kind: count_per_step(kind, batch, precision, (2, 10) if tiny else (8, 40), device)
            for kind in ("plain", "runner")
        },
    }
    if tiny:
        figures["note"] = "no GPU: a tiny CPU run that checks the script, not the GPU's ratio"
    return figures, 0 if tiny or figures["meets_goal"] else 1


def main(argv: list[str]) -> int:
    if argv and argv[0] == "worker":
        _worker(argv[1], int(argv[2]), int(argv[3]), argv[4])
        return 0
    if argv and argv[0] == "count":
        kind, batch, precision, e1, e2 = argv[1:6]
        print(json.dumps(count_per_step(kind, int(batch), precision, (int(e1), int(e2)))))
        return 0
    if argv and argv[0] == "gpu":
        parser = argparse.ArgumentParser(prog="python -m bench.runner_overhead gpu")
        parser.add_argument("out", type=Path)
        parser.add_argument(
            "--allow-cpu", action="store_true", help="without a GPU, a few steps on the CPU"
        )
        args = parser.parse_args(argv[1:])
        figures, code = gpu_compare(args.allow_cpu)
        args.out.write_text(json.dumps(figures, indent=1) + "\n")
        print(json.dumps({k: v for k, v in figures.items() if k != "counts"}, indent=1))
        return code
    print(json.dumps(run(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
