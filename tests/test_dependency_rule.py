"""DESIGN.md's dependency rule, checked on the source: `provisioning` and `db`
never import `bot`; `training` imports nothing of ours but itself (it is copied to
GPU hosts with only torch and nvidia-ml-py); only `bot` knows Slack, only
`provisioning` boto3/fabric, only `training` torch/pynvml, only `db` SQLAlchemy
sessions. And no import cycle among our modules, counting every import statement:
at the top, inside functions, under `if TYPE_CHECKING:`."""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
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
        ("training", "import bot.app.config"),
        ("training", "from db.models import User"),
        ("provisioning", "from bot.app.service import GpuService"),
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


# --- no import cycle ------------------------------------------------------------------


def _modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of our packages (`pkg/__init__.py` is `pkg`)."""
    found: dict[str, Path] = {}
    for package in sorted(OURS):
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _named(node: ast.Import | ast.ImportFrom, here: str, is_package: bool) -> Iterator[str]:
    """The dotted names one import statement asks for; a relative one resolved against
    the package of the module it is in."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:
        package = here.split(".") if is_package else here.split(".")[:-1]
        anchor = package[: len(package) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    # `from bot.domain import views` names the module bot.domain.views; `from bot.app.service
    # import Actor` names bot.app.service (the longest known prefix is taken below).
    yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """module -> {module it imports: line of the first such import}: every Import and
    ImportFrom anywhere in the file (function bodies and TYPE_CHECKING blocks too)."""
    modules = _modules(root)
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for wanted in _named(node, name, is_package):
                target = wanted
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].setdefault(target, node.lineno)
    return graph


def import_cycles(root: Path) -> list[list[str]]:
    """One cycle per strongly connected group of modules, as a path that ends where it
    starts (["bot.a", "bot.b", "bot.a"]); empty when the imports only point one way."""
    graph = import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(_a_cycle_in(graph, group) for group in groups)


