"""Preparing a host on first use, so that the worker can start `training.runner` there.

A fresh instance (or an on-prem box nobody told us about) has a driver or not, some
Python, maybe the image's torch, and certainly not our `training` package. `bootstrap`
brings it to a known state and leaves a marker (`<root>/bootstrap.json`) saying which
state: a later call that finds the marker current does nothing but read it, because
the worker calls this before every first placement on a host and must not pay minutes
(or re-download torch) for a host that is already ready.

Why the steps are what they are:

- A host without an NVIDIA driver is a CPU host, a fact to report, not a failure: the
  bot shares CPU slots too, and a half-set-up instance should say so in plain words.
- Torch is 2+ GB. An image that already has it (a Deep Learning AMI) keeps its build,
  which matches its CUDA driver, by giving the venv the system site-packages; only a
  bare host gets `pip install`.
- The package goes over with the hash-skipping `upload_dir`, so a changed file costs
  one transfer; the marker holds a hash of the local package so that a new bot release
  re-uploads without being asked.
- A smoke run of `training.inventory` from the uploaded copy proves that the venv's
  interpreter imports our package before any user's job depends on it.
- The marker is written last and atomically: a bootstrap that died halfway is redone,
  never mistaken for a finished one.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import posixpath
import re
import time
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from provisioning import shell
from provisioning.base import ProvisioningError
from provisioning.hostshell import HostShell
from provisioning.manifest import local_tree
from provisioning.ssh import RunResult, SshTarget

# Bump when a host bootstrapped by an older bot lacks something the bot now relies on
# (another package in the venv, a new directory); every host then redoes the steps.
BOOTSTRAP_VERSION = 2  # 2: the whole `train` extra (scikit-learn was missing), not two packages
MARKER_NAME = "bootstrap.json"
MIN_PYTHON = (3, 10)
# What never goes to a host: bytecode is the host's own to compile.
PACKAGE_EXCLUDE = ("__pycache__", "*.pyc", "*.pyo")
# What `training` needs on a host is pyproject.toml's `train` extra, read by
# `train_requirements()`: one list, so a recipe's import cannot work here and fail there.
TRAIN_EXTRA = "train"

# Timeouts (seconds): a quick shell command; a first `import torch` from a cold disk;
# venv creation (ensurepip copies pip in); pip downloading and unpacking torch.
QUICK_TIMEOUT_S = 30.0
IMPORT_TIMEOUT_S = 180.0
VENV_TIMEOUT_S = 300.0
PIP_TIMEOUT_S = 3600.0

UP_TO_DATE = "up to date"
NO_DRIVER = "no NVIDIA driver: this host will run on CPU"

# Prints the torch version, or exits non-zero: the probe for "torch works here".
_TORCH_PROBE = "import torch; print(torch.__version__)"
# For the image's interpreter also: when it is itself a venv, where its packages live
# (a venv made from a venv sees the base interpreter's site-packages, not the outer's).
_IMAGE_PROBE = (
    "import json, site, sys, torch; print(json.dumps({'torch': torch.__version__, "
    "'site': site.getsitepackages() if sys.prefix != sys.base_prefix else []}))"
)
_PURELIB_PROBE = "import sysconfig; print(sysconfig.get_path('purelib'))"
IMAGE_PTH = "_gpubot_image.pth"
_PYTHON_PROBE = "import sys; print(tuple(sys.version_info[:3]))"


@dataclass(frozen=True)
class BootstrapReport:
    # True when the marker was current and nothing was done.
    noop: bool
    # What was done (or found), in the words the bot shows; ("up to date",) on a no-op.
    steps: tuple[str, ...]
    # GPUs the driver lists; 0 on a CPU host.
    gpus: int
    # The host interpreter's version, "3.11.7".
    python: str
    # torch's version in the venv; None where it is absent (install_torch=False).
    torch: str | None
    # Files of the training package sent this time (0 when all were already there).
    uploaded: int
    # The resolved remote root (no "~"); the venv and code live under it.
    root: str = ""

    @property
    def venv_python(self) -> str:
        """The interpreter that runs `training.runner` on this host."""
        return venv_python(self.root)

    @property
    def code_dir(self) -> str:
        """The directory to run `python -m training.…` from (the package is inside it)."""
        return posixpath.join(self.root, "code")


def train_requirements() -> tuple[str, ...]:
    """The `train` extra of gpubot, as pip requirement strings ("torch==2.13.0", …).

    From pyproject.toml beside the package in a source checkout (an editable install's
    metadata is only as new as its last `pip install`), else from the installed
    distribution's metadata (a deployed bot has no pyproject.toml). Either way the list
    is pyproject's; nothing here repeats it.
    """
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():
        try:
            data = tomllib.loads(pyproject.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ProvisioningError(f"cannot read {pyproject}: {exc}") from None
        extra = data.get("project", {}).get("optional-dependencies", {}).get(TRAIN_EXTRA)
        if not isinstance(extra, list) or not extra:
            raise ProvisioningError(f"{pyproject} has no [{TRAIN_EXTRA}] extra")
        return tuple(str(req).strip() for req in extra)
    try:
        declared = importlib.metadata.requires("gpubot") or []
    except importlib.metadata.PackageNotFoundError:
        declared = []
    found = extra_from_metadata(declared, TRAIN_EXTRA)
    if not found:
        raise ProvisioningError(
            "cannot tell what a host needs: gpubot is installed without its "
            f"[{TRAIN_EXTRA}] extra's metadata and there is no pyproject.toml"
        )
    return found


def extra_from_metadata(declared: list[str], extra: str) -> tuple[str, ...]:
    """One extra's requirements out of `importlib.metadata.requires` lines."""
    return tuple(
        req.split(";", 1)[0].strip()
        for req in declared
        if ";" in req and _is_extra(req.split(";", 1)[1], extra)
    )


