"""The run's status file: one versioned JSON document that the bot reads over SSH.

This is a public contract. The runner (and a user script, through `report`) writes it on
the GPU host; the bot's worker `cat`s it over SSH and turns it into events and DMs.
Imports nothing but the standard library, so the bot can use `read_status` without torch.

Guarantees:

* **Never torn.** Every write goes to a temporary file in the same directory, is fsynced,
  and replaces the old document with `os.replace`, which is atomic on POSIX; a reader
  sees the old document or the new one, never half of either.
* **No lost updates.** Two processes write the file: the runner (state, heartbeat, log
  tail) and, for a user command, the user's script (step, loss, metrics). Writers
  read-modify-write under an advisory lock (``<file>.lock``), so neither erases the
  other's fields. Readers take no lock.
* **Versioned.** ``schema_version`` changes only on an incompatible change; fields are
  added without a bump, and readers ignore fields they do not know. `read_status`
  returns None for a version it does not understand rather than guessing.

States (`RunStatus.state`): ``starting`` → ``running`` → one of the terminal states
``done``, ``failed``, ``preempted`` (SIGTERM, checkpointed, resumable) or ``time_limit``
(``--max-minutes`` reached, checkpointed, resumable). See `training.exitcodes` for the
matching exit codes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, get_args

SCHEMA_VERSION: Final = 1

State = Literal["starting", "running", "done", "failed", "preempted", "time_limit"]
STATES: Final[frozenset[str]] = frozenset(get_args(State))
TERMINAL_STATES: Final[frozenset[str]] = frozenset({"done", "failed", "preempted", "time_limit"})

#: Environment variables the runner sets for a user command (and for recipe workers).
ENV_STATUS_FILE: Final = "GPUBOT_STATUS_FILE"
ENV_CHECKPOINT_DIR: Final = "GPUBOT_CHECKPOINT_DIR"
ENV_PRECISION: Final = "GPUBOT_PRECISION"
ENV_PRECISION_REASON: Final = "GPUBOT_PRECISION_REASON"


@dataclass
class Summary:
    """What a finished (or stopped) run amounts to; the bot's "your run finished" DM."""

    final_metrics: dict[str, float] = field(default_factory=dict)
    """Metrics at the end, e.g. ``{"test_accuracy": 0.97}``."""
    final_loss: float | None = None
    """Mean training loss over the last reporting window."""
    wall_s: float = 0.0
    """Wall time of this process's part of the run, start to end, in seconds."""
    steps: int = 0
    """Optimizer steps done in total, including those before a resume."""
    samples_per_s: float | None = None
    """Mean training throughput over this process's part of the run."""


