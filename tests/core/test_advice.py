"""The digest's largest wastes and its replayed advice (bot.app.money.advice), on histories
written into a real database: one with an instance left idle most of the week under a
long idle stop, and one with nothing to save. The saving the digest claims is checked by
replaying the same history through the simulator on the path `gpubot simulate
--history` takes (the trace CSV), with the setting changed, independently of the
digest's own replay."""

from __future__ import annotations

import csv
import io
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.app.config import Settings
from bot.app.money.advice import MIN_SAVING_USD, WeekReport
from bot.app.money.digest import (
    chart_bars,
    digest_chart,
    digest_csv,
    digest_for,
    digest_report_csv,
    digest_view,
    write_csv,
)
from bot.app.money.history_trace import history_trace
from bot.app.money.rollups import rebuild_rollups
from bot.app.runs.context import scheduler_config
from bot.app.service import GpuService
from bot.domain.clock import VirtualClock
from bot.domain.durations import format_duration
from bot.faces.dispatch import handle_text
from bot.faces.replay import SimReplayer
from bot.faces.terminal import render
from bot.sim.simulate import parse_trace, run_simulation
from db.models import (
    Gpu,
    GpuSample,
    Host,
    HostPeriod,
    Reservation,
    TrainingRun,
    UsageInterval,
    User,
)
from provisioning.catalog import Catalog

MON = datetime(2026, 3, 9, tzinfo=UTC)  # Monday of 2026-W11
AFTER = datetime(2026, 3, 17, 9, tzinfo=UTC)  # in W12: W11 is the last complete week
H = timedelta(hours=1)
CATALOG = Catalog.load()
_P4D = CATALOG.get("p4d.24xlarge")
assert _P4D is not None
P4D = _P4D
SHARE = P4D.ondemand_usd_hr / P4D.gpus


class World:
    """Rows written as the bot writes them (periods, intervals, runs), then the rollups
    rebuilt from them as `gpubot db rebuild-rollups` does."""

    def __init__(self, s: Session) -> None:
        self.s = s
        self.users: dict[str, User] = {}

    def user(self, key: str) -> User:
        if key not in self.users:
            u = User(key=key, display_name=key.title(), created_at=MON - 30 * 24 * H)
            self.s.add(u)
            self.s.flush()
            self.users[key] = u
        return self.users[key]

    def host(self, name: str, running: list[tuple[datetime, datetime]]) -> tuple[Host, list[Gpu]]:
        h = Host(
            name=name,
            provider="aws",
            instance_id=f"i-{name}",
            instance_type=P4D.instance_type,
            market="ondemand",
            state="terminated",
            hourly_usd=P4D.ondemand_usd_hr,
            created_at=running[0][0],
            updated_at=running[-1][1],
        )
        self.s.add(h)
        self.s.flush()
        assert h.id is not None
        gpus = [Gpu(host_id=h.id, index=i, model="A100") for i in range(P4D.gpus)]
        self.s.add_all(gpus)
        for a, b in running:
            self.s.add(
                HostPeriod(
                    host_id=h.id,
                    state="running",
                    started_at=a,
                    ended_at=b,
                    gpus=P4D.gpus,
                    usd_per_hour=P4D.ondemand_usd_hr,
                    storage_usd_per_hour=0.0,
                    market="ondemand",
                )
            )
        self.s.flush()
        return h, gpus

    def run(
        self,
        key: str,
        host: tuple[Host, list[Gpu]],
        start: datetime,
        hours: float,
        gpus: int = 1,
        state: str = "succeeded",
        checkpoints: bool = False,
    ) -> TrainingRun:
        u = self.user(key)
        end = start + hours * H
        r = TrainingRun(
            user_id=u.id,  # type: ignore[arg-type]
            command="python train.py",
            gpu_count=gpus,
            gpu_model="A100",
            state=state,
            checkpoints=checkpoints,
            submitted_at=start,
            started_at=start,
            finished_at=end,
            host_id=host[0].id,
        )
        self.s.add(r)
        self.s.flush()
        for g in host[1][:gpus]:
            self.held(g, u, start, end, run_id=r.id)
        return r

    def held(self, g: Gpu, u: User, start: datetime, end: datetime, **ref: int | None) -> None:
        """A GPU held on demand from start to end, by a run or a reservation (`ref`)."""
        self.s.add(
            UsageInterval(
                gpu_id=g.id,  # type: ignore[arg-type]
                host_id=g.host_id,
                user_id=u.id,  # type: ignore[arg-type]
                started_at=start,
                ended_at=end,
                usd_per_hour=SHARE,
                market="ondemand",
                **ref,
            )
        )

    def reservation(
        self,
        key: str,
        host: tuple[Host, list[Gpu]],
        start: datetime,
        hours: float,
        idle_hours: int = 0,
    ) -> None:
        u = self.user(key)
        end = start + hours * H
        res = Reservation(
            user_id=u.id,  # type: ignore[arg-type]
            gpu_model="A100",
            gpu_count=1,
            duration_s=int(hours * 3600),
            state="released",
            requested_at=start,
            granted_at=start,
            ends_at=end,
            ended_at=end,
            host_id=host[0].id,
        )
        self.s.add(res)
        self.s.flush()
        g = host[1][-1]
        self.held(g, u, start, end, reservation_id=res.id)
        for i in range(idle_hours):  # hourly samples under the idle threshold
            self.s.add(
                GpuSample(
                    host_id=host[0].id,  # type: ignore[arg-type]
                    gpu_index=g.index,
                    at=start + (i + 1) * H,
                    span_s=3600,
                    util_pct=0.0,
                    user_id=u.id,
                    reservation_id=res.id,
                )
            )

    def done(self) -> None:
        self.s.flush()
        rebuild_rollups(self.s)
        self.s.commit()


