"""`gpubot`: the command line (DESIGN.md's public contract).

Every command reads Settings once, and turns a bad setting into one plain line on
stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import getpass
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import typer
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from bot import providers
from bot.adapters.leader import worker_running
from bot.adapters.logs import log_format as resolve_log_format
from bot.adapters.logs import setup_logging
from bot.adapters.metrics import OpsApp
from bot.app.config import ConfigError, Settings, load_settings
from bot.app.money.digest import digest_for, digest_view, post_digest, write_csv
from bot.app.money.prices import priced_catalog
from bot.domain.clock import SystemClock
from bot.domain.errors import UserError
from bot.faces.doctor import doctor
from bot.faces.runtime import build_runtime, open_database
from bot.faces.simulate_cli import simulate
from bot.faces.slack.cli import default_host as slack_default_host
from bot.faces.slack.cli import manifest as slack_manifest
from bot.faces.slack.cli import serve as slack_serve
from bot.faces.slack.notifier import from_settings as slack_notifier_from_settings
from bot.faces.slack.server import HttpServer
from bot.faces.terminal import Shell
from bot.faces.worker import Worker

app = typer.Typer(
    name="gpubot",
    help="Share the team's GPUs from Slack or a terminal: reserve, queue runs, see costs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database schema commands.", no_args_is_help=True)
app.add_typer(db_app, name="db")
prices_app = typer.Typer(help="The GPU price catalog.", no_args_is_help=True)
app.add_typer(prices_app, name="prices")
hosts_app = typer.Typer(help="The team's own SSH hosts.", no_args_is_help=True)
app.add_typer(hosts_app, name="hosts")


def _settings() -> Settings:
    """The settings, with the providers they name known (bot.providers): a bad setting
    is one line naming it, before anything starts."""
    try:
        settings = load_settings()
        providers.names(settings)
        return settings
    except ConfigError as exc:
        typer.echo(f"gpubot: {exc.text}", err=True)
        raise typer.Exit(2) from None


def _log_format(requested: str) -> str:
    try:
        return resolve_log_format(requested)
    except ValueError as exc:
        typer.echo(f"gpubot: {exc}", err=True)
        raise typer.Exit(2) from None


LOG_FORMAT_OPTION = typer.Option(
    "",
    "--log-format",
    help="text or json (one object a line); default $GPUBOT_LOG_FORMAT, else text.",
)


def _log_to_file(settings: Settings, fmt: str = "text", level: int = logging.INFO) -> Path:
    """The shell's screen is the user's: logs (with tracebacks) go to a file instead."""
    settings.home.mkdir(parents=True, exist_ok=True)
    path = settings.home / "gpubot.log"
    setup_logging(fmt, settings, level=level, path=str(path))
    return path


def _log_to_stderr(settings: Settings, fmt: str = "text", level: int = logging.INFO) -> None:
    setup_logging(fmt, settings, level=level, stream=sys.stderr)


@app.command()
def shell(
    user: str = typer.Option(
        "", "--user", help="Who you are in the shell (default: your login name)."
    ),
    no_wait: bool = typer.Option(
        False, "--no-wait", help="At end of input exit at once, without waiting for runs."
    ),
    log_format: str = LOG_FORMAT_OPTION,
) -> None:
    """The whole bot in a terminal: on SQLite under $GPUBOT_HOME, with this machine as the GPU host.

    Type what you would type in Slack (`/gpu reserve a100 for 3h`); `@alice /gpu status`
    runs as alice. Works interactively and piped.
    """
    settings = _settings()
    log_path = _log_to_file(settings, _log_format(log_format))
    name = (user or os.environ.get("GPUBOT_USER") or _login() or "me").lstrip("@")
    try:
        runtime = build_runtime(settings, SystemClock())
    except UserError as exc:
        typer.echo(f"gpubot: {exc.text}", err=True)
        raise typer.Exit(2) from None
    lock = threading.Lock()
    sh = Shell(runtime.service, name, sys.stdout, lock)
    worker = Worker(runtime.service, sh.notifier, settings.tick_seconds, runtime.leadership())
    worker.start()
    if sys.stdin.isatty():
        hosts = runtime.compute.list_instances()
        slots = sum(len(h.gpus) for h in hosts)
        sh.print(
            f"gpubot shell — you are @{name}; {slots} slot(s) on {len(hosts)} host(s); "
            f"logs in {log_path}. Try `/gpu help`. Ctrl-D quits."
        )
    try:
        sh.run(_lines())
        if not no_wait:
            # Reservations simply stay in the database; runs this shell started are
            # waited for, so a piped script sees their results.
            sh.wait_for_runs(min(settings.tick_seconds, 1.0))
    except KeyboardInterrupt:
        pass
    finally:
        worker.stop()


def _lines() -> Iterator[str]:
    while True:
        line = sys.stdin.readline()
        if not line:
            return
        yield line


def _login() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return ""


# `gpubot submit` (bot.app.hosts.sources): a local directory staged and run as a /gpu run.
@app.command()
def submit(
    directory: Path = typer.Argument(..., help="The project directory to upload."),
    command: list[str] = typer.Argument(None, help="After --: the command to run in it."),
    gpus: int = typer.Option(1, "--gpus", help="GPUs for the run."),
    gpu: str = typer.Option("", "--gpu", help="GPU model (a100, h100, cpu...)."),
    precision: str = typer.Option("auto", "--precision", help="auto, bf16, fp16 or fp32."),
    max_time: str = typer.Option("", "--max", help="Longest it may run, e.g. 4h."),
    spot: bool = typer.Option(False, "--spot", help="Run on spot capacity."),
    user: str = typer.Option("", "--user", help="Whose run it is (default: your login name)."),
    wait: bool = typer.Option(
        False, "--wait", help="Run the worker here and wait for the run, printing its DMs."
    ),
) -> None:
    """Upload a local directory and queue a run of COMMAND in it, as `/gpu run` would.

    The directory is copied under $GPUBOT_HOME/staged/ (without .git, __pycache__, .venv
    and the patterns in its .gpubotignore; 200 MB at most) and sent to the host when the
    run is placed, only the files the host does not have yet:

      gpubot submit ./myproj --gpus 1 --max 2h -- python train.py --lr 3e-4
    """
    import dataclasses
    import shlex

    from bot.app.hosts.sources import stage
    from bot.domain.code_sources import SourceError
    from bot.domain.commands import Run
    from bot.faces.dispatch import execute, parse_text
    from bot.faces.terminal import render

    settings = _settings()
    _log_to_file(settings)
    if not command:
        typer.echo("gpubot: say what to run after --, e.g. -- python train.py", err=True)
        raise typer.Exit(2)
    name = (user or os.environ.get("GPUBOT_USER") or _login() or "me").lstrip("@")
    flags = [f"--gpus {gpus}", f"--precision {shlex.quote(precision)}"]
    flags += [f"--gpu {shlex.quote(gpu)}"] if gpu else []
    flags += [f"--max {shlex.quote(max_time)}"] if max_time else []
    flags += ["--spot"] if spot else []
    try:
        parsed = parse_text(f"run {' '.join(flags)} -- {shlex.join(command)}")
        assert isinstance(parsed, Run)
        runtime = build_runtime(settings, SystemClock())
        # Asked before anything is copied: a refused user leaves nothing under staged/.
        refusal = runtime.service.runs.gate.run_refusal(runtime.service.actor(name))
        if refusal is not None:
            raise UserError(refusal)
        staged = stage(directory, settings.home)
    except (UserError, SourceError) as exc:
        typer.echo(f"gpubot: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(
        f"Staged {staged.files} file(s), {staged.bytes} bytes, as {staged.source.staged_id}"
        + ("" if staged.fresh else " (unchanged since it was last staged)")
        + "."
    )
    run_cmd = dataclasses.replace(parsed, source=staged.source.text())
    lock = threading.Lock()
    sh = Shell(runtime.service, name, sys.stdout, lock)
    try:
        reply = execute(runtime.service, runtime.service.actor(name), run_cmd)
    except UserError as exc:
        typer.echo(f"gpubot: {exc.text}", err=True)
        raise typer.Exit(2) from None
    sh.print(render(reply.view))
    run_id = reply.extra.get("run_id")
    if not isinstance(run_id, int):
        return
    if not wait:
        if worker_running(runtime.engine, runtime.service.clock):
            sh.print(
                f"A gpubot worker is running: it places run #{run_id} on its next tick "
                f"(every {settings.tick_seconds:g} s)."
            )
        else:
            # The reply promises DMs; without a worker nothing places the run.
            sh.print(
                f"No gpubot worker is running, so run #{run_id} waits in the queue until one "
                "starts: run `gpubot worker` (or `gpubot serve`, or `gpubot shell`, which run "
                "one), or submit with --wait to run it from this terminal."
            )
        return
    sh.run_ids.add(run_id)
    w = Worker(runtime.service, sh.notifier, settings.tick_seconds, runtime.leadership())
    w.start()
    try:
        sh.wait_for_runs(min(settings.tick_seconds, 1.0))
    except KeyboardInterrupt:
        pass
    finally:
        w.stop()


@app.command()
def worker(
    log_format: str = LOG_FORMAT_OPTION,
    metrics_port: int | None = typer.Option(
        None,
        "--metrics-port",
        envvar="GPUBOT_METRICS_PORT",
        help="Serve /metrics and /healthz on this port (default $GPUBOT_METRICS_PORT; off when unset).",
    ),
    metrics_host: str = typer.Option(
        "",
        "--metrics-host",
        help="Address for --metrics-port (default $GPUBOT_HOST, else 0.0.0.0 when $PORT is set, else 127.0.0.1).",
    ),
) -> None:
    """The periodic work alone (expiry, warnings, grants, notification delivery).

    SIGTERM: the tick in hand finishes, the leader lock is released, and it exits 0.
    """
    settings = _settings()
    _log_to_stderr(settings, _log_format(log_format))
    try:
        runtime = build_runtime(settings, SystemClock())
    except UserError as exc:
        typer.echo(f"gpubot: {exc.text}", err=True)
        raise typer.Exit(2) from None
    notifier = slack_notifier_from_settings(settings, runtime.engine, runtime.service.clock)
    if notifier is None:
        # Without a bot token notifications wait in the outbox rather than being
        # marked sent unseen.
        logging.getLogger(__name__).warning("SLACK_BOT_TOKEN is not set: notifications stay queued")
    w = Worker(runtime.service, notifier, settings.tick_seconds, runtime.leadership())
    stop = threading.Event()

    def _stop(_sig: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    ops = None
    if metrics_port is not None:
        try:
            # The same front as `serve` (bot.faces.slack.server): a slow or idle stranger on
            # this port holds no worker thread; only /healthz and /metrics answer.
            ops = HttpServer(
                None,
                metrics_host or slack_default_host(),
                metrics_port,
                threads=2,
                app=OpsApp(runtime.engine, runtime.service.clock),
            ).start()
        except OSError as exc:
            typer.echo(f"gpubot: cannot serve metrics on port {metrics_port}: {exc}", err=True)
            raise typer.Exit(2) from None
    w.start()
    logging.getLogger(__name__).info("worker started; tick every %ss", settings.tick_seconds)
    while not stop.is_set():
        time.sleep(0.5)
    w.stop()
    if ops is not None:
        ops.stop()
    logging.getLogger(__name__).info("worker stopped; the lead is released")


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Brings the database schema to the latest revision (the app also does this on start)."""
    from db.migrate import head_revision

    settings = _settings()
    engine = open_database(settings)
    head = head_revision()
    typer.echo(f"database at revision {head} ({engine.url.render_as_string(hide_password=True)})")


