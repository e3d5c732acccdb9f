"""From a line of text to a reply, for every face: parse, call the use case, and
turn failures into words. A `UserError` becomes a short ephemeral error with the
verb's usage; anything else is logged with a reference id, and the user sees
only that id. No input reaches a user as a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from decimal import Decimal
from functools import lru_cache

from bot.app.burst.summary import burst_line
from bot.app.fleet import pool as fleet_pool
from bot.app.money.advice import Totals
from bot.app.money.billing import team_cost_view
from bot.app.money.budgets import budget_command
from bot.app.money.prices import priced_catalog
from bot.app.money.recommend import recommend_view
from bot.app.runs import RunService
from bot.app.service import Actor, GpuService
from bot.app.watching.idle import keep as idle_keep
from bot.app.watching.utilization import util_reply
from bot.domain import views
from bot.domain.commands import (
    Budget,
    Cancel,
    Cloud,
    Command,
    Cost,
    Extend,
    Help,
    Logs,
    Pool,
    Prices,
    Queue,
    Recommend,
    Release,
    Reserve,
    Run,
    Status,
    Util,
    parse,
)
from bot.domain.errors import UserError, failure_message
from bot.domain.metering import money
from provisioning.catalog import Catalog

log = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def _catalog() -> Catalog:
    # Model names only (bot.app.money.prices: a refresh does not change them).
    return Catalog.load()


def normalize_model(text: str) -> str | None:
    """User-typed GPU model to the catalog's name; `cpu` names the local CPU slots."""
    if text.lower() in {"cpu", "cpus"}:
        return "cpu"
    return _catalog().normalize_model(text)


def known_models() -> tuple[str, ...]:
    return (*_catalog().models(), "cpu")


def parse_text(text: str) -> Command:
    return parse(text, normalize_model=normalize_model, known_models=known_models())


def handle_text(
    service: GpuService, actor: Actor, text: str, request_key: str | None = None
) -> views.Reply:
    try:
        command = parse_text(text)
        return execute(service, actor, command, request_key)
    except UserError as exc:
        return views.error(exc.text)
    except Exception as exc:
        verb = text.strip().removeprefix("/gpu").strip().split(" ", 1)[0][:20]
        return views.error(failure_message(exc, f"/gpu {verb} by {actor.key}"))


def execute(
    service: GpuService, actor: Actor, command: Command, request_key: str | None = None
) -> views.Reply:
    # Every verb has a handler (tests/core/test_dispatch.py checks the table is whole).
    reply = _HANDLERS[type(command)](service, actor, command, request_key)
    if isinstance(command, _FREES_OR_ADDS_WORK) and not reply.error:
        service.nudge()  # runs start at once, not on the next tick
    return reply


# Verbs after which a placement may start something: a new run, GPUs given back, a run
# stopping (its GPUs come back when the runner exits, seen by the next poll).
_FREES_OR_ADDS_WORK = (Run, Release, Cancel)


def _help(service: GpuService, actor: Actor, cmd: Command, key: str | None) -> views.Reply:
    assert isinstance(cmd, Help)
    return views.Reply(views.help_view(cmd.topic))


def _status(service: GpuService, actor: Actor, cmd: Command, key: str | None) -> views.Reply:
    assert isinstance(cmd, Status)
    return service.status(actor, cmd)


def _reserve(service: GpuService, actor: Actor, cmd: Command, key: str | None) -> views.Reply:
    assert isinstance(cmd, Reserve)
    return service.reserve(actor, cmd, request_key=key)


def _release(service: GpuService, actor: Actor, cmd: Command, key: str | None) -> views.Reply:
    assert isinstance(cmd, Release)
    return service.release(actor, cmd)


def _extend(service: GpuService, actor: Actor, cmd: Command, key: str | None) -> views.Reply:
    assert isinstance(cmd, Extend)
    return service.extend(actor, cmd)


def _prices(service: GpuService, actor: Actor, cmd: Command, key: str | None) -> views.Reply:
    assert isinstance(cmd, Prices)
    return views.Reply(views.prices_view(priced_catalog(service.settings), cmd.model))


def _recommend(service: GpuService, actor: Actor, cmd: Command, key: str | None) -> views.Reply:
    assert isinstance(cmd, Recommend)
    return views.Reply(recommend_view(priced_catalog(service.settings), cmd))


def _runs(service: GpuService, what: str) -> RunService:
    if service.places.runs is None:  # a bot of listed hosts: reservations only
        raise UserError(
            f"`/gpu {what}` needs hosts that can run training; none is configured here."
        )
    return service.runs


def _run(service: GpuService, actor: Actor, cmd: Command, key: str | None) -> views.Reply:
    assert isinstance(cmd, Run)
    return _runs(service, "run").submit(actor, cmd, request_key=key)


def _queue(service: GpuService, actor: Actor, cmd: Command, key: str | None) -> views.Reply:
    assert isinstance(cmd, Queue)
    return _runs(service, "queue").queue(actor, cmd)


