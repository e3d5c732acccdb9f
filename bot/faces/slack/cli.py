"""`gpubot serve` and `gpubot manifest`, written as typer commands for bot/faces/cli.py.

Where `serve` listens: `--host` defaults to `$GPUBOT_HOST`; failing that 0.0.0.0 when
`$PORT` is set (a PaaS sets PORT and routes to the container's interface, so it must
bind all of them), else 127.0.0.1 (on a laptop or a shared box nothing outside
should reach an app that is usually run in Socket Mode anyway). Only this one
address is bound, unlike Bolt's development server.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import FrameType

import typer

from bot import providers
from bot.app.config import ConfigError, Settings, load_settings
from bot.domain.errors import UserError

log = logging.getLogger(__name__)


def default_host(env: dict[str, str] | None = None) -> str:
    env = dict(os.environ) if env is None else env
    if env.get("GPUBOT_HOST"):
        return env["GPUBOT_HOST"]
    return "0.0.0.0" if env.get("PORT") else "127.0.0.1"


def default_port(env: dict[str, str] | None = None) -> int:
    env = dict(os.environ) if env is None else env
    raw = env.get("PORT", "")
    return int(raw) if raw.isdigit() else 3000


def _fail(text: str) -> typer.Exit:
    typer.echo(f"gpubot: {text}", err=True)
    return typer.Exit(2)


def _load() -> Settings:
    try:
        settings = load_settings()
        providers.names(settings)  # one that does not exist is named before anything starts
        return settings
    except ConfigError as exc:
        raise _fail(exc.text) from None


def serve(
    port: int | None = typer.Option(
        None, "--port", help="HTTP port (default $PORT, else 3000); unused in Socket Mode."
    ),
    no_worker: bool = typer.Option(
        False, "--no-worker", help="Do not run the periodic work here (run `gpubot worker`)."
    ),
    host: str = typer.Option(
        "",
        "--host",
        help="Address to bind (default $GPUBOT_HOST; else 0.0.0.0 when $PORT is set, as on a PaaS; else 127.0.0.1).",
    ),
    log_format: str = typer.Option(
        "",
        "--log-format",
        help="text or json (one object a line); default $GPUBOT_LOG_FORMAT, else text.",
    ),
) -> None:
    """The Slack app: Socket Mode when SLACK_APP_TOKEN is set, else HTTP at /slack/events."""
    from bot.adapters.logs import log_format as resolve_log_format
    from bot.adapters.logs import setup_logging
    from bot.faces.runtime import build_runtime
    from bot.faces.slack.app import build_face
    from bot.faces.slack.notifier import from_settings
    from bot.faces.slack.server import HttpServer, socket_mode
    from bot.faces.worker import Worker

    settings = _load()
    try:
        fmt = resolve_log_format(log_format)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    # Scrubbed in both formats: tokens and the signing secret never reach a log line.
    setup_logging(fmt, settings, stream=sys.stderr)
    if not settings.slack_bot_token:
        raise _fail("SLACK_BOT_TOKEN is not set; docs/SLACK_SETUP.md says where to find it.")
    if not settings.slack_app_token and not settings.slack_signing_secret:
        raise _fail(
            "Set SLACK_APP_TOKEN (Socket Mode) or SLACK_SIGNING_SECRET (HTTP); "
            "docs/SLACK_SETUP.md says where to find them."
        )
    try:
        # Slack users are strangers to this machine: runs only as GPUBOT_RUN_AS.
        runtime = build_runtime(settings, runs_as_self=False)
    except UserError as exc:
        raise _fail(exc.text) from None
    notifier = from_settings(settings, runtime.engine, runtime.service.clock)
    try:
        face = build_face(
            runtime.service, settings, notifier=notifier, deliver_after_commands=not no_worker
        )
    except Exception as exc:  # auth.test failed: wrong token or unreachable Slack
        raise _fail(f"could not start the Slack app: {type(exc).__name__}: {exc}") from None
    worker = (
        None
        if no_worker
        else Worker(runtime.service, notifier, settings.tick_seconds, runtime.leadership())
    )
    stop = threading.Event()

    def _stop(_sig: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    if worker is not None:
        worker.start()
    try:
        if settings.slack_app_token:
            handler = socket_mode(face, settings.slack_app_token.get_secret_value())
            handler.connect()  # type: ignore[no-untyped-call]
            log.info("connected to Slack in Socket Mode")
            stop.wait()
            handler.close()  # type: ignore[no-untyped-call]
        else:
            server = HttpServer(
                face, host=host or default_host(), port=default_port() if port is None else port
            )
            server.start()
            stop.wait()
            server.stop()
    finally:
        if worker is not None:
            worker.stop()
        face.shutdown()


def manifest(
    url: str = typer.Option(
        "",
        "--url",
        help="Public https URL of /slack/events for HTTP mode; without it the manifest uses Socket Mode.",
    ),
    name: str = typer.Option("gpubot", "--name", help="App and bot user name in Slack."),
) -> None:
    """Prints the Slack app manifest (YAML) for "Create an app → From a manifest"."""
    from bot.faces.slack.manifest import manifest_yaml

    if url and not url.lower().startswith("https://"):
        # Slack refuses a request URL that is not https; say so before it does.
        raise _fail(
            f"--url must be an https:// address (Slack only calls https), not {url!r}; "
            "or leave --url out for Socket Mode."
        )
    typer.echo(manifest_yaml(name=name, request_url=url), nl=False)
