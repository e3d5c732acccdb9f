"""The simulator behind the app's `Replayer` port (bot.app.ports): the digest's advice
replays the week's runs through `bot.sim.simulate` here, among the faces, because the app
may not import the simulator (tests/test_dependency_rule.py).

The replay is the simulator's world as `gpubot simulate --history` runs it, with what the
history knows of each run instead of the contract's stand-ins: whether it checkpoints is
the run's own `--checkpoints` (not the hash rule), and a run that ran on spot runs on spot.
Run times stay hidden from the scheduler (`--estimates none`), as in the worker."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from bot.app.money.advice import Totals, report_blocks, report_for
from bot.app.money.digest import digest_job
from bot.app.money.history_trace import HistoryRun
from bot.app.money.prices import priced_catalog
from bot.app.ports import ReplayOutcome
from bot.domain.scheduling import SchedulerConfig
from bot.sim.simulate import TraceJob, run_simulation
from provisioning.catalog import Catalog

if TYPE_CHECKING:
    from bot.app.service import GpuService
    from bot.domain.metering import Window
    from bot.domain.views import Block


def trace_jobs(jobs: Sequence[HistoryRun], catalog: Catalog) -> list[TraceJob]:
    """The history's runs as the simulator's jobs (a model the catalog does not know is
    left as written: the simulator rejects the run, and the outcome counts it)."""
    return [
        TraceJob(
            job_id=j.job_id,
            user=j.user,
            submit_s=j.submit_s,
            duration_s=j.duration_s,
            gpus=j.gpus,
            gpu_model=catalog.normalize_model(j.gpu_model) or j.gpu_model,
            checkpoints=j.checkpoints,
            spot=j.spot,
        )
        for j in jobs
    ]


class SimReplayer:
    """`Replayer` over `bot.sim.simulate.run_simulation`, with one catalog for all calls."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def __call__(
        self,
        jobs: Sequence[HistoryRun],
        config: SchedulerConfig,
        *,
        ebs_gb: float,
        ebs_usd_gb_month: float,
    ) -> ReplayOutcome:
        res = run_simulation(
            trace_jobs(jobs, self.catalog),
            policy=config.policy,
            catalog=self.catalog,
            max_gpus=config.max_gpus,
            boot_s=config.boot_s,
            setup_s=config.setup_s,
            start_s=config.start_s,
            ebs_gb=ebs_gb,
            ebs_usd_gb_month=ebs_usd_gb_month,
            config=config,
            estimates="none",
        )
        return ReplayOutcome(
            usd=res.total_cost_usd,
            avg_queue_s=res.avg_queue_s,
            p95_queue_s=res.p95_queue_s,
            jobs=res.jobs,
            rejected=len(res.rejected),
        )


def weekly_digest_job(service: GpuService) -> None:
    """The worker's weekly digest with its advice (APScheduler restores module-level
    functions only, so the simulator is bound here rather than in a lambda)."""
    digest_job(service, replay=SimReplayer(priced_catalog(service.settings)))


def team_week_blocks(
    service: GpuService, window: Window, catalog: Catalog, totals: Totals | None = None
) -> tuple[Block, ...]:
    """`/gpu cost team week`: this week so far's largest wastes and the replay's advice,
    and with the bill's `totals` where the two part."""
    report = report_for(
        service.engine,
        service.settings,
        window,
        service.clock.now(),
        catalog,
        SimReplayer(catalog),
        totals,
    )
    return report_blocks(report)
