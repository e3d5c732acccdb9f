"""Delivers the core's outbox to Slack: DMs (conversations.open + chat.postMessage) and
posts to the team channel.

The outbox promises "none lost, none twice"; this side keeps the second half, from facts
written down rather than remembered (bot.app.outbox.DeliveryLog, in the database):

- where each target lives: a channel name's id (learnt from the first post to it) and each
  user's DM channel are stored once, so a restarted process knows where a post went;
- before chat.postMessage the row records that an attempt started and to which
  conversation; after Slack's answer it records the message's ts, or clears the attempt
  when Slack refused it. An attempt with neither outcome (a crash, a lost reply) is
  maybe-sent: it is looked for once, by the notification id that every message carries in
  its `metadata`, with one conversations.history call, and then either recorded as posted
  or sent again. The attachment's upload gets the same two facts;
- a 429 stores a pause until Retry-After: no call to Slack is made by this or any other
  deliverer until it has passed, so the rest of a batch waits instead of being refused.

The client used here has slack_sdk's automatic retries switched off: its
connection-error retry would resend a chat.postMessage whose outcome is unknown,
which is exactly the duplicate this module exists to prevent.
"""

from __future__ import annotations

import http.client
import logging
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError
from slack_sdk.web import SlackResponse
from sqlalchemy.engine import Engine

from bot.adapters.metrics import slack_call
from bot.app.config import Settings
from bot.app.delivery import DeliveryRetry
from bot.app.outbox import DeliveryFacts, DeliveryLog, MemoryDeliveryLog, StoredDeliveryLog
from bot.app.service import OutboxItem
from bot.domain.clock import Clock, SystemClock
from bot.faces.slack.blocks import message

log = logging.getLogger(__name__)

EVENT_TYPE = "gpubot_notification"
# Errors after which Slack has not acted: worth another try later, not a bug of ours.
_NOT_TAKEN = {"ratelimited", "service_unavailable"}
# Errors Slack documents as "some aspect of the operation may have succeeded".
_MAYBE_TAKEN = {"internal_error", "fatal_error", "request_timeout"}
_CHANNEL_ID = re.compile(r"^[CGD][A-Z0-9]{2,}$")
_HISTORY_PAGE = 200


def make_client(settings: Settings, timeout: int = 15) -> WebClient:
    """A Web API client for delivery: same base URL as the app's, no automatic retries."""
    token = settings.slack_bot_token.get_secret_value()
    kwargs: dict[str, Any] = {"token": token, "timeout": timeout}
    if settings.slack_api_url:
        kwargs["base_url"] = settings.slack_api_url
    client = WebClient(**kwargs)
    client.retry_handlers = []
    return client


def _retry_after(resp: SlackResponse) -> timedelta:
    headers = {str(k).lower(): v for k, v in (resp.headers or {}).items()}
    raw = headers.get("retry-after")
    if isinstance(raw, list):
        raw = raw[0] if raw else None
    try:
        seconds = float(raw) if raw is not None else 30.0
    except (TypeError, ValueError):
        seconds = 30.0
    return timedelta(seconds=max(1.0, seconds))


class NotTaken(DeliveryRetry):
    """Slack answered and did not act (a 429, a pause still running, unavailable)."""


class MaybeTaken(DeliveryRetry):
    """No answer, or an error after which the call may have taken effect."""