@dataclass
class RunStatus:
    """The whole document. Every field has a default so a partial writer is valid."""

    schema_version: int = SCHEMA_VERSION
    """Format version; see the module docstring for when it changes."""
    state: str = "starting"
    """One of `STATES`."""
    run_id: str | None = None
    """The caller's name for the run (``--run-id``), echoed back."""
    kind: str | None = None
    """``"recipe"`` or ``"command"``."""
    recipe: str | None = None
    """The built-in recipe's name when ``kind == "recipe"``."""
    command: list[str] | None = None
    """The user's argv when ``kind == "command"``."""
    step: int = 0
    """Optimizer steps done so far (global, counting from the run's true start)."""
    total_steps: int | None = None
    """Steps the run will take in all, when known."""
    epoch: int = 0
    """Current epoch, counting from 0."""
    total_epochs: int | None = None
    loss: float | None = None
    """Mean training loss over the last reporting window."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Named figures (accuracy, perplexity...), the latest value of each."""
    samples_per_s: float | None = None
    """Training throughput over the last reporting window, all processes together."""
    eta_s: float | None = None
    """Seconds left at the current throughput, when ``total_steps`` is known."""
    precision: str | None = None
    """``"bf16"``, ``"fp16"`` or ``"fp32"``: what the run actually uses."""
    precision_reason: str | None = None
    """Why that precision: the reason ``auto`` chose it, or that it was requested."""
    batch_size: int | None = None
    """Per-process micro-batch (what goes through the model at once)."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step."""
    effective_batch_size: int | None = None
    """``batch_size * grad_accum_steps * world_size``: samples per optimizer step."""
    lr: float | None = None
    """Learning rate after linear scaling to ``effective_batch_size``."""
    batch_reason: str | None = None
    """How the batch size was chosen (requested, probed, capped...)."""
    world_size: int = 1
    """Training processes (DDP ranks) in the run."""
    device: str | None = None
    """``"cuda"`` or ``"cpu"`` plus the device name where known."""
    peak_gpu_mem_bytes: int | None = None
    """Peak GPU memory allocated by torch on rank 0; None on CPU."""
    started_at: float | None = None
    """Unix time this process started the run."""
    heartbeat_at: float | None = None
    """Unix time of the last write; a stale heartbeat means the run is hung or gone."""
    resumed_from_step: int | None = None
    """The checkpoint step this process resumed from; None on a fresh start."""
    checkpoint_path: str | None = None
    """The latest checkpoint written."""
    checkpoint_step: int | None = None
    """The step that checkpoint holds."""
    warnings: list[str] = field(default_factory=list)
    """Trouble worth telling the user: skipped steps, collapsing loss scale, NaN losses."""
    exit_code: int | None = None
    """The process's exit code, once it ended (see `training.exitcodes`)."""
    error: str | None = None
    """Why a failed run failed, in one or a few lines."""
    log_tail: list[str] = field(default_factory=list)
    """The last lines the run printed (user commands), newest last."""
    history: list[dict[str, float]] = field(default_factory=list)
    """Loss (and metrics) against steps, oldest first: ``{"step": 120, "loss": 0.41,
    "accuracy": 0.9}`` per status write, thinned to at most `HISTORY_POINTS` (every other
    old point is dropped when full, so the whole run stays covered). The bot judges the
    run's health from it and draws the final DM's chart; the file alone carries it, so a
    run that ends between two polls still has its curve."""
    nonfinite_losses: int = 0
    """Losses reported as NaN or inf so far (they are stored as null, JSON has no NaN)."""
    summary: Summary | None = None
    """Set once the run ends (done, or stopped and resumable)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, allow_nan=False)


_FIELD_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "schema_version": (int,),
    "state": (str,),
    "step": (int,),
    "epoch": (int,),
    "grad_accum_steps": (int,),
    "world_size": (int,),
    "metrics": (dict,),
    "warnings": (list,),
    "log_tail": (list,),
    "history": (list,),
    "nonfinite_losses": (int,),
}
_FIELDS: Final = {f.name for f in dataclasses.fields(RunStatus)}
_SUMMARY_FIELDS: Final = {f.name for f in dataclasses.fields(Summary)}


def status_from_dict(data: object) -> RunStatus | None:
    """Build a `RunStatus` from parsed JSON; None when it is not a document we understand."""
    if not isinstance(data, dict):
        return None
    if data.get("schema_version") != SCHEMA_VERSION:
        return None
    for name, types in _FIELD_TYPES.items():
        if name in data and (not isinstance(data[name], types) or isinstance(data[name], bool)):
            return None
    if data.get("state") not in STATES:
        return None
    known = {k: v for k, v in data.items() if k in _FIELDS}
    summary = known.pop("summary", None)
    status = RunStatus(**known)
    if isinstance(summary, dict):
        status.summary = Summary(**{k: v for k, v in summary.items() if k in _SUMMARY_FIELDS})
    return status


def read_status(path: str | os.PathLike[str]) -> RunStatus | None:
    """The current document, or None if there is none yet or it is not one we understand."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        return parse_status(text)
    except (OSError, UnicodeDecodeError):
        return None