def _is_extra(marker: str, extra: str) -> bool:
    """Whether a metadata marker (`extra == "train"`) selects exactly this extra."""
    return re.fullmatch(rf"""\s*extra\s*==\s*["']{re.escape(extra)}["']\s*""", marker) is not None


def requirement_name(requirement: str) -> str:
    """The distribution a requirement names: "scikit-learn>=1.5" → "scikit-learn"."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ProvisioningError(f"not a requirement: {requirement!r}")
    return match.group(1)


def torch_requirement(requirements: tuple[str, ...]) -> str:
    """The torch line of the train extra: the one package an image may already bring."""
    for req in requirements:
        if requirement_name(req).lower() == "torch":
            return req
    raise ProvisioningError("the train extra names no torch")


def venv_python(root: str) -> str:
    return posixpath.join(root, "venv", "bin", "python")


def default_package_dir() -> Path:
    """The local `training` package, found without importing it (provisioning may not)."""
    spec = importlib.util.find_spec("training")
    if spec is None or not spec.submodule_search_locations:
        raise ProvisioningError("the training package is not installed next to the bot")
    return Path(next(iter(spec.submodule_search_locations)))


def package_hash(package_dir: str | os.PathLike[str]) -> str:
    """One sha256 over every shipped file's path, content and executable bit.

    It is what the marker compares, so it covers exactly what `upload_dir` would send:
    a file renamed, edited or made executable changes it; bytecode does not.
    """
    digest = hashlib.sha256()
    for f in local_tree(package_dir, PACKAGE_EXCLUDE):
        digest.update(f"{f.rel}\0{f.sha256}\0{int(f.executable)}\n".encode())
    return digest.hexdigest()


def bootstrap(
    runner: HostShell,
    target: SshTarget,
    *,
    remote_root: str = "~/.gpubot",
    torch_spec: str | None = None,
    python: str = "python3",
    install_torch: bool = True,
    progress: Callable[[str], None] | None = None,
    package_dir: str | os.PathLike[str] | None = None,
    nvidia_smi: str = "nvidia-smi",
    env: Mapping[str, str] | None = None,
    agent: AgentInstall | None = None,
) -> BootstrapReport:
    """Bring the host to BOOTSTRAP_VERSION with the current training package; idempotent.

    `torch_spec` replaces the train extra's torch line (None: keep it). `python` is the
    host interpreter the venv is made from. `nvidia_smi` is the
    driver's CLI, for images that keep it off PATH. `env` goes to every command: a
    pip index or proxy for hosts without direct internet (PIP_INDEX_URL, HTTPS_PROXY).
    `agent` installs the host agent (`training.agent`) as a service; None installs none.
    Raises `ProvisioningError` (or its `SshError`) with a message fit for the user.
    """
    requirements = train_requirements()
    torch_line = torch_requirement(requirements)
    if torch_spec is not None:
        requirements = tuple(torch_spec if r == torch_line else r for r in requirements)
    return _Bootstrap(
        runner=runner,
        target=target,
        torch_spec=torch_spec or torch_line,
        requirements=requirements,
        python=python,
        install_torch=install_torch,
        progress=progress,
        package_dir=Path(package_dir) if package_dir is not None else default_package_dir(),
        nvidia_smi=nvidia_smi,
        env=dict(env) if env else None,
        agent=agent,
    ).run(remote_root)


class _Bootstrap:
    """One bootstrap's state; a class only so the steps can share the host and options."""

    def __init__(
        self,
        *,
        runner: HostShell,
        target: SshTarget,
        torch_spec: str,
        requirements: tuple[str, ...],
        python: str,
        install_torch: bool,
        progress: Callable[[str], None] | None,
        package_dir: Path,
        nvidia_smi: str,
        env: dict[str, str] | None,
        agent: AgentInstall | None = None,
    ) -> None:
        self.runner = runner
        self.target = target
        self.torch_spec = torch_spec
        self.requirements = requirements
        self.python = python
        self.install_torch = install_torch
        self.progress = progress
        self.package_dir = package_dir
        self.nvidia_smi = nvidia_smi
        self.env = env
        self.agent = agent
        self.steps: list[str] = []

    # plumbing

    def _say(self, step: str) -> None:
        self.steps.append(step)
        if self.progress is not None:
            self.progress(step)

    def _run(self, argv: list[str], timeout: float, *, cwd: str | None = None) -> RunResult:
        return self.runner.run(self.target, shell.join(argv), timeout, cwd=cwd, env=self.env)

    def _fail(self, what: str, result: RunResult) -> ProvisioningError:
        detail = (result.stderr.strip() or result.stdout.strip())[-400:]
        detail = detail or f"exit code {result.exit_code}"
        return ProvisioningError(f"bootstrap of {self.target.label}: {what}: {detail}")

    # the steps

    def run(self, remote_root: str) -> BootstrapReport:
        root = self._resolve_root(remote_root)
        marker_path = posixpath.join(root, MARKER_NAME)
        training_sha = package_hash(self.package_dir)

        marker = self._read_marker(marker_path)
        if marker is not None and self._is_current(marker, training_sha):
            if (
                self.agent is not None
                and marker.get("agent_service") == "supervisor"
                and not agent_supervisor_alive(self.runner, self.target, root)
            ):
                self._install_agent(root)  # a reboot without cron: bring the guard back
            self._say(UP_TO_DATE)
            torch = marker.get("torch")
            return BootstrapReport(
                noop=True,
                steps=tuple(self.steps),
                gpus=int(marker["gpus"]),
                python=str(marker.get("python") or ""),
                torch=str(torch) if torch is not None else None,
                uploaded=0,
                root=root,
            )

        gpus = self._check_driver()
        py_version = self._check_python()
        torch, system_site = self._prepare_venv(root)
        uploaded = self._upload(root)
        self._smoke(root)
        agent_service = self._install_agent(root) if self.agent is not None else None
        self._write_marker(
            root,
            marker_path,
            {
                "version": BOOTSTRAP_VERSION,
                "training_sha": training_sha,
                "python": py_version,
                "torch": torch,
                "gpus": gpus,
                "base_python": self.python,
                "system_site_packages": system_site,
                "agent": self.agent.marker() if self.agent is not None else None,
                "agent_service": agent_service,
            },
        )
        return BootstrapReport(
            noop=False,
            steps=tuple(self.steps),
            gpus=gpus,
            python=py_version,
            torch=torch,
            uploaded=uploaded,
            root=root,
        )

    def _install_agent(self, root: str) -> str:
        assert self.agent is not None
        service, steps = install_agent(
            self.runner,
            self.target,
            root,
            self.agent,
            python=venv_python(root),
            code_dir=posixpath.join(root, "code"),
            env=self.env,
        )
        for step in steps:
            self._say(step)
        return service

    def _resolve_root(self, remote_root: str) -> str:
        """An absolute root: "~" and relative paths mean the remote user's home."""
        if not remote_root:
            raise ValueError("remote_root must not be empty")
        if remote_root.startswith("/"):
            return posixpath.normpath(remote_root)
        if remote_root.startswith("~") and remote_root != "~" and not remote_root.startswith("~/"):
            raise ValueError(f"only ~ (this user's home) may start remote_root: {remote_root!r}")
        result = self.runner.run(self.target, "echo $HOME", QUICK_TIMEOUT_S, env=self.env)
        home = result.stdout.strip()
        if not result.ok or not home.startswith("/"):
            raise self._fail("cannot tell the remote user's home directory", result)
        rest = remote_root[1:].lstrip("/") if remote_root.startswith("~") else remote_root
        return posixpath.normpath(posixpath.join(home, rest))

    def _read_marker(self, path: str) -> dict[str, Any] | None:
        data = self.runner.read_file(self.target, path, max_bytes=1 << 16)
        if data is None:
            return None
        try:
            marker = json.loads(data)
        except ValueError:
            return None  # half-written by hand or by a foreign tool: redo, do not trust it
        return marker if isinstance(marker, dict) else None

    def _is_current(self, marker: dict[str, Any], training_sha: str) -> bool:
        """Current when it is this version, this package and was made the way asked now.

        A marker from another base interpreter, or one left by a run that skipped
        torch when torch is now wanted, is stale: the caller asked for something else.
        """
        return (
            marker.get("version") == BOOTSTRAP_VERSION
            and marker.get("training_sha") == training_sha
            and marker.get("base_python") == self.python
            and isinstance(marker.get("gpus"), int)
            and not (self.install_torch and marker.get("torch") is None)
            and marker.get("agent") == (self.agent.marker() if self.agent is not None else None)
        )

    def _check_driver(self) -> int:
        result = self._run(
            [self.nvidia_smi, "--query-gpu=name,memory.total", "--format=csv,noheader"],
            QUICK_TIMEOUT_S,
        )
        if result.exit_code in (126, 127):  # not found / not executable: no driver installed
            self._say(NO_DRIVER)
            return 0
        if not result.ok:
            # nvidia-smi says why on stdout; stderr may hold a login script's noise.
            detail = result.stdout.strip().splitlines() or result.stderr.strip().splitlines()[-1:]
            reason = detail[0][:200] if detail else f"exit code {result.exit_code}"
            self._say(f"{NO_DRIVER} (nvidia-smi failed: {reason})")
            return 0
        names = [
            line.rsplit(",", 1)[0].strip() for line in result.stdout.splitlines() if line.strip()
        ]
        if not names:
            self._say(f"{NO_DRIVER} (the driver lists no GPU)")
            return 0
        kinds = ", ".join(f"{names.count(n)}× {n}" for n in sorted(set(names)))
        self._say(f"NVIDIA driver: {len(names)} GPU{'s' if len(names) != 1 else ''} ({kinds})")
        return len(names)

    def _check_python(self) -> str:
        result = self._run([self.python, "-c", _PYTHON_PROBE], QUICK_TIMEOUT_S)
        if result.exit_code in (126, 127):
            raise ProvisioningError(
                f"{self.target.label} has no Python at {self.python!r}; "
                f"install Python {_dotted(MIN_PYTHON)} or newer"
            )
        numbers = tuple(int(n) for n in re.findall(r"\d+", result.stdout)[:3])
        if not result.ok or len(numbers) < 2:
            raise self._fail(f"cannot run {self.python}", result)
        if numbers[:2] < MIN_PYTHON:
            raise ProvisioningError(
                f"{self.target.label} has Python {_dotted(numbers)} at {self.python!r}; "
                f"gpubot needs Python {_dotted(MIN_PYTHON)} or newer"
            )
        version = _dotted(numbers)
        self._say(f"Python {version}")
        return version

    def _torch_in(self, interpreter: str) -> str | None:
        result = self._run([interpreter, "-c", _TORCH_PROBE], IMPORT_TIMEOUT_S)
        lines = result.stdout.strip().splitlines()
        return lines[-1].strip() if result.ok and lines else None

    def _image_torch(self) -> tuple[str, list[str]] | None:
        """(torch version, site dirs to link when the image's python is a venv), or None."""
        result = self._run([self.python, "-c", _IMAGE_PROBE], IMPORT_TIMEOUT_S)
        lines = result.stdout.strip().splitlines()
        if not result.ok or not lines:
            return None
        try:
            found = json.loads(lines[-1])
        except ValueError:
            return None
        if not isinstance(found, dict) or not isinstance(found.get("site"), list):
            return None
        return str(found.get("torch")), [str(d) for d in found["site"]]

    def _link_image_venv(self, vpy: str, site_dirs: list[str]) -> None:
        """A .pth in our venv naming the image venv's site-packages, so its torch imports."""
        result = self._run([vpy, "-c", _PURELIB_PROBE], QUICK_TIMEOUT_S)
        purelib = result.stdout.strip()
        if not result.ok or not purelib.startswith("/"):
            raise self._fail("cannot find the venv's site-packages", result)
        data = "".join(f"{d}\n" for d in site_dirs).encode()
        self.runner.write_file(self.target, posixpath.join(purelib, IMAGE_PTH), data)

    def _make_venv(self, venv: str, *, system_site: bool, with_pip: bool) -> None:
        argv = [self.python, "-m", "venv"]
        if system_site:
            argv.append("--system-site-packages")
        if not with_pip:
            argv.append("--without-pip")  # fast, and works without Debian's python3-venv
        result = self._run([*argv, venv], VENV_TIMEOUT_S)
        if not result.ok:
            raise self._fail(
                "could not create the virtualenv (on Debian/Ubuntu: apt install python3-venv)",
                result,
            )

    def _prepare_venv(self, root: str) -> tuple[str | None, bool]:
        """The venv with torch in it; (torch version or None, uses system site-packages)."""
        venv = posixpath.join(root, "venv")
        vpy = venv_python(root)
        found = self._torch_in(vpy)
        if found is not None:
            self._say(f"torch {found} already in the venv")
            self._install_missing(vpy)  # a host bootstrapped by an older list
            return found, self._uses_system_site(venv)

        image = self._image_torch()
        if image is not None:
            image_torch, image_site = image
            self._make_venv(venv, system_site=True, with_pip=False)
            if image_site:
                self._link_image_venv(vpy, image_site)
            found = self._torch_in(vpy)
            if found is None:
                raise ProvisioningError(
                    f"bootstrap of {self.target.label}: the image's torch {image_torch} "
                    f"imports with {self.python} but not in the venv made from it"
                )
            self._say(f"torch {found} from the image (the venv uses its site-packages)")
            self._install_missing(vpy)
            return found, True

        if not self.install_torch:
            self._make_venv(venv, system_site=False, with_pip=False)
            self._say("torch not installed (install_torch=False)")
            return None, False

        self._make_venv(venv, system_site=False, with_pip=True)
        self._ensure_pip(vpy)
        packages = list(self.requirements)
        self._say(f"installing {' '.join(packages)} (this can take several minutes)")
        self._pip_install(vpy, packages)
        found = self._torch_in(vpy)
        if found is None:
            raise ProvisioningError(
                f"bootstrap of {self.target.label}: {self.torch_spec} installed but "
                "`import torch` fails in the venv"
            )
        self._say(f"torch {found} installed")
        return found, False

    def _ensure_pip(self, vpy: str) -> None:
        if not self._run([vpy, "-m", "pip", "--version"], QUICK_TIMEOUT_S).ok:
            # A venv made without pip (install_torch was off then, or an image's torch).
            ensured = self._run([vpy, "-m", "ensurepip", "--upgrade"], VENV_TIMEOUT_S)
            if not ensured.ok:
                raise self._fail("the venv has no pip and ensurepip failed", ensured)

    def _pip_install(self, vpy: str, packages: list[str]) -> None:
        # --no-compile: byte-compiling torch's ~15k modules up front costs tens of seconds
        # of a first bootstrap; the venv is the login's own, so imports compile lazily.
        pip = [
            *(vpy, "-m", "pip", "install", "--disable-pip-version-check", "--no-input"),
            "--no-compile",
        ]
        installed = self._run([*pip, *packages], PIP_TIMEOUT_S)
        if not installed.ok:
            raise self._fail(f"pip install {' '.join(packages)} failed", installed)

    def _install_missing(self, vpy: str) -> None:
        """The train extra's other packages where an image brought torch: whatever the
        venv cannot already import (the image's own numpy is kept; sklearn rarely is there)."""
        others = [r for r in self.requirements if requirement_name(r).lower() != "torch"]
        names = [requirement_name(r) for r in others]
        probe = (
            "import importlib.metadata as m, json, sys\n"
            "def has(n):\n"
            "    try:\n        m.version(n)\n        return True\n"
            "    except m.PackageNotFoundError:\n        return False\n"
            "print(json.dumps([n for n in sys.argv[1:] if not has(n)]))"
        )
        result = self._run([vpy, "-c", probe, *names], IMPORT_TIMEOUT_S)
        lines = result.stdout.strip().splitlines()
        try:
            missing = set(json.loads(lines[-1])) if result.ok and lines else None
        except ValueError:
            missing = None
        if missing is None:
            raise self._fail("cannot list the packages in the venv", result)
        wanted = [r for r, n in zip(others, names, strict=True) if n in missing]
        if not wanted:
            self._say("the image has every other package training needs")
            return
        self._ensure_pip(vpy)
        self._say(f"installing {' '.join(wanted)} (the image lacks them)")
        self._pip_install(vpy, wanted)

    def _uses_system_site(self, venv: str) -> bool:
        cfg = self.runner.read_file(self.target, posixpath.join(venv, "pyvenv.cfg"))
        text = (cfg or b"").decode("utf-8", "replace")
        return bool(re.search(r"^include-system-site-packages\s*=\s*true\s*$", text, re.M | re.I))

    def _upload(self, root: str) -> int:
        report = self.runner.upload_dir(
            self.target,
            self.package_dir,
            posixpath.join(root, "code", "training"),
            exclude=PACKAGE_EXCLUDE,
        )
        sent, same = len(report.uploaded), len(report.skipped) + len(report.chmodded)
        self._say(f"training package: {sent} file{'s' if sent != 1 else ''} sent, {same} unchanged")
        return sent

    def _smoke(self, root: str) -> None:
        """The uploaded package runs in the venv and speaks JSON, as the worker expects."""
        result = self._run(
            [venv_python(root), "-m", "training.inventory", "--json"],
            IMPORT_TIMEOUT_S,
            cwd=posixpath.join(root, "code"),
        )
        if not result.ok:
            raise self._fail("the smoke test (python -m training.inventory) failed", result)
        lines = result.stdout.strip().splitlines()
        try:
            parsed = json.loads(lines[-1]) if lines else None
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict) or not isinstance(parsed.get("gpus"), list):
            raise ProvisioningError(
                f"bootstrap of {self.target.label}: the smoke test (python -m "
                f"training.inventory --json) printed no inventory JSON: {result.stdout[-200:]!r}"
            )
        seen = len(parsed["gpus"])
        self._say(
            f"smoke test passed: training.inventory sees {seen} GPU{'s' if seen != 1 else ''}"
        )

    def _write_marker(self, root: str, marker_path: str, marker: dict[str, Any]) -> None:
        part = posixpath.join(root, f".{MARKER_NAME}.tmp")
        data = (json.dumps(marker, indent=2, sort_keys=True) + "\n").encode()
        self.runner.write_file(self.target, part, data)
        moved = self._run(["mv", "-f", "--", part, marker_path], QUICK_TIMEOUT_S)
        if not moved.ok:
            raise self._fail("could not write the bootstrap marker", moved)
        self._say(f"marker written (bootstrap v{BOOTSTRAP_VERSION})")


