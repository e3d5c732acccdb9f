"""Watching a run while it goes on, and reading it when it ends.

`bot.app.runs.RunService.poll` reads each run's status file and calls `watch` in the same
transaction that stores the run's latest figures. `watch`:

- notes when the step last moved (the bot's clock: a run that stops reporting is seen
  even when its host's clock is off);
- asks `bot.domain.health.judge` about the run's curve, warnings and the telemetry samples
  attributed to it (`GpuSample.run_id`), and DMs the owner each new alert once (the
  outbox's dedupe key makes "once" hold across workers and crashes);
- edits the run's live message (the "started" DM) in place through the outbox: with its
  first figures as soon as the runner has measured some steps, then about once a minute, (`bot.app.outbox.enqueue_edit`), so an edit survives a crash like any message
  and is spaced within Slack's Tier 3 limit for chat.update.

`result_view` builds the final DM (metrics, precision and batch and why, wall time,
GPU-hours and cost, the health summary, a curve chart; for a failure the likely cause)
and `sweep_view` the table that compares a sweep's variants.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

from sqlmodel import Session, col, select

from bot.app.outbox import enqueue, enqueue_edit
from bot.app.watching.runfigures import costs_so_far, gpus_now
from bot.domain import charts, health, views
from bot.domain.durations import format_duration
from db.models import GpuSample, TrainingRun, User
from training.exitcodes import EXIT_TIME_LIMIT, describe_exit
from training.status import RunStatus

LIVE_PERIOD: Final = timedelta(seconds=60)
# With this many runs live at once, each is edited less often so that all of them
# together stay within the edit rate (bot.app.outbox.EDIT_SPACING).
EDITS_PER_MINUTE: Final = 40


def what(run: TrainingRun) -> str:
    """How every reply names a run (`views.run_what`: the command as it was typed)."""
    return views.run_what(run.recipe, run.command)


def _run_samples(s: Session, run_id: int) -> list[GpuSample]:
    return list(
        s.exec(select(GpuSample).where(GpuSample.run_id == run_id).order_by(col(GpuSample.at)))
    )


def cost_so_far(s: Session, run_id: int, now: datetime) -> tuple[float, float]:
    """(USD, GPU-hours) of the run's usage intervals up to `now` (bot.app.watching.runfigures, which
    `/gpu queue` reads for all its runs at once)."""
    return costs_so_far(s, (run_id,), now)[run_id]


def observations(
    s: Session, run: TrainingRun, status: RunStatus, silent_s: float | None
) -> health.Observations:
    assert run.id is not None
    samples = [
        health.GpuReading(x.util_pct, x.mem_used_mb, x.mem_total_mb)
        for x in _run_samples(s, run.id)
    ]
    return health.Observations(
        run_id=run.id,
        what=what(run),
        gpu_model=run.gpu_model,
        precision=status.precision,
        history=status.history,
        warnings=status.warnings,
        nonfinite_losses=status.nonfinite_losses,
        samples=samples,
        silent_s=silent_s,
        lr=status.lr if status.lr is not None else _float(run.options.get("lr")),
        cross_entropy=run.recipe is not None,
    )


def _float(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _progress_state(run: TrainingRun, status: RunStatus, now: datetime) -> float | None:
    """Records when the step last moved; returns how long it has been still (seconds).
    None for a run that never reported a step: a script that does not call
    `training.report` is not "silent", it never spoke."""
    if status.step == 0 and not status.history:
        return None
    seen = run.metrics.get("progress") or {}
    if seen.get("step") != status.step or "at" not in seen:
        run.metrics = {**run.metrics, "progress": {"step": status.step, "at": now.isoformat()}}
        return 0.0
    return (now - datetime.fromisoformat(seen["at"])).total_seconds()


def new_alerts(
    s: Session, run: TrainingRun, status: RunStatus, silent_s: float | None
) -> list[health.Alert]:
    """Alerts the judge raises now that the run has not had yet; recorded on the run."""
    found = health.judge(observations(s, run, status, silent_s))
    had: dict[str, str] = dict(run.metrics.get("alerts") or {})
    fresh = [a for a in found.alerts if a.key not in had]
    if fresh:
        assert run.id is not None
        for a in fresh:
            had[a.key] = a.text(run.id, what(run))
        run.metrics = {**run.metrics, "alerts": had}
    return fresh


def watch(
    s: Session, run: TrainingRun, owner: User, status: RunStatus, now: datetime, live_runs: int
) -> None:
    """One poll's look at a running run (in the caller's transaction, run row locked)."""
    assert run.id is not None
    silent_s = _progress_state(run, status, now) if status.state == "running" else None
    for alert in new_alerts(s, run, status, silent_s):
        text = alert.text(run.id, what(run))
        blocks: tuple[views.Block, ...] = (
            views.Text(("⚠️ " if alert.severity == "warning" else "") + text),
            views.cancel_run_button(run.id),
        )
        enqueue(
            s,
            "dm",
            owner.key,
            views.View(text=text, blocks=blocks),
            now,
            dedupe=f"run-health:{run.id}:{alert.key}",
        )
    live_edit(s, run, owner, status, now, live_runs)


def live_period(live_runs: int) -> timedelta:
    """About once a minute per run; less often when many are live at once."""
    return max(LIVE_PERIOD, timedelta(minutes=max(1, live_runs) / EDITS_PER_MINUTE))


def has_figures(status: RunStatus) -> bool:
    """The runner has measured some steps: a step, and a loss or a speed to show."""
    return status.step > 0 and (status.loss is not None or status.samples_per_s is not None)


def live_edit(
    s: Session, run: TrainingRun, owner: User, status: RunStatus, now: datetime, live_runs: int
) -> bool:
    """Queues an edit of the run's live message when one is due; True when queued. The
    first figures (step, loss, speed) go out as soon as the runner has measured them;
    after them, and for a script that never reports any, an edit every `live_period`
    from the last one (from the start for the first)."""
    live = dict(run.metrics.get("live") or {})
    message = live.get("message")
    if not isinstance(message, int):
        return False
    first_figures = not live.get("figures") and has_figures(status)
    last = live.get("at")
    since = datetime.fromisoformat(last) if isinstance(last, str) else run.started_at
    period = live_period(live_runs)
    if not first_figures and since is not None and now - since < period:
        return False
    usd, _ = cost_so_far(s, run.id or 0, now)
    view = live_view(run, progress_line(s, run, status, now, usd), period)
    enqueue_edit(s, message, owner.key, view, now)
    live.update(at=now.isoformat(), edits=int(live.get("edits", 0)) + 1)
    if has_figures(status):
        live["figures"] = True
    run.metrics = {**run.metrics, "live": live}
    return True


def _gpu_now(s: Session, run_id: int) -> str:
    """Utilization and memory of the run's GPUs at their latest sample (bot.app.watching.runfigures)."""
    return gpus_now(s, (run_id,)).get(run_id, "")


