"""The Bolt app: `/gpu`, button clicks, the run modal and App Home, all handed to
`bot.faces.dispatch.handle_text` as the Slack user who acted.

Shape of a request. Bolt runs with `process_before_response=True`, so a listener
finishes before the HTTP response leaves and no listener thread polls for the ack
(the polling costs ~10 ms per request under load). Reads (`status`, `help`,
`prices`) are answered on the request thread. Everything else runs on a small pool
with a deadline below Slack's 3 seconds: a reply ready in time is the ack itself; a
slow one is acked with "working on it" and follows by `response_url`.
Button clicks and modal submissions are acked at once and answered the same way.

Slack redelivers what it thinks timed out. Every request is keyed by what stays
the same across deliveries (trigger_id, event_id); a second delivery with a key
already seen waits for, and answers with, the first delivery's result, and the
key also reaches the core (`request_key`) so a reservation survives even a
redelivery to another process.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from slack_bolt import Ack, App, BoltContext, BoltRequest, Respond
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError

from bot.app.access import RunGate
from bot.app.config import Settings
from bot.app.delivery import Notifier, deliver
from bot.app.service import Actor, GpuService
from bot.domain import views
from bot.domain.commands import Run
from bot.domain.errors import UserError, failure_message
from bot.faces.dispatch import handle_text, known_models, parse_text
from bot.faces.slack import modal
from bot.faces.slack.blocks import message
from bot.faces.slack.home import publish_home
from bot.faces.slack.membership import SlackMembership

log = logging.getLogger(__name__)


class _OneClient(logging.Filter):
    """Bolt reads SLACK_BOT_TOKEN from the environment even when it is handed a client,
    then warns at every start that the token will be unused. We hand it the one client
    (with our API URL and timeouts) on purpose, so that line is noise: it is dropped,
    and every other Bolt record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "`token` will be unused" not in record.getMessage()


logging.getLogger("slack_bolt.App").addFilter(_OneClient())

# Verbs whose success changes what Home shows; after them the caller's Home is republished.
CHANGING_VERBS = frozenset({"reserve", "release", "extend", "run", "cancel"})
# Verbs that only read the database: answered on the request thread, skipping the pool's
# hand-off (measured: ~20% more requests per second at 16 clients). Anything that may
# wait on the outside world (SSH, EC2) must not be here: it needs the ack deadline.
INLINE_VERBS = frozenset({"status", "help", "prices"})
# How long a command's reply may take to be the ack itself; past it the ack says
# "working on it" and the reply follows by response_url. Far inside Slack's 3 s, which
# also covers the trip from Slack and any proxy: under a burst (50 first reservations
# at once wait in line for the database, ~1-2 s for the last) acks would otherwise
# come near that limit. A lone reservation takes tens of milliseconds.
ACK_DEADLINE_S = 0.5
# Set by the HTTP front (bot.faces.slack.server): when the request had fully arrived, on this
# process's monotonic clock. The ack deadline counts from there, so time spent queued
# for a worker is not added on top of it.
RECEIVED_AT_HEADER = "x-gpubot-received-at"
DEFAULT_API_URL = "https://slack.com/api/"