# --- the host agent as a service ----------------------------------------------------------
# `training.agent` guards the host when the bot is gone (dead-man switch, spot notice,
# lost runs after a reboot), so it must outlive SSH sessions and reboots: a systemd unit
# where systemd runs, else a shell loop that restarts it, brought back at boot by cron.

# Where an EC2 instance reaches its instance metadata service (IMDSv2): the agent's spot
# watch asks it; Ec2Settings.metadata_url (GPUBOT_AWS_METADATA_URL) points elsewhere.
DEFAULT_METADATA_URL = "http://169.254.169.254"
AGENT_UNIT = "gpubot-agent.service"
AGENT_CRON_TAG = "# gpubot-agent"
_SYSTEMD_UP = ("running", "degraded", "starting", "initializing", "maintenance")


@dataclass(frozen=True)
class AgentInstall:
    """How the host agent runs on this host; part of the marker, so a change reinstalls."""

    # The shell command that stops the host when the bot is gone and nothing runs: on EC2
    # "sudo -n shutdown -h now" (the instance stops, not terminates). None: watch only,
    # never stop (an on-prem server others use). No default: the caller must decide.
    stop_command: str | None
    idle_s: float = 1800.0  # nothing held or running for this long ...
    lease_s: float = 900.0  # ... and no lease renewal for this long: stop
    interval_s: float = 15.0  # seconds between the agent's checks
    # The spot-notice endpoint; None where there is no EC2 metadata service.
    imds_endpoint: str | None = DEFAULT_METADATA_URL
    runs_dirs: tuple[str, ...] = ()  # where run directories live; () = <root>/runs
    use_systemd: bool | None = None  # None: systemd when `systemctl is-system-running` answers

    def marker(self) -> dict[str, Any]:
        return {
            "stop_command": self.stop_command,
            "idle_s": self.idle_s,
            "lease_s": self.lease_s,
            "interval_s": self.interval_s,
            "imds_endpoint": self.imds_endpoint,
            "runs_dirs": list(self.runs_dirs),
            "use_systemd": self.use_systemd,
        }

    def argv(self, python: str, root: str) -> list[str]:
        argv = [python, "-m", "training.agent", "--state-dir", posixpath.join(root, "agent")]
        for runs_dir in self.runs_dirs or (posixpath.join(root, "runs"),):
            argv += ["--runs-dir", runs_dir]
        return [
            *argv,
            *("--interval", f"{self.interval_s:g}", "--idle", f"{self.idle_s:g}"),
            *("--lease", f"{self.lease_s:g}", "--stop-command", self.stop_command or ""),
            *("--imds-endpoint", self.imds_endpoint or "none"),
        ]


