"""``python -m training.agent``: the GPU host's own guard, so money stays safe without the bot.

The bot may die, be redeployed or run as replicas; an instance it launched must not run
for days because nobody is left to stop it. So every GPU host runs this small loop
(installed at bootstrap as a service) that needs nothing but the standard library and
our `training` package, and does three things on its own:

* **Dead-man switch.** The bot renews a *lease* file on every poll of the host (see
  `Lease`; `bot.app.hosts.hostagent.renew_lease` writes it). When the host has had no reservation,
  no run and no GPU activity for ``--idle`` seconds *and* the lease has not been renewed
  for longer than ``--lease`` seconds, the agent runs the stop command (default
  ``shutdown -h now``: an EC2 instance then *stops*, it is not terminated) once per boot,
  and records that it did.
* **Spot interruption.** It polls the instance metadata service (IMDSv2: a token from
  ``PUT /latest/api/token``, then ``GET /latest/meta-data/spot/instance-action``; 404
  means no notice). On the two-minute notice it sends SIGTERM to every active run's
  process group, so `training.runner` checkpoints and exits 75, and writes
  ``interruption.json`` for the worker, which requeues those runs.
* **After a reboot.** It keeps the boot id it last saw; when the id changed, the runs
  that were active before and are not alive now are appended to ``lost-runs.json``.

Why the lease age is measured on the host's own clock: the agent notes *when it first
saw* each new ``renewed_at`` value. A bot whose clock runs behind the host's would
otherwise look dead while it is renewing, and one whose clock runs ahead would look
alive after it died. A host with no lease file at all counts from the agent's first run.

What "active" means on the host, all re-read every iteration:

* a reservation in the lease whose ``until`` is still ahead (or has no end);
* a run in the lease whose process group still has a live process;
* a run directory (``<runs-dir>/<run id>/status.json``) that a live process has as its
  working directory (the worker starts each run there), the process's group being the
  one to signal;
* a GPU whose utilization is at least ``--gpu-util-pct`` (`training.telemetry`).

Files in ``--state-dir`` (JSON, replaced atomically, each with ``schema_version``):
``lease.json`` (the bot's), ``heartbeat.json``, ``interruption.json``,
``lost-runs.json``, ``stop.json``, and ``agent-state.json`` (the agent's memory).
Tests steer time with ``--now-file`` and the boot id with ``--boot-id-file``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from training import telemetry

AGENT_VERSION: Final = "1"
SCHEMA_VERSION: Final = 1

LEASE_NAME: Final = "lease.json"
HEARTBEAT_NAME: Final = "heartbeat.json"
INTERRUPTION_NAME: Final = "interruption.json"
LOST_NAME: Final = "lost-runs.json"
STOP_NAME: Final = "stop.json"
STATE_NAME: Final = "agent-state.json"
LOCK_NAME: Final = "agent.lock"

DEFAULT_STATE_DIR: Final = "~/.gpubot/agent"
DEFAULT_RUNS_DIR: Final = "~/.gpubot/runs"
DEFAULT_STOP_COMMAND: Final = "shutdown -h now"
DEFAULT_IMDS: Final = "http://169.254.169.254"
DEFAULT_BOOT_ID_FILE: Final = "/proc/sys/kernel/random/boot_id"
ENV_NOW_FILE: Final = "GPUBOT_AGENT_NOW_FILE"
ENV_BOOT_ID_FILE: Final = "GPUBOT_AGENT_BOOT_ID_FILE"

IMDS_TOKEN_TTL_S: Final = 21600
IMDS_TIMEOUT_S: Final = 2.0
STOP_TIMEOUT_S: Final = 120.0
# Lost-run entries kept; the worker acts on each once, so old ones are only history.
LOST_KEEP: Final = 200


# --- the lease: the one file the bot writes ------------------------------------------------


@dataclass(frozen=True)
class ReservationHold:
    id: str
    until: float | None = None  # unix seconds the reservation ends; None: open-ended


@dataclass(frozen=True)
class RunHold:
    id: str
    pgid: int | None = None  # the process group the worker started (placement["pgid"])


@dataclass(frozen=True)
class Lease:
    """What the bot holds on this host, and when it last said so (its own clock)."""

    renewed_at: float
    reservations: tuple[ReservationHold, ...] = ()
    runs: tuple[RunHold, ...] = ()

    def to_json(self) -> str:
        doc = {"schema_version": SCHEMA_VERSION, **asdict(self)}
        return json.dumps(doc, sort_keys=True)


def parse_lease(text: str | bytes) -> Lease | None:
    """None for anything not a lease of this version: an unreadable lease never holds."""
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict) or doc.get("schema_version") != SCHEMA_VERSION:
            return None
        renewed = doc["renewed_at"]
        if not isinstance(renewed, (int, float)) or isinstance(renewed, bool):
            return None
        reservations = tuple(
            ReservationHold(
                id=str(r["id"]), until=None if r.get("until") is None else float(r["until"])
            )
            for r in doc.get("reservations") or ()
        )
        runs = tuple(
            RunHold(id=str(r["id"]), pgid=None if r.get("pgid") is None else int(r["pgid"]))
            for r in doc.get("runs") or ()
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return Lease(renewed_at=float(renewed), reservations=reservations, runs=runs)


# --- small file helpers --------------------------------------------------------------------


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Temp file beside it, then rename: the worker's `cat` never sees half a document."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            os.fchmod(fh.fileno(), 0o644)
            json.dump(doc, fh, sort_keys=True)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


# --- the host's processes ---------------------------------------------------------------


@dataclass(frozen=True)
class Proc:
    pid: int
    pgid: int
    cwd: str | None  # None where /proc will not tell (another user's process)


def list_processes(proc_root: str = "/proc") -> list[Proc]:
    """Live processes (zombies excluded: an exited run waiting for its reaper is done)."""
    found = []
    try:
        entries = os.listdir(proc_root)
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"{proc_root}/{name}/stat", encoding="utf-8", errors="replace") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) < 3 or fields[0] in ("Z", "X"):
            continue
        try:
            cwd: str | None = os.readlink(f"{proc_root}/{name}/cwd")
        except OSError:
            cwd = None
        found.append(Proc(pid=int(name), pgid=int(fields[2]), cwd=cwd))
    return found


@dataclass
class ActiveRun:
    id: str
    pgid: int | None
    source: str  # "lease" or "run-dir" (or both, "lease+run-dir")
    dir: str | None = None


def find_active_runs(
    lease: Lease | None, runs_dirs: Sequence[Path], procs: list[Proc]
) -> list[ActiveRun]:
    """Runs with a live process, from the lease's process groups and the run directories."""
    groups = {p.pgid for p in procs}
    active: dict[str, ActiveRun] = {}
    for hold in lease.runs if lease is not None else ():
        if hold.pgid is not None and hold.pgid in groups:
            active[hold.id] = ActiveRun(hold.id, hold.pgid, "lease")
    by_cwd: dict[str, Proc] = {}
    for p in sorted(procs, key=lambda p: p.pid):  # the oldest (lowest pid) names the group
        if p.cwd is not None:
            by_cwd.setdefault(p.cwd, p)
    for runs_dir in runs_dirs:
        try:
            children = sorted(runs_dir.iterdir())
        except OSError:
            continue
        for run_dir in children:
            if not (run_dir / "status.json").is_file():
                continue
            resolved = str(run_dir.resolve())
            owner = by_cwd.get(resolved) or next(
                (p for cwd, p in by_cwd.items() if cwd.startswith(resolved + "/")), None
            )
            if owner is None:
                continue
            known = active.get(run_dir.name)
            if known is not None:
                known.source, known.dir = "lease+run-dir", resolved
            else:
                active[run_dir.name] = ActiveRun(run_dir.name, owner.pgid, "run-dir", resolved)
    return sorted(active.values(), key=lambda r: r.id)


