"""A host that is not this machine: its own account, only the system python3, nothing of ours.

The slow step (a bootstrap from nothing: venv, the whole `train` extra from the wheel
cache, the training package) runs once per session in the `bootstrapped` fixture; these
tests check what it left and what a host sees without it.
"""

from __future__ import annotations

import importlib.metadata
import json
import posixpath
import sys
import tomllib
from pathlib import Path

import pytest

from provisioning import shell
from provisioning.base import ProvisioningError
from provisioning.bootstrap import (
    BOOTSTRAP_VERSION,
    NO_DRIVER,
    UP_TO_DATE,
    bootstrap,
    extra_from_metadata,
    requirement_name,
    train_requirements,
)
from provisioning.ssh import SshClient
from tests.isolated_hosts import Bootstrapped, isolated_target
from tests.ssh_hosts import SshLab

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_bootstrap_installs_exactly_pyprojects_train_extra() -> None:
    """One list: what a host gets is what `pip install .[train]` gets here."""
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]["train"]
    assert list(train_requirements()) == declared
    names = {requirement_name(r).lower() for r in declared}
    # What training imports on a host: the digits recipe's sklearn was once missing.
    assert {"torch", "numpy", "scikit-learn", "nvidia-ml-py"} <= names
    # An installed bot without pyproject.toml reads the same list from its metadata.
    installed = importlib.metadata.requires("gpubot") or []
    assert list(extra_from_metadata(installed, "train")) == declared


def test_a_host_account_has_nothing_of_the_bots(isolated_lab: SshLab) -> None:
    client = SshClient(connect_timeout=5, command_timeout=30)
    target = isolated_target(isolated_lab, "lab-b")
    try:
        who = client.run(target, "id -un; echo $HOME; command -v python3", timeout=30)
        assert who.ok, who.stderr
        user, home, python = who.stdout.split()
        assert user == isolated_lab.hosts["lab-b"].account != isolated_lab.user
        assert home.startswith("/home/") and python == "/usr/bin/python3"
        bare = client.run(target, "python3 -c 'import training'", timeout=30)
        assert not bare.ok and "No module named 'training'" in bare.stderr
        # The bot's home (its secrets, its config) is closed to the host's account.
        assert not client.run(target, shell.join(["ls", str(Path.home())]), timeout=30).ok
    finally:
        client.close()


def test_a_bootstrap_from_nothing_leaves_a_venv_that_runs_every_recipe_import(
    bootstrapped: Bootstrapped,
) -> None:
    report = bootstrapped.report
    assert not report.noop
    assert report.steps[0] == NO_DRIVER
    assert f"installing {' '.join(train_requirements())} (this can take several minutes)" in (
        report.steps
    )
    assert report.steps[-1] == f"marker written (bootstrap v{BOOTSTRAP_VERSION})"
    assert report.root == posixpath.join(bootstrapped.lab.hosts["lab-a"].root.as_posix(), ".gpubot")
    assert report.torch is not None and report.torch.startswith("2.13.0")
    client = SshClient(connect_timeout=5, command_timeout=120)
    try:
        imports = client.run(
            bootstrapped.target,
            shell.join(
                [
                    report.venv_python,
                    "-c",
                    "import json, sys, sklearn, numpy, pynvml, torch, training.recipes as r;"
                    "d = r.load_digits_data();"
                    "print(json.dumps([sys.prefix, len(d.train_x) + len(d.test_x)]))",
                ]
            ),
            timeout=120,
            cwd=report.code_dir,
        )
    finally:
        client.close()
    assert imports.ok, imports.stderr[-500:]
    prefix, samples = json.loads(imports.stdout.strip().splitlines()[-1])
    assert prefix == posixpath.join(report.root, "venv")
    assert samples == 1797  # scikit-learn's bundled digits, read on the host


def test_a_second_bootstrap_is_a_noop(bootstrapped: Bootstrapped) -> None:
    again = bootstrapped.again
    assert again.noop and again.steps == (UP_TO_DATE,)
    assert again.venv_python == bootstrapped.report.venv_python
    assert again.uploaded == 0


def test_pip_failing_is_a_setup_error_that_says_why(isolated_lab: SshLab) -> None:
    """No index and no wheels: the host's own pip fails, and the error carries its words."""
    client = SshClient(connect_timeout=5, command_timeout=60)
    target = isolated_target(isolated_lab, "lab-b")
    try:
        with pytest.raises(ProvisioningError) as failed:
            bootstrap(
                client,
                target,
                remote_root="~/.gpubot-nopip",
                env={"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "/nonexistent"},
            )
    finally:
        client.run(target, "rm -rf ~/.gpubot-nopip", timeout=30)
        client.close()
    text = str(failed.value)
    assert text.startswith("bootstrap of lab-b (")
    # pip's own last words follow the list it was given.
    assert f": pip install {' '.join(train_requirements())} failed: " in text
    assert text.rstrip().endswith(text.split(" failed: ", 1)[1].rstrip()) and "ERROR" in text


def test_no_python_is_a_setup_error(isolated_lab: SshLab) -> None:
    client = SshClient(connect_timeout=5, command_timeout=30)
    target = isolated_target(isolated_lab, "lab-b")
    try:
        with pytest.raises(ProvisioningError, match=r"lab-b \(.*\) has no Python at 'python9'"):
            bootstrap(client, target, remote_root="~/.gpubot-nopy", python="python9")
    finally:
        client.run(target, "rm -rf ~/.gpubot-nopy", timeout=30)
        client.close()


if sys.platform != "linux":  # pragma: no cover - the accounts are Linux accounts
    pytestmark = pytest.mark.skip(reason="isolated hosts are Linux accounts")
