"""A real run watched from Slack (the local fake): its "started" DM is edited in place
with chat.update in the DM it was posted in, within chat.update's published tier; a
health alert and the result (with its chart uploaded) arrive as messages of their own."""

from __future__ import annotations

import secrets
import sys
from collections import Counter
from datetime import timedelta
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.app.delivery import deliver
from bot.app.outbox import StoredDeliveryLog
from bot.domain.commands import Run
from bot.faces.slack.app import build_face
from bot.faces.slack.notifier import SlackNotifier, make_client
from bot.faces.slack.server import HttpServer
from db.models import Notification, TrainingRun
from tests.core.helpers import actor, make_service, runs_here
from tests.core.test_runs import local_host, run_until, state
from tests.core.test_runwatch import SCRIPT
from tests.fakes.slack_api import FakeSlack
from tests.slack.conftest import SignedClient

ALICE = "U0ALICE01"


def test_the_live_message_is_updated_in_place_and_the_result_follows(
    fake_slack: FakeSlack, engine: Engine, tmp_path: Path
) -> None:
    svc, clock = make_service(
        engine,
        [local_host(1)],
        slack_bot_token=fake_slack.bot_token,
        slack_api_url=fake_slack.url,
        places=runs_here(tmp_path / "runs"),
    )
    notifier = SlackNotifier(
        make_client(svc.settings), svc.settings.channel, StoredDeliveryLog(engine, clock)
    )
    runs = svc.runs
    script = tmp_path / "report.py"
    script.write_text(SCRIPT)
    go = tmp_path / "go"
    cmd = (sys.executable, str(script), str(go), "2.3,2.1,3.5,8.0,20.0")
    rid = int(runs.submit(actor(svc, ALICE), Run(command=cmd)).extra["run_id"])
    run_until(runs, lambda: state(engine, rid).metrics.get("step") == 5)
    dm = fake_slack.dm_channel_for(ALICE)
    for _ in range(12):  # four virtual minutes, a poll and a delivery every 20 s
        clock.advance(timedelta(seconds=20))
        runs.poll()
        deliver(svc, notifier)
    updates = fake_slack.calls_to("chat.update")
    assert 4 <= len(updates) <= 5, "about once a minute"
    started, alert = fake_slack.messages_in(dm)
    assert {(c.params["channel"], c.params["ts"]) for c in updates} == {(dm, started.ts)}
    assert started.edits == len(updates)
    assert started.text is not None and f"Run #{rid} (`" in started.text
    assert "is running: step 5/50, loss 20" in started.text
    assert alert.text is not None and "the loss is diverging" in alert.text
    # Within chat.update's tier (Tier 3) in every virtual minute of the edits' schedule.
    with Session(engine) as s:
        due = [
            n.deliver_after
            for n in s.exec(select(Notification).where(col(Notification.edit_of).is_not(None)))
        ]
    per_minute = Counter(d.replace(second=0, microsecond=0) for d in due)
    assert max(per_minute.values()) <= fake_slack.per_minute("chat.update")
    go.touch()
    run_until(runs, lambda: state(engine, rid).finished_at is not None)
    clock.advance(timedelta(seconds=5))
    deliver(svc, notifier)
    started, alert, result, *rest = fake_slack.messages_in(dm)
    assert [m.files for m in rest] == [(next(iter(fake_slack.files)),)], rest
    assert (
        started.text is not None and "finished; the result is in the message below" in started.text
    )
    assert result.text is not None and result.text.startswith(f"⚠️ Run #{rid}")
    (upload,) = fake_slack.files.values()
    assert upload.filename == f"run-{rid}-curve.png"


def test_a_sweep_from_slack_ends_with_one_table_in_the_owners_dm(
    fake_slack: FakeSlack, sqlite_engine: Engine, tmp_path: Path
) -> None:
    """Through the real HTTP front and Bolt app: `/gpu run --sweep …` queues the group (a
    malformed sweep is an ephemeral error), the worker side runs it, and the comparison
    table reaches the owner's DM as Block Kit the fake accepts."""
    secret = secrets.token_hex(16)
    svc, clock = make_service(
        sqlite_engine,
        [local_host(2)],
        slack_bot_token=fake_slack.bot_token,
        slack_signing_secret=secret,
        slack_api_url=fake_slack.url,
        places=runs_here(tmp_path / "runs"),
    )
    runs = svc.runs
    notifier = SlackNotifier(
        make_client(svc.settings), svc.settings.channel, StoredDeliveryLog(sqlite_engine, clock)
    )
    face = build_face(svc, svc.settings, notifier=notifier, deliver_after_commands=True)
    server = HttpServer(face, host="127.0.0.1", port=0, threads=4).start()
    try:
        client = SignedClient(server.host, server.port, secret, fake_slack)
        # answer(): the ack, or the post it promised when a loaded machine was slower than it
        bad = client.answer("run --recipe digits --sweep lr=1e-3", user=ALICE)
        assert bad["response_type"] == "ephemeral" and "2 to 8 different values" in bad["text"]
        body = client.answer("run --recipe digits --epochs 1 --sweep lr=0.001,100000", user=ALICE)
        assert body["text"].startswith("Sweep s"), body
        with Session(sqlite_engine) as s:
            ids = [r.id for r in s.exec(select(TrainingRun).order_by(col(TrainingRun.id)))]
        run_until(runs, lambda: all(state(sqlite_engine, i or 0).finished_at for i in ids), 300)
        clock.advance(timedelta(seconds=5))
        deliver(svc, notifier)
    finally:
        server.stop()
        face.shutdown()
    texts = [m.text or "" for m in fake_slack.messages_in(fake_slack.dm_channel_for(ALICE))]
    (table,) = [t for t in texts if t.startswith("Sweep s")]
    assert f"Best: run #{ids[0]} (lr 0.001)" in table
