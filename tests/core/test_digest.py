"""The weekly digest on a seeded database: two weeks of reservations, utilization
samples, a spot run and an on-demand run; its numbers against hand-computed values,
its Block Kit through the fake Slack, the chart read back, the CSV, `--post` once."""

from __future__ import annotations

import csv
import io
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from apscheduler.triggers.cron import CronTrigger
from PIL import Image
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select
from typer.testing import CliRunner

from bot.app.config import Settings
from bot.app.delivery import deliver
from bot.app.money.digest import (
    digest_chart,
    digest_csv,
    digest_for,
    digest_job,
    digest_trigger,
    digest_view,
    last_complete_week,
    parse_week,
    post_digest,
)
from bot.app.service import GpuService
from bot.app.watching.held import end_held
from bot.domain.charts import COST_HEIGHT_PX as CHART_H
from bot.domain.charts import COST_WIDTH_PX as CHART_W
from bot.domain.clock import VirtualClock
from bot.domain.commands import Reserve
from bot.domain.errors import UserError
from bot.domain.metering import to_cents
from bot.faces.cli import app
from bot.faces.replay import weekly_digest_job
from bot.faces.slack.notifier import SlackNotifier
from bot.faces.terminal import render
from bot.faces.worker import periodic_jobs
from db.models import Gpu, GpuSample, Host, Notification, TrainingRun, User
from db.session import transaction
from provisioning.base import GpuDevice, Instance
from tests.core.helpers import HOUR, actor
from tests.fakes.slack_api import FakeSlack

W01 = datetime(2025, 12, 29, 9, tzinfo=UTC)  # Monday of 2026-W01
W02 = datetime(2026, 1, 5, 9, tzinfo=UTC)  # Monday of 2026-W02
AFTER = datetime(2026, 1, 12, 10, tzinfo=UTC)  # 2026-W03: W02 is the last complete week


def aws(name: str, hourly: float, market: str) -> Instance:
    return Instance(
        name=name,
        provider="aws",
        state="ready",
        gpus=tuple(GpuDevice(index=i, model="A100", memory_gb=40.0) for i in range(8)),
        instance_id=f"i-{name}",
        instance_type="p4d.24xlarge",
        market=market,
        hourly_usd=hourly,
        address=f"{name}.example",
        ssh_user="ubuntu",
    )


def _ids(s: Session) -> tuple[int, int, int, int]:
    od = s.exec(select(Host).where(Host.name == "od")).one()
    sp = s.exec(select(Host).where(Host.name == "sp")).one()
    alice = s.exec(select(User).where(User.key == "alice")).one()
    bob = s.exec(select(User).where(User.key == "bob")).one()
    assert od.id and sp.id and alice.id and bob.id
    return od.id, sp.id, alice.id, bob.id


def _run(svc: GpuService, host: str, user: str, gpus: int, hours: int, **kw: object) -> None:
    """A run that held `gpus` GPUs of `host` for `hours` from now, through the service's
    own usage bookkeeping (what dispatch does), then finished."""
    now = svc.clock.now()
    with transaction(svc.engine) as s:
        h = s.exec(select(Host).where(Host.name == host)).one()
        u = s.exec(select(User).where(User.key == user)).one()
        assert u.id is not None and h.id is not None
        run = TrainingRun(
            user_id=u.id,
            gpu_count=gpus,
            gpu_model="A100",
            state="running",
            submitted_at=now,
            started_at=now,
            host_id=h.id,
            **kw,  # type: ignore[arg-type]
        )
        s.add(run)
        s.flush()
        free = s.exec(
            select(Gpu).where(Gpu.host_id == h.id).order_by(col(Gpu.index)).offset(4)
        ).all()[:gpus]
        svc.open_usage(s, h, list(free), u.id, now, run_id=run.id)
        run_id = run.id
    assert isinstance(svc.clock, VirtualClock)
    svc.clock.advance(timedelta(hours=hours))
    assert svc.places.runs is None and run_id is not None
    with transaction(svc.engine) as s:
        # Closed the way the bot closes them (rolled up in the same transaction).
        end_held(s, svc.clock.now(), run_id=run_id)
        r = s.get(TrainingRun, run_id)
        assert r is not None
        r.state, r.finished_at = "succeeded", svc.clock.now()
        s.add(r)


