"""What a reply says, as data.

Builders here are pure functions from domain objects to a `View`; the Slack face
renders a View as Block Kit, the terminal as text, and the outbox stores it as
JSON (`to_dict`/`from_dict`) so a notification written before a crash is
rendered the same after it. Nothing here knows Slack's limits: renderers cut.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Literal

from bot.domain.commands import VERBS
from bot.domain.durations import format_duration
from bot.domain.readmodels import FleetCounts, HostState, ReservationInfo, StatusSnapshot
from bot.domain.timefmt import days, when
from provisioning.catalog import Catalog

# --- the blocks -------------------------------------------------------------------


@dataclass(frozen=True)
class Header:
    text: str
    type: Literal["header"] = "header"


@dataclass(frozen=True)
class Text:
    """A paragraph; `*bold*` and `code` in backticks are the only markup (both faces read them)."""

    text: str
    type: Literal["text"] = "text"


@dataclass(frozen=True)
class Fields:
    items: tuple[tuple[str, str], ...]
    type: Literal["fields"] = "fields"


@dataclass(frozen=True)
class Table:
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    type: Literal["table"] = "table"


@dataclass(frozen=True)
class Code:
    text: str
    type: Literal["code"] = "code"


@dataclass(frozen=True)
class Context:
    text: str
    type: Literal["context"] = "context"


@dataclass(frozen=True)
class Divider:
    type: Literal["divider"] = "divider"


@dataclass(frozen=True)
class Button:
    label: str
    action_id: str
    value: str
    style: Literal["primary", "danger"] | None = None
    # The /gpu line that does the same, for faces without buttons (the terminal).
    command: str | None = None


@dataclass(frozen=True)
class Actions:
    buttons: tuple[Button, ...]
    type: Literal["actions"] = "actions"


Block = Header | Text | Fields | Table | Code | Context | Divider | Actions


@dataclass(frozen=True)
class View:
    # Plain-text summary: notification text, fallback for clients without blocks.
    text: str
    blocks: tuple[Block, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "blocks": [asdict(b) for b in self.blocks]}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> View:
        return View(
            text=str(data.get("text", "")), blocks=tuple(_block(b) for b in data.get("blocks", []))
        )


def _block(data: dict[str, Any]) -> Block:
    kind = data.get("type")
    if kind == "header":
        return Header(data["text"])
    if kind == "text":
        return Text(data["text"])
    if kind == "fields":
        return Fields(tuple((str(a), str(b)) for a, b in data["items"]))
    if kind == "table":
        return Table(tuple(data["columns"]), tuple(tuple(r) for r in data["rows"]))
    if kind == "code":
        return Code(data["text"])
    if kind == "context":
        return Context(data["text"])
    if kind == "divider":
        return Divider()
    if kind == "actions":
        return Actions(tuple(Button(**b) for b in data["buttons"]))
    raise ValueError(f"unknown block type {kind!r}")


@dataclass(frozen=True)
class Reply:
    """A view and who sees it: the caller alone (ephemeral) or the channel."""

    view: View
    ephemeral: bool = True
    # Set when the reply is an error, so faces can style it and tests can tell.
    error: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def with_note(self, note: str | None) -> Reply:
        """The same reply with a sentence of context after its first block (a choice the
        bot made for the caller, said where they read the result); unchanged for None."""
        if not note:
            return self
        blocks = (*self.view.blocks[:1], Context(note), *self.view.blocks[1:])
        return replace(self, view=View(text=f"{self.view.text} {note}", blocks=blocks))


# --- action ids shared with the Slack face -------------------------------------

ACTION_RELEASE = "gpubot_release"
ACTION_EXTEND = "gpubot_extend_1h"
ACTION_CANCEL_RUN = "gpubot_cancel_run"


def cancel_run_button(run_id: int) -> Actions:
    return Actions(
        (Button("Cancel run", ACTION_CANCEL_RUN, str(run_id), "danger", f"/gpu cancel {run_id}"),)
    )


# --- formatting helpers ------------------------------------------------------------


def clip(text: str, limit: int) -> str:
    """Cut to `limit` characters, saying so with "…"."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


_PLAIN_WORD = re.compile(r"[\w@%+=:,./-]+")


