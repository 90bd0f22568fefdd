"""The shipped journal catalog is generated from the code's table and stays in sync."""

from __future__ import annotations

import re

from conftest import REPO
from gpuguard.journal.catalog import KINDS, message_id, render_catalog


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
    assert not missing, f"kinds logged but not in gpuguard.journal.catalog.KINDS: {missing}"


def _field_names_in_code() -> set[str]:
    """Journal field names the code sets: dict keys and keyword arguments in CAPS."""
    names: set[str] = set()
    for path in (REPO / "src/gpuguard").rglob("*.py"):
        text = path.read_text()
        names |= set(re.findall(r'"([A-Z][A-Z0-9_]{2,})"(?::|\])', text))
        names |= set(re.findall(r"\b([A-Z][A-Z0-9_]{2,})=[a-z]", text))
    return names


def test_catalog_shows_field_values_instead_of_naming_fields() -> None:
    """`BACKUP` in a catalog text tells the operator to go and find a field; `@BACKUP@` is
    replaced by its value in `journalctl -x`. A field named in prose must be said to be a
    field (`the TRACEBACK field`)."""
    fields = _field_names_in_code()
    bare = []
    for kind, doc in KINDS.items():
        prose = re.sub(r"@[A-Z0-9_]+@", "", doc.subject + " " + doc.text)
        for token in re.findall(r"\b[A-Z][A-Z0-9_]{2,}\b(?! field)", prose):
            if token in fields:
                bare.append(f"{kind}: {token}")
    assert not bare, f"use @FIELD@ (a field the entry always carries) instead: {bare}"


def test_shown_fields_exist_and_are_set_somewhere() -> None:
    """Each @FIELD@ is a field the code sets (every entry of the kind carrying it is
    checked at run time by tests/conftest.py for every entry any test makes)."""
    from catalog_fields import ALWAYS, shown

    fields = _field_names_in_code() | ALWAYS | {"GPUGUARD_RECONCILER"}
    unknown = {k: sorted(shown(k) - fields) for k in KINDS if shown(k) - fields}
    assert not unknown, unknown
    assert shown("checkpoint-repaired") == {"BACKUP"}


def test_runtime_check_catches_an_entry_without_a_shown_field() -> None:
    from catalog_fields import lacking

    assert lacking("checkpoint-repaired", {"GPUGUARD_ACTION": "x"}, None, {}) == {"BACKUP"}
    assert lacking("checkpoint-repaired", {"BACKUP": "/b"}, None, {}) == frozenset()
    assert lacking("reconciler-crashed", {}, None, {}) == {"GPUGUARD_RECONCILER"}