def wasteful_week(engine: Engine, now: datetime = AFTER) -> GpuService:
    """W11 on one p4d that ran all week: a 2-hour run each weekday morning, one run that
    failed after 3 hours, one on-demand run that checkpoints, a reservation that sat idle
    for 2 of its 3 hours. Carol held a GPU the week before, and nothing this week.
    The team's idle stop was 6 hours."""
    with Session(engine) as s:
        w = World(s)
        prev = w.host("p4d-prev", [(MON - 7 * 24 * H, MON - 6 * 24 * H)])
        w.reservation("carol", prev, MON - 7 * 24 * H + H, 2)
        box = w.host("p4d-1", [(MON, MON + 7 * 24 * H)])
        for day in range(4):
            w.run("alice" if day % 2 else "bob", box, MON + (24 * day + 9) * H, 2, gpus=2)
        w.run("bob", box, MON + (4 * 24 + 9) * H, 3, state="failed")
        w.run("alice", box, MON + (4 * 24 + 13) * H, 2, gpus=4, checkpoints=True)
        w.reservation("dave", box, MON + (5 * 24 + 9) * H, 3, idle_hours=2)
        w.done()
    settings = Settings(idle_stop_after=6 * H)
    return GpuService(engine, settings, VirtualClock(now))


def trace_saving(engine: Engine, settings: Settings, changed: Settings) -> float:
    """What the simulator says `changed` saves against `settings` on W11's runs, replayed
    from the trace CSV that `gpubot simulate --history` reads, each with the worker's
    scheduler knobs for those settings."""
    text, skipped = history_trace(engine, MON, MON + 7 * 24 * H)
    assert skipped == 0
    jobs = parse_trace(text.splitlines(), CATALOG, "A100")
    with Session(engine) as s:
        runs = s.exec(select(TrainingRun).where(col(TrainingRun.checkpoints).is_(True)))
        ckpt = {f"run-{r.id}" for r in runs}
    jobs = [replace(j, checkpoints=j.job_id in ckpt) for j in jobs]

    def cost(st: Settings) -> float:
        cfg = scheduler_config(st, CATALOG)
        res = run_simulation(
            jobs,
            catalog=CATALOG,
            config=cfg,
            max_gpus=cfg.max_gpus,
            ebs_gb=st.ebs_gb,
            ebs_usd_gb_month=st.ebs_usd_gb_month,
        )
        return res.total_cost_usd

    return round(cost(settings) - cost(changed), 2)


