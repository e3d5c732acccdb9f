"""A lab's Slurm cluster as a place GPUs come from (`GPUBOT_PROVIDER=slurm`).

Settings (docs/SLURM.md walks through them):

    SLURM_CONF                 honoured as Slurm's own tools honour it
    GPUBOT_SLURM_WORKDIR       a directory every node and the bot can read and write: run
                               directories, status files, checkpoints, the cluster's Python
                               environment (default $GPUBOT_HOME/slurm)
    GPUBOT_SLURM_PARTITIONS    comma list of partitions to use (default: every one with GPUs)
    GPUBOT_SLURM_USERS         `slackid=unixuser,…`: whose account a person's jobs run as
    GPUBOT_SLURM_LOGIN         `user@host[:port]`: run Slurm's commands on a login node over
                               SSH (GPUBOT_SSH_KEY) instead of on this machine
    GPUBOT_SLURM_RATES         `A100=1.50,H100=3.20`: USD per GPU-hour of the team's use,
                               per model (default: unset, and /gpu cost says so)
    GPUBOT_SLURM_ENV           where the cluster's Python environment is made (default
                               <workdir>/env): any directory every node reads
    GPUBOT_SLURM_SHARED_ACCOUNT  an unprivileged account for people without a mapping
                               (default none: they are refused); never uid 0
    GPUBOT_SLURM_SUBMIT_AS     sudo (default: `sudo -n -u PERSON` for Slurm's tools, by the
                               cluster's sudoers) or uid (a root bot's sbatch --uid/--gid)
    GPUBOT_SLURM_ACCOUNTS      `slackid=account,…`: a person's Slurm account (default:
                               their default account in Slurm's accounting)
    GPUBOT_SLURM_CPUS_PER_GPU, GPUBOT_SLURM_MEM_PER_GPU  a job's share per GPU where the
                               partition sets none (default: the node's share, e.g. 16G)
    GPUBOT_SLURM_ARRAY_RUNNING  at most this many runs of one sweep at once (its job
                               array's %K; default: the person's share of the partition's
                               GPUs, split evenly among the people mapped to the cluster)
    GPUBOT_SLURM_SIGNAL        Slurm's warning before a job's end (default TERM@120; off)
    GPUBOT_SLURM_PYTHON        the interpreter the environment is made from (default:
                               the first python3 every account can execute)
    GPUBOT_SLURM_CACHE_S       how long one read of the cluster serves (default 30 s)
    GPUBOT_SLURM_TIMEOUT_S     the most any Slurm command may take (default 15 s)

Slurm orders and preempts the cluster's jobs: a reservation is a holding job
(bot.providers.slurm.holds), a run a batch job (bot.providers.slurm.runs); gpubot
meters the team's use and never reorders the cluster.
"""

from __future__ import annotations

import logging
import os
import pwd
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from bot.app.config import ConfigError, Settings
from bot.app.hosts.remote import PreparedHost, bootstrap_prepare
from bot.app.hosts.runaccount import bot_pip_env
from bot.app.money.prices import priced_catalog
from bot.app.places import RunParts, Wiring
from bot.app.ports import FIXED_POOL, Supply
from bot.domain.readmodels import HostState
from bot.domain.timefmt import when
from bot.providers.base import Note, Parts, Probes
from bot.providers.slurm.cluster import ClusterView
from bot.providers.slurm.fit import Shares
from bot.providers.slurm.holds import SlurmHolder
from bot.providers.slurm.lab import Lab
from bot.providers.slurm.runs import ClusterEnv, ClusterSeat, SlurmExecutor
from db.models import User
from db.session import transaction
from provisioning import shell
from provisioning.base import Instance
from provisioning.bootstrap import bootstrap
from provisioning.catalog import Catalog
from provisioning.checks import Check
from provisioning.hostshell import HostShell
from provisioning.local_runner import LOCAL_TARGET, LocalRunner
from provisioning.slurm import SUBMIT_MODES, JobSpec, SlurmClient, SlurmError
from provisioning.ssh import SshTarget, parse_address

