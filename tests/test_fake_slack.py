"""Contract tests of the fake Slack Web API, driven by the real slack_sdk client.

The fake is only worth something if it rejects what Slack rejects and accepts what Slack
accepts; these tests pin both sides at the limits in `../shared/slack/limits.json`.
"""

from __future__ import annotations

import concurrent.futures
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from http.client import RemoteDisconnected
from typing import Any
from urllib.parse import urlsplit

import pytest
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackRequestError
from slack_sdk.http_retry import (
    ConnectionErrorRetryHandler,
    FixedValueRetryIntervalCalculator,
    RateLimitErrorRetryHandler,
)
from slack_sdk.webhook import WebhookClient

from tests.fakes.slack_api import (
    ENFORCED_LIMITS,
    NOT_ENFORCED_LIMITS,
    UPLOAD_ENDPOINT,
    WEB_API_LIMIT_SECTIONS,
    FakeSlack,
    SlackReference,
    SlackSpecMissingError,
    load_reference,
    supplement_methods,
)

# The fake_slack fixture (tests/conftest.py may import it too; loading it twice is harmless).

CHANNEL = "C0FAKECHAN1"
NO_WAIT = FixedValueRetryIntervalCalculator(fixed_internal=0.0)
Blocks = list[dict[str, Any]]


def _reference_or_none() -> SlackReference | None:
    try:
        return load_reference()
    except SlackSpecMissingError:
        return None


REF = _reference_or_none()


def _ref() -> SlackReference:
    if REF is None:
        pytest.skip("Slack reference data (../shared/slack) is missing")
    return REF


def _limit(limit_id: str) -> int:
    return REF.limit(limit_id) if REF is not None else 1


def section(text: str = "hello") -> dict[str, Any]:
    return {"type": "section", "text": {"type": "mrkdwn", "text": text}}


def button(text: str = "Go", **extra: Any) -> dict[str, Any]:
    return {"type": "button", "text": {"type": "plain_text", "text": text}, **extra}


def actions(*elements: dict[str, Any]) -> dict[str, Any]:
    return {"type": "actions", "elements": list(elements)}


def modal(blocks: Blocks, title: str = "GPU", **extra: Any) -> dict[str, Any]:
    return {
        "type": "modal",
        "title": {"type": "plain_text", "text": title},
        "blocks": blocks,
        **extra,
    }


def home(blocks: Blocks) -> dict[str, Any]:
    return {"type": "home", "blocks": blocks}


def client(fake: FakeSlack, **kwargs: Any) -> WebClient:
    """No retry handlers unless a test asks: a hidden retry would mask the fault under test."""
    kwargs.setdefault("retry_handlers", [])
    return fake.client(**kwargs)


# ---- the ordinary calls -----------------------------------------------------------------------


def test_post_message_returns_slack_shape_and_is_recorded(fake_slack: FakeSlack) -> None:
    blocks = [section("*a100* free")]
    resp = client(fake_slack).chat_postMessage(channel=CHANNEL, text="a100 free", blocks=blocks)

    assert resp["ok"] is True
    assert resp["channel"] == CHANNEL
    assert resp["message"]["text"] == "a100 free"
    assert resp["message"]["blocks"] == blocks
    assert resp["message"]["bot_id"] == fake_slack.bot_id
    call = fake_slack.last_call("chat.postMessage")
    assert call.params["blocks"] == blocks  # JSON-decoded, as sent
    assert call.content_type.startswith("application/json")
    assert call.headers["Authorization"] == "Bearer xoxb-(redacted)"
    assert fake_slack.bot_token not in repr(fake_slack.calls)
    [msg] = fake_slack.messages_in(CHANNEL)
    assert msg.ts == resp["ts"] and msg.text == "a100 free"


def test_form_encoded_blocks_string_is_accepted_and_decoded(fake_slack: FakeSlack) -> None:
    """Slack takes blocks as a JSON string in a form body (the spec's formData 'string')."""
    blocks = [section()]
    resp = client(fake_slack).api_call(
        "chat.postMessage", data={"channel": CHANNEL, "blocks": json.dumps(blocks)}
    )
    assert resp["ok"] is True
    call = fake_slack.last_call("chat.postMessage")
    assert call.content_type == "application/x-www-form-urlencoded"
    assert call.params["blocks"] == blocks


