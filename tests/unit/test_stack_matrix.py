"""The README's support matrix and docs/devices.md's reload table are what the committed
stack results (docs/stack-matrix.json) render, and those results cover every cell the
stack test runs (tests/integration/test_stacks_f2.py)."""

from __future__ import annotations

import copy

import stack_matrix
from integration.stacks.scenario import RUNTIMES
from integration.test_stacks_f2 import EXPECTED, STACKS


def test_tables_match_the_committed_results() -> None:
    assert stack_matrix.stale(stack_matrix.load()) == [], "run scripts/stack-matrix"


def test_results_cover_every_cell() -> None:
    have = {(c["suite"], c["layout"], c["runtime"]) for c in stack_matrix.load()}
    want = {(s, layout, rt) for s, layout in STACKS for rt in RUNTIMES}
    assert have == want


def test_results_agree_with_what_the_test_expects() -> None:
    for c in stack_matrix.load():
        want = EXPECTED.get((c["suite"], c["layout"], c["runtime"]))
        if want is None:
            assert c["result"] == "pass", c
        elif isinstance(want, tuple):
            assert c["result"] == "not run", c
        else:
            assert c["result"] == "fail" and c["known"] == want, c


def test_a_changed_count_makes_the_table_stale() -> None:
    cells = copy.deepcopy(stack_matrix.load())
    cells[0]["losses"] += 1
    assert stack_matrix.stale(cells), "the check would not notice a changed result"