def agent_unit(user: str, code_dir: str, argv: list[str]) -> str:
    """The systemd unit: restarted whenever it exits, started at every boot."""
    if any(ch in value for value in (user, code_dir, *argv) for ch in "\n\r"):
        # One line per setting: a line break would start a setting of its own.
        raise ProvisioningError("the host agent's unit cannot hold a line break")
    return (
        "[Unit]\n"
        "Description=gpubot host agent (dead-man switch, spot notices, lost runs)\n"
        "After=network-online.target\n\n"
        "[Service]\n"
        f"User={user}\n"
        f"WorkingDirectory={code_dir}\n"
        f"ExecStart={_systemd_escape(shell.join(argv))}\n"
        "Restart=always\n"
        "RestartSec=5\n\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def _systemd_escape(line: str) -> str:
    """systemd expands % specifiers and $VARIABLES in ExecStart even inside quotes."""
    return line.replace("%", "%%").replace("$", "$$")


def agent_supervisor_script(code_dir: str, argv: list[str], pidfile: str) -> str:
    """Where there is no systemd: a loop that brings the agent back whenever it exits."""
    line = shell.join(argv)
    return (
        "#!/bin/sh\n"
        "# gpubot host agent supervisor, written by bootstrap: restarts the agent if it dies.\n"
        f"echo $$ > {shell.path(pidfile)}\n"
        f"{shell.cd(code_dir)} || exit 1\n"
        "while :; do\n"
        f"  {line}\n"
        '  echo "gpubot-agent exited with $?; restarting in 5 s" >&2\n'
        "  sleep 5\n"
        "done\n"
    )


def install_agent(
    runner: HostShell,
    target: SshTarget,
    root: str,
    agent: AgentInstall,
    *,
    python: str,
    code_dir: str,
    env: Mapping[str, str] | None = None,
) -> tuple[str, list[str]]:
    """(Re)install and (re)start the agent: ("systemd" or "supervisor", the steps said)."""

    def sh(line: str, timeout: float = QUICK_TIMEOUT_S) -> RunResult:
        return runner.run(target, line, timeout, env=env)

    agent_dir = posixpath.join(root, "agent")
    pidfile = _supervisor_pidfile(root)
    argv = agent.argv(python, root)
    systemd = agent.use_systemd
    if systemd is None:
        systemd = sh("systemctl is-system-running").stdout.strip() in _SYSTEMD_UP

    # Whatever ran before goes first, so one agent runs (its lock would make another wait).
    old = _live_supervisor(runner, target, root)
    if old is not None:
        runner.kill_group(target, old, "TERM")
        deadline = time.monotonic() + 10
        while runner.is_alive(target, old) and time.monotonic() < deadline:
            time.sleep(0.1)

    if systemd:
        user = sh("id -un").stdout.strip()
        staged = posixpath.join(agent_dir, AGENT_UNIT)
        runner.write_file(target, staged, agent_unit(user, code_dir, argv).encode())
        sudo = 'S=; [ "$(id -u)" = 0 ] || S="sudo -n"; '
        dest = f"/etc/systemd/system/{AGENT_UNIT}"
        done = sh(
            f"{sudo}$S {shell.join(['install', '-m', '0644', '--', staged, dest])}"
            f" && $S {shell.join(['systemctl', 'daemon-reload'])}"
            f" && $S {shell.join(['systemctl', 'enable', AGENT_UNIT])}"
            f" && $S {shell.join(['systemctl', 'restart', AGENT_UNIT])}",
            VENV_TIMEOUT_S,
        )
        if not done.ok:
            detail = (done.stderr.strip() or done.stdout.strip())[-300:] or str(done.exit_code)
            raise ProvisioningError(
                f"bootstrap of {target.label}: could not install the host agent unit: {detail}"
            )
        return "systemd", [f"host agent: systemd unit {AGENT_UNIT} enabled and started"]

    script = posixpath.join(agent_dir, "supervise.sh")
    log = posixpath.join(agent_dir, "agent.log")
    runner.write_file(
        target, script, agent_supervisor_script(code_dir, argv, pidfile).encode(), mode=0o755
    )
    pgid = runner.start_detached(target, "exec " + shell.join(["/bin/sh", script]), log)
    runner.write_file(target, pidfile, f"{pgid}\n".encode())
    steps = [f"host agent: supervised process started (group {pgid})"]
    cron_line = agent_cron_line(script, log)
    keep_others = shell.join(["grep", "-vF", "--", AGENT_CRON_TAG])
    add_ours = shell.join(["printf", "%s\\n", cron_line])
    cron = sh(
        "command -v crontab >/dev/null 2>&1 || exit 3; "
        f"{{ crontab -l 2>/dev/null | {keep_others}; {add_ours}; }} | crontab -"
    )
    if cron.ok:
        steps.append("host agent: @reboot crontab line installed")
    else:
        steps.append(
            "host agent: no crontab here, so after a reboot it runs again at the next bootstrap"
        )
    return "supervisor", steps


def remove_agent(
    runner: HostShell,
    target: SshTarget,
    root: str,
    *,
    purge: bool = False,
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """Stops and removes the host agent and whatever brings it back (systemd unit, the
    supervisor loop, its @reboot line), and the bootstrap marker, so a later bootstrap
    installs afresh. `purge` also removes `root` (the venv, the code, the runs). Returns
    what was done, in words. Safe to repeat: what is already gone is skipped."""

    def sh(line: str, timeout: float = QUICK_TIMEOUT_S) -> RunResult:
        return runner.run(target, line, timeout, env=env)

    steps: list[str] = []
    dest = f"/etc/systemd/system/{AGENT_UNIT}"
    if sh(shell.join(["test", "-e", dest])).ok:
        sudo = 'S=; [ "$(id -u)" = 0 ] || S="sudo -n"; '
        done = sh(
            f"{sudo}$S {shell.join(['systemctl', 'disable', '--now', AGENT_UNIT])}"
            f" ; $S {shell.join(['rm', '-f', '--', dest])}"
            f" && $S {shell.join(['systemctl', 'daemon-reload'])}",
            VENV_TIMEOUT_S,
        )
        if not done.ok:
            detail = (done.stderr.strip() or done.stdout.strip())[-300:] or str(done.exit_code)
            raise ProvisioningError(
                f"{target.label}: could not remove the host agent unit {dest}: {detail}"
            )
        steps.append(f"host agent: systemd unit {AGENT_UNIT} stopped, disabled and removed")
    pid = _live_supervisor(runner, target, root)
    if pid is not None:

        def group_alive() -> bool:
            # The whole group: the agent under the supervisor finishes its SIGTERM after
            # the loop that started it is gone, and must not outlive the removal.
            return sh(shell.join(["kill", "-0", "--", f"-{pid}"])).ok

        runner.kill_group(target, pid, "TERM")
        deadline = time.monotonic() + 10
        while group_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        if group_alive():
            runner.kill_group(target, pid, "KILL")
        steps.append(f"host agent: supervised process group {pid} stopped")
    keep_others = shell.join(["grep", "-vF", "--", AGENT_CRON_TAG])
    tagged = shell.join(["grep", "-qF", "--", AGENT_CRON_TAG])
    cron = sh(
        "command -v crontab >/dev/null 2>&1 || exit 3; "
        f"crontab -l 2>/dev/null | {tagged} || exit 4; "
        f"crontab -l | {keep_others} | crontab -"
    )
    if cron.ok:
        steps.append("host agent: @reboot crontab line removed")
    agent_dir = posixpath.join(root, "agent")
    marker = posixpath.join(root, MARKER_NAME)
    targets = [root] if purge else [agent_dir, marker]
    removed = sh(shell.join(["rm", "-rf", "--", *targets]), VENV_TIMEOUT_S)
    if not removed.ok:
        detail = (removed.stderr.strip() or removed.stdout.strip())[-300:]
        raise ProvisioningError(f"{target.label}: could not remove {' '.join(targets)}: {detail}")
    steps.append(
        f"removed {root} (venv, code, runs)"
        if purge
        else f"removed {agent_dir} and the bootstrap marker (the venv and code stay)"
    )
    return steps


def agent_cron_line(script: str, log: str) -> str:
    """The crontab line that starts the supervisor again after a reboot. The tag is a
    comment at the end, so the next install finds (and replaces) its own line. cron reads
    an unescaped `%` as a line break, so every `%` is escaped."""
    start = shell.join(["setsid", "/bin/sh", script])
    line = f"({start} >>{shell.path(log)} 2>&1 </dev/null &)".replace("%", "\\%")
    return f"@reboot {line} {AGENT_CRON_TAG}"


def _supervisor_pidfile(root: str) -> str:
    return posixpath.join(root, "agent", "supervisor.pid")


def _live_supervisor(runner: HostShell, target: SshTarget, root: str) -> int | None:
    """The supervisor's pid when it still runs. After a reboot the recorded pid may belong
    to some other process, so it counts only if that process runs our script."""
    raw = runner.read_file(target, _supervisor_pidfile(root), max_bytes=64)
    if raw is None or not raw.strip().isdigit() or int(raw) <= 1:
        return None
    pid = int(raw)
    cmdline = runner.read_file(target, f"/proc/{pid}/cmdline", max_bytes=4096)
    script = posixpath.join(root, "agent", "supervise.sh").encode()
    if cmdline is None or script not in cmdline or not runner.is_alive(target, pid):
        return None
    return pid


def agent_supervisor_alive(runner: HostShell, target: SshTarget, root: str) -> bool:
    """Whether the supervisor loop (not systemd's unit) still runs on the host."""
    return _live_supervisor(runner, target, root) is not None


def _dotted(numbers: tuple[int, ...]) -> str:
    return ".".join(str(n) for n in numbers)
