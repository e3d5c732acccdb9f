"""Who may do what (bot.app.access): the membership port's contract, run against the shell's
table and against Slack (the fake Web API); who may start runs, with its cache and its
refusals; run logs kept to their owner and the admins on both databases; and the audit
line each admin action leaves, only once its change is committed."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from bot.app.access import (
    AUDIT_LOGGER,
    Membership,
    MembershipError,
    RunGate,
    StaticMembership,
    audit,
)
from bot.app.config import ConfigError, Settings, load_settings
from bot.app.service import Actor, GpuService
from bot.domain.commands import Logs, Reserve, Run
from bot.domain.errors import UserError
from bot.faces.dispatch import handle_text
from bot.faces.slack.membership import SlackMembership
from db.models import TrainingRun
from db.session import transaction
from tests.core.helpers import actor, host, make_service, runs_here
from tests.core.test_runs import local_host, run_until, state
from tests.fakes.slack_api import FakeSlack

ROOT = Path(__file__).resolve().parents[2]
GPUBOT = str(Path(sys.executable).with_name("gpubot"))
GROUPS = {"S0GPUTEAM": ["U0ALICE01", "U0BOB0001"], "S0EMPTY01": []}

# --- the Membership port: one contract, both implementations -----------------------------

MembershipFactory = Callable[[dict[str, list[str]]], Membership]


@pytest.fixture(params=["static", "slack"])
def membership_of(request: pytest.FixtureRequest, fake_slack: FakeSlack) -> MembershipFactory:
    """Builds the implementation under test holding the given groups."""

    def static(groups: dict[str, list[str]]) -> Membership:
        return StaticMembership(groups)

    def slack(groups: dict[str, list[str]]) -> Membership:
        for group, members in groups.items():
            fake_slack.add_usergroup(group, members)
        return SlackMembership(fake_slack.client(retry_handlers=[]))

    return static if request.param == "static" else slack


def test_contract_a_group_answers_its_members(membership_of: MembershipFactory) -> None:
    m = membership_of(GROUPS)
    assert m.members("S0GPUTEAM") == frozenset({"U0ALICE01", "U0BOB0001"})
    assert m.members("S0EMPTY01") == frozenset()  # "nobody", not an error


def test_contract_an_unknown_group_is_an_error_not_an_empty_group(
    membership_of: MembershipFactory,
) -> None:
    m = membership_of(GROUPS)
    with pytest.raises(MembershipError):
        m.members("S0NOSUCH1")


@pytest.mark.parametrize("kind", ["error", "disconnect", "ratelimit"])
def test_slack_failures_are_membership_errors(fake_slack: FakeSlack, kind: str) -> None:
    fake_slack.add_usergroup("S0GPUTEAM", ["U0ALICE01"])
    fake_slack.fail_next("usergroups.users.list", kind=kind, error="invalid_auth")  # type: ignore[arg-type]
    m = SlackMembership(fake_slack.client(retry_handlers=[], timeout=2))
    with pytest.raises(MembershipError):
        m.members("S0GPUTEAM")
    assert m.members("S0GPUTEAM") == frozenset({"U0ALICE01"})  # the next call works again


# --- who may start runs ----------------------------------------------------------------------


class CountingMembership:
    """The port's double, counting how often it is asked (the cache's whole point)."""

    def __init__(self, groups: dict[str, list[str]], fail: bool = False) -> None:
        self.inner = StaticMembership(groups)
        self.asked = 0
        self.fail = fail

    def members(self, group_id: str) -> frozenset[str]:
        self.asked += 1
        if self.fail:
            raise MembershipError("Slack is down")
        return self.inner.members(group_id)


ALICE = Actor("U0ALICE01", "Alice")
CAROL = Actor("U0CAROL01", "Carol")
ROOT_ADMIN = Actor("U0ADMIN01", "Admin", admin=True)


def test_by_default_everyone_may_run_and_no_group_is_asked() -> None:
    counting = CountingMembership(GROUPS)
    gate = RunGate(Settings(), counting)
    assert gate.run_refusal(CAROL) is None
    assert gate.channel_refusal("C0ANY0001") is None and gate.channel_refusal(None) is None
    assert counting.asked == 0


def test_listed_users_group_members_and_admins_may_run_others_may_not() -> None:
    counting = CountingMembership(GROUPS)
    settings = Settings(run_users=("U0DAVE001",), run_groups=("S0GPUTEAM",))
    gate = RunGate(settings, counting)
    assert gate.run_refusal(Actor("U0DAVE001", "Dave")) is None
    assert counting.asked == 0  # a listed user costs no lookup
    assert gate.run_refusal(ALICE) is None  # in the group
    assert gate.run_refusal(ROOT_ADMIN) is None
    refusal = gate.run_refusal(CAROL)
    assert refusal is not None and "not one of them" in refusal


def test_group_members_are_cached_for_a_while_then_read_again() -> None:
    now = [1000.0]
    counting = CountingMembership(GROUPS)
    gate = RunGate(Settings(run_groups=("S0GPUTEAM",)), counting, ttl_s=300, clock=lambda: now[0])
    for _ in range(5):
        assert gate.run_refusal(ALICE) is None
        assert gate.run_refusal(CAROL) is not None
    assert counting.asked == 1
    now[0] += 301
    gate.run_refusal(ALICE)
    assert counting.asked == 2


def test_a_failed_lookup_is_a_plain_refusal_never_an_exception() -> None:
    gate = RunGate(Settings(run_groups=("S0GPUTEAM",)), CountingMembership(GROUPS, fail=True))
    refusal = gate.run_refusal(ALICE)
    assert refusal is not None and "could not check with Slack" in refusal
    assert gate.run_refusal(ROOT_ADMIN) is None  # admins need no lookup


def test_channels_limit_where_runs_are_taken() -> None:
    gate = RunGate(Settings(run_channels=("C0GPU0001",)), StaticMembership())
    assert gate.channel_refusal("C0GPU0001") is None
    for elsewhere in ("C0RANDOM1", "", None):
        refusal = gate.channel_refusal(elsewhere)
        assert refusal is not None and "<#C0GPU0001>" in refusal


def test_run_settings_from_the_environment() -> None:
    s = load_settings(
        {
            "GPUBOT_RUN_USERS": "U0ALICE01, @bob",
            "GPUBOT_RUN_GROUPS": "S0GPUTEAM",
            "GPUBOT_RUN_CHANNELS": "C0GPU0001,G0PRIV001",
            "GPUBOT_SHARED_LOGS": "yes",
        }
    )
    assert s.run_users == ("U0ALICE01", "bob")
    assert s.run_groups == ("S0GPUTEAM",)
    assert s.run_channels == ("C0GPU0001", "G0PRIV001")
    assert s.shared_logs is True
    assert load_settings({}).shared_logs is False
    # A name where an id belongs would match nobody and silently lock everyone out.
    with pytest.raises(ConfigError, match=r"GPUBOT_RUN_CHANNELS.*not '#gpu'"):
        load_settings({"GPUBOT_RUN_CHANNELS": "#gpu"})
    with pytest.raises(ConfigError, match=r"GPUBOT_RUN_GROUPS.*not '@ml-team'"):
        load_settings({"GPUBOT_RUN_GROUPS": "@ml-team"})
    with pytest.raises(ConfigError, match=r"from GPUBOT_SHARED_LOGS\) must be true or false"):
        load_settings({"GPUBOT_SHARED_LOGS": "sometimes"})


def test_a_refused_user_queues_nothing_through_the_service(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    svc, _ = make_service(
        sqlite_engine, [local_host(1)], run_users=("alice",), places=runs_here(tmp_path / "runs")
    )
    runs = svc.runs
    reply = handle_text(svc, actor(svc, "mallory"), "/gpu run -- echo hi")
    assert reply.error and "Starting runs is limited" in reply.view.text
    assert "Usage:" not in reply.view.text  # a refusal is about who, not about syntax
    with pytest.raises(UserError):
        runs.submit(actor(svc, "mallory"), Run(command=("echo", "hi")))
    ok = runs.submit(actor(svc, "alice"), Run(command=("echo", "hi")))
    assert ok.extra["run_id"] == 1
    assert "queued" in runs.submit(actor(svc, "root"), Run(command=("echo", "x"))).view.text
    with Session(sqlite_engine) as s:
        owners = [r.user_id for r in s.exec(select(TrainingRun))]
    assert len(owners) == 2  # alice's and the admin's; mallory's never existed


def test_gpubot_submit_is_refused_for_someone_not_allowed_to_run(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text("print('hi')\n")
    home = tmp_path / "home"
    env = {**os.environ, "GPUBOT_HOME": str(home), "GPUBOT_USER": "mallory"}
    env.update(GPUBOT_RUN_USERS="alice", GPUBOT_LOCAL_GPUS="none")
    for name in ("DATABASE_URL", "GPUBOT_PROVIDER", "GPUBOT_ADMINS"):
        env.pop(name, None)
    done = subprocess.run(
        [GPUBOT, "submit", str(proj), "--", "python", "train.py"],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Starting runs is limited" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert not (home / "staged").exists()  # refused before anything was copied
    from db.session import make_engine

    engine = make_engine(f"sqlite:///{home / 'gpubot.db'}")
    try:
        with Session(engine) as s:
            assert s.exec(select(TrainingRun)).all() == []
    finally:
        engine.dispose()


# --- run logs: the owner's and the admins' ----------------------------------------------------

SECRET_LINE = "alice-private-output-7f3a"


@pytest.fixture
def finished_run(engine: Engine, tmp_path: Path) -> Iterator[tuple[GpuService, int]]:
    """Alice's run, really run on this machine, that printed a line only she should see."""
    svc, _ = make_service(engine, [local_host(1)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    cmd = (sys.executable, "-c", f"print('{SECRET_LINE}')")
    rid = runs.submit(actor(svc, "alice"), Run(command=cmd)).extra["run_id"]
    run_until(runs, lambda: state(engine, rid).state == "succeeded")
    yield svc, rid


def test_bob_cannot_read_alices_log_on_either_database(
    finished_run: tuple[GpuService, int], caplog: pytest.LogCaptureFixture
) -> None:
    svc, rid = finished_run
    bob = handle_text(svc, actor(svc, "bob"), f"/gpu logs {rid}")
    assert bob.error and bob.ephemeral
    assert f"Run #{rid} is not yours" in bob.view.text
    assert SECRET_LINE not in repr(bob)
    # Its owner reads it; an admin reads it too, and that leaves an audit line.
    alice = handle_text(svc, actor(svc, "alice"), f"/gpu logs {rid}")
    assert not alice.error and SECRET_LINE in repr(alice.view)
    with caplog.at_level(logging.INFO, logger=AUDIT_LOGGER):
        root = handle_text(svc, actor(svc, "root"), f"/gpu logs {rid}")
    assert not root.error and SECRET_LINE in repr(root.view)
    assert _audit_lines(caplog) == [
        f"actor=root name='root' verb=read-log target='run #{rid} of alice'"
    ]


def test_shared_logs_open_every_log(sqlite_engine: Engine, tmp_path: Path) -> None:
    svc, _ = make_service(
        sqlite_engine, [local_host(1)], shared_logs=True, places=runs_here(tmp_path / "runs")
    )
    runs = svc.runs
    cmd = (sys.executable, "-c", f"print('{SECRET_LINE}')")
    rid = runs.submit(actor(svc, "alice"), Run(command=cmd)).extra["run_id"]
    run_until(runs, lambda: state(sqlite_engine, rid).state == "succeeded")
    reply = runs.logs(actor(svc, "bob"), Logs(rid))
    assert SECRET_LINE in repr(reply.view)


# --- the audit line ----------------------------------------------------------------------------


def _audit_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == AUDIT_LOGGER]


def test_each_admin_action_leaves_one_line_with_actor_verb_target(
    sqlite_engine: Engine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    svc, _ = make_service(
        sqlite_engine, [host("gpu1", "A100", 2), local_host(1)], places=runs_here(tmp_path / "runs")
    )
    runs = svc.runs
    alice, root = actor(svc, "alice"), actor(svc, "root")
    svc.reserve(alice, Reserve(count=1, model="A100"))
    svc.reserve(alice, Reserve(count=1, model="A100"))
    runs.submit(alice, Run(command=("echo", "hi"), model="cpu"))

    def as_root(line: str) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=AUDIT_LOGGER):
            reply = handle_text(svc, root, line)
        assert not reply.error, reply.view.text
        return _audit_lines(caplog)

    def line(verb: str, target: str) -> list[str]:
        return [f"actor=root name='root' verb={verb} target={target!r}"]

    assert as_root("/gpu util keep 1") == line("keep", "reservation #1 of alice")
    assert as_root("/gpu extend 1 1h") == line("extend", "reservation #1 of alice by 1h")
    assert as_root("/gpu release 1") == line("release", "reservation #1 of alice")
    assert as_root("/gpu cancel 1") == line("cancel", "run #1 of alice")
    assert as_root("/gpu budget @alice 200/week") == line("budget", "alice to $200/week")
    assert as_root("/gpu budget @alice none") == line("budget", "alice to none")
    assert as_root("/gpu pool set p4d.24xlarge max=2 spend=50") == line(
        "pool-set", "p4d.24xlarge max=2 spend=50.0"
    )


def test_own_actions_and_refused_ones_leave_no_audit_line(
    sqlite_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    svc, _ = make_service(sqlite_engine, [host("gpu1", "A100", 2)])
    alice, bob, root = actor(svc, "alice"), actor(svc, "bob"), actor(svc, "root")
    svc.reserve(alice, Reserve(count=1))
    svc.reserve(root, Reserve(count=1))
    with caplog.at_level(logging.INFO, logger=AUDIT_LOGGER):
        assert handle_text(svc, bob, "/gpu release 1").error  # not his
        assert handle_text(svc, bob, "/gpu budget @alice 1/week").error  # not an admin
        assert handle_text(svc, root, "/gpu release 99").error  # no such reservation
        assert not handle_text(svc, root, "/gpu release 2").error  # the admin's own
        assert not handle_text(svc, alice, "/gpu release 1").error  # alice's own
    assert _audit_lines(caplog) == []


def test_a_rolled_back_change_leaves_no_audit_line(
    sqlite_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=AUDIT_LOGGER):
        with pytest.raises(RuntimeError), transaction(sqlite_engine) as s:
            audit(ROOT_ADMIN, "release", "reservation #1 of alice", session=s)
            raise RuntimeError("deadlock, say; the caller retries")
        with transaction(sqlite_engine) as s:
            audit(ROOT_ADMIN, "release", "reservation #1 of alice", session=s)
            assert _audit_lines(caplog) == []  # not before the commit
    assert _audit_lines(caplog) == [
        "actor=U0ADMIN01 name='Admin' verb=release target='reservation #1 of alice'"
    ]
