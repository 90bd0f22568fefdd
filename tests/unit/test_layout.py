"""The shape of the code: one home per step, and pure reconcilers.

Every step of the registry lives in `steps/<name>/`. A reconcile module decides from
what it is given: it imports no `os`, no `subprocess`, no actuator, no D-Bus client and
no `commands` (checked on the source with `ast`, so a lazy import inside a function counts too).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gpuguard.steps import registry

SRC = Path(__file__).resolve().parents[2] / "src" / "gpuguard"
# Modules a reconciler must not import: the OS, commands, D-Bus, anything that writes.
FORBIDDEN = ("os", "subprocess", "shutil", "gpuguard.commands", "gpuguard.systemd", "dbus_next")
# Pure helpers of a reconciler, held to the same rule.
PURE = (SRC / "steps/checkpoint/deviceids.py", SRC / "steps/container_access/inplace.py")


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
        "from gpuguard.commands import run",
        "from gpuguard import commands",
        "from gpuguard.systemd import Systemd",
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
