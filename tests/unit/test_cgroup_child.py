"""devices/cgroupchild.py, the fork-join-report skeleton of both probes, without a
cgroup: what the child's work returns comes back, each way it can fail is a report (a
cgroup it cannot join, work that raises, a child that never answers), and every child
is reaped. The kernel's verdicts through it are tests/integration's (probe_open in
test_devices_cgroup_v1.py, test_bpf_inplace.py ...; probe_nvml in
test_plugin_nvml_probe.py)."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

from gpuguard.devices import cgroupchild
from gpuguard.devices.cgroupchild import MAX_REPORT, process_cgroup_dirs, run_in_cgroups
from gpuguard.host.paths import Root


def _children() -> list[str]:
    try:
        return Path(f"/proc/self/task/{os.getpid()}/children").read_text().split()
    except OSError:
        return []


def test_the_work_runs_in_the_child_and_its_bytes_come_back() -> None:
    before = _children()
    r = run_in_cgroups([], lambda: str(os.getpid()).encode(), timeout=10)
    assert r.status == cgroupchild.DONE
    assert int(r.data) != os.getpid()  # the child's pid, not ours
    assert _children() == before


def test_a_report_is_capped_and_still_whole() -> None:
    r = run_in_cgroups([], lambda: b"x" * (MAX_REPORT * 2), timeout=10)
    assert (r.status, len(r.data)) == (cgroupchild.DONE, MAX_REPORT)


def test_a_cgroup_it_cannot_join_is_named_and_the_work_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    def work() -> bytes:
        marker.write_text("ran")
        return b""

    r = run_in_cgroups([tmp_path / "no-such-cgroup"], work, timeout=10)
    assert r.status == cgroupchild.JOIN and r.errno == errno.ENOENT
    assert r.text == str(tmp_path / "no-such-cgroup/cgroup.procs")
    assert not marker.exists()


def test_work_that_raises_is_a_report() -> None:
    def work() -> bytes:
        raise RuntimeError("no such library")

    r = run_in_cgroups([], work, timeout=10)
    assert r.status == cgroupchild.ERROR and "no such library" in r.text


def test_a_child_that_never_answers_is_killed_and_reaped() -> None:
    def never() -> bytes:
        time.sleep(3600)  # a driver call that never returns
        return b"never"

    before = _children()
    t0 = time.monotonic()
    r = run_in_cgroups([], never, timeout=0.3)
    assert r.status == cgroupchild.TIMEOUT and r.data == b""
    assert time.monotonic() - t0 < 5
    assert _children() == before


def test_a_fifo_in_place_of_cgroup_procs_is_refused_at_once(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "cgroup.procs")  # opening it for writing would block forever
    t0 = time.monotonic()
    r = run_in_cgroups([tmp_path], lambda: b"never", timeout=30)
    assert r.status == cgroupchild.JOIN and r.errno == errno.ENXIO
    assert time.monotonic() - t0 < 5


def test_process_cgroup_dirs_v1_devices_and_v2(tmp_path: Path) -> None:
    (tmp_path / "proc/88").mkdir(parents=True)
    (tmp_path / "proc/88/cgroup").write_text(
        "12:devices:/kubepods/besteffort/podx/abc\n"
        "5:memory:/kubepods/besteffort/podx/abc\n"
        "0::/kubepods/besteffort/podx/abc\n"
    )
    v1 = tmp_path / "sys/fs/cgroup/devices/kubepods/besteffort/podx/abc"
    v2 = tmp_path / "sys/fs/cgroup/unified/kubepods/besteffort/podx/abc"
    v1.mkdir(parents=True)
    v2.mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/devices/devices.list").write_text("a *:* rwm\n")
    (tmp_path / "sys/fs/cgroup/unified/cgroup.controllers").write_text("")
    assert process_cgroup_dirs(Root(tmp_path), 88) == [v1, v2]
    assert process_cgroup_dirs(Root(tmp_path), 99) == []
    v2.rmdir()  # a directory that is gone is not offered
    assert process_cgroup_dirs(Root(tmp_path), 88) == [v1]