def test_missing_channel_is_a_violation(fake_slack: FakeSlack) -> None:
    fake_slack.expect_violation(
        r"chat\.postMessage: invalid_arguments: missing required field: channel"
    )
    with pytest.raises(SlackApiError) as err:
        client(fake_slack).api_call("chat.postMessage", json={"text": "hi"})
    assert err.value.response["error"] == "invalid_arguments"
    assert fake_slack.messages == []


@pytest.mark.filterwarnings("ignore:The top-level `text` argument is missing")
def test_post_without_text_or_blocks_is_no_text(fake_slack: FakeSlack) -> None:
    fake_slack.expect_violation(r"chat\.postMessage: no_text")
    with pytest.raises(SlackApiError) as err:
        client(fake_slack).chat_postMessage(channel=CHANNEL)
    assert err.value.response["error"] == "no_text"


def test_no_token_is_a_violation(fake_slack: FakeSlack) -> None:
    fake_slack.expect_violation(r"not_authed")
    anonymous = WebClient(base_url=fake_slack.url, retry_handlers=[])
    with pytest.raises(SlackApiError) as err:
        anonymous.chat_postMessage(channel=CHANNEL, text="hi")
    assert err.value.response["error"] == "not_authed"
    assert "Authorization" not in fake_slack.last_call("chat.postMessage").headers


def test_malformed_and_app_tokens_are_rejected_for_chat(fake_slack: FakeSlack) -> None:
    fake_slack.expect_violation(r"invalid_auth: .*malformed token")
    fake_slack.expect_violation(r"not_allowed_token_type: .*app-level token")
    for token, error in (
        ("not-a-token", "invalid_auth"),
        (fake_slack.app_token, "not_allowed_token_type"),
    ):
        with pytest.raises(SlackApiError) as err:
            client(fake_slack, token=token).chat_postMessage(channel=CHANNEL, text="hi")
        assert err.value.response["error"] == error
    assert all(
        t not in v for v in fake_slack.violations for t in ("not-a-token", fake_slack.app_token)
    )


def test_unknown_method_is_a_violation(fake_slack: FakeSlack) -> None:
    fake_slack.expect_violation(r"chat\.postMesage: unknown_method")
    with pytest.raises(SlackApiError) as err:
        client(fake_slack).api_call("chat.postMesage", json={"channel": CHANNEL, "text": "x"})
    assert err.value.response["error"] == "unknown_method"


def test_spec_method_without_behaviour_says_so_until_registered(fake_slack: FakeSlack) -> None:
    fake_slack.expect_violation(r"conversations\.history: not_implemented_in_fake")
    c = client(fake_slack)
    with pytest.raises(SlackApiError):
        c.conversations_history(channel=CHANNEL)
    fake_slack.on(
        "conversations.history", lambda call: {"ok": True, "messages": [], "has_more": False}
    )
    assert c.conversations_history(channel=CHANNEL)["messages"] == []


def test_json_body_to_a_form_only_method_is_a_violation(fake_slack: FakeSlack) -> None:
    """users.info reads form/query arguments only; a JSON body would lose 'user' at Slack."""
    fake_slack.expect_violation(r"users\.info: invalid_arguments: .*JSON")
    with pytest.raises(SlackApiError):
        client(fake_slack).api_call("users.info", json={"user": "U0FAKEUSR1"})


# ---- Block Kit limits (limits.json) -----------------------------------------------------------

BlockCase = tuple[str, Callable[[int], Blocks]]

# (limit id, blocks built around a size n): n = the limit passes, n = limit + 1 is a violation.
BLOCK_CASES: list[BlockCase] = [
    ("blocks_per_message", lambda n: [section() for _ in range(n)]),
    ("section_text_chars", lambda n: [section("x" * n)]),
    (
        "section_fields_count",
        lambda n: [{"type": "section", "fields": [{"type": "mrkdwn", "text": "f"}] * n}],
    ),
    (
        "section_field_text_chars",
        lambda n: [{"type": "section", "fields": [{"type": "mrkdwn", "text": "f" * n}]}],
    ),
    ("block_id_chars", lambda n: [{**section(), "block_id": "b" * n}]),
    (
        "header_text_chars",
        lambda n: [{"type": "header", "text": {"type": "plain_text", "text": "h" * n}}],
    ),
    ("actions_block_elements", lambda n: [actions(*(button(action_id=f"a{i}") for i in range(n)))]),
    ("button_text_chars", lambda n: [actions(button("b" * n))]),
    ("action_id_chars", lambda n: [actions(button(action_id="a" * n))]),
    ("button_value_chars", lambda n: [actions(button(value="v" * n))]),
    ("button_url_chars", lambda n: [actions(button(url="https://x.test/" + "u" * (n - 15)))]),
    ("button_accessibility_label_chars", lambda n: [actions(button(accessibility_label="l" * n))]),
    (
        "section_text_chars",
        lambda n: [
            {"type": "section", "accessory": button(), "text": {"type": "mrkdwn", "text": "s" * n}}
        ],
    ),
]


