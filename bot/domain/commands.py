"""The `/gpu` grammar: text in, a typed command out — or a `UserError` whose text
says what is wrong and shows the usage of that verb.

Pure: no database, no clock, no Slack. The one outside fact it needs, which GPU
model names exist, comes in as a function so the grammar can be fuzzed alone.
Any exception other than `UserError` escaping `parse` is a bug (a hypothesis
test holds it to that).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import timedelta

from bot.domain.durations import ascii_digits, parse_duration
from bot.domain.errors import UserError

MAX_GPUS_PER_REQUEST = 64
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
PERIODS = ("today", "week", "month")
# `/gpu run --cloud`: take the cloud's offer in advance, or never be offered it.
CLOUD_CHOICES = ("ok", "never")


# Where a Slurm cluster is to run a request (bot.providers.slurm checks each against what
# the cluster and its accounting allow the person): flag -> what the help says of it.
PLACE_OPTIONS = {
    "--partition": "the partition (default: the first that has the GPUs and allows the length)",
    "--account": "the Slurm account to charge (default: yours)",
    "--qos": "the quality of service",
    "--constraint": "node features, as Slurm's --constraint takes them",
}
_PLACE_HELP = (
    "On a Slurm cluster: "
    + "; ".join(f"`{flag} NAME` {what}" for flag, what in PLACE_OPTIONS.items())
    + "."
)
_PLACE_VALUE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_CONSTRAINT_VALUE = re.compile(r"[A-Za-z0-9_.\-&|\[\]*:()]{1,128}")


@dataclass(frozen=True)
class VerbSpec:
    usage: str
    summary: str
    examples: tuple[str, ...]
    details: str = ""


VERBS: dict[str, VerbSpec] = {
    "help": VerbSpec(
        "/gpu help [verb]",
        "what gpubot can do, or how one verb works",
        ("/gpu help", "/gpu help reserve"),
    ),
    "status": VerbSpec(
        "/gpu status [me]",
        "every host and GPU: model, holder, until when; who is waiting",
        ("/gpu status", "/gpu status me"),
    ),
    "reserve": VerbSpec(
        "/gpu reserve [COUNT] [MODEL] [for DURATION]",
        "hold GPUs for yourself; if none is free you wait in line and get a DM",
        (
            "/gpu reserve",
            "/gpu reserve a100",
            "/gpu reserve 2 a100 for 3h",
            "/gpu reserve 2xa100 4h",
        ),
        "COUNT defaults to 1, MODEL to any free GPU, DURATION to the team default. "
        "Durations: 45m, 3h, 1h30m, 2d. " + _PLACE_HELP,
    ),
    "release": VerbSpec(
        "/gpu release [ID|all]",
        "give GPUs back (admins may release anyone's by ID)",
        ("/gpu release", "/gpu release 12", "/gpu release all"),
        "With no ID it releases your only reservation; waiting requests count too.",
    ),
    "extend": VerbSpec(
        "/gpu extend [ID] DURATION",
        "keep a reservation longer",
        ("/gpu extend 1h", "/gpu extend 12 1h"),
    ),
    "run": VerbSpec(
        "/gpu run [--gpus N] [--gpu MODEL] [--precision auto|bf16|fp16|fp32] [--max DURATION] "
        "[--spot] [--checkpoints] [--cloud ok|never] [--git URL[@REF] | --path DIR] [--recipe NAME [--lr LR] [--batch-size N] "
        "[--epochs N] [--sweep lr=V1,V2,...]] -- COMMAND, or /gpu run --resume ID [--max DURATION]",
        "queue a training run on the team's GPUs",
        (
            "/gpu run --recipe digits",
            "/gpu run --recipe digits --sweep lr=1e-4,3e-4,1e-3",
            "/gpu run --gpus 1 -- python train.py",
            "/gpu run --git https://github.com/org/repo@main -- python train.py --lr 3e-4",
            "/gpu run --path /data/proj --gpus 8 --gpu a100 --max 4h --spot -- torchrun train.py",
            "/gpu run --resume 42 --max 2h",
        ),
        # bot.app.hosts.sources: where the command's code comes from.
        "The command starts in its code: `--git` clones the repository (https:// or git@, "
        "at a branch, tag or full commit) on the host; `--path` runs in a directory already "
        "on the host; from a terminal, `gpubot submit DIR -- COMMAND` uploads a local "
        "directory. A run that runs out of GPU memory (exit 77) is retried once with half "
        "the batch (`GPUBOT_BATCH_SIZE` for your own script). While it runs, the reply "
        "you got when it started shows its first figures as soon as the runner has measured "
        "some steps, then is updated about once a minute (step, loss, GPU use, ETA, "
        "cost so far), and you get a DM when its loss goes NaN or diverges, its GPUs sit "
        "idle or full, or it stops reporting; your own script reports with "
        "`training.report(step=..., loss=...)`. `--sweep lr=1e-4,3e-4` runs one variant per "
        "value and compares them in one table. `--checkpoints` says your "
        "command saves a checkpoint in `$GPUBOT_CHECKPOINT_DIR` on SIGTERM, exits 75 and "
        "resumes from it when run again (recipes do): such a run may be preempted for a "
        "teammate's and resumed later. `--resume ID` runs run ID again as it was (with "
        "a new `--max` if you give one), from the checkpoint it saved when it stopped at "
        "its time limit. " + _PLACE_HELP + " Where the team's own GPUs come first and a "
        "cloud after (GPUBOT_PROVIDERS=slurm,aws): a run that waits long for them is offered "
        "the cloud with its price, and starts wherever it can first; `--cloud ok` takes "
        "that offer in advance (within your budget), `--cloud never` keeps it on the "
        "team's own GPUs.",
    ),
    "queue": VerbSpec(
        "/gpu queue [me]",
        "waiting runs with position, estimated start and cost",
        ("/gpu queue", "/gpu queue me"),
    ),
    "cancel": VerbSpec(
        "/gpu cancel ID|SWEEP",
        "stop a queued or running run, or every run of a sweep at once",
        ("/gpu cancel 42", "/gpu cancel s3fa9c1"),
    ),
    "logs": VerbSpec(
        "/gpu logs ID [LINES]",
        "the last lines of a run's log",
        ("/gpu logs 42", "/gpu logs 42 100"),
    ),
    "util": VerbSpec(
        "/gpu util [HOST] | /gpu util keep ID",
        "GPU utilization and memory now, with a chart of the last hours",
        ("/gpu util", "/gpu util local", "/gpu util keep 12"),
        "Hosts are sampled while GPUs on them are held or running. `keep ID` answers the "
        "idle question: the reservation's GPUs are wanted, don't release them.",
    ),
    "cost": VerbSpec(
        "/gpu cost [me|@user|team] [today|week|month]",
        "what GPUs cost, per person or for the team",
        ("/gpu cost", "/gpu cost team week", "/gpu cost @alice month"),
    ),
    "budget": VerbSpec(
        "/gpu budget [@user AMOUNT[/week|/month]|off]",
        "see your budget; admins set anyone's",
        ("/gpu budget", "/gpu budget @alice 200/week", "/gpu budget @alice off"),
    ),
    "prices": VerbSpec(
        "/gpu prices [MODEL]",
        "GPU instance prices and their source",
        ("/gpu prices", "/gpu prices h100"),
    ),
    "recommend": VerbSpec(
        "/gpu recommend --mem GiB --hours H [--gpus N] [--spot]",
        "the GPU model that makes a run cheapest overall, with the estimated time and cost",
        (
            "/gpu recommend --mem 40 --hours 10",
            "/gpu recommend --mem 120 --hours 6 --gpus 2 --spot",
        ),
        "--mem is the GPU memory the run needs, in GiB (as `nvidia-smi` counts it); with --gpus N it may be split across "
        "N GPUs. --hours is how long the run takes on as many A100s (write 10, 10h or 90m); "
        "other GPUs are scaled by their peak bf16 throughput. --spot prices at spot.",
    ),
    "cloud": VerbSpec(
        "/gpu cloud [take [res] ID | wait [res] ID | @user ok|never|ask]",
        "your offers of the cloud while a run or reservation waits for the team's own GPUs",
        (
            "/gpu cloud",
            "/gpu cloud take 42",
            "/gpu cloud wait res 7",
            "/gpu cloud @alice never",
        ),
        "Where the team's own GPUs come first and a cloud after (GPUBOT_PROVIDERS=slurm,aws), "
        "a run (or a reservation) that waits longer than GPUBOT_BURST_AFTER is offered the "
        "cloud with its price: `take ID` (`take res ID`) buys it (your budget is checked "
        "against the estimate first), and it starts wherever it can first, the other side "
        "given back; `wait ID` keeps it on the team's GPUs. `/gpu run --cloud ok` takes the offer in advance. An admin sets "
        "it for a person: `@alice ok` (taken in advance, within budget), `@alice never` "
        "(never offered: a `never` from either the admin or the run wins), `@alice ask`.",
    ),
    "pool": VerbSpec(
        "/gpu pool [set INSTANCE_TYPE [max=N] [spend=USD]]",
        "instances the team runs, and their limits (admins set them)",
        ("/gpu pool", "/gpu pool set p4d.24xlarge max=2 spend=50"),
    ),
}


# --- the commands -----------------------------------------------------------


@dataclass(frozen=True)
class UserRef:
    """Someone named in a command: a Slack id from `<@U…>`, or a plain name."""

    key: str


@dataclass(frozen=True)
class Help:
    topic: str | None = None


@dataclass(frozen=True)
class Status:
    mine_only: bool = False


@dataclass(frozen=True)
class Reserve:
    count: int = 1
    model: str | None = None  # None: the configured default, else any model
    duration: timedelta | None = None  # None: the configured default
    # Where a cluster is to hold them (PLACE_OPTIONS, without the dashes): name -> value.
    place: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Release:
    reservation_id: int | None = None
    all: bool = False


@dataclass(frozen=True)
class Extend:
    duration: timedelta
    reservation_id: int | None = None


@dataclass(frozen=True)
class Run:
    command: tuple[str, ...] = ()
    recipe: str | None = None
    gpus: int = 1
    model: str | None = None
    precision: str = "auto"
    max_duration: timedelta | None = None
    spot: bool = False
    # Where the code comes from (bot.app.hosts.sources): "git:<url>@<ref>", "path:<dir>",
    # "staged:<id>"; "" runs the command in the run's own directory.
    source: str = ""
    # A recipe's own settings (`--lr`, `--batch-size`, `--epochs`) as (name, value) pairs.
    options: tuple[tuple[str, float], ...] = ()
    # `--sweep lr=1e-4,3e-4`: one variant per value of one recipe setting, run as a group.
    sweep: tuple[str, tuple[float, ...]] | None = None
    # The command checkpoints: it saves to $GPUBOT_CHECKPOINT_DIR on SIGTERM, exits 75
    # and resumes from there when started again, so the scheduler may move it.
    checkpoints: bool = False
    # Where a cluster is to run it (PLACE_OPTIONS, without the dashes): name -> value.
    place: tuple[tuple[str, str], ...] = ()
    # `--resume ID`: run ID again as it was, from the checkpoint it stopped at.
    resume: int | None = None
    # `--cloud ok|never` (bot.app.burst): the cloud's offer taken in advance, or never made.
    cloud: str | None = None

    @property
    def interactive(self) -> bool:
        """Nothing said what to run: Slack opens the run modal."""
        return not self.command and self.recipe is None and self.resume is None


@dataclass(frozen=True)
class Queue:
    mine_only: bool = False


@dataclass(frozen=True)
class Cancel:
    run_id: int = 0
    sweep: str | None = None  # `/gpu cancel s3fa9c1`: every open run of the sweep


@dataclass(frozen=True)
class Logs:
    run_id: int
    lines: int = 40


@dataclass(frozen=True)
class Util:
    host: str | None = None
    keep: int | None = None  # `/gpu util keep N`: keep reservation N despite idle GPUs


@dataclass(frozen=True)
class Cost:
    scope: str = "me"  # "me", "team", or "user"
    user: UserRef | None = None
    period: str = "week"


@dataclass(frozen=True)
class Budget:
    user: UserRef | None = None  # None: show the caller's
    amount_usd: float | None = None  # None with a user: remove the limit
    period: str = "week"
    clear: bool = False


@dataclass(frozen=True)
class Prices:
    model: str | None = None


@dataclass(frozen=True)
class Recommend:
    mem_gb: float  # GPU memory the run needs, GB, in total across its GPUs
    hours: float  # the run's time on the reference GPU (A100), as many GPUs as `gpus`
    gpus: int | None = None  # None: one GPU
    spot: bool = False


@dataclass(frozen=True)
class Pool:
    instance_type: str | None = None  # None: show the pool
    max_instances: int | None = None
    max_usd_per_hour: float | None = None


@dataclass(frozen=True)
class Cloud:
    """`/gpu cloud`: the offers; `take ID` / `wait ID` answers one; `@user ok|never|ask`
    is an admin's word for a person."""

    run_id: int | None = None
    take: bool = False
    # `res ID`: the id is a reservation's, not a run's.
    reservation: bool = False
    user: UserRef | None = None
    policy: str | None = None  # "ok", "never" or "ask" (for `user`)


