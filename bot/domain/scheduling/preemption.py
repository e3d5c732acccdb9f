"""Preemption: fair-share reclaim, defragmentation and consolidation, as one planner.

Runs that checkpoint may be moved: for a user below their share when the quota is
full, to make an instance whole for a big run, or to empty a half-used instance of a
draining fleet so it stops. `PreemptionPlanner` holds the state its steps share.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from bot.domain.scheduling.model import (
    Action,
    Allocation,
    FleetInstance,
    Launch,
    Place,
    Preempt,
    QueuedRun,
    SchedulerConfig,
    Start,
    Stop,
    Terminate,
    cached_shape,
    est,
    market_of,
)
from bot.domain.scheduling.order import Ordering, fairshare_factors, submit_key
from provisioning.catalog import Catalog


def fair_shares(
    demand: Mapping[str, int], capacity: int, weights: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Max-min fair split of `capacity` GPUs over the users' demands (water-filling).

    A user asking for less than an even split gets all of it; the rest is split evenly
    among the others, again and again. This is the share preemption defends: a user
    below theirs may take GPUs back from a user above theirs (YARN's and Kueue's fair
    sharing preemption), never from one at or below it."""
    w = {u: max(1e-12, (weights or {}).get(u, 1.0)) for u in demand}
    shares: dict[str, float] = {}
    left = float(capacity)
    wsum = sum(w.values())
    for user in sorted(demand, key=lambda u: (demand[u] / w[u], u)):
        give = min(float(demand[user]), left * w[user] / wsum) if wsum > 0 else 0.0
        shares[user] = give
        left -= give
        wsum -= w[user]
    return shares


