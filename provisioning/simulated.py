"""A cloud that runs on a virtual clock: launches, boots, stops, quotas and the bill.

It exists so the scheduler can be measured (`gpubot simulate`) and tested against the
same lifecycle EC2 has, without money or minutes. The rules it bills by are the ones
`tests/sim_checker.py` recomputes independently:

* A launched instance is billed from launch (boot time is paid, as on EC2) and is usable
  `boot_s + setup_s` later (the bootstrap runs only on a fresh instance).
* A stopped instance is billed for its volume only: `ebs_gb * ebs_usd_gb_month` per month,
  prorated per second with a month of 730 hours (AWS's own convention for monthly rates).
* A restarted instance is billed again from the start and usable `start_s` later.
* Each running interval (launch or start to stop or terminate) is billed per second with
  a minimum of `min_bill_s` (60 s): the EC2 rule for Linux on-demand and spot.
* The quota counts the GPUs of every instance that is not stopped or terminated; a
  launch or start that would pass it raises `QuotaExceeded`, as EC2's vCPU limits do.

The clock only moves forward (`advance_to`). Nothing here knows about jobs; the caller
decides what runs where.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from provisioning.catalog import Catalog, InstanceType
from provisioning.costs import DEFAULT_COSTS, CloudCosts

SimMarket = Literal["ondemand", "spot"]
SimState = Literal["pending", "running", "stopped", "terminated"]


class QuotaExceeded(RuntimeError):
    """The launch or start would run more GPUs at once than the quota allows."""


class UnknownInstance(KeyError):
    """No such instance id, or the operation does not apply in its state."""


@dataclass
class _Inst:
    instance_id: str
    itype: InstanceType
    market: SimMarket
    usd_hr: float
    launch_s: float
    ready_s: float  # first time usable
    usable_at: float  # usable from (after the latest launch or start)
    state: SimState = "pending"
    run_since: float = 0.0  # start of the current running interval
    end_s: float | None = None
    stopped: list[tuple[float, float | None]] = field(default_factory=list)
    billed_usd: float = 0.0  # closed intervals


@dataclass(frozen=True)
class InstanceRecord:
    """One instance's life, as `--instances-out` writes it."""

    instance_id: str
    instance_type: str
    market: SimMarket
    gpus: int
    launch_s: float  # launch request time; billing starts here
    ready_s: float  # first time usable for work
    end_s: float | None  # termination time, None while alive
    stopped: tuple[tuple[float, float], ...]  # closed stopped intervals (open one ends at now)
    usd: float  # bill so far