Command = (
    Help
    | Status
    | Reserve
    | Release
    | Extend
    | Run
    | Queue
    | Cancel
    | Logs
    | Util
    | Cost
    | Budget
    | Prices
    | Recommend
    | Pool
    | Cloud
)

ModelNormalizer = Callable[[str], "str | None"]


@dataclass
class _Ctx:
    verb: str
    normalize: ModelNormalizer
    known: tuple[str, ...] = field(default_factory=tuple)

    def fail(self, reason: str) -> UserError:
        return UserError(reason, VERBS[self.verb].usage)


# --- entry point --------------------------------------------------------------

_MAX_TEXT = 4000
_SLASH = re.compile(r"^/gpu\b", re.IGNORECASE)


def parse(
    text: str,
    normalize_model: ModelNormalizer | None = None,
    known_models: tuple[str, ...] = (),
) -> Command:
    """Parses what follows `/gpu` (a leading `/gpu` is tolerated, as the shell sends it)."""
    if len(text) > _MAX_TEXT:
        raise UserError(
            f"That command is too long ({len(text)} characters; the limit is {_MAX_TEXT})."
        )
    body = _SLASH.sub("", text.strip(), count=1).strip()
    if not body:
        return Help()
    verb, _, rest = body.partition(" ")
    verb = verb.lower()
    if verb not in VERBS:
        suggestion = _closest(verb)
        hint = f" Did you mean `{suggestion}`?" if suggestion else ""
        raise UserError(
            f"I don't know `{_clip(verb)}`.{hint} Try `/gpu help` for the list of verbs."
        )
    ctx = _Ctx(verb, normalize_model or _default_normalizer(), known_models)
    return _PARSERS[verb](rest.strip(), ctx)


