"""What a configuration key is: its name, value type, default (as written in a file,
parsed once at import) and doc, carried in the field metadata of a section dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuguard.config.types import ValueType

SEE_ALSO = "(see gpuguard.conf(5))"
DEFAULT_ORIGIN = "default"


@dataclass(frozen=True)
class _KeyMeta:
    key: str
    type: ValueType
    default_text: str
    doc: str


@dataclass(frozen=True)
class KeySpec:
    """One configuration key: where it lives, how it parses, its default and meaning."""

    section: str
    key: str
    attr: str  # the attribute of the section dataclass
    type: ValueType
    default_text: str  # the default as it is written in a config file
    default: Any
    doc: str


def _key(key: str, vtype: ValueType, default_text: str, doc: str) -> Any:
    """A section dataclass field whose default is parsed from its text form.

    Parsing the default (at import) proves each default is itself a valid setting and
    makes the text in docs/the shipped file the single source of the value.
    """
    default = vtype.parse(default_text) if default_text or not vtype.empty_resets else None
    meta = {"gpuguard": _KeyMeta(key, vtype, default_text, doc)}
    return field(default=default, metadata=meta)
