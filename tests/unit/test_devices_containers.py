"""containers.py: kubepods trees for both drivers, both cgroup versions, odd names."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

from gpuguard.devices.containers import (
    CgroupLayout,
    ContainerCgroup,
    detect_layout,
    discover_containers,
)
from gpuguard.host.paths import Root

CID1 = "90d6d4dbe64f821d43e4ef954808089d3f2f63af3fc9824d2c1e719768cd7d18"
CID2 = "a" * 64
PAUSE = "b" * 64
UID = "0dbd65af-6693-11eb-994b-246e9634b5c8"
UID_ = UID.replace("-", "_")

HYBRID_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
UNIFIED_MOUNTINFO = (
    "35 24 0:30 / /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"
)


def _cg(base: Path, rel: str, pids: tuple[int, ...] = ()) -> Path:
    d = base / rel
    d.mkdir(parents=True, exist_ok=True)
    (d / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    return d


def _proc(root: Path, pid: int, argv0: str) -> None:
    (root / f"proc/{pid}").mkdir(parents=True, exist_ok=True)
    (root / f"proc/{pid}/cmdline").write_bytes(argv0.encode() + b"\0")


@pytest.mark.parametrize(
    ("mountinfo", "files", "expected"),
    [
        (HYBRID_MOUNTINFO, [], CgroupLayout("/sys/fs/cgroup/devices", "/sys/fs/cgroup/unified")),
        (UNIFIED_MOUNTINFO, [], CgroupLayout(None, "/sys/fs/cgroup")),
        (None, ["sys/fs/cgroup/cgroup.controllers"], CgroupLayout(None, "/sys/fs/cgroup")),
        (
            None,
            ["sys/fs/cgroup/devices/devices.list", "sys/fs/cgroup/unified/cgroup.controllers"],
            CgroupLayout("/sys/fs/cgroup/devices", "/sys/fs/cgroup/unified"),
        ),
        (
            None,
            ["sys/fs/cgroup/devices/devices.list"],
            CgroupLayout("/sys/fs/cgroup/devices", None),
        ),
        (None, [], CgroupLayout(None, None)),
    ],
)
def test_detect_layout(
    tmp_path: Path, mountinfo: str | None, files: list[str], expected: CgroupLayout
) -> None:
    if mountinfo is not None:
        (tmp_path / "proc/self").mkdir(parents=True)
        (tmp_path / "proc/self/mountinfo").write_text(mountinfo)
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    assert detect_layout(Root(tmp_path)) == expected


def test_layout_kind() -> None:
    assert CgroupLayout("a", "b").kind == "hybrid"
    assert CgroupLayout(None, "b").kind == "unified"
    assert CgroupLayout("a", None).kind == "legacy"
    assert CgroupLayout(None, None).kind == "none"


def test_hybrid_systemd(tmp_path: Path) -> None:
    v1 = tmp_path / "sys/fs/cgroup/devices"
    v2 = tmp_path / "sys/fs/cgroup/unified"
    pod = f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice"
    _cg(v1, f"{pod}/cri-containerd-{CID1}.scope", (100,))
    _cg(v2, f"{pod}/cri-containerd-{CID1}.scope", (100,))
    _cg(v1, f"{pod}/cri-containerd-{PAUSE}.scope", (99,))
    _cg(v2, f"{pod}/cri-containerd-{PAUSE}.scope", (99,))
    _cg(v1, f"{pod}/crio-conmon-{CID2}.scope", (98,))  # cri-o's monitor: skipped
    _proc(tmp_path, 99, "/pause")
    _proc(tmp_path, 100, "/usr/bin/python3")
    layout = CgroupLayout("/sys/fs/cgroup/devices", "/sys/fs/cgroup/unified")
    got = discover_containers(Root(tmp_path), layout)
    assert got == (
        ContainerCgroup(
            pod_uid=UID,
            container_id=CID1,
            runtime="containerd",
            driver="systemd",
            cgroup_v1_devices=v1 / pod / f"cri-containerd-{CID1}.scope",
            cgroup_v2=v2 / pod / f"cri-containerd-{CID1}.scope",
            unit=f"cri-containerd-{CID1}.scope",
            pids=(100,),
        ),
    )
    with_pause = discover_containers(Root(tmp_path), layout, skip_pause=False)
    assert {c.container_id for c in with_pause} == {CID1, PAUSE}


@pytest.mark.parametrize(
    ("pod_rel", "scope", "runtime"),
    [
        (f"kubepods.slice/kubepods-pod{UID_}.slice", f"crio-{CID2}.scope", "cri-o"),
        (
            f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice",
            f"docker-{CID2}.scope",
            "docker",
        ),
        (
            f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice",
            f"cri-containerd-{CID2}.scope",
            "containerd",
        ),
    ],
)
def test_unified_systemd_variants(tmp_path: Path, pod_rel: str, scope: str, runtime: str) -> None:
    base = tmp_path / "sys/fs/cgroup"
    _cg(base, f"{pod_rel}/{scope}", (5,))
    (got,) = discover_containers(Root(tmp_path), CgroupLayout(None, "/sys/fs/cgroup"))
    assert (got.pod_uid, got.container_id, got.runtime, got.driver, got.unit) == (
        UID,
        CID2,
        runtime,
        "systemd",
        scope,
    )
    assert got.cgroup_v1_devices is None
    assert got.cgroup_v2 == base / pod_rel / scope


@pytest.mark.parametrize(
    ("rel", "runtime"),
    [
        (f"kubepods/burstable/pod{UID}/{CID1}", "unknown"),
        (f"kubepods/pod{UID}/{CID1}", "unknown"),
        (f"kubepods/besteffort/pod{UID}/crio-{CID1}", "cri-o"),
    ],
)
def test_v1_cgroupfs(tmp_path: Path, rel: str, runtime: str) -> None:
    v1 = tmp_path / "sys/fs/cgroup/devices"
    _cg(v1, rel, (7, 8))
    (got,) = discover_containers(Root(tmp_path), CgroupLayout("/sys/fs/cgroup/devices", None))
    assert (got.pod_uid, got.container_id, got.runtime, got.driver, got.unit, got.pids) == (
        UID,
        CID1,
        runtime,
        "cgroupfs",
        None,
        (7, 8),
    )
    assert got.cgroup_v1_devices == v1 / rel


def test_cgroup_root_and_static_pod_uid(tmp_path: Path) -> None:
    v1 = tmp_path / "sys/fs/cgroup/devices"
    static_uid = "6a2b6f5d3a0f4f0e9b7c1d2e3f405162"  # static pods: a hash, no dashes
    _cg(v1, f"kube/kubepods/pod{static_uid}/{CID1}")
    _cg(v1, f"kubepods/pod{UID}/{CID2}")  # outside the cgroup root: not ours
    got = discover_containers(
        Root(tmp_path), CgroupLayout("/sys/fs/cgroup/devices", None), cgroup_root="/kube"
    )
    assert [(c.pod_uid, c.container_id) for c in got] == [(static_uid, CID1)]


def test_odd_names_are_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    v1 = tmp_path / "sys/fs/cgroup/devices"
    pod = v1 / f"kubepods/burstable/pod{UID}"
    _cg(pod, CID1)
    for odd in (
        "not-a-container",
        "Ünïcødé-" + "a" * 56,
        "A" * 64,  # upper-case hex: not what runtimes write
        CID1 + "x",
        "cri-containerd-" + CID2 + ".scope.bak",
    ):
        _cg(pod, odd)
    os.mkdir(os.fsencode(pod) + b"/\xff\xfe-undecodable")
    (pod / ("f" * 64)).write_text("a file, not a cgroup")
    _cg(v1, "kubepods/burstable/podNOT-HEX/" + CID2)
    _cg(v1, "kubepods/weird-qos/pod" + UID + "/" + CID2)
    deep = v1 / f"kubepods/pod{UID}/{CID2}"
    _cg(deep, "/".join(["x"] * 60))  # a very deep tree below a container: never walked
    (v1 / "kubepods.slice").write_text("a file where a slice should be")
    with caplog.at_level(logging.DEBUG, logger="gpuguard.devices.containers"):
        got = discover_containers(Root(tmp_path), CgroupLayout("/sys/fs/cgroup/devices", None))
    assert sorted(c.container_id for c in got) == sorted([CID1, CID2])
    assert "not a container directory" in caplog.text
    assert "not a pod or QoS directory" in caplog.text


def test_vanishing_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod deleted between listing its parent and reading it (ENOENT) is skipped."""
    v2 = tmp_path / "sys/fs/cgroup"
    _cg(v2, f"kubepods/pod{UID}/{CID1}", (1,))
    _cg(v2, f"kubepods/burstable/pod{UID}/{CID2}", (2,))
    real_scandir = os.scandir

    def racing_scandir(path: Path) -> Any:
        if str(path).endswith("burstable"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", racing_scandir)
    got = discover_containers(Root(tmp_path), CgroupLayout(None, "/sys/fs/cgroup"))
    assert [c.container_id for c in got] == [CID1]


def test_vanished_procs_file(tmp_path: Path) -> None:
    v2 = tmp_path / "sys/fs/cgroup"
    d = _cg(v2, f"kubepods/pod{UID}/{CID1}")
    (d / "cgroup.procs").unlink()
    (got,) = discover_containers(Root(tmp_path), CgroupLayout(None, "/sys/fs/cgroup"))
    assert got.pids == ()


def test_nothing_mounted(tmp_path: Path) -> None:
    assert discover_containers(Root(tmp_path)) == ()


@pytest.mark.parametrize("suffix", ["\n", "\x1b[0m", "\u2028", "\t"])
def test_names_are_matched_whole_and_control_characters_refused(
    tmp_path: Path, suffix: str
) -> None:
    from gpuguard.devices.cgroupnames import ANY_CONTAINER_SCOPE, SYSTEMD_CONTAINER

    scope = f"cri-containerd-{CID2}.scope"
    assert SYSTEMD_CONTAINER.fullmatch(scope) and not SYSTEMD_CONTAINER.fullmatch(scope + suffix)
    assert not ANY_CONTAINER_SCOPE.fullmatch(scope + suffix)
    v2 = tmp_path / "sys/fs/cgroup"
    pod = f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice"
    _cg(v2, f"{pod}/cri-containerd-{CID1}.scope", (7,))
    _cg(v2, f"{pod}/{scope}{suffix}", (8,))
    got = discover_containers(Root(tmp_path), CgroupLayout(None, "/sys/fs/cgroup"))
    assert [c.container_id for c in got if not c.problem] == [CID1]
    (refused,) = [c for c in got if c.problem]
    assert refused.container_id.startswith("refused:") and refused.pids == ()
    assert refused.cgroup_v2 is None and refused.unit is None  # nothing to grant or make
    assert "control character" in refused.problem and refused.problem.isprintable()
