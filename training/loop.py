"""The training loop of a built-in recipe: precision, batch plan, checkpoints, status, stops.

On a GPU a small model's step is a few milliseconds of kernel launches, so whatever the
runner adds to a plain ``for batch: loss.backward(); opt.step()`` loop adds to the step
directly, and anything that brings a value to the host (``.item()``, ``.tolist()``, a
plain ``.to(device)`` of host data) makes the host wait for the GPU to drain. So the
step path has no host sync and launches no kernel of the runner's own: each step's loss
is only held (`AmpMonitor`) and read back in one transfer at each status write (every
``status_every_s``) or every 512 steps; the status file is written by a thread of its
own (`StatusWriter`); the data order is made hundreds of steps at a time and copied
without blocking; stop requests (SIGTERM, the time limit, the checkpoint timer) are plain
flag checks, which several ranks agree on by an all-reduce about every 0.1 s rather than
every step. `make bench` (``runner_overhead``) counts a step's ops and host reads
against a hand-written loop's and times both on CPU; ``scripts/gpu_check.sh`` times
both on a GPU.

Data order is a pure function of (seed, epoch), so a resumed run replays the exact batch
sequence from the checkpointed step: interrupted and uninterrupted runs end with the same
weights on CPU.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Final

import torch
from torch import nn

from training import ddp
from training.batch import BatchPlan, find_max_batch, is_oom, plan_batch
from training.checkpoint import load_checkpoint, save_checkpoint
from training.exitcodes import (
    EXIT_DONE,
    EXIT_FAILED,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_TIME_LIMIT,
)
from training.precision import (
    AmpMonitor,
    AmpReport,
    Precision,
    PrecisionChoice,
    autocast,
    choose_precision,
    make_grad_scaler,
)
from training.recipes import Recipe, TensorData, accuracy, get_recipe
from training.status import (
    RunStatus,
    StatusFile,
    StatusWriter,
    Summary,
    add_history,
    add_warning,
)


@dataclass
class TrainConfig:
    recipe: str = "digits"
    precision: str = "auto"
    batch_size: int | None = None
    """Per-process micro-batch; None means ``auto`` (probe on CUDA, reference batch on CPU)."""
    effective_batch: int | None = None
    lr: float | None = None
    """LR at the recipe's reference batch; scaled linearly to the effective batch."""
    epochs: int | None = None
    seed: int = 0
    device: str = "auto"
    status_file: Path | None = None
    checkpoint_dir: Path | None = None
    checkpoint_every_min: float = 10.0
    max_minutes: float | None = None
    status_every_s: float = 2.0
    run_id: str | None = None
    verbose: bool = True


@dataclass
class TrainResult:
    exit_code: int
    state: str
    step: int
    total_steps: int
    metrics: dict[str, float] = field(default_factory=dict)
    resumed_from_step: int | None = None
    precision: str = "fp32"
    plan: BatchPlan | None = None
    error: str | None = None


class StopRequest:
    """Set from a signal handler; read once per step."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum


@contextlib.contextmanager
def _stop_on_signals(stop: StopRequest) -> Any:
    """SIGTERM (spot notice, cancel) and SIGINT stop at the next step, checkpointed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def pick_device(requested: str, info: ddp.DistInfo) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        return torch.device("cuda", info.local_rank % max(1, torch.cuda.device_count()))
    return torch.device(requested)


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index} {torch.cuda.get_device_name(device)}"
    return f"cpu ({torch.get_num_threads()} threads)"


def _log(cfg: TrainConfig, info: ddp.DistInfo, message: str) -> None:
    if cfg.verbose and info.is_main:
        print(f"[gpubot] {message}", flush=True)


ORDER_STEPS: Final = 256
"""Steps of data order made at once (whole epochs, at least this many steps)."""
FLAGS_EVERY_S: Final = 0.1
"""How often (about) the ranks of a distributed run agree on stopping and checkpointing."""
FLAGS_MAX_STEPS: Final = 64


