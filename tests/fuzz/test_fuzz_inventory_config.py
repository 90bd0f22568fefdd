"""Generated inventories, and configurations with drop-in directories, through the CLI.

No traceback, a documented exit code, one error line naming the file (and a line that
exists in it), no hang on FIFOs or /dev/zero, and `check --dry-run` changes nothing.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from conftest import CHECKPOINTS
from fakenode import CHECKPOINT, Run, assert_clean, run_cli, tree, write
from fuzz.budget import budget
from gpuguard import exitcodes
from gpuguard.config import KEYS

STALE = CHECKPOINTS / "numa-blog-04.json"

# ---------------------------------------------------------------------- inventories

_uuid = st.one_of(
    st.sampled_from(
        [
            "GPU-77a702db-e37f-3a74-d46d-c5713f66058c",
            "GPU-9b341c59-f96b-ba85-c137-78c3652fea65",
            "GPU-5d3e2a10-7c4b-4f0e-9a61-2b8e4c1d7f93",
        ]
    ),
    st.text(max_size=8),
)
_number = st.one_of(
    st.integers(0, 3),
    st.integers(-5, -1),
    st.integers(2**20, 2**80),
    st.floats(allow_nan=False),
    st.booleans(),
    st.text(max_size=3),
    st.none(),
)
_gpu = st.fixed_dictionaries(
    {"uuid": _uuid, "index": _number, "minor": _number, "pci_bus_id": st.text(max_size=12)},
    optional={
        "mig": st.lists(
            st.fixed_dictionaries({"uuid": _uuid, "gi": _number, "ci": _number}), max_size=2
        ),
        "name": st.one_of(st.text(max_size=8), st.integers()),
    },
)
inventories = st.one_of(
    st.fixed_dictionaries({"gpus": st.lists(_gpu, max_size=4)}).map(json.dumps),
    st.recursive(
        st.none() | st.integers() | st.text(max_size=6),
        lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids),
        max_leaves=12,
    ).map(json.dumps),
    st.text(max_size=40),
)


def _check_dry(root: Path, inv: Path) -> Run:
    before = tree(root)
    argv = ["check", "--root", str(root), "--inventory", str(inv), "--dry-run", "--json"]
    run = run_cli(*argv)
    assert_clean(run, argv)
    assert tree(root) == before, "--dry-run changed the root"
    return run


@budget(60)
@given(inventories)
@example('{"gpus": ' + "[" * 100_000 + "]" * 100_000 + "}")  # RecursionError
@example('{"gpus": [{"uuid": "GPU-a", "index": ' + "1" * 5000 + "}]}")  # int digit limit
@example(
    json.dumps(
        {"gpus": [{"uuid": f"GPU-{i}", "index": 0, "minor": i, "pci_bus_id": "x"} for i in (1, 2)]}
    )
)  # duplicate index
@example(json.dumps({"gpus": [{"uuid": "GPU-a", "index": 0, "minor": -1, "pci_bus_id": "x"}]}))
def test_generated_inventories(text: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        write(root / CHECKPOINT.lstrip("/"), STALE.read_bytes())
        inv = root / "inventory.json"
        write(inv, text.encode("utf-8", "surrogatepass"))
        run = _check_dry(root, inv)
        if run.code == exitcodes.BAD_INPUT:
            lines = [ln for ln in run.err.splitlines() if ln.startswith("gpuguard: ")]
            assert lines and str(inv) in lines[-1], run.err


# ------------------------------------------------------------------- configurations

_SEPARATORS = ["\n", "\r\n", "\f", "\u2028", "\u2029", "\x85", "\x0b"]
_values = st.one_of(
    st.sampled_from(
        [
            "",
            "yes",
            "no",
            "5min",
            "2s 500ms",
            "9" * 5000 + "s",
            "99999999999999999999999w",
            "\u0663",
            "\u0663s",
            "1e999s",
            "-1",
            "9" * 5000,
            "/var/lib/gpuguard/backups",
            "relative/path",
            "nvidia.com/gpu",
            "x" * 20_000,
            "debug",
        ]
    ),
    st.text(max_size=12),
)
_PAIRS = [(k.section, k.key) for k in KEYS]


@st.composite
def config_text(draw: Any) -> str:
    lines = []
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["section", "assign", "comment", "junk", "blank"]))
        if kind == "section":
            section, _ = draw(st.sampled_from(_PAIRS))
            lines.append(f"[{draw(st.sampled_from([section, section.lower(), 'Nope']))}]")
        elif kind == "assign":
            section, key = draw(st.sampled_from(_PAIRS))
            if draw(st.booleans()):
                lines.append(f"[{section}]")
            lines.append(f"{key}={draw(_values)}")
        elif kind == "comment":
            lines.append("# " + draw(st.text(max_size=10)))
        elif kind == "junk":
            lines.append(draw(st.text(max_size=20)))
        else:
            lines.append("")
    sep = draw(st.sampled_from(_SEPARATORS[:2]))
    text = sep.join(lines)
    # Line separators other than "\n" inside a line: they must not shift line numbers.
    extra = draw(st.sampled_from(_SEPARATORS[2:]))
    return text.replace("# ", f"# {extra}", 1) + "\n"


_ENTRY_KINDS = ["file", "file", "file", "fifo", "dev-zero", "dir", "dangling", "not-utf8"]


@st.composite
def config_root(draw: Any) -> list[tuple[str, str, str]]:
    """(relative path, kind, text): the main file and 0-3 drop-ins."""
    entries = [("etc/gpuguard/gpuguard.conf", draw(st.sampled_from(_ENTRY_KINDS)), "")]
    for i in range(draw(st.integers(0, 3))):
        name = f"etc/gpuguard/gpuguard.conf.d/{i}0-{draw(st.sampled_from(['a', '.hidden']))}.conf"
        entries.append((name, draw(st.sampled_from(_ENTRY_KINDS)), ""))
    return [(p, k, draw(config_text()) if k in ("file", "not-utf8") else "") for p, k, _ in entries]


def _make(root: Path, entries: list[tuple[str, str, str]]) -> None:
    for rel, kind, text in entries:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if kind == "file":
            p.write_bytes(text.encode("utf-8", "surrogatepass"))
        elif kind == "not-utf8":
            p.write_bytes(text.encode("utf-8", "surrogatepass") + b"\xff\n")
        elif kind == "fifo":
            os.mkfifo(p)
        elif kind == "dev-zero":
            p.symlink_to("/dev/zero")
        elif kind == "dir":
            p.mkdir()
        else:
            p.symlink_to(root / "nowhere")


_WHERE = re.compile(r"^gpuguard: (/\S+?):(\d+): ")


def _line_exists(message: str) -> None:
    """An error naming FILE:N names a line FILE has (counted in "\\n", as editors do)."""
    m = _WHERE.match(message)
    if m is None:
        return
    path, n = Path(m.group(1)), int(m.group(2))
    data = path.read_bytes()
    assert 1 <= n <= data.count(b"\n") + 1, message[:200]


@budget(80)
@given(config_root())
@example([("etc/gpuguard/gpuguard.conf", "dev-zero", "")])
@example([("etc/gpuguard/gpuguard.conf", "fifo", "")])
@example(
    [
        ("etc/gpuguard/gpuguard.conf", "file", "[Daemon]\n"),
        ("etc/gpuguard/gpuguard.conf.d/10-a.conf", "fifo", ""),
    ]
)
@example([("etc/gpuguard/gpuguard.conf", "file", "# \f\u2028\n[Daemon]\nQuietPeriod=1e999s\n")])
def test_generated_configurations(entries: list[tuple[str, str, str]]) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        _make(root, entries)
        run = run_cli("config", "--root", d)
        assert_clean(run, ["config"])
        assert run.code in (exitcodes.OK, exitcodes.USAGE)
        errors = [ln for ln in run.err.splitlines() if ln.startswith("gpuguard: ")]
        if run.code == exitcodes.USAGE:
            assert len(errors) == 1 and "/etc/gpuguard/" in errors[0], run.err
            _line_exists(errors[0])
        write(root / CHECKPOINT.lstrip("/"), STALE.read_bytes())
        inv = root / "inventory.json"
        write(inv, '{"gpus": []}')
        check = _check_dry(root, inv)
        # check --dry-run helps debug a node: with a broken file it runs without it and
        # names it (config/parse.py, load_config_or_fallback), never refuses to run
        assert check.code != exitcodes.USAGE, check.err
        if run.code == exitcodes.USAGE:
            warned = [ln for ln in check.err.splitlines() if ln.startswith("gpuguard: warning:")]
            assert warned and "/etc/gpuguard/" in warned[0], check.err
