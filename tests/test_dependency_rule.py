"""DESIGN.md's dependency rule, checked on the source: `provisioning` and `db`
never import `bot`; `training` imports nothing of ours but itself (it is copied to
GPU hosts with only torch and nvidia-ml-py); only `bot` knows Slack, only
`provisioning` boto3/fabric, only `training` torch/pynvml, only `db` SQLAlchemy
sessions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"bot", "provisioning", "training", "db"}
ALLOWED_OURS = {
    "bot": {"bot", "provisioning", "training", "db"},
    "provisioning": {"provisioning"},
    "db": {"db"},
    "training": {"training"},
}
# Third-party packages that only one of our packages may import.
OWNED = {
    "slack_bolt": "bot",
    "slack_sdk": "bot",
    "boto3": "provisioning",
    "botocore": "provisioning",
    "fabric": "provisioning",
    "paramiko": "provisioning",
    "torch": "training",
    "pynvml": "training",
}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def violations(root: Path) -> list[str]:
    out = []
    for package in sorted(OURS):
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root)
            for name in imports_of(path):
                if name in OURS and name not in ALLOWED_OURS[package]:
                    out.append(f"{rel} imports {name}")
                owner = OWNED.get(name)
                if owner is not None and owner != package:
                    out.append(f"{rel} imports {name}, which only {owner} may use")
    return out


def test_the_tree_obeys_the_dependency_rule() -> None:
    assert violations(ROOT) == []


def test_only_db_makes_engines_and_sessions() -> None:
    """bot queries through sessions that db.session hands out; it never builds its own."""
    offenders = []
    for package in sorted(OURS - {"db"}):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = {a.name for a in node.names}
                    if names & {"create_engine", "sessionmaker", "scoped_session"}:
                        offenders.append(str(path.relative_to(ROOT)))
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Session":
                    offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


@pytest.mark.parametrize(
    ("package", "line"),
    [
        ("training", "import bot.config"),
        ("training", "from db.models import User"),
        ("provisioning", "from bot.service import GpuService"),
        ("db", "import bot"),
        ("bot", "import torch"),
        ("db", "import boto3"),
    ],
)
def test_the_check_catches_a_breach(tmp_path: Path, package: str, line: str) -> None:
    for p in OURS:
        (tmp_path / p).mkdir()
    (tmp_path / package / "bad.py").write_text(line + "\n")
    assert len(violations(tmp_path)) == 1