def command_phrase(command: str, limit: int = 60) -> str:
    """A run's command as a person would type it, for reading, never for running.

    The stored command is one shell line quoted for dash (`shlex.quote`: `'print('"'"'hi'"'"')'`);
    shown, each word is bare when it can be, in double quotes when that needs no escape,
    and only otherwise in the shell's own quoting. Cut with "…".
    """
    try:
        words = shlex.split(command)
    except ValueError:  # not one of ours (hand-written row): show it as stored
        return clip(command, limit)
    shown = []
    for word in words:
        if word and _PLAIN_WORD.fullmatch(word):
            shown.append(word)
        elif not any(c in word for c in '"$`\\!'):
            shown.append(f'"{word}"')
        else:
            shown.append(shlex.quote(word))
    return clip(" ".join(shown), limit)


def run_what(recipe: str | None, command: str, limit: int = 60) -> str:
    """`recipe digits` or the command in backticks: how every reply names a run."""
    if recipe:
        return f"recipe {recipe}"
    return f"`{command_phrase(command, limit)}`"


def gpu_phrase(count: int, model: str | None) -> str:
    what = model if model and model != "cpu" else ("CPU slot" if model == "cpu" else "GPU")
    if model == "cpu":
        return f"{count} CPU slot" + ("s" if count != 1 else "")
    if model:
        return f"{count}× {what}"
    return f"{count} GPU" + ("s" if count != 1 else "")


def error(text: str) -> Reply:
    return Reply(View(text=text, blocks=(Text(text),)), ephemeral=True, error=True)


def message(text: str, ephemeral: bool = True) -> Reply:
    return Reply(View(text=text, blocks=(Text(text),)), ephemeral=ephemeral)


# --- help ------------------------------------------------------------------------------


def help_view(topic: str | None) -> View:
    if topic is None:
        rows = tuple(
            (f"`{spec.usage.split(' [')[0].split(' -')[0]}`", spec.summary)
            for spec in VERBS.values()
        )
        blocks: list[Block] = [
            Header("gpubot: share the team's GPUs"),
            Text("Reserve a GPU, queue a training run, see who holds what and what it costs."),
            Table(("command", "what it does"), rows),
            Text(
                "Try `/gpu reserve a100 for 3h`, `/gpu status`, `/gpu release`. "
                "`/gpu help VERB` shows the options and examples of one verb."
            ),
        ]
        return View(text="gpubot commands: " + ", ".join(VERBS), blocks=tuple(blocks))
    spec = VERBS[topic]
    blocks = [Header(f"/gpu {topic}"), Text(spec.summary[0].upper() + spec.summary[1:] + ".")]
    blocks.append(Code(spec.usage))
    if spec.details:
        blocks.append(Text(spec.details))
    blocks.append(Text("*Examples*"))
    blocks.append(Code("\n".join(spec.examples)))
    return View(text=f"{spec.usage} — {spec.summary}", blocks=tuple(blocks))


# --- reservations -----------------------------------------------------------------


def _how_to_use(res: ReservationInfo) -> list[Block]:
    host = res.host
    if host is None:
        return []
    if res.how:  # its provider's own lines (a cluster's holding job)
        return [Text("*How to use them*"), Code("\n".join(res.how))]
    devices = ",".join(str(i) for i in res.gpu_indexes)
    is_cpu = all(m == "cpu" for m in res.gpu_models)
    lines = []
    if host.address:
        target = f"{host.ssh_user}@{host.address}" if host.ssh_user else host.address
        port = f" -p {host.ssh_port}" if host.ssh_port not in (0, 22) else ""
        lines.append(f"ssh{port} {target}")
    if is_cpu:
        lines.append('export CUDA_VISIBLE_DEVICES=""   # CPU slot: no GPU on this host')
    else:
        lines.append(f"export CUDA_VISIBLE_DEVICES={devices}")
    return [Text("*How to use them*"), Code("\n".join(lines))]


def _res_buttons(res: ReservationInfo) -> Actions:
    return Actions(
        (
            Button("Extend 1h", ACTION_EXTEND, str(res.id), "primary", f"/gpu extend {res.id} 1h"),
            Button("Release", ACTION_RELEASE, str(res.id), "danger", f"/gpu release {res.id}"),
        )
    )


def _devices(res: ReservationInfo) -> str:
    label = "CPU slot" if all(m == "cpu" for m in res.gpu_models) else "GPU"
    plural = "s" if len(res.gpu_indexes) != 1 else ""
    models = sorted(set(res.gpu_models))
    model = "" if label == "CPU slot" else f" {'/'.join(models)}"
    return f"{label}{plural}{model} {', '.join(str(i) for i in res.gpu_indexes)}"


