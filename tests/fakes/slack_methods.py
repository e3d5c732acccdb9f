"""What the fake Slack Web API does for each method it knows: the behaviour behind a call.

`FakeSlack` (in `slack_api`) receives a request, checks it against the spec and finds the
handler here by `HANDLERS`; the handlers check Block Kit limits, keep the workspace's state
(messages, users, views, files) and answer in Slack's shapes. They are a base class of
`FakeSlack` rather than a module of functions because they share its state and its lock.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any, ClassVar

from tests.fakes.slack_records import (
    RESPONSE_URL_ENDPOINT,
    UPLOAD_ENDPOINT,
    Call,
    FakeUser,
    Message,
    ResponsePost,
    UploadedFile,
    _absent,
    _parse_body,
    _Reply,
    _ResponseUrl,
    _SlackError,
    _Violation,
)
from tests.fakes.slack_spec import JsonDict, SlackReference, _Problems

__all__ = ["SlackMethods"]

_USER_ID_RE = re.compile(r"^[UW][A-Z0-9]{2,}$")


class SlackMethods:
    """Each known method's behaviour, over the state that `FakeSlack` sets and this declares."""

    # The methods with behaviour of their own; any other spec method needs fake.on().
    HANDLERS: ClassVar[dict[str, str]] = {
        "auth.test": "_auth_test",
        "apps.connections.open": "_apps_connections_open",
        "chat.postMessage": "_chat_post_message",
        "chat.postEphemeral": "_chat_post_ephemeral",
        "chat.update": "_chat_update",
        "chat.delete": "_chat_delete",
        "conversations.open": "_conversations_open",
        "users.info": "_users_info",
        "usergroups.users.list": "_usergroups_users_list",
        "views.open": "_views_open",
        "views.push": "_views_open",
        "views.update": "_views_update",
        "views.publish": "_views_publish",
        "files.getUploadURLExternal": "_files_get_upload_url",
        "files.completeUploadExternal": "_files_complete_upload",
    }

    # Set by FakeSlack: its identity in the workspace, its settings and the state it records.
    team: str
    team_id: str
    bot_user_id: str
    bot_id: str
    app_id: str
    ref: SlackReference
    auto_users: bool
    home_tab_enabled: bool
    socket_mode_url: str | None
    violations: list[str]
    messages: list[Message]
    users: dict[str, FakeUser]
    usergroups: dict[str, list[str]]
    files: dict[str, UploadedFile]
    views: dict[str, JsonDict]
    home_views: dict[str, JsonDict]
    responses: list[ResponsePost]
    _lock: threading.RLock
    _response_urls: dict[str, _ResponseUrl]
    _triggers_issued: dict[str, float]
    _triggers_used: set[str]
    _dm_channels: dict[str, str]
    _named_channels: dict[str, str]
    _last_us: int
    _ids: itertools.count[int]

    if TYPE_CHECKING:
        # FakeSlack's own, which the handlers use.
        @property
        def port(self) -> int: ...

        @property
        def root_url(self) -> str: ...

        def add_user(self, user_id: str) -> FakeUser: ...

        def dm_channel_for(self, user_id: str) -> str: ...

    # ---- ids ------------------------------------------------------------------------------------

    def _next_ts(self) -> str:
        """Slack message ids: unique and increasing, as the bot may sort or dedupe by them."""
        with self._lock:
            us = max(int(time.time() * 1_000_000), self._last_us + 1)
            self._last_us = us
            return f"{us // 1_000_000}.{us % 1_000_000:06d}"

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}FAKE{next(self._ids):06d}"

    def _resolve_channel(self, channel: str) -> str:
        """Posting to a user id lands in the app's DM with them; a #name maps to one C id."""
        if _USER_ID_RE.match(channel):
            return self.dm_channel_for(channel)
        if re.match(r"^[CGD][A-Z0-9]{2,}$", channel):
            return channel
        name = channel.lstrip("#")
        with self._lock:
            if name not in self._named_channels:
                self._named_channels[name] = self._new_id("C")
            return self._named_channels[name]

    # ---- message checks ---------------------------------------------------------------------

    def _check_message(self, params: JsonDict) -> tuple[str | None, list[str]]:
        """Block Kit limits and text rules of chat.* and response_url bodies.
        Returns the text as Slack stores it (truncated past the limit) and response warnings."""
        problems = _Problems(self.ref)
        blocks = params.get("blocks")
        if blocks is not None:
            problems.blocks(blocks, "/blocks", "blocks_per_message")
        if problems.items:
            raise _Violation("invalid_blocks", *problems.items)
        markdown = params.get("markdown_text")
        if markdown is not None:
            if not _absent(params.get("text")) or not _absent(blocks):
                raise _Violation(
                    "invalid_arguments", "markdown_text cannot be combined with text or blocks"
                )
            problems.too_long("markdown_text_chars", "/markdown_text", markdown)
            if problems.items:
                raise _Violation("msg_too_long", *problems.items)
        text = params.get("text")
        warnings: list[str] = []
        if text is not None and not isinstance(text, str):
            text = str(text)
        limit = self.ref.limit("message_text_chars")
        if text is not None and len(text) > limit:
            text = text[:limit]
            warnings.append("message_truncated")
        return text, warnings

    def _message_json(self, msg: Message) -> JsonDict:
        out: JsonDict = {
            "type": "message",
            "text": msg.text or "",
            "user": self.bot_user_id,
            "bot_id": self.bot_id,
            "team": self.team_id,
            "ts": msg.ts,
        }
        if msg.blocks is not None:
            out["blocks"] = msg.blocks
        if msg.attachments is not None:
            out["attachments"] = msg.attachments
        if msg.thread_ts is not None:
            out["thread_ts"] = msg.thread_ts
        if msg.metadata is not None:
            out["metadata"] = msg.metadata
        if msg.files:
            # A file share, as history shows it: the files themselves and "upload".
            out["files"] = [self._file_json(self.files[f]) for f in msg.files if f in self.files]
            out["upload"] = True
        return out

    @staticmethod
    def _with_warnings(response: JsonDict, warnings: list[str]) -> JsonDict:
        if warnings:
            response["response_metadata"] = {"warnings": warnings}
        return response

    # ---- method behaviour -------------------------------------------------------------------

    def _auth_test(self, call: Call, token: str) -> JsonDict:
        return {
            "ok": True,
            "url": "https://gpubot-test.slack.com/",
            "team": self.team,
            "user": "gpubot",
            "team_id": self.team_id,
            "user_id": self.bot_user_id,
            "bot_id": self.bot_id,
            "is_enterprise_install": False,
        }

    def _apps_connections_open(self, call: Call, token: str) -> JsonDict:
        url = self.socket_mode_url or (
            f"ws://127.0.0.1:{self.port}/link/?ticket=fake{next(self._ids)}&app_id={self.app_id}"
        )
        return {"ok": True, "url": url}

    def _chat_post_message(self, call: Call, token: str) -> JsonDict:
        p = call.params
        text, warnings = self._check_message(p)
        channel = self._resolve_channel(str(p["channel"]))
        msg = Message(
            channel=channel,
            ts=self._next_ts(),
            text=text,
            blocks=p.get("blocks"),
            attachments=p.get("attachments"),
            thread_ts=p.get("thread_ts") or None,
            metadata=p.get("metadata") if isinstance(p.get("metadata"), dict) else None,
        )
        with self._lock:
            self.messages.append(msg)
        response = {
            "ok": True,
            "channel": channel,
            "ts": msg.ts,
            "message": self._message_json(msg),
        }
        return self._with_warnings(response, warnings)

    def _chat_post_ephemeral(self, call: Call, token: str) -> JsonDict:
        p = call.params
        text, warnings = self._check_message(p)
        msg = Message(
            channel=self._resolve_channel(str(p["channel"])),
            ts=self._next_ts(),
            text=text,
            blocks=p.get("blocks"),
            attachments=p.get("attachments"),
            thread_ts=p.get("thread_ts") or None,
            ephemeral_to=str(p["user"]),
        )
        with self._lock:
            self.messages.append(msg)
        return self._with_warnings({"ok": True, "message_ts": msg.ts}, warnings)

    def _find_message(self, channel: str, ts: str) -> Message:
        with self._lock:
            for m in self.messages:
                if m.channel == channel and m.ts == ts and not m.deleted and m.ephemeral_to is None:
                    return m
        raise _SlackError("message_not_found")

    def _chat_update(self, call: Call, token: str) -> JsonDict:
        p = call.params
        channel = str(p["channel"])
        if _USER_ID_RE.match(channel):
            raise _Violation(
                "channel_not_found",
                f"chat.update needs the conversation id (D...), not a user id ({channel})",
            )
        text, warnings = self._check_message(p)
        msg = self._find_message(self._resolve_channel(channel), str(p["ts"]))
        with self._lock:
            if text is not None:
                msg.text = text
                # Slack: passing text without blocks removes the previous blocks.
                msg.blocks = p.get("blocks")
            elif "blocks" in p:
                msg.blocks = p.get("blocks")
            if "attachments" in p:
                msg.attachments = p.get("attachments")
            msg.edits += 1
        message: JsonDict = {
            "text": msg.text or "",
            "user": self.bot_user_id,
            "bot_id": self.bot_id,
        }
        if msg.blocks is not None:
            message["blocks"] = msg.blocks
        if msg.attachments is not None:
            message["attachments"] = msg.attachments
        response = {
            "ok": True,
            "channel": msg.channel,
            "ts": msg.ts,
            "text": msg.text or "",
            "message": message,
        }
        return self._with_warnings(response, warnings)

    def _chat_delete(self, call: Call, token: str) -> JsonDict:
        p = call.params
        msg = self._find_message(self._resolve_channel(str(p["channel"])), str(p["ts"]))
        with self._lock:
            msg.deleted = True
        return {"ok": True, "channel": msg.channel, "ts": msg.ts}

    def _known_user(self, user_id: str) -> FakeUser:
        with self._lock:
            user = self.users.get(user_id)
        if user is not None:
            return user
        if self.auto_users and _USER_ID_RE.match(user_id):
            return self.add_user(user_id)
        raise _SlackError("user_not_found")

    def _conversations_open(self, call: Call, token: str) -> JsonDict:
        p = call.params
        if not _absent(p.get("channel")):
            return {"ok": True, "channel": {"id": self._resolve_channel(str(p["channel"]))}}
        users = [u for u in str(p["users"]).split(",") if u]
        if not 1 <= len(users) <= 8:
            raise _Violation("invalid_arguments", f"users takes 1..8 user ids (got {len(users)})")
        for u in users:
            self._known_user(u)
        with self._lock:
            if len(users) == 1:
                already = users[0] in self._dm_channels
                channel_id = self.dm_channel_for(users[0])
            else:
                key = ",".join(sorted(users))
                already = key in self._dm_channels
                if not already:
                    self._dm_channels[key] = self._new_id("G")
                channel_id = self._dm_channels[key]
        channel: JsonDict = {"id": channel_id}
        if p.get("return_im") in ("1", "true", True) and len(users) == 1:
            channel.update({"is_im": True, "is_open": True, "user": users[0]})
        response: JsonDict = {"ok": True, "channel": channel}
        if already:
            response.update({"no_op": True, "already_open": True})
        return response

    def _users_info(self, call: Call, token: str) -> JsonDict:
        u = self._known_user(str(call.params["user"]))
        profile: JsonDict = {
            "real_name": u.real_name,
            "real_name_normalized": u.real_name,
            "display_name": u.display_name,
            "display_name_normalized": u.display_name,
            "avatar_hash": "0fake0avatar",
            "title": "",
            "phone": "",
            "skype": "",
            "status_text": "",
            "status_emoji": "",
            "fields": None,
            "team": self.team_id,
        }
        if u.email is not None:
            profile["email"] = u.email
        user: JsonDict = {
            "id": u.id,
            "team_id": self.team_id,
            "name": u.name,
            "deleted": u.deleted,
            "real_name": u.real_name,
            "tz": u.tz,
            "tz_label": u.tz,
            "tz_offset": u.tz_offset,
            "profile": profile,
            "is_admin": u.is_admin,
            "is_owner": u.is_owner,
            "is_primary_owner": False,
            "is_restricted": False,
            "is_ultra_restricted": False,
            "is_bot": u.is_bot,
            "is_app_user": False,
            "updated": 1700000000,
        }
        return {"ok": True, "user": user}

    def _usergroups_users_list(self, call: Call, token: str) -> JsonDict:
        # An unknown group: Slack's documented error (the 2020 spec's enum predates it).
        with self._lock:
            members = self.usergroups.get(str(call.params["usergroup"]))
        if members is None:
            raise _SlackError("no_such_subteam")
        return {"ok": True, "users": list(members)}

    def _check_view(self, method: str, view: Any) -> None:
        problems = _Problems(self.ref)
        problems.view(view, method)
        if problems.items:
            raise _Violation("invalid_arguments", *problems.items)
        size = len(json.dumps(view).encode("utf-8"))
        if size > self.ref.limit("view_size"):
            raise _Violation("view_too_large", f"view is {size} bytes")

    def _view_json(self, view: JsonDict, view_id: str, root: str | None = None) -> JsonDict:
        out: JsonDict = {
            "id": view_id,
            "team_id": self.team_id,
            "type": view.get("type"),
            "blocks": view.get("blocks", []),
            "private_metadata": view.get("private_metadata", ""),
            "callback_id": view.get("callback_id", ""),
            "state": {"values": {}},
            "hash": f"{int(time.time())}.fake{next(self._ids):08x}",
            "clear_on_close": bool(view.get("clear_on_close", False)),
            "notify_on_close": bool(view.get("notify_on_close", False)),
            "root_view_id": root or view_id,
            "previous_view_id": None,
            "app_id": self.app_id,
            "external_id": view.get("external_id", ""),
            "bot_id": self.bot_id,
        }
        for key in ("title", "submit", "close"):
            if key in view:
                out[key] = view[key]
        return out

    def _views_open(self, call: Call, token: str) -> JsonDict:
        p = call.params
        self._check_view(call.method, p["view"])
        trigger = p.get("trigger_id")
        if isinstance(trigger, str) and trigger:
            with self._lock:
                if trigger in self._triggers_used:
                    raise _SlackError("exchanged_trigger_id")
                self._triggers_used.add(trigger)
                issued = self._triggers_issued.get(trigger)
            if issued is not None and time.monotonic() - issued > self.ref.limit(
                "trigger_id_lifetime"
            ):
                raise _SlackError("expired_trigger_id")
        view_id = self._new_id("V")
        stored = self._view_json(p["view"], view_id)
        with self._lock:
            self.views[view_id] = stored
        return {"ok": True, "view": stored}

    def _views_update(self, call: Call, token: str) -> JsonDict:
        p = call.params
        self._check_view(call.method, p["view"])
        with self._lock:
            if not _absent(p.get("view_id")):
                current = self.views.get(str(p["view_id"]))
            else:
                ext = p.get("external_id")
                current = next((v for v in self.views.values() if v["external_id"] == ext), None)
            if current is None:
                raise _SlackError("not_found")
            if not _absent(p.get("hash")) and p["hash"] != current["hash"]:
                raise _SlackError("hash_conflict")
            stored = self._view_json(p["view"], current["id"], current["root_view_id"])
            self.views[current["id"]] = stored
        return {"ok": True, "view": stored}

    def _views_publish(self, call: Call, token: str) -> JsonDict:
        p = call.params
        self._check_view(call.method, p["view"])
        if not self.home_tab_enabled:
            raise _SlackError("not_enabled")
        user_id = str(p["user_id"])
        with self._lock:
            current = self.home_views.get(user_id)
            if current is not None and not _absent(p.get("hash")) and p["hash"] != current["hash"]:
                raise _SlackError("hash_conflict")
            view_id = current["id"] if current else self._new_id("V")
            stored = self._view_json(p["view"], view_id)
            self.home_views[user_id] = stored
            self.views[view_id] = stored
        return {"ok": True, "view": stored}

    def _files_get_upload_url(self, call: Call, token: str) -> JsonDict:
        p = call.params
        try:
            length = int(p["length"])
        except (TypeError, ValueError):
            raise _Violation(
                "invalid_arguments", f"length must be an integer (got {p['length']!r})"
            ) from None
        if length <= 0:
            raise _Violation("missing_argument", "length must be > 0")
        problems = _Problems(self.ref)
        problems.too_long("alt_txt_chars", "/alt_txt", p.get("alt_txt"))
        if problems.items:
            raise _Violation("alt_txt_too_large", *problems.items)
        file_id = self._new_id("F")
        with self._lock:
            self.files[file_id] = UploadedFile(
                id=file_id,
                filename=str(p["filename"]),
                length=length,
                alt_txt=p.get("alt_txt"),
                snippet_type=p.get("snippet_type"),
            )
        return {
            "ok": True,
            "upload_url": f"{self.root_url}/upload/v1/{file_id}",
            "file_id": file_id,
        }

    def _files_complete_upload(self, call: Call, token: str) -> JsonDict:
        p = call.params
        items = p["files"]
        if not isinstance(items, list) or not items:
            raise _Violation("invalid_arguments", "files must be a non-empty JSON array")
        channels: list[str] = []
        if not _absent(p.get("channel_id")):
            channels.append(str(p["channel_id"]))
        if not _absent(p.get("channels")):
            channels += [c for c in str(p["channels"]).split(",") if c]
        if not _absent(p.get("thread_ts")) and len(channels) != 1:
            raise _Violation("invalid_arguments", "thread_ts needs exactly one channel")
        picked: list[UploadedFile] = []
        with self._lock:
            for i, item in enumerate(items):
                if not isinstance(item, dict) or _absent(item.get("id")):
                    raise _Violation("invalid_arguments", f"files[{i}] needs an id")
                f = self.files.get(str(item["id"]))
                if f is None:
                    raise _Violation(
                        "file_not_found", f"files[{i}].id {item['id']} was never issued"
                    )
                if f.data is None:
                    raise _Violation(
                        "invalid_arguments",
                        f"files[{i}].id {f.id}: no bytes were POSTed to its upload_url",
                    )
                picked.append(f)
            resolved = [self._resolve_channel(c) for c in channels]
            for item, f in zip(items, picked, strict=True):
                f.title = item.get("title") or f.filename
                f.completed = True
                f.channels = resolved
                f.initial_comment = p.get("initial_comment")
                f.thread_ts = p.get("thread_ts") or None
            for ch in resolved:
                self.messages.append(
                    Message(
                        channel=ch,
                        ts=self._next_ts(),
                        text=p.get("initial_comment"),
                        thread_ts=p.get("thread_ts") or None,
                        files=tuple(f.id for f in picked),
                    )
                )
        return {"ok": True, "files": [self._file_json(f) for f in picked]}

    def _file_json(self, f: UploadedFile) -> JsonDict:
        now = int(time.time())
        ext = f.filename.rsplit(".", 1)[-1].lower() if "." in f.filename else "binary"
        mimetype = {"png": "image/png", "csv": "text/csv", "txt": "text/plain"}.get(
            ext, "application/octet-stream"
        )
        base = f"https://files.slack.com/files-pri/{self.team_id}-{f.id}/{f.filename}"
        return {
            "id": f.id,
            "created": now,
            "timestamp": now,
            "name": f.filename,
            "title": f.title or f.filename,
            "mimetype": mimetype,
            "filetype": ext,
            "pretty_type": ext.upper(),
            "user": self.bot_user_id,
            "user_team": self.team_id,
            "editable": False,
            "size": len(f.data or b""),
            "mode": "hosted",
            "is_external": False,
            "external_type": "",
            "is_public": any(c.startswith("C") for c in f.channels),
            "public_url_shared": False,
            "display_as_bot": False,
            "username": "",
            "url_private": base,
            "url_private_download": f"{base}?download=1",
            "permalink": f"https://gpubot-test.slack.com/files/{self.bot_user_id}/{f.id}",
            "channels": [c for c in f.channels if c.startswith("C")],
            "groups": [c for c in f.channels if c.startswith("G")],
            "ims": [c for c in f.channels if c.startswith("D")],
            "alt_txt": f.alt_txt or "",
            "comments_count": 0,
            "is_starred": False,
            "has_rich_preview": False,
        }

    # ---- the upload URL (step 2 of files_upload_v2) -------------------------------------------

    def _store_upload(self, file_id: str, req: BaseHTTPRequestHandler, body: bytes) -> _Reply:
        with self._lock:
            f = self.files.get(file_id)
            if f is None or req.command != "POST":
                self.violations.append(
                    f"{UPLOAD_ENDPOINT}: {req.command} to an upload URL the fake never issued "
                    f"({file_id})"
                )
                return _Reply(404, "not found")
            data = body
            ctype = req.headers.get("Content-Type", "")
            if ctype.lower().startswith("multipart/form-data"):
                parts, _, _ = _parse_body(ctype, body)
                data = next((v for v in parts.values() if isinstance(v, bytes)), b"")
            if len(data) != f.length:
                self.violations.append(
                    f"{UPLOAD_ENDPOINT}: {file_id}: {len(data)} bytes POSTed, "
                    f"files.getUploadURLExternal declared length={f.length}"
                )
                return _Reply(400, "length mismatch")
            f.data = data
        return _Reply(200, f"OK - {len(data)}")

    # ---- response_url -------------------------------------------------------------------------

    def _store_response(self, url: str, req: BaseHTTPRequestHandler, body: bytes) -> _Reply:
        try:
            payload: Any = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            payload = body.decode("utf-8", "replace")
        post = ResponsePost(url=url, body=payload, status=200)
        with self._lock:
            self.responses.append(post)
            entry = self._response_urls.get(url)
        try:
            if entry is None:
                raise _Violation("invalid_url", f"{url} was not issued by fake.response_url()")
            if req.command != "POST" or not isinstance(payload, dict):
                raise _Violation("invalid_payload", "response_url takes a POSTed JSON object")
            with self._lock:
                entry.uses += 1
                uses = entry.uses
            limit = self.ref.limit("response_url_uses")
            if uses > limit:
                raise _Violation("used_url", f"response_url used {uses} times (limit {limit})")
            if payload.get("response_type", "ephemeral") not in ("ephemeral", "in_channel"):
                raise _Violation(
                    "invalid_payload", f"response_type {payload['response_type']!r} is not valid"
                )
            if not payload.get("delete_original") and all(
                _absent(payload.get(k)) for k in ("text", "blocks", "attachments")
            ):
                raise _Violation("no_text", "one of text, blocks, attachments is required")
            self._check_message(payload)
        except _Violation as v:
            with self._lock:
                self.violations.append(
                    f"{RESPONSE_URL_ENDPOINT}: {v.error}: {'; '.join(v.details)}"
                )
            post.status = 404 if v.error in ("invalid_url", "used_url") else 400
            post.error = v.error
            return _Reply(post.status, {"ok": False, "error": v.error})
        return _Reply(200, {"ok": True})
