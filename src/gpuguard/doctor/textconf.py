"""Just enough of TOML and YAML to read the few keys `gpuguard doctor` needs.

Hosts run Python 3.9 (no tomllib) and gpuguard adds no parser dependency for a handful
of scalars. Both readers are deliberately narrow: top-level tables and `key = value`
scalars in TOML, top-level `key: value` scalars in YAML. Anything else is skipped,
so an unusual file gives "not set" (and the check says unknown), never a wrong value.
"""

from __future__ import annotations

import re
from typing import Optional

_TABLE = re.compile(r"^\[\s*([^\[\]]+?)\s*\]\s*(?:#.*)?$")
_KEY = re.compile(r"^([A-Za-z0-9_.\-\"']+)\s*=\s*(.*)$")


def _unquote_key(key: str) -> str:
    parts = re.findall(r'"([^"]*)"|\'([^\']*)\'|([^.\s]+)', key)
    return ".".join(a or b or c for a, b, c in parts)


def _scalar(raw: str) -> Optional[str]:
    """A TOML string, boolean or number as text; None for arrays, tables and the like."""
    raw = raw.strip()
    if raw[:1] in ('"', "'"):
        q = raw[0]
        end = raw.find(q, 1)
        return raw[1:end] if end > 0 else None
    m = re.match(r"^(true|false|[-+0-9._]+)\s*(?:#.*)?$", raw)
    return m.group(1) if m else None


def toml_scalars(text: str) -> dict[str, str]:
    """`table.key` -> scalar text for every `key = scalar` line (dotted, quotes removed).

    `[plugins."io.containerd.grpc.v1.cri".containerd]` + `default_runtime_name = "nvidia"`
    gives ``plugins.io.containerd.grpc.v1.cri.containerd.default_runtime_name``."""
    out: dict[str, str] = {}
    table = ""
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if s.startswith("[["):
            table = "\0"  # arrays of tables: not needed, never confused with a table
            continue
        m = _TABLE.match(s)
        if m:
            table = _unquote_key(m.group(1))
            continue
        m = _KEY.match(s)
        if m and table != "\0":
            value = _scalar(m.group(2))
            if value is not None:
                key = _unquote_key(m.group(1))
                out[f"{table}.{key}" if table else key] = value
    return out


def toml_tables(text: str) -> list[str]:
    """Every `[table]` header, dotted and unquoted, in file order."""
    out = []
    for line in text.splitlines():
        m = _TABLE.match(line.strip())
        if m and not line.strip().startswith("[["):
            out.append(_unquote_key(m.group(1)))
    return out


def yaml_top_scalars(text: str) -> dict[str, str]:
    """Top-level `key: scalar` pairs of a YAML mapping (kubelet's config.yaml)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not line or line[0] in " \t#-" or ":" not in line:
            continue
        key, _, value = line.partition(":")
        value = value.split(" #", 1)[0].strip()
        if value[:1] in ('"', "'") and value[-1:] == value[:1] and len(value) >= 2:
            value = value[1:-1]
        if value and value[:1] not in "{[|>&*!":
            out[key.strip()] = value
    return out