def granted_view(res: ReservationInfo, now: datetime, tz: str, was_waiting: bool = False) -> View:
    assert res.host is not None and res.ends_at is not None
    lead = "Your turn: granted" if was_waiting else "Reserved"
    summary = (
        f"{lead}: reservation #{res.id}, {_devices(res)} on {res.host.name}, "
        f"until {when(res.ends_at, now, tz)}."
    )
    blocks: list[Block] = [Text(summary), *_how_to_use(res), _res_buttons(res)]
    return View(text=summary, blocks=tuple(blocks))


def waiting_view(res: ReservationInfo, why: Sequence[str] = ()) -> View:
    """`why`: what keeps hosts that have such GPUs from granting them (bot.app.service's
    reservations: a host not answered yet, or down), one sentence each."""
    ahead = (res.position or 1) - 1
    queue = "you are first in line" if ahead == 0 else f"{ahead} ahead of you"
    text = (
        f"Nothing free for {gpu_phrase(res.gpu_count, res.gpu_model)} right now. Reservation #{res.id} "
        f"is waiting ({queue}); I'll DM you when it is granted. "
        f"`/gpu release {res.id}` leaves the line."
    )
    blocks: tuple[Block, ...] = (Text(text),)
    if why:
        blocks += (Context(" ".join(why)),)
        text += " " + " ".join(why)
    return View(text=text, blocks=blocks)


def already_view(res: ReservationInfo, now: datetime, tz: str) -> View:
    """The answer to a retried request: what the first delivery created, unchanged."""
    if res.state == "active":
        return granted_view(res, now, tz)
    if res.state == "waiting":
        return waiting_view(res)
    text = f"Reservation #{res.id} is {res.state}."
    return View(text=text, blocks=(Text(text),))


def released_view(items: list[ReservationInfo], actor_key: str) -> View:
    parts = []
    for r in items:
        whose = "" if r.user_key == actor_key else f" (held by {r.user_name})"
        what = "left the line" if r.state == "cancelled" else "released"
        parts.append(f"#{r.id}{whose} {what}")
    text = "Done: " + "; ".join(parts) + "."
    return View(text=text, blocks=(Text(text),))


def released_by_admin_dm(res: ReservationInfo, admin_name: str) -> View:
    text = f"{admin_name} released your reservation #{res.id} ({_devices(res)})."
    return View(text=text, blocks=(Text(text),))


def extended_view(res: ReservationInfo, now: datetime, tz: str, added: timedelta) -> View:
    assert res.ends_at is not None
    text = f"Reservation #{res.id} extended by {format_duration(added)}: now until {when(res.ends_at, now, tz)}."
    return View(text=text, blocks=(Text(text),))


def expiry_warning_view(res: ReservationInfo, now: datetime, tz: str) -> View:
    assert res.ends_at is not None
    text = (
        f"Reservation #{res.id} ({_devices(res)} on {res.host.name if res.host else '?'}) "
        f"ends {when(res.ends_at, now, tz)}. `/gpu extend {res.id} 1h` keeps it longer."
    )
    return View(text=text, blocks=(Text(text), _res_buttons(res)))


def expired_view(res: ReservationInfo) -> View:
    text = f"Reservation #{res.id} ended; its GPUs went back to the pool."
    return View(text=text, blocks=(Text(text),))