@pytest.mark.parametrize(("limit_id", "build"), BLOCK_CASES, ids=[c[0] for c in BLOCK_CASES])
def test_block_limit_is_enforced_at_the_boundary(
    fake_slack: FakeSlack, limit_id: str, build: Callable[[int], Blocks]
) -> None:
    c = client(fake_slack)
    n = _limit(limit_id)
    assert c.chat_postMessage(channel=CHANNEL, text="t", blocks=build(n))["ok"] is True
    fake_slack.expect_violation(rf"chat\.postMessage: invalid_blocks: {limit_id}: ")
    with pytest.raises(SlackApiError) as err:
        c.chat_postMessage(channel=CHANNEL, text="t", blocks=build(n + 1))
    assert err.value.response["error"] == "invalid_blocks"
    assert "json-pointer:/blocks" in err.value.response["response_metadata"]["messages"][0]
    assert len(fake_slack.messages_in(CHANNEL)) == 1


def test_51_blocks_and_3001_char_section_and_76_char_button(fake_slack: FakeSlack) -> None:
    """The issue's three named limits, as one readable case each."""
    c = client(fake_slack)
    fake_slack.expect_violation(r"blocks_per_message: no more than 50 items allowed \(got 51\)")
    fake_slack.expect_violation(
        r"section_text_chars: must be less than 3001 characters .*/blocks/0/text/text"
    )
    fake_slack.expect_violation(
        r"button_text_chars: must be less than 76 characters .*/blocks/0/elements/0/text/text"
    )
    for blocks in ([section()] * 51, [section("x" * 3001)], [actions(button("b" * 76))]):
        with pytest.raises(SlackApiError):
            c.chat_postMessage(channel=CHANNEL, text="t", blocks=blocks)
    assert len(fake_slack.violations) == 3


@pytest.mark.parametrize(
    ("blocks", "rule"),
    [
        ([actions(button("a", action_id="same"), button("b", action_id="same"))], "not unique"),
        ([actions(button(style="secondary"))], "button_style_values"),
        ([{"type": "sectoin", "text": {"type": "mrkdwn", "text": "x"}}], "unknown block type"),
        ([section("")], "section_text_chars: must be at least 1"),
        ([{"type": "header", "text": {"type": "mrkdwn", "text": "h"}}], "must be plain_text"),
        ([{"type": "section", "text": "bare string"}], "must be a text object"),
        ([actions(button(""))], "button_text_chars: must be at least 1"),
    ],
    ids=[
        "duplicate-action-id",
        "button-style",
        "typo-type",
        "empty-section",
        "mrkdwn-header",
        "bare-text",
        "empty-button",
    ],
)
def test_malformed_blocks_are_violations(fake_slack: FakeSlack, blocks: Blocks, rule: str) -> None:
    fake_slack.expect_violation(rule)
    with pytest.raises(SlackApiError) as err:
        client(fake_slack).chat_postMessage(channel=CHANNEL, text="t", blocks=blocks)
    assert err.value.response["error"] == "invalid_blocks"


def test_long_text_is_truncated_with_a_warning_not_rejected(fake_slack: FakeSlack) -> None:
    limit = _limit("message_text_chars")
    resp = client(fake_slack).chat_postMessage(channel=CHANNEL, text="x" * (limit + 5))
    assert resp["response_metadata"]["warnings"] == ["message_truncated"]
    assert len(fake_slack.messages_in(CHANNEL)[0].text or "") == limit