@db_app.command("rebuild-rollups")
def db_rebuild_rollups() -> None:
    """Recomputes the cost rollups and fair-share counters from the raw usage intervals
    (after upgrading from a version without them, or to repair them)."""
    from bot.app.money.rollups import rebuild_rollups
    from db.session import lock_pool, transaction

    settings = _settings()
    engine = open_database(settings)
    with transaction(engine) as s:
        lock_pool(s)  # nothing closes an interval meanwhile
        rows = rebuild_rollups(s)
    typer.echo(f"rebuilt {rows} rollup rows from the usage intervals")


@hosts_app.command("forget")
def hosts_forget(
    name: str = typer.Argument(..., help="The host's name, as /gpu status shows it."),
    purge: bool = typer.Option(
        False, "--purge", help="Also remove ~/.gpubot on the host: the venv, the code, the runs."
    ),
) -> None:
    """Stop and remove the host agent (its systemd unit or supervised loop) and forget the host.

    Refused while GPUs on it are held or runs run there. Take it out of GPUBOT_SSH_HOSTS
    too, or the next start lists it again.
    """
    from bot.app.hosts.hostadmin import forget_host
    from bot.providers import owners
    from provisioning.ssh import SshClient

    settings = _settings()
    engine = open_database(settings)
    key = os.environ.get("GPUBOT_SSH_KEY", "").strip()
    client = SshClient()
    try:
        steps = forget_host(
            engine,
            settings,
            SystemClock(),
            client,
            name,
            key_path=str(Path(key).expanduser()) if key else None,
            owned=owners(settings),
            purge=purge,
        )
    except UserError as exc:
        typer.echo(f"gpubot: {exc.text}", err=True)
        raise typer.Exit(1) from None
    finally:
        client.close()
    for step in steps:
        typer.echo(step)
    configured = os.environ.get("GPUBOT_SSH_HOSTS", "")
    if any(e.strip().split("=", 1)[0] == name for e in configured.split(",") if "=" in e):
        typer.echo(f"{name} is still in GPUBOT_SSH_HOSTS: remove it there before the next start.")