def status_view(snap: StatusSnapshot) -> View:
    now = snap.now
    blocks: list[Block] = [Header("GPU status")]
    summary = fleet_summary(FleetCounts.of(snap.hosts), len(snap.waiting))
    blocks.append(Context(summary))
    hosts = snap.hosts
    if snap.mine_only:
        keys = {r.host.name for r in snap.mine if r.host is not None}
        hosts = tuple(h for h in hosts if h.name in keys)
    for host in hosts:
        blocks.append(Text(_host_line(host, now, snap.tz)))
        rows = []
        for g in host.gpus:
            if g.holder is None:
                rows.append((str(g.index), g.model, _idle_word(host.state), ""))
            else:
                until = when(g.until, now, snap.tz) if g.until else ""
                ref = (
                    f" (#{g.reservation_id})"
                    if g.reservation_id
                    else (f" (run {g.run_id})" if g.run_id else "")
                )
                rows.append((str(g.index), g.model, f"{g.holder}{ref}", until))
        blocks.append(Table(("gpu", "model", "held by", "until"), tuple(rows)))
    if not hosts:
        blocks.append(Text(_no_hosts(snap)))
    blocks += [Context(note) for note in snap.notes]
    if snap.waiting and not snap.mine_only:
        blocks.append(Text("*Waiting*"))
        blocks.append(waiting_table(snap.waiting, now))
        for host in snap.hosts:
            trouble = host_trouble(host.state, host.down_since, host.down_reason, now, snap.tz)
            if trouble is not None and host.state != "ready":
                again = " again" if host.state == "unreachable" else ""
                blocks.append(
                    Context(
                        f"{host.name} is {trouble}; what waits for its GPUs gets them "
                        f"when it answers{again}."
                    )
                )
    if snap.mine:
        blocks.append(Text("*Yours*\n" + yours_lines(snap.mine, now, snap.tz)))
    return View(text=summary, blocks=tuple(blocks))


def fleet_summary(fleet: FleetCounts, waiting: int) -> str:
    """The status's first line, which App Home shows too: one function, so the two
    never word it, or count it, differently."""
    summary = f"{fleet.free_gpus} of {fleet.ready_gpus} free on {fleet.ready_hosts} host" + (
        "s" if fleet.ready_hosts != 1 else ""
    )
    if fleet.starting_gpus:
        summary += f"; {fleet.starting_gpus} starting up"
    # Stopped or unreachable: listed with their state, never counted as free.
    if fleet.away_gpus:
        summary += f"; {fleet.away_gpus} unavailable"
    if waiting:
        summary += f"; {waiting} waiting"
    return summary


def waiting_table(waiting: tuple[ReservationInfo, ...], now: datetime) -> Table:
    """The waiting line as the status and App Home both show it."""
    rows = tuple(
        (
            str(r.position or i + 1),
            f"#{r.id}",
            r.user_name,
            gpu_phrase(r.gpu_count, r.gpu_model),
            format_duration(timedelta(seconds=r.duration_s)),
            f"{format_duration(now - r.requested_at)}",
        )
        for i, r in enumerate(waiting)
    )
    return Table(("pos", "id", "who", "wants", "for", "waiting"), rows)


def yours_lines(mine: tuple[ReservationInfo, ...], now: datetime, tz: str) -> str:
    """The caller's open reservations, a line each, as the status and App Home show them."""
    lines = []
    for r in mine:
        if r.state == "active" and r.ends_at is not None:
            lines.append(
                f"#{r.id}: {_devices(r)} on {r.host.name if r.host else '?'} until {when(r.ends_at, now, tz)}"
            )
        else:
            lines.append(
                f"#{r.id}: waiting for {gpu_phrase(r.gpu_count, r.gpu_model)}, position {r.position}"
            )
    return "\n".join(lines)


def _idle_word(host_state: str) -> str:
    """What an unheld GPU is: free only on a ready host."""
    return {"ready": "free", "pending": "starting up", "checking": "not answered yet"}.get(
        host_state, host_state
    )


# What an empty pool that grows on demand (a cloud) says: nothing is wrong.
GROWS_ON_DEMAND = (
    "No instances are running: the first `/gpu reserve` or `/gpu run` launches one "
    "(`/gpu prices` lists what it costs)."
)


def _no_hosts(snap: StatusSnapshot) -> str:
    return "You hold no GPUs." if snap.mine_only else snap.empty_pool


def _host_line(host: HostState, now: datetime, tz: str) -> str:
    price = f", ${host.hourly_usd:.2f}/h" if host.hourly_usd else ""
    where = f" ({host.address})" if host.address else ""
    line = f"*{host.name}*{where}: {host.provider}, {host.state}{price}, {host.free}/{len(host.gpus)} free"
    trouble = host_trouble(host.state, host.down_since, host.down_reason, now, tz)
    if trouble is not None:
        line += f", {trouble}"
    elif host.note:
        line += f", {host.note}"
    return line


def down_phrase(since: datetime, reason: str | None, now: datetime, tz: str) -> str:
    """How a host marked down reads wherever work waits on it."""
    return f"down since {when(since, now, tz)}: {reason or 'no answer'}"


