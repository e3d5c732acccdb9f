"""How fast the HTTP face answers Slack, side by side in one run:

- **first_command**: `FIRST_USERS` people new to the bot send their first `/gpu status`,
  `FIRST_AT_ONCE` at a time, then their second (goal: the slowest first under 100 ms);
- **status**: signed `/gpu status`, `STATUS_CLIENTS` concurrent clients, each
  request on a fresh connection as Slack's deliveries are (goal: p99 < 100 ms);
- **burst**: `BURST_USERS` users never seen before send their first `/gpu reserve`
  at the same instant, `BURST_ROUNDS` times (goal: p99 < 1 s, far from Slack's
  3-second ack limit);
- **slow_clients**: signed `/gpu help` answered one after another, first alone,
  then while `SLOW_CLIENTS` unauthenticated connections trickle their headers in one
  byte at a time (goal: under a second of added delay).

Each database (SQLite, and PostgreSQL when it answers at 127.0.0.1:5432) gets its own
server in a child process, so that the client threads do not share its GIL: on this
2-core machine that would measure our own load generator. The fake Slack Web API
answers after `SLACK_API_LATENCY_S`, as the real one does from a typical host, so
that a Web API call the ack waits for shows in the figures instead of hiding behind
a loopback fake. Everything is on 127.0.0.1 and bounded in count; the whole module
takes well under a minute.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import multiprocessing as mp
import os
import secrets
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlencode

STATUS_CLIENTS = 16
REQUESTS_PER_CLIENT = 100
WARMUP = 64
USERS = 32
FIRST_USERS = 32
FIRST_AT_ONCE = 16
BURST_USERS = 50
BURST_ROUNDS = 4
SLOW_CLIENTS = 48
HELP_REQUESTS = 20
SLACK_API_LATENCY_S = 0.1
SECRET = "bench-signing-secret-0123456789ab"
T = TypeVar("T")
PG_URL = os.environ.get("GPUBOT_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


def _serve(conn: Connection, home: str, database_url: str) -> None:
    """Child process: the service on the given database, the Bolt app on the HTTP
    front; sends the port, then waits to be told to stop."""
    import logging

    from pydantic import SecretStr

    from bot.app.config import Settings
    from bot.app.service import GpuService
    from bot.domain.clock import SystemClock
    from bot.faces.slack.app import build_face
    from bot.faces.slack.server import HttpServer
    from db.migrate import upgrade
    from db.session import make_engine
    from provisioning.base import GpuDevice, Instance
    from tests.fakes.slack_api import Call, FakeSlack, JsonDict

    class SlowSlack(FakeSlack):
        """The fake, answering after a real Web API's round trip."""

        def _dispatch(self, call: Call, token: str) -> JsonDict:
            time.sleep(SLACK_API_LATENCY_S)
            return super()._dispatch(call, token)

    logging.disable(logging.WARNING)
    fake = SlowSlack().start()
    settings = Settings(
        home=Path(home),
        database_url=SecretStr(database_url),
        slack_bot_token=SecretStr(fake.bot_token),
        slack_signing_secret=SecretStr(SECRET),
        slack_api_url=fake.url,
    )
    engine = make_engine(settings.sqlalchemy_url)
    upgrade(engine)
    service = GpuService(engine, settings, SystemClock())
    service.sync_hosts(
        Instance(
            name=f"gpu{h}",
            provider="ssh",
            state="ready",
            gpus=tuple(GpuDevice(index=i, model="A100", memory_gb=40.0) for i in range(8)),
            address=f"gpu{h}.example",
            ssh_user="ubuntu",
        )
        for h in range(4)
    )
    face = build_face(service, settings)
    server = HttpServer(face, host="127.0.0.1", port=0).start()
    conn.send(server.port)
    conn.recv()  # told to stop
    server.stop()
    face.shutdown()
    engine.dispose()
    fake.stop()


