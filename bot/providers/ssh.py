"""The team's own servers over SSH (`GPUBOT_PROVIDER=ssh`).

Settings: GPUBOT_SSH_HOSTS, a comma list of `[name=][user@]host[:port][/4xA100[+2xT4]]`;
GPUBOT_SSH_USER, the login where an entry names none (default root); GPUBOT_SSH_KEY, the
private key (default: ssh-agent and ~/.ssh). The hosts are owned (no hourly bill), each
bootstrapped and checked off the tick (bot.app.hosts.hostcheck): `checking` until a check
answers, their runs process groups reached over SSH with the host agent beside them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from sqlalchemy.engine import Engine
from sqlmodel import select

from bot.app.config import ConfigError, Settings
from bot.app.hosts.hostcheck import HostChecker
from bot.app.hosts.remote import RemoteAccess
from bot.app.money.prices import priced_catalog
from bot.app.places import RunParts, Wiring
from bot.app.ports import FIXED_POOL, PlainDisplay, Supply
from bot.app.runs.processes import ProcessExecutor
from bot.domain.readmodels import HostState
from bot.providers.base import SSH_TIMEOUT_S, Parts, Probes, for_hosts
from db.models import HOST_CHECKING, HOST_UNREACHABLE, Host
from db.session import transaction
from provisioning.base import Instance
from provisioning.catalog import Catalog
from provisioning.checks import Check
from provisioning.hosts import HostEntryError, StaticHost, StaticHostsCompute, parse_host_entries
from provisioning.hostshell import HostShell
from provisioning.ssh import SshClient, SshError, SshTarget, StaticResolver

if TYPE_CHECKING:
    from bot.app.service import GpuService


class SshProvider(PlainDisplay):
    name: ClassVar[str] = "ssh"
    label: ClassVar[str] = "SSH"
    owns_hosts: ClassVar[bool] = True

    def __init__(self, settings: Settings, compute: StaticHostsCompute) -> None:
        self._compute = compute
        self._catalog = priced_catalog(settings)

    @classmethod
    def from_env(cls, settings: Settings, env: Mapping[str, str], runner: HostShell) -> SshProvider:
        hosts = static_hosts_from_env(env)
        if not hosts:
            raise ConfigError(
                "GPUBOT_PROVIDER=ssh but GPUBOT_SSH_HOSTS lists no hosts; list them as "
                "[name=][user@]host[:port][/4xA100], comma-separated."
            )
        return cls(settings, StaticHostsCompute(hosts, runner))

    @property
    def compute(self) -> StaticHostsCompute:
        return self._compute

    @property
    def catalog(self) -> Catalog:
        return self._catalog

    @property
    def supply(self) -> Supply:
        return FIXED_POOL

    def connect(self, service: GpuService, parts: Parts) -> Wiring:
        """Owned hosts over SSH: bootstrap, inventory and health run on the checker's
        threads, never in the tick."""
        service.sync_hosts(static_listing(parts.engine, self._compute))
        access = RemoteAccess(
            parts.engine,
            parts.runner,
            parts.resolver or StaticResolver(self._compute.targets()),
            prepare=for_hosts(parts.prepare, cloud=False),
            # The checker bootstraps; the tick (dispatch, sampling) never waits on one.
            wait_for_prepare=False,
            clock=service.clock,
        )
        executor = ProcessExecutor(access, service.clock, service.nudge, agents=(self.name,))
        return Wiring(
            self.name,
            label="the team's SSH hosts",
            display=self,
            runs=RunParts(access, self._catalog, executor),
            checker=HostChecker(service, access, self._compute.hosts, owner=self.name),
        )

    def note(self, host: HostState) -> str | None:
        if host.gpus and all(g.model == "cpu" for g in host.gpus):
            return "CPU only: no NVIDIA GPU found, runs use its CPUs"
        return None

    # --- gpubot doctor ------------------------------------------------------------------

    @classmethod
    def checks(cls, settings: Settings, env: Mapping[str, str], probes: Probes) -> list[Check]:
        targets = probes.ssh_targets
        if targets is None:
            try:
                targets = ssh_targets_from_env(env)
            except ConfigError as exc:
                return [Check("SSH hosts", False, exc.text, "Fix GPUBOT_SSH_HOSTS.")]
        required = cls.name in (settings.providers or (settings.provider,))
        return check_ssh(targets, required=required, timeout_s=probes.ssh_timeout_s)

    @classmethod
    def wanted(cls, env: Mapping[str, str]) -> bool:
        return bool(env.get("GPUBOT_SSH_HOSTS", "").strip())


def static_listing(engine: Engine, compute: StaticHostsCompute) -> list[Instance]:
    """The static hosts as configured, without dialling any. A host that has never
    answered a check (new, or only ever down) is `checking` until bot.app.hosts.hostcheck's
    first check answers: declaring its GPUs does not make it reachable, and nothing is
    granted on it meanwhile. A host given without a GPU list gets them from that check
    (its bootstrap, then its inventory: a bare `python3` there cannot import
    `training`). One marked down stays down until a check sees it answer, across
    restarts; one that answered before keeps its state."""
    with transaction(engine, write=False) as s:
        rows = {h.name: h for h in s.exec(select(Host).where(Host.provider == SshProvider.name))}
    out = []
    for inst in StaticHostsCompute(compute.hosts).list_instances():
        row = rows.get(inst.name)
        if row is not None and row.state == HOST_UNREACHABLE and row.down_reason:
            inst = replace(inst, state=HOST_UNREACHABLE)
        elif row is None or row.ready_at is None or not inst.gpus:
            inst = replace(inst, state=HOST_CHECKING)
        out.append(inst)
    return out


# --- settings ---------------------------------------------------------------------------


def ssh_targets_from_env(env: Mapping[str, str]) -> tuple[SshTarget, ...]:
    """GPUBOT_SSH_HOSTS as targets; a ConfigError names an entry that does not parse."""
    return tuple(h.target for h in static_hosts_from_env(env))


def static_hosts_from_env(env: Mapping[str, str]) -> tuple[StaticHost, ...]:
    """GPUBOT_SSH_HOSTS with the GPUs each entry declares (`box=user@host:22/4xA100`)."""
    user = env.get("GPUBOT_SSH_USER", "").strip() or "root"
    key = env.get("GPUBOT_SSH_KEY", "").strip() or None
    try:
        return parse_host_entries(
            env.get("GPUBOT_SSH_HOSTS", ""),
            default_user=user,
            key_path=str(Path(key).expanduser()) if key else None,
            normalize=_normalize_model,
        )
    except HostEntryError as exc:
        raise ConfigError(str(exc)) from None


def _normalize_model(text: str) -> str | None:
    return Catalog.load().normalize_model(text)


# --- gpubot doctor's SSH lines ----------------------------------------------------------


def check_ssh(
    targets: Sequence[SshTarget], *, required: bool = False, timeout_s: float = SSH_TIMEOUT_S
) -> list[Check]:
    """A login plus `true` per host: a listening port is not a host the bot can use.
    `required`: the configured provider needs hosts, so none is a failure."""
    if not targets:
        if required:
            return [
                Check(
                    "SSH",
                    False,
                    "GPUBOT_PROVIDER=ssh but no hosts are configured",
                    "List the GPU hosts in GPUBOT_SSH_HOSTS as [name=][user@]host[:port], comma-separated.",
                )
            ]
        return [Check("SSH", True, "no SSH hosts configured (GPUBOT_SSH_HOSTS)")]
    checks = []
    with SshClient(connect_timeout=timeout_s, command_timeout=timeout_s) as client:
        for target in targets:
            name = f"SSH {target.name or target.host}"
            try:
                checks.append(_ssh_login(client, target, name, timeout_s))
            except Exception as exc:  # a check must never crash the doctor
                checks.append(
                    Check(
                        name,
                        False,
                        f"the check itself failed ({type(exc).__name__}: {exc})",
                        "This is a bug in gpubot doctor; please report this line.",
                    )
                )
    return checks


def _ssh_fix(target: SshTarget, message: str) -> str:
    key = target.key_path or "ssh-agent or ~/.ssh"
    try_it = (
        f"Try `ssh{f' -i {target.key_path}' if target.key_path else ''} -p {target.port} "
        f"{target.user}@{target.host} true` from this machine."
    )
    if "did not accept" in message:
        return (
            f"Add the bot's public key (for {key}) to ~{target.user}/.ssh/authorized_keys on the host, "
            f"or set GPUBOT_SSH_USER/GPUBOT_SSH_KEY to a user and key it accepts. {try_it}"
        )
    if "refused" in message:
        return f"Nothing listens on port {target.port}: start sshd there, or fix the port in GPUBOT_SSH_HOSTS. {try_it}"
    if "host key" in message:
        return f"The host was reinstalled or is not the one you meant; check its key before trusting it. {try_it}"
    return (
        f"Check that {target.host} is up and reachable from here (firewall, VPN), that sshd listens on "
        f"port {target.port}, and that user {target.user} accepts the key ({key}). {try_it}"
    )


def _ssh_login(client: SshClient, target: SshTarget, name: str, timeout_s: float) -> Check:
    if target.key_path and not Path(target.key_path).is_file():
        return Check(
            name,
            False,
            f"the SSH key {target.key_path} does not exist",
            "Set GPUBOT_SSH_KEY to the private key file the hosts accept.",
        )
    try:
        result = client.run(target, "true", timeout=timeout_s)
    except SshError as exc:
        return Check(name, False, str(exc), _ssh_fix(target, str(exc)))
    if not result.ok:
        return Check(
            name,
            False,
            f"logged in to {target.label}, but `true` exited {result.exit_code}",
            f"The login shell of {target.user} on {target.host} is broken; check its shell and profile.",
        )
    return Check(name, True, f"{target.label}: logged in and ran a command")
