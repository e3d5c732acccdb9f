"""One line of `gpubot doctor`'s answer, whatever it checked: a provider's hosts or
cluster, the database, Slack, EC2. Its own module so that a provider's checks need not
import another provider's (they all imported it from the AWS doctor)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    """One line of the doctor's answer."""

    # What was checked ("AWS credentials", "EC2 key pair", "Slurm identity", …).
    name: str
    ok: bool
    # What was found, in words a teammate understands.
    detail: str
    # What to do about it; empty when ok.
    fix: str = ""