def _closest(word: str) -> str | None:
    """A verb one slip away (`stauts`, `relase`, `log`); at difflib's default 0.6 a
    word that shares two letters (`bogus` → `logs`) was offered, which misleads."""
    import difflib

    found = difflib.get_close_matches(word, list(VERBS), n=1, cutoff=0.75)
    return found[0] if found else None


def _clip(text: str, limit: int = 40) -> str:
    text = text.replace("`", "'")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _default_normalizer() -> ModelNormalizer:
    from provisioning.catalog import Catalog

    catalog = Catalog.load()

    def normalize(text: str) -> str | None:
        if text.lower() in {"cpu", "cpus"}:
            return "cpu"
        return catalog.normalize_model(text)

    return normalize


# --- per-verb parsers -----------------------------------------------------------


def _words(rest: str) -> list[str]:
    return rest.split()


def _int(token: str, ctx: _Ctx, what: str, low: int = 1, high: int = 10**9) -> int:
    t = token.lstrip("#")
    if not ascii_digits(t) or len(t) > 12:
        raise ctx.fail(f"{what} must be a whole number, not `{_clip(token)}`.")
    value = int(t)
    if not low <= value <= high:
        raise ctx.fail(f"{what} must be between {low} and {high}, not {value}.")
    return value


def _model(token: str, ctx: _Ctx) -> str:
    model = ctx.normalize(token)
    if model is None:
        known = ", ".join(ctx.known) if ctx.known else "a100, h100, l4, …"
        raise ctx.fail(f"I don't know the GPU model `{_clip(token)}`. Known models: {known}.")
    return model


