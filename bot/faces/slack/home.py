"""The App Home tab: your reservations and runs, your GPU cost this week, and the
team's waiting line.

It is composed from the core's status view rather than from database reads of its
own, so Home can never disagree with `/gpu status`.
"""

from __future__ import annotations

import logging

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError

from bot.app.service import Actor, GpuService
from bot.domain import views
from bot.domain.commands import Queue, Status
from bot.faces.slack.blocks import VIEW, render_blocks

log = logging.getLogger(__name__)


def home_view(service: GpuService, actor: Actor) -> views.View:
    full = service.status(actor, Status(mine_only=False)).view
    blocks: list[views.Block] = [views.Header("gpubot")]
    summary = next((b.text for b in full.blocks if isinstance(b, views.Context)), full.text)
    blocks.append(views.Context(summary))
    blocks.append(views.Text("*Your reservations*"))
    yours = next(
        (b for b in full.blocks if isinstance(b, views.Text) and b.text.startswith("*Yours*")),
        None,
    )
    if yours is not None:
        blocks.append(views.Text(yours.text.removeprefix("*Yours*\n")))
    else:
        blocks.append(
            views.Text("You hold no GPUs and are not waiting. `/gpu reserve` asks for one.")
        )
    blocks.append(
        views.Context(
            "Release or extend with `/gpu release ID` and `/gpu extend ID 1h`, "
            "or the buttons on the reply you got when it was granted."
        )
    )
    blocks.append(views.Divider())
    blocks.append(views.Text("*Your runs*"))
    blocks.extend(_runs_blocks(service, actor))
    _, costs, _ = service.costs("week", actor.key)
    blocks.append(
        views.Text(f"*Your cost this week*\n${costs.get(actor.key, 0):,.2f} (`/gpu cost` for more)")
    )
    blocks.append(views.Divider())
    blocks.append(views.Text("*The team's waiting line*"))
    waiting_at = next(
        (
            i
            for i, b in enumerate(full.blocks)
            if isinstance(b, views.Text) and b.text == "*Waiting*"
        ),
        None,
    )
    table = (
        full.blocks[waiting_at + 1]
        if waiting_at is not None and waiting_at + 1 < len(full.blocks)
        else None
    )
    if isinstance(table, views.Table):
        blocks.append(table)
    else:
        blocks.append(views.Text("Nobody is waiting."))
    blocks.append(views.Context("`/gpu status` shows every host and GPU."))
    return views.View(text=f"gpubot: {summary}", blocks=tuple(blocks))


def _runs_blocks(service: GpuService, actor: Actor) -> list[views.Block]:
    """The caller's queued and running runs, as `/gpu queue me` shows them."""
    if service.runs is None:
        return [views.Text("This gpubot has no hosts that can run training.")]
    mine = service.runs.queue(actor, Queue(mine_only=True)).view
    tables = [b for b in mine.blocks if isinstance(b, views.Table)]
    if not tables:
        return [views.Text("No runs queued or running. `/gpu run --recipe digits` tries one.")]
    return [*tables, views.Context("`/gpu cancel ID` stops one; `/gpu logs ID` shows its log.")]


def publish_home(client: WebClient, service: GpuService, actor: Actor) -> bool:
    """Publishes the caller's Home; a failure is logged and not raised, since Home is a
    convenience that must never turn a command that worked into an error."""
    view = home_view(service, actor)
    try:
        client.views_publish(
            user_id=actor.key,
            view={"type": "home", "blocks": render_blocks(view, VIEW)},
        )
    except SlackApiError as exc:
        log.warning("views.publish for %s failed: %s", actor.key, exc.response.get("error"))
        return False
    except OSError as exc:
        log.warning("views.publish for %s failed: %s", actor.key, type(exc).__name__)
        return False
    return True
