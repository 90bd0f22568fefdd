"""The shape of the code: one home per step, pure reconcilers, libraries that know no
step, small modules.

Every step of the registry lives in `steps/<name>/`. A reconcile module decides from
what it is given: it imports no `os`, no `subprocess`, no actuator, no D-Bus client and
no `commands` (checked on the source with `ast`, so a lazy import inside a function counts too).
`devices/` and `checkpoint/` import no step, actuator, D-Bus client or `commands`.
A module of the package fits in a head: at most MAX_LINES lines, or it is listed in
LONG_MODULES with the reason it may be longer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gpuguard.steps import registry

SRC = Path(__file__).resolve().parents[2] / "src" / "gpuguard"
# Modules a reconciler must not import: the OS, commands, D-Bus, anything that writes.
FORBIDDEN = (
    "os",
    "subprocess",
    "shutil",
    "gpuguard.host.commands",
    "gpuguard.host.systemd",
    "dbus_next",
)
# Pure helpers of a reconciler, held to the same rule.
PURE = (
    SRC / "steps/checkpoint/deviceids.py",
    SRC / "steps/checkpoint/gpumap.py",
    SRC / "steps/checkpoint/remap.py",
    SRC / "steps/device_plugin/limits.py",
    SRC / "steps/container_access/inplace.py",
    SRC / "steps/container_access/durable.py",
)
# Modules aim at under about 400 lines; past this one a module is split by what it holds.
MAX_LINES = 450
# Modules allowed past MAX_LINES, by path under src/gpuguard, each with its reason.
LONG_MODULES: dict[str, str] = {}


def imported(source: str) -> set[str]:
    """Every module `source` imports, `from a import b` giving both a and a.b."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def impurities(source: str) -> list[str]:
    bad = []
    for name in sorted(imported(source)):
        parts = name.split(".")
        if (
            any(name == f or name.startswith(f + ".") for f in FORBIDDEN)
            or "actuate" in parts
            or parts[-1] == "actuate"
        ):
            bad.append(name)
    return bad


def reconcile_modules() -> list[Path]:
    return sorted(SRC.glob("steps/*/reconcile.py")) + list(PURE)


def test_every_step_of_the_registry_has_its_package() -> None:
    for spec in registry.STEPS:
        module = spec.load.partition(":")[0]
        assert module == f"gpuguard.steps.{spec.name}", spec
        assert (SRC / "steps" / spec.name / "__init__.py").is_file()
        assert (SRC / "steps" / spec.name / "reconcile.py").is_file()


def test_the_reconcile_modules_are_found() -> None:
    names = {p.parent.name for p in reconcile_modules()}
    assert names >= {"container_access", "checkpoint", "device_nodes", "device_plugin", "gpu_count"}


@pytest.mark.parametrize("path", reconcile_modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_reconcile_modules_import_nothing_that_acts(path: Path) -> None:
    assert impurities(path.read_text()) == [], f"{path.relative_to(SRC)} must stay pure"


@pytest.mark.parametrize(
    "line",
    [
        "import os",
        "import os.path",
        "from os import listdir",
        "import subprocess",
        "from gpuguard.host.commands import run",
        "from gpuguard.host import commands",
        "from gpuguard.host.systemd import Systemd",
        "from gpuguard.steps.checkpoint.actuate import CheckpointActuator",
        "from gpuguard.steps.checkpoint import actuate",
        "from gpuguard.actuate.files import write_new",
        "def f():\n    import subprocess",
    ],
)
def test_the_check_catches_each_kind_of_impure_import(line: str) -> None:
    assert impurities(line) != []


def test_pure_imports_pass() -> None:
    src = "from dataclasses import dataclass\nfrom gpuguard.model import Finding\nimport re\n"
    assert impurities(src) == []


# Libraries of host and format knowledge: the steps share them, they know no step.
LIBRARIES = ("devices", "checkpoint")
LIBRARY_FORBIDDEN = (
    "gpuguard.steps",
    "gpuguard.actuate",
    "gpuguard.host.systemd",
    "gpuguard.host.commands",
)


@pytest.mark.parametrize(
    "path",
    sorted(p for lib in LIBRARIES for p in (SRC / lib).rglob("*.py")),
    ids=lambda p: str(p.relative_to(SRC)),
)
def test_libraries_import_no_step_actuator_or_client(path: Path) -> None:
    bad = [
        n
        for n in sorted(imported(path.read_text()))
        if any(n == f or n.startswith(f + ".") for f in LIBRARY_FORBIDDEN)
    ]
    assert bad == [], f"{path.relative_to(SRC)} is a library: {bad}"


def module_lines() -> dict[str, int]:
    return {
        str(p.relative_to(SRC)): len(p.read_text().splitlines())
        for p in sorted(SRC.rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def test_modules_stay_small() -> None:
    lines = module_lines()
    assert len(lines) > 50  # the package was found
    long = {m: n for m, n in lines.items() if n > MAX_LINES and m not in LONG_MODULES}
    assert not long, (
        f"split these by what they hold (or list them in LONG_MODULES, with why): {long}"
    )


def test_every_long_module_exception_is_still_needed() -> None:
    lines = module_lines()
    stale = [m for m in LONG_MODULES if lines.get(m, 0) <= MAX_LINES]
    assert not stale, f"no longer long (or gone): drop them from LONG_MODULES: {stale}"