def progress_line(
    s: Session,
    run: TrainingRun,
    status: RunStatus | None,
    now: datetime,
    usd: float,
    gpu: str | None = None,
) -> str:
    """One line of where a running run is: the live message, `/gpu queue` and App Home.
    `gpu`: its GPUs' line when the caller read it already (`bot.app.watching.runfigures.gpus_now`)."""
    m = run.metrics
    step = status.step if status is not None else m.get("step")
    total = status.total_steps if status is not None else m.get("total_steps")
    parts: list[str] = []
    if isinstance(step, int):
        parts.append(f"step {step}/{total}" if isinstance(total, int) else f"step {step}")
    epoch = status.epoch if status is not None else m.get("epoch")
    epochs = status.total_epochs if status is not None else m.get("total_epochs")
    if isinstance(epochs, int) and isinstance(epoch, int):
        parts.append(f"epoch {epoch + 1}/{epochs}")
    loss = status.loss if status is not None else m.get("loss")
    if isinstance(loss, int | float):
        parts.append(f"loss {loss:.4g}")
    rate = status.samples_per_s if status is not None else m.get("samples_per_s")
    if isinstance(rate, int | float):
        parts.append(f"{rate:,.0f} samples/s")
    if gpu is None:
        gpu = _gpu_now(s, run.id or 0)
    if gpu:
        parts.append(gpu)
    if run.started_at is not None:
        parts.append(f"{format_duration(now - run.started_at)} elapsed")
    eta = status.eta_s if status is not None else m.get("eta_s")
    if isinstance(eta, int | float):
        parts.append(f"ETA {format_duration(timedelta(seconds=round(eta)))}")
    parts.append(f"${usd:.2f} so far")
    return ", ".join(parts)