def _duration(token: str, ctx: _Ctx) -> timedelta:
    delta = parse_duration(token)
    if delta is None:
        raise ctx.fail(f"`{_clip(token)}` is not a duration; write it like 30m, 3h or 1h30m.")
    return delta


_USER = re.compile(r"^<@([A-Z0-9]+)(?:\|[^>]*)?>$|^@([\w.\-]{1,64})$")


def _user(token: str) -> UserRef | None:
    m = _USER.match(token)
    if not m:
        return None
    return UserRef(key=m.group(1) or m.group(2))


def _parse_help(rest: str, ctx: _Ctx) -> Help:
    words = _words(rest)
    if not words:
        return Help()
    if len(words) > 1:
        raise ctx.fail("Ask about one verb at a time.")
    topic = words[0].lower().removeprefix("/gpu")
    if topic not in VERBS:
        raise ctx.fail(f"There is no verb `{_clip(topic)}`; `/gpu help` lists them.")
    return Help(topic)


def _parse_status(rest: str, ctx: _Ctx) -> Status:
    words = [w.lower() for w in _words(rest)]
    if not words:
        return Status()
    if words in (["me"], ["mine"]):
        return Status(mine_only=True)
    raise ctx.fail(f"`status` only understands `me`, not `{_clip(rest)}`.")


_COUNT_X_MODEL = re.compile(r"^(\d{1,3})\s*[x×*]\s*([a-z][\w\-]*)$", re.IGNORECASE)
_MODEL_X_COUNT = re.compile(r"^([a-z][\w\-]*?)\s*[x×*](\d{1,3})$", re.IGNORECASE)
_NUMBER = re.compile(r"^\d+(?:\.\d+)?$")


def _parse_reserve(rest: str, ctx: _Ctx) -> Reserve:
    words = _words(rest)
    count: int | None = None
    model: str | None = None
    duration: timedelta | None = None
    i = 0

    def set_count(value: int) -> None:
        nonlocal count
        if count is not None:
            raise ctx.fail("Give the GPU count once.")
        if not 1 <= value <= MAX_GPUS_PER_REQUEST:
            raise ctx.fail(
                f"You can reserve 1 to {MAX_GPUS_PER_REQUEST} GPUs at a time, not {value}."
            )
        count = value

    def set_model(token: str) -> None:
        nonlocal model
        if model is not None:
            raise ctx.fail("Give one GPU model per reservation.")
        model = _model(token, ctx)

    def set_duration(delta: timedelta) -> None:
        nonlocal duration
        if duration is not None:
            raise ctx.fail("Give the duration once.")
        duration = delta

    place: dict[str, str] = {}
    while i < len(words):
        w = words[i]
        lw = w.lower()
        nxt = words[i + 1] if i + 1 < len(words) else None
        if w.startswith("--"):
            flag, eq, value = w.partition("=")
            if not eq:
                value = nxt or ""
                i += 1
            _place_option(flag.lower(), value, place, ctx)
            i += 1
            continue
        if lw == "for":
            if nxt is None:
                raise ctx.fail("`for` needs a duration after it, like `for 3h`.")
            # "for 90 minutes" arrives as two words; "for 3h" as one.
            if _NUMBER.match(nxt) and i + 2 < len(words) and parse_duration(nxt + words[i + 2]):
                set_duration(_duration(nxt + words[i + 2], ctx))
                i += 3
            else:
                set_duration(_duration(nxt, ctx))
                i += 2
            continue
        if m := _COUNT_X_MODEL.match(w):
            set_count(int(m.group(1)))
            set_model(m.group(2))
        elif m := _MODEL_X_COUNT.match(w):
            set_model(m.group(1))
            set_count(int(m.group(2)))
        elif ascii_digits(w) and len(w) <= 6:
            if (
                nxt is not None
                and parse_duration(w + nxt) is not None
                and ctx.normalize(nxt) is None
            ):
                set_duration(_duration(w + nxt, ctx))  # "3 hours"
                i += 2
                continue
            set_count(int(w))
        elif (delta := parse_duration(w)) is not None:
            set_duration(delta)
        elif lw in {"gpu", "gpus", "a", "an"}:
            pass  # "reserve 2 gpus", "reserve an a100"
        else:
            set_model(w)
        i += 1
    return Reserve(count=count or 1, model=model, duration=duration, place=tuple(place.items()))