class SlackNotifier:
    def __init__(self, client: WebClient, channel: str, facts: DeliveryLog | None = None) -> None:
        """`facts`: where delivery facts are kept; gpubot's processes pass the database's
        (from_settings). Without one they live in this process only and die with it."""
        self._client = client
        self._channel = channel.lstrip("#")
        self._facts: DeliveryLog = facts if facts is not None else MemoryDeliveryLog()

    def _failure(self, name: str, exc: Exception) -> Exception:
        """What a failed call means for the outbox; a 429 also stores the pause."""
        if isinstance(exc, SlackApiError):
            resp = exc.response
            error = str(resp.get("error", "")) if resp is not None else ""
            status = resp.status_code if resp is not None else 0
            if resp is not None and (status == 429 or error == "ratelimited"):
                wait = _retry_after(resp)
                self._facts.pause(self._facts.now() + wait, f"{name}: 429")
                return NotTaken(f"{name}: rate limited", wait, stop_batch=True)
            if error in _MAYBE_TAKEN or status >= 500:
                return MaybeTaken(f"{name}: {error or status}")
            if error in _NOT_TAKEN:
                return NotTaken(f"{name}: {error}")
            return RuntimeError(f"{name} failed: {error}")
        # The call may or may not have taken effect.
        return MaybeTaken(f"{name}: network error ({type(exc).__name__})")

    def _call(self, name: str, fn: Callable[..., SlackResponse], **kwargs: Any) -> SlackResponse:
        try:
            with slack_call(name):
                return fn(**kwargs)
        except (SlackApiError, OSError, http.client.HTTPException) as exc:
            raise self._failure(name, exc) from None

    def _respect_pause(self) -> None:
        until = self._facts.paused_until()
        now = self._facts.now()
        if until is not None and until > now:
            raise NotTaken(
                "Slack asked us to wait (429): not calling it before Retry-After",
                until - now,
                stop_batch=True,
            )

    def _target_name(self, item: OutboxItem) -> str:
        return item.target.lstrip("#") or self._channel

    def _conversation(self, item: OutboxItem) -> str:
        """The channel id to post in, from the stored ones when known; a channel name
        whose id is not yet learnt is posted to by name."""
        if item.kind == "dm":
            known = self._facts.conversation("dm", item.target)
            if known is None:
                resp = self._call(
                    "conversations.open", self._client.conversations_open, users=item.target
                )
                known = str(resp["channel"]["id"])
                self._facts.remember_conversation("dm", item.target, known)
            return known
        name = self._target_name(item)
        if _CHANNEL_ID.match(name):
            return name
        return self._facts.conversation("channel", name) or name

    def _history(self, channel: str, **kwargs: Any) -> list[dict[str, Any]]:
        resp = self._call(
            "conversations.history",
            self._client.conversations_history,
            channel=channel,
            limit=_HISTORY_PAGE,
            **kwargs,
        )
        return list(resp.get("messages") or [])

    def _find_posted(self, channel: str, item_id: int) -> str | None:
        """The ts of this notification's message in `channel`, if Slack has it."""
        for msg in self._history(channel, include_all_metadata=True):
            meta = msg.get("metadata") or {}
            payload = meta.get("event_payload") or {}
            if meta.get("event_type") == EVENT_TYPE and payload.get("notification_id") == item_id:
                return str(msg.get("ts") or "")
        return None

    def _resolved(self, channel: str) -> str | None:
        if _CHANNEL_ID.match(channel):
            return channel
        return self._facts.conversation("channel", channel.lstrip("#"))

    def _settle_maybe_sent(self, item: OutboxItem, facts: DeliveryFacts) -> str | None:
        """An attempt started and nobody wrote down how it ended: look once. Returns the
        channel it is in when found; either way the outcome is recorded, so a retry of
        this item never looks again for the same attempt."""
        channel = self._resolved(facts.attempt_channel or "")
        if channel is None:
            # Only a first-ever post to a channel name can end here: its id is learnt
            # from that post's reply. Nothing can be checked; sending again is the lesser harm.
            log.warning(
                "cannot check %s for notification %s: channel id unknown",
                facts.attempt_channel,
                item.id,
            )
            self._facts.attempt_refused(item.id)
            return None
        ts = self._find_posted(channel, item.id)
        if ts is None:
            self._facts.attempt_refused(item.id)
            return None
        log.info("notification %s was already delivered; not sending it again", item.id)
        self._facts.posted(item.id, channel, ts)
        return channel

    def _post(self, item: OutboxItem, channel: str) -> str:
        body = message(item.view)
        self._facts.attempt_started(item.id, channel)
        try:
            resp = self._call(
                "chat.postMessage",
                self._client.chat_postMessage,
                channel=channel,
                text=body["text"],
                blocks=body["blocks"],
                metadata={"event_type": EVENT_TYPE, "event_payload": {"notification_id": item.id}},
                unfurl_links=False,
            )
        except MaybeTaken:
            raise  # the attempt stays open: maybe-sent, checked before any resend
        except Exception:
            self._facts.attempt_refused(item.id)
            raise
        posted_in = str(resp.get("channel") or channel)
        self._facts.posted(item.id, posted_in, str(resp.get("ts") or ""))
        if item.kind != "dm" and not _CHANNEL_ID.match(channel):
            self._facts.remember_conversation("channel", self._target_name(item), posted_in)
        return posted_in

    def send(self, item: OutboxItem) -> None:
        self._respect_pause()
        if item.edit_of is not None:
            self._edit(item, item.edit_of)
            return
        channel = self._conversation(item)
        facts = self._facts.facts(item.id)
        posted_in: str | None = None
        if facts.posted_ts is not None:
            posted_in = facts.attempt_channel  # posted before a crash; mark_sent never ran
        elif facts.attempt_started_at is not None:
            posted_in = self._settle_maybe_sent(item, facts)
        if posted_in is None:
            posted_in = self._post(item, channel)
        if item.attachment is not None and facts.uploaded_at is None:
            # After the message, so a chart never arrives without its words.
            self._upload(item, item.attachment, posted_in)

    def _edit(self, item: OutboxItem, message_id: int) -> None:
        """chat.update of a message posted earlier (a run's live message), found by the
        channel and ts stored when it was posted. An edit is idempotent, so a lost reply
        just means it is sent again; a message not yet posted makes the edit wait."""
        facts = self._facts.facts(message_id)
        if facts.posted_ts is None or facts.attempt_channel is None:
            raise NotTaken("the message to edit is not posted yet", timedelta(seconds=15))
        body = message(item.view)
        try:
            self._call(
                "chat.update",
                self._client.chat_update,
                channel=facts.attempt_channel,
                ts=facts.posted_ts,
                text=body["text"],
                blocks=body["blocks"],
            )
        except RuntimeError as exc:
            if "message_not_found" in str(exc) or "cant_update_message" in str(exc):
                # Deleted by its reader: nothing to edit, and nothing worth retrying.
                log.info("live message of notification %s is gone: %s", message_id, exc)
                return
            raise

    def _upload(self, item: OutboxItem, attachment: tuple[str, bytes], channel: str) -> None:
        name, data = attachment
        facts = self._facts.facts(item.id)
        if facts.upload_started_at is not None and self._file_posted(channel, facts, name):
            self._facts.uploaded(item.id)
            return
        self._facts.upload_started(item.id)
        try:
            upload_file(
                self._client,
                channel,
                name,
                data,
                title=item.view.text[:200],
                alt_txt=item.view.text,
            )
        except (SlackApiError, OSError, http.client.HTTPException) as exc:
            failure = self._failure("file upload", exc)
            if not isinstance(failure, MaybeTaken):
                self._facts.upload_refused(item.id)
            raise failure from None
        self._facts.uploaded(item.id)

    def _file_posted(self, channel: str, facts: DeliveryFacts, name: str) -> bool:
        """Whether an upload cut short got shared: a file of that name in the channel after
        the message it belongs to (one conversations.history call)."""
        if not _CHANNEL_ID.match(channel) or not facts.posted_ts:
            return False
        for msg in self._history(channel, oldest=facts.posted_ts):
            if any(f.get("name") == name for f in msg.get("files") or []):
                return True
        return False


def upload_file(
    client: WebClient,
    channel: str,
    filename: str,
    data: bytes,
    title: str | None = None,
    alt_txt: str | None = None,
    initial_comment: str | None = None,
) -> str:
    """Uploads a chart or report the current way (files.getUploadURLExternal, then
    files.completeUploadExternal; files.upload is retired). Returns the file id."""
    kwargs: dict[str, Any] = {"channel": channel, "filename": filename, "content": data}
    if title:
        kwargs["title"] = title
    if alt_txt:
        kwargs["alt_txt"] = alt_txt[:1000]
    if initial_comment:
        kwargs["initial_comment"] = initial_comment
    resp = client.files_upload_v2(**kwargs)
    files = resp.get("files") or [resp.get("file") or {}]
    return str(files[0].get("id", ""))


def from_settings(
    settings: Settings, engine: Engine, clock: Clock | None = None
) -> SlackNotifier | None:
    """The notifier for `gpubot worker` and `serve`, its delivery facts in the bot's
    database (the runtime's engine); None when no bot token is set."""
    if not settings.slack_bot_token:
        return None
    facts = StoredDeliveryLog(engine, clock or SystemClock())
    return SlackNotifier(make_client(settings), settings.channel, facts)