class Identity:
    """Slack user id -> Actor. Display names come from users.info, cached, because a
    name lookup per command would double the Web API traffic; a failed lookup falls
    back to the name in the payload instead of failing the command.

    With `later` set (SlackFace.after), a name not yet known is looked up after the
    ack, never before it: a burst of first commands would otherwise wait a Web API
    round trip each. Meanwhile the command runs as the user the database knows, or
    a new user under the payload's name, renamed once users.info answers."""

    def __init__(self, service: GpuService, client: WebClient, name_ttl_s: float = 3600.0) -> None:
        self._service = service
        self._client = client
        self._ttl = name_ttl_s
        self._names: dict[str, tuple[float, str]] = {}
        self._actors: dict[tuple[str, str], tuple[float, Actor]] = {}
        self._looking: set[str] = set()
        # Users whose row this process made or found (one per person of the team).
        self._made: set[str] = set()
        self._lock = threading.Lock()
        self.later: Callable[..., None] | None = None

    def _cached_name(self, user_id: str) -> str | None:
        with self._lock:
            hit = self._names.get(user_id)
        return hit[1] if hit is not None and time.monotonic() - hit[0] < self._ttl else None

    def _look_up(self, user_id: str) -> str | None:
        """users.info, cached on success; None when Slack did not answer."""
        now = time.monotonic()
        try:
            resp = self._client.users_info(user=user_id)
            user = resp["user"] or {}
            profile = user.get("profile") or {}
            name = str(
                profile.get("display_name")
                or profile.get("real_name")
                or user.get("real_name")
                or user.get("name")
                or user_id
            )
        except (SlackApiError, OSError) as exc:
            log.warning("users.info for %s failed (%s)", user_id, type(exc).__name__)
            return None
        with self._lock:
            self._names[user_id] = (now, name)
        return name

    def display_name(self, user_id: str, fallback: str) -> str:
        return self._cached_name(user_id) or self._look_up(user_id) or fallback or user_id

    def _rename_later(self, user_id: str, fallback_name: str = "") -> None:
        with self._lock:
            if user_id in self._looking:
                return
            self._looking.add(user_id)
        assert self.later is not None
        self.later(self._rename, user_id, fallback_name)

    def _rename(self, user_id: str, fallback_name: str = "") -> None:
        """After the ack: the name from users.info, then the person's row with it: made
        (if a read-only first command left it unmade) or renamed, in one write."""
        try:
            name = self._look_up(user_id)
            self._service.actor(user_id, name, name_if_new=fallback_name or None)
            with self._lock:
                self._made.add(user_id)
        except Exception as exc:
            failure_message(exc, f"display name of {user_id}")
        finally:
            with self._lock:
                self._looking.discard(user_id)

    def actor(self, user_id: str, fallback_name: str = "", *, reads_only: bool = False) -> Actor:
        """Creates the user on first sight (service.actor); the Actor is then cached for a
        minute so a burst of `/gpu status` does not queue on the database's write lock.
        `reads_only` (a command that only reads, with `later` set): someone new is answered
        first and their row made after the ack, with the name lookup, so a first command
        waits on no write (sixteen first commands at once queued on SQLite's one writer)."""
        name = self._cached_name(user_id)
        if name is None:
            if self.later is None:
                name = self.display_name(user_id, fallback_name)
            else:
                self._rename_later(user_id, fallback_name)
        now = time.monotonic()
        key = (user_id, name or "")
        with self._lock:
            hit = self._actors.get(key)
        if hit is not None and now - hit[0] < 60.0:
            return hit[1]
        with self._lock:
            made = user_id in self._made
        # Someone whose row this process has not seen made is answered without making it
        # when the command only reads (the row follows after the ack, in `_rename`), and
        # that actor is not kept: the next command looks again.
        create = made or not (reads_only and self.later is not None)
        actor = self._service.actor(user_id, name, name_if_new=fallback_name or None, create=create)
        if create:
            with self._lock:
                self._actors[key] = (now, actor)
                self._made.add(user_id)
        return actor


class RequestMemo:
    """The first delivery's future per request key, for the last `size` keys."""

    def __init__(self, size: int = 2048) -> None:
        self._futures: OrderedDict[str, Future[views.Reply]] = OrderedDict()
        self._lock = threading.Lock()
        self._size = size

    def get_or_start(
        self, key: str | None, start: Callable[[], Future[views.Reply]]
    ) -> tuple[Future[views.Reply], bool]:
        """Returns (future, is_first)."""
        if key is None:
            return start(), True
        with self._lock:
            fut = self._futures.get(key)
            if fut is not None:
                self._futures.move_to_end(key)
                return fut, False
            fut = start()
            self._futures[key] = fut
            while len(self._futures) > self._size:
                self._futures.popitem(last=False)
            return fut, True


