"""`gpubot hosts forget NAME`: leave a team's own server as it was before the bot.

The bootstrap leaves a host agent behind that outlives SSH sessions and reboots (a
systemd unit or a supervised loop with an @reboot line): right while the bot runs, wrong
once the team stops using the host. Forgetting a host removes that agent and what
restarts it, the marker (so a later bootstrap starts clean), with `purge` the venv and
code too, and marks the host's row terminated so it leaves `/gpu status`. A host that
still holds GPUs or runs is refused: its users would lose them without a word.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from sqlmodel import col, select

from bot.app.config import Settings
from bot.app.money.billing import note_host_state
from bot.app.watching.held import held_gpu_ids
from bot.domain.clock import Clock
from bot.domain.errors import UserError
from db.models import HOST_TERMINATED, Host, TrainingRun
from db.session import lock_pool, transaction
from provisioning.base import ProvisioningError
from provisioning.bootstrap import remove_agent
from provisioning.hostshell import HostShell
from provisioning.ssh import SshTarget

USAGE = "gpubot hosts forget NAME [--purge]"
_RUN_ON_HOST = ("starting", "running", "cancelling")


def forget_host(
    engine: Any,
    settings: Settings,
    clock: Clock,
    runner: HostShell,
    name: str,
    *,
    key_path: str | None,
    owned: Collection[str],
    remote_root: str = "~/.gpubot",
    purge: bool = False,
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """Removes the agent from host `name` and forgets the host; returns what was done.
    `owned`: the providers whose hosts are the team's own machines (bot.providers.owners);
    a host of another (a cloud instance, a cluster's node) is not forgotten this way.
    Raises UserError with the reason when it may not or cannot."""
    with transaction(engine, write=False) as s:
        host = s.exec(select(Host).where(Host.name == name)).first()
        if host is None or host.state == HOST_TERMINATED:
            known = ", ".join(
                h.name for h in s.exec(select(Host).where(Host.state != HOST_TERMINATED))
            )
            raise UserError(f"There is no host `{name}`; hosts: {known or 'none'}.", USAGE)
        if host.provider not in owned:
            raise UserError(
                f"`{name}` is a {host.provider} host: only the team's own SSH hosts are "
                "forgotten this way (the fleet stops and terminates cloud instances).",
                USAGE,
            )
        held = held_gpu_ids(s, host_id=host.id)
        runs = s.exec(
            select(TrainingRun.id).where(
                TrainingRun.host_id == host.id, col(TrainingRun.state).in_(_RUN_ON_HOST)
            )
        ).all()
        if held or runs:
            raise UserError(
                f"`{name}` is in use ({len(held)} GPUs held, {len(runs)} runs on it); "
                "release them or wait for the runs to end, then forget it.",
                USAGE,
            )
        target = SshTarget(
            host=host.address,
            port=host.ssh_port,
            user=host.ssh_user,
            key_path=key_path,
            name=host.name,
        )
    home = runner.run(target, 'printf %s "$HOME"', timeout=30, env=env)
    if not home.ok or not home.stdout.startswith("/"):
        raise UserError(
            f"Cannot reach `{name}` to remove its agent ({home.stderr.strip()[-200:]}); "
            "nothing was changed. Try again when it answers.",
            USAGE,
        )
    root = remote_root
    if root == "~" or root.startswith("~/"):
        root = home.stdout.rstrip("/") + root[1:]
    try:
        steps = remove_agent(runner, target, root, purge=purge, env=env)
    except ProvisioningError as exc:
        raise UserError(f"Could not remove the agent from `{name}`: {exc}", USAGE) from None
    with transaction(engine) as s:
        lock_pool(s)
        row = s.exec(select(Host).where(Host.name == name)).one()
        now = clock.now()
        row.state = HOST_TERMINATED
        row.updated_at = now
        s.add(row)
        s.flush()
        note_host_state(s, row, now, settings)
    steps.append(f"host {name} forgotten: it no longer shows in /gpu status")
    return steps