def _place_option(flag: str, value: str, place: dict[str, str], ctx: _Ctx) -> None:
    """One of PLACE_OPTIONS into `place` (checked: a name, at most once)."""
    if flag not in PLACE_OPTIONS:
        known = ", ".join(PLACE_OPTIONS)
        raise ctx.fail(f"Unknown option `{_clip(flag)}`; the options here are {known}.")
    name = flag[2:]
    if name in place:
        raise ctx.fail(f"`{flag}` is given twice.")
    if not value:
        raise ctx.fail(f"`{flag}` needs a value.")
    pattern = _CONSTRAINT_VALUE if name == "constraint" else _PLACE_VALUE
    if not pattern.fullmatch(value):
        raise ctx.fail(f"`{_clip(value)}` is not a {name} name.")
    place[name] = value


def _parse_release(rest: str, ctx: _Ctx) -> Release:
    words = _words(rest)
    if not words:
        return Release()
    if len(words) > 1:
        raise ctx.fail("Release one reservation by its ID, or `all` of yours.")
    if words[0].lower() == "all":
        return Release(all=True)
    return Release(reservation_id=_int(words[0], ctx, "A reservation ID"))


def _parse_extend(rest: str, ctx: _Ctx) -> Extend:
    words = _words(rest)
    if not words:
        raise ctx.fail("Say how much longer, like `/gpu extend 1h`.")
    rid: int | None = None
    if len(words) >= 2 and ascii_digits(words[0].lstrip("#")) and parse_duration(words[0]) is None:
        rid = _int(words[0], ctx, "A reservation ID")
        words = words[1:]
    spec = "".join(words[1:]) if words[0].lower() == "by" else "".join(words)
    if not spec:
        raise ctx.fail("Say how much longer, like `/gpu extend 1h`.")
    return Extend(duration=_duration(spec, ctx), reservation_id=rid)


def _options(
    tokens: list[str],
    ctx: _Ctx,
    with_value: Collection[str],
    unknown: Callable[[str, str], str],
    *,
    command_follows: bool,
    bare: Collection[str] = (),
) -> tuple[dict[str, str], bool, list[str]]:
    """`--name value`, `--name=value` and the bare `--spot` (and, for `bare`, those
    flags too, returned in `opts` as "1"), for every verb that takes options: each at
    most once. With `command_follows`, `--` or the first word that is no
    option starts the user's command, returned as the third item; otherwise every word
    must be an option (`unknown(name, token)` says what is wrong)."""
    opts: dict[str, str] = {}
    spot = False
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if command_follows and tok == "--":
            return opts, spot, tokens[i + 1 :]
        if command_follows and not tok.startswith("--"):
            return opts, spot, tokens[i:]  # no `--`: the rest is the command
        name, eq, value = tok.partition("=")
        name = name.lower()
        if name == "--spot":
            if eq:
                raise ctx.fail("`--spot` takes no value.")
            spot = True
            i += 1
            continue
        if name in bare:
            if eq:
                raise ctx.fail(f"`{name}` takes no value.")
            if name in opts:
                raise ctx.fail(f"`{name}` is given twice.")
            opts[name] = "1"
            i += 1
            continue
        if name not in with_value:
            raise ctx.fail(unknown(name, tok))
        if not eq:
            if i + 1 >= len(tokens):
                raise ctx.fail(f"`{name}` needs a value.")
            value = tokens[i + 1]
            i += 1
        if name in opts:
            raise ctx.fail(f"`{name}` is given twice.")
        opts[name] = value
        i += 1
    return opts, spot, []


_RUN_FLAGS_WITH_VALUE = {
    "--resume",
    "--gpus",
    "--gpu",
    "--precision",
    "--max",
    "--recipe",
    "--git",
    "--path",
    "--lr",
    "--batch-size",
    "--epochs",
    "--sweep",
    "--cloud",
    *PLACE_OPTIONS,
}
# A recipe's settings the bot passes to the runner: name -> (kind, lowest, highest).
RECIPE_OPTIONS: dict[str, tuple[type, float, float]] = {
    "lr": (float, 1e-12, 1e12),
    "batch-size": (int, 1, 1_000_000),
    "epochs": (int, 1, 10_000),
}
MAX_SWEEP = 8