def seed(engine: Engine, crowd: int = 0) -> GpuService:
    """od: on demand, $21.96/h for 8 GPUs ($2.745 each); sp: spot, $8/h ($1 each).
    `crowd` more people hold a GPU for an hour on Thursday, on hosts of their own."""
    clock = VirtualClock(W01)
    svc = GpuService(engine, Settings(admins=("root",)), clock)
    svc.sync_hosts([aws("od", 21.96, "ondemand"), aws("sp", 8.0, "spot")])
    alice, bob = actor(svc, "alice"), actor(svc, "bob")
    # Last week: alice, 1 GPU for 2 h on od = $5.49.
    svc.reserve(alice, Reserve(count=1, model="A100", duration=2 * HOUR))
    clock.advance(3 * HOUR)
    svc.tick()
    # This week. Alice: 2 GPUs for 3 h on od ($16.47); bob: 1 GPU for 1 h on od ($2.745).
    clock.set(W02)
    svc.reserve(alice, Reserve(count=2, model="A100", duration=3 * HOUR))
    svc.reserve(bob, Reserve(count=1, model="A100", duration=HOUR))
    with transaction(engine) as s:
        od, _, alice_id, _ = _ids(s)
        # Hourly samples of alice's two GPUs: 3 of the 6 GPU-hours under 5% (idle).
        for index, utils in ((0, (90.0, 80.0, 2.0)), (1, (0.0, 0.0, 50.0))):
            for h, util in enumerate(utils):
                s.add(
                    GpuSample(
                        host_id=od,
                        gpu_index=index,
                        at=W02 + timedelta(hours=h + 1),
                        span_s=3600,
                        util_pct=util,
                        user_id=alice_id,
                        reservation_id=2,
                    )
                )
    clock.set(datetime(2026, 1, 6, 10, tzinfo=UTC))
    svc.tick()
    # Bob's spot run: 4 GPUs of sp for 2 h = $8 (on demand it would be 8 x $2.74470525).
    _run(svc, "sp", "bob", 4, 2, recipe="digits", spot=True)
    clock.set(datetime(2026, 1, 7, 10, tzinfo=UTC))
    # Alice's run on od: 1 GPU for 2 h = $5.49.
    _run(svc, "od", "alice", 1, 2, command="python train.py --epochs 90")
    if crowd:
        clock.set(datetime(2026, 1, 8, 9, tzinfo=UTC))
        svc.sync_hosts([aws(f"x{i}", 8.0, "ondemand") for i in range(crowd // 8 + 1)])
        for i in range(crowd):
            name = f"user-with-a-long-name-{i:03d}"
            svc.reserve(actor(svc, name), Reserve(count=1, duration=HOUR))
    clock.set(AFTER)
    svc.tick()
    return svc


def test_the_digest_numbers_are_the_hand_computed_ones(engine: Engine) -> None:
    svc = seed(engine)
    d = digest_for(svc)
    assert d.week == "2026-W02"
    alice, bob = d.users
    assert (alice.key, bob.key) == ("alice", "bob")  # dearest first
    assert alice.gpu_hours == 8 and bob.gpu_hours == 9
    assert alice.usd == Decimal("21.96") and bob.usd == Decimal("10.745")
    assert alice.efficiency_pct == pytest.approx(222 / 6)  # (90+80+2+0+0+50) / 6
    assert bob.efficiency_pct is None
    assert alice.idle_waste_usd == 3 * Decimal("2.745") and bob.idle_waste_usd == 0
    # Spot: 8 GPU-hours at $2.74470525 on demand against $1; metered, so to the cent.
    assert to_cents(bob.spot_savings_usd) == Decimal("13.96") and alice.spot_savings_usd == 0
    assert alice.last_week_usd == Decimal("5.49") and alice.change_usd == Decimal("16.47")
    assert bob.last_week_usd == 0
    assert [(r.user, r.usd) for r in d.top_runs] == [
        ("bob", Decimal("8")),
        ("alice", Decimal("5.49")),
    ]
    # Both instances ran all 168 hours of the week: $29.96 an hour.
    assert d.instances_usd == 168 * Decimal("29.96")
    assert d.held_usd == Decimal("32.705")
    assert d.idle_overhead_usd == d.instances_usd - d.held_usd == Decimal("5000.575")
    assert d.last_week_held_usd == Decimal("5.49")


def test_the_digest_text(sqlite_engine: Engine) -> None:
    d = digest_for(seed(sqlite_engine))
    text = render(digest_view(d))
    assert (
        "GPU digest 2026-W02 (Mon 05 Jan – Sun 11 Jan 2026, UTC): the instances cost "
        "$5,033.28; $32.71 held by 2 people over 17.0 GPU-hours, $5,000.57 idle overhead "
        "($27.22 more held than last week)."
    ) in text
    lines = text.splitlines()
    assert any(
        line.split() == ["alice", "8.0", "$21.96", "+$16.47", "37%", "$8.24"] for line in lines
    )
    assert any(
        line.split() == ["bob", "9.0", "$10.75", "+$10.75", "n/a", "$0.00", "$13.96"]
        for line in lines
    )
    # The rows add up to the instances' bill as shown: 21.96 + 10.75 + 5000.57 = 5033.28.
    assert any(line.split() == ["idle", "overhead", "$5,000.57"] for line in lines)
    assert any(line.split() == ["instances", "$5,033.28"] for line in lines)
    assert any(line.split()[:4] == ["#1", "bob", "recipe", "digits"] for line in lines)
    assert any(line.split()[:3] == ["#2", "alice", "python"] for line in lines)


def test_the_chart_is_a_real_png_of_fixed_size(sqlite_engine: Engine) -> None:
    d = digest_for(seed(sqlite_engine))
    png = digest_chart(d)
    img = Image.open(io.BytesIO(png))
    assert img.format == "PNG" and img.size == (CHART_W, CHART_H)
    rgb = img.convert("RGB")
    colors = rgb.getcolors(maxcolors=1_000_000)
    assert colors is not None and len(colors) > 50, "a blank or near-blank chart"
    counts = {c: n for n, c in colors}
    used, idle_reserved, overhead = (0x2B, 0x6C, 0xB0), (0x90, 0xCD, 0xF4), (0xA0, 0xAE, 0xC0)
    # The team's idle overhead dwarfs the people this week: a bar of many pixels.
    assert counts.get(overhead, 0) > 20_000
    # Without it, the people's bars fill the plot: alice's 37% reserved-but-idle on top.
    people = Image.open(io.BytesIO(digest_chart(replace(d, idle_overhead_usd=Decimal(0)))))
    shades = {c: n for n, c in people.convert("RGB").getcolors(maxcolors=1_000_000) or []}
    assert shades.get(used, 0) > 20_000 and shades.get(idle_reserved, 0) > 5_000
    # An empty week still draws a chart of the same size.
    empty = replace(d, users=(), top_runs=())
    assert Image.open(io.BytesIO(digest_chart(empty))).size == (CHART_W, CHART_H)


def test_the_csv_has_one_row_per_person(sqlite_engine: Engine) -> None:
    rows = list(csv.DictReader(io.StringIO(digest_csv(digest_for(seed(sqlite_engine))))))
    assert rows == [
        {
            "week": "2026-W02",
            "user": "alice",
            "name": "alice",
            "gpu_hours": "8.0000",
            "usd": "21.96",
            "efficiency_pct": "37.0",
            "idle_waste_usd": "8.24",
            "spot_savings_usd": "0.00",
            "last_week_usd": "5.49",
            "change_usd": "16.47",
        },
        {
            "week": "2026-W02",
            "user": "bob",
            "name": "bob",
            "gpu_hours": "9.0000",
            "usd": "10.75",
            "efficiency_pct": "",
            "idle_waste_usd": "0.00",
            "spot_savings_usd": "13.96",
            "last_week_usd": "0.00",
            "change_usd": "10.75",
        },
    ]


def clear_outbox(svc: GpuService) -> None:
    """The seed's DMs (granted, expired) go to made-up users; mark them sent, so that
    what reaches the fake Slack below is the digest alone."""
    with transaction(svc.engine) as s:
        for n in s.exec(select(Notification).where(col(Notification.sent_at).is_(None))):
            n.sent_at = svc.clock.now()
            s.add(n)


def test_posted_twice_it_reaches_slack_once_with_its_chart(
    sqlite_engine: Engine, fake_slack: FakeSlack
) -> None:
    svc = seed(sqlite_engine)
    clear_outbox(svc)
    d = digest_for(svc)
    assert post_digest(svc, d) is True
    assert post_digest(svc, digest_for(svc)) is False
    digest_job(svc)  # the weekly job for the same (previous) week: nothing new
    notifier = SlackNotifier(fake_slack.client(), svc.settings.channel)
    assert deliver(svc, notifier) == 1
    assert deliver(svc, notifier) == 0
    posted = [m for m in fake_slack.messages if m.metadata]
    assert len(posted) == 1 and posted[0].blocks
    assert posted[0].text is not None and posted[0].text.startswith("GPU digest 2026-W02")
    [chart] = fake_slack.files.values()
    assert chart.filename == "gpu-digest-2026-W02.png" and chart.completed
    assert chart.data is not None and chart.data.startswith(b"\x89PNG\r\n\x1a\n")
    # The fake checked every block against Slack's limits; the fixture fails on any breach.
    assert fake_slack.violations == []


def test_many_people_stay_within_slacks_limits(
    sqlite_engine: Engine, fake_slack: FakeSlack
) -> None:
    svc = seed(sqlite_engine, crowd=90)
    clear_outbox(svc)
    d = digest_for(svc)
    assert len(d.users) == 92
    assert post_digest(svc, d)
    assert deliver(svc, SlackNotifier(fake_slack.client(), svc.settings.channel)) == 1
    assert fake_slack.violations == []


def test_gpubot_digest_command(sqlite_engine: Engine, tmp_path: Path) -> None:
    seed(sqlite_engine)
    url = sqlite_engine.url.render_as_string(hide_password=False)
    env = {"DATABASE_URL": url, "GPUBOT_HOME": str(tmp_path), "GPUBOT_CHANNEL": "gpu-costs"}
    runner = CliRunner()
    shown = runner.invoke(app, ["digest", "--week", "2026-W02"], env=env)
    assert shown.exit_code == 0, shown.output
    assert "GPU digest 2026-W02" in shown.output and "alice" in shown.output
    out = tmp_path / "w02.csv"
    first = runner.invoke(
        app, ["digest", "--week", "2026-w02", "--post", "--csv", str(out)], env=env
    )
    assert first.exit_code == 0, first.output
    assert "Digest 2026-W02 queued for #gpu-costs" in first.output
    assert out.read_text().splitlines()[1].startswith("2026-W02,alice,alice,8.0000,21.96,")
    again = runner.invoke(app, ["digest", "--week", "2026-W02", "--post"], env=env)
    assert "already queued or posted" in again.output
    with Session(sqlite_engine) as s:
        posts = s.exec(select(Notification).where(Notification.kind == "channel")).all()
    assert [(n.target, n.dedupe_key, n.attachment_name) for n in posts] == [
        ("gpu-costs", "digest:2026-W02", "gpu-digest-2026-W02.png")
    ]
    bad = runner.invoke(app, ["digest", "--week", "2026-W54"], env=env)
    assert bad.exit_code == 2 and "2026 has no ISO week 54" in bad.output


def test_weeks_and_the_weekly_job_in_the_team_time_zone(sqlite_engine: Engine) -> None:
    with pytest.raises(UserError, match="not an ISO week"):
        parse_week("last week")
    assert parse_week("2026-w49") == (2026, 49)
    # Monday 00:30 in Berlin is still Sunday in UTC: the last complete week is W48 there.
    monday = datetime(2026, 11, 30, 0, 30, tzinfo=UTC) - timedelta(hours=1)
    assert last_complete_week(monday, "Europe/Berlin") == (2026, 48)
    assert last_complete_week(monday, "UTC") == (2026, 47)
    svc = GpuService(
        sqlite_engine,
        Settings(digest_at="fri 17:30", timezone="Europe/Berlin"),
        VirtualClock(),
    )
    args = digest_trigger(svc.settings)
    assert args == {"day_of_week": "fri", "hour": 17, "minute": 30, "timezone": "Europe/Berlin"}
    [job] = [j for j in periodic_jobs(svc) if j.id == "digest"]
    assert job.trigger == "cron" and job.run is weekly_digest_job and job.trigger_args == args
    fire = CronTrigger(**args).get_next_fire_time(None, datetime(2026, 7, 1, tzinfo=UTC))
    assert fire is not None and fire.astimezone(UTC) == datetime(2026, 7, 3, 15, 30, tzinfo=UTC)