def test_a_week_with_an_idle_instance_names_it_and_a_replayed_saving(
    sqlite_engine: Engine,
) -> None:
    svc = wasteful_week(sqlite_engine)
    d = digest_for(svc, replay=SimReplayer(CATALOG))
    assert d.week == "2026-W11" and d.report is not None
    w, a = d.report.wastes, d.report.advice
    # The idle instance: its idle overhead is the whole week's idle overhead here.
    [idle] = w.idle_hosts
    assert idle.name == "p4d-1" and idle.instance_type == "p4d.24xlarge"
    assert idle.usd == d.idle_overhead_usd
    # Empty: 168 h less the hours anything held a GPU of it (4 x 2 h, 3 h, 2 h, 3 h).
    assert idle.empty_hours == pytest.approx(168 - 8 - 3 - 2 - 3)
    [hold] = w.idle_holds
    assert hold.user == "Dave" and hold.idle_gpu_hours == pytest.approx(2.0)
    assert hold.usd == Decimal(str(SHARE)) * 2
    [lost] = w.lost_runs
    assert lost.user == "Bob" and lost.state == "failed" and lost.gpu_hours == pytest.approx(3)
    [spot] = w.missed_spot
    assert spot.user == "Alice" and spot.gpu_hours == pytest.approx(8.0)
    assert P4D.spot_usd_hr is not None
    spot_share = P4D.spot_usd_hr / P4D.gpus
    assert float(spot.usd) == pytest.approx(8 * (SHARE - spot_share), abs=1e-5)
    # The replay: 6 runs, and a shorter idle stop saves the most.
    assert a.runs == 6 and a.base is not None and a.best
    top = a.best[0]
    assert top.setting == "GPUBOT_IDLE_STOP_AFTER"
    assert top.saved(a.base) >= MIN_SAVING_USD
    # The claim holds: the same history, replayed with that setting, saves as much.
    new = Settings(idle_stop_after=timedelta(minutes=5))
    assert top.label.startswith("idle stop after 5m")
    assert trace_saving(sqlite_engine, svc.settings, new) == pytest.approx(top.saved(a.base))
    # And the text says it, as a replay estimate, with what it costs in waiting.
    text = render(digest_view(d))
    assert "Largest wastes" in text and "p4d-1" in text and "reservation #" in text
    assert "replay estimate" in text.lower()
    assert f"{top.label} saves ${top.saved(a.base):,.2f}" in text
    assert "Nothing would have helped" not in text


def test_the_advice_csv_agrees_with_the_text(sqlite_engine: Engine, tmp_path: Path) -> None:
    svc = wasteful_week(sqlite_engine)
    d = digest_for(svc, replay=SimReplayer(CATALOG))
    assert d.report is not None and d.report.advice.base is not None
    extra = write_csv(d, tmp_path / "w11.csv")
    assert extra == tmp_path / "w11-advice.csv"
    rows = list(csv.DictReader(io.StringIO(extra.read_text())))
    assert rows == list(csv.DictReader(io.StringIO(digest_report_csv(d))))
    kinds = [r["kind"] for r in rows]
    assert kinds[:4] == ["idle_instance", "idle_reservation", "lost_run", "spot_missed"]
    base = d.report.advice.base
    savings = [r for r in rows if r["kind"] == "saving"]
    assert [(r["what"], r["usd"]) for r in savings] == [
        (c.label, f"{c.saved(base):.2f}") for c in d.report.advice.best
    ]
    text = render(digest_view(d))
    for r in rows:
        if r["kind"] in ("idle_instance", "saving", "bill"):
            assert f"${Decimal(r['usd']):,.2f}" in text
        if r["kind"] == "empty_time":
            assert f"{float(r['hours']):,.1f} h" in text