def _recipe_value(name: str, text: str, ctx: _Ctx) -> float:
    kind, low, high = RECIPE_OPTIONS[name]
    try:
        value = float(text) if kind is float else int(text)
    except ValueError:
        raise ctx.fail(f"`--{name}` takes a number, not `{_clip(text)}`.") from None
    if not (low <= value <= high) or value != value:
        raise ctx.fail(f"`--{name}` must be between {low:g} and {high:g}, not `{_clip(text)}`.")
    return value


def _recipe_options(
    opts: dict[str, str], recipe: str | None, ctx: _Ctx
) -> tuple[tuple[tuple[str, float], ...], tuple[str, tuple[float, ...]] | None]:
    """`--lr`/`--batch-size`/`--epochs` and `--sweep NAME=V1,V2,...`, for recipes only (a
    command takes its own arguments after `--`)."""
    given = [n for n in RECIPE_OPTIONS if f"--{n}" in opts]
    if recipe is None and (given or "--sweep" in opts):
        used = "--sweep" if "--sweep" in opts else f"--{given[0]}"
        raise ctx.fail(
            f"`{used}` goes with a recipe; your own command takes its settings after `--`."
        )
    options = tuple((n, _recipe_value(n, opts[f"--{n}"], ctx)) for n in given)
    if "--sweep" not in opts:
        return options, None
    name, eq, values = opts["--sweep"].partition("=")
    name = name.strip().lower().lstrip("-")
    if not eq or name not in RECIPE_OPTIONS:
        raise ctx.fail(
            "Sweep one setting: `--sweep lr=1e-4,3e-4,1e-3` "
            f"(settings: {', '.join(RECIPE_OPTIONS)})."
        )
    if name in given:
        raise ctx.fail(f"`--{name}` and a sweep over {name}: give one of them.")
    swept = tuple(_recipe_value(name, v.strip(), ctx) for v in values.split(",") if v.strip())
    if not 2 <= len(swept) <= MAX_SWEEP or len(set(swept)) != len(swept):
        raise ctx.fail(f"A sweep takes 2 to {MAX_SWEEP} different values, comma-separated.")
    return options, (name, swept)


def _parse_run(rest: str, ctx: _Ctx) -> Run:
    try:
        tokens = shlex.split(rest)
    except ValueError as exc:
        raise ctx.fail(f"I could not split that command line: {exc}.") from None
    opts, spot, command = _options(
        tokens,
        ctx,
        _RUN_FLAGS_WITH_VALUE,
        lambda name, tok: f"Unknown option `{_clip(name)}`; put your own command after `--`.",
        command_follows=True,
        bare=("--checkpoints",),
    )
    checkpoints = opts.pop("--checkpoints", "") == "1"
    resume = _int(opts.pop("--resume"), ctx, "--resume", 1, 2**31) if "--resume" in opts else None
    if resume is not None and (
        command or spot or checkpoints or set(opts) - {"--max", "--cloud", *PLACE_OPTIONS}
    ):
        raise ctx.fail(
            f"`--resume {resume}` runs run #{resume} again as it was, from its checkpoint: "
            "give it only `--max` and where (`--partition`, `--account`, `--qos`, "
            "`--constraint`)."
        )
    gpus = _int(opts["--gpus"], ctx, "--gpus", 1, MAX_GPUS_PER_REQUEST) if "--gpus" in opts else 1
    model = _model(opts["--gpu"], ctx) if "--gpu" in opts else None
    precision = opts.get("--precision", "auto").lower()
    if precision not in PRECISIONS:
        raise ctx.fail(
            f"--precision must be one of {', '.join(PRECISIONS)}, not `{_clip(precision)}`."
        )
    max_duration = _duration(opts["--max"], ctx) if "--max" in opts else None
    recipe = opts.get("--recipe")
    if recipe is not None and not re.fullmatch(r"[a-z][a-z0-9_\-]{0,31}", recipe):
        raise ctx.fail(f"`{_clip(recipe)}` is not a recipe name.")
    if recipe is not None and command:
        raise ctx.fail("Give a recipe or a command, not both.")
    if not command and recipe is None and opts and resume is None:
        raise ctx.fail("Say what to run: `--recipe NAME` or `-- COMMAND`.")
    source = _run_source(opts, recipe, ctx)
    place: dict[str, str] = {}
    for flag in PLACE_OPTIONS:
        if flag in opts:
            _place_option(flag, opts.pop(flag), place, ctx)
    cloud = opts.pop("--cloud", None)
    if cloud is not None:
        cloud = cloud.lower()
        if cloud not in CLOUD_CHOICES:
            raise ctx.fail(
                f"`--cloud` takes ok (take the cloud's offer when the wait is long) or "
                f"never (wait for the team's own GPUs), not `{_clip(cloud)}`."
            )
    options, sweep = _recipe_options(opts, recipe, ctx)
    return Run(
        command=tuple(command),
        recipe=recipe,
        gpus=gpus,
        model=model,
        precision=precision,
        max_duration=max_duration,
        spot=spot,
        source=source,
        options=options,
        sweep=sweep,
        checkpoints=checkpoints,
        place=tuple(place.items()),
        resume=resume,
        cloud=cloud,
    )


