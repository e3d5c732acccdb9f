"""Precision choice, the fp16 + GradScaler path on CPU, and the trouble monitor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from training.precision import (
    AmpMonitor,
    _cpu_has_amx,
    autocast,
    autocast_context,
    choose_precision,
    grad_scaler,
    make_grad_scaler,
    precision_from_env,
)
from training.status import ENV_PRECISION

CPU = torch.device("cpu")


def test_auto_on_cpu_without_amx_is_fp32_and_says_why() -> None:
    choice = choose_precision("auto", CPU)
    if _cpu_has_amx():
        assert choice.precision == "bf16"
    else:
        assert choice.precision == "fp32"
        assert "AMX" in choice.reason and "slower" in choice.reason


def test_explicit_precision_passes_through_and_nonsense_is_refused() -> None:
    assert choose_precision("fp16", CPU).precision == "fp16"
    with pytest.raises(ValueError, match="fp8"):
        choose_precision("fp8", CPU)


def test_grad_scaler_only_for_fp16() -> None:
    assert make_grad_scaler("fp16", CPU).is_enabled()
    assert not make_grad_scaler("bf16", CPU).is_enabled()
    assert not make_grad_scaler("fp32", CPU).is_enabled()


def test_autocast_puts_matmuls_in_the_chosen_dtype() -> None:
    a = torch.randn(4, 4)
    with autocast("bf16", CPU):
        assert (a @ a).dtype == torch.bfloat16
    with autocast("fp32", CPU):
        assert (a @ a).dtype == torch.float32


def test_user_helpers_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_PRECISION, "bf16")
    assert precision_from_env() == "bf16"
    a = torch.randn(4, 4)
    with autocast_context("cpu"):
        assert (a @ a).dtype == torch.bfloat16
    assert not grad_scaler("cpu").is_enabled()
    monkeypatch.setenv(ENV_PRECISION, "fp16")
    assert grad_scaler("cpu").is_enabled()
    monkeypatch.setenv(ENV_PRECISION, "int4")
    with pytest.raises(ValueError, match="int4"):
        precision_from_env()


def _fp16_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    monitor: AmpMonitor,
    x: torch.Tensor,
    y: torch.Tensor,
    poison: float = 1.0,
) -> None:
    with autocast("fp16", CPU):
        loss = nn.functional.cross_entropy(model(x), y) * poison
    torch.autograd.backward(scaler.scale(loss))
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    monitor.after_step(loss)


def test_fp16_with_grad_scaler_trains_on_cpu() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make_grad_scaler("fp16", CPU)
    monitor = AmpMonitor(scaler)
    x = torch.randn(128, 8)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    first = nn.functional.cross_entropy(model(x), y).item()
    for _ in range(60):
        _fp16_step(model, opt, scaler, monitor, x, y)
    report = monitor.collect(60)
    assert report.nonfinite_losses == 0 and report.warnings == []
    assert report.mean_loss is not None
    assert nn.functional.cross_entropy(model(x), y).item() < 0.7 * first


def test_monitor_reports_skipped_streak_collapsing_scale_and_nan() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    monitor = AmpMonitor(scaler)
    x, y = torch.randn(8, 4), torch.zeros(8, dtype=torch.long)
    weights_before = model.weight.detach().clone()
    for _ in range(6):
        _fp16_step(model, opt, scaler, monitor, x, y, poison=float("inf"))
    report = monitor.collect(6)
    assert torch.equal(model.weight, weights_before), "GradScaler must skip inf steps"
    assert report.skipped_steps == 6 and report.longest_skip_streak == 6
    assert report.nonfinite_losses == 6 and report.mean_loss is None
    assert report.loss_scale is not None and report.loss_scale < 1.0
    text = " ".join(report.warnings)
    assert "skipped 6 steps in a row" in text
    assert "loss scale collapsed" in text
    assert "NaN or inf" in text
    _fp16_step(model, opt, scaler, monitor, x, y)  # a healthy step ends the streak
    healthy = monitor.collect(7)
    assert healthy.skipped_steps == 0 and healthy.nonfinite_losses == 0


def test_monitor_without_scaler_counts_nan_losses() -> None:
    monitor = AmpMonitor(None)
    monitor.after_step(torch.tensor(1.0))
    monitor.after_step(torch.tensor(float("nan")))
    report = monitor.collect(2)
    assert report.mean_loss == 1.0 and report.nonfinite_losses == 1
    assert report.skipped_steps == 0


@pytest.mark.gpu
def test_auto_on_cuda_follows_compute_capability() -> None:
    device = torch.device("cuda", 0)
    major, _ = torch.cuda.get_device_capability(device)
    expected = "bf16" if major >= 8 else "fp16" if major == 7 else "fp32"
    assert choose_precision("auto", device).precision == expected


@pytest.mark.gpu
def test_fp16_grad_scaler_and_monitor_on_cuda() -> None:
    torch.manual_seed(0)
    device = torch.device("cuda", 0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = make_grad_scaler("fp16", device)
    monitor = AmpMonitor(scaler)
    x = torch.randn(512, 64, device=device)
    y = torch.randint(0, 10, (512,), device=device)
    for _ in range(50):
        with autocast("fp16", device):
            loss = nn.functional.cross_entropy(model(x), y)
        torch.autograd.backward(scaler.scale(loss))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        monitor.after_step(loss)
    report = monitor.collect(50)
    assert report.nonfinite_losses == 0
    assert report.longest_skip_streak < AmpMonitor.skip_streak_warn
    assert report.loss_scale is not None and report.loss_scale >= 1.0
    assert report.mean_loss is not None and report.mean_loss < 2.3
