"""gpuguard.conf(5) is current, lists every key with its default, and messages point at
installed documentation (man pages), never at the source tree's docs/."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

from conftest import REPO
from gpuguard.config import KEYS, ConfigError, load_config
from gpuguard.config.manconf import render
from gpuguard.host.paths import Root

MAN = REPO / "docs/gpuguard.conf.5"


def test_man_page_is_current() -> None:
    assert MAN.read_text() == render(), (
        "run: python -m gpuguard.config.manconf > docs/gpuguard.conf.5"
    )


def test_man_page_has_every_key_with_its_default() -> None:
    text = subprocess.run(
        ["man", "-l", "-Tutf8", str(MAN)],
        capture_output=True,
        text=True,
        env={"MANWIDTH": "200", "PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
        check=True,
    ).stdout
    text = re.sub(r".\x08", "", text)  # overstrike (bold/underline)
    section = ""
    for spec in KEYS:
        if spec.section != section:
            section = spec.section
            assert f"[{section}] SECTION" in text
        block = text[text.index(f"[{section}] SECTION") :]
        m = re.search(rf"^\s+{spec.key}=(.*)\n((?:\s{{8,}}.*\n)+)", block, re.M)
        assert m, spec.key
        body = " ".join(m.group(2).split())
        assert f"Default: {spec.default_text or '(empty)'}." in body, (spec.key, body)


def test_config_errors_point_at_the_man_page(tmp_path: Path) -> None:
    conf = tmp_path / "gpuguard.conf"
    conf.write_text("[Daemon]\nAuditIntervall=1min\n")
    try:
        load_config(Root(tmp_path), path=conf, strict=True)
    except ConfigError as e:
        assert e.message.endswith("(see gpuguard.conf(5))"), e.message
    else:
        raise AssertionError("accepted an unknown key")


def test_messages_never_point_at_the_source_tree() -> None:
    """String constants in the code other than docstrings (messages, shipped text)."""
    bad = []
    for path in sorted((REPO / "src/gpuguard").rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and re.search(r"(?<![\w/])docs/|README", node.value)
            ):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value[:60]!r}")
    # the developer's regeneration helpers name the files they regenerate
    allowed = ("REFERENCE_BEGIN", "docs/configuration.md's key reference")
    bad = [b for b in bad if not any(a in b for a in allowed)]
    assert not bad, bad
