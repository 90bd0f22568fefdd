"""Which journal fields a catalog entry shows (@FIELD@), and whether an entry carries them.

journalctl -x replaces @FIELD@ in a catalog entry with the entry's own value; a field the
entry lacks stays as the literal "@FIELD@", which tells the operator nothing. tests/conftest.py
checks every entry any test makes against its kind's catalog text with `lacking()`.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

from gpuguard.journal.catalog import KINDS

FIELD = re.compile(r"@([A-Z0-9_]+)@")
# Set on every entry by EventLog itself.
ALWAYS = frozenset({"MESSAGE", "MESSAGE_ID", "PRIORITY", "SYSLOG_IDENTIFIER", "GPUGUARD_KIND"})


def shown(kind: str) -> frozenset[str]:
    doc = KINDS.get(kind)
    if doc is None:
        return frozenset()
    return frozenset(FIELD.findall(doc.subject + "\n" + doc.text))


def lacking(
    kind: str,
    fields: Optional[Mapping[str, Any]],
    exc: Optional[BaseException],
    static: Mapping[str, str],
) -> frozenset[str]:
    """The @FIELD@s of `kind`'s catalog entry that this entry would not carry."""
    carried = {k.upper() for k in (fields or {})} | {k.upper() for k in static} | ALWAYS
    if exc is not None:
        carried.add("TRACEBACK")
    return shown(kind) - carried