def _run_source(opts: dict[str, str], recipe: str | None, ctx: _Ctx) -> str:
    """`--git`/`--path` as the stored source text (bot.app.hosts.sources checks them)."""
    from bot.domain.code_sources import SourceError, parse_git, parse_path

    if "--git" in opts and "--path" in opts:
        raise ctx.fail("Give `--git` or `--path`, not both: the code comes from one place.")
    if recipe is not None and ("--git" in opts or "--path" in opts):
        raise ctx.fail("A recipe brings its own code; `--git` and `--path` go with `-- COMMAND`.")
    try:
        if "--git" in opts:
            return parse_git(opts["--git"]).text()
        if "--path" in opts:
            return parse_path(opts["--path"]).text()
    except SourceError as exc:
        raise ctx.fail(str(exc)) from None
    return ""


def _parse_queue(rest: str, ctx: _Ctx) -> Queue:
    words = [w.lower() for w in _words(rest)]
    if not words:
        return Queue()
    if words in (["me"], ["mine"]):
        return Queue(mine_only=True)
    raise ctx.fail(f"`queue` only understands `me`, not `{_clip(rest)}`.")


def _parse_cancel(rest: str, ctx: _Ctx) -> Cancel:
    words = _words(rest)
    if len(words) != 1:
        raise ctx.fail("Cancel one run by its ID, or a sweep by its name (`s3fa9c1`).")
    if re.fullmatch(r"s[0-9a-f]{6}", words[0].lower()):
        return Cancel(sweep=words[0].lower())
    return Cancel(_int(words[0], ctx, "A run ID"))


def _parse_logs(rest: str, ctx: _Ctx) -> Logs:
    words = _words(rest)
    if not 1 <= len(words) <= 2:
        raise ctx.fail("Name the run whose log you want.")
    lines = _int(words[1], ctx, "The line count", 1, 500) if len(words) == 2 else 40
    return Logs(_int(words[0], ctx, "A run ID"), lines)


def _parse_util(rest: str, ctx: _Ctx) -> Util:
    words = _words(rest)
    if words and words[0].lower() == "keep":
        if len(words) != 2:
            raise ctx.fail("Say which reservation to keep: `/gpu util keep ID`.")
        return Util(keep=_int(words[1], ctx, "A reservation ID"))
    if len(words) > 1:
        raise ctx.fail("Name at most one host.")
    if words and not re.fullmatch(r"[\w.\-]{1,128}", words[0]):
        raise ctx.fail(f"`{_clip(words[0])}` is not a host name.")
    return Util(words[0] if words else None)


def _parse_cost(rest: str, ctx: _Ctx) -> Cost:
    scope, user, period = "me", None, "week"
    seen_scope = seen_period = False
    for w in _words(rest):
        lw = w.lower()
        if lw in PERIODS or lw in {"this-week", "day"}:
            if seen_period:
                raise ctx.fail("Give one period.")
            period = {"day": "today", "this-week": "week"}.get(lw, lw)
            seen_period = True
        elif lw in {"me", "mine", "team", "all"}:
            if seen_scope:
                raise ctx.fail("Give one of me, @user or team.")
            scope = "team" if lw in {"team", "all"} else "me"
            seen_scope = True
        elif (ref := _user(w)) is not None:
            if seen_scope:
                raise ctx.fail("Give one of me, @user or team.")
            scope, user, seen_scope = "user", ref, True
        else:
            raise ctx.fail(f"`{_clip(w)}` is neither me/@user/team nor today/week/month.")
    return Cost(scope=scope, user=user, period=period)


_AMOUNT = re.compile(r"^\$?(\d{1,9}(?:\.\d{1,2})?)(?:/(week|wk|w|month|mo|m))?$", re.IGNORECASE)


def _parse_budget(rest: str, ctx: _Ctx) -> Budget:
    words = _words(rest)
    if not words:
        return Budget()
    ref = _user(words[0])
    if ref is None:
        raise ctx.fail(f"Name the person first, like `@alice`, not `{_clip(words[0])}`.")
    if len(words) == 1:
        return Budget(user=ref)
    if len(words) > 3:
        raise ctx.fail("Too many words: give an amount like 200/week.")
    spec = "".join(words[1:]).lower()
    if spec in {"none", "off", "unlimited"}:
        return Budget(user=ref, clear=True)
    m = _AMOUNT.match(spec.replace("per", "/").replace("//", "/"))
    if not m:
        raise ctx.fail(f"`{_clip(spec)}` is not an amount; write it like 200/week or 800/month.")
    period = "month" if (m.group(2) or "week").lower() in {"month", "mo", "m"} else "week"
    amount = float(m.group(1))
    if amount <= 0:
        raise ctx.fail("A budget must be more than 0; use `off` to remove it.")
    return Budget(user=ref, amount_usd=amount, period=period)