def run_state(runs_dirs: Sequence[Path], run_id: str) -> str | None:
    """The state its status file last said, for the lost-runs report; None if none."""
    for runs_dir in runs_dirs:
        doc = read_json(runs_dir / run_id / "status.json")
        if doc is not None and isinstance(doc.get("state"), str):
            return str(doc["state"])
    return None


# --- the metadata service ----------------------------------------------------------------


class Imds:
    """IMDSv2 client for the spot notice. Never through a proxy: the endpoint is local."""

    def __init__(self, endpoint: str, timeout: float = IMDS_TIMEOUT_S) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.timeout = timeout
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._token: str | None = None
        self._token_until = 0.0

    def _get_token(self) -> str:
        if self._token is not None and time.monotonic() < self._token_until:
            return self._token
        request = urllib.request.Request(
            f"{self.endpoint}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(IMDS_TOKEN_TTL_S)},
        )
        with self._opener.open(request, timeout=self.timeout) as resp:
            token: str = resp.read().decode("ascii", "replace").strip()
        self._token, self._token_until = token, time.monotonic() + IMDS_TOKEN_TTL_S - 60
        return token

    def spot_notice(self) -> dict[str, Any] | None:
        """The notice (``{"action": "stop"|"terminate"|"hibernate", "time": ...}``) or None.

        Raises OSError (URLError, timeouts) when the service cannot be asked at all.
        """
        for attempt in (1, 2):
            request = urllib.request.Request(
                f"{self.endpoint}/latest/meta-data/spot/instance-action",
                headers={"X-aws-ec2-metadata-token": self._get_token()},
            )
            try:
                with self._opener.open(request, timeout=self.timeout) as resp:
                    body: str = resp.read().decode("utf-8", "replace")
            except urllib.error.HTTPError as exc:
                if exc.code == 404:
                    return None
                if exc.code == 401 and attempt == 1:
                    self._token = None  # expired or revoked: one fresh token, then give up
                    continue
                raise
            try:
                doc = json.loads(body)
            except ValueError:
                doc = {"raw": body[:200]}
            return doc if isinstance(doc, dict) else {"raw": body[:200]}
        return None