def test_people_who_used_nothing_are_one_line(sqlite_engine: Engine) -> None:
    svc = wasteful_week(sqlite_engine)
    d = digest_for(svc, replay=SimReplayer(CATALOG))
    assert [u.key for u in d.unused] == ["carol"]
    carol_last = d.unused[0].last_week_usd
    view = digest_view(d)
    text = render(view)
    assert f"1 person used nothing this week (${carol_last:,.2f} held last week)." in text
    assert "Carol" not in text
    rows = list(csv.DictReader(io.StringIO(digest_csv(d))))
    assert [r["name"] for r in rows] == [u.name for u in d.used] + ["1 person used nothing"]
    nobody = rows[-1]
    assert nobody["user"] == "" and nobody["usd"] == "0.00"
    assert nobody["last_week_usd"] == f"{carol_last:.2f}"
    # The people's rows and the text's total agree.
    held = sum(Decimal(r["usd"]) for r in rows)
    assert f"${held:,.2f} held by {len(d.used)} people" in view.text
    # And the chart: a bar per person in the text's table, the rest counted in its title.
    bars, title = chart_bars(d)
    assert [(name, usd) for name, usd, _ in bars] == [(u.name, u.usd) for u in d.used]
    assert title.endswith("; 1 person used nothing")
    assert digest_chart(d).startswith(b"\x89PNG")


def quiet_week(engine: Engine) -> GpuService:
    """W11 on instances that ran only while a run used all their GPUs, under a 5-minute
    idle stop: nothing idles, and no setting has anything to save."""
    with Session(engine) as s:
        w = World(s)
        for day in range(3):
            start = MON + (24 * day + 9) * H
            box = w.host(f"p4d-{day}", [(start, start + 2 * H)])
            w.run("alice", box, start, 2, gpus=8)
        w.done()
    return GpuService(engine, Settings(idle_stop_after=timedelta(minutes=5)), VirtualClock(AFTER))


def test_a_week_with_nothing_to_save_says_so(engine: Engine) -> None:
    svc = quiet_week(engine)
    d = digest_for(svc, replay=SimReplayer(CATALOG))
    assert d.report is not None
    assert d.report.wastes.empty
    a = d.report.advice
    assert a.runs == 3 and a.base is not None and a.best == ()
    assert a.tried  # something was tried, and it is named
    text = render(digest_view(d))
    assert "No idle instance, idle reservation, lost run or missed spot." in text
    assert "Nothing would have helped" in text
    for label in a.tried:
        assert label in text
    rows = list(csv.DictReader(io.StringIO(digest_report_csv(d))))
    [saving] = [r for r in rows if r["kind"] == "saving"]
    assert saving["detail"] == "nothing would have helped"


def test_a_week_without_runs_says_there_was_nothing_to_replay(sqlite_engine: Engine) -> None:
    with Session(sqlite_engine) as s:
        w = World(s)
        box = w.host("p4d-1", [(MON, MON + 24 * H)])
        w.reservation("dave", box, MON + H, 3, idle_hours=3)
        w.done()
    svc = GpuService(sqlite_engine, Settings(), VirtualClock(AFTER))
    d = digest_for(svc, replay=SimReplayer(CATALOG))
    assert d.report is not None and d.report.advice.base is None
    text = render(digest_view(d))
    assert "Nothing replayed: no runs on rented instances to replay." in text
    assert "p4d-1" in text  # the idle instance is still named


