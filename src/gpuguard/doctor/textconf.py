"""The keys `gpuguard doctor` needs from TOML (containerd, CRI-O, the NVIDIA toolkit)
and YAML (kubelet), read by real parsers (host/structconf.py), flattened to dotted
text keys so the judge stays a table of string comparisons.

A file its owner would refuse, or one past the parsers' bounds, raises Unreadable: the
check it feeds says "unknown" with the reason. A key that is absent is simply absent
(the judge says unknown, or names the owner's documented default as such), never a
value guessed from a line that looked like one.
"""

from __future__ import annotations

from typing import Any, Iterator

from gpuguard.host.structconf import Refusal, scalar_text, toml_document, yaml_mapping

MAX_KEYS = 65536  # flattened keys kept from one file, at most


class Unreadable(ValueError):
    """The file cannot be read as its owner reads it; str() says why, in one line."""


def _walk(prefix: str, node: dict[str, Any], depth: int = 0) -> Iterator[tuple[str, Any]]:
    for k, v in node.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        yield key, v
        if isinstance(v, dict) and depth < 64:
            yield from _walk(key, v, depth + 1)


def _toml(text: str) -> dict[str, Any]:
    doc = toml_document(text)
    if isinstance(doc, Refusal):
        raise Unreadable(doc.why)
    return doc


def toml_scalars(text: str) -> dict[str, str]:
    """`table.key` -> scalar text for every scalar, at any depth (quotes removed).

    `[plugins."io.containerd.grpc.v1.cri".containerd]` + `default_runtime_name = "nvidia"`
    gives ``plugins.io.containerd.grpc.v1.cri.containerd.default_runtime_name``."""
    out: dict[str, str] = {}
    for key, v in _walk("", _toml(text)):
        s = scalar_text(v)
        if s is not None and len(out) < MAX_KEYS:
            out[key] = s
    return out


def toml_tables(text: str) -> list[str]:
    """Every table (a `[header]`, a dotted key's or an inline one), dotted, in order."""
    tables = [key for key, v in _walk("", _toml(text)) if isinstance(v, dict)]
    return tables[:MAX_KEYS]


def yaml_top_scalars(text: str) -> dict[str, str]:
    """Top-level scalar fields of a YAML or JSON mapping (kubelet's configuration)."""
    doc = yaml_mapping(text)
    if isinstance(doc, Refusal):
        raise Unreadable(doc.why)
    out: dict[str, str] = {}
    for k, v in doc.items():
        s = scalar_text(v)
        if s is not None:
            out[k] = s
    return out
