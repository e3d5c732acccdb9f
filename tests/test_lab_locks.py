"""Two test sessions on one machine take turns on the isolated host accounts.

`start_isolated_lab` empties the accounts' homes and kills their processes: a second
session doing that under a first one's bootstrap would break it mid-test. Each lab holds
an flock per account (`AccountLock`); these tests hold locks on names no account has,
so they touch no real host account and run anywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ssh_hosts import (
    _LOCK_DIR,
    SSH_ACCOUNT_PREFIX,
    AccountLock,
    SshdUnavailable,
    worker_accounts,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def names() -> Iterator[tuple[str, str]]:
    pair = (f"gpubot-locktest-{os.getpid()}-b", f"gpubot-locktest-{os.getpid()}-a")
    try:
        yield pair
    finally:
        for name in pair:
            (_LOCK_DIR / f"gpubot-test-{name}.lock").unlink(missing_ok=True)


def test_a_second_session_waits_and_gets_the_accounts_when_the_first_lets_go(
    names: tuple[str, str],
) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from tests.ssh_hosts import AccountLock;"
            f"AccountLock({names!r}).acquire(); print('held', flush=True); sys.stdin.read()",
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        mine = AccountLock((names[0],))
        with pytest.raises(SshdUnavailable, match="another test session on this machine"):
            mine.acquire(wait_s=1)
        assert mine.fds == []  # gave up cleanly, holding nothing
        assert holder.stdin is not None
        holder.stdin.close()  # the first session ends (a crash drops its locks the same way)
        assert holder.wait(timeout=30) == 0
        mine.acquire(wait_s=60)
        mine.release()
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_one_process_cannot_start_two_labs_on_one_account(names: tuple[str, str]) -> None:
    """It would wait for itself for half an hour: refused at once instead."""
    first = AccountLock(names)
    first.acquire(wait_s=5)
    try:
        with pytest.raises(SshdUnavailable, match="already has a lab on"):
            AccountLock((names[1],)).acquire(wait_s=5)
    finally:
        first.release()
    again = AccountLock((names[1],))
    again.acquire(wait_s=5)
    again.release()


def test_waiting_out_of_name_order_is_short_and_says_why(names: tuple[str, str]) -> None:
    """Holding "…-b" and wanting "…-a", held by another session that may want "…-b":
    a long wait could be a deadlock, so it gives up after `out_of_order_s`."""
    later, earlier = sorted(names, reverse=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from tests.ssh_hosts import AccountLock;"
            f"AccountLock(({earlier!r},)).acquire(); print('held', flush=True); sys.stdin.read()",
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    mine = AccountLock((later,))
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        mine.acquire(wait_s=5)
        # A half-hour wait asked for; held out of order, it is cut to one second.
        with pytest.raises(SshdUnavailable, match=f"this process holds {later}"):
            AccountLock((earlier,)).acquire(wait_s=1800, out_of_order_s=1)
    finally:
        mine.release()
        holder.kill()
        holder.wait(timeout=30)


def test_each_xdist_worker_has_its_own_accounts() -> None:
    assert worker_accounts(0) == (f"{SSH_ACCOUNT_PREFIX}0-a", f"{SSH_ACCOUNT_PREFIX}0-b")
    assert set(worker_accounts(0)).isdisjoint(worker_accounts(1))