def test_markdown_text_cannot_be_combined_with_blocks(fake_slack: FakeSlack) -> None:
    fake_slack.expect_violation(r"markdown_text cannot be combined")
    c = client(fake_slack)
    assert c.api_call("chat.postMessage", json={"channel": CHANNEL, "markdown_text": "**hi**"})[
        "ok"
    ]
    with pytest.raises(SlackApiError):
        c.api_call(
            "chat.postMessage",
            json={"channel": CHANNEL, "markdown_text": "**hi**", "blocks": [section()]},
        )


def test_every_web_api_limit_is_enforced_or_explained() -> None:
    """A new limit in limits.json must be implemented or listed as skipped, with a reason."""
    ref = _ref()
    ids = {e["id"] for s in WEB_API_LIMIT_SECTIONS for e in ref.limits.get(s, [])}
    assert ids - ENFORCED_LIMITS - set(NOT_ENFORCED_LIMITS) == set()
    assert ENFORCED_LIMITS - ids == set(), "enforcing a limit limits.json does not have"
    assert ENFORCED_LIMITS.isdisjoint(NOT_ENFORCED_LIMITS)


# ---- views -----------------------------------------------------------------------------------


def test_views_publish_101_blocks_is_a_violation(fake_slack: FakeSlack) -> None:
    c = client(fake_slack)
    user = "U0FAKEUSR1"
    ok = c.views_publish(user_id=user, view=home([section()] * 100))
    assert ok["view"]["type"] == "home"
    fake_slack.expect_violation(
        r"views\.publish: invalid_arguments: blocks_per_modal_or_home: .*got 101"
    )
    with pytest.raises(SlackApiError):
        c.views_publish(user_id=user, view=home([section()] * 101))
    assert len(fake_slack.home_views[user]["blocks"]) == 100


@pytest.mark.parametrize(
    ("view", "rule"),
    [
        (modal([section()], title="t" * 25), "modal_title_chars"),
        (
            modal([section()], submit={"type": "plain_text", "text": "s" * 25}),
            "modal_submit_close_chars",
        ),
        (
            modal(
                [
                    {
                        "type": "input",
                        "label": {"type": "plain_text", "text": "GPUs"},
                        "element": {"type": "plain_text_input", "action_id": "n"},
                    }
                ]
            ),
            "modal_submit_close_chars: required when blocks hold an input",
        ),
        (modal([section()], private_metadata="m" * 3001), "private_metadata_chars"),
        (modal([section()], callback_id="c" * 256), "callback_id_chars"),
        (home([section()]), "must be modal for views.open"),
        ({"type": "modal", "blocks": []}, "a modal needs a title"),
        (modal([section("x" * 2900)] * 90), "view_too_large"),
    ],
    ids=[
        "title",
        "submit",
        "input-needs-submit",
        "metadata",
        "callback-id",
        "home-in-open",
        "no-title",
        "size",
    ],
)
def test_views_open_checks_modal_limits(
    fake_slack: FakeSlack, view: dict[str, Any], rule: str
) -> None:
    fake_slack.expect_violation(rf"views\.open: .*{rule}")
    with pytest.raises(SlackApiError):
        client(fake_slack).views_open(trigger_id=fake_slack.trigger_id(), view=view)


def test_trigger_id_is_single_use(fake_slack: FakeSlack) -> None:
    c = client(fake_slack)
    trigger = fake_slack.trigger_id()
    opened = c.views_open(trigger_id=trigger, view=modal([section()]))
    assert opened["view"]["id"] in fake_slack.views
    with pytest.raises(SlackApiError) as err:
        c.views_open(trigger_id=trigger, view=modal([section()]))
    assert err.value.response["error"] == "exchanged_trigger_id"
    assert fake_slack.violations == []  # a runtime error the bot must handle, not a spec breach


def test_views_update_replaces_by_id_and_checks_hash(fake_slack: FakeSlack) -> None:
    c = client(fake_slack)
    view = c.views_open(trigger_id=fake_slack.trigger_id(), view=modal([section("1")]))["view"]
    updated = c.views_update(view_id=view["id"], hash=view["hash"], view=modal([section("2")]))
    assert updated["view"]["blocks"] == [section("2")]
    with pytest.raises(SlackApiError) as err:
        c.views_update(view_id=view["id"], hash=view["hash"], view=modal([section("3")]))
    assert err.value.response["error"] == "hash_conflict"