# --- one iteration -------------------------------------------------------------------------


@dataclass
class Config:
    state_dir: Path
    runs_dirs: tuple[Path, ...]
    lease_file: Path
    idle_s: float
    lease_s: float
    stop_command: str | None  # None or empty: never stop the host (watch only)
    imds_endpoint: str | None  # None: no spot watch (not on EC2)
    gpu_util_pct: int
    now_file: Path | None
    boot_id_file: Path
    telemetry_file: Path | None  # a recorded snapshot instead of probing the GPUs


@dataclass
class Outcome:
    """What one iteration saw and did; the heartbeat is this, as JSON."""

    at: float
    boot_id: str
    lease_renewed_at: float | None
    lease_age_s: float
    reservations: list[str]
    runs: list[dict[str, Any]]
    gpu_busy: bool
    gpu_source: str
    idle_s: float
    imds: str
    stop_issued: bool = False
    lost: list[str] = field(default_factory=list)
    signalled: list[str] = field(default_factory=list)


class Agent:
    def __init__(
        self,
        config: Config,
        *,
        snapshot: Callable[[], telemetry.HostSnapshot] | None = None,
        imds: Imds | None = None,
    ) -> None:
        self.config = config
        self.snapshot = snapshot or self._snapshot
        self.imds = imds or (Imds(config.imds_endpoint) if config.imds_endpoint else None)

    def path(self, name: str) -> Path:
        return self.config.state_dir / name

    def now(self) -> float:
        if self.config.now_file is not None:
            return float(self.config.now_file.read_text().strip())
        return time.time()

    def boot_id(self) -> str:
        try:
            return self.config.boot_id_file.read_text().strip()
        except OSError:
            return "unknown"

    def _snapshot(self) -> telemetry.HostSnapshot:
        if self.config.telemetry_file is not None:
            snap = telemetry.parse_snapshot(self.config.telemetry_file.read_text())
            if snap is None:
                raise ValueError(f"{self.config.telemetry_file} holds no telemetry snapshot")
            return snap
        return telemetry.take_snapshot()

    def _gpu_busy(self) -> tuple[bool, str]:
        try:
            snap = self.snapshot()
        except Exception as exc:  # a broken probe must not stop the guard; it counts as busy
            return True, f"probe failed ({exc}); counted as busy"
        busy = any(
            g.util_pct is not None and g.util_pct >= self.config.gpu_util_pct for g in snap.gpus
        )
        return busy, snap.source if snap.gpus else "no GPU"

    def step(self) -> Outcome:
        cfg = self.config
        now = self.now()
        boot = self.boot_id()
        state = read_json(self.path(STATE_NAME)) or {}
        first_seen = float(state.get("first_seen_at", now))

        raw_lease = None
        with contextlib.suppress(OSError):
            raw_lease = cfg.lease_file.read_bytes()
        lease = parse_lease(raw_lease) if raw_lease is not None else None
        if lease is not None and lease.renewed_at != state.get("lease_renewed_at"):
            state["lease_renewed_at"] = lease.renewed_at
            state["lease_seen_at"] = now
        lease_since = float(state.get("lease_seen_at", first_seen))
        lease_age = now - lease_since

        procs = list_processes()
        runs = find_active_runs(lease, cfg.runs_dirs, procs)
        reservations = [
            r.id
            for r in (lease.reservations if lease is not None else ())
            if r.until is None or r.until > now
        ]
        gpu_busy, gpu_source = self._gpu_busy()

        lost: list[str] = []
        previous_boot = state.get("boot_id")
        if previous_boot is not None and previous_boot != boot:
            lost = self._report_lost(state, previous_boot, boot, runs, now)
            # A fresh boot gets the full idle time: somebody started this host on purpose.
            state["last_busy_at"] = now
            state.pop("stop", None)
        busy = bool(runs or reservations or gpu_busy)
        if busy or "last_busy_at" not in state:
            state["last_busy_at"] = now
        idle = now - float(state["last_busy_at"])

        imds_said, signalled = self._watch_spot(boot, runs, now)

        # A renewal or activity after a stop means someone wants the host: re-arm.
        stop = state.get("stop")
        if stop is not None and (busy or float(stop["at"]) < lease_since):
            state.pop("stop", None)
        stop_issued = False
        if (
            cfg.stop_command
            and idle > cfg.idle_s
            and lease_age > cfg.lease_s
            and "stop" not in state
        ):
            state["stop"] = self._stop(state, now, boot, idle, lease_age)
            stop_issued = True

        state.update(
            boot_id=boot,
            first_seen_at=first_seen,
            active_runs=[asdict(r) for r in runs],
        )
        write_json(self.path(STATE_NAME), state)
        outcome = Outcome(
            at=now,
            boot_id=boot,
            lease_renewed_at=lease.renewed_at if lease is not None else None,
            lease_age_s=lease_age,
            reservations=reservations,
            runs=[asdict(r) for r in runs],
            gpu_busy=gpu_busy,
            gpu_source=gpu_source,
            idle_s=idle,
            imds=imds_said,
            stop_issued=stop_issued,
            lost=lost,
            signalled=signalled,
        )
        self._heartbeat(outcome, state)
        return outcome

    def _heartbeat(self, outcome: Outcome, state: dict[str, Any]) -> None:
        cfg = self.config
        doc = {
            "schema_version": SCHEMA_VERSION,
            "version": AGENT_VERSION,
            "pid": os.getpid(),
            "time": outcome.at,
            "boot_id": outcome.boot_id,
            "seen": {
                "lease_renewed_at": outcome.lease_renewed_at,
                "lease_age_s": round(outcome.lease_age_s, 3),
                "reservations": outcome.reservations,
                "runs": outcome.runs,
                "gpu_busy": outcome.gpu_busy,
                "gpu": outcome.gpu_source,
                "idle_s": round(outcome.idle_s, 3),
                "imds": outcome.imds,
            },
            "limits": {
                "idle_s": cfg.idle_s,
                "lease_s": cfg.lease_s,
                "stops_host": bool(cfg.stop_command),
            },
            "stop": state.get("stop"),
        }
        write_json(self.path(HEARTBEAT_NAME), doc)

    def _stop(
        self, state: dict[str, Any], now: float, boot: str, idle: float, lease_age: float
    ) -> dict[str, Any]:
        """Runs the stop command once; its record goes to the state and to stop.json.

        The record is written *before* the command runs: a shutdown may kill this process
        before the command returns, and a restarted agent must not issue it again.
        """
        command = self.config.stop_command or ""
        log(f"idle {idle:.0f}s and lease {lease_age:.0f}s old: running {command!r}")
        pending = {"at": now, "boot_id": boot, "command": command, "exit_code": None}
        write_json(self.path(STATE_NAME), {**state, "stop": pending})
        try:
            done = subprocess.run(
                ["/bin/sh", "-c", command],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=STOP_TIMEOUT_S,
                check=False,
            )
            exit_code: int | None = done.returncode
            said = (done.stderr.strip() or done.stdout.strip())[-400:]
        except (OSError, subprocess.TimeoutExpired) as exc:
            exit_code, said = None, str(exc)
        record = {
            "at": now,
            "boot_id": boot,
            "command": command,
            "exit_code": exit_code,
            "output": said,
            "idle_s": round(idle, 3),
            "lease_age_s": round(lease_age, 3),
        }
        write_json(self.path(STOP_NAME), {"schema_version": SCHEMA_VERSION, **record})
        return record

    def _watch_spot(self, boot: str, runs: list[ActiveRun], now: float) -> tuple[str, list[str]]:
        if self.imds is None:
            return "off", []
        try:
            notice = self.imds.spot_notice()
        except (OSError, ValueError) as exc:
            return f"error: {exc}", []
        if notice is None:
            return "no notice", []
        record = read_json(self.path(INTERRUPTION_NAME)) or {}
        if record.get("boot_id") not in (None, boot):
            record = {}  # a notice from before a reboot is history
        already = {str(r["id"]) for r in record.get("runs", []) if isinstance(r, dict)}
        signalled = []
        entries = list(record.get("runs", []))
        for run in runs:
            if run.id in already or run.pgid is None:
                continue
            try:
                os.killpg(run.pgid, signal.SIGTERM)
                ok, why = True, None
            except OSError as exc:
                ok, why = False, str(exc)
            log(f"spot notice {notice}: SIGTERM to run {run.id} (group {run.pgid}): {ok}")
            entries.append(
                {"id": run.id, "pgid": run.pgid, "signalled_at": now, "ok": ok, "error": why}
            )
            signalled.append(run.id)
        if signalled or not record:
            write_json(
                self.path(INTERRUPTION_NAME),
                {
                    "schema_version": SCHEMA_VERSION,
                    "interrupted": True,
                    "noticed_at": record.get("noticed_at", now),
                    "boot_id": boot,
                    "notice": notice,
                    "runs": entries,
                },
            )
        return f"notice: {notice.get('action', '?')}", signalled

    def _report_lost(
        self,
        state: dict[str, Any],
        previous_boot: str,
        boot: str,
        runs: list[ActiveRun],
        now: float,
    ) -> list[str]:
        alive = {r.id for r in runs if "run-dir" in r.source}
        before = [r for r in state.get("active_runs", []) if isinstance(r, dict)]
        lost = []
        for r in before:
            rid = str(r.get("id"))
            status = run_state(self.config.runs_dirs, rid)
            if rid in alive or status in ("done", "failed", "preempted", "time_limit"):
                continue  # still going, or ended (and said so) before the reboot
            lost.append(
                {
                    "id": rid,
                    "pgid": r.get("pgid"),
                    "status": status,
                    "lost_at": now,
                    "previous_boot_id": previous_boot,
                    "boot_id": boot,
                }
            )
        if lost:
            doc = read_json(self.path(LOST_NAME)) or {}
            entries = [e for e in doc.get("runs", []) if isinstance(e, dict)] + lost
            write_json(
                self.path(LOST_NAME),
                {"schema_version": SCHEMA_VERSION, "updated_at": now, "runs": entries[-LOST_KEEP:]},
            )
            log(f"reboot ({previous_boot} -> {boot}): lost runs {[e['id'] for e in lost]}")
        return [str(e["id"]) for e in lost]


