"""What the runner adds to a training step, counted, and the health alerts it still raises.

On a GPU a small model's step is milliseconds of kernel launches, so the runner's cost
is what it adds per step: ops (each a kernel launch, views aside) and host reads (each
waits for the device to drain). Both are counted here on CPU, machine-independently,
with the bench's own counters (`bench.runner_overhead`) against its plain loop. The
monitor that keeps them off the step path must still let every alert through: NaN/inf
losses, a diverging loss, a GradScaler skip streak and a collapsing loss scale, judged
by the bot (`bot.domain.health`) from the status file the run leaves.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from bench.runner_overhead import count_per_step, counting, runner_run
from bot.domain.health import Observations, judge
from training.exitcodes import EXIT_DONE, EXIT_FAILED
from training.loop import TrainConfig, TrainResult, _flag_interval, train
from training.precision import AmpMonitor, make_grad_scaler
from training.recipes import RECIPES, build_digits_model, get_recipe
from training.status import RunStatus, read_status


@pytest.mark.parametrize(("batch", "epochs"), [(64, (1, 2)), (512, (4, 8))])
def test_a_runner_step_asks_no_more_of_torch_than_a_plain_loop_step(
    batch: int, epochs: tuple[int, int]
) -> None:
    """Batch 512 is the GPU case of issue 28 (2 steps an epoch: per-epoch work shows)."""
    plain = count_per_step("plain", batch, "fp32", epochs)
    runner = count_per_step("runner", batch, "fp32", epochs)
    # The loss kept for the status: one `detach`, a view; no kernel of the runner's own.
    assert runner["compute_ops_per_step"] <= plain["compute_ops_per_step"] + 0.5, (
        runner["by_op"],
        plain["by_op"],
    )
    assert runner["ops_per_step"] <= plain["ops_per_step"] + 1.5, (runner["by_op"], plain)
    # Host reads (syncs on a GPU): the plain loop's own (CPU AdamW reads its step count),
    # not one more; the runner reads its losses only at status writes, here only the last.
    assert runner["host_reads_per_step"] == plain["host_reads_per_step"], runner["reads"]


@pytest.mark.gpu
def test_on_cuda_a_runner_step_never_waits_for_the_gpu() -> None:
    """CUDA's own sync detector over runs of two lengths: the longer one makes no more
    synchronizing calls (the data order's pinned copies, the held losses: none waits)."""
    syncs = []
    for epochs in (4, 12):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                runner_run(epochs, 512, "bf16", "cuda", min_accuracy=0.0, status_every_s=1e9)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs.append(sum("synchroniz" in str(w.message) for w in caught))
    assert syncs[0] > 0, "the detector saw the evaluation's and the checkpoint's syncs"
    assert syncs[1] == syncs[0], syncs


def test_the_monitor_holds_losses_without_kernels_or_reads_until_it_is_full() -> None:
    monitor = AmpMonitor(None, capacity=8)
    losses = [torch.tensor(float(i)) for i in range(8)]
    with counting() as held:
        for loss in losses[:7]:
            monitor.after_step(loss)
    assert sum(held.reads.values()) == 0
    assert set(held.ops) <= held.views, held.ops  # detach only
    with counting() as full:
        monitor.after_step(losses[7])  # the eighth fills it: one transfer of all eight
    assert full.reads == {"tolist": 1}
    report = monitor.collect(8)
    assert report.mean_loss == pytest.approx(3.5) and report.nonfinite_losses == 0


def test_with_a_live_scaler_a_step_costs_one_copy_of_the_scale() -> None:
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make_grad_scaler("fp16", torch.device("cpu"))
    monitor = AmpMonitor(scaler)
    loss = model(torch.randn(3, 4)).sum()
    torch.autograd.backward(scaler.scale(loss))
    scaler.step(opt)
    scaler.update()
    with counting() as step:
        monitor.after_step(loss)
    assert sum(step.reads.values()) == 0
    assert {k: v for k, v in step.ops.items() if k not in step.views} == {"aten.clone": 1}


def test_epochs_are_points_of_the_curve_though_read_in_one_window() -> None:
    monitor = AmpMonitor(None)
    for step in range(1, 7):
        monitor.after_step(torch.tensor(float(step)))
        if step % 2 == 0:
            monitor.end_segment(step)
    monitor.after_step(torch.tensor(float("nan")))
    report = monitor.collect(7)
    assert report.points == [(2, 1.5), (4, 3.5), (6, 5.5), (7, None)]
    assert report.mean_loss == pytest.approx(3.5) and report.nonfinite_losses == 1
    assert report.diverged, "a segment of only NaN losses and no scaler cannot recover"
    assert monitor.collect(7).points == [], "nothing new, nothing reported"


def test_ranks_agree_on_stopping_about_every_tenth_of_a_second() -> None:
    assert _flag_interval(0.002) == 50
    assert _flag_interval(0.5) == 1
    assert _flag_interval(1e-6) == 64  # bounded, so a fast run still stops promptly


# -- the alerts, from a whole run's status file ---------------------------------------------


class Poisoned(nn.Module):
    """The digits MLP whose training forward passes number `bad` give inf/NaN logits."""

    def __init__(self, bad: range) -> None:
        super().__init__()
        self.inner = build_digits_model()
        self.bad = bad
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(x)
        if self.training:
            self.calls += 1
            if self.calls in self.bad:
                return out * float("inf")
        return out


def _run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    precision: str,
    *,
    bad: range = range(0),
    **cfg: float,
) -> tuple[TrainResult, RunStatus, set[str]]:
    build: Callable[[], nn.Module] = lambda: Poisoned(bad)  # noqa: E731
    recipe = dataclasses.replace(get_recipe("digits"), name="poisoned", build_model=build)
    monkeypatch.setitem(RECIPES, "poisoned", recipe)
    path = tmp_path / "status.json"
    result = train(
        TrainConfig(
            recipe="poisoned",
            precision=precision,
            epochs=int(cfg.pop("epochs", 3)),
            status_file=path,
            verbose=False,
            **cfg,  # type: ignore[arg-type]
        )
    )
    status = read_status(path)
    assert status is not None
    alerts = judge(
        Observations(
            run_id=1,
            what="recipe digits",
            precision=precision,
            history=status.history,
            warnings=status.warnings,
            nonfinite_losses=status.nonfinite_losses,
            lr=status.lr,
            cross_entropy=True,
        )
    ).keys()
    return result, status, alerts