# ---- files: the two-step upload ----------------------------------------------------------------


def test_files_upload_v2_uses_the_two_step_upload_on_loopback(fake_slack: FakeSlack) -> None:
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
    resp = client(fake_slack).files_upload_v2(
        content=png, filename="util.png", title="GPU util", channel=CHANNEL, initial_comment="util"
    )

    assert [c.method for c in fake_slack.calls] == [
        "files.getUploadURLExternal",
        "files.completeUploadExternal",
    ]
    step1 = fake_slack.calls[0]
    assert step1.params["length"] == str(len(png))
    upload_url = step1.response["upload_url"] if step1.response else ""
    parts = urlsplit(upload_url)
    assert (parts.hostname, parts.port) == ("127.0.0.1", fake_slack.port)
    stored = fake_slack.files[resp["file"]["id"]]
    assert stored.data == png and stored.completed and stored.channels == [CHANNEL]
    assert resp["file"]["title"] == "GPU util"
    [msg] = fake_slack.messages_in(CHANNEL)
    assert msg.files == (stored.id,) and msg.text == "util"


def test_complete_upload_without_posting_bytes_is_a_violation(fake_slack: FakeSlack) -> None:
    fake_slack.expect_violation(r"files\.completeUploadExternal: .*no bytes were POSTed")
    c = client(fake_slack)
    file_id = c.files_getUploadURLExternal(filename="a.png", length=3)["file_id"]
    with pytest.raises(SlackApiError):
        c.files_completeUploadExternal(files=[{"id": file_id, "title": "a"}], channel_id=CHANNEL)


def test_upload_length_must_match_what_was_declared(fake_slack: FakeSlack) -> None:
    fake_slack.expect_violation(rf"{UPLOAD_ENDPOINT}: .*2 bytes POSTed, .*length=3")
    url = client(fake_slack).files_getUploadURLExternal(filename="a.png", length=3)["upload_url"]
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(urllib.request.Request(url, data=b"ab", method="POST"), timeout=5)
    assert err.value.code == 400


def test_failed_upload_step_surfaces_in_files_upload_v2(fake_slack: FakeSlack) -> None:
    fake_slack.fail_next(UPLOAD_ENDPOINT, kind="error", status=503)
    with pytest.raises(urllib.error.HTTPError):
        client(fake_slack).files_upload_v2(content=b"abc", filename="a.txt", channel=CHANNEL)
    assert fake_slack.calls_to("files.completeUploadExternal") == []


def test_retired_files_upload_is_rejected(fake_slack: FakeSlack) -> None:
    fake_slack.expect_violation(r"files\.upload: method_deprecated")
    with pytest.raises(SlackApiError) as err:
        client(fake_slack).api_call(
            "files.upload", data={"channels": CHANNEL, "filename": "a.png"}, files={"file": b"abc"}
        )
    assert err.value.response["error"] == "method_deprecated"
    assert fake_slack.files == {}


# ---- faults: 429, network errors ---------------------------------------------------------------


def test_429_with_retry_after_is_retried_by_the_rate_limit_handler(fake_slack: FakeSlack) -> None:
    fake_slack.rate_limit("chat.postMessage", times=1, retry_after=0)
    c = client(fake_slack, retry_handlers=[RateLimitErrorRetryHandler(max_retry_count=2)])
    resp = c.chat_postMessage(channel=CHANNEL, text="after the wait")
    assert resp["ok"] is True
    first, second = fake_slack.calls_to("chat.postMessage")
    assert (first.status, first.fault, first.error) == (429, "ratelimit", "ratelimited")
    assert second.ok
    assert [m.text for m in fake_slack.messages_in(CHANNEL)] == ["after the wait"]


def test_429_without_a_handler_raises_with_retry_after(fake_slack: FakeSlack) -> None:
    fake_slack.rate_limit("*", times=1, retry_after=7)
    with pytest.raises(SlackApiError) as err:
        client(fake_slack).chat_postMessage(channel=CHANNEL, text="x")
    assert err.value.response.status_code == 429
    assert err.value.response.headers["Retry-After"] == "7"
    assert fake_slack.messages == []
    assert client(fake_slack).chat_postMessage(channel=CHANNEL, text="x")["ok"]  # only once


