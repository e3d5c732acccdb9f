"""The App Home tab: your reservations and runs, your GPU cost this week, and the
team's waiting line.

The pool's part is the core's Home read (`GpuService.home`: counts, not a row per
GPU), worded by the status view's own functions (`views.fleet_summary`,
`yours_lines`, `waiting_table`), so Home can never disagree with `/gpu status`.
"""

from __future__ import annotations

import logging

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError

from bot.app.service import Actor, GpuService
from bot.domain import views
from bot.domain.commands import Queue
from bot.faces.slack.blocks import VIEW, render_blocks

log = logging.getLogger(__name__)


def home_view(service: GpuService, actor: Actor) -> views.View:
    snap = service.home(actor)
    blocks: list[views.Block] = [views.Header("gpubot")]
    summary = views.fleet_summary(snap.fleet, len(snap.waiting))
    blocks.append(views.Context(summary))
    blocks.append(views.Text("*Your reservations*"))
    if snap.mine:
        blocks.append(views.Text(views.yours_lines(snap.mine, snap.now, snap.tz)))
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
    blocks.append(
        views.Text(f"*Your cost this week*\n${snap.week_usd:,.2f} (`/gpu cost` for more)")
    )
    blocks.append(views.Divider())
    blocks.append(views.Text("*The team's waiting line*"))
    if snap.waiting:
        blocks.append(views.waiting_table(snap.waiting, snap.now))
    else:
        blocks.append(views.Text("Nobody is waiting."))
    blocks.append(views.Context("`/gpu status` shows every host and GPU."))
    return views.View(text=f"gpubot: {summary}", blocks=tuple(blocks))


def _runs_blocks(service: GpuService, actor: Actor) -> list[views.Block]:
    """The caller's queued and running runs, as `/gpu queue me` shows them."""
    if service.places.runs is None:
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