def _parse_prices(rest: str, ctx: _Ctx) -> Prices:
    words = _words(rest)
    if not words:
        return Prices()
    if len(words) > 1:
        raise ctx.fail("Name at most one GPU model.")
    return Prices(_model(words[0], ctx))


_RECOMMEND_OPTS = ("--mem", "--hours", "--gpus")
_GB = re.compile(r"^(\d{1,6}(?:\.\d{1,3})?)\s*(?:gb|g|gib)?$", re.IGNORECASE)
_HOURS = re.compile(r"^(\d{1,6}(?:\.\d{1,3})?)\s*(?:h|hr|hrs|hours?)?$", re.IGNORECASE)


def _parse_recommend(rest: str, ctx: _Ctx) -> Recommend:
    opts, spot, _ = _options(
        _words(rest),
        ctx,
        _RECOMMEND_OPTS,
        lambda name, tok: (
            f"`{_clip(tok)}` is not an option here; use --mem, --hours, --gpus, --spot."
        ),
        command_follows=False,
    )
    if "--mem" not in opts:
        raise ctx.fail("Say how much GPU memory the run needs, like `--mem 40` (GiB).")
    if "--hours" not in opts:
        raise ctx.fail("Say how long the run takes on A100s, like `--hours 10`.")
    m = _GB.match(opts["--mem"])
    mem = float(m.group(1)) if m else 0.0
    if not 0 < mem <= 100_000:
        raise ctx.fail(f"--mem must be a number of GiB above 0, not `{_clip(opts['--mem'])}`.")
    raw = opts["--hours"]
    if m := _HOURS.match(raw):
        hours = float(m.group(1))
    else:
        delta = parse_duration(raw)
        hours = delta.total_seconds() / 3600 if delta is not None else 0.0
    if not 0 < hours <= 100_000:
        raise ctx.fail(f"--hours must be a time above 0 like 10, 10h or 90m, not `{_clip(raw)}`.")
    gpus = (
        _int(opts["--gpus"], ctx, "--gpus", 1, MAX_GPUS_PER_REQUEST) if "--gpus" in opts else None
    )
    return Recommend(mem_gb=mem, hours=hours, gpus=gpus, spot=spot)


_POOL_KV = re.compile(r"^(max|spend)=(\d{1,6}(?:\.\d{1,2})?)(?:/h)?$", re.IGNORECASE)


def _parse_pool(rest: str, ctx: _Ctx) -> Pool:
    words = _words(rest)
    if not words or words == ["show"]:
        return Pool()
    if words[0].lower() != "set" or len(words) < 3:
        raise ctx.fail("Use `/gpu pool` to see the pool, or `/gpu pool set TYPE max=N spend=USD`.")
    itype = words[1].lower()
    if not re.fullmatch(r"[a-z0-9]+[a-z0-9\-]*\.[a-z0-9]+", itype):
        raise ctx.fail(f"`{_clip(words[1])}` is not an instance type like p4d.24xlarge.")
    max_instances: int | None = None
    spend: float | None = None
    for kv in words[2:]:
        m = _POOL_KV.match(kv)
        if not m:
            raise ctx.fail(f"`{_clip(kv)}` is not `max=N` or `spend=USD`.")
        if m.group(1).lower() == "max":
            if "." in m.group(2):
                raise ctx.fail("max must be a whole number of instances.")
            max_instances = int(m.group(2))
        else:
            spend = float(m.group(2))
    return Pool(instance_type=itype, max_instances=max_instances, max_usd_per_hour=spend)


def _parse_cloud(rest: str, ctx: _Ctx) -> Cloud:
    words = _words(rest)
    if not words:
        return Cloud()
    ref = _user(words[0]) if words[0].startswith(("@", "<@")) else None
    if ref is not None:
        policy = words[1].lower() if len(words) == 2 else ""
        if policy not in (*CLOUD_CHOICES, "ask"):
            raise ctx.fail("Say what the cloud is for them: `ok`, `never` or `ask`.")
        return Cloud(user=ref, policy=policy)
    answer = words[0].lower()
    reservation = len(words) == 3 and words[1].lower() in ("res", "reservation")
    if answer not in ("take", "wait") or len(words) != (3 if reservation else 2):
        raise ctx.fail(
            "Say `take ID` to run it on the cloud, or `wait ID` to keep waiting "
            "(`take res ID` for a reservation)."
        )
    what = "A reservation ID" if reservation else "A run ID"
    return Cloud(_int(words[-1], ctx, what), take=answer == "take", reservation=reservation)


_PARSERS: dict[str, Callable[[str, _Ctx], Command]] = {
    "help": _parse_help,
    "status": _parse_status,
    "reserve": _parse_reserve,
    "release": _parse_release,
    "extend": _parse_extend,
    "run": _parse_run,
    "queue": _parse_queue,
    "cancel": _parse_cancel,
    "logs": _parse_logs,
    "util": _parse_util,
    "cost": _parse_cost,
    "budget": _parse_budget,
    "prices": _parse_prices,
    "recommend": _parse_recommend,
    "pool": _parse_pool,
    "cloud": _parse_cloud,
}
