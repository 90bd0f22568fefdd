"""The import graph of the package: no cycle, no step importing another step, and a
top level grouped by role.

Every import counts, a lazy one inside a function too (it still ties the two modules
together). `from a import b` names the module a.b where b is one, else a.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "gpuguard"
STEPS = SRC / "steps"
# What may sit at the top of src/gpuguard besides the role packages: the package's
# face, `python -m gpuguard`, and the vocabulary every layer shares.
TOP_LEVEL_MODULES = {"__init__.py", "__main__.py", "model.py", "errors.py", "exitcodes.py"}


def module_name(path: Path) -> str:
    parts = ["gpuguard", *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SRC.rglob("*.py")) if "__pycache__" not in p.parts}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The package's modules that `path` imports (the deepest known name of each)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    # Importing a.b.c runs the faces a and a.b first; that is not a dependency of the
    # importer's own, so a package's face counts only by what it imports itself.
    return {m: imports_of(p, known) - {m} for m, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


# steps/ modules that are no step: the registry and its vocabulary of events
NOT_STEPS = ("registry", "events")


def step_of(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "steps" and parts[2] not in NOT_STEPS else ""


def test_the_import_graph_has_no_cycle() -> None:
    g = graph()
    assert len(g) > 50
    assert cycles(g) == [], "break each cycle: move what both sides need below both"


def test_no_step_imports_another_step() -> None:
    bad = sorted(
        f"{m} -> {d}"
        for m, deps in graph().items()
        for d in deps
        if step_of(m) and step_of(d) and step_of(m) != step_of(d)
    )
    assert bad == [], "what two steps both need belongs in devices/, checkpoint/ or the snapshot"


def test_the_top_level_holds_role_packages_only() -> None:
    loose = sorted(p.name for p in SRC.glob("*.py") if p.name not in TOP_LEVEL_MODULES)
    assert loose == [], "a module's home is the package of its role (engine, host, ...)"


def test_the_checks_find_what_they_look_for() -> None:
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert step_of("gpuguard.steps.checkpoint.observe") == "checkpoint"
    assert step_of("gpuguard.steps.registry") == ""
    assert step_of("gpuguard.steps.events") == ""