@prices_app.command("refresh")
def prices_refresh(
    region: str = typer.Option("us-east-1", "--region", help="AWS region to price."),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="File to write (default: GPUBOT_PRICES_FILE, else $GPUBOT_HOME/prices.csv).",
    ),
) -> None:
    """Fetch today's AWS on-demand and spot prices for the catalog's GPU types.

    On-demand from the AWS Price List API, spot from EC2's spot price history (cheapest
    zone); the catalog CSV it writes is what the bot then quotes instead of the shipped one.
    """
    from provisioning.base import ProvisioningError
    from provisioning.catalog import Catalog
    from provisioning.pricing import refresh

    settings = _settings()
    target = out or settings.prices_path
    try:  # diff against what the file held, else against what the bot quotes now
        base = Catalog.load(prefer=target if target.is_file() else settings.prices_path)
    except ValueError as exc:
        typer.echo(f"gpubot: {exc}; starting from the shipped prices.", err=True)
        base = Catalog.load()
    try:
        result = refresh(base, target, region)
    except ProvisioningError as exc:
        typer.echo(f"gpubot: {exc}", err=True)
        raise typer.Exit(1) from None
    for line in result.lines():
        typer.echo(line)
    typer.echo(f"Wrote {target}.")
    if target.resolve() != settings.prices_path.resolve():
        typer.echo(
            f"The bot reads {settings.prices_path}: set GPUBOT_PRICES_FILE={target} to use it."
        )


