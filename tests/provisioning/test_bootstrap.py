"""Host bootstrap against the real sshd hosts (127.0.0.2/.3) and the local runner.

Nothing is downloaded: the image's torch is a tiny fake module on the remote
PYTHONPATH (with PIP_NO_INDEX=1 so a slip into pip fails instead of fetching), and
PATH holds only what a test puts there, so "no nvidia-smi" is true even on a GPU box.

A shortcut, on purpose: the hosts are the default lab (the bot's own user), because these
tests are about the bootstrap's steps and their failures in seconds: "the image's python"
is the bot's own interpreter (its venv has numpy, scikit-learn and NVML), and the fake
torch and the remote root lie in the test's tmp dir, which only the bot's user may read.
A bootstrap from nothing on a host that is not this machine is
tests/provisioning/test_isolated_hosts.py (and the journey's, in tests/provisioning_aws).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from provisioning.base import ProvisioningError
from provisioning.bootstrap import (
    BOOTSTRAP_VERSION,
    IMAGE_PTH,
    MARKER_NAME,
    NO_DRIVER,
    PACKAGE_EXCLUDE,
    UP_TO_DATE,
    BootstrapReport,
    bootstrap,
    default_package_dir,
    package_hash,
    requirement_name,
    train_requirements,
)
from provisioning.hostshell import HostShell
from provisioning.local_runner import LOCAL_TARGET, LocalRunner
from provisioning.manifest import local_tree
from provisioning.ssh import RunResult, SshClient, SshTarget, UploadReport
from tests.provisioning.conftest import target_for
from tests.ssh_hosts import SshLab

FAKE_TORCH = "2.13.0+fake"


class Recorder:
    """The real runner, with a log of what was asked of the host (to prove a no-op)."""

    def __init__(self, inner: HostShell) -> None:
        self.inner = inner
        self.calls: list[tuple[str, str]] = []
        self.uploads: list[UploadReport] = []

    def run(
        self,
        target: SshTarget,
        command: str,
        timeout: float | None = None,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> RunResult:
        assert timeout is not None, f"no timeout on {command!r}"
        self.calls.append(("run", command))
        return self.inner.run(target, command, timeout, cwd=cwd, env=env)

    def upload_dir(
        self,
        target: SshTarget,
        local_dir: str | os.PathLike[str],
        remote_dir: str,
        *,
        exclude: Sequence[str] = (),
    ) -> UploadReport:
        self.calls.append(("upload_dir", remote_dir))
        report = self.inner.upload_dir(target, local_dir, remote_dir, exclude=exclude)
        self.uploads.append(report)
        return report

    def put_file(
        self,
        target: SshTarget,
        local_path: str | os.PathLike[str],
        remote_path: str,
        *,
        mode: int | None = None,
    ) -> None:
        self.calls.append(("put_file", remote_path))
        self.inner.put_file(target, local_path, remote_path, mode=mode)

    def write_file(
        self, target: SshTarget, remote_path: str, data: bytes, *, mode: int = 0o644
    ) -> None:
        self.calls.append(("write_file", remote_path))
        self.inner.write_file(target, remote_path, data, mode=mode)

    def read_file(
        self, target: SshTarget, path: str, *, max_bytes: int | None = None
    ) -> bytes | None:
        self.calls.append(("read_file", path))
        return self.inner.read_file(target, path, max_bytes=max_bytes)

    def start_detached(
        self,
        target: SshTarget,
        command: str,
        log_path: str,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        pid_file: str | None = None,
    ) -> int:
        self.calls.append(("start_detached", command))
        return self.inner.start_detached(
            target, command, log_path, cwd=cwd, env=env, pid_file=pid_file
        )

    def tail(self, target: SshTarget, path: str, lines: int = 50) -> str:
        self.calls.append(("tail", path))
        return self.inner.tail(target, path, lines)

    def kill_group(self, target: SshTarget, pgid: int, signal: str = "TERM") -> bool:
        self.calls.append(("kill_group", str(pgid)))
        return self.inner.kill_group(target, pgid, signal)

    def is_alive(self, target: SshTarget, pid: int) -> bool:
        self.calls.append(("is_alive", str(pid)))
        return self.inner.is_alive(target, pid)

    def wait_gone(self, target: SshTarget, pid: int, timeout: float) -> bool:
        self.calls.append(("wait_gone", str(pid)))
        return self.inner.wait_gone(target, pid, timeout)

    def close(self, target: SshTarget | None = None) -> None:
        self.inner.close(target)


@dataclass
class Host:
    """One host to bootstrap, a remote root of its own, and the environment tests give it."""

    runner: Recorder
    target: SshTarget
    root: Path
    tmp: Path
    env: dict[str, str]
    bin_dir: Path

    def boot(self, **kwargs: object) -> BootstrapReport:
        options: dict[str, object] = {
            "remote_root": str(self.root),
            "python": sys.executable,
            "env": self.env,
        }
        options.update(kwargs)
        return bootstrap(self.runner, self.target, **options)  # type: ignore[arg-type]

    def marker(self) -> dict[str, object]:
        data: dict[str, object] = json.loads((self.root / MARKER_NAME).read_text())
        return data

    def fake_nvidia_smi(self, script: str) -> None:
        path = self.bin_dir / "nvidia-smi"
        path.write_text("#!/bin/sh\n" + script)
        path.chmod(0o755)


def _fake_site(tmp: Path, init: str) -> Path:
    site = tmp / "fake-site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(init)
    _fake_dists(site)
    return site


def _fake_dists(site: Path) -> None:
    """The train extra's other packages as installed metadata, as an image that has them
    shows them: the bootstrap then has nothing to pip install (and no index to ask)."""
    for req in train_requirements():
        name = requirement_name(req)
        if name.lower() == "torch":
            continue
        info = site / f"{name.replace('-', '_')}-99.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 99.0\n")


def _make_host(runner: HostShell, target: SshTarget, tmp: Path) -> Host:
    bin_dir = tmp / "bin"
    bin_dir.mkdir(parents=True)
    mv = shutil.which("mv")
    assert mv is not None
    (bin_dir / "mv").symlink_to(mv)
    site = _fake_site(tmp, f"__version__ = {FAKE_TORCH!r}\n")
    env = {"PATH": str(bin_dir), "PYTHONPATH": str(site), "PIP_NO_INDEX": "1"}
    return Host(Recorder(runner), target, tmp / "root", tmp, env, bin_dir)


@pytest.fixture(params=["gpu-a", "local"])
def host(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Host]:
    """A real sshd host (gpu-a unless a test names gpu-b), or this machine."""
    runner: HostShell
    name = str(request.param)
    if name == "local":
        runner = LocalRunner(command_timeout=30)
        target = LOCAL_TARGET
    else:
        lab: SshLab = request.getfixturevalue("ssh_lab")
        runner = SshClient(connect_timeout=5, command_timeout=30)
        target = target_for(lab, name)
    try:
        yield _make_host(runner, target, tmp_path / name)
    finally:
        runner.close()


@pytest.fixture
def local(tmp_path: Path) -> Host:
    """This machine only: for what the runner kind does not change (an sshd costs ~0.3 s a command)."""
    return _make_host(LocalRunner(command_timeout=30), LOCAL_TARGET, tmp_path / "local")


@pytest.fixture
def package(tmp_path: Path) -> Path:
    """A copy of the training package that a test may edit."""
    dest = tmp_path / "pkg" / "training"
    shutil.copytree(default_package_dir(), dest, ignore=shutil.ignore_patterns(*PACKAGE_EXCLUDE))
    return dest


def _shipped(package_dir: Path) -> list[str]:
    return [f.rel for f in local_tree(package_dir, PACKAGE_EXCLUDE)]


def _mtimes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


# --- first run, then a no-op ------------------------------------------------------------------


def test_first_bootstrap_does_every_step_and_the_second_is_a_noop(host: Host) -> None:
    package_dir = default_package_dir()
    said: list[str] = []
    first = host.boot(progress=said.append)

    assert not first.noop
    assert said == list(first.steps)
    shipped = _shipped(package_dir)
    assert first.uploaded == len(shipped) > 0
    assert first.steps == (
        NO_DRIVER,
        f"Python {platform.python_version()}",
        f"torch {FAKE_TORCH} from the image (the venv uses its site-packages)",
        # The image's python is the bot's venv here: numpy, sklearn and NVML come with it.
        "the image has every other package training needs",
        f"training package: {len(shipped)} files sent, 0 unchanged",
        "smoke test passed: training.inventory sees 0 GPUs",
        f"marker written (bootstrap v{BOOTSTRAP_VERSION})",
    )
    assert (first.gpus, first.python, first.torch) == (0, platform.python_version(), FAKE_TORCH)
    code = host.root / "code" / "training"
    for rel in shipped:
        assert (code / rel).read_bytes() == (package_dir / rel).read_bytes(), rel
    [sent] = [u.uploaded for u in host.runner.uploads]
    assert sorted(sent) == sorted(shipped)
    assert not any("__pycache__" in rel or rel.endswith(".pyc") for rel in sent)
    assert first.venv_python == str(host.root / "venv" / "bin" / "python")
    assert first.code_dir == str(host.root / "code")
    cfg = (host.root / "venv" / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = true" in cfg
    marker = host.marker()
    assert marker["version"] == BOOTSTRAP_VERSION
    assert marker["training_sha"] == package_hash(package_dir)
    assert (marker["python"], marker["torch"], marker["gpus"]) == (
        platform.python_version(),
        FAKE_TORCH,
        0,
    )
    assert not (host.root / f".{MARKER_NAME}.tmp").exists()

    before = _mtimes(host.root)
    host.runner.calls.clear()
    second = host.boot(progress=said.append)

    assert second.noop
    assert second.steps == (UP_TO_DATE,)
    assert said[-1] == UP_TO_DATE
    assert (second.gpus, second.python, second.torch, second.uploaded) == (
        0,
        platform.python_version(),
        FAKE_TORCH,
        0,
    )
    assert second.root == first.root
    # Only the marker was read: no command ran, nothing was listed or sent.
    assert host.runner.calls == [("read_file", str(host.root / MARKER_NAME))]
    assert _mtimes(host.root) == before


def test_tilde_root_is_the_remote_home(local: Host) -> None:
    host = local
    home = host.tmp / "home"
    home.mkdir()
    host.env["HOME"] = str(home)
    first = host.boot(remote_root="~/.gpubot")
    assert first.root == str(home / ".gpubot")
    assert (home / ".gpubot" / MARKER_NAME).is_file()

    host.runner.calls.clear()
    assert host.boot(remote_root="~/.gpubot").noop
    assert host.runner.calls == [
        ("run", "echo $HOME"),
        ("read_file", str(home / ".gpubot" / MARKER_NAME)),
    ]


# --- incremental upload -----------------------------------------------------------------------


@pytest.mark.parametrize("host", ["gpu-b", "local"], indirect=True)
def test_a_changed_file_is_the_only_one_sent_again(host: Host, package: Path) -> None:
    junk = package / "__pycache__" / "status.cpython-311.pyc"
    junk.parent.mkdir()
    junk.write_bytes(b"stale bytecode")
    first = host.boot(package_dir=package)
    total = len(_shipped(package))
    assert first.uploaded == total
    assert not any("__pycache__" in rel for rel in host.runner.uploads[0].uploaded)
    remote_pyc = host.root / "code" / "training" / "__pycache__" / junk.name
    assert not remote_pyc.exists() or remote_pyc.read_bytes() != b"stale bytecode"
    junk.write_bytes(b"other bytecode")  # bytecode is not part of the package's hash
    assert host.boot(package_dir=package).noop

    changed = package / "status.py"
    changed.write_text(changed.read_text() + "\n# changed by the test\n")
    host.runner.uploads.clear()
    second = host.boot(package_dir=package)

    assert not second.noop
    assert second.uploaded == 1
    assert [u.uploaded for u in host.runner.uploads] == [("status.py",)]
    assert f"training package: 1 file sent, {total - 1} unchanged" in second.steps
    assert f"torch {FAKE_TORCH} already in the venv" in second.steps
    remote = host.root / "code" / "training" / "status.py"
    assert remote.read_text().endswith("# changed by the test\n")
    assert host.marker()["training_sha"] == package_hash(package)
    assert host.marker()["system_site_packages"] is True

    assert host.boot(package_dir=package).noop


@pytest.mark.parametrize(
    "marker",
    [b"{not json", b"[1, 2]", b"version 0"],
    ids=["garbage", "not-an-object", "text"],
)
def test_an_unreadable_marker_means_bootstrap_again(local: Host, marker: bytes) -> None:
    host = local
    host.boot()
    (host.root / MARKER_NAME).write_bytes(marker)
    again = host.boot()
    assert not again.noop
    assert again.uploaded == 0
    assert host.marker()["version"] == BOOTSTRAP_VERSION


def test_a_marker_of_another_version_or_interpreter_is_stale(local: Host) -> None:
    host = local
    host.boot()
    path = host.root / MARKER_NAME
    current = host.marker()
    path.write_text(json.dumps({**current, "version": BOOTSTRAP_VERSION - 1}))
    assert not host.boot().noop
    path.write_text(json.dumps({**current, "base_python": "/usr/bin/python3.99"}))
    assert not host.boot().noop
    assert host.boot().noop


# --- what a host lacks ------------------------------------------------------------------------


def test_python_too_old_is_a_plain_error(host: Host) -> None:
    old = host.tmp / "python3.8"
    old.write_text("#!/bin/sh\necho '(3, 8)'\n")
    old.chmod(0o755)
    with pytest.raises(ProvisioningError) as err:
        host.boot(python=str(old))
    message = str(err.value)
    assert "Python 3.8" in message and "needs Python 3.10 or newer" in message
    assert "Traceback" not in message
    assert not (host.root / MARKER_NAME).exists()
    assert not (host.root / "code").exists()
    assert not (host.root / "venv").exists()


def test_missing_python_is_a_plain_error(host: Host) -> None:
    with pytest.raises(ProvisioningError, match=r"has no Python at '/nonexistent/python3'"):
        host.boot(python="/nonexistent/python3")


def test_a_failing_driver_is_reported_and_the_host_runs_on_cpu(local: Host) -> None:
    host = local
    host.fake_nvidia_smi(
        "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'\n"
        "exit 9\n"
    )
    report = host.boot()
    assert report.gpus == 0
    assert report.steps[0] == (
        f"{NO_DRIVER} (nvidia-smi failed: NVIDIA-SMI has failed because it could not "
        "communicate with the NVIDIA driver.)"
    )


def test_gpus_the_driver_lists_are_counted(local: Host) -> None:
    host = local
    # Answers both queries: the driver check's and training.inventory's fallback.
    host.fake_nvidia_smi(
        'case "$*" in\n'
        "  *index*) echo '0, NVIDIA H100 80GB HBM3, 81559'; echo '1, NVIDIA H100 80GB HBM3, 81559';;\n"
        "  *) echo 'NVIDIA H100 80GB HBM3, 81559 MiB'; echo 'NVIDIA H100 80GB HBM3, 81559 MiB';;\n"
        "esac\n"
    )
    report = host.boot()
    assert report.gpus == 2
    assert report.steps[0] == "NVIDIA driver: 2 GPUs (2× NVIDIA H100 80GB HBM3)"
    assert "smoke test passed: training.inventory sees 2 GPUs" in report.steps
    assert host.marker()["gpus"] == 2


# --- torch ------------------------------------------------------------------------------------


def test_without_torch_and_install_off_the_venv_is_bare(local: Host) -> None:
    host = local
    # Shadows any real torch the test interpreter has: `import torch` fails on the host.
    site = _fake_site(host.tmp / "broken", "raise ImportError('no torch on this image')\n")
    host.env["PYTHONPATH"] = str(site)
    report = host.boot(install_torch=False)
    assert report.torch is None
    assert "torch not installed (install_torch=False)" in report.steps
    assert "include-system-site-packages = false" in (host.root / "venv" / "pyvenv.cfg").read_text()
    assert not any(" -m pip " in cmd for _, cmd in host.runner.calls)
    assert host.marker()["torch"] is None
    assert host.boot(install_torch=False).noop


def test_torch_wanted_later_makes_a_torchless_marker_stale(local: Host) -> None:
    host = local
    good_site = host.env["PYTHONPATH"]
    broken = _fake_site(host.tmp / "broken", "raise ImportError('no torch on this image')\n")
    host.env["PYTHONPATH"] = str(broken)
    assert host.boot(install_torch=False).torch is None
    # The image gained torch since; asking for torch now must not be answered "up to date".
    host.env["PYTHONPATH"] = good_site
    again = host.boot(install_torch=True)
    assert not again.noop
    assert again.torch == FAKE_TORCH
    assert f"torch {FAKE_TORCH} already in the venv" in again.steps
    assert host.marker()["torch"] == FAKE_TORCH
    assert host.boot(install_torch=True).noop


def test_an_image_whose_python_is_a_venv_lends_its_torch(local: Host) -> None:
    """A venv made from a venv sees the base interpreter's packages, not the outer venv's."""
    host = local
    image = host.tmp / "image-venv"
    made = subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(image)],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    [site] = image.glob("lib/python*/site-packages")
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text("__version__ = '2.13.0+image'\n")
    _fake_dists(site)
    del host.env["PYTHONPATH"]

    report = host.boot(python=str(image / "bin" / "python"))

    assert report.torch == "2.13.0+image"
    [pth] = (host.root / "venv").rglob(IMAGE_PTH)
    assert pth.read_text() == f"{site}\n"


# --- the smoke test ---------------------------------------------------------------------------


def test_smoke_output_that_is_not_json_fails(local: Host, package: Path) -> None:
    host = local
    (package / "inventory.py").write_text("print('hello, no json here')\n")
    with pytest.raises(ProvisioningError, match="printed no inventory JSON"):
        host.boot(package_dir=package)
    assert not (host.root / MARKER_NAME).exists()


def test_a_crashing_smoke_test_fails_with_its_error(local: Host, package: Path) -> None:
    host = local
    (package / "inventory.py").write_text("raise SystemExit('inventory is broken')\n")
    with pytest.raises(ProvisioningError, match=r"(?s)smoke test.*inventory is broken"):
        host.boot(package_dir=package)
    assert not (host.root / MARKER_NAME).exists()
