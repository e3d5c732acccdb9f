"""Block Kit rendering stays within Slack's limits for any View, and says what it cut."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bot.domain import views
from bot.faces.slack import blocks
from tests.fakes.slack_api import FakeSlack, SlackReference, SlackSpecMissingError, load_reference

# Text that stresses escaping and splitting: markup, Slack's control characters, newlines.
_text = st.text(
    alphabet=st.sampled_from(list("ab <>&*`_~\n|:@!#é…")) | st.characters(codec="utf-8"),
    max_size=4000,
)
_short = st.text(max_size=300)
_button = st.builds(
    views.Button,
    label=_short,
    action_id=st.text(min_size=1, max_size=300),
    value=_short,
    style=st.sampled_from([None, "primary", "danger"]),
    command=st.one_of(st.none(), st.text(max_size=2500)),
)
_block = st.one_of(
    st.builds(views.Header, _text),
    st.builds(views.Text, _text),
    st.builds(views.Context, _text),
    st.builds(views.Code, _text),
    st.builds(views.Divider),
    st.builds(views.Fields, st.lists(st.tuples(_short, _text), max_size=25).map(tuple)),
    st.builds(
        views.Table,
        st.lists(_short, min_size=1, max_size=6).map(tuple),
        st.lists(st.lists(_short, max_size=6).map(tuple), max_size=400).map(tuple),
    ),
    st.builds(views.Actions, st.lists(_button, max_size=30).map(tuple)),
)
_view = st.builds(views.View, text=_text, blocks=st.lists(_block, max_size=70).map(tuple))


@pytest.fixture(scope="module")
def fake() -> FakeSlack:
    """Only its checkers are used; nothing is started. Without Slack's reference data
    (`../shared/slack`) the tests skip, as every test of the fake does."""
    try:
        return FakeSlack()
    except SlackSpecMissingError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def ref() -> SlackReference:
    try:
        return load_reference()
    except SlackSpecMissingError as exc:
        pytest.skip(str(exc))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(view=_view)
def test_any_view_renders_within_slack_limits(fake: FakeSlack, view: views.View) -> None:
    body = blocks.message(view)
    assert fake.message_problems(body) == []
    assert 1 <= len(body["blocks"]) <= blocks.BLOCKS_PER_MESSAGE
    assert sum(blocks.block_chars(b) for b in body["blocks"]) <= blocks.MESSAGE.chars
    home = {"type": "home", "blocks": blocks.render_blocks(view, blocks.VIEW)}
    assert fake.view_problems(home) == []


def test_limits_agree_with_limits_json(ref: SlackReference) -> None:
    assert ref.limit("blocks_per_message") == blocks.BLOCKS_PER_MESSAGE
    assert ref.limit("blocks_per_modal_or_home") == blocks.BLOCKS_PER_VIEW
    assert ref.limit("section_text_chars") == blocks.SECTION_TEXT_CHARS
    assert ref.limit("section_fields_count") == blocks.SECTION_FIELDS_COUNT
    assert ref.limit("section_field_text_chars") == blocks.SECTION_FIELD_TEXT_CHARS
    assert ref.limit("header_text_chars") == blocks.HEADER_TEXT_CHARS
    assert ref.limit("actions_block_elements") == blocks.ACTIONS_BLOCK_ELEMENTS
    assert ref.limit("button_text_chars") == blocks.BUTTON_TEXT_CHARS
    assert ref.limit("action_id_chars") == blocks.ACTION_ID_CHARS
    assert ref.limit("button_value_chars") == blocks.BUTTON_VALUE_CHARS
    assert ref.limit("message_text_chars") >= blocks.MESSAGE_TEXT_CHARS


def _all_text(body: dict[str, Any]) -> str:
    return json.dumps(body["blocks"], ensure_ascii=False)


def test_a_queue_of_300_is_cut_with_and_n_more() -> None:
    rows = tuple((str(i), f"#{i}", f"user{i}", "1 GPU", "2h", "5m") for i in range(300))
    view = views.View(
        "300 waiting", (views.Table(("pos", "id", "who", "wants", "for", "waiting"), rows),)
    )
    text = _all_text(blocks.message(view))
    assert "user0 " in text and "user59 " in text and "user60 " not in text
    assert "…and 240 more rows" in text


def test_forty_hosts_are_cut_with_a_closing_note() -> None:
    host_blocks: list[views.Block] = [views.Header("GPU status")]
    for h in range(40):
        host_blocks.append(views.Text(f"*host{h}*: ssh, ready, 8/8 free"))
        host_blocks.append(views.Table(("gpu", "model"), tuple((str(g), "A100") for g in range(8))))
    body = blocks.message(views.View("status", tuple(host_blocks)))
    assert len(body["blocks"]) == blocks.BLOCKS_PER_MESSAGE
    last = body["blocks"][-1]
    assert last["type"] == "context" and "more blocks not shown" in last["elements"][0]["text"]


def test_mrkdwn_control_characters_are_escaped() -> None:
    body = blocks.message(views.View("x", (views.Text("<!channel> & *bold*"),)))
    assert body["blocks"][0]["text"]["text"] == "&lt;!channel&gt; &amp; *bold*"


def test_buttons_carry_their_command_line_and_unique_action_ids() -> None:
    b = views.Button("Release", views.ACTION_RELEASE, "1", "danger", "/gpu release 1")
    body = blocks.message(views.View("x", (views.Actions((b, b)),)))
    elements = body["blocks"][0]["elements"]
    assert [e["value"] for e in elements] == ["/gpu release 1", "/gpu release 1"]
    assert len({e["action_id"] for e in elements}) == 2


def test_the_clouds_offer_renders_within_slack_limits_with_its_two_buttons(
    fake: FakeSlack,
) -> None:
    """The plan a waiting run's owner gets (bot.app.burst.offers), with a long price."""
    from datetime import UTC, datetime

    from bot.app.burst.offers import Ask, offer_view
    from db.models import BurstOffer, User

    offer = BurstOffer(
        run_id=123456789,
        user_id=1,
        place="aws",
        instance_type="p4de.24xlarge",
        usd_per_hour=40.97 * 8,
        hours=72.0,
        assumed=False,
        estimate_usd=40.97 * 8 * 72,
        created_at=datetime(2026, 12, 6, tzinfo=UTC),
    )
    when = datetime(2026, 12, 6, tzinfo=UTC)
    owner = User(id=1, key="U0123456789", display_name="alice")
    ask = Ask(
        "run",
        123456789,
        owner,
        "A100-80GB",
        8,
        False,
        72 * 3600,
        when,
        None,
        True,
        None,
        False,
        None,
    )
    stage = "pending: Resources, expected 15:20 UTC"
    head = f"{ask.name} has waited 3h for the team's own A100-80GB GPUs."
    body = blocks.message(offer_view(offer, ask, head, stage, "EC2"))
    assert fake.message_problems(body) == []
    (actions,) = [b for b in body["blocks"] if b["type"] == "actions"]
    labels = [e["text"]["text"] for e in actions["elements"]]
    assert labels == ["Run on EC2 now, about $23,598.72", "Keep waiting"]
    assert all(len(label) <= blocks.BUTTON_TEXT_CHARS for label in labels)
    assert "expected 15:20 UTC" in _all_text(body)
