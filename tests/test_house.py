"""The house's rules, read from the source: which package may import which, no import circles,
no reaching into another package's private names, small modules, a core that stays small; and
the tests' own: what a process they start leaves behind is theirs to find."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import daemonutil

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
GENERATED = ("_pb2.py", "_pb2_grpc.py")
MAX_LINES = 400
MAX_CORE_MODULES = 12

# What each package may import; `bench` may import everything and nothing imports it.
MAY_IMPORT = {
    "tiers": {"tiers"},
    "proto": {"proto"},
    "service": {"service", "tiers", "proto"},
    "connector": {"connector", "tiers", "proto"},
    "engine": {"engine", "tiers", "connector"},
    "bench": {"bench", "tiers", "proto", "service", "connector", "engine"},
}


def _modules() -> dict[str, Path]:
    """Every first-party module by dotted name."""
    found = {}
    for package, folder in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name.endswith(GENERATED):
                continue
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            found.setdefault(name, path)
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every first-party import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if path.name != "__init__.py":
                    base.pop()
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [alias.name for alias in node.names]
            # `from pkg import submodule` imports the submodule
            subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
            found += [(sub, []) for sub in subs]
            found.append((module, [n for n in names if f"{module}.{n}" not in MODULES]))
    return [(module, names) for module, names in found if module.startswith("kvtier.")]


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _package(module: str) -> str:
    return module.split(".")[1]


def test_packages_import_only_along_the_arrows() -> None:
    wrong = [
        f"{name} imports {module}"
        for name, imports in GRAPH.items()
        for module, _ in imports
        if _package(module) not in MAY_IMPORT[_package(name)]
    ]
    assert not wrong, "\n".join(wrong)


def test_no_package_takes_another_packages_private_names() -> None:
    """A private name crosses no subpackage boundary either (``tiers.disk`` is not
    ``tiers.host``)."""

    def room(module: str) -> str:
        parts = module.split(".")
        path = MODULES.get(module)
        is_package = path is not None and path.name == "__init__.py"
        return ".".join(parts if is_package else parts[:-1])

    wrong = [
        f"{name} takes {module}.{n}"
        for name, imports in GRAPH.items()
        for module, names in imports
        for n in names
        if n.startswith("_") and not n.startswith("__") and room(module) != room(name)
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_circles() -> None:
    edges = {
        name: {module for module, _ in imports if module in MODULES and module != name}
        for name, imports in GRAPH.items()
    }
    # A package's __init__ is imported on the way to any of its modules: not an edge back.
    circles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not circles, "\n".join(circles)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_small(name: str) -> None:
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name]} has {lines} lines: split it along its seams"


def test_the_storage_core_stays_small() -> None:
    core = sorted(p.name for p in (ROOT / "tiers").glob("*.py") if p.name != "__init__.py")
    assert len(core) <= MAX_CORE_MODULES, f"tiers/ holds {len(core)} modules: {core}"


def test_a_daemon_a_childs_test_code_starts_is_this_sessions(tmp_path) -> None:
    """The leftover check at the session's end sees only this session's daemons: a process the
    tests start (a script, an engine) must mark its daemons as this session's."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    child = subprocess.run(
        [sys.executable, "-c", "import daemonutil; print(daemonutil.Daemon().root)"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout.split()[-1]
    try:
        assert Path(child).name.startswith(daemonutil.ROOT_PREFIX)
    finally:
        Path(child).rmdir()