if TYPE_CHECKING:
    from bot.app.service import GpuService

log = logging.getLogger(__name__)

# How long one read of the whole cluster serves everything that reads it (status,
# placement, the holds' and runs' looks): a controller's info RPCs stay constant with
# jobs live, a few a minute (docs/SLURM.md, what the bot asks of the controller).
DEFAULT_CACHE_S = 30.0


class SlurmCompute:
    """The cluster's nodes as `provisioning.base.Compute` lists hosts."""

    name = "slurm"

    def __init__(self, cluster: ClusterView) -> None:
        self.cluster = cluster

    def list_instances(self) -> list[Instance]:
        return self.cluster.instances(self.name)


class SlurmProvider:
    name: ClassVar[str] = "slurm"
    label: ClassVar[str] = "Slurm"
    owns_hosts: ClassVar[bool] = False

    def __init__(
        self,
        settings: Settings,
        env: Mapping[str, str],
        runner: HostShell,
        *,
        client: SlurmClient | None = None,
        files: HostShell | None = None,
    ) -> None:
        self.settings = settings
        self._catalog = priced_catalog(settings)
        self.workdir = env.get("GPUBOT_SLURM_WORKDIR", "").strip() or str(
            (settings.home / "slurm").resolve()
        )
        self.partitions = _items(env.get("GPUBOT_SLURM_PARTITIONS", ""))
        self.users = _pairs(env.get("GPUBOT_SLURM_USERS", ""), "GPUBOT_SLURM_USERS")
        self.shared = env.get("GPUBOT_SLURM_SHARED_ACCOUNT", "").strip() or None
        for slack, account in [*self.users.items(), ("shared", self.shared or "")]:
            if account and _is_root(account):
                raise ConfigError(
                    f"{'GPUBOT_SLURM_SHARED_ACCOUNT' if slack == 'shared' else 'GPUBOT_SLURM_USERS'}"
                    f" names {account}, which is root (uid 0): jobs never run as root; name "
                    "an unprivileged account"
                )
        self.accounts = _pairs(env.get("GPUBOT_SLURM_ACCOUNTS", ""), "GPUBOT_SLURM_ACCOUNTS")
        self.submit_as = env.get("GPUBOT_SLURM_SUBMIT_AS", "").strip().lower() or "sudo"
        if self.submit_as not in SUBMIT_MODES:
            raise ConfigError(
                f"GPUBOT_SLURM_SUBMIT_AS={self.submit_as!r}: say sudo (the default: the bot "
                "submits as each person through sudo) or uid (a root bot's sbatch --uid)"
            )
        self.shares = Shares(
            cpus_per_gpu=_count(
                env.get("GPUBOT_SLURM_CPUS_PER_GPU", ""), "GPUBOT_SLURM_CPUS_PER_GPU"
            ),
            mem_per_gpu_mb=_megabytes(env.get("GPUBOT_SLURM_MEM_PER_GPU", "")),
        )
        self.array_running = _count(
            env.get("GPUBOT_SLURM_ARRAY_RUNNING", ""), "GPUBOT_SLURM_ARRAY_RUNNING"
        )
        warn = env.get("GPUBOT_SLURM_SIGNAL", "").strip() or "TERM@120"
        self.signal = None if warn.lower() in ("off", "none", "no") else _signal(warn)
        self.python = env.get("GPUBOT_SLURM_PYTHON", "").strip() or None
        self.rates = {
            self._model(k): _price(v, k)
            for k, v in _pairs(env.get("GPUBOT_SLURM_RATES", ""), "GPUBOT_SLURM_RATES").items()
        }
        self.cache_s = _seconds(
            env.get("GPUBOT_SLURM_CACHE_S", ""), DEFAULT_CACHE_S, "GPUBOT_SLURM_CACHE_S"
        )
        timeout = _seconds(env.get("GPUBOT_SLURM_TIMEOUT_S", ""), 15.0, "GPUBOT_SLURM_TIMEOUT_S")
        login = env.get("GPUBOT_SLURM_LOGIN", "").strip()
        self.target: SshTarget = LOCAL_TARGET
        self.files: HostShell = LocalRunner()
        if login:
            user, host, port = parse_address(login)
            key = env.get("GPUBOT_SSH_KEY", "").strip() or None
            self.target = SshTarget(
                host=host,
                port=port or 22,
                user=user or "root",
                key_path=str(Path(key).expanduser()) if key else None,
                name="slurm-login",
            )
            self.files = runner
        if files is not None:  # where the work directory is read and written (tests)
            self.files = files
        self.env_root = env.get("GPUBOT_SLURM_ENV", "").strip() or f"{self.workdir}/env"
        if not login:
            _apart_from_secrets(self.workdir, settings, env)
        self.client = client or SlurmClient(
            conf=env.get("SLURM_CONF") or None,
            login=self.target if login else None,
            runner=self.files if login else None,
            timeout_s=timeout,
            normalize=self._catalog.normalize_model,
            submit_as=self.submit_as,
        )
        self.cluster: ClusterView | None = None
        self._compute: SlurmCompute | None = None

    def _model(self, text: str) -> str:
        model = self._catalog.normalize_model(text)
        if model is None:
            raise ConfigError(f"GPUBOT_SLURM_RATES names {text!r}, which is no GPU model")
        return model

    @classmethod
    def from_env(
        cls, settings: Settings, env: Mapping[str, str], runner: HostShell
    ) -> SlurmProvider:
        return cls(settings, env, runner)

    @property
    def compute(self) -> SlurmCompute:
        assert self._compute is not None, "connect first"
        return self._compute

    @property
    def catalog(self) -> Catalog:
        return self._catalog

    @property
    def supply(self) -> Supply:
        return FIXED_POOL

    def connect(self, service: GpuService, parts: Parts) -> Wiring:
        cluster = ClusterView(
            self.client,
            cache_s=self.cache_s,
            partitions=self.partitions,
            clock=service.clock.now,
        )
        self.cluster = cluster
        self._compute = SlurmCompute(cluster)
        name = self.name

        def upkeep() -> None:
            cluster.sync_hosts(parts.engine, name, service.sync_hosts)

        upkeep()  # listed at start; then the worker's upkeep every cache period
        env = ClusterEnv(lambda: self._prepare(parts))
        lab = Lab(
            cluster,
            users=self.users,
            shared=self.shared,
            accounts=self.accounts,
            shares=self.shares,
            signal=self.signal,
            partitions=self.partitions,
        )

        def owner_of(user_id: int) -> str | None:
            with transaction(parts.engine, write=False) as s:
                user = s.get(User, user_id)
                return user.key if user is not None else None

        executor = SlurmExecutor(
            cluster,
            lab,
            self.files,
            self.target,
            workdir=self.workdir,
            env=env,
            clock=service.clock,
            nudge=service.nudge,
            owner_of=owner_of,
            rates=self.rates,
            tz=service.settings.timezone,
            submit_as=self.submit_as,
            array_running=self.array_running,
        )
        access = ClusterSeat(cluster, self.files, self.target, env, self.workdir)
        holder = SlurmHolder(
            service,
            cluster,
            lab,
            self.files,
            self.target,
            provider=name,
            rates=self.rates,
            workdir=self.workdir,
        )
        return Wiring(
            name,
            label="the Slurm cluster",
            display=self,
            runs=RunParts(access, self._catalog, executor),
            holder=holder,
            upkeep=(upkeep,),
        )

    def _prepare(self, parts: Parts) -> PreparedHost:
        """The cluster's Python, once, under the work directory: the bootstrap's venv and
        code (a test hands its own preparation)."""
        if parts.prepare is not bootstrap_prepare and parts.prepare is not None:
            return parts.prepare(self.files, self.target)
        python = self.python or shared_python(self.files, self.target)
        root = self.env_root
        report = bootstrap(
            self.files, self.target, remote_root=root, env=bot_pip_env(), python=python
        )
        # Read and run by every job account, changed by none of them.
        self.files.run(self.target, shell.join(["chmod", "-R", "go-w", "--", root]), timeout=120)
        return PreparedHost(root=report.root, python=report.venv_python, code_dir=report.code_dir)

    # --- how its hosts read -----------------------------------------------------------

    def note(self, host: HostState) -> str | None:
        snap = self.cluster.read() if self.cluster is not None else None
        node = next((n for n in snap.nodes if n.name == host.name), None) if snap else None
        if node is None:
            return None
        used = sum(node.gpus_used.values())
        return f"Slurm: {node.state}, {used} of {node.gpu_count} GPUs allocated"

    def called(self, host_name: str, provider: str) -> str:
        return f"Slurm node {host_name}"

    def empty_pool(self) -> str:
        where = f" in partitions {', '.join(self.partitions)}" if self.partitions else ""
        return f"No Slurm node with GPUs{where} is listed yet."

    def status_lines(self) -> list[str]:
        cluster = self.cluster
        if cluster is None or cluster.down_since is None:
            return []
        since = when(cluster.down_since, cluster.clock(), self.settings.timezone)
        return [
            f"The Slurm controller is not answering (since {since}): what is shown is as of "
            "then. Reservations and runs wait, and are reconciled when it answers."
        ]

    def cost_note(self) -> str | None:
        snap = self.cluster.read() if self.cluster is not None else None
        models = sorted({m for n in snap.nodes for m in n.gpus}) if snap else []
        unset = [m for m in models if m not in self.rates]
        if not unset:
            return None
        return (
            f"Slurm GPUs have no price set for {', '.join(unset)}: their use is counted in "
            "GPU-hours at $0 (an admin sets GPUBOT_SLURM_RATES, e.g. A100=1.50)."
        )

    # --- gpubot doctor ----------------------------------------------------------------

    @classmethod
    def wanted(cls, env: Mapping[str, str]) -> bool:
        return any(k.startswith("GPUBOT_SLURM_") and v.strip() for k, v in env.items())

    @classmethod
    def checks(cls, settings: Settings, env: Mapping[str, str], probes: Probes) -> list[Check]:
        try:
            provider = cls(settings, env, LocalRunner())
        except ConfigError as exc:
            return [Check("Slurm settings", False, exc.text, "Fix that GPUBOT_SLURM_* setting.")]
        client = provider.client
        try:
            client.ping()
        except SlurmError as exc:
            fix = (
                "Point SLURM_CONF at the cluster's slurm.conf (as for sinfo), or set "
                "GPUBOT_SLURM_LOGIN to a login node where Slurm's tools work."
            )
            return [Check("Slurm controller", False, str(exc), fix)]
        out = [Check("Slurm controller", True, f"answers ({client.where})")]
        try:
            nodes = [n for n in client.nodes() if n.gpus]
        except SlurmError as exc:
            return [*out, Check("Slurm GPUs", False, str(exc), "")]
        if provider.partitions:
            nodes = [n for n in nodes if set(n.partitions) & set(provider.partitions)]
        gpus: dict[str, int] = {}
        for n in nodes:
            for m, k in n.gpus.items():
                gpus[m] = gpus.get(m, 0) + k
        if not gpus:
            out.append(
                Check(
                    "Slurm GPUs",
                    False,
                    "no node with GPUs (gres) in the partitions used",
                    "Declare the GPUs as gres (GresTypes=gpu, Gres=gpu:a100:4), or fix GPUBOT_SLURM_PARTITIONS.",
                )
            )
        else:
            listed = ", ".join(f"{k} × {m}" for m, k in sorted(gpus.items()))
            out.append(Check("Slurm GPUs", True, f"{listed} on {len(nodes)} nodes"))
        ok = os.access(provider.workdir, os.W_OK) if provider.target is LOCAL_TARGET else True
        out.append(
            Check(
                "Slurm work directory",
                ok,
                f"{provider.workdir}" + (" is writable" if ok else " is missing or not writable"),
                f"mkdir -p {provider.workdir} on a file system every node mounts, writable by the jobs' accounts",
            )
        )
        out += provider.identity_checks()
        out.append(
            Note(
                "Slurm operator",
                True,
                "extending a reservation whose holding job already runs needs the bot's account to be a Slurm operator",
                "sacctmgr modify user where name=BOTUSER set adminlevel=operator",
            )
        )
        cost = provider.cost_note_for(gpus)
        if cost:
            out.append(Note("Slurm prices", True, cost, "GPUBOT_SLURM_RATES=A100=1.50,H100=3.20"))
        return out

    def identity_checks(self) -> list[Check]:
        """Whose accounts jobs run as, how, and a held job submitted and cancelled as one
        of them: the proof that the sudoers lines (or a root bot's --uid) work."""
        mode = (
            "each person's jobs are submitted, cancelled and changed as their own account "
            "through `sudo -n -u PERSON` (Slurm's tools only)"
            if self.submit_as == "sudo"
            else "jobs are submitted with sbatch --uid/--gid (the bot is root; newer Slurm "
            "deprecates it)"
        )
        people = f"{len(self.users)} people mapped (GPUBOT_SLURM_USERS)"
        others = (
            f"people without a mapping run as the shared account {self.shared}"
            if self.shared
            else "people without a mapping are refused"
        )
        out: list[Check] = [Check("Slurm identity", True, f"{mode}; {people}; {others}")]
        person = next(iter(self.users.values()), None) or self.shared
        if person is None:
            out.append(
                Check(
                    "Slurm users",
                    False,
                    "nobody is mapped to a cluster account and no shared account is named: "
                    "every request is refused",
                    "GPUBOT_SLURM_USERS=U0123=alice,… (Slack id = unix account), or "
                    "GPUBOT_SLURM_SHARED_ACCOUNT=an unprivileged account",
                )
            )
            return out
        spec = JobSpec(
            name="gpubot-doctor",
            argv=("true",),
            workdir=self.workdir,
            time_limit_s=60,
            output="/dev/null",
            user=person,
            hold=True,
            comment="gpubot doctor: a held job, cancelled at once",
        )
        try:
            job = self.client.submit(spec)
            self.client.cancel(job, user=person)
        except SlurmError as exc:
            fix = (
                "Add the sudoers lines of docs/SLURM.md for the bot's account"
                if self.submit_as == "sudo"
                else "Run the bot as root, or use GPUBOT_SLURM_SUBMIT_AS=sudo"
            )
            out.append(Check("Slurm submit as a person", False, str(exc), fix))
            return out
        out.append(
            Check(
                "Slurm submit as a person",
                True,
                f"held job {job} submitted and cancelled as {person}",
            )
        )
        return out

    def cost_note_for(self, gpus: Mapping[str, int]) -> str | None:
        unset = sorted(m for m in gpus if m not in self.rates)
        if not unset:
            return None
        return f"no price per GPU-hour for {', '.join(unset)}: /gpu cost shows their use at $0"


