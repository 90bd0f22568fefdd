"""Kubernetes cgroup name patterns live in one module (devices/cgroupnames.py)."""

from __future__ import annotations

import re
from pathlib import Path

from gpuguard.devices import cgroupnames as n
from gpuguard.devices.processes import classify_cgroup

SRC = Path(__file__).resolve().parents[2] / "src" / "gpuguard"
CID = "a" * 64
# a regex literal naming a runtime's scope prefix or the kubepods tree
_PATTERN = re.compile(r"""re\.compile\(\s*r?f?["'][^"']*(cri-containerd|crio|kubepods)""")


def test_no_other_module_holds_a_cgroup_name_pattern() -> None:
    holders = [
        str(p.relative_to(SRC))
        for p in sorted(SRC.rglob("*.py"))
        if _PATTERN.search(p.read_text()) and p.name != "cgroupnames.py"
    ]
    assert holders == []
    assert _PATTERN.search((SRC / "devices/cgroupnames.py").read_text())


def test_every_runtime_prefix_in_every_container_pattern() -> None:
    for prefix, runtime in n.RUNTIME.items():
        scope = f"{prefix}-{CID}.scope"
        assert n.SYSTEMD_CONTAINER.match(scope)
        assert n.ANY_CONTAINER_SCOPE.match(scope)
        assert n.ANY_CONTAINER_SCOPE.match(f"{prefix}-{CID[:12]}.scope")
        assert not n.SYSTEMD_CONTAINER.match(f"{prefix}-{CID[:12]}.scope")
        assert n.CGROUPFS_CONTAINER.match(f"{prefix}-{CID}")
        path = f"/kubepods.slice/kubepods-pod1_2.slice/{scope}"
        assert classify_cgroup(path) == ("container", CID, runtime, "1-2", "")
    assert not n.ANY_CONTAINER_SCOPE.match(f"crio-conmon-{CID}.scope")


def test_proc_cgroup_is_parsed_once_for_both_readers() -> None:
    """/proc/PID/cgroup: the device plugin's process classification and the probes'
    cgroup directories read it through n.parse_proc_cgroup, one controller per name."""
    text = (
        "12:devices:/kubepods/besteffort/podx/abc\n"
        "5:cpu,cpuacct:/kubepods/besteffort/podx/abc\n"
        "1:name=systemd:/system.slice/x.service\n"
        "garbage line\n"
        "0::/kubepods.slice/y.scope\n"
        "3:devices:/second/devices/line\n"
    )
    assert n.parse_proc_cgroup(text) == {
        "devices": "/kubepods/besteffort/podx/abc",
        "cpu": "/kubepods/besteffort/podx/abc",
        "cpuacct": "/kubepods/besteffort/podx/abc",
        "name=systemd": "/system.slice/x.service",
        "": "/kubepods.slice/y.scope",
    }
    readers = [
        str(p.relative_to(SRC))
        for p in sorted(SRC.rglob("*.py"))
        if 'f"/proc/{pid}/cgroup"' in p.read_text()
    ]
    assert readers == ["devices/cgroupchild.py", "devices/processes.py"]
    assert all("parse_proc_cgroup(" in (SRC / r).read_text() for r in readers)