def _step_order(
    seed: int,
    step: int,
    n: int,
    info: ddp.DistInfo,
    plan: BatchPlan,
    steps_per_epoch: int,
    epochs: int,
    device: torch.device,
) -> tuple[list[torch.Tensor], int, int]:
    """This rank's sample indices from the epoch that holds `step` on, one index tensor
    per micro-batch, and the steps they cover: ``(order, first step, end step)``.

    Each epoch's order is a pure function of (seed, epoch): rank r takes every
    world_size-th index of one shared permutation, as DistributedSampler does; the tail
    that does not fill a whole step is dropped. Whole epochs worth `ORDER_STEPS` steps
    are made at once and split into views by one op, so a step only looks up a list (an
    epoch of the digits recipe at batch 512 is 2 steps). On CUDA they travel from pinned
    memory without blocking: a plain ``.to(device)`` would wait for the GPU to finish
    everything queued, a sync in the middle of the step path.
    """
    first = step // steps_per_epoch
    count = min(max(1, -(-ORDER_STEPS // steps_per_epoch)), epochs - first)
    per_epoch = steps_per_epoch * plan.micro_batch * plan.accum_steps
    order = torch.cat(
        [
            torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + e))[
                info.rank :: info.world_size
            ][:per_epoch]
            for e in range(first, first + count)
        ]
    )
    if device.type == "cuda":
        order = order.pin_memory().to(device, non_blocking=True)
    else:
        order = order.to(device)
    micro_batches = list(order.view(-1, plan.micro_batch).unbind(0))
    return micro_batches, first * steps_per_epoch, (first + count) * steps_per_epoch


def _flag_interval(seconds_per_step: float) -> int:
    """Steps until the ranks next agree on their flags: about `FLAGS_EVERY_S` of training.

    Every rank computes it from the same all-reduced figure, so they agree on it too."""
    return max(1, min(FLAGS_MAX_STEPS, int(FLAGS_EVERY_S / max(seconds_per_step, 1e-9))))


def _choose_batch(
    cfg: TrainConfig,
    recipe: Recipe,
    model: nn.Module,
    data: TensorData,
    info: ddp.DistInfo,
    device: torch.device,
    choice: PrecisionChoice,
) -> tuple[BatchPlan, str]:
    n_per_rank = len(data.train_x) // info.world_size
    base_lr = cfg.lr if cfg.lr is not None else recipe.base_lr
    if cfg.batch_size is not None:
        micro, reason = cfg.batch_size, f"{cfg.batch_size} requested"
    elif device.type != "cuda":
        micro = min(recipe.reference_batch, n_per_rank)
        reason = f"auto on {device.type}: no GPU memory to size against; reference batch {micro}"
    else:
        cap = max(1, min(recipe.max_batch, n_per_rank))

        def try_batch(size: int) -> None:
            probe = copy.deepcopy(model)
            optimizer = recipe.make_optimizer(probe, base_lr)
            idx = torch.arange(size, device=device) % len(data.train_x)
            with autocast(choice.precision, device):
                loss = recipe.loss(probe(data.train_x[idx]), data.train_y[idx])
            torch.autograd.backward(loss)
            optimizer.step()
            torch.cuda.synchronize(device)

        search = find_max_batch(try_batch, start=min(8, cap), cap=cap)
        fitted = torch.tensor([search.largest_fit], device=device)
        if info.distributed:
            torch.distributed.all_reduce(fitted, op=torch.distributed.ReduceOp.MIN)
        micro = int(fitted.item())
        if micro < 1:
            raise torch.OutOfMemoryError("even a batch of 1 does not fit in GPU memory")
        torch.cuda.reset_peak_memory_stats(device)
        tried = ", ".join(f"{size}{'' if ok else ' OOM'}" for size, ok in search.tries)
        limit = f"capped at the recipe's {cap}" if search.capped else "largest that fits"
        reason = f"auto: {micro}, {limit} (tried {tried})"
    plan = plan_batch(
        max_micro_batch=micro,
        effective_batch=cfg.effective_batch,
        world_size=info.world_size,
        base_lr=base_lr,
        reference_batch=recipe.reference_batch,
    )
    if plan.effective_batch > len(data.train_x):
        raise ValueError(
            f"effective batch {plan.effective_batch} is larger than the "
            f"{len(data.train_x)} training samples"
        )
    if plan.effective_batch != recipe.reference_batch:
        reason += (
            f"; lr {base_lr:g} scaled x{plan.effective_batch}/{recipe.reference_batch}"
            f" to {plan.lr:g}"
        )
    if plan.accum_steps > 1:
        reason += (
            f"; {plan.accum_steps} accumulation steps for effective batch {plan.effective_batch}"
        )
    return plan, reason


def train(cfg: TrainConfig) -> TrainResult:
    """Run (or resume) one recipe to completion, a stop request, or a failure."""
    info = ddp.DistInfo.from_env()
    device = pick_device(cfg.device, info)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ddp.init_process_group(info, device)
    status_file = (
        StatusFile(cfg.status_file) if cfg.status_file is not None and info.is_main else None
    )
    status = StatusWriter(status_file) if status_file is not None else None
    stop = StopRequest()
    try:
        with _stop_on_signals(stop):
            result = _train(cfg, info, device, status, stop)
        if status is not None:
            status.close()  # the last state is on disk when train returns
        return result
    except Exception as error:
        oom = is_oom(error)
        message = (
            f"out of GPU memory: {error}. Try a smaller --batch-size or --batch-size auto"
            if oom
            else f"{type(error).__name__}: {error}"
        )
        code = EXIT_OOM if oom else EXIT_FAILED
        if status is not None and status_file is not None:
            with contextlib.suppress(Exception):  # what was queued lands first
                status.close()
            status_file.update(state="failed", error=message, exit_code=code)
        _log(cfg, info, f"failed: {message}")
        if not oom:
            raise
        return TrainResult(code, "failed", 0, 0, error=message)
    finally:
        if status is not None:
            with contextlib.suppress(Exception):
                status.close()
        ddp.destroy_process_group()


def _train(
    cfg: TrainConfig,
    info: ddp.DistInfo,
    device: torch.device,
    status: StatusWriter | None,
    stop: StopRequest,
) -> TrainResult:
    wall_start = time.time()
    t_start = time.monotonic()
    recipe = get_recipe(cfg.recipe)
    choice = choose_precision(cfg.precision, device)
    precision: Precision = choice.precision
    _log(cfg, info, f"precision {precision}: {choice.reason}")

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    data = recipe.load_data().to(device)
    model = recipe.build_model().to(device)
    plan, batch_reason = _choose_batch(cfg, recipe, model, data, info, device, choice)
    _log(
        cfg,
        info,
        f"batch {plan.micro_batch} x {plan.accum_steps} x {info.world_size}: {batch_reason}",
    )
    optimizer = recipe.make_optimizer(model, plan.lr)
    scaler = make_grad_scaler(precision, device)

    epochs = cfg.epochs if cfg.epochs is not None else recipe.epochs
    n_train = len(data.train_x)
    steps_per_epoch = n_train // plan.effective_batch
    total_steps = epochs * steps_per_epoch

    step = 0
    resumed_from: int | None = None
    warnings: list[str] = []
    checkpoint = load_checkpoint(cfg.checkpoint_dir, map_location=device)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        if checkpoint.get("scaler"):
            scaler.load_state_dict(checkpoint["scaler"])
        step = resumed_from = int(checkpoint["step"])
        saved_plan = checkpoint.get("plan", {})
        now_plan = {"micro": plan.micro_batch, "accum": plan.accum_steps, "world": plan.world_size}
        if saved_plan != now_plan or checkpoint.get("precision") != precision:
            warnings.append(
                f"resumed with a different setup (was {saved_plan} {checkpoint.get('precision')},"
                f" now {now_plan} {precision}); the data order differs from the original run"
            )
        _log(cfg, info, f"resumed from checkpoint at step {step}")

    train_model: nn.Module = model
    if info.distributed:
        train_model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )

    def write_checkpoint(at_step: int) -> str | None:
        """Rank 0 writes; the barrier keeps the others alive until the file is whole."""
        path: str | None = None
        if cfg.checkpoint_dir is not None and info.is_main:
            path = str(
                save_checkpoint(
                    cfg.checkpoint_dir,
                    {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict() if scaler.is_enabled() else {},
                        "step": at_step,
                        "epoch": at_step // max(1, steps_per_epoch),
                        "total_steps": total_steps,
                        "recipe": recipe.name,
                        "precision": precision,
                        "plan": {
                            "micro": plan.micro_batch,
                            "accum": plan.accum_steps,
                            "world": plan.world_size,
                        },
                    },
                )
            )
        ddp.barrier()
        return path

    if status is not None:
        status.reset(
            RunStatus(
                state="running",
                run_id=cfg.run_id,
                kind="recipe",
                recipe=recipe.name,
                step=step,
                total_steps=total_steps,
                epoch=step // max(1, steps_per_epoch),
                total_epochs=epochs,
                precision=precision,
                precision_reason=choice.reason,
                batch_size=plan.micro_batch,
                grad_accum_steps=plan.accum_steps,
                effective_batch_size=plan.effective_batch,
                lr=plan.lr,
                batch_reason=batch_reason,
                world_size=info.world_size,
                device=describe_device(device),
                started_at=wall_start,
                resumed_from_step=resumed_from,
                checkpoint_path=str(cfg.checkpoint_dir / "latest.pt")
                if checkpoint is not None and cfg.checkpoint_dir is not None
                else None,
                checkpoint_step=resumed_from,
                warnings=list(warnings),
            )
        )

    # Rank 0 alone watches the losses: it is the one that writes the status.
    monitor = AmpMonitor(scaler) if info.is_main else None
    x_all, y_all = data.train_x, data.train_y
    accum = plan.accum_steps
    inv_accum = 1.0 / accum
    loss_fn = recipe.loss
    scaling = scaler.is_enabled()
    amp = autocast(precision, device)  # one context object, entered every step
    distributed = info.distributed
    flag_device = device if device.type == "cuda" else torch.device("cpu")

    now = time.monotonic()
    next_status = now + cfg.status_every_s
    next_checkpoint = now + cfg.checkpoint_every_min * 60.0
    deadline = t_start + cfg.max_minutes * 60.0 if cfg.max_minutes is not None else math.inf
    window_start, window_steps = now, 0
    train_start, first_step = now, step
    last_loss: float | None = None
    checkpoint_path: str | None = None
    checkpoint_step: int | None = None
    stop_state: str | None = None
    order: list[torch.Tensor] = []
    order_start = order_end = step
    diverged = False
    next_flags, flags_at = step + 1, (now, step)

    model.train()
    while step < total_steps:
        if step >= order_end:
            order, order_start, order_end = _step_order(
                cfg.seed, step, n_train, info, plan, steps_per_epoch, epochs, device
            )
        at = (step - order_start) * accum
        if accum == 1:
            idx = order[at]
            with amp:
                loss = loss_fn(train_model(x_all[idx]), y_all[idx])
            torch.autograd.backward(scaler.scale(loss) if scaling else loss)
            step_loss = loss
        else:
            step_loss = torch.zeros((), device=device)
            for micro in range(accum):
                idx = order[at + micro]
                sync = micro == accum - 1 or not distributed
                no_sync = contextlib.nullcontext() if sync else train_model.no_sync()  # type: ignore[operator]
                with no_sync:
                    with amp:
                        loss = loss_fn(train_model(x_all[idx]), y_all[idx]) * inv_accum
                    torch.autograd.backward(scaler.scale(loss) if scaling else loss)
                step_loss = step_loss + loss.detach()
        if scaling:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        window_steps += 1
        now = time.monotonic()

        if monitor is not None:
            monitor.after_step(step_loss)
            if step % steps_per_epoch == 0:
                monitor.end_segment(step)  # each epoch is a point of the curve
            if now >= next_status or step == total_steps:
                amp_report = monitor.collect(step)  # the one host-device sync in a window
                diverged = amp_report.diverged
                for _, mean in amp_report.points:
                    if mean is not None:
                        last_loss = mean
                if amp_report.warnings:
                    _log(cfg, info, "warning: " + "; ".join(amp_report.warnings))
                rate = window_steps / max(now - window_start, 1e-9)
                eta = (total_steps - step) / rate if rate > 0 else None
                if status is not None:

                    def apply(s: RunStatus, report: AmpReport = amp_report) -> None:
                        for w in report.warnings:
                            add_warning(s, w)
                        s.nonfinite_losses += report.nonfinite_losses
                        for at_step, mean_loss in report.points:
                            add_history(s, at_step, mean_loss)

                    status.update(
                        apply,
                        state="running",
                        step=step,
                        epoch=(step - 1) // steps_per_epoch,
                        loss=last_loss,
                        metrics={"train_loss": last_loss} if last_loss is not None else {},
                        samples_per_s=rate * plan.effective_batch,
                        eta_s=eta,
                        peak_gpu_mem_bytes=_peak_memory(device),
                    )
                if step < total_steps:
                    _log(
                        cfg,
                        info,
                        f"step {step}/{total_steps} epoch {(step - 1) // steps_per_epoch} "
                        f"loss {last_loss if last_loss is not None else float('nan'):.4f} "
                        f"{rate * plan.effective_batch:.0f} samples/s eta {eta or 0:.0f}s",
                    )
                window_start, window_steps = now, 0
                next_status = now + cfg.status_every_s

        if distributed:
            # The ranks agree on stopping every few steps, not every step: agreeing is a
            # collective whose result the host must read, a sync with the device.
            if step < next_flags and step < total_steps:
                continue
            seconds_per_step = (now - flags_at[0]) / max(1, step - flags_at[1])
            flags = torch.tensor(
                [
                    stop.signum is not None,
                    now >= deadline,
                    now >= next_checkpoint,
                    diverged,
                    seconds_per_step,
                ],
                dtype=torch.float64,
                device=flag_device,
            )
            agreed = ddp.any_rank(flags).tolist()
            want_stop, out_of_time, checkpoint_due, diverged = (v > 0 for v in agreed[:4])
            next_flags, flags_at = step + _flag_interval(agreed[4]), (now, step)
        else:
            want_stop = stop.signum is not None
            out_of_time = now >= deadline
            checkpoint_due = now >= next_checkpoint
        if diverged:
            message = "loss diverged: NaN/inf losses with nothing left to recover (see warnings)"
            if status is not None:
                status.update(state="failed", error=message, exit_code=EXIT_FAILED, step=step)
            _log(cfg, info, message)
            return TrainResult(EXIT_FAILED, "failed", step, total_steps, error=message)
        if want_stop or out_of_time:
            stop_state = "preempted" if want_stop else "time_limit"
            break
        if checkpoint_due and step < total_steps:
            checkpoint_path, checkpoint_step = write_checkpoint(step), step
            if status is not None:
                status.update(checkpoint_path=checkpoint_path, checkpoint_step=step)
            next_checkpoint = time.monotonic() + cfg.checkpoint_every_min * 60.0

    train_s = time.monotonic() - train_start
    samples_per_s = (step - first_step) * plan.effective_batch / train_s if train_s > 0 else None
    if step > first_step or checkpoint is None:
        checkpoint_path, checkpoint_step = write_checkpoint(step), step
    elif cfg.checkpoint_dir is not None:
        checkpoint_path = str(cfg.checkpoint_dir / "latest.pt")
        checkpoint_step = step

    if stop_state is not None:
        code = EXIT_PREEMPTED if stop_state == "preempted" else EXIT_TIME_LIMIT
        why = (
            f"signal {stop.signum}"
            if stop_state == "preempted"
            else f"--max-minutes {cfg.max_minutes}"
        )
        _log(
            cfg, info, f"stopped at step {step}/{total_steps} ({why}); checkpoint {checkpoint_path}"
        )
        if status is not None:
            status.update(
                state=stop_state,
                step=step,
                exit_code=code,
                checkpoint_path=checkpoint_path,
                checkpoint_step=checkpoint_step,
                summary=Summary(
                    final_loss=last_loss,
                    wall_s=time.time() - wall_start,
                    steps=step,
                    samples_per_s=samples_per_s,
                ),
            )
        return TrainResult(
            code,
            stop_state,
            step,
            total_steps,
            resumed_from_step=resumed_from,
            precision=precision,
            plan=plan,
        )

    metrics: dict[str, float] = {}
    if info.is_main:
        metrics["test_accuracy"] = accuracy(
            model, data.test_x, data.test_y, lambda: autocast(precision, device)
        )
        if last_loss is not None:
            metrics["train_loss"] = last_loss
    ddp.barrier()
    _log(
        cfg,
        info,
        f"done: step {step}/{total_steps}, "
        + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()),
    )
    if status is not None:
        status.update(
            state="done",
            step=step,
            epoch=epochs - 1,
            metrics=metrics,
            eta_s=0.0,
            samples_per_s=samples_per_s,
            exit_code=EXIT_DONE,
            checkpoint_path=checkpoint_path,
            checkpoint_step=checkpoint_step,
            peak_gpu_mem_bytes=_peak_memory(device),
            summary=Summary(
                final_metrics=metrics,
                final_loss=last_loss,
                wall_s=time.time() - wall_start,
                steps=step,
                samples_per_s=samples_per_s,
            ),
        )
    return TrainResult(EXIT_DONE, "done", step, total_steps, metrics, resumed_from, precision, plan)


def _peak_memory(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