class PreemptionPlanner:
    """The checkpoint-and-move part of one fair decision, in named steps.

    One planner per decision. It starts from what placement decided (`decided`: places,
    launches, starts, stops) and adds `moves`: each a `Preempt` of a run that
    checkpoints and a `Place` of it, or of the run it makes room for. The steps build on
    what the earlier ones established — the GPUs committed against the quota, each
    user's holdings and share, the GPUs idle or being freed per instance, the runs
    already moved — which is why they share one object rather than a dozen arguments:

    * `reclaim`, for runs the quota keeps out: `defragment` (move small runs into the
      gaps) else `take_fair_share` (from users above their share);
    * `consolidate`, for a draining fleet: empty an instance so it can be stopped.

    The caches (movable runs and victims per instance, the swap test, failures per
    state of the holdings, `version`) are there because a decision over a long queue
    must not redo per claimant what it already knows; none changes a decision."""

    EPS = 1e-9

    def __init__(
        self,
        fleet: Sequence[FleetInstance],
        decided: Sequence[Action],
        now: float,
        catalog: Catalog,
        config: SchedulerConfig,
    ) -> None:
        self.fleet = fleet
        self.decided = tuple(decided)
        self.now = now
        self.catalog = catalog
        self.config = config
        self.after = config.preempt_after()
        self.exempt = config.preempt_exempt()
        self.stopped_ids = {a.instance_id for a in decided if isinstance(a, Stop | Terminate)}
        self.moves: list[Action] = []
        # What reclaim's steps establish, in their order.
        self.placed: set[str] = set()  # runs placement already placed in this decision
        self.committed = 0  # GPUs of instances not stopped (or being launched, started)
        self.held: dict[str, int] = {}  # user -> GPUs held (or placed) now
        self.freed: dict[str, int] = {}  # instance -> GPUs freed (or being freed) for claimants
        self.pool: dict[tuple[str, str], list[FleetInstance]] = {}  # (model, market) -> usable
        self.idle: dict[str, int] = {}  # free GPUs nobody was placed on in this decision
        self.mov_users: set[str] = set()  # users with a preemptible run on a usable instance
        self.usable_fleet: list[FleetInstance] = []  # running, ready, not being stopped
        self.by_iid: dict[str, FleetInstance] = {}
        self.multi: set[str] = set()  # runs on more than one usable instance (multi-host)
        self.weights: dict[str, float] = {}  # fair-share factor per user
        self.shares: dict[str, float] = {}  # usage-weighted max-min share of the GPUs
        self.over: set[str] = set()  # users above their share with a run that may move
        self.any_freed = False
        self.pending: dict[tuple[str, str], int] = {}  # GPUs the claimants still ask per pool
        self.gone: set[str] = set()  # runs preempted by this decision
        self.version = 0  # bumped by every preemption: what failed before may succeed now
        self.scan_over = False  # preempt_scan claimants searched in vain: the rest waits
        # Caches (see the class docstring).
        self.movable_of: dict[str, list[Allocation]] = {}
        self.span_of: dict[str, list[str]] = {}
        self.victim_lists: dict[str, list[Allocation]] = {}
        self.no_room: set[tuple[str, str, int, int]] = set()
        self.hopeless: set[tuple[tuple[str, str], int, str, int]] = set()
        self.takable_of: dict[tuple[str, int], set[str]] = {}
        self.gains: dict[tuple[str, int, str, int, int], bool] = {}

    def plan(self, queue: Sequence[QueuedRun], usage: Mapping[str, float]) -> list[Action]:
        """All the moves of this decision: reclaim for the runs that wait, then
        consolidation of the pools nobody waits for."""
        if queue:
            self.reclaim(queue, usage)
        placed = {a.run_id for a in (*self.decided, *self.moves) if isinstance(a, Place)}
        waiting: set[tuple[str, str]] = {
            (r.gpu_model, market_of(r)) for r in queue if r.run_id not in placed
        }
        self.consolidate(waiting)
        return self.moves

    # ------------------------------------------------------------ shared helpers

    def movable(self, al: Allocation, *, to_wait: bool = False) -> bool:
        """Whether a preemption may touch this allocation at all.

        It must checkpoint (preemptible), not be stopping already, have run at least
        `preempt_exempt()` since it last started, and not be due to end within
        preempt_after() anyway. `to_wait`: the move sends it back in line (fair-share
        and least-attained-service reclaim, not a move into a gap elsewhere); then it
        must also have run at least as long as it had before that start, so every such
        move at least doubles its attained service — Tiresias' exponentially spaced
        queues: a run waits again about log2(its length / exempt) times at most however
        busy the fleet is, instead of losing its work since the last checkpoint on every
        look."""
        if not al.preemptible or al.stopping:
            return False
        if al.started_s is not None:
            ran = self.now - al.started_s
            if ran < self.exempt or (to_wait and ran < al.attained_s):
                return False
        return al.est_end_s is None or al.est_end_s - self.now > self.after

    def movable_on(self, iid: str) -> list[Allocation]:
        """An instance's allocations that reclaim may send back in line, worked out where
        a claimant looks (a decision over a busy fleet must not walk every allocation)."""
        got = self.movable_of.get(iid)
        if got is None:
            got = [al for al in self.by_iid[iid].allocations if self.movable(al, to_wait=True)]
            self.movable_of[iid] = got
        return got

    def spans(self, rid: str, where: str) -> list[str]:
        """The usable instances a run holds GPUs on; `where` is one of them."""
        if rid not in self.multi:
            return [where]
        got = self.span_of.get(rid)
        if got is None:
            got = [i.instance_id for i in self.usable_fleet if rid in i.run_ids]
            self.span_of[rid] = got
        return got

    def run_total(self, al: Allocation, where: str) -> int:
        """A run's GPUs over all its instances: what preempting it takes from its user."""
        if al.run_id not in self.multi:
            return al.gpus
        return sum(
            x.gpus
            for iid in self.spans(al.run_id, where)
            for x in self.by_iid[iid].allocations
            if x.run_id == al.run_id
        )

    @staticmethod
    def end_of(al: Allocation) -> float:
        return math.inf if al.est_end_s is None else al.est_end_s

    def victims(self, iid: str) -> list[Allocation]:
        """Movable runs of users above their share on an instance, largest then longest
        first; built on first use, as most decisions look at few instances."""
        got = self.victim_lists.get(iid)
        if got is None:
            over, end_of = self.over, self.end_of
            got = sorted(
                (al for al in self.movable_on(iid) if al.user in over),
                key=lambda al: (-al.gpus, -end_of(al), al.run_id),
            )
            self.victim_lists[iid] = got
        return got

    def first_gain(self, run: QueuedRun, mine: float, user: str, t: int) -> bool:
        """The swap test of `_pick_victims` for a first pick (a later pick of the same
        user only gains less), cached per claimant user and size, victim user and size."""
        key = (run.user, run.gpus, user, t, self.version)
        ok = self.gains.get(key)
        if ok is None:
            held, eps = self.held, self.EPS
            hc, hv, sv = held.get(run.user, 0), held.get(user, 0), self.shares.get(user, 0.0)
            before = abs(hc - mine) + abs(hv - sv)
            after_swap = abs(hc + run.gpus - mine) + abs(hv - t - sv)
            ok = before - after_swap >= (run.gpus + t) / 2 - eps
            self.gains[key] = ok
        return ok

    # ------------------------------------------------------------ reclaim

    def reclaim(self, queue: Sequence[QueuedRun], usage: Mapping[str, float]) -> None:
        """Preempt-and-place for runs the quota keeps out: defragmentation, then fair share.

        A claimant has waited `preempt_after()` (a run ending or an instance booting
        within that is cheaper than a preemption) and the quota leaves no room to
        provision an instance for it (on owned hosts nothing can be bought at all). First,
        if the pool has the GPUs but scattered, small runs are moved into the gaps
        (`defragment`). Else, if its user is below a usage-weighted max-min share of the
        GPUs in use (`fair_shares`, weights: the fair-share factor), it may take GPUs from
        a victim whose user is above theirs, has used at least one fair share more than
        the claimant's lately, and ends up nearer their share by at least half the GPUs
        moved (`take_fair_share`). Victims are movable runs (`movable`: preemptible, past
        `preempt_exempt()`, not ending soon), largest first (one preemption frees the
        most for the runs behind), not more than the claimants ask for, then the most
        work left. The freed GPUs go to the claimants in fair order; a preempted run goes
        back in line and resumes from its checkpoint, paying `resume_s` on its GPUs.
        Users at or below their share never lose GPUs."""
        claimants = self._claimants(queue)
        if not claimants:
            return
        if not self._survey():
            return  # nothing may be moved and nothing is being freed
        self._share(queue, usage)
        las = self._long_runners()
        las_after = self.config.las_after_s or 0.0
        claimants = self._promising(claimants) if not las else claimants
        if not claimants:
            return
        order = self._rank(claimants, usage)
        if (
            not las
            and not self.over
            and not self.any_freed
            and not any(v > 0 and self.by_iid[k].preemptible_users for k, v in self.idle.items())
        ):
            return  # nobody to take from, nothing freed, no gaps to fill: the usual case
        for run in order:
            pkey = (run.gpu_model, market_of(run))
            asked = self.pending[pkey]
            self.pending[pkey] -= run.gpus
            group = self.pool.get(pkey, [])
            if self.defragment(run, group):
                continue
            version = self.version
            self.take_fair_share(run, group, asked)
            if las and self.version == version and run.attained_s < las_after:
                self.take_by_service(run, group, las)
            if self.scan_over:
                break  # like Slurm's bf_max_job_test: a long queue is not searched to the end

    def _claimants(self, queue: Sequence[QueuedRun]) -> list[QueuedRun]:
        """The runs that may preempt: not placed, waited `preempt_after()`, on one host,
        and no room under the quota to provision for them. Counts, on the way, the GPUs
        committed against the quota and those placement gave each user."""
        now, catalog = self.now, self.catalog
        by_id = {r.run_id: r for r in queue}
        committed = 0
        for inst in self.fleet:
            if inst.state != "stopped" and inst.instance_id not in self.stopped_ids:
                committed += inst.gpus
        placed_gpus: dict[str, int] = {}
        for a in self.decided:
            if isinstance(a, Place):
                self.placed.add(a.run_id)
                run = by_id.get(a.run_id)
                if run is not None:
                    n = a.gpus_per_instance * len(a.instance_ids)
                    placed_gpus[run.user] = placed_gpus.get(run.user, 0) + n
            elif isinstance(a, Launch):
                t = catalog.get(a.instance_type)
                committed += t.gpus if t is not None else 0
            elif isinstance(a, Start):
                committed += next((i.gpus for i in self.fleet if i.instance_id == a.instance_id), 0)
        self.committed = committed
        self.held = placed_gpus
        headroom = self.config.max_gpus - committed
        claimants: list[QueuedRun] = []
        for run in queue:
            if run.run_id in self.placed or now - run.submit_s < self.after:
                continue
            shape = cached_shape(catalog, run.gpu_model, run.gpus)
            if shape is not None and (shape[1] > 1 or shape[0].gpus <= headroom):
                continue  # multi-host runs are not placed by preemption; room to provision
            claimants.append(run)  # (no shape: owned hosts only, nothing could be bought)
        return claimants

    def _survey(self) -> bool:
        """Each user's GPUs, and per usable instance its pool and idle GPUs, from the
        instances' cached summaries. Whether anything may move or is being freed."""
        held, freed, idle, pool = self.held, self.freed, self.idle, self.pool
        usable_fleet, mov_users = self.usable_fleet, self.mov_users
        now, stopped_ids = self.now, self.stopped_ids
        for inst in self.fleet:
            iid = inst.instance_id
            for user, g in inst.holders.items():
                held[user] = held.get(user, 0) + g
            if inst.stopping_gpus:  # told to stop earlier: their GPUs are already promised
                freed[iid] = inst.stopping_gpus
            if iid in stopped_ids or inst.state != "running" or inst.ready_at_s > now:
                continue
            usable_fleet.append(inst)
            pool.setdefault((inst.gpu_model, inst.market), []).append(inst)
            idle[iid] = inst.free_gpus
            mov_users |= inst.preemptible_users
        if not mov_users and not freed:
            return False
        self.by_iid = {i.instance_id: i for i in self.fleet}
        seen_once: set[str] = set()
        for inst in usable_fleet:
            self.multi |= seen_once & inst.run_ids
            seen_once |= inst.run_ids
        return True

    def _share(self, queue: Sequence[QueuedRun], usage: Mapping[str, float]) -> None:
        """Each user's fair share of the GPUs in use, and who is above theirs."""
        held = self.held
        demand = dict(held)
        for run in queue:
            if run.run_id not in self.placed:
                demand[run.user] = demand.get(run.user, 0) + run.gpus
        self.weights = fairshare_factors(demand, usage)
        # The GPUs there are to share: at the quota (or on owned hosts, where nothing can
        # be bought) that is what runs now.
        self.shares = shares = fair_shares(
            demand, min(self.config.max_gpus, self.committed), self.weights
        )
        idle = self.idle
        for a in self.decided:
            if isinstance(a, Place):
                for iid in a.instance_ids:
                    if iid in idle:
                        idle[iid] -= a.gpus_per_instance
        eps = self.EPS
        self.over = {u for u in self.mov_users if held.get(u, 0) > shares.get(u, 0.0) + eps}
        self.any_freed = any(v > 0 for v in self.freed.values())

    def _promising(self, claimants: list[QueuedRun]) -> list[QueuedRun]:
        """The claimants with a chance, cheaply: below their share while someone above
        theirs has a run that may move, or a gap as big as the run beside a movable run,
        or GPUs being freed. The usual case ends here."""
        held, shares, eps = self.held, self.shares, self.EPS
        gaps: dict[tuple[str, str], int] = {
            key: sum(max(0, self.idle[i.instance_id]) for i in group)
            for key, group in self.pool.items()
            if any(i.preemptible_users for i in group)
        }
        return [
            r
            for r in claimants
            if (self.over and held.get(r.user, 0) < shares.get(r.user, 0.0) - eps)
            or r.gpus <= gaps.get((r.gpu_model, market_of(r)), 0)
            or self.any_freed
        ]

    def _rank(self, claimants: list[QueuedRun], usage: Mapping[str, float]) -> list[QueuedRun]:
        """The order the claimants are served in, and the GPUs they ask per pool.

        Per user and shape, the first few only: the rest of a group fares as its first do
        within one decision, and the simulator decides again at once after a preemption.
        Fair order, but one user's runs of one shape that waited together (a sweep) go by
        length: the GPUs one preemption frees then hold runs that end together, and the
        instance does not stay paid for one straggler."""
        config = self.config
        per_group: dict[tuple[str, int, str, bool], int] = {}
        capped: list[QueuedRun] = []
        for r in sorted(claimants, key=submit_key):
            gkey = (r.user, r.gpus, r.gpu_model, r.spot)
            n = per_group.get(gkey, 0)
            if n < config.preempt_group:
                per_group[gkey] = n + 1
                capped.append(r)
        ordering = Ordering(capped, self.now, usage, config)
        ranked = sorted(capped, key=ordering.key)
        first: dict[tuple[str, int, str, bool, int], int] = {}
        for idx, run in enumerate(ranked):
            first.setdefault((run.user, run.gpus, run.gpu_model, run.spot, run.priority), idx)
        order = sorted(
            ranked,
            key=lambda r: (
                first[(r.user, r.gpus, r.gpu_model, r.spot, r.priority)],
                est(r, config),
                r.run_id,
            ),
        )
        pending = self.pending
        for run in order:
            pkey = (run.gpu_model, market_of(run))
            pending[pkey] = pending.get(pkey, 0) + run.gpus
        return order

    # ------------------------------------------------------------ defragmentation

    def defragment(self, run: QueuedRun, group: list[FleetInstance]) -> bool:
        """Room for `run` by moving a few small runs into GPUs idle elsewhere; whether it
        was placed so.

        The fleet has the GPUs but no instance has enough of them together (a big run
        behind small ones that ended at different times): moving runs off one instance
        into the gaps on others makes it whole. Nobody loses GPUs; the moved runs pay
        `resume_s` each, so it is done only when that costs less GPU-time than the run
        would wait for `preempt_after()` on its own GPUs."""
        memo = (run.gpu_model, market_of(run), run.gpus, self.version)
        if memo in self.no_room:
            return False
        self.no_room.add(memo)  # a success bumps the version, so this only remembers failures
        idle = self.idle
        if sum(max(0, idle[i.instance_id]) for i in group) < run.gpus:
            return False
        gone, multi, end_of = self.gone, self.multi, self.end_of
        best: tuple[tuple[int, int, str], FleetInstance, list[tuple[Allocation, str]]] | None
        best = None
        for inst in group:
            need = run.gpus - idle[inst.instance_id]
            if inst.gpus < run.gpus or need <= 0:
                continue
            movable = sorted(
                (
                    al
                    for al in inst.allocations
                    if self.movable(al) and al.run_id not in gone and al.run_id not in multi
                ),
                key=lambda al: (al.gpus, end_of(al), al.run_id),
            )
            chosen: list[Allocation] = []
            for al in movable:
                if need <= 0:
                    break
                chosen.append(al)
                need -= al.gpus
            if need > 0:
                continue
            plan = self._into_gaps(chosen, inst, group)
            if plan is None:
                continue
            moved = sum(al.gpus for al in chosen)
            if moved * self.config.resume_s >= run.gpus * self.after:
                continue
            score = (moved, len(chosen), inst.instance_id)
            if best is None or score < best[0]:
                best = (score, inst, plan)
        if best is None:
            return False
        _, inst, plan = best
        moves: list[Action] = [Preempt(al.run_id, run.run_id) for al, _ in plan]
        for al, to in plan:
            gone.add(al.run_id)
            idle[to] -= al.gpus
            idle[inst.instance_id] += al.gpus
            moves.append(Place(al.run_id, (to,), al.gpus))
        idle[inst.instance_id] -= run.gpus
        moves.append(Place(run.run_id, (inst.instance_id,), run.gpus))
        self.moves.extend(moves)
        self.held[run.user] = self.held.get(run.user, 0) + run.gpus
        self.version += 1
        return True

    def _into_gaps(
        self, chosen: list[Allocation], inst: FleetInstance, group: list[FleetInstance]
    ) -> list[tuple[Allocation, str]] | None:
        """Where each chosen run goes, largest first, into the tightest gap on another
        instance; None when one does not fit."""
        idle = self.idle
        room = {
            o.instance_id: idle[o.instance_id]
            for o in group
            if o is not inst and idle[o.instance_id] > 0
        }
        plan: list[tuple[Allocation, str]] = []
        for al in sorted(chosen, key=lambda al: (-al.gpus, al.run_id)):
            fits = [(left - al.gpus, iid) for iid, left in room.items() if left >= al.gpus]
            if not fits:
                return None
            _, to = min(fits)
            room[to] -= al.gpus
            plan.append((al, to))
        return plan

    # ------------------------------------------------------------ fair-share reclaim

    def take_fair_share(self, run: QueuedRun, group: list[FleetInstance], asked: int) -> None:
        """Places `run` on GPUs taken from users above their share, when its own user is
        below theirs: on the instance needing the fewest preemptions, then wasting the
        fewest GPUs the claimants do not ask for (`asked`, this pool), then freeing the
        most, then the victims with the most work left."""
        held, shares, freed, eps = self.held, self.shares, self.freed, self.EPS
        mine = shares.get(run.user, 0.0)
        if held.get(run.user, 0) >= mine - eps:
            return  # at or above its share: it waits like everyone else
        memo = ((run.gpu_model, market_of(run)), run.gpus, run.user, self.version)
        if memo in self.hopeless:
            return
        takable = self._takable(run.user)
        if not takable and not self.any_freed:
            return  # nobody it may take from (see the band below): no instance to scan
        best: tuple[tuple[int, int, int, float, str], FleetInstance, list[Allocation]] | None
        best = None
        end_of = self.end_of
        for inst in group:
            if inst.gpus < run.gpus:
                continue
            if not freed.get(inst.instance_id) and takable.isdisjoint(inst.preemptible_users):
                continue
            need = run.gpus - freed.get(inst.instance_id, 0)
            picks: list[Allocation] = []
            if need > 0:
                got_picks = self._pick_victims(run, inst, need, asked, mine, takable)
                if got_picks is None:
                    continue
                picks = got_picks
            got = sum(al.gpus for al in picks)
            waste = max(0, got + freed.get(inst.instance_id, 0) - asked)
            latest = max((end_of(al) for al in picks), default=0.0)
            score = (len(picks), waste, -got, -latest, inst.instance_id)
            if best is None or score < best[0]:
                best = (score, inst, picks)
        if best is None:
            self.hopeless.add(memo)
            if len(self.hopeless) >= self.config.preempt_scan:
                self.scan_over = True
            return
        _, inst, picks = best
        self._take(run, inst, picks)

    # ------------------------------------------------------------ least attained service

    def _long_runners(self) -> dict[str, list[Allocation]]:
        """Per usable instance, its movable runs that have run `las_after_s` or more since
        they (re)started, the longest-running first; empty when the step is off.

        Tiresias' two-dimensional least-attained-service, discretized into two queues:
        run times are unknown, and in a heavy-tailed workload a run that has gone on for
        a while is likely to go on much longer, while a run that never ran is likely
        short. So a run that waited may take the GPUs of one in the long queue, which
        resumes from its checkpoint later; `preempt_exempt()` keeps each such run at least
        that long on its GPUs between moves."""
        after = self.config.las_after_s
        if after is None:
            return {}
        now, out = self.now, {}
        for inst in self.usable_fleet:
            longs = [
                al
                for al in self.movable_on(inst.instance_id)
                if al.started_s is not None
                and now - al.started_s >= after
                and al.run_id not in self.multi
            ]
            if longs:
                longs.sort(key=lambda al: (al.started_s, al.run_id))
                out[inst.instance_id] = longs
        return out

    def take_by_service(
        self, run: QueuedRun, group: list[FleetInstance], las: dict[str, list[Allocation]]
    ) -> None:
        """Places a waiting run on GPUs of runs in the long queue (`_long_runners`): on the
        instance needing the fewest preemptions, then the longest-running victims."""
        freed, gone = self.freed, self.gone
        best: tuple[tuple[int, float, str], FleetInstance, list[Allocation]] | None = None
        for inst in group:
            if inst.gpus < run.gpus:
                continue
            need = run.gpus - freed.get(inst.instance_id, 0)
            picks: list[Allocation] = []
            for al in las.get(inst.instance_id, ()):
                if need <= 0:
                    break
                if al.run_id in gone:
                    continue
                picks.append(al)
                need -= al.gpus
            if need > 0:
                continue
            oldest = min((al.started_s or 0.0 for al in picks), default=self.now)
            score = (len(picks), oldest, inst.instance_id)
            if best is None or score < best[0]:
                best = (score, inst, picks)
        if best is not None:
            _, inst, picks = best
            self._take(run, inst, picks)

    def _takable(self, user: str) -> set[str]:
        """The users a claimant of `user` may take from: above their share, and having
        used at least one fair share more than `user` lately (weight at most half)."""
        tkey = (user, self.version)
        takable = self.takable_of.get(tkey)
        if takable is None:
            held, shares, weights, eps = self.held, self.shares, self.weights, self.EPS
            wc = weights.get(user, 1.0)
            takable = {
                v
                for v in self.over
                if v != user
                and wc >= 2.0 * weights.get(v, 1.0) - eps
                and held.get(v, 0) > shares.get(v, 0.0) + eps
            }
            self.takable_of[tkey] = takable
        return takable

    def _pick_victims(
        self,
        run: QueuedRun,
        inst: FleetInstance,
        need: int,
        asked: int,
        mine: float,
        takable: set[str],
    ) -> list[Allocation] | None:
        """The runs on `inst` to preempt for `need` GPUs, or None if they cannot be had.

        Largest first frees the most for the claimants behind, but not more than they ask
        for; then the one with the most work left."""
        held, shares, weights, eps = self.held, self.shares, self.weights, self.EPS
        gone = self.gone
        fit: list[Allocation] = []
        over_ask: list[Allocation] = []
        room = 0
        for al in self.victims(inst.instance_id):  # largest, then longest, first
            if (
                al.user in takable
                and al.run_id not in gone
                and self.first_gain(run, mine, al.user, al.gpus)
            ):
                (fit if al.gpus <= asked else over_ask).append(al)
                room += al.gpus
        if room < need:
            return None
        cands = fit + over_ask[::-1]  # overshooting ones last, the smallest first
        budget: dict[str, int] = {}
        picks: list[Allocation] = []
        for al in cands:
            total = self.run_total(al, inst.instance_id)
            hv, sv = budget.get(al.user, held.get(al.user, 0)), shares.get(al.user, 0.0)
            hc = held.get(run.user, 0)
            if hv <= sv + eps:
                continue  # its user is not above their share
            if weights.get(run.user, 1.0) < 2.0 * weights.get(al.user, 1.0) - eps:
                # Only from a user who has used at least one fair share (1/N of
                # everybody's recent GPU time) more than the claimant's: usage follows
                # the GPUs, so without this band two busy users would take them back
                # and forth as their usage crosses.
                continue
            # The swap must bring the two users nearer their shares by at least half the
            # GPUs it moves (in whole GPUs a share is rarely met exactly, and shares drift
            # with usage): a small gain in fairness is not worth a checkpoint, and GPUs
            # cannot swing back and forth.
            before = abs(hc - mine) + abs(hv - sv)
            after_swap = abs(hc + run.gpus - mine) + abs(hv - total - sv)
            if before - after_swap < (run.gpus + total) / 2 - eps:
                continue
            budget[al.user] = hv - total
            picks.append(al)
            need -= al.gpus
            if need <= 0:
                break
        if need > 0:
            return None
        return picks

    def _take(self, run: QueuedRun, inst: FleetInstance, picks: list[Allocation]) -> None:
        """Commits a fair-share take: the victims preempted (all their GPUs freed, on every
        instance they span), `run` placed on `inst`."""
        self.version += 1
        held, freed = self.held, self.freed
        for al in picks:
            self.gone.add(al.run_id)
            self.moves.append(Preempt(al.run_id, run.run_id))
            for iid in self.spans(al.run_id, inst.instance_id):
                g = sum(x.gpus for x in self.by_iid[iid].allocations if x.run_id == al.run_id)
                freed[iid] = freed.get(iid, 0) + g
                held[al.user] = held.get(al.user, 0) - g
        freed[inst.instance_id] = freed.get(inst.instance_id, 0) - run.gpus
        held[run.user] = held.get(run.user, 0) + run.gpus
        self.moves.append(Place(run.run_id, (inst.instance_id,), run.gpus))

    # ------------------------------------------------------------ consolidation

    def consolidate(self, waiting: set[tuple[str, str]]) -> None:
        """Empties an instance whose runs fit in GPUs idle on others, so it can be stopped.

        What a cluster autoscaler's scale-down does with pods: a draining fleet (runs that
        ended at different times) otherwise pays for whole instances kept alive by one or
        two long runs. Each move is a preemption and a resume (`resume_s` on the run's
        GPUs); an instance is emptied only when the GPU-time it saves (its GPUs until its
        last run would have ended) exceeds what the moves cost plus the time they add to
        the targets. Only runs with a known end, preemptible, on one instance, not ending
        within `preempt_after()` move; nothing moves onto an instance being emptied. Not
        while runs of the pool (`waiting`: model, market) wait: idle GPUs are theirs (and
        the backfill promise to the head of the line covers them), and defragmentation
        serves them instead."""
        now = self.now
        actions = (*self.decided, *self.moves)
        busy_refs = {a.instance_id for a in actions if isinstance(a, Stop | Terminate)}
        placed: dict[str, list[tuple[float, int]]] = {}
        moved_runs: set[str] = set()
        for a in actions:
            if isinstance(a, Place):
                for iid in a.instance_ids:
                    placed.setdefault(iid, []).append((math.inf, a.gpus_per_instance))
            elif isinstance(a, Preempt):
                moved_runs.add(a.run_id)
        groups: dict[tuple[str, str, str], list[FleetInstance]] = {}
        for inst in self.fleet:
            if inst.state != "running" or inst.ready_at_s > now or inst.instance_id in busy_refs:
                continue
            if (inst.gpu_model, inst.market) in waiting:
                continue
            groups.setdefault((inst.instance_type, inst.gpu_model, inst.market), []).append(inst)
        if not any(len(g) >= 2 for g in groups.values()):
            return  # nothing to empty into: skip counting every allocation
        span_count: dict[str, int] = {}
        for inst in self.fleet:
            for al in inst.allocations:
                span_count[al.run_id] = span_count.get(al.run_id, 0) + 1
        for group in groups.values():
            if len(group) >= 2:
                self._empty_some(group, placed, moved_runs, span_count)

    def _empty_some(
        self,
        group: list[FleetInstance],
        placed: dict[str, list[tuple[float, int]]],
        moved_runs: set[str],
        span_count: dict[str, int],
    ) -> None:
        """Consolidation within one group of alike instances, the least used first."""
        now, config = self.now, self.config
        idle: dict[str, int] = {}
        horizon: dict[str, float] = {}
        for inst in group:
            extra = placed.get(inst.instance_id, [])
            idle[inst.instance_id] = inst.free_gpus - sum(g for _, g in extra)
            ends = [al.est_end_s for al in inst.allocations]
            horizon[inst.instance_id] = (
                math.inf
                if extra or any(e is None for e in ends)
                else max([now, *(e for e in ends if e is not None)])
            )
        if sum(max(0, v) for v in idle.values()) == 0:
            return
        # An instance whose every run was told to stop is being emptied (by an earlier
        # decision's consolidation, the worker still checkpointing them): it is about to
        # stop, so nothing moves onto it; moving a run there only sends it back in line
        # to land wherever placement puts it next, losing its work since its checkpoint.
        emptied: set[str] = {
            inst.instance_id
            for inst in group
            if inst.allocations and all(al.stopping for al in inst.allocations)
        }
        for inst in sorted(group, key=lambda i: (i.used_gpus, i.instance_id)):
            iid = inst.instance_id
            als = inst.allocations
            if (
                not als
                or horizon[iid] == math.inf
                or any(
                    not self.movable(al)
                    or al.run_id in moved_runs
                    or span_count[al.run_id] != 1
                    or al.est_end_s is None
                    for al in als
                )
            ):
                continue
            room = {
                o.instance_id: idle[o.instance_id]
                for o in group
                if o is not inst and o.instance_id not in emptied and idle[o.instance_id] > 0
            }
            new_h = {k: horizon[k] for k in room}
            plan: list[tuple[Allocation, str]] = []
            for al in sorted(als, key=lambda a: (-a.gpus, -(a.est_end_s or 0.0), a.run_id)):
                end = (al.est_end_s or now) + config.resume_s
                # the target whose paid time grows least: one already kept as long
                fits = [
                    (max(0.0, end - new_h[k]), left - al.gpus, k)
                    for k, left in room.items()
                    if left >= al.gpus and new_h[k] != math.inf
                ]
                if not fits:
                    break
                _, _, to = min(fits)
                room[to] -= al.gpus
                new_h[to] = max(new_h[to], end)
                plan.append((al, to))
            if len(plan) < len(als):
                continue
            saved = inst.gpus * (horizon[iid] - now)
            added = sum(inst.gpus * (new_h[k] - horizon[k]) for k in new_h)
            cost = sum(al.gpus for al in als) * config.resume_s
            if saved - added - cost <= inst.gpus * config.preempt_after():
                continue  # not worth the moves and the restart of the emptied instance
            emptied.add(iid)
            for al, to in plan:
                self.moves.append(Preempt(al.run_id, f"consolidate:{iid}"))
                self.moves.append(Place(al.run_id, (to,), al.gpus))
                idle[to] -= al.gpus
                horizon[to] = new_h[to]
                moved_runs.add(al.run_id)
            idle[iid] = inst.gpus
