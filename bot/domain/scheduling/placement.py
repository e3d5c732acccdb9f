"""Placement on the warm fleet: best fit by added paid time, and EASY backfill.

The fair policy's first pass. What cannot be placed is handed to provisioning.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from operator import attrgetter

from bot.domain.scheduling.model import (
    Action,
    FleetInstance,
    Place,
    QueuedRun,
    SchedulerConfig,
    Stop,
    Terminate,
    est,
    min_gpus,
    split_hosts,
)
from bot.domain.scheduling.order import Lazy, Ordering
from bot.domain.scheduling.provision import provision
from bot.domain.scheduling.slots import Slot, hosts_for
from provisioning.catalog import Catalog


def place_fair(
    queue: Sequence[QueuedRun],
    fleet: Sequence[FleetInstance],
    now: float,
    catalog: Catalog,
    config: SchedulerConfig,
    usage: Mapping[str, float],
) -> list[Action]:
    actions: list[Action] = []
    idle_after = config.idle_stop_after()
    stopped_now: set[str] = set()
    # Idle management first: a stopped instance frees quota for this same decision.
    for inst in fleet:
        if inst.owned:
            continue  # the team's own machine: stopping it saves nothing
        if inst.state == "running" and not inst.allocations:
            since = inst.idle_since_s if inst.idle_since_s is not None else now
            if now - since >= idle_after:
                actions.append(Stop(inst.instance_id))
                stopped_now.add(inst.instance_id)
        elif inst.state == "stopped":
            since = inst.stopped_since_s if inst.stopped_since_s is not None else now
            if now - since >= config.terminate_after(inst.usd_hr):
                actions.append(Terminate(inst.instance_id))
                stopped_now.add(inst.instance_id)
    if not queue:
        return actions
    stopped = [i for i in fleet if i.state == "stopped" and i.instance_id not in stopped_now]
    warm = [i for i in fleet if i.state != "stopped" and i.instance_id not in stopped_now]
    headroom = config.max_gpus - sum(i.gpus for i in warm)
    if headroom > 0:
        smallest = min((min_gpus(catalog, m) for m in {r.gpu_model for r in queue}), default=0)
    else:
        smallest = 1  # at the quota nothing can be provisioned, whatever the models
    if not any(i.free_gpus for i in warm) and (headroom < smallest or smallest == 0):
        return actions  # nothing can start and nothing can be provisioned

    slots: dict[tuple[str, str], list[Slot]] = {}  # (model, market) -> slots
    unknown_end = now + config.unknown_duration_s
    for inst in warm:
        # `instance_horizon`, inlined: this runs for every instance on every decision
        ready = max(now, inst.ready_at_s)
        horizon = max(ready, inst.latest_end)
        if inst.unknown_end_gpus:
            horizon = max(horizon, unknown_end)
        group = slots.get((inst.gpu_model, inst.market))
        if group is None:
            group = slots[(inst.gpu_model, inst.market)] = []
        group.append(
            Slot(
                inst,
                inst.instance_id,
                inst.gpus,
                ready,
                inst.usd_hr,
                inst.instance_type,
                inst.free_gpus,
                horizon,
            )
        )
    ordering = Ordering(queue, now, usage, config)
    ordered = Lazy(iter(ordering), len(queue))
    can_provision = headroom >= smallest or any(i.gpus <= headroom for i in stopped)
    gfree = {key: sum(s.free for s in group) for key, group in slots.items()}

    # Pass 1: the warm fleet, with an EASY reservation for the first run that waits.
    head_t = math.inf
    head_extra: dict[str, int] = {}  # instance ref -> GPUs the head leaves spare at head_t
    have_head = False
    head_key: tuple[str, str] | None = None
    head_todo: tuple[QueuedRun, float] | None = None  # reservation computed on first need
    waiting: list[QueuedRun] = []
    done: set[str] = set()
    failed: dict[tuple[tuple[str, str], int], float] = {}
    peer_window = config.peer_window()
    i = 0
    tot_free = sum(gfree.values())
    unknown = config.unknown_duration_s
    bound_checked = False
    while (run := ordered.get(i)) is not None:
        if run.run_id in done:
            i += 1
            continue
        if tot_free <= 0 and not can_provision:
            break  # no room left and none to be made: the rest of the queue waits
        key = (run.gpu_model, "spot" if run.spot else "ondemand")
        dur = unknown if run.est_duration_s is None else run.est_duration_s
        # A run that did not fit makes every later run of its shape and no shorter
        # duration fail too (free GPUs and the head's spare only shrink): skip them.
        shape_key = (key, run.gpus)
        if gfree.get(key, 0) < run.gpus or dur >= failed.get(shape_key, math.inf):
            if can_provision:
                waiting.append(run)
            i += 1
            if not have_head:
                have_head = True
                head_key = key
                head_todo = (run, dur)
            elif not can_provision and not bound_checked:
                bound_checked = True
                if head_todo is not None and head_key is not None:
                    head_t, head_extra = _reservation(
                        head_todo[0], head_todo[1], slots.get(head_key, []), now, config
                    )
                    head_todo = None
                cands = _backfill_candidates(
                    ordering, ordered, slots, gfree, head_key, head_t, head_extra, unknown
                )
                if not cands:
                    break
                if ordering.uniform:
                    ordered, i = Lazy(iter(sorted(cands, key=ordering.key)), len(cands)), 0
            continue
        group = slots.get(key, [])
        if head_todo is not None and key == head_key:
            head_t, head_extra = _reservation(head_todo[0], head_todo[1], group, now, config)
            head_todo = None
        chosen = _best_fit(run, dur, group, now, config, have_head, head_t, head_extra)
        if chosen is None:
            failed[shape_key] = dur
        pick = run
        if chosen is not None and chosen[2] > _FREE_FIT and peer_window > 0:
            # Among equals (same user, shape and priority, queued together, as a sweep
            # is), the one that packs best goes first: the user's order among them is
            # not an intent, and a worse fit keeps an instance paid for longer. At an
            # equal fit, one that checkpoints goes before one that would pin an
            # instance no such run holds yet (`Fit`).
            for j in range(i + 1, i + 1 + config.peer_scan):
                peer = ordered.get(j)
                if peer is None:
                    break
                if (
                    peer.run_id in done
                    or peer.user != run.user
                    or peer.gpus != run.gpus
                    or peer.priority != run.priority
                    or peer.gpu_model != run.gpu_model
                    or peer.spot != run.spot
                    or abs(peer.submit_s - run.submit_s) > peer_window
                ):
                    continue
                pdur = est(peer, config)
                if pdur >= failed.get(shape_key, math.inf):
                    continue
                alt = _best_fit(peer, pdur, group, now, config, have_head, head_t, head_extra)
                if alt is not None and alt[2] < chosen[2]:
                    pick, chosen = peer, alt
        if chosen is not None:
            hosts, per, _ = chosen
            pdur = est(pick, config)
            start = max(h.ready for h in hosts)
            for s in hosts:
                s.free -= per
                s.horizon = max(s.horizon, start + pdur)
                s.placed.append((start + pdur, per))
                s.pinned = s.pinned or not pick.preemptible
                if have_head and s.ref in head_extra and start + pdur > head_t:
                    head_extra[s.ref] -= per
            actions.append(Place(pick.run_id, tuple(s.ref for s in hosts), per))
            gfree[key] -= per * len(hosts)
            tot_free -= per * len(hosts)
            done.add(pick.run_id)
            if pick is run:
                i += 1
            continue
        if can_provision:
            waiting.append(run)
        done.add(run.run_id)
        i += 1
        if not have_head:
            # The reservation only guards the head's own instances, so only runs of its
            # model and market need it; it is computed when the first such run comes.
            have_head = True
            head_key = key
            head_todo = (run, dur)
        elif not can_provision and not bound_checked and head_todo is None:
            bound_checked = True
            cands = _backfill_candidates(
                ordering, ordered, slots, gfree, head_key, head_t, head_extra, unknown
            )
            if not cands:
                break
            if ordering.uniform:
                ordered, i = Lazy(iter(sorted(cands, key=ordering.key)), len(cands)), 0

    if not waiting or (headroom < smallest and not any(i.gpus <= headroom for i in stopped)):
        return actions
    actions.extend(provision(waiting, slots, stopped, headroom, now, catalog, config))
    return actions


_gpus_key = attrgetter("gpus")

# A place's cost to the fleet: (the paid instance-time it adds, valued in USD per GPU;
# whether it pins a rented instance that nothing pins yet). Compared in that order, so
# the second decides only at an equal first: among a sweep's equals, where one empty
# instance has room for some of them, the movable ones take it and the ones that cannot
# move wait, to be bundled onto an instance of their own (or join pinned room as it
# frees). Mixed, they would pin every instance the sweep touches; apart, the movable
# runs' instances can be emptied by consolidation as the fleet drains. Worth 0.910 ->
# 0.927 of the packing bound on the dev trace and 0.929 -> 0.951 on the small team's
# (issue 31's bench, honest world); nothing where every run or none checkpoints. A host
# the team owns (no hourly price) is never stopped, so pinning it costs nothing and the
# user's order stands there.
Fit = tuple[float, bool]
_FREE_FIT: Fit = (0.0, False)


def _backfill_candidates(
    ordering: Ordering,
    ordered: Lazy,
    slots: Mapping[tuple[str, str], list[Slot]],
    gfree: Mapping[tuple[str, str], int],
    head_key: tuple[str, str] | None,
    head_t: float,
    head_extra: Mapping[str, int],
    unknown: float,
) -> list[QueuedRun]:
    """The runs not yet looked at that could still fit some free GPUs beside the head.

    A superset (every run that can start is in it), found in one pass: behind a blocked
    head of a long queue, the free GPUs are too few on each instance, or promised to the
    head, for nearly every run, so the scan jumps to the few that might fit instead of
    failing through the rest."""
    # per group: GPUs usable for any duration (max over instances), and the instances
    # whose free GPUs are promised to the head, with how long a run may hold them
    groups: dict[tuple[str, str], tuple[int, int, list[tuple[int, float]], int, list[Slot]]] = {}
    for key, free in gfree.items():
        if free <= 0:
            continue
        open_ = [s for s in slots[key] if s.free > 0]
        any_cap = 0
        short: list[tuple[int, float]] = []
        for s in open_:
            if key != head_key or s.ref not in head_extra:
                cap = s.free
            else:
                cap = max(0, min(s.free, head_extra[s.ref]))
                short.append((s.free, head_t - s.ready))
            any_cap = max(any_cap, cap)
        big = max(s.gpus for s in slots[key])
        groups[key] = (any_cap, max(s.free for s in open_), short, big, open_)
    if not groups:
        return []
    seen = {r.run_id for r in ordered.items}
    out: list[QueuedRun] = []
    # by (model, spot) as the runs carry them, so the scan below builds no key strings;
    # a multi-host run's test depends only on its size and duration: asked once each
    by_run_key = {(model, market == "spot"): g for (model, market), g in groups.items()}
    multi_ok: dict[tuple[str, bool, int, float], bool] = {}
    # A user whose runs all need more than any instance has free (and fit on one) has
    # none to offer: most users, behind a blocked head; skipped at C speed.
    most_free = max(g[1] for g in groups.values())
    least_big = min(g[3] for g in groups.values())
    for runs in ordering.by_user.values():
        if min(map(_gpus_key, runs)) > most_free and max(map(_gpus_key, runs)) <= least_big:
            continue
        for r in runs:
            g = by_run_key.get((r.gpu_model, r.spot))
            if g is None:
                continue
            any_cap, max_free, short, big, open_ = g
            gpus = r.gpus
            if gpus <= big:
                if gpus > max_free:
                    continue
                if gpus > any_cap:
                    dur = unknown if r.est_duration_s is None else r.est_duration_s
                    if not any(gpus <= f and dur <= lim for f, lim in short):
                        continue
            else:
                dur = unknown if r.est_duration_s is None else r.est_duration_s
                mkey = (r.gpu_model, r.spot, gpus, dur)
                ok = multi_ok.get(mkey)
                if ok is None:
                    k = split_hosts(gpus, big)
                    per = gpus // k
                    n = sum(
                        1
                        for s in open_
                        if s.free >= per
                        and (
                            s.ref not in head_extra
                            or head_extra[s.ref] >= per
                            or s.ready + dur <= head_t
                        )
                    )
                    ok = multi_ok[mkey] = n >= k
                if not ok:
                    continue
            if r.run_id not in seen:
                out.append(r)
    return out


def _best_fit(
    run: QueuedRun,
    dur: float,
    group: list[Slot],
    now: float,
    config: SchedulerConfig,
    have_head: bool,
    head_t: float,
    head_extra: Mapping[str, int],
) -> tuple[list[Slot], int, Fit] | None:
    k, per = hosts_for(run, group)
    if k == 0:
        return None

    def allowed(s: Slot) -> bool:
        if s.free < per:
            return False
        if not have_head or s.ref not in head_extra:
            return True
        return s.ready + dur <= head_t or head_extra[s.ref] >= per

    pins = not run.preemptible and config.pin_cost > 0  # 0: the pinning rule is off

    def fit_pins(s: Slot) -> bool:
        """The Fit's second part: whether the run pins an instance nothing pins yet that
        is rented (only those are stopped to save money; pinning an owned one is free)."""
        return pins and not s.pinned and s.usd_hr > 0

    def cost(s: Slot) -> tuple[float, int, str]:
        # Paid instance-time the run adds, plus its wait valued like GPU time; then best
        # fit (fewest GPUs left over), so whole instances stay free for big runs. A run
        # that cannot be moved pins its instance until it ends: it joins another pinned
        # one where it can, and leaves instances of movable runs free to be emptied by
        # consolidation (priced as the instance-time pinned, as the run is predicted).
        end = s.ready + dur
        added = s.gpus * max(0.0, end - s.horizon)
        if pins and not s.pinned:  # fit_pins without the price: inlined, it runs per slot
            added = max(added, s.gpus * (end - max(now, s.ready)) * config.pin_cost)
        delay = config.wait_value * per * (s.ready - now)
        return ((added + delay) * s.usd_hr / s.gpus, s.free - per, s.ref)

    fits = [s for s in group if allowed(s)]
    if k == 1:
        if not fits:
            return None
        one = min(fits, key=cost)
        return [one], per, (cost(one)[0], fit_pins(one))
    by_type: dict[str, list[Slot]] = {}
    for s in fits:
        if s.gpus >= per:
            by_type.setdefault(s.type_name, []).append(s)
    best: tuple[Fit, list[Slot]] | None = None
    for same in by_type.values():
        if len(same) < k:
            continue
        pick = sorted(same, key=cost)[:k]
        c = (sum(cost(s)[0] for s in pick), any(fit_pins(s) for s in pick))
        if best is None or c < best[0]:
            best = (c, pick)
    return (best[1], per, best[0]) if best else None


def _reservation(
    run: QueuedRun, dur: float, group: list[Slot], now: float, config: SchedulerConfig
) -> tuple[float, dict[str, int]]:
    """When and where the head run could start on the warm fleet (EASY's shadow time).

    Free GPUs on an instance only grow as its runs end (nothing else is booked into the
    future), so the head's start on it is the first expected end that frees enough."""
    del dur
    k, per = hosts_for(run, group)
    if k == 0:
        return math.inf, {}
    cands: list[tuple[float, str, int]] = []
    unknown_end = now + config.unknown_duration_s
    for s in group:
        if s.inst is None or s.gpus < per:
            continue
        free = s.free
        t = s.ready
        if free < per and not s.placed and not s.inst.unknown_end_gpus:
            # the common case, from the instance's cached cumulative releases
            cum = s.inst.free_after_releases
            idx = bisect.bisect_left(cum, per)
            if idx == len(cum):
                continue
            t = max(s.inst.releases[idx][0], s.ready)
            free = cum[idx]
        elif free < per:
            rel: Iterable[tuple[float, int]] = s.inst.releases
            if s.inst.unknown_end_gpus or s.placed:
                extra = list(s.placed)
                if s.inst.unknown_end_gpus:
                    extra.append((unknown_end, s.inst.unknown_end_gpus))
                rel = sorted([*rel, *extra])
            t = math.inf
            for end, g in rel:
                free += g
                if free >= per:
                    t = max(end, s.ready)
                    break
            if t == math.inf:
                continue
        cands.append((t, s.ref, free - per))
    if len(cands) < k:
        return math.inf, {}
    cands.sort()
    chosen = cands[:k]
    t_h = chosen[-1][0]
    return t_h, {ref: extra for (_, ref, extra) in chosen}
