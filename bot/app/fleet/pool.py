"""`/gpu pool`: the pool's instance types with what runs and what it costs now, and the
admins' caps per type (PoolLimit rows over the settings); and the Supply of a pool that
can grow (CatalogSupply)."""

from __future__ import annotations

import logging
from typing import Any

from sqlmodel import col, func, select

from bot.app.access import audit
from bot.app.fleet.common import RUNNING_STATES
from bot.app.money.prices import priced_catalog
from bot.app.service import Actor, GpuService
from bot.domain import views
from bot.domain.commands import Pool
from bot.domain.errors import UserError
from bot.domain.scheduling import split_hosts
from db.models import HOST_STOPPED, HOST_TERMINATED, Gpu, Host, PoolLimit
from db.session import transaction
from provisioning.catalog import Catalog

log = logging.getLogger(__name__)

POOL_USAGE = "/gpu pool  |  /gpu pool set TYPE max=N spend=USD"


class CatalogSupply:
    """The Supply of a cloud pool (`bot.app.ports.Supply`): a model the catalog can launch
    is a model the pool can have, so a reservation or a run for it waits for the fleet
    (the scheduler's Launch buys it) where a fixed pool must refuse it up front. A
    reservation must fit one instance type; a run may span several of one type."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def can_have(self, model: str, gpus: int) -> bool:
        return launchable(self.catalog, model, gpus)

    def can_run(self, model: str, gpus: int) -> bool:
        return launchable(self.catalog, model, gpus, across=True)

    def offered(self) -> list[str]:
        return self.catalog.models()


def launchable(catalog: Catalog, model: str, gpus: int, *, across: bool = False) -> bool:
    """True when some instance type carries `gpus` GPUs of `model` on one machine, or,
    `across` (a run: torchrun spans hosts, a reservation cannot), on several instances
    of one type."""
    if across:
        return instances_for(catalog, model, gpus) is not None
    return any(t.gpus >= gpus for t in catalog.for_model(model))


def instances_for(
    catalog: Catalog, model: str, gpus: int, prefer: str | None = None
) -> tuple[int, int, str | None] | None:
    """(instances, GPUs on each, the instance type they must share) that hold `gpus` GPUs
    of `model`: one instance where one type holds them all (any such type: None), else
    the fewest instances of `prefer` (the scheduler's pick) or of the model's largest
    type, by the scheduler's own split (even shares). None where the catalog has no type
    of `model`."""
    types = catalog.for_model(model)
    if not types:
        return None
    if any(t.gpus >= gpus for t in types):
        return 1, gpus, prefer
    pick = next((t for t in types if t.instance_type == prefer), None)
    if pick is None:
        pick = max(types, key=lambda t: (t.gpus, -t.ondemand_usd_hr))
    k = split_hosts(gpus, pick.gpus)
    return k, gpus // k, pick.instance_type


def pool(service: GpuService, actor: Actor, cmd: Pool) -> views.Reply:
    if cmd.instance_type is None:
        return views.Reply(pool_view(service))
    if not actor.admin:
        raise UserError("Only an admin can change the pool limits.")
    if cmd.max_instances is None and cmd.max_usd_per_hour is None:
        raise UserError(
            "Say what to set: `max=N` instances and/or `spend=USD` per hour.", POOL_USAGE
        )
    catalog = priced_catalog(service.settings)
    if catalog.get(cmd.instance_type) is None:
        raise UserError(
            f"`{cmd.instance_type}` is not an instance type the catalog knows; "
            "`/gpu prices` lists them.",
            POOL_USAGE,
        )
    now = service.clock.now()
    with transaction(service.engine) as s:
        row = s.get(PoolLimit, cmd.instance_type) or PoolLimit(instance_type=cmd.instance_type)
        if cmd.max_instances is not None:
            row.max_instances = cmd.max_instances
        if cmd.max_usd_per_hour is not None:
            row.max_usd_per_hour = cmd.max_usd_per_hour
        row.updated_by = actor.key
        row.updated_at = now
        s.add(row)
        caps = f"max={row.max_instances} spend={row.max_usd_per_hour}"
        audit(actor, "pool-set", f"{cmd.instance_type} {caps}", session=s)
    return views.Reply(pool_view(service, changed=cmd.instance_type), ephemeral=False)


def pool_view(service: GpuService, changed: str | None = None) -> views.View:
    """Each instance type in use or limited: instances running/stopped, GPUs, $/h now, caps."""
    settings = service.settings
    rows: dict[str, dict[str, Any]] = {}
    with transaction(service.engine, write=False) as s:
        limits = {p.instance_type: p for p in s.exec(select(PoolLimit))}
        for h in s.exec(
            select(Host).where(Host.state != HOST_TERMINATED, col(Host.instance_type).is_not(None))
        ):
            assert h.instance_type is not None
            r = rows.setdefault(h.instance_type, {"run": 0, "stop": 0, "gpus": 0, "usd": 0.0})
            n_gpus = s.exec(
                select(func.count())
                .select_from(Gpu)
                .where(Gpu.host_id == h.id, col(Gpu.present).is_(True))
            ).one()
            if h.state in RUNNING_STATES:
                r["run"] += 1
                r["gpus"] += int(n_gpus)
                r["usd"] += h.hourly_usd
            elif h.state == HOST_STOPPED:
                r["stop"] += 1
        for itype in limits:
            rows.setdefault(itype, {"run": 0, "stop": 0, "gpus": 0, "usd": 0.0})
    table_rows = []
    total = 0.0
    for itype in sorted(rows):
        r = rows[itype]
        lim = limits.get(itype)
        max_n = lim.max_instances if lim and lim.max_instances is not None else None
        spend = lim.max_usd_per_hour if lim and lim.max_usd_per_hour is not None else None
        n_text = str(max_n) if max_n is not None else f"{settings.pool_max_instances} (default)"
        cap = spend if spend is not None else settings.pool_max_usd_per_hour
        s_text = f"${cap:.2f}/h" if cap else "no cap"
        if spend is None:
            s_text += " (default)"
        total += r["usd"]
        table_rows.append(
            (
                itype,
                str(r["run"]),
                str(r["stop"]),
                str(r["gpus"]),
                f"${r['usd']:.2f}",
                n_text,
                s_text,
            )
        )
    blocks: list[views.Block] = [views.Header("GPU pool")]
    if changed is not None:
        blocks.append(views.Text(f"Pool limit for `{changed}` updated."))
    if table_rows:
        blocks.append(
            views.Table(
                ("type", "running", "stopped", "GPUs", "$/h now", "max instances", "max spend"),
                tuple(table_rows),
            )
        )
    else:
        blocks.append(views.Text("No instances and no limits yet."))
    default_spend = (
        f"${settings.pool_max_usd_per_hour:.2f}/h" if settings.pool_max_usd_per_hour else "no cap"
    )
    blocks.append(
        views.Context(
            f"Running now: ${total:.2f}/h. Defaults per type: {settings.pool_max_instances} "
            f"instances, {default_spend}. Admins: `/gpu pool set TYPE max=N spend=USD`."
        )
    )
    summary = ", ".join(f"{t[0]}: {t[1]} running, {t[2]} stopped" for t in table_rows)
    text = f"GPU pool: {summary or 'no instances'}; ${total:.2f}/h now."
    if changed is not None:
        text = f"Pool limit for {changed} updated. " + text
    return views.View(text=text, blocks=tuple(blocks))
