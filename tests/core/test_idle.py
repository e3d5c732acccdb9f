"""Idle detection on a virtual clock, driven minute by minute through the real collection
(a recorded-telemetry runner) and the real idle job, on SQLite and PostgreSQL: an idle
reservation gets one DM with Keep/Release and the cost; Keep silences it; no answer
releases it; busy GPUs, or gaps in the samples, never prompt; squatting does."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.app.watching.idle import ACTION_KEEP, ACTION_RELEASE, Point, assess, coverage_s, idle_job
from bot.app.watching.utilization import collect
from bot.domain import views
from bot.domain.clock import VirtualClock
from bot.domain.commands import Reserve
from bot.faces.dispatch import handle_text
from db.models import Notification, Reservation, UsageInterval
from tests.core.helpers import actor, make_service, place
from tests.core.test_utilization import (
    MapAccess,
    RecordedRunner,
    gpu_a,
    snapshot_json,
    with_access,
)

# gpu-a: 8× A100 at $32.77/h, so each GPU's share is $4.09625/h.
PER_GPU = 32.77 / 8


class Lab:
    """One host, a runner whose GPUs show what the test sets, and a clock to move."""

    def __init__(self, engine: Engine) -> None:
        access = MapAccess()
        self.svc, self.clock = make_service(engine, [gpu_a()], places=place("ssh", access))
        self.engine = engine
        self.gpus: dict[int, tuple[int, int]] = {i: (0, 0) for i in range(8)}
        self.runner = RecordedRunner(snapshot_json(self.gpus))
        with_access(access, gpu_a=self.runner)

    def set(self, util: int, mem_mb: int = 0, indexes: range = range(8)) -> None:
        for i in indexes:
            self.gpus[i] = (util, mem_mb)

    def minutes(self, n: int, *, sample: bool = True) -> None:
        """n minutes of the worker: sample, check idleness, then time moves on."""
        for _ in range(n):
            if sample:
                self.runner.answer = snapshot_json(self.gpus)
                collect(self.svc)
            idle_job(self.svc)
            self.clock.advance(timedelta(minutes=1))

    def reservation(self, res_id: int) -> Reservation:
        with Session(self.engine) as s:
            res = s.get(Reservation, res_id)
            assert res is not None
            return res

    def dms(self, who: str) -> list[Notification]:
        with Session(self.engine) as s:
            return list(
                s.exec(
                    select(Notification)
                    .where(Notification.target == who)
                    .order_by(col(Notification.id))
                )
            )


def prompts(lab: Lab, who: str) -> list[Notification]:
    return [n for n in lab.dms(who) if "has been idle" in n.text]


def test_idle_for_the_window_asks_once_with_keep_release_and_the_cost(engine: Engine) -> None:
    lab = Lab(engine)
    alice = actor(lab.svc, "alice")
    lab.svc.reserve(alice, Reserve(count=2, model="A100"))
    start = lab.clock.now()
    lab.minutes(28)
    assert prompts(lab, "alice") == []  # the window is not covered yet
    lab.minutes(10)
    (dm,) = prompts(lab, "alice")
    res = lab.reservation(1)
    assert res.idle_prompted_at is not None
    idle_for = res.idle_prompted_at - start  # idle since its first sample
    assert timedelta(minutes=29) <= idle_for <= timedelta(minutes=30)
    cost = 2 * PER_GPU * idle_for.total_seconds() / 3600
    assert f"${cost:,.2f} so far" in dm.text and f"${2 * PER_GPU:,.2f}/h" in dm.text
    assert "Reservation #1 (2× A100 on gpu-a (GPUs 0, 1))" in dm.text
    assert "under 5% utilization" in dm.text
    view = views.View.from_dict(dm.view)
    (actions,) = [b for b in view.blocks if isinstance(b, views.Actions)]
    keep, release = actions.buttons
    assert (keep.label, keep.action_id, keep.value) == ("Keep", ACTION_KEEP, "/gpu util keep 1")
    assert (release.label, release.action_id, release.value) == (
        "Release",
        ACTION_RELEASE,
        "/gpu release 1",
    )
    assert lab.reservation(1).state == "active"


def test_keep_silences_the_question_for_a_window(engine: Engine) -> None:
    lab = Lab(engine)
    alice = actor(lab.svc, "alice")
    lab.svc.reserve(alice, Reserve(count=1, model="A100"))
    lab.minutes(31)
    assert len(prompts(lab, "alice")) == 1
    reply = handle_text(lab.svc, alice, "/gpu util keep 1")  # the Keep button's line
    assert not reply.error and "Keeping reservation #1" in reply.view.text
    res = lab.reservation(1)
    assert res.idle_prompted_at is None and res.idle_keep_until == lab.clock.now() + timedelta(
        minutes=30
    )
    lab.minutes(45)  # past the grace, past the keep: not released
    assert lab.reservation(1).state == "active"
    # Silent for the kept window; once it is over and a whole new window was idle, asked again.
    assert len(prompts(lab, "alice")) == 2
    second = prompts(lab, "alice")[1]
    assert res.idle_keep_until is not None and second.created_at >= res.idle_keep_until


def test_only_the_holder_or_an_admin_may_keep(engine: Engine) -> None:
    lab = Lab(engine)
    lab.svc.reserve(actor(lab.svc, "alice"), Reserve())
    bob = handle_text(lab.svc, actor(lab.svc, "bob"), "/gpu util keep 1")
    assert bob.error and "not yours; only its holder or an admin can keep it" in bob.view.text
    assert "Usage:" not in bob.view.text  # who may, not how: a usage line would mislead
    assert lab.reservation(1).idle_keep_until is None
    root = handle_text(lab.svc, actor(lab.svc, "root"), "/gpu util keep 1")  # an admin
    assert not root.error
    missing = handle_text(lab.svc, actor(lab.svc, "alice"), "/gpu util keep 99")
    assert missing.error and "There is no reservation #99." in missing.view.text
    bare = handle_text(lab.svc, actor(lab.svc, "alice"), "/gpu util keep")
    assert bare.error and "Say which reservation to keep" in bare.view.text
    handle_text(lab.svc, actor(lab.svc, "alice"), "/gpu release 1")
    done = handle_text(lab.svc, actor(lab.svc, "alice"), "/gpu util keep 1")
    assert done.error and "is released; there is nothing to keep" in done.view.text


def test_no_answer_within_the_grace_releases_it_and_says_why(engine: Engine) -> None:
    lab = Lab(engine)
    lab.svc.reserve(actor(lab.svc, "alice"), Reserve(count=8, model="A100"))
    waiting = lab.svc.reserve(actor(lab.svc, "bob"), Reserve(count=1, model="A100"))
    assert "waiting" in waiting.view.text.lower() or "line" in waiting.view.text.lower()
    lab.minutes(31)
    asked = lab.reservation(1).idle_prompted_at
    assert asked is not None
    until_grace = (asked + timedelta(minutes=15) - lab.clock.now()) // timedelta(minutes=1)
    lab.minutes(until_grace)  # checks up to 14 minutes after the question
    assert lab.reservation(1).state == "active"  # the grace is 15 minutes
    lab.minutes(1)
    res = lab.reservation(1)
    assert res.state == "released" and res.ended_at == asked + timedelta(minutes=15)
    (gone,) = [n for n in lab.dms("alice") if "because it was idle" in n.text]
    assert gone.text.startswith("Released reservation #1 (8× A100 on gpu-a")
    with Session(lab.engine) as s:
        open_ivs = s.exec(select(UsageInterval).where(col(UsageInterval.ended_at).is_(None))).all()
    assert [iv.reservation_id for iv in open_ivs] == [2], "bob, who waited, got a GPU"
    assert lab.reservation(2).state == "active"
    assert any("granted" in n.text.lower() or "yours" in n.text.lower() for n in lab.dms("bob"))
    lab.minutes(5)
    assert len([n for n in lab.dms("alice") if "because it was idle" in n.text]) == 1


def test_busy_gpus_are_never_asked_about(engine: Engine) -> None:
    lab = Lab(engine)
    lab.svc.reserve(actor(lab.svc, "alice"), Reserve(count=2, model="A100"))
    lab.set(83, 30000, range(0, 1))  # one of the two GPUs works: the reservation is in use
    lab.minutes(70)
    assert prompts(lab, "alice") == [] and lab.reservation(1).state == "active"


def test_memory_held_at_zero_percent_is_squatting(engine: Engine) -> None:
    lab = Lab(engine)
    lab.svc.reserve(actor(lab.svc, "alice"), Reserve(count=1, model="A100"))
    lab.set(0, 31000)  # a notebook holding 30 GiB, computing nothing
    lab.minutes(31)
    (dm,) = prompts(lab, "alice")
    assert "while holding 30.3 GiB of GPU memory" in dm.text


def test_activity_after_the_prompt_clears_it_silently(engine: Engine) -> None:
    lab = Lab(engine)
    lab.svc.reserve(actor(lab.svc, "alice"), Reserve(count=1, model="A100"))
    lab.minutes(31)
    assert lab.reservation(1).idle_prompted_at is not None
    before = len(lab.dms("alice"))
    lab.set(60)
    lab.minutes(2)
    assert lab.reservation(1).idle_prompted_at is None
    lab.set(0)
    lab.minutes(20)  # past the old grace: no release, since it worked meanwhile
    assert lab.reservation(1).state == "active" and len(lab.dms("alice")) == before


def test_a_gap_in_the_samples_is_not_evidence_of_idleness(engine: Engine) -> None:
    lab = Lab(engine)
    lab.svc.reserve(actor(lab.svc, "alice"), Reserve(count=1, model="A100"))
    lab.minutes(20)
    lab.minutes(5, sample=False)  # the host did not answer for five minutes
    lab.minutes(20)
    assert prompts(lab, "alice") == []  # no window of 30 covered end to end yet
    lab.minutes(12)
    assert len(prompts(lab, "alice")) == 1


def test_a_host_without_telemetry_never_prompts(sqlite_engine: Engine) -> None:
    lab = Lab(sqlite_engine)
    lab.runner.answer = "not json"
    lab.svc.reserve(actor(lab.svc, "alice"), Reserve())
    for _ in range(60):
        collect(lab.svc)  # fails every time: no samples
        idle_job(lab.svc)
        lab.clock.advance(timedelta(minutes=1))
    assert prompts(lab, "alice") == []


def test_coverage_and_assessment_are_exact() -> None:
    t0 = VirtualClock().now()
    pts = [Point(t0 + timedelta(minutes=i), 60, 0.0, 0.0) for i in range(30)]
    end = t0 + timedelta(minutes=30)
    assert coverage_s(pts, t0, end) == 1800
    assert coverage_s(pts + pts, t0, end) == 1800  # overlaps count once
    assert coverage_s(pts[:10] + pts[15:], t0, end) == 1500
    assert assess(pts, t0, end, 5.0, timedelta(seconds=60)).idle
    busy = [*pts[:-1], Point(pts[-1].at, 60, 5.0, 0.0)]
    assert not assess(busy, t0, end, 5.0, timedelta(seconds=60)).idle  # 5% is not under 5%
    assert not assess(pts[:25], t0, end, 5.0, timedelta(seconds=60)).covered