# --- the cluster's Python ----------------------------------------------------------------

# The first interpreter that every account can run: the file and each directory above
# it executable by others (a python3 under root's 0700 home is not; a venv made from it
# fails for every job account with "Permission denied"). A constant snippet: no data.
_SHARED_PYTHON = r"""
for p in /usr/bin/python3 /usr/local/bin/python3 "$(command -v python3)"; do
  [ -n "$p" ] || continue
  r=$(readlink -f -- "$p") || continue
  ok=1; d=$r
  while [ "$d" != / ]; do
    case $(stat -c %A -- "$d") in *x|*t) ;; *) ok=0; break ;; esac
    d=$(dirname -- "$d")
  done
  [ "$ok" = 1 ] && { echo "$p"; exit 0; }
done
exit 1
"""


def shared_python(files: HostShell, target: SshTarget) -> str:
    """The interpreter the cluster's environment is made from (GPUBOT_SLURM_PYTHON
    overrides): one every job account can execute, or SlurmError saying what to set."""
    found = files.run(target, _SHARED_PYTHON, timeout=30)
    path = found.stdout.strip().splitlines()[-1] if found.ok and found.stdout.strip() else ""
    if not path:
        raise SlurmError(
            "no python3 here is executable by every account (each one found sits under a "
            "directory others cannot enter): set GPUBOT_SLURM_PYTHON to one they can run, "
            "e.g. /usr/bin/python3"
        )
    return path