def test_gpu_cost_team_week_carries_the_same_report(sqlite_engine: Engine) -> None:
    """On demand, mid-week: the week so far, its wastes and the replay's advice."""
    svc = wasteful_week(sqlite_engine, now=MON + 6 * 24 * H)  # Sunday of W11
    reply = handle_text(svc, svc.actor("alice"), "/gpu cost team week")
    assert not reply.error
    text = render(reply.view)
    assert "Largest wastes" in text and "p4d-1" in text
    assert "saves $" in text and "replay estimate" in text.lower()
    # The weekly digest's own report, computed for the same window at the same time.
    report: WeekReport | None = digest_for(svc, "2026-W11", replay=SimReplayer(CATALOG)).report
    assert report is not None and report.advice.best
    assert report.advice.best[0].label in text


def test_the_digest_says_where_the_bill_and_the_replay_part(sqlite_engine: Engine) -> None:
    """The replay prices runs only; the digest says where the rest of the bill went, in
    figures that add up to it: held GPU time and idle overhead, and the instance's empty
    hours by what kept it up (issue 37: $23,227 replayed against $634,243 billed, and
    nothing said where the other $611,000 went)."""
    svc = wasteful_week(sqlite_engine)
    d = digest_for(svc, replay=SimReplayer(CATALOG))
    assert d.report is not None and d.report.totals is not None
    t, e, base = d.report.totals, d.report.empty, d.report.advice.base
    assert e is not None and base is not None
    assert t.bill == d.instances_usd and t.held + t.idle == t.bill
    assert e.hosts == 1 and e.idle_stop == svc.settings.idle_stop_after
    # The one instance's empty hours, all of them, split three ways (the idle host's).
    [idle] = d.report.wastes.idle_hosts
    assert e.total_h == pytest.approx(idle.empty_hours)
    text = render(digest_view(d))
    assert "Where the bill and the replay part" in text
    assert f"The rented instances cost ${t.bill:,.2f}" in text
    assert f"Replaying the runs costs ${base.usd:,.2f}" in text
    assert f"1 instance ran {e.total_h:,.1f} h with nothing held" in text
    stop = format_duration(svc.settings.idle_stop_after)
    assert f"within the idle stop after a use (GPUBOT_IDLE_STOP_AFTER={stop})" in text


def test_empty_hours_are_split_by_what_kept_the_host_up() -> None:
    """Up 0–10 h, held 2–3 h and 3.5–4 h, idle stop 15 minutes: 2 h before its first use,
    then 0.5 h of empty stretches and 6 h more, of which 15 minutes each are the setting's."""
    from bot.app.money.advice import _Rented, empty_time
    from bot.domain.metering import HostPeriod, Usage, Window

    t0 = datetime(2026, 3, 9, tzinfo=UTC)
    h = timedelta(hours=1)
    period = HostPeriod(1, 8, Decimal("32"), "running", t0, t0 + 10 * h)
    held = [
        Usage("a", 1, 1, t0 + 2 * h, t0 + 3 * h, Decimal(4), "run", 1),
        Usage("b", 2, 1, t0 + 2.5 * h, t0 + 3 * h, Decimal(4), "reservation", 2),
        Usage("a", 1, 1, t0 + 3.5 * h, t0 + 4 * h, Decimal(4), "run", 3),
    ]
    host = Host(id=1, name="p4d-1", provider="aws", market="ondemand")
    rented = _Rented({1: host}, {1: [period]}, {1: held})
    e = empty_time(rented, Window(t0, t0 + 24 * h), t0 + 24 * h, timedelta(minutes=15))
    assert e.hosts == 1
    assert e.before_use_h == pytest.approx(2.0)
    assert e.idle_stop_h == pytest.approx(0.5)
    assert e.beyond_h == pytest.approx(0.25 + 5.75)
    # Not yet over: only up to now counts.
    mid = empty_time(rented, Window(t0, t0 + 24 * h), t0 + 5 * h, timedelta(minutes=15))
    assert mid.total_h == pytest.approx(2.0 + 0.5 + 1.0)