def cadence(period: timedelta) -> str:
    """How often the live message changes, as it really does (`live_edit`)."""
    every = "once a minute" if period <= LIVE_PERIOD else f"every {format_duration(period)}"
    return f"first figures as soon as it has measured some steps, then about {every}"


def live_view(run: TrainingRun, line: str, period: timedelta = LIVE_PERIOD) -> views.View:
    assert run.id is not None
    text = f"Run #{run.id} ({what(run)}) is running: {line}."
    blocks: tuple[views.Block, ...] = (
        views.Text(text),
        views.Context(f"Updated with its {cadence(period)}. `/gpu logs {run.id}` shows its log."),
        views.cancel_run_button(run.id),
    )
    return views.View(text=text, blocks=blocks)


def started_live(s: Session, run: TrainingRun, message_id: int | None) -> None:
    """Remembers which outbox row is the run's live message (its "started" DM)."""
    if message_id is not None:
        run.metrics = {**run.metrics, "live": {"message": message_id, "edits": 0}}


# --- the result --------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What `poll` knows of a run that ended, for its final DM."""

    state: str  # succeeded, failed, cancelled
    exit_code: int | None
    status: RunStatus | None
    log_tail: str
    error: str | None


def _pct_or_num(name: str, value: float) -> str:
    return f"{name} {value:.2%}" if "accuracy" in name else f"{name} {value:.4g}"


def _batch_line(st: RunStatus) -> str | None:
    if st.batch_size is None and st.effective_batch_size is None:
        return None
    line = f"{st.batch_size} per device"
    if st.grad_accum_steps > 1:
        line += f" x {st.grad_accum_steps} accumulated"
    if st.world_size > 1:
        line += f" x {st.world_size} GPUs"
    if st.effective_batch_size is not None:
        line += f" = {st.effective_batch_size} per step"
    if st.batch_reason:
        line += f" ({st.batch_reason})"
    return line


