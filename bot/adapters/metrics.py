"""What operators watch: Prometheus `/metrics` and `/healthz` for `gpubot serve` and
`gpubot worker`.

Two kinds of numbers, kept apart on purpose:

- **State** (queue, reservations, GPUs, instances, spend, outbox) is read from the
  database at scrape time by `DatabaseCollector`. The database is the only memory
  every replica shares, so any replica answers the same, and nothing can drift
  from the truth between scrapes.
- **Events** (Slack and AWS call latency and errors, tick duration) are counted by
  the code as they happen, in this process. They live in a registry of this module,
  never prometheus-client's global one, so tests (and two apps in one process) do
  not collide; each `/metrics` registry forwards them.

AWS calls are timed through botocore's own event system (`instrument_boto3_session`),
registered from the bot side: `provisioning` never imports `bot`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector
from sqlalchemy import func, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import col, select

from bot.app.watching.held import held_gpu_ids
from bot.domain.clock import Clock, SystemClock
from db.models import (
    HOST_STOPPED,
    HOST_TERMINATED,
    Gpu,
    Host,
    Notification,
    Reservation,
    TrainingRun,
)
from db.session import transaction

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
HEALTH_PATH = "/healthz"

# Slack answers in tens of milliseconds, EC2's RunInstances in seconds: one bucket set
# wide enough for both, fine enough at the low end.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# --- events, counted by the code ---------------------------------------------------------

EVENTS = CollectorRegistry(auto_describe=True)

SLACK_SECONDS = Histogram(
    "gpubot_slack_call_seconds",
    "Slack Web API calls made by the notifier, by method.",
    ["method"],
    buckets=_LATENCY_BUCKETS,
    registry=EVENTS,
)
SLACK_ERRORS = Counter(
    "gpubot_slack_call_errors",
    "Slack Web API calls that failed, by method and Slack's error (or the exception type).",
    ["method", "error"],
    registry=EVENTS,
)
AWS_SECONDS = Histogram(
    "gpubot_aws_call_seconds",
    "AWS API calls, by service and operation (retries inside botocore included).",
    ["service", "operation"],
    buckets=_LATENCY_BUCKETS,
    registry=EVENTS,
)
AWS_ERRORS = Counter(
    "gpubot_aws_call_errors",
    "AWS API calls that failed, by service, operation and AWS error code.",
    ["service", "operation", "code"],
    registry=EVENTS,
)
TICK_SECONDS = Histogram(
    "gpubot_tick_seconds",
    "Duration of the leading worker's scheduler tick (expiry, grants, runs, delivery).",
    buckets=_LATENCY_BUCKETS,
    registry=EVENTS,
)
HTTP_REFUSED = Counter(
    "gpubot_http_refused",
    "HTTP requests answered with an error before any listener ran, by reason (unsigned, "
    "too_large, timeout, malformed, ...). Counted, not logged: strangers choose how many.",
    ["reason"],
    registry=EVENTS,
)


@dataclass
class _TickState:
    """What /healthz says about the worker in this process: its role and last tick."""

    role: str = "none"  # none (no worker here), leader, standby
    last_tick: float | None = None  # time.time() of the last tick, standby or not


_tick = _TickState()
_tick_lock = threading.Lock()


def note_tick(leading: bool) -> None:
    """Called by every worker tick, leader or standby: /healthz shows the role and age."""
    with _tick_lock:
        _tick.role = "leader" if leading else "standby"
        _tick.last_tick = time.time()


def tick_state() -> tuple[str, float | None]:
    with _tick_lock:
        age = None if _tick.last_tick is None else max(0.0, time.time() - _tick.last_tick)
        return _tick.role, age


@contextmanager
def slack_call(method: str) -> Iterator[None]:
    """Times one Slack call; an exception counts as an error of that method and propagates."""
    started = time.perf_counter()
    try:
        yield
    except BaseException as exc:
        SLACK_ERRORS.labels(method, _slack_error(exc)).inc()
        raise
    finally:
        SLACK_SECONDS.labels(method).observe(time.perf_counter() - started)


def _slack_error(exc: BaseException) -> str:
    # slack_sdk's SlackApiError carries the response; its "error" is Slack's own code
    # ("ratelimited", "channel_not_found"), a bounded set fit for a label.
    response = getattr(exc, "response", None)
    if response is not None:
        try:
            error = response.get("error")
        except Exception:
            error = None
        if error:
            return str(error)[:64]
        status = getattr(response, "status_code", None)
        if status is not None:
            return f"http_{status}"
    return type(exc).__name__


# botocore keeps per-call state in the request context; this key is ours.
_AWS_T0 = "gpubot_metrics_t0"
_HOOK_ID = "gpubot-metrics"


def instrument_boto3_session(session: Any) -> Any:
    """Registers the timing hooks on a boto3 (or botocore) session; returns it.

    `before-call` fires once per API call (botocore's retries happen inside it), then
    `after-call` with the parsed response (an error response still arrives here, with
    its `Error.Code`) or `after-call-error` for an exception (a connection that failed).
    Every client made from the session afterwards carries the hooks; registering twice
    is harmless (the unique id keeps one copy).
    """
    events = getattr(session, "events", None)  # a boto3 Session, or a client's `.meta`
    if events is None:
        events = session.get_component("event_emitter")  # a botocore Session
    events.register("before-call", _aws_before, unique_id=f"{_HOOK_ID}-before")
    events.register("after-call", _aws_after, unique_id=f"{_HOOK_ID}-after")
    events.register("after-call-error", _aws_failed, unique_id=f"{_HOOK_ID}-error")
    return session


def _aws_names(model: Any) -> tuple[str, str]:
    service = str(getattr(model.service_model, "service_name", "unknown"))
    return service, str(getattr(model, "name", "unknown"))


def _aws_before(model: Any, context: dict[str, Any], **_: Any) -> None:
    context.setdefault(_AWS_T0, time.perf_counter())


def _aws_elapsed(context: dict[str, Any]) -> float | None:
    """Seconds since before-call; None when this call was already counted (hooks that
    were registered twice, on a session and again on one of its clients)."""
    started = context.pop(_AWS_T0, None)
    return None if started is None else time.perf_counter() - float(started)


def _aws_after(
    model: Any, context: dict[str, Any], http_response: Any, parsed: Any, **_: Any
) -> None:
    elapsed = _aws_elapsed(context)
    if elapsed is None:
        return
    service, operation = _aws_names(model)
    AWS_SECONDS.labels(service, operation).observe(elapsed)
    status = int(getattr(http_response, "status_code", 200) or 200)
    if status >= 300:
        code = ""
        if isinstance(parsed, dict):
            code = str(parsed.get("Error", {}).get("Code", ""))
        AWS_ERRORS.labels(service, operation, (code or f"http_{status}")[:64]).inc()


def _aws_failed(model: Any, context: dict[str, Any], exception: BaseException, **_: Any) -> None:
    elapsed = _aws_elapsed(context)
    if elapsed is None:
        return
    service, operation = _aws_names(model)
    AWS_SECONDS.labels(service, operation).observe(elapsed)
    AWS_ERRORS.labels(service, operation, type(exception).__name__).inc()


# --- state, read from the database at scrape time ------------------------------------------


class _Forward(Collector):
    """Puts this process's event metrics into an app's own registry."""

    def collect(self) -> Iterable[Metric]:
        yield from EVENTS.collect()


class DatabaseCollector(Collector):
    """Gauges computed from the tables on each scrape, in one read-only transaction.

    A database that cannot be read gives `gpubot_db_up 0` and no other state: the
    scrape itself still succeeds, so the alert says "database", not "target down".
    """

    def __init__(self, engine: Engine, clock: Clock | None = None) -> None:
        self._engine = engine
        self._clock = clock or SystemClock()

    def describe(self) -> Iterable[Metric]:
        # Without this the registry would call collect() (a query) at registration.
        return []

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily("gpubot_db_up", "1 when the database answered this scrape.")
        try:
            families = self._read()
        except SQLAlchemyError as exc:
            log.warning("metrics: database unreachable: %s", type(exc).__name__)
            up.add_metric([], 0.0)
            return [up]
        up.add_metric([], 1.0)
        return [up, *families]

    def _read(self) -> list[Metric]:
        now = self._clock.now()
        with transaction(self._engine, write=False) as s:
            runs = GaugeMetricFamily(
                "gpubot_runs",
                "Training runs by state (queued is the queue length).",
                labels=["state"],
            )
            for state, n in s.exec(
                select(TrainingRun.state, func.count()).group_by(col(TrainingRun.state))
            ):
                runs.add_metric([state], float(n))

            reservations = GaugeMetricFamily(
                "gpubot_reservations", "Reservations by state.", labels=["state"]
            )
            for state, n in s.exec(
                select(Reservation.state, func.count()).group_by(col(Reservation.state))
            ):
                reservations.add_metric([state], float(n))

            gpus = GaugeMetricFamily(
                "gpubot_gpus",
                "GPUs (or CPU slots) by state: held (an open usage interval), free (present on "
                "a ready host), absent (gone from its host, or the host is not ready).",
                labels=["state", "model"],
            )
            held_ids = held_gpu_ids(s)
            counts: dict[tuple[str, str], int] = {}
            for gpu, host_state in s.exec(
                select(Gpu, Host.state).join(Host, col(Host.id) == col(Gpu.host_id))
            ):
                if gpu.id in held_ids:
                    key = ("held", gpu.model)
                elif gpu.present and host_state == "ready":
                    key = ("free", gpu.model)
                else:
                    key = ("absent", gpu.model)
                counts[key] = counts.get(key, 0) + 1
            for (state, model), n in sorted(counts.items()):
                gpus.add_metric([state, model], float(n))

            instances = GaugeMetricFamily(
                "gpubot_instances",
                "Hosts not terminated, by instance type, market and state.",
                labels=["instance_type", "market", "state"],
            )
            spend = 0.0
            by_kind: dict[tuple[str, str, str], int] = {}
            for host in s.exec(select(Host).where(col(Host.state) != HOST_TERMINATED)):
                key3 = (host.instance_type or host.provider, host.market, host.state)
                by_kind[key3] = by_kind.get(key3, 0) + 1
                if host.state != HOST_STOPPED:
                    spend += host.hourly_usd
            for key3, n in sorted(by_kind.items()):
                instances.add_metric(list(key3), float(n))
            usd = GaugeMetricFamily(
                "gpubot_spend_usd_per_hour",
                "Dollars per hour being spent now: the hourly price of every host that runs "
                "(not stopped, not terminated).",
            )
            usd.add_metric([], round(spend, 6))

            unsent_n, oldest = s.exec(
                select(func.count(), func.min(Notification.created_at)).where(
                    col(Notification.sent_at).is_(None)
                )
            ).one()
            depth = GaugeMetricFamily(
                "gpubot_outbox_unsent", "Notifications written but not yet delivered."
            )
            depth.add_metric([], float(unsent_n))
            age = GaugeMetricFamily(
                "gpubot_outbox_oldest_unsent_age_seconds",
                "Age of the oldest undelivered notification (0 when none waits).",
            )
            age.add_metric([], _age_s(now, oldest))
        return [runs, reservations, gpus, instances, usd, depth, age]


def _age_s(now: datetime, then: datetime | None) -> float:
    if then is None:
        return 0.0
    if then.tzinfo is None:  # SQLite may hand back a naive UTC value from an aggregate
        then = then.replace(tzinfo=UTC)
    return max(0.0, (now - then).total_seconds())


def build_registry(engine: Engine, clock: Clock | None = None) -> CollectorRegistry:
    """A registry for one app: the database's state plus this process's events."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector(engine, clock))
    registry.register(_Forward())
    return registry


# --- the two endpoints -----------------------------------------------------------------------


def health(engine: Engine) -> tuple[bool, dict[str, Any]]:
    """(ok, body): ok is False only when the database does not answer."""
    role, age = tick_state()
    body: dict[str, Any] = {"db": "ok", "role": role, "last_tick_age_s": age}
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        body["db"] = f"unreachable ({type(exc).__name__})"
        return False, body
    if age is not None:
        body["last_tick_age_s"] = round(age, 3)
    return True, body


class OpsApp:
    """WSGI for /healthz and /metrics; `handles` says whether a request is ours."""

    def __init__(self, engine: Engine, clock: Clock | None = None) -> None:
        self._engine = engine
        self.registry = build_registry(engine, clock)

    @staticmethod
    def handles(environ: WSGIEnvironment) -> bool:
        return environ.get("PATH_INFO") in (METRICS_PATH, HEALTH_PATH) and environ.get(
            "REQUEST_METHOD"
        ) in ("GET", "HEAD")

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if not self.handles(environ):
            return _reply(start_response, "404 Not Found", "text/plain", b"not found\n")
        if environ.get("PATH_INFO") == HEALTH_PATH:
            ok, body = health(self._engine)
            status = "200 OK" if ok else "503 Service Unavailable"
            return _reply(
                start_response, status, "application/json", json.dumps(body).encode() + b"\n"
            )
        return _reply(start_response, "200 OK", CONTENT_TYPE_LATEST, generate_latest(self.registry))


def _reply(start_response: StartResponse, status: str, ctype: str, body: bytes) -> list[bytes]:
    start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(body)))])
    return [body]
