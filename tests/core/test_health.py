"""bot.domain.health: each check fires on the trouble it names, with the run, what was seen
and a fix, and stays quiet on a healthy run."""

from __future__ import annotations

from bot.domain.health import GpuReading, Observations, judge, summary_lines


def obs(**kw: object) -> Observations:
    base: dict[str, object] = {"run_id": 7, "what": "recipe digits", "gpu_model": "A100"}
    base.update(kw)
    return Observations(**base)  # type: ignore[arg-type]


def curve(*losses: float) -> list[dict[str, float]]:
    return [{"step": float(10 * i), "loss": v} for i, v in enumerate(losses)]


HEALTHY = curve(2.3, 1.9, 1.2, 0.8, 0.6, 0.5, 0.45, 0.4)
BUSY = [GpuReading(92.0, 20_000, 40_000)] * 10


def test_a_healthy_run_raises_nothing() -> None:
    assert judge(obs(history=HEALTHY, samples=BUSY, silent_s=30.0)).alerts == []


def test_nan_losses_are_named_with_the_fix() -> None:
    (alert,) = judge(obs(history=HEALTHY, nonfinite_losses=3)).alerts
    text = alert.text(7, "recipe digits")
    assert alert.key == "nonfinite"
    assert text.startswith("Run #7 (recipe digits): 3 NaN/inf losses")
    assert "lower the learning rate" in text
    (one,) = judge(obs(history=HEALTHY, nonfinite_losses=1)).alerts
    assert one.seen == "1 NaN/inf loss was reported."


def test_a_loss_far_above_its_start_is_diverging() -> None:
    (alert,) = judge(obs(history=curve(2.3, 2.0, 5.0, 9.0), lr=0.5)).alerts
    assert alert.key == "diverging" and "up from 2.3" in alert.seen
    assert "(it is at 0.5) by 10x" in alert.fix


def test_a_loss_that_blew_up_from_the_first_step_is_diverging() -> None:
    """lr 100000 on digits: the first reported loss is already 1e19 and it falls from
    there, so only its size gives it away (a recipe's loss is a cross-entropy)."""
    exploded = curve(1.4e19, 4.5e17, 2.9e9, 7.7e4)
    (alert,) = judge(obs(history=exploded, cross_entropy=True)).alerts
    assert alert.key == "diverging" and "blew up" in alert.seen
    # A script's loss may be an MSE in any units: large and falling is not trouble.
    assert judge(obs(history=exploded)).alerts == []


def test_a_loss_growing_steadily_is_diverging() -> None:
    rising = curve(2.3, 1.0, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
    (alert,) = judge(obs(history=rising)).alerts
    assert alert.key == "diverging" and "grown for 6 reports" in alert.seen
    wobble = curve(2.3, 1.0, 0.5, 0.6, 0.55, 0.7, 0.8, 0.9)
    assert judge(obs(history=wobble)).alerts == []


def test_a_scaler_skip_streak_suggests_bf16_only_where_the_gpu_has_it() -> None:
    said = "GradScaler skipped 9 steps in a row (inf/NaN gradients); fp16 overflow: consider bf16"
    (on_a100,) = judge(obs(warnings=[said])).alerts
    assert on_a100.key == "scaler" and "`--precision bf16`" in on_a100.fix
    (on_v100,) = judge(obs(warnings=[said], gpu_model="V100")).alerts
    assert "bf16" not in on_v100.fix and "lower the learning rate" in on_v100.fix


def test_idle_gpus_for_most_of_the_run_mean_input_bound() -> None:
    samples = [GpuReading(8.0, 5_000, 40_000)] * 8 + [GpuReading(90.0, 5_000, 40_000)] * 2
    (alert,) = judge(obs(history=HEALTHY, samples=samples)).alerts
    assert alert.key == "input_bound" and "DataLoader workers" in alert.fix
    assert judge(obs(history=HEALTHY, samples=samples[:4])).alerts == [], "too few samples"


def test_memory_close_to_full() -> None:
    samples = [*BUSY, GpuReading(95.0, 39_500, 40_000)]
    (alert,) = judge(obs(history=HEALTHY, samples=samples)).alerts
    assert alert.key == "memory" and "99%" in alert.seen


def test_a_run_that_stopped_reporting() -> None:
    (alert,) = judge(obs(history=HEALTHY, silent_s=16 * 60.0)).alerts
    assert alert.key == "silent" and "16 minutes" in alert.seen and "/gpu logs 7" in alert.fix


def test_the_summary_lists_each_alert_once_in_a_fixed_order() -> None:
    assert summary_lines({"silent": "b", "diverging": "a"}) == ["a", "b"]