def result_view(
    s: Session, run: TrainingRun, outcome: Outcome, now: datetime
) -> tuple[views.View, tuple[str, bytes] | None]:
    """The final DM and its chart (loss, and accuracy where reported, against steps)."""
    assert run.id is not None
    st = outcome.status
    usd, gpu_hours = cost_so_far(s, run.id, now)
    alerts: dict[str, str] = dict(run.metrics.get("alerts") or {})
    if st is not None and outcome.state != "cancelled":
        for a in health.judge(observations(s, run, st, None)).alerts:
            alerts.setdefault(a.key, a.text(run.id, what(run)))
    run.metrics = {**run.metrics, "alerts": alerts}
    summary = st.summary if st is not None else None
    metrics = dict(summary.final_metrics) if summary is not None else {}
    if not metrics and st is not None:
        metrics = dict(st.metrics)
    shown = ", ".join(_pct_or_num(k, v) for k, v in metrics.items())
    wall = summary.wall_s if summary is not None and summary.wall_s else None
    took = f" in {format_duration(timedelta(seconds=round(wall)))}" if wall else ""
    cost = f"${usd:.2f}" if usd >= 0.005 else "$0.00 (owned host)"
    label = f"Run #{run.id} ({what(run)})"
    warned = [k for k in alerts if k in ("nonfinite", "diverging", "scaler")]
    if outcome.state == "succeeded" and warned:
        head = (
            f"⚠️ {label} finished{took}, but its training went wrong "
            f"({', '.join(_ALERT_WORDS[k] for k in warned)}): {shown or 'no metrics'}. "
            "Do not trust this result."
        )
    elif outcome.state == "succeeded":
        head = f"{label} finished{took}: {shown or 'no metrics reported'}."
    elif outcome.state == "cancelled":
        head = f"{label} was cancelled{took}."
    elif (
        outcome.exit_code == EXIT_TIME_LIMIT
        or outcome.error == "time_limit"
        or (st is not None and st.state == "time_limit")
    ):
        # Not a failure of the run: it reached the --max its owner gave it.
        # (Without --max the limit was the place's: a cluster's says which, as error.)
        limit = (
            f" (--max {format_duration(timedelta(seconds=run.max_seconds))})"
            if run.max_seconds
            else (f" ({outcome.error})" if outcome.error not in (None, "time_limit") else "")
        )
        got = f": {shown}" if shown else ""
        head = f"{label} stopped at its time limit{limit}{took}{got}."
        saved = (run.metrics.get("summary") or {}).get("resume_step")
        if isinstance(saved, int):
            head += (
                f" It saved a checkpoint at step {saved}: `/gpu run --resume {run.id}` goes on "
                "from there (add `--max` to give it longer)."
            )
        elif run.recipe or run.checkpoints:
            head += " It had saved no checkpoint to go on from."
    else:
        code = outcome.exit_code
        status_words = f"exit status {code}" if code is not None else "no exit status"
        head = f"{label} failed ({status_words}): {outcome.error or 'it stopped'}."
    blocks: list[views.Block] = [views.Text(head)]
    facts: list[tuple[str, str]] = []
    if st is not None and st.precision:
        facts.append(
            (
                "precision",
                st.precision + (f" ({st.precision_reason})" if st.precision_reason else ""),
            )
        )
    batch = _batch_line(st) if st is not None else None
    if batch:
        facts.append(("batch", batch))
    if st is not None and st.lr is not None:
        facts.append(("learning rate", f"{st.lr:g}"))
    retry = run.metrics.get("oom_retry")
    if isinstance(retry, dict):
        facts.append(
            (
                "out of memory",
                f"at batch {retry.get('from_batch') or '?'}; retried with "
                f"{retry.get('batch_size') or 'half the batch'}",
            )
        )
    if outcome.state == "failed" and outcome.exit_code != EXIT_TIME_LIMIT:
        facts.append(("exit status", describe_exit(outcome.exit_code)))
    if st is not None and st.step:
        facts.append(("steps", f"{st.step}" + (f"/{st.total_steps}" if st.total_steps else "")))
    if wall:
        facts.append(("wall time", format_duration(timedelta(seconds=round(wall)))))
    # A run on CPU slots (a host without a GPU) held slots, not GPUs: its hours say so.
    hours_word = "CPU-slot hours" if run.placement.get("cpu") else "GPU-hours"
    facts.append((hours_word, f"{gpu_hours:.3f}"))
    facts.append(("cost", cost))
    blocks.append(views.Fields(tuple(facts)))
    if alerts:
        blocks.append(
            views.Text("*Health*\n" + "\n".join(f"• {t}" for t in health.summary_lines(alerts)))
        )
    elif outcome.state == "succeeded":
        blocks.append(views.Context("Health: no NaNs, no divergence, no stalls seen."))
    if outcome.state == "failed" and outcome.log_tail.strip():
        blocks += [
            views.Text("*Last lines of its log*"),
            views.Code(outcome.log_tail.strip()[-2500:]),
        ]
    chart = None
    if st is not None and outcome.state != "cancelled":
        history = list(st.history)
        final = {k: v for k, v in metrics.items() if "acc" in k}
        if final and history:
            history = [*history[:-1], {**history[-1], **final}]
        png = charts.run_curve_chart(
            history, f"Run #{run.id} ({what(run).strip('`')}): loss by step"
        )
        if png is not None:
            chart = (f"run-{run.id}-curve.png", png)
    text = head + f" {hours_word} {gpu_hours:.3f}, cost {cost}."
    return views.View(text=text, blocks=tuple(blocks)), chart


_ALERT_WORDS: Final = {
    "nonfinite": "NaN/inf losses",
    "diverging": "the loss diverged",
    "scaler": "fp16 loss scaling failed",
}


