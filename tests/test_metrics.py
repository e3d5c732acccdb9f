"""Operators' view: /metrics and /healthz from `gpubot serve` and `gpubot worker` as real
processes over real sockets, parsed with prometheus-client's own text parser, and checked
against the database of a seeded scenario; Slack calls timed against the fake Slack, AWS
calls timed through botocore's events against moto; a dead database answers 503."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from sqlalchemy import func, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.adapters import metrics
from bot.app.config import Settings
from bot.app.delivery import deliver
from bot.app.service import GpuService
from bot.domain import views
from bot.domain.clock import VirtualClock
from bot.domain.commands import Reserve, Run
from bot.faces.slack.notifier import SlackNotifier, make_client
from db.models import Notification, TrainingRun
from db.session import make_engine, transaction
from provisioning.base import GpuDevice, Instance
from tests.core.helpers import HOUR, runs_here
from tests.fakes.slack_api import Call, FakeSlack
from tests.provisioning_aws.conftest import AwsLab, aws_env, inprocess_lab  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
SERVE = "import typer; from bot.faces.slack.cli import serve; typer.run(serve)"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample, keyed by (name, sorted labels); the parser rejects a malformed page."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def family(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(port: int, path: str) -> tuple[int, bytes, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.getheader("Content-Type") or ""
    finally:
        conn.close()


def wait_up(proc: subprocess.Popen[bytes], port: int, timeout: float = 45.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if get(port, "/healthz")[0] == 200:
                return
        except OSError:
            pass
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise AssertionError(f"process exited {proc.returncode}:\n{out}")
        assert time.monotonic() < deadline, "the process did not come up"
        time.sleep(0.1)


def child_env(tmp_path: Path, engine: Engine, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLACK_", "GPUBOT_", "PORT"))}
    env.update(
        GPUBOT_HOME=str(tmp_path),
        GPUBOT_LOCAL_GPUS="none",
        GPUBOT_LOCAL_SLOTS="1",
        DATABASE_URL=engine.url.render_as_string(hide_password=False),
        PYTHONPATH=str(ROOT),
    )
    env.update(extra)
    return env


def stop(proc: subprocess.Popen[bytes]) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    return out.decode("utf-8", "replace")


# --- a seeded scenario -------------------------------------------------------------------------


def _hosts() -> list[Instance]:
    a100 = GpuDevice(index=0, model="A100", memory_gb=40.0)
    return [
        Instance(
            name="local",
            provider="local",
            state="ready",
            gpus=(GpuDevice(index=0, model="cpu"),),
        ),
        Instance(
            name="p4d-1",
            provider="aws",
            state="ready",
            gpus=(a100, GpuDevice(index=1, model="A100", memory_gb=40.0)),
            instance_id="i-00000000000000001",
            instance_type="p4d.24xlarge",
            market="ondemand",
            hourly_usd=32.77,
        ),
        Instance(
            name="g5-1",
            provider="aws",
            state="ready",
            gpus=(GpuDevice(index=0, model="A10G", memory_gb=24.0),),
            instance_id="i-00000000000000002",
            instance_type="g5.xlarge",
            market="spot",
            hourly_usd=1.006,
        ),
        Instance(
            name="p4d-2",
            provider="aws",
            state="stopped",
            gpus=(a100,),
            instance_id="i-00000000000000003",
            instance_type="p4d.24xlarge",
            market="ondemand",
            hourly_usd=32.77,
        ),
    ]


def seed(engine: Engine, tmp_path: Path) -> GpuService:
    """alice holds an A100, bob waits for two; three runs (queued, running, done); the
    grant and queue DMs wait in the outbox; two running hosts with prices, one stopped."""
    clock = VirtualClock(datetime.now(UTC) - timedelta(minutes=7))
    svc = GpuService(engine, Settings(admins=("root",)), clock, runs_here(tmp_path / "runs"))
    svc.sync_hosts(_hosts())
    svc.reserve(svc.actor("alice"), Reserve(count=1, model="A100", duration=HOUR))
    clock.advance(timedelta(minutes=1))
    svc.reserve(svc.actor("bob"), Reserve(count=2, model="A100", duration=HOUR))
    ids = [
        svc.runs.submit(svc.actor("carol"), Run(command=("sleep", "1"), model="cpu")).extra[
            "run_id"
        ]
        for _ in range(3)
    ]
    with transaction(engine) as s:
        s.exec(update(TrainingRun).where(col(TrainingRun.id) == ids[1]).values(state="running"))
        s.exec(update(TrainingRun).where(col(TrainingRun.id) == ids[2]).values(state="succeeded"))
    # Three DMs, written 6, 5 and 4 minutes ago; the oldest was delivered, two wait.
    for who in ("alice", "bob", "carol"):
        with transaction(engine) as s:
            text = f"hello {who}"
            svc.notify_dm(s, who, views.View(text, (views.Text(text),)), clock.now(), None)
        clock.advance(timedelta(minutes=1))
    first = svc.pending_notifications(1)[0]
    svc.mark_sent(first.id)
    return svc


def check_against_database(samples: Samples, engine: Engine) -> None:
    """The numbers this scenario must show, and the same numbers asked of the tables."""
    assert value(samples, "gpubot_db_up") == 1.0
    assert family(samples, "gpubot_runs") == {
        (("state", "queued"),): 1.0,
        (("state", "running"),): 1.0,
        (("state", "succeeded"),): 1.0,
    }
    assert family(samples, "gpubot_reservations") == {
        (("state", "active"),): 1.0,
        (("state", "waiting"),): 1.0,
    }
    assert family(samples, "gpubot_gpus") == {
        (("model", "A100"), ("state", "held")): 1.0,
        (("model", "A100"), ("state", "free")): 1.0,
        (("model", "A100"), ("state", "absent")): 1.0,  # on the stopped host
        (("model", "A10G"), ("state", "free")): 1.0,
        (("model", "cpu"), ("state", "free")): 1.0,
    }
    assert family(samples, "gpubot_instances") == {
        (("instance_type", "p4d.24xlarge"), ("market", "ondemand"), ("state", "ready")): 1.0,
        (("instance_type", "p4d.24xlarge"), ("market", "ondemand"), ("state", "stopped")): 1.0,
        (("instance_type", "g5.xlarge"), ("market", "spot"), ("state", "ready")): 1.0,
        (("instance_type", "local"), ("market", "owned"), ("state", "ready")): 1.0,
    }
    assert value(samples, "gpubot_spend_usd_per_hour") == pytest.approx(32.77 + 1.006)
    with Session(engine) as s:
        unsent, oldest = s.exec(
            select(func.count(), func.min(Notification.created_at)).where(
                col(Notification.sent_at).is_(None)
            )
        ).one()
    assert unsent == 2
    assert value(samples, "gpubot_outbox_unsent") == float(unsent)
    if oldest.tzinfo is None:
        oldest = oldest.replace(tzinfo=UTC)
    expected_age = (datetime.now(UTC) - oldest).total_seconds()
    assert 4.5 * 60 < expected_age < 6 * 60  # bob's, not alice's (delivered)
    age = value(samples, "gpubot_outbox_oldest_unsent_age_seconds")
    assert age is not None and abs(age - expected_age) < 30


def test_metrics_from_gpubot_serve_match_the_database(
    engine: Engine, fake_slack: FakeSlack, tmp_path: Path
) -> None:
    seed(engine, tmp_path)
    port = free_port()
    env = child_env(
        tmp_path,
        engine,
        SLACK_BOT_TOKEN=fake_slack.bot_token,
        SLACK_SIGNING_SECRET="metrics-test-signing-secret-0",
        SLACK_API_URL=fake_slack.url,
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, "--port", str(port), "--no-worker", "--host", "127.0.0.1"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_up(proc, port)
        status, body, ctype = get(port, "/metrics")
        assert status == 200 and ctype.startswith("text/plain")
        check_against_database(parse(body.decode()), engine)
        status, body, ctype = get(port, "/healthz")
        assert status == 200 and ctype == "application/json"
        # No worker in this process (--no-worker): it says so rather than inventing a tick.
        assert json.loads(body) == {"db": "ok", "role": "none", "last_tick_age_s": None}
    finally:
        out = stop(proc)
    assert proc.returncode == 0, out


def test_the_worker_serves_metrics_and_healthz_on_its_port(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    port = free_port()
    env = child_env(tmp_path, sqlite_engine, GPUBOT_TICK_SECONDS="0.2")
    env["GPUBOT_METRICS_PORT"] = str(port)  # the environment's default for --metrics-port
    proc = subprocess.Popen(
        [sys.executable, "-m", "bot.faces.cli", "worker"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    stragglers: list[socket.socket] = []
    try:
        wait_up(proc, port)
        # Strangers that announce a body and never send it hold no worker thread: the
        # port has two, and a thread-per-connection server would answer nothing below.
        for _ in range(8):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nx")
            stragglers.append(sock)
        deadline = time.monotonic() + 20
        while True:
            health = json.loads(get(port, "/healthz")[1])
            if health["role"] == "leader":
                break
            assert time.monotonic() < deadline, health
            time.sleep(0.1)
        assert health["db"] == "ok" and 0 <= health["last_tick_age_s"] < 5
        samples = parse(get(port, "/metrics")[1].decode())
        ticks = value(samples, "gpubot_tick_seconds_count")
        assert ticks is not None and ticks >= 1
        assert value(samples, "gpubot_db_up") == 1.0
        assert family(samples, "gpubot_gpus") == {(("model", "cpu"), ("state", "free")): 1.0}
        assert get(port, "/slack/events")[0] == 404  # only the operators' endpoints here
    finally:
        for sock in stragglers:
            sock.close()
        out = stop(proc)
    assert proc.returncode == 0, out


def test_healthz_is_503_and_metrics_say_db_down_when_the_database_is_gone() -> None:
    # A closed loopback port: the connection is refused at once.
    engine = make_engine(f"postgresql://postgres@127.0.0.1:{free_port()}/nothing")
    app = metrics.OpsApp(engine)
    got: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc: Any = None) -> Any:
        got["status"] = status
        got["headers"] = dict(headers)

    body = b"".join(app({"PATH_INFO": "/healthz", "REQUEST_METHOD": "GET"}, start_response))
    assert got["status"].startswith("503")
    assert json.loads(body)["db"].startswith("unreachable")
    body = b"".join(app({"PATH_INFO": "/metrics", "REQUEST_METHOD": "GET"}, start_response))
    assert got["status"].startswith("200")
    samples = parse(body.decode())
    assert value(samples, "gpubot_db_up") == 0.0
    assert not family(samples, "gpubot_runs")
    engine.dispose()


# --- the code-fed metrics -----------------------------------------------------------------------


def _count(name: str, **labels: str) -> float:
    return value(parse(_events_text()), name, **labels) or 0.0


def _events_text() -> str:
    from prometheus_client.exposition import generate_latest

    return generate_latest(metrics.EVENTS).decode()


def test_slack_calls_are_timed_and_failures_counted(
    fake_slack: FakeSlack, sqlite_engine: Engine
) -> None:
    svc = GpuService(
        sqlite_engine,
        Settings(slack_bot_token=SecretStr(fake_slack.bot_token), slack_api_url=fake_slack.url),
        VirtualClock(),
    )
    notifier = SlackNotifier(make_client(svc.settings), svc.settings.channel)

    def history(call: Call) -> dict[str, Any]:  # the notifier looks before resending
        msgs = [fake_slack.message_json(m) for m in fake_slack.messages_in(call.params["channel"])]
        return {"ok": True, "messages": msgs, "has_more": False, "pin_count": 0}

    fake_slack.on("conversations.history", history)
    posts = _count("gpubot_slack_call_seconds_count", method="chat.postMessage")
    limited = _count(
        "gpubot_slack_call_errors_total", method="chat.postMessage", error="ratelimited"
    )
    with transaction(sqlite_engine) as s:
        svc.notify_dm(s, "U0BOB0001", views.View("hi", (views.Text("hi"),)), svc.clock.now(), None)
    fake_slack.rate_limit("chat.postMessage", retry_after=1)
    assert deliver(svc, notifier) == 0
    assert _count("gpubot_slack_call_seconds_count", method="chat.postMessage") == posts + 1
    assert (
        _count("gpubot_slack_call_errors_total", method="chat.postMessage", error="ratelimited")
        == limited + 1
    )
    svc.clock.advance(timedelta(seconds=2))  # type: ignore[attr-defined]
    assert deliver(svc, notifier) == 1
    assert _count("gpubot_slack_call_seconds_count", method="chat.postMessage") == posts + 2
    assert (
        _count("gpubot_slack_call_errors_total", method="chat.postMessage", error="ratelimited")
        == limited + 1
    )


def test_aws_calls_are_timed_and_errors_counted_through_botocore_events(
    inprocess_lab: AwsLab,  # noqa: F811
) -> None:
    metrics.instrument_boto3_session(inprocess_lab.session)
    compute = inprocess_lab.compute()
    before = _count("gpubot_aws_call_seconds_count", service="ec2", operation="DescribeInstances")
    errors = _count(
        "gpubot_aws_call_errors_total",
        service="ec2",
        operation="StopInstances",
        code="InvalidInstanceID.NotFound",
    )
    assert compute.list_instances() == []
    after = _count("gpubot_aws_call_seconds_count", service="ec2", operation="DescribeInstances")
    assert after == before + 1
    ec2: Any = inprocess_lab.ec2()
    with pytest.raises(Exception, match="InvalidInstanceID"):
        ec2.stop_instances(InstanceIds=["i-0123456789abcdef0"])
    assert (
        _count(
            "gpubot_aws_call_errors_total",
            service="ec2",
            operation="StopInstances",
            code="InvalidInstanceID.NotFound",
        )
        == errors + 1
    )


@pytest.fixture(autouse=True)
def _worker_state() -> Iterator[None]:
    """The tick state is per process; a test that ticks must not leak its role."""
    yield
    with metrics._tick_lock:
        metrics._tick.role = "none"
        metrics._tick.last_tick = None
