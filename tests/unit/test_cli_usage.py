"""Usage errors name the command that was mistyped, and every option says what it does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


def gpuguard(*args: str, root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuguard", *args, "--root", str(root)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"},
        timeout=60,
    )


@pytest.mark.parametrize(
    "argv,usage",
    [
        (["check", "--bogus"], "usage: gpuguard check "),
        (["status", "--bogus"], "usage: gpuguard status "),
        (["daemon", "--bogus"], "usage: gpuguard daemon "),
        (["checkpoint", "inspect", "FILE", "--bogus"], "usage: gpuguard checkpoint inspect "),
    ],
)
def test_unknown_option_prints_the_commands_usage(
    tmp_path: Path, argv: list[str], usage: str
) -> None:
    res = gpuguard(*argv, root=tmp_path)
    assert res.returncode == 2
    assert res.stderr.startswith(usage), res.stderr
    assert res.stderr.rstrip().endswith("error: unrecognized arguments: --bogus"), res.stderr
    assert "Traceback" not in res.stderr


def test_status_json_has_help(tmp_path: Path) -> None:
    out = gpuguard("status", "--help", root=tmp_path).stdout
    line = next(x for x in out.splitlines() if x.strip().startswith("--json"))
    assert line.strip() != "--json", out  # a help text follows the option


def test_every_option_of_every_command_has_help() -> None:
    from gpuguard.cli import build_parser

    def walk(p: object, name: str) -> list[str]:
        import argparse

        assert isinstance(p, argparse.ArgumentParser)
        bare = [
            f"{name} {'/'.join(a.option_strings)}"
            for a in p._actions
            if a.option_strings and not a.help
        ]
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub, sp in a.choices.items():
                    bare += walk(sp, f"{name} {sub}")
        return bare

    missing = walk(build_parser(), "gpuguard")
    assert not missing, f"options without a help text: {missing}"