def digest_command(
    week: str = typer.Option(
        "", "--week", help="ISO week like 2026-W49 (default: the last complete week)."
    ),
    post: bool = typer.Option(
        False, "--post", help="Queue it for the team channel, chart attached (once per week)."
    ),
    csv_file: Path | None = typer.Option(
        None,
        "--csv",
        help="Also write one row per person to this CSV file, and the wastes and advice "
        "beside it (FILE-advice.csv).",
    ),
) -> None:
    """The weekly GPU cost digest: per person GPU-hours, dollars, utilization, idle waste,
    spot savings and the change against last week; the team's idle overhead.

    Without --post it prints the digest; the worker posts it on its own every week at
    `digest_at` in the team's time zone.
    """
    from bot.app.service import GpuService
    from bot.faces.replay import SimReplayer
    from bot.faces.terminal import render

    settings = _settings()
    engine = open_database(settings)
    service = GpuService(engine, settings, SystemClock())
    try:
        d = digest_for(service, week or None, replay=SimReplayer(priced_catalog(settings)))
    except UserError as exc:
        typer.echo(f"gpubot: {exc.text}", err=True)
        raise typer.Exit(2) from None
    if csv_file is not None:
        try:
            extra = write_csv(d, csv_file)
        except OSError as exc:
            typer.echo(f"gpubot: cannot write {csv_file}: {exc.strerror or exc}", err=True)
            raise typer.Exit(2) from None
        if extra is not None:
            typer.echo(f"Wrote {csv_file} (people) and {extra} (wastes and advice).", err=True)
    if post:
        if post_digest(service, d):
            typer.echo(f"Digest {d.week} queued for #{settings.channel}; the worker posts it.")
        else:
            typer.echo(f"Digest {d.week} was already queued or posted; not again.")
    else:
        typer.echo(render(digest_view(d)))


app.command("simulate")(simulate)
app.command("serve")(slack_serve)
app.command("manifest")(slack_manifest)
app.command("doctor")(doctor)
app.command("digest")(digest_command)


def main() -> None:
    """Every command; what the environment gets wrong (a database that is down or
    refuses us, a home directory we cannot write) ends as one line with its fix and
    exit 2, never a traceback, at every entry point alike."""
    try:
        app()
    except SQLAlchemyError as exc:
        typer.echo(f"gpubot: {_database_line(exc)}", err=True)
        sys.exit(2)
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        typer.echo(
            f"gpubot: cannot use{where}: {exc.strerror or exc}. Check that GPUBOT_HOME "
            "(default ~/.gpubot) is a directory this user may write.",
            err=True,
        )
        sys.exit(2)


def _database_line(exc: SQLAlchemyError) -> str:
    reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    first = reason[0].strip() if reason else type(exc).__name__
    shown, password = "the database", None
    try:
        url = make_url(load_settings().sqlalchemy_url)
        shown, password = url.render_as_string(hide_password=True), url.password
    except (ConfigError, ArgumentError):
        pass
    if password:
        first = first.replace(str(password), "***")
    return (
        f"cannot use the database at {shown}: {first}. Start the database server, or fix "
        "DATABASE_URL (host, port, user, password, database name; unset it for SQLite under "
        "GPUBOT_HOME); `gpubot doctor` checks every setting."
    )


if __name__ == "__main__":
    main()
