"""The run account's interpreter: what runs on this machine start with.

Runs on this machine run as an unprivileged account (GPUBOT_RUN_AS), never as the bot.
That account needs `training` and torch: the bot's own virtualenv where it can use it,
else an environment of its own under its home, prepared on first use as a host's
bootstrap prepares one (bot.faces.runtime wires `RunAccount` into the local access).
"""

from __future__ import annotations

import logging
import os
import site
import stat
import sys
import threading
from pathlib import Path

from bot.app.hosts.remote import PreparedHost
from bot.app.ports import Interpreter
from provisioning import shell
from provisioning.base import ProvisioningError
from provisioning.bootstrap import bootstrap
from provisioning.local_runner import LOCAL_TARGET, LocalRunner
from provisioning.ssh import SshError

log = logging.getLogger(__name__)


def prepare_run_account(runner: LocalRunner) -> PreparedHost:
    """Where `python -m training.runner` comes from when it runs as the run account.

    The bot's own interpreter when that account can run it and import `training` and
    torch with it (a virtualenv under /opt, readable by all). Otherwise the package is
    staged into the account's ``~/.gpubot`` as bootstrap does for a remote host, with a
    virtualenv made from the account's ``python3``, lent the bot's site-packages where
    the account can read them, and else given the whole `train` extra of its own (torch
    included) through the bot's own pip settings (`bot_pip_env`): a run never starts in
    an environment without torch. Raises SshError with the exact fix when none works."""
    account = runner.account
    root = f"{account.home}/.gpubot"
    probe = runner.run(
        LOCAL_TARGET,
        shell.join([sys.executable, "-c", "import training.runner, torch"]),
        timeout=180,
        cwd=account.home,
    )
    if probe.ok:
        return PreparedHost(root=root, python=sys.executable)
    why = (probe.stderr.strip().splitlines() or [f"exit {probe.exit_code}"])[-1][:200]
    fix = run_account_fix(account.name)
    try:
        report = bootstrap(runner, LOCAL_TARGET, remote_root=root, install_torch=False)
        # Lent again on every preparation, not only the first: the marker remembers a
        # torch that came from a lent path, and a bot venv that moved or was rebuilt
        # since would leave the account's venv pointing at nothing.
        torch = _lend_bot_packages(runner, report.venv_python)
        if torch is None:
            # The account cannot read the bot's packages (a checkout under a private
            # home, say): an environment of its own, torch from where the bot's came.
            log.info(
                "run account %s cannot use %s (%s); installing the train extra into %s",
                account.name,
                sys.executable,
                why,
                root,
            )
            report = bootstrap(
                runner, LOCAL_TARGET, remote_root=root, install_torch=True, env=bot_pip_env()
            )
            torch = report.torch
    except ProvisioningError as exc:
        raise SshError(
            f"the run account {account.name} cannot use the bot's interpreter "
            f"{sys.executable} ({why}), and preparing an environment of its own in {root} "
            f"failed: {exc}. {fix}"
        ) from None
    if torch is None:
        raise SshError(
            f"the run account {account.name} cannot use the bot's interpreter "
            f"{sys.executable} ({why}), and its own environment in {root} has no torch. {fix}"
        )
    log.info("run account %s uses its own environment in %s (torch %s)", account.name, root, torch)
    return PreparedHost(root=report.root, python=report.venv_python, code_dir=report.code_dir)


# pip's settings that say where packages come from, passed from the bot's environment to
# the run account's install so that it finds torch where the bot's own came from (a
# wheel directory, an index, a proxy). Their values are never logged.
_PIP_ENV = (
    "PIP_INDEX_URL",
    "PIP_EXTRA_INDEX_URL",
    "PIP_FIND_LINKS",
    "PIP_NO_INDEX",
    "PIP_TRUSTED_HOST",
    "PIP_CERT",
    "PIP_CONSTRAINT",
    "PIP_DEFAULT_TIMEOUT",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
)


def bot_pip_env() -> dict[str, str]:
    """Where the bot's own pip installs from, for the run account's install."""
    return {k: os.environ[k] for k in _PIP_ENV if os.environ.get(k)}


def closed_dirs(path: Path) -> list[Path]:
    """The directories on the way to `path` (itself included) that another account cannot
    enter: what keeps the run account from the bot's virtualenv."""
    closed = []
    for d in [*reversed(path.parents), path]:
        try:
            if not d.stat().st_mode & stat.S_IXOTH:
                closed.append(d)
        except OSError:
            break
    return closed


def run_account_fix(account: str) -> str:
    """The exact fix for a run account that cannot read the bot's interpreter: the
    directories on the way to its virtualenv and to the Python it was made from."""
    real = Path(os.path.realpath(sys.executable)).parent
    closed = sorted({*closed_dirs(Path(sys.prefix)), *closed_dirs(real)})
    if not closed:
        return f"Make {sys.prefix} readable by {account}, or give {account} a python3 with torch."
    dirs = " ".join(shell.quote(str(d)) for d in closed)
    return (
        f"To let {account} use the bot's own virtualenv instead: `chmod o+x {dirs}` "
        f"({', '.join(str(d) for d in closed)} cannot be entered by other accounts)."
    )


# The .pth that lends the bot's site-packages to the staged virtualenv.
_LENT_PTH = "_gpubot_bot_packages.pth"


def _lend_bot_packages(runner: LocalRunner, python: str) -> str | None:
    """The staged virtualenv's interpreter may not reach the bot's, but often it can read
    the bot's site-packages (torch and all): with the same Python minor version, a .pth
    naming them lends it those packages, as bootstrap does with an image's virtualenv.
    Returns torch's version when it then imports; None otherwise."""

    def ask(code: str) -> str | None:
        result = runner.run(LOCAL_TARGET, shell.join([python, "-c", code]), timeout=180)
        return result.stdout.strip() if result.ok else None

    ours = "{}.{}".format(*sys.version_info[:2])
    if ask("import sys; print('%d.%d' % sys.version_info[:2])") != ours:
        return None
    purelib = ask("import sysconfig; print(sysconfig.get_path('purelib'))")
    if not purelib or not purelib.startswith("/"):
        return None
    lent = "".join(f"{d}\n" for d in site.getsitepackages())
    runner.write_file(LOCAL_TARGET, f"{purelib}/{_LENT_PTH}", lent.encode())
    return ask("import torch; print(torch.__version__)")


class RunAccount:
    """The run account's interpreter, prepared on first use (`prepare_run_account`) when a
    run starts or a probe runs there: a failure then fails that run or probe with the
    reason (SshError), instead of the bot refusing to start, and the next use tries again."""

    def __init__(self, runner: LocalRunner) -> None:
        self.runner = runner
        self._found: Interpreter | None = None
        self._lock = threading.Lock()

    def interpreter(self) -> Interpreter:
        with self._lock:
            if self._found is None:
                self._found = prepare_run_account(self.runner).interpreter()
            return self._found