def host_trouble(
    state: str, down_since: datetime | None, reason: str | None, now: datetime, tz: str
) -> str | None:
    """What is wrong with a host, in the words every reply uses (status, the queue, a
    reservation left waiting), or None when nothing is: down (bot.app.hosts.hostcheck marked
    it), not answered its first check yet, or ready but not answering its last dial (it
    answered before, so it stays ready until its checks fail: one lost dial is no outage)."""
    if state == "checking":
        return (
            "not answered yet: it is being checked, and nothing is granted on it until it answers"
        )
    if down_since is None:
        return None
    if state == "ready":
        return (
            f"not answering since {when(down_since, now, tz)} ({reason or 'no answer'}); "
            "being checked"
        )
    return down_phrase(down_since, reason, now, tz)


def prices_view(catalog: Catalog, model: str | None) -> View:
    types = (
        catalog.for_model(model)
        if model
        else sorted(catalog.types, key=lambda t: (t.gpu_model, t.ondemand_usd_hr))
    )
    rows = tuple(
        (
            t.instance_type,
            f"{t.gpus}× {t.gpu_model} {t.gpu_mem_gb:g} GiB",
            f"${t.ondemand_usd_hr:.2f}",
            f"${t.ondemand_per_gpu_hr:.2f}",
            f"${t.spot_usd_hr:.2f}" if t.spot_usd_hr is not None else "—",
        )
        for t in types
    )
    if not rows:
        known = ", ".join(sorted({t.gpu_model for t in catalog.types}))
        what = (
            "CPU slots are this machine's own and cost nothing per hour" if model == "cpu" else ""
        )
        text = (
            f"{what or f'The catalog has no {model} instances'}; "
            f"the catalog prices these GPU models: {known}."
        )
        return View(text=text, blocks=(Text(text),))
    title = f"{model} prices" if model else "GPU instance prices"
    text = f"{title}: {len(rows)} instance types, on-demand and typical spot, USD per hour."
    blocks: tuple[Block, ...] = (
        Header(title),
        Table(("instance", "GPUs", "on-demand/h", "per GPU/h", "spot/h"), rows),
        Context(
            f"Source: {catalog.source}. As of: {as_of_phrase(catalog.as_of)}. "
            "Prices change; spot varies by zone."
            + (
                ""
                if catalog.shipped
                else " Using refreshed prices (`gpubot prices refresh`), not the shipped snapshot."
            )
        ),
    )
    return View(text=text, blocks=blocks)


def as_of_phrase(text: str) -> str:
    """The catalog's date without its pointer to a README this repository does not ship
    (`2025H2-or-later(snapshot;see README)` → `2025H2-or-later (snapshot)`)."""
    text = re.sub(r"\s*;?\s*see README\s*", "", text)
    return re.sub(r"(\S)\(", r"\1 (", text).replace("()", "").strip()


def cost_view(
    scope: str,
    period: str,
    window: Any,
    costs: dict[str, Any],
    names: dict[str, str],
    tz: str,
    who: str | None = None,
) -> View:
    """`/gpu cost`: what the GPUs held cost over a calendar period in the team's zone."""
    span = f"{days(window.start, window.end, tz)}, {tz}"
    label = {"today": "today", "week": "this week", "month": "this month"}[period]
    if scope != "team":
        key = who or ""
        amount = costs.get(key, 0)
        subject = "Your" if scope == "me" else f"{names.get(key, key)}'s"
        text = f"{subject} GPU cost {label} ({span}): ${amount:,.2f}."
        return View(text=text, blocks=(Text(text), Context(_COST_NOTE)))
    rows = tuple(
        (names.get(k, k), f"${v:,.2f}")
        for k, v in sorted(costs.items(), key=lambda kv: (-kv[1], kv[0]))
    )
    total = sum(costs.values(), 0)
    text = f"Team GPU cost {label} ({span}): ${total:,.2f} held by {len(rows)} people."
    blocks: tuple[Block, ...] = (Header(f"GPU cost {label}"), Text(text))
    if rows:
        blocks += (Table(("who", "cost"), rows),)
    blocks += (
        Context(_COST_NOTE + " `/gpu cost team` adds the idle overhead and the instances' bill."),
    )
    return View(text=text, blocks=blocks)


_COST_NOTE = "Every GPU-second held by a reservation or run, at its share of the host's hourly price; owned hosts cost nothing per hour."
