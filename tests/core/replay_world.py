"""The world the replay test drives the real worker in: a cloud and a runner on the
test's virtual clock, each recording what the worker did to it and when.

Why doubles here and not moto and sshd: the replay compares *when* things happen to the
simulator's schedule, to the tick, over hours of virtual time; a real boot, a real
process and a real SSH round trip run on the wall clock. Both doubles keep the shapes
production speaks (`RentingCompute`, `HostShell`, the runner's status file, its
checkpoint directory), so every line of the worker between them is the real one:
the scheduler's inputs, dispatch's claim, poll's reading of the status file, the
checkpoint copied off and uploaded again, the fleet's launch, readiness and idle stop.

- `ReplayCloud`: instances that are usable `boot_s + setup_s` after a launch and
  `start_s` after a restart (the bootstrap's time is folded into the cloud's boot: the
  test's `prepare` is instantaneous), named ``sim-000001`` … in launch order as
  `provisioning.simulated.SimulatedCloud` names them, so both logs name the same ids.
- `ReplayRunner`: `python -m training.runner` as the worker sees it, without a process:
  a run ends `work` seconds after it starts (its trace duration, less what an uploaded
  checkpoint saved, plus `resume_s` when it resumes), and its status file then says
  done; on SIGTERM it saves its progress to its checkpoint directory at once (as the
  recipes do on the signal) and exits 75 `exit_s` later with state ``preempted``.
  Files live in memory per host; a shell line it does not know is recorded in
  `unknown`, which the test asserts empty (the worker must not have asked for more).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import posixpath
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bot.domain.clock import VirtualClock
from provisioning.base import GpuDevice, Instance, ProvisioningError
from provisioning.catalog import Catalog
from provisioning.compute import LaunchSpec
from provisioning.manifest import remote_manifest_command_line
from provisioning.ssh import RunResult, SshTarget, UploadReport
from training.exitcodes import EXIT_PREEMPTED
from training.status import RunStatus

# One action the worker took on the world: (seconds since the trace's start, kind, what).
Action = tuple[float, str, str]


@dataclass
class _Machine:
    instance_id: str
    instance_type: str
    gpus: int
    model: str
    usd_hr: float
    market: str
    request_key: str
    usable_at: float
    state: str = "pending"  # pending (booting) | stopped | terminated; ready = usable


class ReplayCloud:
    """A `RentingCompute` on the virtual clock (see the module docstring)."""

    name = "sim"

    def __init__(
        self,
        catalog: Catalog,
        clock: VirtualClock,
        t0: float,
        *,
        boot_s: float,
        setup_s: float,
        start_s: float,
    ) -> None:
        self.catalog = catalog
        self.clock = clock
        self.t0 = t0
        self.boot_s, self.setup_s, self.start_s = boot_s, setup_s, start_s
        self.machines: dict[str, _Machine] = {}
        self.log: list[Action] = []

    def _now(self) -> float:
        return self.clock.now().timestamp() - self.t0

    def _instance(self, m: _Machine) -> Instance:
        state = m.state
        if state == "pending" and self._now() >= m.usable_at:
            state = "ready"
        return Instance(
            name=m.instance_id,
            provider=self.name,
            state=state,
            gpus=tuple(GpuDevice(index=i, model=m.model, memory_gb=40.0) for i in range(m.gpus)),
            instance_id=m.instance_id,
            instance_type=m.instance_type,
            market=m.market,
            hourly_usd=m.usd_hr,
            address=f"{m.instance_id}.replay.invalid",  # never dialled: ReplayRunner
            ssh_user="ubuntu",
            tags={"gpubot:managed": "1", "gpubot:request": m.request_key},
        )

    def list_instances(self) -> list[Instance]:
        return [self._instance(m) for m in self.machines.values() if m.state != "terminated"]

    def launch(self, spec: LaunchSpec) -> Instance:
        for m in self.machines.values():
            if m.request_key == spec.request_key:
                return self._instance(m)
        names = spec.instance_types or tuple(
            t.instance_type for t in self.catalog.for_model(spec.gpu_model) if t.gpus >= spec.gpus
        )
        types = [t for t in (self.catalog.get(n) for n in names) if t is not None]
        if not types:
            raise ProvisioningError(f"no instance type offers {spec.gpus} {spec.gpu_model}")
        t = min(types, key=lambda t: (t.hourly(spec.market), t.instance_type))
        iid = f"sim-{len(self.machines) + 1:06d}"
        now = self._now()
        self.machines[iid] = _Machine(
            iid,
            t.instance_type,
            t.gpus,
            t.gpu_model,
            t.hourly(spec.market),
            spec.market,
            spec.request_key,
            now + self.boot_s + self.setup_s,
        )
        self.log.append((now, "launch", f"{iid} {t.instance_type}"))
        return self._instance(self.machines[iid])

    def find_by_request_key(self, request_key: str) -> Instance | None:
        for m in self.machines.values():
            if m.request_key == request_key:
                return self._instance(m)
        return None

    def get(self, instance_id: str) -> Instance | None:
        m = self.machines.get(instance_id)
        return None if m is None else self._instance(m)

    def _get(self, instance_id: str, *states: str) -> _Machine:
        m = self.machines.get(instance_id)
        if m is None or m.state not in states:
            raise ProvisioningError(f"{instance_id} is not {' or '.join(states)}")
        return m

    def start(self, instance_id: str) -> Instance:
        m = self._get(instance_id, "stopped")
        m.state, m.usable_at = "pending", self._now() + self.start_s
        self.log.append((self._now(), "restart", instance_id))
        return self._instance(m)

    def stop(self, instance_id: str) -> Instance:
        m = self._get(instance_id, "pending")
        m.state = "stopped"
        self.log.append((self._now(), "stop", instance_id))
        return self._instance(m)

    def terminate(self, instance_id: str) -> Instance:
        m = self._get(instance_id, "pending", "stopped")
        m.state = "terminated"
        self.log.append((self._now(), "terminate", instance_id))
        return self._instance(m)


@dataclass
class _Process:
    run_id: str
    host: str
    status_path: str
    checkpoint_dir: str
    started: float
    overhead: float  # resume_s on a resumed start, else 0
    saved: float  # work its uploaded checkpoint had done
    work: float  # the run's whole work (its trace duration)
    exit_at: float
    exit_code: int = 0
    signalled: bool = False
    alive: bool = True


@dataclass
class ReplayRunner:
    """An `HostShell` for the replay's hosts (see the module docstring)."""

    clock: VirtualClock
    t0: float
    work_of: Callable[[str], float]  # run id -> its trace duration, s
    resume_s: float
    exit_s: float = 5.0
    files: dict[tuple[str, str], bytes] = field(default_factory=dict)
    procs: dict[int, _Process] = field(default_factory=dict)
    log: list[Action] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)

    CHECKPOINT = "progress.json"

    def _now(self) -> float:
        return self.clock.now().timestamp() - self.t0

    def _advance(self, host: str) -> None:
        """Processes on `host` that are due end now, writing their final status."""
        now = self._now()
        for p in self.procs.values():
            if p.host == host and p.alive and now >= p.exit_at:
                p.alive = False
                state = "preempted" if p.exit_code == EXIT_PREEMPTED else "done"
                self._status(p, state, p.exit_code)

    def _status(self, p: _Process, state: str, exit_code: int | None) -> None:
        status = RunStatus(state=state, run_id=p.run_id, kind="command", exit_code=exit_code)
        if state == "preempted":
            status.checkpoint_step = 1
            status.checkpoint_path = posixpath.join(p.checkpoint_dir, self.CHECKPOINT)
        self.files[(p.host, p.status_path)] = json.dumps(dataclasses.asdict(status)).encode()

    # --- HostShell -------------------------------------------------------------------

    def run(
        self,
        target: SshTarget,
        command: str,
        timeout: float | None = None,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> RunResult:
        words = shlex.split(command) if "&&" not in command else []
        if command == "true" or words[:3] == ["mkdir", "-p", "--"]:
            return RunResult(0, "", "")
        if words[:3] == ["mv", "-f", "--"] and len(words) == 5:
            data = self.files.pop((target.name, words[3]), None)
            if data is None:
                return RunResult(1, "", "no such file")
            self.files[(target.name, words[4])] = data
            return RunResult(0, "", "")
        for p in self.procs.values():
            if p.host == target.name and command == remote_manifest_command_line(p.checkpoint_dir):
                lines = []
                prefix = p.checkpoint_dir.rstrip("/") + "/"
                for (host, path), data in sorted(self.files.items()):
                    if host == target.name and path.startswith(prefix):
                        rel = path[len(prefix) :]
                        lines.append(f"{hashlib.sha256(data).hexdigest()}  ./{rel}\n")
                return RunResult(0, "".join(lines), "")
        self.unknown.append(command)
        return RunResult(127, "", "not modelled by ReplayRunner")

    def upload_dir(
        self,
        target: SshTarget,
        local_dir: str | os.PathLike[str],
        remote_dir: str,
        *,
        exclude: Sequence[str] = (),
    ) -> UploadReport:
        sent = []
        root = Path(local_dir)
        for path in sorted(root.rglob("*")):
            if path.is_file():
                rel = path.relative_to(root).as_posix()
                self.files[(target.name, posixpath.join(remote_dir, rel))] = path.read_bytes()
                sent.append(rel)
        return UploadReport(uploaded=tuple(sent))

    def put_file(
        self,
        target: SshTarget,
        local_path: str | os.PathLike[str],
        remote_path: str,
        *,
        mode: int | None = None,
    ) -> None:
        self.files[(target.name, remote_path)] = Path(local_path).read_bytes()

    def write_file(
        self, target: SshTarget, remote_path: str, data: bytes, *, mode: int = 0o644
    ) -> None:
        self.files[(target.name, remote_path)] = data

    def read_file(
        self, target: SshTarget, path: str, *, max_bytes: int | None = None
    ) -> bytes | None:
        self._advance(target.name)
        data = self.files.get((target.name, path))
        return data if data is None or max_bytes is None else data[:max_bytes]

    def start_detached(
        self,
        target: SshTarget,
        command: str,
        log_path: str,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        pid_file: str | None = None,
    ) -> int:
        words = shlex.split(command)

        def arg(name: str) -> str:
            return words[words.index(name) + 1]

        run_id, ckpt = arg("--run-id"), arg("--checkpoint-dir")
        saved_doc = self.files.get((target.name, posixpath.join(ckpt, self.CHECKPOINT)))
        saved = float(json.loads(saved_doc)["done_s"]) if saved_doc else 0.0
        overhead = self.resume_s if saved_doc else 0.0
        now, work = self._now(), self.work_of(run_id)
        pgid = 1000 + len(self.procs)
        p = _Process(
            run_id,
            target.name,
            arg("--status-file"),
            ckpt,
            now,
            overhead,
            saved,
            work,
            exit_at=now + overhead + max(0.0, work - saved),
        )
        self.procs[pgid] = p
        if pid_file:
            self.files[(target.name, pid_file)] = f"{pgid}\n".encode()
        self._status(p, "running", None)
        self.log.append((now, "start", f"{run_id} {target.name}"))
        return pgid

    def tail(self, target: SshTarget, path: str, lines: int = 50) -> str:
        return ""

    def kill_group(self, target: SshTarget, pgid: int, signal: str = "TERM") -> bool:
        self._advance(target.name)
        p = self.procs.get(pgid)
        if p is None or not p.alive:
            return False
        now = self._now()
        if signal == "TERM" and not p.signalled:
            # The runner's handler: a checkpoint of the work done, then exit 75.
            p.signalled = True
            done = min(p.work, p.saved + max(0.0, now - p.started - p.overhead))
            path = posixpath.join(p.checkpoint_dir, self.CHECKPOINT)
            self.files[(p.host, path)] = json.dumps({"done_s": done}).encode()
            p.exit_at, p.exit_code = min(p.exit_at, now + self.exit_s), EXIT_PREEMPTED
            self.log.append((now, "preempt", p.run_id))
        elif signal == "KILL":
            p.alive = False
            self._status(p, "failed", 137)
        return True

    def is_alive(self, target: SshTarget, pid: int) -> bool:
        self._advance(target.name)
        p = self.procs.get(pid)
        return p is not None and p.alive

    def wait_gone(self, target: SshTarget, pid: int, timeout: float) -> bool:
        """Never says a process ended: its end is a virtual time the replay's clock reaches
        only between ticks, so the ticks' poll finds it, at the time the simulator does."""
        time.sleep(min(timeout, 0.5))
        return False

    def close(self, target: SshTarget | None = None) -> None:
        """Nothing is held open."""
