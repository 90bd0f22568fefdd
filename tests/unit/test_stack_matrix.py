"""The support matrix, the F1 matrix (docs/support-matrix.md) and docs/devices.md's reload table are
what the committed stack results (docs/stack-matrix.json) render, and those results
cover every cell the stack test runs (tests/integration/test_stacks_f2.py) and every
run of the real-kubelet F1 test (tests/integration/test_kubelet_f1.py)."""

from __future__ import annotations

import copy

import stack_matrix
from integration.stacks.scenario import RUNTIMES
from integration.test_kubelet_f1 import runs
from integration.test_stacks_f2 import EXPECTED, STACKS


def f2_cells() -> list:  # type: ignore[type-arg]
    return [c for c in stack_matrix.load() if stack_matrix.scenario(c) == "f2"]


def f1_cells() -> list:  # type: ignore[type-arg]
    return [c for c in stack_matrix.load() if stack_matrix.scenario(c) == "f1"]


def test_tables_match_the_committed_results() -> None:
    assert stack_matrix.stale(stack_matrix.load()) == [], "run scripts/stack-matrix"


def test_results_cover_every_cell() -> None:
    have = {(c["suite"], c["layout"], c["runtime"]) for c in f2_cells()}
    want = {(s, layout, rt) for s, layout in STACKS for rt in RUNTIMES}
    assert have == want


def test_results_agree_with_what_the_test_expects() -> None:
    for c in f2_cells():
        want = EXPECTED.get((c["suite"], c["layout"], c["runtime"]))
        if want is None:
            assert c["result"] == "pass", c
        elif isinstance(want, tuple):
            assert c["result"] == "not run", c
        else:
            assert c["result"] == "fail" and c["known"] == want, c


def test_f1_results_cover_every_run_and_pass() -> None:
    have = {(c["stack"], c["layout"], c["case"], c["gpuguard"]) for c in f1_cells()}
    want = {(p.values[0], "v1", p.values[1], mode) for mode in ("none", "yes") for p in runs(mode)}
    assert have == want
    for c in f1_cells():
        assert c["result"] == "pass", c
        kubelet = "1.34.9" if c["stack"].endswith("-1.34") else "1.20.2"
        assert c["versions"]["kubelet"].startswith(kubelet), c
        expected_back = 1 if (c["gpuguard"], c["case"]) == ("yes", "gone") else 2
        if c["gpuguard"] == "yes":
            assert c["pods_back"] == expected_back and c["seconds"] is not None, c


def test_every_f1_stack_has_its_row() -> None:
    table = stack_matrix.render_f1(f1_cells())
    for stack in {c["stack"] for c in f1_cells()}:
        assert f"[{stack}-*]" in table, table


def test_a_changed_count_makes_the_table_stale() -> None:
    cells = copy.deepcopy(stack_matrix.load())
    next(c for c in cells if stack_matrix.scenario(c) == "f2")["losses"] += 1
    assert stack_matrix.stale(cells), "the check would not notice a changed result"


def test_a_changed_f1_result_makes_the_table_stale() -> None:
    cells = copy.deepcopy(stack_matrix.load())
    next(c for c in cells if stack_matrix.scenario(c) == "f1")["pods_back"] -= 1
    assert stack_matrix.stale(cells), "the check would not notice a changed F1 result"