def reply_body(reply: views.Reply) -> dict[str, Any]:
    body = message(reply.view)
    body["response_type"] = "ephemeral" if reply.ephemeral else "in_channel"
    return body


def _verb(line: str) -> str:
    rest = line.strip().removeprefix("/gpu").strip()
    return rest.split(" ", 1)[0].lower() if rest else "help"


@dataclass
class SlackFace:
    service: GpuService
    settings: Settings
    app: App
    client: WebClient
    identity: Identity
    notifier: Notifier | None = None
    # Whether this process delivers the outbox right after a command (only when the
    # worker runs here: two processes delivering at once could send one item twice).
    deliver_after_commands: bool = False
    ack_deadline_s: float = ACK_DEADLINE_S
    inline_verbs: frozenset[str] = INLINE_VERBS
    # Commands that change things run here, under the ack deadline. Small on purpose:
    # one GIL and one SQLite writer gain nothing from more threads, and fewer runnable
    # threads keep the latency tail short under a burst.
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=8, thread_name_prefix="gpubot-slack")
    )
    background: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=4, thread_name_prefix="gpubot-after")
    )
    memo: RequestMemo = field(default_factory=RequestMemo)

    # --- the one path every surface takes -------------------------------------------

    def _execute(self, user_id: str, fallback_name: str, line: str, key: str | None) -> views.Reply:
        if not user_id:
            return views.error("Slack did not say who sent this; nothing was changed.")
        try:
            reads_only = _verb(line) in self.inline_verbs
            actor = self.identity.actor(user_id, fallback_name, reads_only=reads_only)
        except UserError as exc:
            return views.error(exc.text)
        except Exception as exc:
            return views.error(failure_message(exc, f"identity of {user_id}"))
        reply = handle_text(self.service, actor, line, request_key=key)
        if not reply.error and _verb(line) in CHANGING_VERBS:
            self.after(self._after_change, actor)
        return reply

    def ack_wait(self, headers: Mapping[str, Sequence[str]]) -> float:
        """Seconds left of the ack deadline for a request with these headers."""
        try:
            received = float((headers.get(RECEIVED_AT_HEADER) or [""])[0])
        except ValueError:
            return self.ack_deadline_s
        return max(0.0, self.ack_deadline_s - (time.monotonic() - received))

    def after(self, fn: Callable[..., None], *args: object) -> None:
        """Work that follows a reply (Home, DMs); dropped quietly once shutting down."""
        try:
            self.background.submit(fn, *args)
        except RuntimeError:
            log.info("shutting down: skipped %s", getattr(fn, "__name__", fn))

    def _after_change(self, actor: Actor) -> None:
        try:
            publish_home(self.client, self.service, actor)
            if self.deliver_after_commands and self.notifier is not None:
                deliver(self.service, self.notifier)
        except Exception as exc:
            failure_message(exc, f"after-command work for {actor.key}")

    def run_channel_refusal(self, line: str, channel: str | None) -> str | None:
        """Why `/gpu run` is not taken from this channel (GPUBOT_RUN_CHANNELS), if it isn't."""
        if _verb(line) != "run":
            return None
        return self.service.runs.gate.channel_refusal(channel)

    def run_line(
        self,
        user_id: str,
        fallback_name: str,
        line: str,
        key: str | None,
        channel: str | None = None,
    ) -> Future[views.Reply]:
        refusal = self.run_channel_refusal(line, channel)
        if refusal is not None:
            refused: Future[views.Reply] = Future()
            refused.set_result(views.error(refusal))
            return refused
        fut, _first = self.memo.get_or_start(
            key, lambda: self.pool.submit(self._execute, user_id, fallback_name, line, key)
        )
        return fut

    def publish_home_for(self, user_id: str) -> None:
        try:
            actor = self.identity.actor(user_id)
            publish_home(self.client, self.service, actor)
        except Exception as exc:
            failure_message(exc, f"app home for {user_id}")

    def dm(self, user_id: str, reply: views.Reply) -> None:
        """A direct answer (not a notification: nothing to keep if it fails) to a user
        who acted where there is no response_url, e.g. a button on Home."""
        try:
            channel = self.client.conversations_open(users=user_id)["channel"]["id"]
            body = message(reply.view)
            self.client.chat_postMessage(channel=channel, text=body["text"], blocks=body["blocks"])
        except (SlackApiError, OSError) as exc:
            log.warning("reply DM to %s failed: %s", user_id, type(exc).__name__)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)
        self.background.shutdown(wait=True)


