"""Runs as process groups on hosts: the run executor of the places gpubot schedules itself.

This machine, the team's SSH hosts and the cloud instances the fleet launched all run a
run the same way: `python -m training.runner` started detached on each of its hosts
(node 0's address is a run's rendezvous when it spans several), its process-group id
recorded in its placement, its status file read and its group signalled through the
host's seat (bot.app.ports.HostAccess). Everything that knows a run is a process group
is here; dispatch and poll talk to the `RunExecutor` (bot.app.runs.executor).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from bot.app.hosts import room
from bot.app.hosts.agentwatch import (
    Leases,
    download_checkpoints,
    upload_checkpoints,
    watch_hosts,
)
from bot.app.ports import HostAccess, HostSeat, PlaceRequest, refuse_place_options
from bot.app.runs.command import runner_command
from bot.app.runs.executor import Look, PrepareCode, StartFailed
from bot.app.runs.watch import ExitWatchers
from bot.domain.clock import Clock
from db.models import TrainingRun
from provisioning import shell
from provisioning.ssh import SshError
from training.status import parse_status

log = logging.getLogger(__name__)


def nodes_of(placement: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node's part of the placement: node 0's is the placement itself for a run on
    one host, the first of "nodes" for a run over several."""
    return list(placement.get("nodes") or [placement])