# --- the command line ----------------------------------------------------------------------


def log(message: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(f"{stamp} gpubot-agent: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _single(state_dir: Path, wait: bool) -> Iterator[bool]:
    """One agent per state directory (a systemd unit and a leftover supervisor, say)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            log("another agent holds this state directory; waiting for it to end")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError("must be a number of seconds, 0 or more")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m training.agent",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog=(
            "examples:\n"
            "  python -m training.agent --stop-command 'sudo -n shutdown -h now'\n"
            "  python -m training.agent --once --stop-command '' --imds-endpoint none\n"
            "files: see the module docstring (training/agent.py)."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help="heartbeat, lease, reports")
    parser.add_argument(
        "--runs-dir",
        action="append",
        default=None,
        help=f"where run directories live; repeatable (default {DEFAULT_RUNS_DIR})",
    )
    parser.add_argument("--lease-file", help="the bot's lease (default STATE_DIR/lease.json)")
    parser.add_argument("--interval", type=_seconds, default=15.0, help="seconds between checks")
    parser.add_argument("--idle", type=_seconds, default=1800.0, help="idle seconds before a stop")
    parser.add_argument("--lease", type=_seconds, default=900.0, help="lease seconds before a stop")
    parser.add_argument(
        "--stop-command",
        default=DEFAULT_STOP_COMMAND,
        help=f"shell command that stops the host (default {DEFAULT_STOP_COMMAND!r}; '' = never)",
    )
    parser.add_argument(
        "--imds-endpoint",
        default=DEFAULT_IMDS,
        help=f"instance metadata service (default {DEFAULT_IMDS}; 'none' = no spot watch)",
    )
    parser.add_argument("--gpu-util-pct", type=int, default=5, help="GPU busy at this util")
    parser.add_argument(
        "--now-file", default=os.environ.get(ENV_NOW_FILE), help="file holding 'now' (tests)"
    )
    parser.add_argument(
        "--boot-id-file",
        default=os.environ.get(ENV_BOOT_ID_FILE, DEFAULT_BOOT_ID_FILE),
        help="where the boot id is read",
    )
    parser.add_argument("--telemetry-file", help="a telemetry snapshot to use instead of a probe")
    parser.add_argument("--once", action="store_true", help="one check, then exit")
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    state_dir = Path(args.state_dir).expanduser()
    runs = args.runs_dir or [DEFAULT_RUNS_DIR]
    endpoint = args.imds_endpoint
    return Config(
        state_dir=state_dir,
        runs_dirs=tuple(Path(r).expanduser() for r in runs),
        lease_file=Path(args.lease_file).expanduser()
        if args.lease_file
        else state_dir / LEASE_NAME,
        idle_s=args.idle,
        lease_s=args.lease,
        stop_command=args.stop_command.strip() or None,
        imds_endpoint=None if endpoint in ("", "none") else endpoint,
        gpu_util_pct=args.gpu_util_pct,
        now_file=Path(args.now_file) if args.now_file else None,
        boot_id_file=Path(args.boot_id_file),
        telemetry_file=Path(args.telemetry_file) if args.telemetry_file else None,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    agent = Agent(config)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    with _single(config.state_dir, wait=not args.once) as got:
        if not got:
            print("another agent is running with this state directory", file=sys.stderr)
            return 3
        if not args.once:
            log(f"v{AGENT_VERSION} watching (pid {os.getpid()}, state {config.state_dir})")
        while True:
            try:
                outcome = agent.step()
            except Exception as exc:  # one bad iteration (a full disk) must not end the guard
                if args.once:
                    raise
                log(f"check failed: {exc!r}")
            else:
                if args.once:
                    print(json.dumps(asdict(outcome), sort_keys=True))
                    return 0
            deadline = time.monotonic() + args.interval
            while not stop and time.monotonic() < deadline:
                time.sleep(min(0.5, args.interval))
            if stop:
                log("SIGTERM: exiting")
                return 0


if __name__ == "__main__":
    sys.exit(main())