def test_disconnect_is_a_network_error_and_sends_nothing(fake_slack: FakeSlack) -> None:
    fake_slack.fail_next("chat.postMessage", kind="disconnect")
    with pytest.raises((urllib.error.URLError, RemoteDisconnected, ConnectionError)):
        client(fake_slack).chat_postMessage(channel=CHANNEL, text="lost?")
    assert fake_slack.messages == []
    assert fake_slack.last_call("chat.postMessage").fault == "disconnect"


def test_connection_retry_handler_recovers_from_one_disconnect(fake_slack: FakeSlack) -> None:
    fake_slack.fail_next("chat.postMessage", kind="disconnect")
    c = client(
        fake_slack,
        retry_handlers=[
            ConnectionErrorRetryHandler(max_retry_count=1, interval_calculator=NO_WAIT)
        ],
    )
    assert c.chat_postMessage(channel=CHANNEL, text="once")["ok"]
    assert [m.text for m in fake_slack.messages_in(CHANNEL)] == ["once"]


def test_disconnect_after_applies_the_call_then_loses_the_reply(fake_slack: FakeSlack) -> None:
    """The case an outbox must dedupe: a blind retry here posts the message twice."""
    fake_slack.fail_next("chat.postMessage", kind="disconnect_after")
    c = client(
        fake_slack,
        retry_handlers=[
            ConnectionErrorRetryHandler(max_retry_count=1, interval_calculator=NO_WAIT)
        ],
    )
    c.chat_postMessage(channel=CHANNEL, text="dup")
    assert [m.text for m in fake_slack.messages_in(CHANNEL)] == ["dup", "dup"]


def test_injected_error_is_ok_false_with_that_error(fake_slack: FakeSlack) -> None:
    fake_slack.fail_next("conversations.open", times=2, kind="error", error="service_unavailable")
    c = client(fake_slack)
    for _ in range(2):
        with pytest.raises(SlackApiError) as err:
            c.conversations_open(users="U0FAKEUSR1")
        assert err.value.response["error"] == "service_unavailable"
    assert c.conversations_open(users="U0FAKEUSR1")["ok"]
    assert fake_slack.violations == []


# ---- DMs, users, updates -----------------------------------------------------------------------


def test_conversations_open_then_post_a_dm(fake_slack: FakeSlack) -> None:
    c = client(fake_slack)
    opened = c.conversations_open(users="U0FAKEUSR1")
    dm = opened["channel"]["id"]
    assert dm.startswith("D") and dm == fake_slack.dm_channel_for("U0FAKEUSR1")
    assert c.conversations_open(users="U0FAKEUSR1")["already_open"] is True
    posted = c.chat_postMessage(channel=dm, text="your run finished")
    assert posted["channel"] == dm
    assert [m.text for m in fake_slack.messages_in(dm)] == ["your run finished"]
    assert (
        fake_slack.last_call("conversations.open").content_type
        == "application/x-www-form-urlencoded"
    )


def test_users_info_returns_registered_user(fake_slack: FakeSlack) -> None:
    fake_slack.add_user("U0ALICE001", "alice", real_name="Alice Liddell", is_admin=True)
    user = client(fake_slack).users_info(user="U0ALICE001")["user"]
    assert user["profile"]["display_name"] == "alice"
    assert user["profile"]["real_name"] == "Alice Liddell"
    assert user["is_admin"] is True


def test_unknown_user_is_user_not_found_without_auto_users(fake_slack: FakeSlack) -> None:
    fake_slack.auto_users = False
    with pytest.raises(SlackApiError) as err:
        client(fake_slack).users_info(user="U0NOBODY01")
    assert err.value.response["error"] == "user_not_found"


def test_chat_update_edits_and_rejects_a_user_id_channel(fake_slack: FakeSlack) -> None:
    c = client(fake_slack)
    posted = c.chat_postMessage(channel=CHANNEL, text="provisioning…", blocks=[section("…")])
    updated = c.chat_update(channel=CHANNEL, ts=posted["ts"], text="ready")
    assert updated["text"] == "ready"
    [msg] = fake_slack.messages_in(CHANNEL)
    assert (msg.text, msg.blocks, msg.edits) == ("ready", None, 1)  # text alone drops blocks
    with pytest.raises(SlackApiError) as err:
        c.chat_update(channel=CHANNEL, ts="1000000000.000001", text="x")
    assert err.value.response["error"] == "message_not_found"
    fake_slack.expect_violation(r"chat\.update: channel_not_found: .*not a user id")
    with pytest.raises(SlackApiError):
        c.chat_update(channel="U0FAKEUSR1", ts=posted["ts"], text="x")


