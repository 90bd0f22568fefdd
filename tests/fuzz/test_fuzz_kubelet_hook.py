"""kubelet's pre-start hook (`gpuguard check --only checkpoint --kubelet-stopped`) can
never hang or blow up kubelet's start.

Surfaces: the checkpoint, the request and result records in /run/gpuguard, the memo in
/var/lib/gpuguard, and NVML itself. Inputs: each file replaced by a FIFO, /dev/zero (a
node and a link), a link outside the root, a directory, 64 MiB, generated JSON; NVML
that never answers. The hook ends within its deadline (the drop-in's `-` ignores a
failure, not a hang), with a documented exit code and one bounded line, leaves a
result its caller can read, and writes nothing outside the root.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import fakenvml
from conftest import CHECKPOINTS, REPO, require_root, require_tool
from fakenode import CHECKPOINT, PLACEMENTS, Run, assert_clean, place, run_cli, tree
from fuzz.budget import budget
from gpuguard.host.paths import Root
from gpuguard.steps.checkpoint import kubelet_hook as kh

STALE = CHECKPOINTS / "numa-blog-04.json"
INVENTORY = {
    "gpus": [
        {
            "uuid": "GPU-77a702db-e37f-3a74-d46d-c5713f66058c",
            "index": 0,
            "minor": 0,
            "pci_bus_id": "00000000:10:00.0",
        },
        {
            "uuid": "GPU-9b341c59-f96b-ba85-c137-78c3652fea65",
            "index": 1,
            "minor": 1,
            "pci_bus_id": "00000000:11:00.0",
        },
    ]
}
FILES = {
    "checkpoint": CHECKPOINT,
    "request": kh.REQUEST,
    "result": kh.RESULT,
    "memo": "/var/lib/gpuguard/kubelet-hook.memo.json",
}
HOOK = ["check", "--only", "checkpoint", "--kubelet-stopped", "--reason", "kubelet-pre-start"]
ENV = {"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"}


@pytest.fixture(autouse=True)
def _root_for_mknod() -> None:
    require_root()  # /dev/zero-like nodes are made with mknod, in temp dirs only


def _node(root: Path) -> Path:
    (root / CHECKPOINT.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    (root / CHECKPOINT.lstrip("/")).write_bytes(STALE.read_bytes())
    inv = root / "inventory.json"
    inv.write_text(json.dumps(INVENTORY))
    return inv


def _after(root: Path, run: Run) -> None:
    assert_clean(run, HOOK)
    assert "inventory.json" not in run.err, run.err  # the test's own input is good
    result = kh.read_result(Root(root))
    if result is None:  # only when the result itself could not be written
        assert (root / kh.RESULT.lstrip("/")).exists() or (root / "run").is_symlink()
    else:
        assert result.exit_code == run.code


@pytest.mark.parametrize("which", sorted(FILES))
@pytest.mark.parametrize("kind", PLACEMENTS)
def test_each_file_replaced_in_process(which: str, kind: str, tmp_path: Path) -> None:
    inv = _node(tmp_path)
    target = tmp_path / FILES[which].lstrip("/")
    if target.exists():
        target.unlink()
    place(target, kind)
    outside = tree(Path("/etc")) if kind == "link-outside" else None
    run = run_cli(*HOOK, "--root", str(tmp_path), "--inventory", str(inv))
    _after(tmp_path, run)
    if outside is not None:
        assert tree(Path("/etc")) == outside  # nothing written through the link
    if which == "checkpoint" and kind not in ("absent", "link-outside"):
        assert run.code == 3 or kind == "directory", (run.code, run.err)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3)
    ),
    max_leaves=10,
)


@budget(30)
@given(st.sampled_from(["request", "result", "memo"]), json_values, st.booleans())
@example("request", {"version": 1, "token": "ab" * 1000, "time": 1e400}, True)
@example("result", {"version": 1, "token": [], "outcome": "repaired"}, True)
@example("memo", {"format": 1, "checkpoint_sha256": "0" * 64}, True)
def test_generated_records(which: str, doc: Any, as_json: bool) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        inv = _node(root)
        target = root / FILES[which].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(doc) if as_json else str(doc))
        run = run_cli(*HOOK, "--root", d, "--inventory", str(inv))
        _after(root, run)
        assert run.code in (0, 1)


@pytest.mark.parametrize("which", ["checkpoint", "request", "result"])
@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "link-dev-zero"])
def test_the_hook_process_never_waits_on_a_fifo_or_dev_zero(
    which: str, kind: str, tmp_path: Path
) -> None:
    """The installed entry point, as kubelet's ExecStartPre= runs it: a hang fails the
    timeout, /dev/zero ends in no MemoryError (exit 70)."""
    inv = _node(tmp_path)
    target = tmp_path / FILES[which].lstrip("/")
    if target.exists():
        target.unlink()
    place(target, kind)
    p = subprocess.run(
        [sys.executable, "-m", "gpuguard", *HOOK, "--root", str(tmp_path), "--inventory", str(inv)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    _after(tmp_path, Run(p.returncode, p.stdout, p.stderr))


def test_nvml_that_never_answers_ends_at_the_deadline(tmp_path: Path) -> None:
    """The hook's own deadline: kubelet starts within seconds even when NVML hangs; the
    result says why, so the restart's caller reports it. The real pynvml, over the fake
    driver library (tests/fakenvml) made to hang in nvmlInit."""
    require_tool("gcc")
    lib = fakenvml.build(tmp_path / "usr/lib64")
    fakenvml.write_conf(lib.parent, fakenvml.gpus(1), init_sleep=3600)  # never answers
    _node(tmp_path)
    kh.write_request(Root(tmp_path), "5eed")
    env = ENV
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "gpuguard", *HOOK, "--root", str(tmp_path), "--deadline", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    took = time.monotonic() - t0
    assert p.returncode == kh.DEADLINE_EXIT, (p.returncode, p.stderr)
    (line,) = p.stderr.splitlines()
    assert "2 s deadline" in line and len(line) < 400
    result = kh.read_result(Root(tmp_path))
    assert result is not None and result.outcome == kh.FAILED and result.token == "5eed"
    assert "deadline" in result.detail
    assert took < 30, took  # generous: the point is that it ends, not how fast


def test_a_bad_deadline_is_a_usage_error() -> None:
    for bad in ("0", "-1", "nan", "inf", "1e400", "9" * 5000, "\u0661"):
        run = run_cli(*HOOK, "--deadline", bad)
        assert run.code == 2, (bad, run.code)