def _cancel(service: GpuService, actor: Actor, cmd: Command, key: str | None) -> views.Reply:
    assert isinstance(cmd, Cancel)
    return _runs(service, "cancel").cancel(actor, cmd)


def _logs(service: GpuService, actor: Actor, cmd: Command, key: str | None) -> views.Reply:
    assert isinstance(cmd, Logs)
    return _runs(service, "logs").logs(actor, cmd)


def _cost(service: GpuService, actor: Actor, cmd: Command, key: str | None) -> views.Reply:
    assert isinstance(cmd, Cost)
    # What the providers add about prices (a cluster whose rate is not set).
    note = service.display.cost_note()
    if cmd.scope == "team":
        catalog = priced_catalog(service.settings)
        bill = service.team_bill(cmd.period, catalog)
        view = team_cost_view(bill, cmd.period, service.settings.timezone)
        if cmd.period == "week":  # the week so far's wastes and what a setting would save
            from bot.faces.replay import team_week_blocks  # the simulator: only when asked

            view = views.View(
                view.text,
                view.blocks
                + team_week_blocks(
                    service, bill.window, catalog, Totals(bill.instances, bill.held, bill.idle)
                ),
            )
        if service.places.bursting:
            view = views.View(view.text, view.blocks + _sides_blocks(service, cmd.period))
        return views.Reply(view).with_note(note)
    who = actor.key if cmd.scope == "me" else (cmd.user.key if cmd.user else None)
    window, costs, names = service.costs(cmd.period, None if cmd.scope == "team" else who)
    if cmd.scope == "user" and who not in names and who is not None:
        names[who] = who
    tz = service.settings.timezone
    reply = views.Reply(views.cost_view(cmd.scope, cmd.period, window, costs, names, tz, who))
    if service.places.bursting and who is not None and costs.get(who):
        sides, _, _ = service.cost_sides(cmd.period, who)
        owned, bought = sides.get(who, (Decimal(0), Decimal(0)))
        cloud = _cloud_label(service)
        reply = reply.with_note(
            f"Of it, {money(owned)} on the team's own GPUs (at the team's rates) and "
            f"{money(bought)} on {cloud}."
        )
    return reply.with_note(note)


def _cloud_label(service: GpuService) -> str:
    cloud = service.places.cloud
    return service.places.label(cloud.name) if cloud is not None else "the cloud"


def _sides_blocks(service: GpuService, period: str) -> tuple[views.Block, ...]:
    """`/gpu cost team` where owned places come first and a cloud after: each person's
    use of the team's own GPUs beside their cloud bill, and what bursting did."""
    sides, names, bursting = service.cost_sides(period)
    cloud = _cloud_label(service)
    blocks: list[views.Block] = []
    if sides:
        blocks.append(views.Text(f"*The team's own GPUs and {cloud}, per person*"))
        blocks.append(
            views.Table(
                ("who", "own GPUs", cloud),
                tuple(
                    (names.get(k, k), money(owned), money(bought))
                    for k, (owned, bought) in sides.items()
                ),
            )
        )
    if bursting is not None:
        blocks.append(views.Text(burst_line(bursting, cloud)))
    return tuple(blocks)


def _budget(service: GpuService, actor: Actor, cmd: Command, key: str | None) -> views.Reply:
    assert isinstance(cmd, Budget)
    return budget_command(service, actor, cmd)


def _util(service: GpuService, actor: Actor, cmd: Command, key: str | None) -> views.Reply:
    assert isinstance(cmd, Util)
    if cmd.keep is not None:
        return idle_keep(service, actor, cmd.keep)
    return util_reply(service, actor, cmd.host, key)


def _cloud(service: GpuService, actor: Actor, cmd: Command, key: str | None) -> views.Reply:
    assert isinstance(cmd, Cloud)
    bursts = service.bursts
    if bursts is None:
        raise UserError(
            "This bot has no owned GPUs with a cloud after them, so nothing is offered: "
            "runs go where they can (GPUBOT_PROVIDERS=slurm,aws or ssh,aws sets up both)."
        )
    if cmd.user is not None and cmd.policy is not None:
        return bursts.set_policy(actor, cmd.user.key, cmd.policy)
    if cmd.run_id is None:
        return bursts.list_for(actor)
    return bursts.answer(actor, cmd.run_id, cmd.take, reservation=cmd.reservation)


def _pool(service: GpuService, actor: Actor, cmd: Command, key: str | None) -> views.Reply:
    assert isinstance(cmd, Pool)
    return fleet_pool(service, actor, cmd)


_Handler = Callable[[GpuService, Actor, Command, "str | None"], views.Reply]
_HANDLERS: dict[type, _Handler] = {
    Help: _help,
    Status: _status,
    Reserve: _reserve,
    Release: _release,
    Extend: _extend,
    Prices: _prices,
    Recommend: _recommend,
    Run: _run,
    Queue: _queue,
    Cancel: _cancel,
    Logs: _logs,
    Cost: _cost,
    Util: _util,
    Budget: _budget,
    Pool: _pool,
    Cloud: _cloud,
}