def parse_status(text: str) -> RunStatus | None:
    """Parse the document's text (what the bot got from ``cat`` over SSH)."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    try:
        return status_from_dict(data)
    except TypeError:
        return None


def _finite_or_none(value: float | None) -> float | None:
    """JSON has no NaN; a NaN loss is reported as null plus a warning instead."""
    if value is None or value != value or value in (float("inf"), float("-inf")):
        return None
    return value


def _sanitize(status: RunStatus) -> None:
    status.loss = _finite_or_none(status.loss)
    status.samples_per_s = _finite_or_none(status.samples_per_s)
    status.eta_s = _finite_or_none(status.eta_s)
    status.metrics = {
        k: float(v) for k, v in status.metrics.items() if _finite_or_none(float(v)) is not None
    }
    if status.summary is not None:
        status.summary.final_loss = _finite_or_none(status.summary.final_loss)
        status.summary.final_metrics = {
            k: float(v)
            for k, v in status.summary.final_metrics.items()
            if _finite_or_none(float(v)) is not None
        }


def write_status(path: str | os.PathLike[str], status: RunStatus) -> None:
    """Replace the document atomically (temp file in the same dir, fsync, `os.replace`)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    _sanitize(status)
    payload = status.to_json().encode("utf-8") + b"\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), 0o644)  # mkstemp's 0600 would hide it from other readers
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable, so a host crash cannot resurrect the old document."""
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class StatusFile:
    """Read-modify-write access to one status file, safe against the other writer."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def read(self) -> RunStatus | None:
        return read_status(self.path)

    def update(self, change: Callable[[RunStatus], None] | None = None, **fields: Any) -> RunStatus:
        """Apply `fields` (and then `change`) to the current document and write it back.

        Unknown field names raise, so a typo in a writer fails loudly in tests instead of
        silently never reaching the bot.
        """
        unknown = set(fields) - _FIELDS
        if unknown:
            raise TypeError(f"unknown status fields: {sorted(unknown)}")
        with _locked(self.path):
            status = read_status(self.path) or RunStatus()
            for name, value in fields.items():
                setattr(status, name, value)
            if change is not None:
                change(status)
            status.heartbeat_at = time.time()
            write_status(self.path, status)
            return status

    def reset(self, status: RunStatus) -> None:
        """Start a fresh document (a new run or a resumed one) under the lock."""
        with _locked(self.path):
            status.heartbeat_at = time.time()
            write_status(self.path, status)


_Queued = tuple[Callable[[RunStatus], None] | None, dict[str, Any]]