def test_ts_is_unique_and_increasing_under_concurrency(fake_slack: FakeSlack) -> None:
    c = client(fake_slack)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: c.chat_postMessage(channel=CHANNEL, text=str(i)), range(40)))
    stamps = [m.ts for m in fake_slack.messages]
    assert len(set(stamps)) == 40
    assert stamps == sorted(stamps, key=float)


# ---- response_url ------------------------------------------------------------------------------


def test_response_url_accepts_webhook_posts_and_checks_them(fake_slack: FakeSlack) -> None:
    url = fake_slack.response_url()
    assert urlsplit(url).hostname == "127.0.0.1"
    hook = WebhookClient(url)
    resp = hook.send(text="reserved", response_type="in_channel", blocks=[section("ok")])
    assert resp.status_code == 200
    assert fake_slack.responses[0].body["response_type"] == "in_channel"

    fake_slack.expect_violation(r"response_url: invalid_blocks: blocks_per_message")
    assert hook.send(text="t", blocks=[section()] * 51).status_code == 400
    fake_slack.expect_violation(r"response_url: no_text")
    assert hook.send_dict({"replace_original": True}).status_code == 400


def test_response_url_is_good_for_five_uses(fake_slack: FakeSlack) -> None:
    hook = WebhookClient(fake_slack.response_url())
    limit = _limit("response_url_uses")
    assert [hook.send(text=str(i)).status_code for i in range(limit)] == [200] * limit
    fake_slack.expect_violation(r"response_url: used_url")
    assert hook.send(text="one too many").status_code == 404


def test_unissued_response_url_is_a_violation(fake_slack: FakeSlack) -> None:
    fake_slack.expect_violation(r"response_url: invalid_url")
    bogus = f"{fake_slack.root_url}/response/T0/1/never-issued"
    assert WebhookClient(bogus).send(text="x").status_code == 404


# ---- every supplement method the fake supports can be called validly ---------------------------


def _call_validly(fake: FakeSlack, method: str) -> Any:
    c = client(fake)
    if method == "chat.postMessage":
        return c.chat_postMessage(channel=CHANNEL, text="t", blocks=[section()], thread_ts=None)
    if method == "chat.postEphemeral":
        return c.chat_postEphemeral(channel=CHANNEL, user="U0FAKEUSR1", text="only you")
    if method == "chat.update":
        ts = c.chat_postMessage(channel=CHANNEL, text="a")["ts"]
        return c.chat_update(channel=CHANNEL, ts=ts, text="b", blocks=[section("b")])
    if method == "views.open":
        return c.views_open(trigger_id=fake.trigger_id(), view=modal([section()]))
    if method == "views.publish":
        return c.views_publish(user_id="U0FAKEUSR1", view=home([section()]))
    if method == "views.update":
        view = c.views_open(trigger_id=fake.trigger_id(), view=modal([section()]))["view"]
        return c.views_update(view_id=view["id"], view=modal([section("2")]))
    if method == "conversations.open":
        return c.conversations_open(users=["U0FAKEUSR1", "U0FAKEUSR2"])
    if method == "users.info":
        return c.users_info(user="U0FAKEUSR1", include_locale=True)
    if method == "auth.test":
        return c.auth_test()
    if method == "files.getUploadURLExternal":
        return c.files_getUploadURLExternal(filename="a.csv", length=10, alt_txt="a" * 1000)
    if method == "files.completeUploadExternal":
        step1 = c.files_getUploadURLExternal(filename="a.csv", length=3)
        req = urllib.request.Request(step1["upload_url"], data=b"a,b", method="POST")
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 200
        files = [{"id": step1["file_id"], "title": "a"}]
        return c.files_completeUploadExternal(files=files, channels=[CHANNEL, "C0FAKECHAN2"])
    if method == "apps.connections.open":
        return client(fake, token=fake.app_token).apps_connections_open(app_token=fake.app_token)
    raise AssertionError(f"no valid example call for {method}: add one here")


