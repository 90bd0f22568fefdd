"""`gpuguard status`'s rows, its node summary and the fast paths' figures are frozen
dataclasses inside the process; JSON only where they leave it (`to_json()`), in the
documented key order, and the daemon's own model of its fast paths is the one the
status file's reader builds from that JSON."""

from __future__ import annotations

from gpuguard.reporting.container_row import ContainerRow
from gpuguard.reporting.status_figures import FastPaths, ReloadFigures
from gpuguard.reporting.summary import summarize
from gpuguard.steps.container_access import ContainerAccessStep
from gpuguard.steps.container_access.durable import ReloadRepair

WHO = ["pod_uid", "container_id", "unit", "driver", "layout", "mechanism"]


def test_a_rows_json_keeps_its_keys_order_and_an_unreadable_row_lists_no_stale() -> None:
    row = ContainerRow("u", "c" * 64, None, "cgroupfs", "v1", "v1-rule", "denied",
                       nodes=("/dev/nvidia0",), denied=("/dev/nvidia0",), stale=())  # fmt: skip
    lists = ["nodes", "missing", "denied", "unknown"]
    assert list(row.to_json()) == [*WHO, *lists, "stale", "access", "problems", "pod"]
    assert row.to_json()["denied"] == ["/dev/nvidia0"] and row.to_json()["unit"] is None
    unread = ContainerRow("u", "d" * 64, "s.scope", "systemd", "v2", "own-program",
                          "unreadable", problems=("cgroup.procs: not a pid",))  # fmt: skip
    assert list(unread.to_json()) == [*WHO, *lists, "access", "problems", "pod"]


def test_the_summary_counts_the_typed_rows() -> None:
    denied = ContainerRow("u", "c" * 64, None, "cgroupfs", "v1", "v1-rule", "denied")
    unread = ContainerRow("u", "d" * 64, None, "cgroupfs", "v1", "v1-rule", "unreadable")
    s = summarize(None, "no status", [denied, unread])
    assert s.verdict == "problem"
    assert s.problems == ("1 GPU container(s) denied their devices now",)
    assert s.unknown == ("no status", "1 GPU container(s) could not be read now")
    assert list(s.to_json()) == [
        "verdict", "problems", "unknown", "last_pass", "repairs_last_hour",
        "repairs_by_kind", "last_reload", "rejected_pods",
    ]  # fmt: skip


def test_the_fast_paths_model_is_the_one_read_back_from_its_json() -> None:
    step = ContainerAccessStep(clock=lambda: 5.0)
    step.state.last_reload = ReloadRepair(
        signal=10, first_write=10.5, last_write=11, containers=2, checked=3, cpu_ms=0
    )
    fast = step.fast_status()
    assert isinstance(fast, FastPaths) and isinstance(fast.reload, ReloadFigures)
    assert fast == FastPaths.parse(fast.to_json(), "fast_paths")
    assert fast.reload.signal == 10.0 and isinstance(fast.reload.cpu_ms, float)
