"""The /gpu grammar: the forms people type, the errors they get, and a fuzz."""

from __future__ import annotations

import contextlib
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bot.domain.commands import (
    VERBS,
    Budget,
    Cancel,
    Cost,
    Extend,
    Help,
    Logs,
    Pool,
    Prices,
    Queue,
    Release,
    Reserve,
    Run,
    Status,
    UserRef,
    Util,
)
from bot.domain.durations import format_duration, parse_duration
from bot.domain.errors import UserError
from bot.faces.dispatch import parse_text as parse

H = timedelta(hours=1)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("reserve", Reserve()),
        ("/gpu reserve", Reserve()),
        ("reserve a100", Reserve(model="A100")),
        ("reserve 2 a100 for 3h", Reserve(count=2, model="A100", duration=3 * H)),
        ("reserve 2xa100 4h", Reserve(count=2, model="A100", duration=4 * H)),
        ("reserve 2×H100 for 90 minutes", Reserve(count=2, model="H100", duration=1.5 * H)),
        ("reserve a100x4 1h30m", Reserve(count=4, model="A100", duration=1.5 * H)),
        ("reserve 3 hours", Reserve(duration=3 * H)),
        ("reserve an a100-80gb for 2d", Reserve(model="A100-80GB", duration=48 * H)),
        ("reserve 2 gpus", Reserve(count=2)),
        ("reserve cpu", Reserve(model="cpu")),
        ("RESERVE L4", Reserve(model="L4")),
        ("extend 12 1h", Extend(duration=H, reservation_id=12)),
        ("extend 1h", Extend(duration=H)),
        ("extend #12 by 30m", Extend(duration=H / 2, reservation_id=12)),
        ("release", Release()),
        ("release all", Release(all=True)),
        ("release 12", Release(reservation_id=12)),
        ("release #12", Release(reservation_id=12)),
        ("status", Status()),
        ("status me", Status(mine_only=True)),
        ("", Help()),
        ("help", Help()),
        ("help reserve", Help("reserve")),
        ("queue", Queue()),
        ("cancel 42", Cancel(42)),
        ("cancel s3fa9C1", Cancel(sweep="s3fa9c1")),
        ("logs 42 100", Logs(42, 100)),
        ("util", Util()),
        ("cost", Cost()),
        ("cost team month", Cost(scope="team", period="month")),
        (
            "cost <@U024BE7LH|alice> today",
            Cost(scope="user", user=UserRef("U024BE7LH"), period="today"),
        ),
        ("budget", Budget()),
        ("budget @alice 200/week", Budget(user=UserRef("alice"), amount_usd=200.0)),
        (
            "budget @alice $800/month",
            Budget(user=UserRef("alice"), amount_usd=800.0, period="month"),
        ),
        ("budget @alice none", Budget(user=UserRef("alice"), clear=True)),
        ("prices", Prices()),
        ("prices h100", Prices("H100")),
        ("pool", Pool()),
        ("pool set p4d.24xlarge max=2 spend=50", Pool("p4d.24xlarge", 2, 50.0)),
        ("run --recipe digits", Run(recipe="digits")),
        (
            "run --gpus 8 --gpu a100 --max 4h --spot -- torchrun train.py --lr 3e-4",
            Run(
                command=("torchrun", "train.py", "--lr", "3e-4"),
                gpus=8,
                model="A100",
                max_duration=4 * H,
                spot=True,
            ),
        ),
        ("run --gpus=2 python train.py", Run(command=("python", "train.py"), gpus=2)),
        (
            "run --checkpoints -- python train.py",
            Run(command=("python", "train.py"), checkpoints=True),
        ),
        ("run", Run()),
        ("run --resume 42", Run(resume=42)),
        (
            "run --resume #42 --max 2h --partition long",
            Run(resume=42, max_duration=2 * H, place=(("partition", "long"),)),
        ),
        (
            "run --recipe digits --lr 100000 --epochs 2",
            Run(recipe="digits", options=(("lr", 100000.0), ("epochs", 2))),
        ),
        (
            "run --sweep lr=1e-4,3e-4,1e-3 --recipe digits",
            Run(recipe="digits", sweep=("lr", (1e-4, 3e-4, 1e-3))),
        ),
    ],
)
def test_forms_people_type(text: str, expected: object) -> None:
    assert parse(text) == expected


