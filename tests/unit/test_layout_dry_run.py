"""One apply path: only the executor (engine/executor.py) decides between making a
change and describing it, so a dry-run says what the real run does by construction.

No other module reads the dry-run flag: no name, attribute, parameter or keyword
`dry_run` (checked on the source with `ast`), but for the few that only carry it: the
configuration's `DryRun=`, the command line's `--dry-run` handed to the executor, and
the status file's documented `dry_run` field. Each of those is listed with why, and
the list fails when one of them no longer needs to be on it.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "gpuguard"
EXECUTOR = "engine/executor.py"
# Modules that carry the flag to the executor or into the status file, and why.
CARRIERS: dict[str, str] = {
    "config/sections_node.py": "parses [Daemon] DryRun=",
    "cli/check.py": "--dry-run to the executor (and the off switch making a check one; "
    "a dry-run goes on with a broken configuration)",
    "cli/daemon.py": "--dry-run to the daemon's executor",
    "cli/protect.py": "--dry-run to the executor",
    "engine/report.py": "the status file's dry_run field, from the executor's mode",
    "reporting/status.py": "the status file's dry_run field (a documented field)",
}


def reads(source: str) -> list[int]:
    """The lines where `source` names `dry_run`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (
            (isinstance(node, ast.Name) and node.id == "dry_run")
            or (isinstance(node, ast.Attribute) and node.attr == "dry_run")
            or (isinstance(node, (ast.arg, ast.keyword)) and node.arg == "dry_run")
        ):
            out.append(getattr(node, "lineno", 0))
    return sorted(out)


def by_module() -> dict[str, list[int]]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        lines = reads(path.read_text())
        if lines:
            found[path.relative_to(SRC).as_posix()] = lines
    return found


def test_no_module_but_the_executor_reads_the_dry_run_flag() -> None:
    found = by_module()
    stray = {m: lines for m, lines in found.items() if m != EXECUTOR and m not in CARRIERS}
    assert stray == {}, (
        "dry-run is the executor's decision (engine/executor.py): hand it a Change "
        "(actuate/change.py) instead"
    )


def test_every_carrier_listed_still_carries_it() -> None:
    found = by_module()
    assert EXECUTOR in found
    assert [m for m in CARRIERS if m not in found] == [], "keep CARRIERS minimal"


def test_the_check_sees_each_form() -> None:
    src = "def f(dry_run):\n    g(dry_run=dry_run)\n    return svc.dry_run\n"
    assert reads(src) == [1, 2, 2, 3]
