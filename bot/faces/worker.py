"""The periodic work: ending reservations, warning holders, granting the line,
delivering the outbox (`bot.app.delivery`). APScheduler 3 runs it on a background
thread; job functions are module-level so APScheduler could persist and restore them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from apscheduler.schedulers.background import BackgroundScheduler

from bot.adapters.leader import Leadership
from bot.adapters.metrics import TICK_SECONDS, note_tick
from bot.app import fleet
from bot.app.delivery import Notifier, deliver
from bot.app.hosts import hostcheck
from bot.app.money import digest
from bot.app.service import GpuService
from bot.app.watching import idle, utilization
from bot.domain.errors import new_ref
from bot.faces.replay import weekly_digest_job

log = logging.getLogger(__name__)


def tick_job(
    service: GpuService, notifier: Notifier | None, leader: Leadership | None = None
) -> None:
    try:
        if leader is not None and not leader.hold():
            note_tick(leading=False)
            return  # a standby: another worker leads
        tick_started = time.perf_counter()
        report = service.tick()
        if report.expired or report.warned or report.granted:
            log.info("tick: %s", report)
        if service.bursts is not None:
            # Before the poll: a job just withdrawn from a cluster's queue for the cloud
            # is back in gpubot's line before anything reads it as ended.
            for done in service.bursts.tick():
                log.info("burst: %s", done)
        finished = service.runs.poll()
        started = service.runs.dispatch()
        if finished or started:
            log.info("runs: %d finished, %d started", finished, started)
        if notifier is not None:
            deliver(service, notifier)
        TICK_SECONDS.observe(time.perf_counter() - tick_started)
        # After the work: /healthz's "last tick" is the last one that completed, and a
        # scrape that sees "leader" also sees that tick counted.
        note_tick(leading=True)
    except Exception as exc:
        log.error("ref=%s worker tick failed", new_ref(), exc_info=exc)


def locked_tick_job(
    lock: threading.Lock,
    service: GpuService,
    notifier: Notifier | None,
    leader: Leadership | None = None,
) -> None:
    """The tick under the worker's lock: an interval tick and a nudged one never overlap."""
    with lock:
        tick_job(service, notifier, leader)


@dataclass(frozen=True)
class PeriodicJob:
    """One more piece of periodic work beside the tick (sampling, reconcile, digest, …).

    `run` must be a module-level function (APScheduler can only restore those) taking
    the service; `trigger` and `trigger_args` are APScheduler's ("interval" with
    seconds=…, or "cron" with day_of_week/hour/minute/timezone).
    """

    id: str
    run: Callable[[GpuService], object]
    trigger: str
    trigger_args: dict[str, Any]


def leader_job(
    job_id: str, run: Callable[[GpuService], object], service: GpuService, leader: Leadership | None
) -> None:
    """Runs a periodic job only on the leading worker; a failure is logged with a ref and
    the next firing tries again (a job never takes the scheduler down)."""
    try:
        if leader is not None and not leader.hold():
            return
        run(service)
    except Exception as exc:
        log.error("ref=%s worker job %s failed", new_ref(), job_id, exc_info=exc)


# How often the providers' upkeep runs (a cluster re-read: at most once per its cache).
UPKEEP_EVERY_S = 5.0


def providers_job(service: GpuService) -> None:
    """Each provider's periodic upkeep (bot.providers: a cluster's nodes and holds)."""
    for upkeep in list(service.upkeep):
        upkeep()


def periodic_jobs(service: GpuService) -> list[PeriodicJob]:
    """Every periodic job besides the tick, from the settings. Each feature adds its own
    line here; its function lives in its own module."""
    jobs: list[PeriodicJob] = []
    every_sample = {"seconds": service.settings.util_sample_s}
    jobs.append(PeriodicJob("util-sample", utilization.sample_job, "interval", every_sample))
    jobs.append(PeriodicJob("idle-check", idle.idle_job, "interval", every_sample))
    post_s = max(60.0, service.settings.util_post_interval.total_seconds())  # 0 = off: job skips
    jobs.append(PeriodicJob("util-post", utilization.snapshot_job, "interval", {"seconds": post_s}))
    jobs.append(
        PeriodicJob("digest", weekly_digest_job, "cron", digest.digest_trigger(service.settings))
    )
    jobs.append(
        PeriodicJob("fleet", fleet.fleet_job, "interval", fleet.fleet_trigger(service.settings))
    )
    jobs.append(PeriodicJob("providers", providers_job, "interval", {"seconds": UPKEEP_EVERY_S}))
    jobs.append(
        PeriodicJob(
            "host-check",
            hostcheck.hostcheck_job,
            "interval",
            hostcheck.hostcheck_trigger(service.settings),
        )
    )
    return jobs


@dataclass
class Worker:
    service: GpuService
    notifier: Notifier | None
    interval_s: float
    # None: act on every tick (tests); otherwise only while this process leads.
    leader: Leadership | None = None
    # None: the jobs the settings ask for (periodic_jobs); tests pass their own list.
    extra_jobs: list[PeriodicJob] | None = field(default=None)

    def __post_init__(self) -> None:
        # One tick at a time, whether the interval or a nudge started it.
        self._tick_lock = threading.Lock()
        self._nudged = threading.Event()
        self._stopping = threading.Event()
        self._nudges_done = 0
        self._done = threading.Condition()
        self._waker: threading.Thread | None = None
        self.service.on_work(self._nudged.set)
        self._scheduler = BackgroundScheduler(
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None},
            timezone="UTC",
        )
        self._scheduler.add_job(
            locked_tick_job,
            "interval",
            seconds=self.interval_s,
            args=[self._tick_lock, self.service, self.notifier, self.leader],
            id="tick",
            replace_existing=True,
        )
        for job in self.extra_jobs if self.extra_jobs is not None else periodic_jobs(self.service):
            self._scheduler.add_job(
                leader_job,
                job.trigger,
                args=[job.id, job.run, self.service, self.leader],
                id=job.id,
                replace_existing=True,
                **job.trigger_args,
            )

    def start(self) -> None:
        self._scheduler.start()
        self._waker = threading.Thread(target=self._wake_loop, name="gpubot-nudge", daemon=True)
        self._waker.start()

    def _wake_loop(self) -> None:
        """A nudge (a run queued, GPUs given back) runs a tick now rather than at the next
        interval. A nudge during a tick runs one more tick after it, so none is lost."""
        while True:
            self._nudged.wait()
            if self._stopping.is_set():
                return
            self._nudged.clear()
            locked_tick_job(self._tick_lock, self.service, self.notifier, self.leader)
            with self._done:
                self._nudges_done += 1
                self._done.notify_all()

    def wait_for_nudged_tick(self, after: int, timeout_s: float) -> bool:
        """True once more than `after` nudged ticks have completed (tests and the shell
        wait on this instead of sleeping a tick)."""
        with self._done:
            return self._done.wait_for(lambda: self._nudges_done > after, timeout_s)

    @property
    def nudged_ticks(self) -> int:
        with self._done:
            return self._nudges_done

    def stop(self) -> None:
        self._stopping.set()
        self._nudged.set()
        if self._waker is not None:
            self._waker.join()
        if self._scheduler.running:
            self._scheduler.shutdown(wait=True)
        if self.leader is not None:
            self.leader.release()