class _Answers:
    """Where deferred replies land: a response_url endpoint on loopback that notes
    when each one arrived, so that the figure is the user's wait, not just the ack."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        arrived: dict[str, float] = {}
        self.arrived = arrived

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                arrived[self.path.rsplit("/", 1)[-1]] = time.perf_counter()
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/answer"

    def wait_for(self, key: str, timeout: float = 30.0) -> float:
        deadline = time.monotonic() + timeout
        while key not in self.arrived:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no deferred answer for {key}")
            time.sleep(0.01)
        return self.arrived[key]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _command(
    port: int,
    user: str,
    text: str,
    expect: bytes,
    answers: _Answers | None = None,
    timeout: float = 10.0,
) -> tuple[float, float]:
    """One signed slash command on a fresh connection: seconds until the ack, and until
    the answer itself (the same, unless the ack said "working on it" and the answer
    came by response_url to `answers`)."""
    key = f"{user}-{secrets.token_hex(4)}"
    form = urlencode(
        {
            "team_id": "T111",
            "channel_id": "C111",
            "user_id": user,
            "user_name": user.lower(),
            "command": "/gpu",
            "text": text,
            "response_url": f"{answers.url}/{key}" if answers else "http://127.0.0.1:9/unused",
            "trigger_id": f"{time.time_ns()}.{secrets.token_hex(4)}.bench",
        }
    ).encode()
    ts = str(int(time.time()))
    sig = (
        "v0="
        + hmac.new(SECRET.encode(), b"v0:" + ts.encode() + b":" + form, hashlib.sha256).hexdigest()
    )
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request(
            "POST",
            "/slack/events",
            body=form,
            headers={
                "Content-Type": "application/x-www-form-urlencoded",
                "X-Slack-Request-Timestamp": ts,
                "X-Slack-Signature": sig,
            },
        )
        resp = c.getresponse()
        body = resp.read()
    finally:
        c.close()
    ack = time.perf_counter() - t0
    if answers is not None and resp.status == 200 and b"Working on" in body:
        return ack, answers.wait_for(key) - t0
    if resp.status != 200 or expect not in body:
        raise RuntimeError(f"bad reply to {text!r}: {resp.status} {body[:200]!r}")
    return ack, ack


def _figures(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return {
        "median_ms": round(statistics.median(ordered) * 1000, 1),
        "p99_ms": round(p99 * 1000, 1),
        "max_ms": round(ordered[-1] * 1000, 1),
    }


def _together(jobs: list[Callable[[], list[T]]]) -> list[T]:
    """Runs each job on its own thread, all released at once; their results, joined."""
    gate = threading.Barrier(len(jobs))
    results: list[T] = []
    errors: list[str] = []
    lock = threading.Lock()

    def one(job: Callable[[], list[T]]) -> None:
        gate.wait()
        try:
            mine = job()
        except Exception as exc:
            errors.append(repr(exc))
            return
        with lock:
            results.extend(mine)

    threads = [threading.Thread(target=one, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(jobs)} clients failed: {errors[0]}")
    return results


def _status(port: int) -> dict[str, object]:
    for i in range(WARMUP):  # every user seen once: users.info and user rows warm
        _command(port, f"U0BENCH{i % USERS:03d}", "status", b"GPU status")

    def client(n: int) -> list[float]:
        return [
            _command(port, f"U0BENCH{(n * 7 + i) % USERS:03d}", "status", b"GPU status")[0]
            for i in range(REQUESTS_PER_CLIENT)
        ]

    t0 = time.perf_counter()
    latencies = _together([partial(client, n) for n in range(STATUS_CLIENTS)])
    wall = time.perf_counter() - t0
    return {
        "clients": STATUS_CLIENTS,
        "requests": len(latencies),
        **_figures(latencies),
        "requests_per_s": round(len(latencies) / wall, 1),
    }


def _first_command(port: int, tag: str) -> dict[str, object]:
    """`FIRST_USERS` people new to the bot, `FIRST_AT_ONCE` at a time, each sending their
    first `/gpu status`, then their second: a first use should cost the ack no more than a
    later one (whatever it needs beyond the answer waits until after the ack)."""
    users = [f"U0F{tag}{i:03d}" for i in range(FIRST_USERS)]
    waves = [users[i : i + FIRST_AT_ONCE] for i in range(0, len(users), FIRST_AT_ONCE)]
    for _ in range(WARMUP // 4):  # the server's own first requests (imports, pools) apart
        _command(port, f"U0W{tag}", "status", b"GPU status")

    def once(user: str) -> list[float]:
        return [_command(port, user, "status", b"GPU status")[0]]

    first: list[float] = []
    second: list[float] = []
    for wave in waves:
        first += _together([partial(once, u) for u in wave])
    for wave in waves:
        second += _together([partial(once, u) for u in wave])
    return {
        "users": len(users),
        "at_once": FIRST_AT_ONCE,
        "first": _figures(first),
        "second": _figures(second),
    }


def _burst(port: int, tag: str) -> dict[str, object]:
    """Each user's ack, and apart from it when the reservation's answer reached them:
    in the ack itself, or by response_url after an ack that said "working on it"."""
    timed: list[tuple[float, float]] = []
    answers = _Answers()
    try:
        for r in range(BURST_ROUNDS):
            users = [f"U0{tag}{r}N{i:03d}" for i in range(BURST_USERS)]

            def first(user: str) -> list[tuple[float, float]]:
                return [_command(port, user, "reserve for 1h", b"eserv", answers)]

            timed += _together([partial(first, u) for u in users])
            for u in users:  # back to an empty line for the next round, untimed
                _command(port, u, "release all", b"")
    finally:
        answers.close()
    return {
        "users_at_once": BURST_USERS,
        "rounds": BURST_ROUNDS,
        "ack": _figures([a for a, _ in timed]),
        "answer": _figures([b for _, b in timed]),
        "answered_in_the_ack": sum(1 for a, b in timed if a == b),
        "requests": len(timed),
    }


def _trickle(port: int, stop: threading.Event) -> None:
    """An unauthenticated client that never finishes its headers: one byte at a time."""
    head = (
        b"POST /slack/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-"
        b"urlencoded\r\nContent-Length: 100000\r\nX-Slack-Signature: v0=00\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        for i in range(len(head)):
            if stop.wait(0.5):
                return
            try:
                s.sendall(head[i : i + 1])
            except OSError:
                return  # dropped by the server's header deadline, as it should


def _help(port: int) -> float | None:
    """Seconds for a signed `/gpu help`; None when no answer came within 5 s."""
    try:
        return _command(port, "U0BENCH000", "help", b"gpubot", timeout=5.0)[0]
    except OSError:
        return None


def _slow_clients(port: int) -> dict[str, object]:
    alone = [_help(port) for _ in range(HELP_REQUESTS)]
    stop = threading.Event()
    slow = [
        threading.Thread(target=_trickle, args=(port, stop), daemon=True)
        for _ in range(SLOW_CLIENTS)
    ]
    for t in slow:
        t.start()
    time.sleep(1.0)  # every slow connection accepted and mid-headers
    try:
        crowded = [_help(port) for _ in range(HELP_REQUESTS)]
    finally:
        stop.set()
        for t in slow:
            t.join(timeout=10)
    a = _figures([x for x in alone if x is not None])
    c = _figures([x for x in crowded if x is not None]) if any(crowded) else {}
    return {
        "slow_connections": SLOW_CLIENTS,
        "help_alone": a,
        "help_with_slow_connections": c,
        "help_unanswered_in_5s": sum(1 for x in crowded if x is None),
        "added_delay_max_ms": round(c["max_ms"] - a["median_ms"], 1) if c else None,
    }


def _pg_schema() -> tuple[str, Any] | None:
    """A fresh schema on the machine's PostgreSQL (dropped after), or None without one."""
    try:
        with socket.create_connection(("127.0.0.1", 5432), timeout=0.5):
            pass
    except OSError:
        return None
    from sqlalchemy import text

    from db.session import make_engine

    schema = "bench_" + secrets.token_hex(5)
    admin = make_engine(PG_URL)
    with admin.begin() as c:
        c.execute(text(f"CREATE SCHEMA {schema}"))
    return f"{PG_URL}?options=-csearch_path%3D{schema}", (admin, schema)