def _a_cycle_in(graph: dict[str, dict[str, int]], group: set[str]) -> list[str]:
    """The shortest way from the group's first module back to itself, inside the group."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    back = [v]
                    while back[-1] != start:
                        back.append(came_from[back[-1]])
                    return [*reversed(back), start]
                if w in group and w not in came_from:
                    came_from[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no way back to {start} in {sorted(group)}")


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    """`bot.a -> bot.b (line 3) -> bot.a (line 7)`: where each arrow is written."""
    out = cycle[0]
    for a, b in itertools.pairwise(cycle):
        out += f" -> {b} ({a}, line {graph[a][b]})"
    return out


def test_no_import_cycle() -> None:
    graph = import_graph(ROOT)
    # The graph sees the tree: a top-level, a relative-free from-import of a submodule.
    assert len(graph) > 50 and "bot.app.delivery" in graph["bot.faces.worker"]
    found = [describe(cycle, graph) for cycle in import_cycles(ROOT)]
    assert found == [], "import cycles:\n" + "\n".join(found)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for package in OURS:
        (root / package).mkdir()
        (root / package / "__init__.py").write_text("")
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


TYPE_CHECKING_ONLY = """from __future__ import annotations
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from bot.a import A
"""


@pytest.mark.parametrize(
    ("files", "cycle"),
    [
        (
            {"bot/a.py": "from bot import b\n", "bot/b.py": "import bot.a\n"},
            ["bot.a", "bot.b", "bot.a"],
        ),
        (
            {"bot/a.py": "from bot.b import B\n", "bot/b.py": TYPE_CHECKING_ONLY},
            ["bot.a", "bot.b", "bot.a"],
        ),
        (
            {
                "bot/faces/slack/__init__.py": "",
                "bot/faces/slack/a.py": "from .b import B\n",
                "bot/faces/slack/b.py": "def f() -> None:\n    from . import a\n",
            },
            ["bot.faces.slack.a", "bot.faces.slack.b", "bot.faces.slack.a"],
        ),
        (
            {
                "bot/a.py": "from bot.b import B\n",
                "bot/b.py": "import provisioning.c\n",
                "provisioning/c.py": "x = 1\ndef f() -> None:\n    import bot.a.inner\n",
            },
            ["bot.a", "bot.b", "provisioning.c", "bot.a"],
        ),
    ],
    ids=[
        "two-modules",
        "type-checking-only",
        "relative-inside-a-function",
        "three-across-packages",
    ],
)
def test_the_cycle_check_catches_a_cycle(
    tmp_path: Path, files: dict[str, str], cycle: list[str]
) -> None:
    root = _tree(tmp_path, files)
    assert import_cycles(root) == [cycle]


def test_one_way_imports_are_no_cycle(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "bot/a.py": "from bot import b\nfrom . import c\n",
            "bot/b.py": "from bot.c import C\n",
            "bot/c.py": "import json\nimport bot\n",
        },
    )
    assert import_cycles(root) == []
    assert import_graph(root)["bot.a"] == {"bot.b": 1, "bot.c": 2}
    assert import_graph(root)["bot.c"] == {"bot": 2}


def test_a_cycle_is_named_with_where_each_import_is(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"bot/a.py": "from bot.b import B\n", "bot/b.py": TYPE_CHECKING_ONLY})
    (cycle,) = import_cycles(root)
    text = describe(cycle, import_graph(root))
    assert text == "bot.a -> bot.b (bot.a, line 1) -> bot.a (bot.b, line 4)"


# --- the layers of bot ----------------------------------------------------------------

# Each layer of `bot` and the layers it may import; arrows only point down. `sim` sits
# beside the app: the simulator replays the scheduler and never sees the use cases.
LAYERS: dict[str, set[str]] = {
    "domain": {"domain"},
    "app": {"domain", "app"},
    "adapters": {"domain", "app", "adapters"},
    # The providers (bot.providers): each wires provisioning's hands into the app's ports.
    "providers": {"domain", "app", "adapters", "providers"},
    "sim": {"domain", "sim"},
    "faces": {"domain", "app", "adapters", "providers", "sim", "faces"},
}
# What the pure bottom layer may not touch: the database, the network, the clouds, the
# scheduler library. Of `provisioning` it reads only the shipped catalog and cost facts.
IMPURE = {
    "db",
    "sqlmodel",
    "sqlalchemy",
    "slack_sdk",
    "slack_bolt",
    "boto3",
    "fabric",
    "apscheduler",
}
DOMAIN_READS = {"provisioning", "provisioning.catalog", "provisioning.costs"}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "bot" and len(parts) > 1 else None


def layer_breaches(root: Path) -> list[str]:
    """`bot.app.x imports bot.faces.y (line 3)` for every arrow that points up or
    sideways out of the layer map, and every module of bot outside a layer."""
    out = []
    for module, targets in sorted(import_graph(root).items()):
        if not module.startswith("bot.") and module != "bot":
            continue
        here = _layer(module)
        if module != "bot" and here not in LAYERS:
            out.append(f"{module} is in no layer (one of {sorted(LAYERS)})")
            continue
        for target, line in sorted(targets.items()):
            there = _layer(target)
            if not target.startswith("bot") or (there is None and target != "bot"):
                continue
            if module == "bot" or target == "bot" or there not in LAYERS[here or ""]:
                out.append(f"{module} imports {target} (line {line})")
    for path in sorted((root / "bot" / "domain").rglob("*.py")):
        for name in imports_of(path):
            if name in IMPURE:
                out.append(f"{path.relative_to(root)} imports {name}; the domain stays pure")
    for module, targets in sorted(import_graph(root).items()):
        if _layer(module) == "domain":
            for target, line in sorted(targets.items()):
                if target.split(".")[0] == "provisioning" and target not in DOMAIN_READS:
                    out.append(f"{module} imports {target} (line {line}); the domain stays pure")
    return out


def test_the_layers_only_point_down() -> None:
    found = layer_breaches(ROOT)
    assert found == [], "layer breaches:\n" + "\n".join(found)
    assert {_layer(m) for m in import_graph(ROOT) if m.startswith("bot.")} == set(LAYERS)


@pytest.mark.parametrize(
    ("files", "breach"),
    [
        (
            {"bot/domain/a.py": "def f() -> None:\n    from bot.app.b import B\n"},
            "bot.domain.a imports bot.app.b (line 2)",
        ),
        (
            {"bot/app/a.py": TYPE_CHECKING_ONLY.replace("bot.a", "bot.faces.b")},
            "bot.app.a imports bot.faces.b (line 4)",
        ),
        ({"bot/sim/a.py": "from bot.app import b\n"}, "bot.sim.a imports bot.app.b (line 1)"),
        ({"bot/stray.py": "x = 1\n"}, "bot.stray is in no layer"),
        ({"bot/domain/a.py": "import sqlmodel\n"}, "imports sqlmodel; the domain stays pure"),
        (
            {"bot/domain/a.py": "from provisioning.ssh import HostShell\n"},
            "imports provisioning.ssh (line 1); the domain stays pure",
        ),
    ],
    ids=[
        "function-local-up",
        "type-checking-up",
        "sim-into-app",
        "outside-layers",
        "impure-domain",
        "domain-over-ssh",
    ],
)
def test_the_layer_check_catches_a_breach(
    tmp_path: Path, files: dict[str, str], breach: str
) -> None:
    base = {f"bot/{layer}/{name}": "" for layer in LAYERS for name in ("__init__.py", "b.py")}
    base["provisioning/ssh.py"] = ""
    root = _tree(tmp_path, {**base, **files})
    found = layer_breaches(root)
    assert len(found) == 1 and breach in found[0], found


# --- no provider switch outside the providers --------------------------------------------

# Where code may ask which provider it is: the providers themselves and the composition
# root that makes them (bot/faces/runtime.py). Everywhere else a difference between
# places is a port the provider supplies (an executor, a supply, a display).
PROVIDER_NAMES = {"local", "ssh", "aws", "slurm"}
PROVIDER_CLASSES = {
    "LocalCompute",
    "StaticHostsCompute",
    "Ec2Compute",
    "SlurmCompute",
    "LocalProvider",
    "SshProvider",
    "AwsProvider",
    "SlurmProvider",
}
MAY_SWITCH = ("bot/providers/", "bot/faces/runtime.py")


def _names_a_provider(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and node.value in PROVIDER_NAMES:
        return True
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_a_provider(e) for e in node.elts)
    return False


def provider_switches(root: Path) -> list[str]:
    """`path:line` for every comparison with a provider's name and every isinstance
    with a provider's class in `bot`, outside the providers and the composition root."""
    out = []
    for path in sorted((root / "bot").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(MAY_SWITCH):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if isinstance(node, ast.Compare) and any(
                _names_a_provider(n) for n in (node.left, *node.comparators)
            ):
                out.append(f"{rel}:{node.lineno} compares with a provider's name")
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", "") == "isinstance"
                and len(node.args) == 2
                and any(
                    getattr(n, "id", getattr(n, "attr", "")) in PROVIDER_CLASSES
                    for n in ast.walk(node.args[1])
                )
            ):
                out.append(f"{rel}:{node.lineno} tests a provider's class")
    return out


def test_no_code_outside_the_providers_asks_which_provider_it_is() -> None:
    assert provider_switches(ROOT) == []


@pytest.mark.parametrize(
    ("line", "found"),
    [
        ('if host.provider == "aws":\n    pass\n', "compares with a provider's name"),
        ('ok = provider not in ("local", "ssh")\n', "compares with a provider's name"),
        ("ok = isinstance(c, Ec2Compute)\n", "tests a provider's class"),
    ],
)
def test_the_provider_check_catches_a_switch(tmp_path: Path, line: str, found: str) -> None:
    (tmp_path / "bot" / "app").mkdir(parents=True)
    (tmp_path / "bot" / "app" / "x.py").write_text(line)
    (tmp_path / "bot" / "providers").mkdir(parents=True)
    (tmp_path / "bot" / "providers" / "x.py").write_text(line)  # allowed there
    [breach] = provider_switches(tmp_path)
    assert breach.startswith("bot/app/x.py:") and found in breach