class StatusWriter:
    """A `StatusFile` whose updates are written by a thread of its own, in order.

    A write is a locked read-modify-write with two fsyncs: a few milliseconds on a local
    disk, far more on a network mount, and a training loop that waits for it leaves its
    GPU idle meanwhile. `update` only queues. Updates queued while a write is under way
    go out together in the next one (each applied in turn), so a slow disk means fewer,
    larger writes, never a growing queue. A write's error is raised by the next
    `update`, `flush` or `close`; `flush` returns once everything queued is on disk.
    """

    def __init__(self, status: StatusFile) -> None:
        self.status = status
        self._queue: list[_Queued] = []
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gpubot-status", daemon=True)
        self._thread.start()

    def reset(self, status: RunStatus) -> None:
        """Start a fresh document, after whatever is queued."""
        self.flush()
        self.status.reset(status)

    def update(self, change: Callable[[RunStatus], None] | None = None, **fields: Any) -> None:
        unknown = set(fields) - _FIELDS
        if unknown:  # loudly, in the caller's thread, as `StatusFile.update` does
            raise TypeError(f"unknown status fields: {sorted(unknown)}")
        with self._cond:
            self._raise()
            if self._closed:
                raise RuntimeError("status writer is closed")
            self._queue.append((change, fields))
            self._cond.notify_all()

    def flush(self) -> None:
        with self._cond:
            while self._queue or self._busy:
                self._cond.wait()
            self._raise()

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            self._raise()

    def _raise(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                batch, self._queue = self._queue, []
                self._busy = True

            def apply(status: RunStatus, batch: list[_Queued] = batch) -> None:
                for change, fields in batch:
                    for name, value in fields.items():
                        setattr(status, name, value)
                    if change is not None:
                        change(status)

            error: BaseException | None = None
            try:
                self.status.update(apply)
            except BaseException as exc:  # handed to the caller's thread
                error = exc
            with self._cond:
                self._busy = False
                if error is not None:
                    self._error = error
                self._cond.notify_all()


HISTORY_POINTS: Final = 256


def add_history(status: RunStatus, step: int, loss: float | None, **metrics: float) -> None:
    """Appends one point of the run's curve (finite values only); a point for a step
    already recorded replaces it. Bounded: when full, every other point but the newest is
    dropped, so a long run keeps its whole shape at a coarser grain."""
    point: dict[str, float] = {"step": float(step)}
    if _finite_or_none(loss) is not None:
        point["loss"] = float(loss)  # type: ignore[arg-type]
    for name, value in metrics.items():
        if _finite_or_none(float(value)) is not None:
            point[name] = float(value)
    if len(point) == 1:
        return
    if status.history and status.history[-1].get("step") == point["step"]:
        status.history[-1] = point
    else:
        status.history.append(point)
    if len(status.history) > HISTORY_POINTS:
        last = status.history[-1]
        status.history = [*status.history[:-1:2], last]


def add_warning(status: RunStatus, message: str, limit: int = 20) -> None:
    """Record a warning once; the list is bounded so a looping problem cannot bloat the file."""
    if message not in status.warnings:
        status.warnings.append(message)
        del status.warnings[:-limit]


class _Reporter:
    """State behind `report`: rate-limits writes and derives throughput between calls."""

    min_interval_s: float = 0.5

    def __init__(self) -> None:
        self.pending: dict[str, Any] = {}
        self.pending_metrics: dict[str, float] = {}
        self.last_write = 0.0
        self.last_step: tuple[int, float] | None = None
        self.registered_atexit = False
        self.nonfinite = 0

    def report(self, force: bool, fields: dict[str, Any], metrics: dict[str, float]) -> bool:
        path = os.environ.get(ENV_STATUS_FILE)
        if not path:
            return False
        now = time.monotonic()
        step = fields.get("step")
        if isinstance(step, int):
            if self.last_step is not None and step > self.last_step[0] and now > self.last_step[1]:
                steps_per_s = (step - self.last_step[0]) / (now - self.last_step[1])
                total = fields.get("total_steps", self.pending.get("total_steps"))
                if isinstance(total, int) and steps_per_s > 0:
                    fields.setdefault("eta_s", max(0.0, (total - step) / steps_per_s))
            self.last_step = (step, now)
        loss = fields.get("loss")
        if isinstance(loss, float) and _finite_or_none(loss) is None:
            self.nonfinite += 1
            fields.pop("loss")
        self.pending.update(fields)
        self.pending_metrics.update(metrics)
        if not self.registered_atexit:
            import atexit

            atexit.register(self.flush)
            self.registered_atexit = True
        if force or now - self.last_write >= self.min_interval_s:
            self.flush()
            return True
        return False

    def flush(self) -> None:
        path = os.environ.get(ENV_STATUS_FILE)
        if not path or (not self.pending and not self.pending_metrics and not self.nonfinite):
            return
        pending, metrics = self.pending, self.pending_metrics
        self.pending, self.pending_metrics = {}, {}

        bad = self.nonfinite
        self.nonfinite = 0

        def change(status: RunStatus) -> None:
            if status.state == "starting":
                status.state = "running"
            status.metrics.update(metrics)
            if bad:
                status.nonfinite_losses += bad
                add_warning(status, "training.report got NaN or inf losses")
            step = pending.get("step", status.step)
            if isinstance(step, int):
                add_history(status, step, pending.get("loss"), **metrics)

        StatusFile(path).update(change, **pending)
        self.last_write = time.monotonic()


_reporter = _Reporter()


def report(
    *,
    step: int | None = None,
    loss: float | None = None,
    epoch: int | None = None,
    total_steps: int | None = None,
    samples_per_s: float | None = None,
    force: bool = False,
    **metrics: float,
) -> bool:
    """Tell the bot how a user script is doing, e.g. ``training.report(step=i, loss=l)``.

    Any other keyword is a metric (``accuracy=0.93``). Safe to call every step: writes are
    rate-limited to one per half second (pass ``force=True`` for one that must land now;
    the last pending values are flushed at exit). Outside gpubot (no ``GPUBOT_STATUS_FILE``)
    it does nothing, so the same script runs anywhere. Returns whether it wrote.
    """
    fields: dict[str, Any] = {}
    if step is not None:
        fields["step"] = int(step)
    if loss is not None:
        fields["loss"] = float(loss)
    if epoch is not None:
        fields["epoch"] = int(epoch)
    if total_steps is not None:
        fields["total_steps"] = int(total_steps)
    if samples_per_s is not None:
        fields["samples_per_s"] = float(samples_per_s)
    return _reporter.report(force, fields, {k: float(v) for k, v in metrics.items()})
