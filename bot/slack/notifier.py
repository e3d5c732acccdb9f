"""Delivers the core's outbox to Slack: DMs (conversations.open + chat.postMessage) and
posts to the team channel.

The outbox promises "none lost, none twice"; this side keeps the second half. Each
message carries its notification id in Slack's message `metadata`. When a send was
cut short (crash, a connection dropped after Slack took the message), the outbox
marks the item maybe-sent and we look for that id in the conversation's history
before posting again. Transient failures (429, network) become `DeliveryRetry`
with Slack's own `Retry-After`, so the worker waits as long as Slack asked.

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

from bot.config import Settings
from bot.metrics import slack_call
from bot.service import OutboxItem
from bot.slack.blocks import message
from bot.worker import DeliveryRetry

log = logging.getLogger(__name__)

EVENT_TYPE = "gpubot_notification"
# Errors Slack documents as transient: worth another try later, not a bug of ours.
_TRANSIENT = {
    "ratelimited",
    "internal_error",
    "fatal_error",
    "service_unavailable",
    "request_timeout",
}
_CHANNEL_ID = re.compile(r"^[CGD][A-Z0-9]{2,}$")
_HISTORY_PAGE = 200


def make_client(settings: Settings, timeout: int = 15) -> WebClient:
    """A Web API client for delivery: same base URL as the app's, no automatic retries."""
    kwargs: dict[str, Any] = {"token": settings.slack_bot_token, "timeout": timeout}
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


class SlackNotifier:
    def __init__(self, client: WebClient, channel: str) -> None:
        self._client = client
        self._channel = channel.lstrip("#")
        self._dm_channels: dict[str, str] = {}
        self._channel_ids: dict[str, str] = {}

    def _call(self, name: str, fn: Callable[..., SlackResponse], **kwargs: Any) -> SlackResponse:
        try:
            with slack_call(name):
                return fn(**kwargs)
        except SlackApiError as exc:
            resp = exc.response
            error = str(resp.get("error", "")) if resp is not None else ""
            if resp is not None and (resp.status_code == 429 or error == "ratelimited"):
                raise DeliveryRetry(f"{name}: rate limited", _retry_after(resp)) from None
            if error in _TRANSIENT or (resp is not None and resp.status_code >= 500):
                raise DeliveryRetry(f"{name}: {error or resp.status_code}") from None
            raise RuntimeError(f"{name} failed: {error}") from None
        except (OSError, http.client.HTTPException) as exc:
            # The call may or may not have taken effect; the outbox marks it maybe-sent.
            raise DeliveryRetry(f"{name}: network error ({type(exc).__name__})") from None

    def _conversation(self, item: OutboxItem) -> str:
        if item.kind == "dm":
            user = item.target
            if user not in self._dm_channels:
                resp = self._call("conversations.open", self._client.conversations_open, users=user)
                self._dm_channels[user] = str(resp["channel"]["id"])
            return self._dm_channels[user]
        target = item.target.lstrip("#") or self._channel
        return self._channel_ids.get(target, target)

    def _already_posted(self, channel: str, item_id: int) -> bool:
        if not _CHANNEL_ID.match(channel):
            # A channel given by name: history needs its id, learnt from the first post.
            log.warning("cannot check %s for notification %s: channel id unknown", channel, item_id)
            return False
        resp = self._call(
            "conversations.history",
            self._client.conversations_history,
            channel=channel,
            limit=_HISTORY_PAGE,
            include_all_metadata=True,
        )
        for msg in resp.get("messages") or []:
            meta = msg.get("metadata") or {}
            payload = meta.get("event_payload") or {}
            if meta.get("event_type") == EVENT_TYPE and payload.get("notification_id") == item_id:
                return True
        return False

    def send(self, item: OutboxItem) -> None:
        channel = self._conversation(item)
        # attempts > 0: an earlier try started; if it got far enough, the message is there.
        if (item.maybe_sent or item.attempts > 0) and self._already_posted(channel, item.id):
            log.info("notification %s was already delivered; not sending it again", item.id)
            return
        body = message(item.view)
        resp = self._call(
            "chat.postMessage",
            self._client.chat_postMessage,
            channel=channel,
            text=body["text"],
            blocks=body["blocks"],
            metadata={"event_type": EVENT_TYPE, "event_payload": {"notification_id": item.id}},
            unfurl_links=False,
        )
        if item.kind != "dm" and resp.get("channel"):
            self._channel_ids[item.target.lstrip("#") or self._channel] = str(resp["channel"])
        if item.attachment is not None:
            # After the message, so a chart never arrives without its words. A failed
            # upload is retried with the item; the history check then finds the message
            # posted and skips both (the chart is lost, the message is not doubled).
            name, data = item.attachment
            posted_in = str(resp.get("channel") or channel)
            try:
                upload_file(
                    self._client,
                    posted_in,
                    name,
                    data,
                    title=item.view.text[:200],
                    alt_txt=item.view.text,
                )
            except SlackApiError as exc:
                error = str(exc.response.get("error", "")) if exc.response is not None else ""
                raise DeliveryRetry(f"file upload: {error or 'failed'}") from None
            except (OSError, http.client.HTTPException) as exc:
                raise DeliveryRetry(f"file upload: network error ({type(exc).__name__})") from None


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


def from_settings(settings: Settings) -> SlackNotifier | None:
    """The notifier for `gpubot worker` and `serve`; None when no bot token is set."""
    if not settings.slack_bot_token:
        return None
    return SlackNotifier(make_client(settings), settings.channel)
