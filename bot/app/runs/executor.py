"""The run executor: where a claimed run's processes live, as dispatch and poll see them.

Dispatch decides and claims (bot.app.runs.dispatch), poll reads and ends
(bot.app.runs.poll); neither knows whether a run is a process group on a host the bot
reaches over SSH or a batch job on a cluster scheduler. They ask the executor, which each
provider supplies: `ProcessExecutor` (bot.app.runs.processes) for hosts the bot places
runs on itself (this machine, SSH hosts, cloud instances), a cluster's executor for a
scheduler that places them (Slurm, bot.providers.slurm).

A run's `placement` (the row's JSON) is the executor's to read and extend: the paths of
its status, log and checkpoints, which every executor keeps, and the handle of what runs
(a process group, a job id), which only it reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from bot.app.ports import PlaceRequest
from db.models import TrainingRun
from provisioning.hostshell import HostShell
from provisioning.ssh import SshTarget
from training.status import RunStatus

# Puts a run's code where it starts (bot.app.hosts.sources through dispatch): (runner, target,
# run dir, log path). Raises SshError saying why it could not.
PrepareCode = Callable[[HostShell, SshTarget, str, str], None]


class Unavailable(Exception):
    """The place does not answer now (a cluster's controller is down): nothing was
    started, and the run waits in line for the next try."""


class StartFailed(Exception):
    """A run could not start (the message says why); `host`: the host of the node that
    could not, for a run over several ("" for one)."""

    def __init__(self, cause: Exception, host: str = "") -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.host = host


@dataclass(frozen=True)
class Look:
    """One look at a run that was started: whether it still runs, and its status."""

    # Its process (node 0 of a run over several hosts) or job is still there.
    alive: bool
    # Its status document (node 0's, which holds rank 0): None before its first write.
    status: RunStatus | None
    # A cluster's run that its scheduler has not started yet: why, in the cluster's words
    # with its expected start ("pending: Resources, expected 15:20 UTC"); None otherwise.
    waiting: str | None = None
    # ... and when its scheduler expects to start it, where it says (Slurm's estimate).
    expected_start: datetime | None = None
    # A cluster's run that its scheduler started: each node and the GPU indexes it holds
    # there, so its GPUs are metered from then (empty for an executor gpubot places for).
    where: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # What a GPU-hour of it costs where its place prices the use itself (a cluster's
    # rate for the model); None where the host's own price is shared.
    usd_per_gpu_hour: float | None = None
    # When the cluster started it, by its own clock (what its GPUs are metered from);
    # None: when the bot saw it start.
    started_at: datetime | None = None
    # How the place ended it, in its words, where that was not the run's own finish (a
    # cluster's TIMEOUT, OUT_OF_MEMORY, NODE_FAIL, a cancel by an admin; an interpreter
    # that could not start): said in the result, and as the error when the run wrote none.
    ended: str | None = None


class RunExecutor(Protocol):
    """Starting, looking at, stopping and reading the runs of one kind of place."""

    # Whether the place's own scheduler places runs (a cluster): dispatch then hands it
    # every queued run as it comes, without GPUs, and its look says where it runs once it
    # does; otherwise gpubot's scheduler places runs on hosts and `start` gets its claim.
    places: bool

    def admit(self, request: PlaceRequest) -> str | None:
        """Checks a run before it is put in line: raises UserError when the place will
        not take it as asked (the person is not allowed there, no partition allows it);
        returns a note for the reply (the time limit it will get), or None."""
        ...

    def runs_dir(self, host: str) -> Path | None:
        """Where runs on `host` keep their directories; None when it cannot be reached now."""
        ...

    def address(self, host: str) -> str:
        """The address node 0 of a run over several hosts listens on (the rendezvous)."""
        ...

    def start(
        self, run: TrainingRun, placement: dict[str, Any], code: PrepareCode
    ) -> dict[str, Any]:
        """Starts the claimed run (every node); returns what its placement gains (the
        handles of what now runs). On failure nothing it started is left running, and
        the exception says why."""
        ...

    def stop_started(self, placement: dict[str, Any]) -> None:
        """Kills what `start` started (its handles merged into `placement`): a start that
        is no longer its claim's must not go on."""
        ...

    def started(self, placement: dict[str, Any]) -> bool:
        """Whether the placement records something started (a handle)."""
        ...

    def orphan(self, placement: dict[str, Any]) -> dict[str, Any] | bool | None:
        """A run claimed by a worker that died before recording its start: the handles
        it had started (to adopt), None when it never started, False when the place
        cannot be asked now."""
        ...

    def look(self, placement: dict[str, Any]) -> Look:
        """Whether it runs and what its status says; raises SshError when it cannot be
        asked now."""
        ...

    def failed_node(self, placement: dict[str, Any]) -> str | None:
        """Why a node of a run over several hosts other than node 0 ended without
        finishing, or None."""
        ...

    def signal(self, placement: dict[str, Any], signal: str, *, others_only: bool = False) -> None:
        """Sends `signal` to every node of the run (or to every node but node 0), as far
        as they can be reached; raises SshError when node 0's cannot be."""
        ...

    def tail(self, placement: dict[str, Any], lines: int) -> str:
        """The last lines of its log; raises SshError when it cannot be read now."""
        ...

    def save_checkpoint(self, placement: dict[str, Any], local: Path) -> int:
        """Copies its checkpoint directory into `local`; returns how many files."""
        ...

    def forget_attempt(self, placement: dict[str, Any]) -> None:
        """Removes what would make its next start's status be read as this one's."""
        ...

    def tend(self, records: Any) -> None:
        """Its own upkeep before each poll (hosts with agents: their leases and reports,
        bot.app.hosts.agentwatch, given the `WatchedRuns` there); never raises."""
        ...

    def watch(self, run_id: int, placement: dict[str, Any], figures_due: bool) -> None:
        """Watches the started run for its end, which asks for a tick; `figures_due`:
        its first figures are still to come, and hurried the same way."""
        ...

    def keep_watching(self, run_ids: Iterable[int]) -> None:
        """Stops watching every run but these (the poll's running ones)."""
        ...

    def ended_at(self, run_id: int, placement: dict[str, Any]) -> datetime | None:
        """When its end was seen (the bot's clock), or None."""
        ...

    def free_mb(self, placement: dict[str, Any]) -> float | None:
        """Free megabytes on the disk where the run's directory is (node 0's host), read
        when a run ends failed (bot.app.hosts.room); None where the place cannot tell or
        keeps its disks itself (a cluster). Raises SshError when it cannot be asked."""
        ...

    def watched(self, run_id: int, placement: dict[str, Any]) -> bool:
        """Whether a watcher is waiting on the run's end now, and will ask for a tick when
        it ends: the poll may then read its status less often than every tick
        (bot.app.runs.poll's look budget). False where nothing watches it that way."""
        ...


@runtime_checkable
class GroupStarts(Protocol):
    """An executor that starts runs of one sweep as one thing (a Slurm job array): one
    submission, one throttle, one cancel, where a run at a time would be N of each."""

    def start_group(
        self,
        runs: Sequence[TrainingRun],
        placements: Sequence[dict[str, Any]],
        code: Callable[[int], PrepareCode],
    ) -> list[dict[str, Any]] | None:
        """Starts the claimed runs together; each one's placement gains the matching
        dict (as `start`). None: not as a group (the dispatcher starts each alone).
        Raises as `start` does, for all of them."""
        ...


@runtime_checkable
class GroupSignals(Protocol):
    """An executor that signals runs started together (`GroupStarts`) in one call."""

    def signal_group(self, placements: Sequence[dict[str, Any]], signal: str) -> bool:
        """Signals the runs of `placements`, every open run of one group, as `signal`
        does each; False when they are not one group (the caller signals each)."""
        ...