# --- settings --------------------------------------------------------------------------


def _items(raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def _pairs(raw: str, variable: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in _items(raw):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError(f"{variable}: {item!r} is not NAME=VALUE")
        out[key.strip().lstrip("@")] = value.strip()
    return out


def _price(text: str, model: str) -> float:
    try:
        value = float(text.removeprefix("$"))
    except ValueError:
        raise ConfigError(f"GPUBOT_SLURM_RATES: {model}={text!r} is not a price in USD") from None
    if value < 0:
        raise ConfigError(f"GPUBOT_SLURM_RATES: {model}={text} is below zero")
    return value


def _apart_from_secrets(workdir: str, settings: Settings, env: Mapping[str, str]) -> None:
    """The shared work directory (every job account reads it, their jobs write in it)
    holds none of the bot's own: its database, keys, settings. Refused at start."""
    shared = Path(workdir).expanduser().resolve()
    mine = [("GPUBOT_HOME (the bot's database and keys)", settings.home)]
    for name in ("GPUBOT_CONFIG", "GPUBOT_SSH_KEY"):
        if env.get(name, "").strip():
            mine.append((name, Path(env[name].strip())))
    url = settings.sqlalchemy_url
    if url.startswith("sqlite:///"):
        mine.append(("the database", Path(url.removeprefix("sqlite:///"))))
    for what, path in mine:
        full = path.expanduser().resolve()
        if full == shared or shared in full.parents:
            raise ConfigError(
                f"GPUBOT_SLURM_WORKDIR={workdir} holds {what} ({full}): every job account "
                "reads the work directory. Put the work directory elsewhere (a shared file "
                "system every node mounts), apart from the bot's own files."
            )


def _is_root(account: str) -> bool:
    """An account that is uid 0 here (the name root, or another name for uid 0)."""
    if account == "root":
        return True
    try:
        return pwd.getpwnam(account).pw_uid == 0
    except KeyError:
        return False  # not on this machine: the doctor checks it where jobs run


def _count(text: str, variable: str) -> int | None:
    if not text.strip():
        return None
    if not text.strip().isdigit() or int(text) < 1:
        raise ConfigError(f"{variable}={text!r} is not a whole number above 0")
    return int(text)


def _megabytes(text: str) -> int | None:
    """GPUBOT_SLURM_MEM_PER_GPU: "16G", "500M", or a number of megabytes."""
    raw = text.strip().upper().removesuffix("B")
    if not raw:
        return None
    scale = {"G": 1024, "M": 1, "T": 1024 * 1024}.get(raw[-1:])
    number = raw[:-1] if scale else raw
    if not number.isdigit() or int(number) < 1:
        raise ConfigError(
            f"GPUBOT_SLURM_MEM_PER_GPU={text!r} is not an amount of memory like 16G or 500M"
        )
    return int(number) * (scale or 1)


def _signal(text: str) -> str:
    """GPUBOT_SLURM_SIGNAL ("TERM@120", Slurm's form): sent to the batch script, which is
    the runner itself (B:)."""
    name, at, seconds = text.strip().upper().removeprefix("B:").partition("@")
    if not at or not seconds.isdigit() or not name.isalnum():
        raise ConfigError(
            f"GPUBOT_SLURM_SIGNAL={text!r}: write SIGNAL@SECONDS, like TERM@120, or off"
        )
    return f"B:{name}@{int(seconds)}"


def _seconds(text: str, default: float, variable: str) -> float:
    if not text.strip():
        return default
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{variable}={text!r} is not a number of seconds") from None
    if value <= 0:
        raise ConfigError(f"{variable}={text} must be above zero")
    return value
