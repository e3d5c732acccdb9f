"""App Home reads the pool on its own (counts, not a row per GPU) and must still say
what `/gpu status` says: the first line, the caller's reservations and the line."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from sqlalchemy.engine import Engine

from bot.domain import views
from bot.domain.commands import Release, Reserve, Status
from bot.faces.slack.home import home_view
from tests.core.helpers import HOUR, actor, host, make_service


def _after(view: views.View, heading: str) -> views.Block:
    at = next(i for i, b in enumerate(view.blocks) if getattr(b, "text", None) == heading)
    return view.blocks[at + 1]


def test_home_says_what_status_says_across_host_states(engine: Engine) -> None:
    a100 = host("ready-a", "A100", 4, hourly=8.0)
    fleet = [
        a100,
        host("ready-h", "H100", 2, hourly=12.0),
        replace(host("booting", "A100", 2), state="pending"),
        replace(host("parked", "A100", 3), state="stopped"),
        replace(host("empty", "A100", 1), gpus=()),  # ready, with no GPU present
    ]
    svc, clock = make_service(engine, fleet)
    alice, bob, carol = actor(svc, "alice"), actor(svc, "bob"), actor(svc, "carol")
    svc.reserve(alice, Reserve(count=2, model="A100", duration=2 * HOUR))
    svc.reserve(alice, Reserve(count=1, model="H100", duration=HOUR))
    svc.reserve(bob, Reserve(count=2, model="A100", duration=HOUR))
    svc.reserve(carol, Reserve(count=1, model="A100", duration=HOUR))  # waits: A100s taken
    svc.reserve(alice, Reserve(count=4, model="A100", duration=HOUR))  # waits behind carol
    svc.release(bob, Release(all=True))  # carol is granted; alice still waits
    svc.reserve(bob, Reserve(count=2, model="A100", duration=HOUR))  # waits behind alice
    clock.advance(timedelta(minutes=30))

    for who in (alice, bob, carol, actor(svc, "dave")):
        status = svc.status(who, Status(mine_only=False)).view
        home = home_view(svc, who)
        summary = status.blocks[1]
        assert isinstance(summary, views.Context)
        assert home.blocks[1] == summary
        assert home.text == f"gpubot: {status.text}"
        yours = [b for b in status.blocks if getattr(b, "text", "").startswith("*Yours*")]
        mine = _after(home, "*Your reservations*")
        if yours:
            assert isinstance(mine, views.Text) and isinstance(yours[0], views.Text)
            assert mine.text == yours[0].text.removeprefix("*Yours*\n")
        else:
            assert mine == views.Text(
                "You hold no GPUs and are not waiting. `/gpu reserve` asks for one."
            )
        assert _after(home, "*The team's waiting line*") == _after(status, "*Waiting*")
        _, costs, _ = svc.costs("week", who.key)
        cost = next(b for b in home.blocks if getattr(b, "text", "").startswith("*Your cost"))
        assert isinstance(cost, views.Text)
        assert f"${costs.get(who.key, 0):,.2f} " in cost.text

    first = svc.status(alice, Status()).view
    assert first.text == "2 of 6 free on 3 hosts; 2 starting up; 3 unavailable; 2 waiting"
    shown = _after(home_view(svc, alice), "*Your reservations*")
    assert isinstance(shown, views.Text)
    assert "GPUs A100 0, 1 on ready-a" in shown.text
    assert "GPU H100 0 on ready-h" in shown.text
    assert "#5: waiting for 4× A100, position 1" in shown.text


def test_home_with_nobody_waiting_and_no_reservation(engine: Engine) -> None:
    svc, _ = make_service(engine, [host("one", "A100", 2)])
    home = home_view(svc, actor(svc, "alice"))
    assert home.text == "gpubot: 2 of 2 free on 1 host"
    assert _after(home, "*The team's waiting line*") == views.Text("Nobody is waiting.")
    cost = next(b for b in home.blocks if getattr(b, "text", "").startswith("*Your cost"))
    assert isinstance(cost, views.Text) and "\n$0.00 " in cost.text