@pytest.mark.parametrize(
    ("text", "reason", "verb"),
    [
        ("reserve 2 potato", "I don't know the GPU model `potato`", "reserve"),
        ("run --checkpoints=yes -- x", "`--checkpoints` takes no value", "run"),
        ("run --checkpoints --checkpoints -- x", "given twice", "run"),
        ("reserve 0", "1 to 64 GPUs", "reserve"),
        ("reserve 2 3", "count once", "reserve"),
        ("reserve for", "`for` needs a duration", "reserve"),
        ("reserve for ever", "`ever` is not a duration", "reserve"),
        ("extend", "how much longer", "extend"),
        ("extend 12 soon", "not a duration", "extend"),
        ("release 1 2", "one reservation", "release"),
        ("release abc", "must be a whole number", "release"),
        ("cancel", "one run", "cancel"),
        ("run --gpus two -- x", "--gpus must be a whole number", "run"),
        ("run --precision fp8 -- x", "--precision must be one of", "run"),
        ("run --frob -- x", "Unknown option", "run"),
        ("run --gpus 2", "Say what to run", "run"),
        ("run --resume 42 --gpus 2", "`--resume 42` runs run #42 again as it was", "run"),
        ("run --resume 42 -- python train.py", "give it only `--max` and where", "run"),
        ("run --resume soon", "--resume must be a whole number", "run"),
        ("run 'unclosed", "could not split", "run"),
        ("run --lr 0.1 -- python t.py", "goes with a recipe", "run"),
        ("run --recipe digits --lr fast", "takes a number", "run"),
        ("run --recipe digits --epochs 0", "between 1 and", "run"),
        ("run --recipe digits --sweep lr=1e-3", "2 to 8 different values", "run"),
        ("run --recipe digits --sweep momentum=0.9,0.99", "Sweep one setting", "run"),
        ("run --recipe digits --lr 1 --sweep lr=1,2", "give one of them", "run"),
        ("budget alice 200", "Name the person first", "budget"),
        ("budget @alice lots", "not an amount", "budget"),
        ("pool set p4d max=x", "not an instance type", "pool"),
        ("help frob", "There is no verb", "help"),
        ("status everything", "only understands `me`", "status"),
    ],
)
def test_bad_input_says_what_is_wrong_and_shows_the_usage(
    text: str, reason: str, verb: str
) -> None:
    with pytest.raises(UserError) as err:
        parse(text)
    message = err.value.text
    assert reason in message
    assert message.endswith("Usage: " + VERBS[verb].usage)
    assert len(message.splitlines()) == 2


def test_an_unknown_verb_suggests_the_near_one() -> None:
    with pytest.raises(UserError, match="Did you mean `reserve`"):
        parse("reserv a100")


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=200))
def test_any_text_is_a_command_or_a_user_error(text: str) -> None:
    with contextlib.suppress(UserError):
        parse(text)


@pytest.mark.parametrize(
    "text",
    [
        "/gpu release ²",
        "/gpu reserve ²",
        "/gpu run --gpus ² -- x",
        "/gpu cancel ³",
        "/gpu logs 1 ²",
        "/gpu extend ² 1h",
        "/gpu util keep ²",
    ],
)
def test_digits_that_are_not_ascii_are_a_user_error(text: str) -> None:
    # str.isdigit() says yes to "²" and int() then raises ValueError: a 500 in Slack.
    with pytest.raises(UserError):
        parse(text)


_WORDS = st.sampled_from(
    [
        *VERBS,
        "a100",
        "2xa100",
        "for",
        "3h",
        "all",
        "12",
        "--gpus",
        "--",
        "me",
        "@bob",
        "x4",
        "200/week",
        "'",
        "=",
        "²",
        "٣",
    ]
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_WORDS, max_size=8))
def test_near_miss_sentences_are_a_command_or_a_user_error(words: list[str]) -> None:
    with contextlib.suppress(UserError):
        parse(" ".join(words))


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("3h", 10800),
        ("90m", 5400),
        ("1h30m", 5400),
        ("2d", 172800),
        ("45s", 45),
        ("1.5h", 5400),
        ("90 min", 5400),
    ],
)
def test_durations(text: str, seconds: int) -> None:
    delta = parse_duration(text)
    assert delta is not None and delta.total_seconds() == seconds


@pytest.mark.parametrize("text", ["", "0h", "h", "3", "3x", "-1h", "1y", "99999d"])
def test_not_durations(text: str) -> None:
    assert parse_duration(text) is None


def test_format_duration_round_trips() -> None:
    for text in ["2h", "1h30m", "45m", "30s", "3d"]:
        delta = parse_duration(text)
        assert delta is not None and format_duration(delta) == text