class ProcessExecutor:
    """`RunExecutor` over a `HostAccess`: process groups started, read and signalled
    through each host's seat. `agents`: the providers whose hosts run the host agent
    (training.agent: their leases and reports are tended before each poll)."""

    places = False  # gpubot's scheduler places runs on these hosts

    def admit(self, request: PlaceRequest) -> str | None:
        return refuse_place_options(request)

    def __init__(
        self,
        access: HostAccess,
        clock: Clock,
        nudge: Callable[[], None],
        *,
        agents: Collection[str] = (),
    ) -> None:
        self.access = access
        self.agents = agents
        self.watchers = ExitWatchers(access, clock, nudge)
        self.leases = Leases()

    # --- where runs go ------------------------------------------------------------------

    def runs_dir(self, host: str) -> Path | None:
        seat = self.access.runner_for(host)
        return seat.runs_dir if seat is not None else None

    def address(self, host: str) -> str:
        seat = self.access.runner_for(host)
        if seat is None:
            raise SshError(f"{host} cannot be reached now")
        return seat.target.host

    # --- starting -----------------------------------------------------------------------

    def start(
        self, run: TrainingRun, placement: dict[str, Any], code: PrepareCode
    ) -> dict[str, Any]:
        nodes = nodes_of(placement)
        endpoint: str | None = placement.get("rdzv")
        seats: list[HostSeat] = []
        for node in nodes:
            seat = self.access.runner_for(str(node["host"]))
            if seat is None:
                raise SshError(f"{node['host']} cannot be reached now")
            seats.append(seat)
        pgids: list[int] = []
        try:
            for rank, (seat, node) in enumerate(zip(seats, nodes, strict=True)):
                across = (len(nodes), rank, endpoint) if endpoint is not None else None
                pgids.append(self._start_node(run, seat, node, across, code))
        except Exception as exc:
            # One run: a node that could not start ends the nodes already started.
            _kill(seats, pgids)
            host = str(nodes[len(pgids)]["host"]) if len(nodes) > 1 else ""
            raise StartFailed(exc, host) from exc
        changes: dict[str, Any] = {"pgid": pgids[0]}
        if "nodes" in placement:
            changes["nodes"] = [
                {**node, "pgid": pgid} for node, pgid in zip(nodes, pgids, strict=True)
            ]
        return changes

    def _start_node(
        self,
        run: TrainingRun,
        seat: HostSeat,
        node: dict[str, Any],
        across: tuple[int, int, str] | None,
        code: PrepareCode,
    ) -> int:
        """One host's part of the run started detached; returns its process-group id."""
        runner, target = seat.runner, seat.target
        run_dir = node["dir"]
        env = {
            "CUDA_VISIBLE_DEVICES": "" if node["cpu"] else ",".join(map(str, node["gpu_indexes"])),
        }
        runner.run(target, shell.join(["mkdir", "-p", "--", str(run_dir)]), timeout=30)
        resume = run.placement.get("resume_from")
        if resume:  # the checkpoint it resumes from, first: every node loads it
            upload_checkpoints(runner, target, resume, str(node["checkpoints"]))
        # Code source (bot.app.hosts.sources): clone / check / upload, before the runner starts.
        code(runner, target, str(run_dir), str(node["log"]))
        # The host's interpreter last: the run account's is prepared here on first use.
        python = seat.interpreter()
        return runner.start_detached(
            target,
            runner_command(run, node, python.python, across=across),
            str(node["log"]),
            cwd=str(run_dir),
            env={**env, **python.env()},
            # The launcher writes the group id there before it answers, so a run started
            # by a worker that died before recording it is found, not started twice
            # (`orphan`), even while the runner itself is still starting.
            pid_file=str(node["pgid_file"]),
        )

    def stop_started(self, placement: dict[str, Any]) -> None:
        self._signal_nodes(nodes_of(placement), "KILL")

    def started(self, placement: dict[str, Any]) -> bool:
        return "pgid" in placement

    def orphan(self, placement: dict[str, Any]) -> dict[str, Any] | bool | None:
        started = self._pgid_written(placement)
        if started is False or started is None:
            return started
        nodes = list(placement.get("nodes") or [])
        if not nodes:
            return {"pgid": started}
        # A run over several hosts is adopted whole or not at all: every node's group.
        pgids: list[int | None] = [started]
        for node in nodes[1:]:
            found = self._pgid_written(node)
            if found is False:
                return False  # ask again next poll
            pgids.append(found if isinstance(found, int) else None)
        if any(pgid is None for pgid in pgids):
            # Some node never started, so the rest cannot finish: stop them.
            for node, pgid in zip(nodes, pgids, strict=True):
                seat = self.access.runner_for(str(node.get("host", "")))
                if pgid is not None and seat is not None:
                    with contextlib.suppress(SshError):
                        seat.runner.kill_group(seat.target, pgid, "KILL")
            return None
        return {
            "pgid": started,
            "nodes": [{**n, "pgid": pgid} for n, pgid in zip(nodes, pgids, strict=True)],
        }

    def _pgid_written(self, placement: dict[str, Any]) -> int | bool | None:
        """The group id the runner wrote when the worker that claimed the run died after
        launching it; None when it never launched; False when the host cannot say now."""
        path = placement.get("pgid_file")
        seat = self.access.runner_for(str(placement.get("host", "")))
        if not path or seat is None:
            return None
        try:
            raw = seat.runner.read_file(seat.target, str(path), max_bytes=64)
        except SshError as exc:
            log.warning("cannot check whether run on %s started: %s", placement["host"], exc)
            return False
        text = (raw or b"").decode(errors="replace").strip()
        return int(text) if text.isdigit() else None

    # --- looking and stopping -----------------------------------------------------------

    def _seat(self, placement: dict[str, Any]) -> HostSeat:
        seat = self.access.runner_for(str(placement.get("host", "")))
        if seat is None:
            raise SshError(f"{placement.get('host')} cannot be reached now")
        return seat

    def look(self, placement: dict[str, Any]) -> Look:
        seat = self._seat(placement)
        # Alive first, then the status: a process seen gone wrote its last status before
        # it went, so what is read after is final. Read the other way round, a run that
        # ended between the two reads looked like one that died without a final status,
        # and was failed instead of finished.
        alive = seat.runner.is_alive(seat.target, int(placement["pgid"]))
        raw = seat.runner.read_file(seat.target, placement["status"])
        self.watchers.read(str(placement.get("host", "")), int(placement["pgid"]))
        status = parse_status(raw.decode("utf-8", "replace")) if raw else None
        return Look(alive=alive, status=status)

    def failed_node(self, placement: dict[str, Any]) -> str | None:
        """Node 1 may exit a moment before node 0 writes the result: a node that finished
        well is not a failure. A host that cannot be asked now is asked next poll."""
        for rank, node in enumerate(nodes_of(placement)[1:], start=1):
            seat = self.access.runner_for(str(node.get("host", "")))
            if seat is None or "pgid" not in node:
                continue
            try:
                if seat.runner.is_alive(seat.target, int(node["pgid"])):
                    continue
                raw = seat.runner.read_file(seat.target, node["status"])
            except SshError as exc:
                log.warning("poll of node %s on %s failed: %s", rank, node["host"], exc)
                continue
            status = parse_status(raw.decode("utf-8", "replace")) if raw else None
            if status is not None and status.state == "done":
                continue
            why = (status.error if status is not None else None) or (
                f"exit code {status.exit_code}"
                if status is not None and status.exit_code is not None
                else "it ended without writing a final status"
            )
            return f"node {rank} on {node['host']} failed: {why}"
        return None

    def signal(self, placement: dict[str, Any], signal: str, *, others_only: bool = False) -> None:
        failed: SshError | None = None
        if not others_only:
            try:
                seat = self._seat(placement)
                seat.runner.kill_group(seat.target, int(placement["pgid"]), signal)
            except SshError as exc:
                failed = exc  # the other nodes are told all the same
        self._signal_nodes(nodes_of(placement)[1:], signal)
        if failed is not None:
            raise failed

    def _signal_nodes(self, nodes: list[dict[str, Any]], signal: str) -> None:
        """Signals the process group of each of these nodes that still runs."""
        for node in nodes:
            seat = self.access.runner_for(str(node.get("host", "")))
            if seat is None or "pgid" not in node:
                continue
            try:
                seat.runner.kill_group(seat.target, int(node["pgid"]), signal)
            except SshError as exc:
                log.warning("could not signal a node on %s: %s", node["host"], exc)

    def tail(self, placement: dict[str, Any], lines: int) -> str:
        seat = self._seat(placement)
        return seat.runner.tail(seat.target, placement["log"], lines)

    def save_checkpoint(self, placement: dict[str, Any], local: Path) -> int:
        if not placement.get("checkpoints"):
            return 0
        seat = self._seat(placement)
        return download_checkpoints(seat.runner, seat.target, str(placement["checkpoints"]), local)

    def forget_attempt(self, placement: dict[str, Any]) -> None:
        seat = self.access.runner_for(str(placement.get("host", "")))
        if seat is None:
            return
        old = [placement.get("status"), placement.get("pgid_file")]
        with contextlib.suppress(SshError):
            line = shell.join(["rm", "-f", "--", *(str(p) for p in old if p)])
            seat.runner.run(seat.target, line, timeout=30)

    # --- watching -----------------------------------------------------------------------

    def tend(self, records: Any) -> None:
        if not self.agents:
            return
        try:
            watched = watch_hosts(records, self.agents, self.leases)
            if watched.interrupted or watched.requeued or watched.draining:
                log.info("host agents: %s", watched)
        except Exception:  # never fatal: the runs are still polled
            log.exception("host agent watch failed")

    def watch(self, run_id: int, placement: dict[str, Any], figures_due: bool) -> None:
        for rank, node in enumerate(nodes_of(placement)):
            if "pgid" not in node or "host" not in node:
                continue
            status = str(node["status"]) if rank == 0 and figures_due else None
            self.watchers.ensure(run_id, str(node["host"]), int(node["pgid"]), status)

    def keep_watching(self, run_ids: Iterable[int]) -> None:
        self.watchers.keep_only(run_ids)

    def free_mb(self, placement: dict[str, Any]) -> float | None:
        seat = self._seat(placement)
        return room.free_mb(seat.runner, seat.target, str(placement.get("dir") or seat.runs_dir))

    def watched(self, run_id: int, placement: dict[str, Any]) -> bool:
        # One watcher per node; a run over several hosts is looked at every tick (its
        # other nodes' ends are read there, `failed_node`).
        if "pgid" not in placement or placement.get("nodes"):
            return False
        return self.watchers.waiting(run_id, str(placement["host"]), int(placement["pgid"]))

    def ended_at(self, run_id: int, placement: dict[str, Any]) -> datetime | None:
        if "pgid" not in placement:
            return None
        return self.watchers.exited_at(run_id, str(placement["host"]), int(placement["pgid"]))


def _kill(seats: list[HostSeat], pgids: list[int]) -> None:
    """The nodes of a start that must not go on, killed as far as SSH reaches them."""
    for seat, pgid in zip(seats, pgids, strict=False):
        with contextlib.suppress(SshError):
            seat.runner.kill_group(seat.target, pgid, "KILL")