def test_a_healthy_run_raises_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result, status, alerts = _run(tmp_path, monkeypatch, "fp32", status_every_s=1e9)
    assert result.exit_code == EXIT_DONE and alerts == set()
    # Read in one window at the end (the status timer is beyond the run), every epoch is
    # still a point of the curve: 3 epochs of 22 steps.
    assert [p["step"] for p in status.history] == [22, 44, 66]


def test_nan_losses_in_fp32_fail_the_run_soon_and_are_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, status, alerts = _run(
        tmp_path, monkeypatch, "fp32", bad=range(30, 31), epochs=20, status_every_s=0.0
    )
    assert result.exit_code == EXIT_FAILED and status.state == "failed"
    assert status.error is not None and "loss diverged" in status.error
    assert result.step < 40, "the NaN weights are noticed at the next status write"
    assert status.nonfinite_losses >= 1
    assert "nonfinite" in alerts


def test_an_fp16_skip_streak_is_warned_and_the_run_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, status, alerts = _run(tmp_path, monkeypatch, "fp16", bad=range(10, 18))
    assert result.exit_code == EXIT_DONE
    assert status.nonfinite_losses == 8
    assert any("GradScaler skipped 8 steps in a row" in w for w in status.warnings)
    assert not any("collapsed" in w for w in status.warnings)  # 65536 / 2**8 is plenty
    assert alerts == {"nonfinite", "scaler"}


def test_an_fp16_scale_that_collapses_fails_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, status, alerts = _run(tmp_path, monkeypatch, "fp16", bad=range(10, 10_000))
    assert result.exit_code == EXIT_FAILED and status.error is not None
    assert any("loss scale collapsed" in w for w in status.warnings), status.warnings
    assert {"nonfinite", "scaler"} <= alerts


def test_a_diverging_loss_reaches_the_curve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finite but blown up (lr 3): no NaN, so only the curve can tell. A status write
    every step (each queued while the last is written) loses none of the points."""
    result, status, alerts = _run(
        tmp_path, monkeypatch, "fp32", lr=3.0, epochs=1, status_every_s=0.0
    )
    assert result.exit_code == EXIT_DONE and status.nonfinite_losses == 0
    assert [p["step"] for p in status.history] == list(range(1, 23))
    assert alerts == {"diverging"}