def _with_server(database_url: str, work: Any) -> dict[str, object]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    with tempfile.TemporaryDirectory() as home:
        proc = ctx.Process(target=_serve, args=(child, home, database_url), daemon=True)
        proc.start()
        try:
            if not parent.poll(60):
                raise RuntimeError("server did not start")
            result: dict[str, object] = work(int(parent.recv()))
        finally:
            parent.send("stop")
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return result


def run() -> dict[str, object]:
    load_before = os.getloadavg()[0]

    def sqlite_work(port: int) -> dict[str, object]:
        return {
            "first_command": _first_command(port, "S"),
            "status": _status(port),
            "burst_first_reserve": _burst(port, "S"),
            "slow_clients": _slow_clients(port),
        }

    sqlite = _with_server("", sqlite_work)
    pg: dict[str, object]
    made = _pg_schema()
    if made is None:
        pg = {"skipped": "PostgreSQL not reachable at 127.0.0.1:5432"}
    else:
        url, (admin, schema) = made
        try:
            pg = _with_server(
                url,
                lambda port: {
                    "first_command": _first_command(port, "P"),
                    "status": _status(port),
                    "burst_first_reserve": _burst(port, "P"),
                },
            )
        finally:
            from sqlalchemy import text

            with admin.begin() as c:
                c.execute(text(f"DROP SCHEMA {schema} CASCADE"))
            admin.dispose()

    def p99(part: dict[str, object], *keys: str) -> float | None:
        fig: Any = part
        for key in keys:
            fig = fig.get(key) if isinstance(fig, dict) else None
        return float(fig["p99_ms"]) if isinstance(fig, dict) else None

    status_p99 = p99(sqlite, "status")
    burst_p99 = p99(pg, "burst_first_reserve", "ack")
    slow = sqlite["slow_clients"]
    assert isinstance(slow, dict)
    return {
        "what": "signed Slack requests over HTTP to the real front + Bolt app; fake Web API "
        f"answering after {int(SLACK_API_LATENCY_S * 1000)} ms",
        "goals": {
            "status_p99_ms_under": 100,
            "status_goal_met": status_p99 is not None and status_p99 < 100,
            "first_command_slowest_ms_under": 100,
            "first_command_goal_met": all(
                (slowest := _slowest_first(part)) is not None and slowest < 100
                for part in (sqlite, pg)
                if "skipped" not in part
            ),
            "burst_ack_p99_ms_under": 1000,
            "burst_goal_met (postgresql)": burst_p99 is not None and burst_p99 < 1000,
            "slow_clients_added_delay_ms_under": 1000,
            "slow_clients_goal_met": not slow["help_unanswered_in_5s"]
            and float(slow["added_delay_max_ms"] or 0) < 1000,
        },
        "sqlite": sqlite,
        "postgresql": pg,
        # Other work on the machine shows up in the tail: the 1-minute load when the run began.
        "load_avg_1m_before": round(load_before, 2),
        "cpus": os.cpu_count(),
    }