def _answer_later(
    fut: Future[views.Reply],
    respond: Respond | None,
    dm: Callable[[views.Reply], None],
    replace: bool,
) -> None:
    """Sends the reply when it is ready: by response_url when there is one, else by DM."""

    def done(f: Future[views.Reply]) -> None:
        try:
            reply = f.result()
        except Exception as exc:
            reply = views.error(failure_message(exc, "slack reply"))
        if respond is not None:
            try:
                body = reply_body(reply)
                if replace and reply.ephemeral:
                    body["replace_original"] = True
                respond(**body)
                return
            except Exception as exc:
                log.warning("response_url answer failed (%s); sending a DM", type(exc).__name__)
        dm(reply)

    fut.add_done_callback(done)


def _quick_client(client: WebClient) -> WebClient:
    """The same Web API, with a timeout that fits inside Slack's 3-second ack: a name
    lookup that hangs must fall back to the payload's name, not lose the command."""
    return WebClient(token=client.token, base_url=client.base_url, timeout=1, retry_handlers=[])


def build_face(
    service: GpuService,
    settings: Settings,
    *,
    notifier: Notifier | None = None,
    deliver_after_commands: bool = False,
    client: WebClient | None = None,
    ack_deadline_s: float = ACK_DEADLINE_S,
) -> SlackFace:
    """The Bolt app wired to the service. Bolt calls auth.test here (once), so a wrong
    token fails at start-up rather than on the first command."""
    if client is None:
        client = WebClient(
            token=settings.slack_bot_token.get_secret_value() or None,
            base_url=settings.slack_api_url or DEFAULT_API_URL,
        )
    app = App(
        client=client,
        signing_secret=settings.slack_signing_secret.get_secret_value() or None,
        process_before_response=True,
        # Socket Mode has no signing secret; Bolt skips verification there by itself.
        request_verification_enabled=True,
    )
    quick = _quick_client(client)
    # Who may run: with Slack's user groups (bot.app.access).
    service.runs.gate = RunGate(settings, SlackMembership(quick))
    face = SlackFace(
        service=service,
        settings=settings,
        app=app,
        client=client,
        identity=Identity(service, quick),
        notifier=notifier,
        deliver_after_commands=deliver_after_commands,
        ack_deadline_s=ack_deadline_s,
    )
    face.identity.later = face.after  # names from users.info after the ack
    _register(face)
    return face


