"""gpuguard's own state files, read back: every loader and every reader of them.

Surfaces: the status file (`gpuguard status`, `npd`, `doctor`), metrics.json (`gpuguard
metrics`, `metrics --serve`), the kubelet hook's request and result, its memo, the
dropped-entries record and the device plugin's restart budgets. Inputs: generated JSON
(any shape), documents the daemon writes with one value replaced by a hostile one (a
list where an object was, a 400-digit number, 1e400, a lone surrogate, deep nesting, a
megabyte string), raw bytes, and the file replaced by a FIFO, /dev/zero, links, a
directory or 64 MiB. Every load gives the value or "absent/unknown" with one line of
at most 400 characters; every command exits with its documented code (npd: 2,
unknown) and one bounded line; the HTTP server answers every scrape.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import statusdoc
from conftest import REPO
from fakenode import PLACEMENTS, Run, assert_clean, place, run_cli
from fuzz.budget import budget
from gpuguard.checkpoint import dropped
from gpuguard.host.statefile import StateFile, load
from gpuguard.reporting import metrics_file
from gpuguard.reporting.npd import CONDITIONS, UNKNOWN
from gpuguard.reporting.status import SPEC as STATUS_SPEC
from gpuguard.steps.checkpoint import kubelet_hook, memo
from gpuguard.steps.device_plugin import state as plugin_state

SPECS: dict[str, StateFile[Any]] = {
    "status": STATUS_SPEC,
    "metrics": metrics_file.SPEC,
    "hook-request": kubelet_hook.REQUEST_SPEC,
    "hook-result": kubelet_hook.RESULT_SPEC,
    "memo": memo.SPEC,
    "dropped": dropped.SPEC,
    "plugin-state": plugin_state.SPEC,
}
WHY_MAX = 400

# JSON values a hostile or broken writer may leave where gpuguard expects its own
HOSTILE_VALUES: list[Any] = [
    None,
    [],
    {},
    [1],
    {"a": 1},
    "x" * 1_000_000,
    "\ud800",
    "\x1b[2J\n",
    -1,
    2**70,
    1.5,
    True,
]
HOSTILE_TEXT = [
    "1" * 400,  # a 400-digit number
    "1e400",
    "-1e400",
    "NaN",
    "Infinity",
    '"\\ud800"',
    "[" * 100_000 + "]" * 100_000,
    '{"a": ' * 50_000 + "1" + "}" * 50_000,
]

json_docs = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=20,
)


def _check_loaded(path: Path, spec: StateFile[Any]) -> None:
    got = load(path, spec)
    if got.value is None:
        assert got.why and len(got.why) <= WHY_MAX and got.why.isprintable(), got.why[:300]
    else:  # what it accepted, it writes back and reads again the same
        assert spec.decode(spec.encode(got.value)) == got.value


def _versioned(spec: StateFile[Any], doc: Any) -> Any:
    if isinstance(doc, dict):
        return {spec.version_key: spec.version, **doc}
    return doc


@budget(60)
@given(st.sampled_from(sorted(SPECS)), json_docs, st.booleans())
@example("status", {"pid": [1]}, True)
@example("metrics", {"families": {"gpuguard_passes": [{"labels": [], "value": 1e308}]}}, True)
def test_every_loader_takes_any_json(name: str, doc: Any, versioned: bool) -> None:
    spec = SPECS[name]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "state.json"
        data = json.dumps(_versioned(spec, doc) if versioned else doc, allow_nan=True)
        path.write_text(data)
        _check_loaded(path, spec)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("text", HOSTILE_TEXT, ids=lambda t: t[:12])
def test_every_loader_refuses_hostile_json_text(name: str, text: str, tmp_path: Path) -> None:
    spec = SPECS[name]
    path = tmp_path / "state.json"
    path.write_text(text)
    assert load(path, spec).value is None
    _check_loaded(path, spec)
    # inside a document of the right version, where a field is
    path.write_text(f'{{"{spec.version_key}": {spec.version}, "x": {text}}}')
    _check_loaded(path, spec)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("kind", PLACEMENTS)
def test_every_loader_refuses_what_is_not_a_regular_file(
    name: str, kind: str, tmp_path: Path
) -> None:
    path = tmp_path / "state.json"
    place(path, kind)
    got = load(path, SPECS[name])
    assert got.value is None and (got.absent == (kind == "absent"))
    assert len(got.why) <= WHY_MAX and got.why.isprintable()


def _leaves(doc: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(doc, dict):
        return [at] + [p for k, v in doc.items() for p in _leaves(v, (*at, k))]
    if isinstance(doc, list):
        return [at] + [p for i, v in enumerate(doc) for p in _leaves(v, (*at, i))]
    return [at]


def _replaced(doc: Any, at: tuple[Any, ...], value: Any) -> Any:
    if not at:
        return value
    out = copy.deepcopy(doc)
    node = out
    for k in at[:-1]:
        node = node[k]
    node[at[-1]] = value
    return out


def _status_doc() -> dict[str, Any]:
    finding = {"kind": "container-device-denied", "summary": "lost /dev/nvidia0"}
    steps = {c.steps[0]: {"findings": [finding]} for c in CONDITIONS}
    return statusdoc.complete({"steps": steps, "last_pass": {"findings": [finding]}})


STATUS = _status_doc()
STATUS_LEAVES = _leaves(STATUS)


def _readers(root: Path) -> None:
    """Every reader of the status file, each clean; npd unknown when it is unusable."""
    r = str(root)
    inv = root / "inventory.json"
    inv.write_text('{"gpus": []}')
    usable = load(root / "run/gpuguard/status.json", STATUS_SPEC).value is not None
    for c in CONDITIONS:
        run = run_cli("npd", c.name, "--root", r)
        assert_clean(run, ["npd", c.name])
        assert run.code in (0, 1, 2) and run.out.count("\n") == 1 and len(run.out) <= 81
        if not usable:
            assert run.code == UNKNOWN, run.out
    for argv in (["status", "--inventory", str(inv)], ["status", "--json"], ["doctor"]):
        run = run_cli(*argv, "--root", r)
        assert_clean(run, argv)
        if argv[0] == "status" and not usable and "--json" not in argv:
            assert "UNKNOWN" in run.out.splitlines()[0]


@budget(40)
@given(st.sampled_from(STATUS_LEAVES), st.sampled_from(HOSTILE_VALUES))
@example(("steps",), [])
@example(("last_pass", "findings"), [{"kind": [1]}])
@example(("pid",), 2**70)
def test_status_file_readers_with_one_value_replaced(at: tuple[Any, ...], value: Any) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "proc/4242").mkdir(parents=True)
        f = root / "run/gpuguard/status.json"
        f.parent.mkdir(parents=True)
        f.write_text(json.dumps(_replaced(STATUS, at, value)))
        _readers(root)


@pytest.mark.parametrize("text", HOSTILE_TEXT, ids=lambda t: t[:12])
def test_status_file_readers_with_hostile_json_text(text: str, tmp_path: Path) -> None:
    f = tmp_path / "run/gpuguard/status.json"
    f.parent.mkdir(parents=True)
    f.write_text(text)
    _readers(tmp_path)


def _metrics_doc() -> dict[str, Any]:
    from gpuguard.reporting.metrics_state import MetricsState

    return json.loads(metrics_file.SPEC.encode(MetricsState().to_values()))


METRICS = _metrics_doc()


def _scrape(root: Path) -> tuple[int, bytes]:
    from gpuguard.reporting.metrics import render_file
    from gpuguard.reporting.metrics_http import listen, make_server

    server = make_server(listen("127.0.0.1:0"), root / "run/gpuguard/metrics.json", render_file)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
    finally:
        server.shutdown()
        server.server_close()


@budget(25)
@given(st.sampled_from(_leaves(METRICS)), st.sampled_from(HOSTILE_VALUES))
@example(("families",), [])
@example(("families", "gpuguard_passes", 0, "value"), 2**70)
def test_metrics_readers_with_one_value_replaced(at: tuple[Any, ...], value: Any) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        f = root / "run/gpuguard/metrics.json"
        f.parent.mkdir(parents=True)
        f.write_text(json.dumps(_replaced(METRICS, at, value)))
        run = run_cli("metrics", "--root", d)
        assert_clean(run, ["metrics"])
        assert run.code in (0, 3)
        code, body = _scrape(root)  # every scrape answered: 200 or a one-line 503
        assert code == 200 or (code == 503 and body.count(b"\n") == 1 and len(body) <= 520)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "link-dev-zero", "huge", "directory"])
def test_status_and_metrics_readers_as_processes_never_wait(kind: str, tmp_path: Path) -> None:
    """A FIFO or /dev/zero in place of the files, through the installed entry point: no
    hang (the timeout fails the test), no traceback, npd says unknown."""
    for name in ("status.json", "metrics.json"):
        place(tmp_path / "run/gpuguard" / name, kind)
    inv = tmp_path / "inventory.json"
    inv.write_text('{"gpus": []}')
    env = {"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"}
    for args, codes in (
        (["npd", "gpu-count"], {UNKNOWN}),
        (["status", "--inventory", str(inv)], {0}),
        (["metrics"], {3}),
        (["doctor", "--inventory", "/nonexistent"], {0, 1, 4}),
    ):
        p = subprocess.run(
            [sys.executable, "-m", "gpuguard", *args, "--root", str(tmp_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert_clean(Run(p.returncode, p.stdout, p.stderr), args)
        assert p.returncode in codes, (args, p.returncode, p.stdout, p.stderr)
    code, body = _scrape(tmp_path)
    assert code == 503 and body.count(b"\n") == 1
