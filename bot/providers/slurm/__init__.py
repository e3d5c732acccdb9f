"""A lab's Slurm cluster as a place GPUs come from (`GPUBOT_PROVIDER=slurm`).

Settings (docs/SLURM.md walks through them):

    SLURM_CONF                 honoured as Slurm's own tools honour it
    GPUBOT_SLURM_WORKDIR       a directory every node and the bot can read and write: run
                               directories, status files, checkpoints, the cluster's Python
                               environment (default $GPUBOT_HOME/slurm)
    GPUBOT_SLURM_PARTITIONS    comma list of partitions to use (default: every one with GPUs)
    GPUBOT_SLURM_USERS         `slackid=unixuser,…`: whose account a person's jobs run as
                               (the bot must be root); without it, the bot's own account
    GPUBOT_SLURM_LOGIN         `user@host[:port]`: run Slurm's commands on a login node over
                               SSH (GPUBOT_SSH_KEY) instead of on this machine
    GPUBOT_SLURM_RATES         `A100=1.50,H100=3.20`: USD per GPU-hour of the team's use,
                               per model (default: unset, and /gpu cost says so)
    GPUBOT_SLURM_CACHE_S       how long one read of the cluster serves (default 5 s)
    GPUBOT_SLURM_TIMEOUT_S     the most any Slurm command may take (default 15 s)

Slurm orders and preempts the cluster's jobs: a reservation is a holding job
(bot.providers.slurm.holds), a run a batch job (bot.providers.slurm.runs); gpubot
meters the team's use and never reorders the cluster.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from bot.app.config import ConfigError, Settings
from bot.app.ports import FIXED_POOL, Supply
from bot.app.remote import PreparedHost, bootstrap_prepare
from bot.app.runaccount import bot_pip_env
from bot.app.runs import RunService
from bot.domain.readmodels import HostState
from bot.domain.timefmt import when
from bot.providers.base import Note, Parts, Probes
from bot.providers.slurm.cluster import ClusterView
from bot.providers.slurm.holds import SlurmHolder
from bot.providers.slurm.runs import ClusterEnv, ClusterSeat, SlurmExecutor
from db.models import User
from db.session import transaction
from provisioning.aws_doctor import Check
from provisioning.base import Instance
from provisioning.bootstrap import bootstrap
from provisioning.catalog import Catalog
from provisioning.local_runner import LOCAL_TARGET, LocalRunner
from provisioning.slurm import SlurmClient, SlurmError
from provisioning.ssh import SshRunner, SshTarget, parse_address

if TYPE_CHECKING:
    from bot.app.fleet import Fleet
    from bot.app.service import GpuService

log = logging.getLogger(__name__)


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
        runner: SshRunner,
        *,
        client: SlurmClient | None = None,
    ) -> None:
        self.settings = settings
        self._catalog = Catalog.load(prefer=settings.prices_path)
        self.workdir = env.get("GPUBOT_SLURM_WORKDIR", "").strip() or str(
            (settings.home / "slurm").resolve()
        )
        self.partitions = _items(env.get("GPUBOT_SLURM_PARTITIONS", ""))
        self.users = _pairs(env.get("GPUBOT_SLURM_USERS", ""), "GPUBOT_SLURM_USERS")
        self.rates = {
            self._model(k): _price(v, k)
            for k, v in _pairs(env.get("GPUBOT_SLURM_RATES", ""), "GPUBOT_SLURM_RATES").items()
        }
        self.cache_s = _seconds(env.get("GPUBOT_SLURM_CACHE_S", ""), 5.0, "GPUBOT_SLURM_CACHE_S")
        timeout = _seconds(env.get("GPUBOT_SLURM_TIMEOUT_S", ""), 15.0, "GPUBOT_SLURM_TIMEOUT_S")
        login = env.get("GPUBOT_SLURM_LOGIN", "").strip()
        self.target: SshTarget = LOCAL_TARGET
        self.files: SshRunner = LocalRunner()
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
        self.client = client or SlurmClient(
            conf=env.get("SLURM_CONF") or None,
            login=self.target if login else None,
            runner=self.files if login else None,
            timeout_s=timeout,
            normalize=self._catalog.normalize_model,
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
        cls, settings: Settings, env: Mapping[str, str], runner: SshRunner
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

    def connect(self, service: GpuService, parts: Parts) -> Fleet | None:
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
        service.upkeep.append(upkeep)
        env = ClusterEnv(lambda: self._prepare(parts))

        def owner_of(user_id: int) -> str | None:
            with transaction(parts.engine, write=False) as s:
                user = s.get(User, user_id)
                return user.key if user is not None else None

        executor = SlurmExecutor(
            cluster,
            self.files,
            self.target,
            workdir=self.workdir,
            env=env,
            clock=service.clock,
            nudge=service.nudge,
            owner_of=owner_of,
            rates=self.rates,
            users=self.users,
            partitions=self.partitions,
            tz=service.settings.timezone,
        )
        access = ClusterSeat(cluster, self.files, self.target, env, self.workdir)
        service.runs = RunService(service, access, self._catalog, executor=executor)
        service.holder = SlurmHolder(
            service,
            cluster,
            provider=name,
            rates=self.rates,
            users=self.users,
            partitions=self.partitions,
            workdir=self.workdir,
        )
        return None

    def _prepare(self, parts: Parts) -> PreparedHost:
        """The cluster's Python, once, under the work directory: the bootstrap's venv and
        code (a test hands its own preparation)."""
        if parts.prepare is not bootstrap_prepare and parts.prepare is not None:
            return parts.prepare(self.files, self.target)
        report = bootstrap(
            self.files, self.target, remote_root=f"{self.workdir}/env", env=bot_pip_env()
        )
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
        if provider.users:
            out.append(
                Check(
                    "Slurm users",
                    True,
                    f"{len(provider.users)} people's jobs run as their own accounts",
                )
            )
        else:
            out.append(
                Note(
                    "Slurm users",
                    True,
                    "GPUBOT_SLURM_USERS is not set: every job runs as the bot's own account",
                    "Map Slack ids to unix accounts (GPUBOT_SLURM_USERS=U0123=alice,…); the bot must be root to submit as them.",
                )
            )
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

    def cost_note_for(self, gpus: Mapping[str, int]) -> str | None:
        unset = sorted(m for m in gpus if m not in self.rates)
        if not unset:
            return None
        return f"no price per GPU-hour for {', '.join(unset)}: /gpu cost shows their use at $0"


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
