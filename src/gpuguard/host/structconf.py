"""Other programs' YAML and TOML, read as those programs read them, within bounds.

kubelet's configuration is YAML or JSON (JSON is YAML), k3s's config.yaml YAML, and
containerd's, CRI-O's and the NVIDIA toolkit's configurations TOML. A hand-written
subset misreads valid files (quoted keys, flow mappings, JSON after `---`) and a
backtracking regex can take minutes on one long line, so both go through real
parsers: PyYAML's safe loader, and tomllib (Python 3.11+) or tomli (3.9, 3.10).

Bounds: the text is at most MAX_BYTES (the caller reads it bounded too); YAML's nesting
is measured on libyaml's event stream first (iterative, linear) and a document nested
deeper than MAX_DEPTH is refused, since libyaml's composer recurses in C (a 1 MiB
`[[[[...` crashes the interpreter) and PyYAML's constructor in Python; TOML's
parser's recursion is caught. Every failure is a Refusal with a one-line reason, which
the caller reports as "unknown": never a default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

MAX_BYTES = 1024 * 1024
MAX_DEPTH = 64
MAX_DOCUMENTS = 64
Scalar = Union[str, int, float, bool]


@dataclass(frozen=True)
class Refusal:
    why: str


def _yaml() -> Any:
    import yaml  # type: ignore[import-untyped,unused-ignore]  # python3-yaml, python3-pyyaml

    return yaml


def _loader(yaml: Any) -> Any:
    return getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader


def _too_deep(yaml: Any, text: str) -> Optional[str]:
    depth = docs = 0
    opening = (yaml.SequenceStartEvent, yaml.MappingStartEvent)
    closing = (yaml.SequenceEndEvent, yaml.MappingEndEvent)
    for ev in yaml.parse(text, Loader=_loader(yaml)):
        if isinstance(ev, opening):
            depth += 1
            if depth > MAX_DEPTH:
                return f"nested deeper than {MAX_DEPTH} levels"
        elif isinstance(ev, closing):
            depth -= 1
        elif isinstance(ev, yaml.DocumentStartEvent):
            docs += 1
            if docs > MAX_DOCUMENTS:
                return f"more than {MAX_DOCUMENTS} documents"
    return None


def yaml_documents(text: str) -> Union[list[Any], Refusal]:
    """Every document of a YAML stream (None for an empty one), or why not."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        return Refusal(f"larger than {MAX_BYTES} bytes")
    try:
        yaml = _yaml()
    except ImportError:
        return Refusal("no YAML parser (install PyYAML: python3-yaml)")
    try:
        deep = _too_deep(yaml, text)
        if deep:
            return Refusal(deep)
        return list(yaml.load_all(text, Loader=_loader(yaml)))
    except yaml.YAMLError as e:
        return Refusal(f"not valid YAML: {_one_line(e)}")
    except (RecursionError, ValueError, TypeError, OverflowError) as e:
        return Refusal(f"not readable as YAML: {_one_line(e)}")


def yaml_mapping(text: str) -> Union[dict[str, Any], Refusal]:
    """The first non-empty document of a YAML (or JSON) stream as a mapping: sigs.k8s.io
    yaml, which kubelet and k3s use, reads the first document of a file."""
    docs = yaml_documents(text)
    if isinstance(docs, Refusal):
        return docs
    doc = next((d for d in docs if d is not None), None)
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        return Refusal(f"its document is a {type(doc).__name__}, not a mapping")
    return {str(k): v for k, v in doc.items()}


def _toml() -> Any:
    try:
        import tomllib  # type: ignore[import-not-found,unused-ignore]
    except ImportError:  # Python < 3.11
        try:
            import tomli as tomllib  # type: ignore[import-not-found,unused-ignore,no-redef]
        except ImportError:
            return None
    return tomllib


def toml_document(text: str) -> Union[dict[str, Any], Refusal]:
    """A TOML document as nested dicts, or why not."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        return Refusal(f"larger than {MAX_BYTES} bytes")
    toml = _toml()
    if toml is None:
        return Refusal("no TOML parser on this Python (install tomli: python3-tomli)")
    try:
        doc = toml.loads(text)
    except toml.TOMLDecodeError as e:
        return Refusal(f"not valid TOML: {_one_line(e)}")
    except (RecursionError, ValueError, TypeError, OverflowError) as e:
        return Refusal(f"not readable as TOML: {_one_line(e)}")
    return dict(doc)


def scalar_text(v: Any) -> Optional[str]:
    """A scalar as the owner's configuration would print it; None for anything else."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (str, int, float)):
        return str(v)
    return None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__