def _slowest_first(part: dict[str, Any]) -> float | None:
    fc = part.get("first_command")
    return float(fc["first"]["max_ms"]) if isinstance(fc, dict) else None


def headline(figures: dict[str, Any]) -> list[str]:
    """The few lines `make bench` ends with."""
    lines = []
    for db in ("sqlite", "postgresql"):
        part = figures.get(db) or {}
        fc = part.get("first_command")
        if fc:
            lines.append(
                f"first /gpu status of {fc['users']} new people, {fc['at_once']} at a time, "
                f"{db}: median {fc['first']['median_ms']} ms, slowest {fc['first']['max_ms']} ms "
                f"(goal < 100 ms); their second: median {fc['second']['median_ms']} ms, "
                f"slowest {fc['second']['max_ms']} ms"
            )
        st = part.get("status")
        if st:
            lines.append(
                f"/gpu status, {st['clients']} clients, {db}: median {st['median_ms']} ms, "
                f"p99 {st['p99_ms']} ms (goal p99 < 100 ms)"
            )
        b = part.get("burst_first_reserve")
        if b:
            lines.append(
                f"first /gpu reserve, {b['users_at_once']} users at once x {b['rounds']}, {db}: "
                f"ack median {b['ack']['median_ms']} ms, p99 {b['ack']['p99_ms']} ms "
                f"(goal p99 < 1000 ms); answer median {b['answer']['median_ms']} ms, "
                f"p99 {b['answer']['p99_ms']} ms; {b['answered_in_the_ack']}/{b['requests']} "
                "answered in the ack"
            )
        sc = part.get("slow_clients")
        if sc:
            lines.append(
                f"/gpu help with {sc['slow_connections']} slow unauthenticated connections, "
                f"{db}: added delay {sc['added_delay_max_ms']} ms at most, "
                f"{sc['help_unanswered_in_5s']} unanswered in 5 s (goal < 1000 ms)"
            )
    return lines


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