def _register(face: SlackFace) -> None:
    app = face.app

    @app.command("/gpu")
    def on_command(
        ack: Ack, body: dict[str, Any], respond: Respond, client: WebClient, request: BoltRequest
    ) -> None:
        user_id = str(body.get("user_id", ""))
        text = str(body.get("text", "") or "")
        line = f"/gpu {text}".strip()
        trigger = body.get("trigger_id")
        try:
            cmd = parse_text(line)
        except Exception:  # handle_text below answers it: a usage line or a reference
            cmd = None
        refusal = face.run_channel_refusal(line, str(body.get("channel_id", "")))
        if refusal is not None:
            ack(**reply_body(views.error(refusal)))
            return
        if isinstance(cmd, Run) and cmd.interactive and trigger:
            metadata = {
                "response_url": str(body.get("response_url", "")),
                "channel": str(body.get("channel_id", "")),
            }
            try:
                client.views_open(
                    trigger_id=trigger, view=modal.run_modal(known_models(), metadata)
                )
                ack()
            except SlackApiError as exc:
                log.warning("views.open failed: %s", exc.response.get("error"))
                ack(
                    response_type="ephemeral",
                    text="I could not open the run form; type `/gpu run --gpus 1 -- COMMAND` instead.",
                )
            return
        key = f"slack:cmd:{trigger}" if trigger else None
        if _verb(line) in face.inline_verbs:
            # Reads only: answered on this thread, no hand-off (a redelivery reads again).
            ack(**reply_body(face._execute(user_id, str(body.get("user_name", "")), line, key)))
            return
        fut = face.run_line(
            user_id, str(body.get("user_name", "")), line, key, str(body.get("channel_id", ""))
        )
        try:
            reply = fut.result(timeout=face.ack_wait(request.headers))
        except FutureTimeout:
            ack(
                response_type="ephemeral",
                text=f"Working on `{line[:200]}`… the answer follows here.",
            )
            _answer_later(fut, respond, lambda r: face.dm(user_id, r), replace=False)
            return
        ack(**reply_body(reply))

    @app.action(re.compile(".+"))
    def on_button(ack: Ack, body: dict[str, Any], respond: Respond) -> None:
        """Any button: its value is its `/gpu` line, run as the user who clicked."""
        ack()
        user = body.get("user") or {}
        user_id = str(user.get("id", ""))
        actions = body.get("actions") or [{}]
        action = actions[0]
        line = str(action.get("value") or "")
        has_url = bool(body.get("response_url"))
        if not line.startswith("/gpu"):
            face.dm(
                user_id, views.error("That button is from an older gpubot and does nothing now.")
            )
            return
        trigger = body.get("trigger_id") or f"{action.get('action_ts')}:{user_id}"
        container = body.get("container") or {}
        channel = (body.get("channel") or {}).get("id") or container.get("channel_id")
        fut = face.run_line(
            user_id, str(user.get("name", "")), line, f"slack:act:{trigger}", channel
        )
        on_home = container.get("type") == "view" and (body.get("view") or {}).get("type") == "home"
        _answer_later(
            fut,
            respond if has_url else None,
            lambda r: face.dm(user_id, r),
            replace=bool(container.get("is_ephemeral")),
        )
        if on_home:
            fut.add_done_callback(lambda _f: face.after(face.publish_home_for, user_id))

    @app.view(modal.CALLBACK_ID)
    def on_run_modal(ack: Ack, body: dict[str, Any]) -> None:
        view = body.get("view") or {}
        sub = modal.read_submission(view, known_models(), check=parse_text)
        if sub.line is None:
            ack(response_action="errors", errors=sub.errors)
            return
        ack()
        user = body.get("user") or {}
        user_id = str(user.get("id", ""))
        try:
            meta = json.loads(view.get("private_metadata") or "{}")
        except json.JSONDecodeError:
            meta = {}
        url = meta.get("response_url") if isinstance(meta, dict) else None
        trigger = body.get("trigger_id") or view.get("id")
        channel = meta.get("channel") if isinstance(meta, dict) else None
        fut = face.run_line(
            user_id, str(user.get("name", "")), sub.line, f"slack:view:{trigger}", channel
        )
        respond: Respond | None = None
        if url:
            respond = Respond(response_url=url)
        _answer_later(fut, respond, lambda r: face.dm(user_id, r), replace=False)

    @app.event("app_home_opened")
    def on_home_opened(event: dict[str, Any], context: BoltContext, body: dict[str, Any]) -> None:
        if event.get("tab", "home") != "home":
            return
        user_id = str(event.get("user", ""))
        if user_id:
            face.after(face.publish_home_for, user_id)