SUPPLEMENT_METHODS = supplement_methods(REF) if REF is not None else []


@pytest.mark.parametrize("method", SUPPLEMENT_METHODS)
def test_every_supplement_method_is_supported_or_rejected_as_retired(
    fake_slack: FakeSlack, method: str
) -> None:
    if _ref().methods[method].retired:
        fake_slack.expect_violation(rf"{method}: method_deprecated")
        with pytest.raises(SlackApiError):
            client(fake_slack).api_call(method, data={"channels": CHANNEL})
        return
    assert method in FakeSlack.HANDLERS
    resp = _call_validly(fake_slack, method)
    assert resp["ok"] is True
    assert fake_slack.last_call(method).ok


def test_bolt_app_startup_auth_test_passes(fake_slack: FakeSlack) -> None:
    from slack_bolt import App

    app = App(signing_secret="s3cr3t", client=client(fake_slack))
    assert app.client.base_url == fake_slack.url
    assert fake_slack.calls_to("auth.test")[0].ok


# ---- our own responses match Slack's published shapes -----------------------------------------

SCHEMA_METHODS = [
    "chat.postMessage",
    "chat.postEphemeral",
    "chat.update",
    "conversations.open",
    "users.info",
    "auth.test",
]


@pytest.mark.parametrize("method", SCHEMA_METHODS)
def test_responses_validate_against_the_spec_success_schema(
    fake_slack: FakeSlack, method: str
) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    spec = _ref().spec
    schema = dict(next(iter(spec["paths"][f"/{method}"].values()))["responses"]["200"]["schema"])
    if method == "chat.update":
        # The 2020 spec types message.blocks as an object; Slack returns an array (its docs).
        message = dict(schema["properties"]["message"])
        message["properties"] = {k: v for k, v in message["properties"].items() if k != "blocks"}
        schema["properties"] = {**schema["properties"], "message": message}
    schema["definitions"] = spec["definitions"]
    resp = _call_validly(fake_slack, method)
    jsonschema.Draft4Validator(schema).validate(resp.data)


@pytest.mark.parametrize(
    "method",
    [
        "auth.test",
        "users.info",
        "chat.postEphemeral",
        "files.getUploadURLExternal",
        "files.completeUploadExternal",
        "apps.connections.open",
    ],
)
def test_response_keys_exist_in_recorded_slack_shapes(fake_slack: FakeSlack, method: str) -> None:
    shape = _ref().shapes[method]
    resp = _call_validly(fake_slack, method).data

    def extra_keys(ours: Any, theirs: Any, path: str) -> list[str]:
        if isinstance(ours, dict) and isinstance(theirs, dict):
            out = [f"{path}.{k}" for k in ours if k not in theirs]
            return out + [
                p
                for k in ours
                if k in theirs
                for p in extra_keys(ours[k], theirs[k], f"{path}.{k}")
            ]
        if isinstance(ours, list) and isinstance(theirs, list) and ours and theirs:
            return extra_keys(ours[0], theirs[0], f"{path}[0]")
        return []

    # The spec's objs_user_profile requires `fields`; the java-slack-sdk sample lacks it.
    spec_required = {"users.info.user.profile.fields"}
    assert set(extra_keys(resp, shape, method)) - spec_required == set()


# ---- the fixture's own contract ----------------------------------------------------------------


def test_problems_lists_unexpected_and_unmet_violations() -> None:
    with FakeSlack(reference=_ref()) as fake:
        with pytest.raises(SlackApiError):
            client(fake).api_call("chat.postMessage", json={"channel": CHANNEL})
        fake.expect_violation("this never happens")
        problems = fake.problems()
    assert any(p.startswith("Slack API violation: chat.postMessage: no_text") for p in problems)
    assert any("this never happens" in p for p in problems)
    with FakeSlack(reference=_ref()) as clean:
        client(clean).auth_test()
        assert clean.problems() == []


def test_reference_is_parsed_once() -> None:
    ref = _ref()
    assert load_reference() is ref


def test_stop_releases_the_port() -> None:
    fake = FakeSlack(reference=_ref()).start()
    url = fake.url
    fake.stop()
    with pytest.raises((SlackRequestError, urllib.error.URLError, ConnectionError)):
        WebClient(token=fake.bot_token, base_url=url, retry_handlers=[], timeout=2).auth_test()