# --- sweeps ------------------------------------------------------------------------------


def sweep_view(label: str, param: str, rows: Sequence[tuple[TrainingRun, float]]) -> views.View:
    """One table for a sweep's variants, best first: by the final accuracy where every
    variant reported one, else by the lowest final loss; a failed or unhealthy variant
    last. `rows`: each run with its cost in USD."""

    def figures(run: TrainingRun) -> tuple[float | None, float | None]:
        summary = run.metrics.get("summary") or {}
        fm = summary.get("final_metrics") or {}
        acc = next((v for k, v in fm.items() if "accuracy" in k), None)
        loss = summary.get("final_loss")
        return (
            float(acc) if isinstance(acc, int | float) else None,
            float(loss) if isinstance(loss, int | float) else None,
        )

    def bad(run: TrainingRun) -> bool:
        alerts = run.metrics.get("alerts") or {}
        return run.state != "succeeded" or any(k in alerts for k in _ALERT_WORDS)

    by_acc = all(figures(r)[0] is not None for r, _ in rows if not bad(r))

    def order(item: tuple[TrainingRun, float]) -> tuple[bool, float]:
        acc, loss = figures(item[0])
        score = -(acc or 0.0) if by_acc else (loss if loss is not None else float("inf"))
        return (bad(item[0]), score)

    ranked = sorted(rows, key=order)
    table = []
    for run, usd in ranked:
        acc, loss = figures(run)
        value = run.options.get(param.replace("-", "_"), run.options.get(param))
        health_word = ", ".join(
            _ALERT_WORDS[k] for k in (run.metrics.get("alerts") or {}) if k in _ALERT_WORDS
        )
        table.append(
            (
                f"#{run.id}",
                f"{param} {value:g}" if isinstance(value, int | float) else param,
                f"{acc:.2%}" if acc is not None else "–",
                f"{loss:.4g}" if loss is not None else "–",
                f"${usd:.2f}",
                run.state if not health_word else f"{run.state}: {health_word}",
            )
        )
    best = ranked[0][0] if ranked and not bad(ranked[0][0]) else None
    text = f"Sweep {label} over {param}: {len(rows)} variants done." + (
        f" Best: run #{best.id} ({table[0][1]})."
        if best is not None
        else " No variant ran cleanly."
    )
    blocks: tuple[views.Block, ...] = (
        views.Header(f"Sweep {label}: {param}"),
        views.Text(text),
        views.Table(("run", "variant", "accuracy", "final loss", "cost", "outcome"), tuple(table)),
    )
    return views.View(text=text, blocks=blocks)


def sweep_done(s: Session, label: str) -> list[tuple[TrainingRun, float]] | None:
    """Every run of the sweep with its cost, once all have ended; None while any is open."""
    rows = list(
        s.exec(select(TrainingRun).where(TrainingRun.sweep == label).order_by(col(TrainingRun.id)))
    )
    if not rows or any(r.finished_at is None for r in rows):
        return None
    return [(r, float(r.metrics.get("cost_usd") or 0.0)) for r in rows]


def metrics_of(status: RunStatus) -> dict[str, Any]:
    """What the run row keeps of its status between polls (queue and Home read it)."""
    return {
        "state": status.state,
        "step": status.step,
        "total_steps": status.total_steps,
        "epoch": status.epoch,
        "total_epochs": status.total_epochs,
        "loss": status.loss,
        "metrics": status.metrics,
        "precision": status.precision,
        "samples_per_s": status.samples_per_s,
        "eta_s": status.eta_s,
    }


def close_live(s: Session, run: TrainingRun, owner: User, now: datetime) -> None:
    """The live message's last edit: where the run ended, pointing at the result."""
    live = run.metrics.get("live") or {}
    message = live.get("message")
    if not isinstance(message, int) or run.id is None:
        return
    ended = {"succeeded": "finished", "failed": "failed", "cancelled": "was cancelled"}
    text = f"Run #{run.id} ({what(run)}) {ended.get(run.state, run.state)}; the result is in the message below."
    enqueue_edit(s, message, owner.key, views.View(text=text, blocks=(views.Text(text),)), now)
