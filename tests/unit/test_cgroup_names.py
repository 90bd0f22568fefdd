"""Kubernetes cgroup name patterns live in one module (devices/cgroupnames.py)."""

from __future__ import annotations

import re
from pathlib import Path

from gpuguard.devices import cgroupnames as n
from gpuguard.steps.device_plugin.processes import classify_cgroup

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