class SimulatedCloud:
    """In-memory provider with a virtual clock; ids are ``sim-000001`` in launch order."""

    def __init__(
        self,
        catalog: Catalog,
        *,
        max_gpus: int = 256,
        boot_s: float = DEFAULT_COSTS.boot_s,
        setup_s: float = DEFAULT_COSTS.setup_s,
        start_s: float = DEFAULT_COSTS.start_s,
        ebs_gb: float = DEFAULT_COSTS.ebs_gb,
        ebs_usd_gb_month: float = DEFAULT_COSTS.ebs_usd_gb_month,
        min_bill_s: float = DEFAULT_COSTS.min_bill_s,
        now: float = 0.0,
    ) -> None:
        for name, v in (
            ("boot_s", boot_s),
            ("setup_s", setup_s),
            ("start_s", start_s),
            ("ebs_gb", ebs_gb),
            ("ebs_usd_gb_month", ebs_usd_gb_month),
            ("min_bill_s", min_bill_s),
        ):
            if v < 0:
                raise ValueError(f"{name} must be >= 0")
        if max_gpus < 1:
            raise ValueError("max_gpus must be >= 1")
        self.catalog = catalog
        self.max_gpus = max_gpus
        self.costs = CloudCosts(boot_s, setup_s, start_s, min_bill_s, ebs_gb, ebs_usd_gb_month)
        self.boot_s = boot_s
        self.setup_s = setup_s
        self.start_s = start_s
        self.min_bill_s = min_bill_s
        self.ebs_usd_s = self.costs.storage_usd_per_s
        self.now = now
        self._insts: dict[str, _Inst] = {}
        self._running_gpus = 0

    # -- clock
    def advance_to(self, t: float) -> None:
        if t < self.now:
            raise ValueError(f"the clock does not go back ({t} < {self.now})")
        self.now = t

    # -- lifecycle
    def launch(self, instance_type: str, market: SimMarket = "ondemand") -> str:
        itype = self.catalog.get(instance_type)
        if itype is None:
            raise UnknownInstance(f"unknown instance type {instance_type}")
        if market == "spot" and itype.spot_usd_hr is None:
            raise ValueError(f"{instance_type} has no spot price")
        self._take_quota(itype.gpus)
        iid = f"sim-{len(self._insts) + 1:06d}"
        usd = itype.hourly(market)
        ready = self.now + self.boot_s + self.setup_s
        self._insts[iid] = _Inst(
            iid, itype, market, usd, self.now, ready, ready, run_since=self.now
        )
        return iid

    def stop(self, instance_id: str) -> None:
        inst = self._get(instance_id, ("pending", "running"))
        self._close_running(inst)
        inst.state = "stopped"
        inst.stopped.append((self.now, None))
        self._running_gpus -= inst.itype.gpus

    def start(self, instance_id: str) -> float:
        """Restarts a stopped instance; returns when it is usable."""
        inst = self._get(instance_id, ("stopped",))
        self._take_quota(inst.itype.gpus)
        a, _ = inst.stopped[-1]
        inst.stopped[-1] = (a, self.now)
        inst.billed_usd += (self.now - a) * self.ebs_usd_s
        inst.state = "pending"
        inst.run_since = self.now
        inst.usable_at = self.now + self.start_s
        return inst.usable_at

    def terminate(self, instance_id: str) -> None:
        inst = self._get(instance_id, ("pending", "running", "stopped"))
        if inst.state == "stopped":
            a, _ = inst.stopped[-1]
            inst.stopped[-1] = (a, self.now)
            inst.billed_usd += (self.now - a) * self.ebs_usd_s
        else:
            self._close_running(inst)
            self._running_gpus -= inst.itype.gpus
        inst.state = "terminated"
        inst.end_s = self.now

    def interrupt(self, instance_id: str) -> None:
        """A spot reclaim: the instance is gone now; what ran on it must resume elsewhere."""
        inst = self._get(instance_id, ("pending", "running"))
        if inst.market != "spot":
            raise ValueError(f"{instance_id} is not a spot instance")
        self.terminate(instance_id)

    # -- queries
    def usable_at(self, instance_id: str) -> float:
        """When work can start on it (its latest launch or restart plus the delay)."""
        inst = self._get(instance_id, ("pending", "running"))
        return inst.usable_at

    def mark_ready(self, instance_id: str) -> None:
        """Moves a pending instance to running once the clock reached its ready time."""
        inst = self._get(instance_id, ("pending", "running"))
        if self.now < inst.usable_at:
            raise ValueError(f"{instance_id} is not ready before {inst.usable_at}")
        inst.state = "running"

    def state(self, instance_id: str) -> SimState:
        return self._insts[instance_id].state

    @property
    def running_gpus(self) -> int:
        return self._running_gpus

    def cost(self, instance_id: str) -> float:
        """Its bill up to now, open intervals included."""
        inst = self._insts[instance_id]
        usd = inst.billed_usd
        if inst.state in ("pending", "running"):
            usd += max(self.now - inst.run_since, self.min_bill_s) * inst.usd_hr / 3600.0
        elif inst.state == "stopped":
            usd += (self.now - inst.stopped[-1][0]) * self.ebs_usd_s
        return usd

    def total_cost(self) -> float:
        return sum(self.cost(i) for i in self._insts)

    def records(self) -> list[InstanceRecord]:
        out = []
        for inst in self._insts.values():
            stopped = tuple((a, self.now if b is None else b) for a, b in inst.stopped)
            out.append(
                InstanceRecord(
                    inst.instance_id,
                    inst.itype.instance_type,
                    inst.market,
                    inst.itype.gpus,
                    inst.launch_s,
                    inst.ready_s,
                    inst.end_s,
                    stopped,
                    self.cost(inst.instance_id),
                )
            )
        return out

    # -- internals
    def _take_quota(self, gpus: int) -> None:
        if self._running_gpus + gpus > self.max_gpus:
            raise QuotaExceeded(
                f"{gpus} more GPUs would pass the quota of {self.max_gpus} "
                f"({self._running_gpus} running)"
            )
        self._running_gpus += gpus

    def _close_running(self, inst: _Inst) -> None:
        dur = max(self.now - inst.run_since, self.min_bill_s)
        inst.billed_usd += dur * inst.usd_hr / 3600.0

    def _get(self, instance_id: str, states: tuple[SimState, ...]) -> _Inst:
        inst = self._insts.get(instance_id)
        if inst is None:
            raise UnknownInstance(f"no instance {instance_id}")
        if inst.state not in states:
            raise UnknownInstance(f"{instance_id} is {inst.state}, expected {' or '.join(states)}")
        return inst
