"""Where a runtime puts a container's process (devices/containers.py, cgrouptree.py):
runc in its scope, crun in SCOPE/container (both hierarchies on a hybrid host); a scope
whose processes are nowhere gpuguard looks is a container it cannot audit, never one
left out; the kubepods directories that are no container are the walk's strays."""

from __future__ import annotations

from pathlib import Path

from gpuguard.devices.cgrouptree import SUB_DEPTH, find_processes
from gpuguard.devices.containers import (
    CgroupLayout,
    discover_kubepods,
    find_scope,
    with_fresh_pids,
)
from gpuguard.host.paths import Root
from unit.test_devices_containers import CID1, CID2, UID_, _cg, _proc

POD = f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice"
HYBRID = CgroupLayout("/sys/fs/cgroup/devices", "/sys/fs/cgroup/unified")
UNIFIED = CgroupLayout(None, "/sys/fs/cgroup")


def test_crun_process_in_scope_container_is_found_on_both_hierarchies(tmp_path: Path) -> None:
    v1, v2 = tmp_path / "sys/fs/cgroup/devices", tmp_path / "sys/fs/cgroup/unified"
    scope = f"{POD}/cri-containerd-{CID1}.scope"
    for h in (v1, v2):
        _cg(h, scope)  # crun leaves the scope itself empty
        _cg(h, f"{scope}/container", (200,))
        _cg(h, f"{POD}/cri-containerd-{CID2}.scope", (300,))  # runc: in the scope
    _proc(tmp_path, 200, "/bin/busybox")
    _proc(tmp_path, 300, "/bin/busybox")
    (crun, runc), _strays = discover_kubepods(Root(tmp_path), HYBRID)
    assert crun.container_id == CID1 and crun.pids == (200,)
    assert crun.cgroup_v2 == v2 / scope and crun.process_v2 == v2 / scope / "container"
    assert crun.cgroup_v1_devices == v1 / scope
    assert crun.process_v1 == v1 / scope / "container"
    assert crun.v2_dir == v2 / scope / "container" and crun.v1_dir == v1 / scope / "container"
    assert not crun.problem
    assert runc.process_v2 is None and runc.process_v1 is None and runc.pids == (300,)
    assert runc.v2_dir == runc.cgroup_v2 and runc.v1_dir == runc.cgroup_v1_devices


def test_a_new_scope_is_followed_when_its_process_moves_below_it(tmp_path: Path) -> None:
    """crun's init starts in the scope and moves into SCOPE/container: a retry of the
    new-scope path finds it there."""
    v2 = tmp_path / "sys/fs/cgroup"
    scope = _cg(v2, f"{POD}/cri-containerd-{CID1}.scope", (200,))
    _proc(tmp_path, 200, "crun")
    c = find_scope(Root(tmp_path), f"cri-containerd-{CID1}.scope", UNIFIED)
    assert c is not None and c.process_v2 is None and c.pids == (200,)
    (scope / "cgroup.procs").write_text("")
    _cg(scope, "container", (201,))
    _proc(tmp_path, 201, "/bin/busybox")
    again = with_fresh_pids(Root(tmp_path), c)
    assert again is not None and again.pids == (201,) and again.process_v2 == scope / "container"


def test_processes_deeper_than_gpuguard_looks_make_the_container_unauditable(
    tmp_path: Path,
) -> None:
    """cgroup.events says the scope holds processes, none is within SUB_DEPTH levels:
    a `problem` (container-unreadable, with the path), never a silent empty scope."""
    v2 = tmp_path / "sys/fs/cgroup"
    scope = _cg(v2, f"{POD}/cri-containerd-{CID1}.scope")
    deep = scope
    for i in range(SUB_DEPTH + 1):
        deep = _cg(deep, f"level{i}")
    (deep / "cgroup.procs").write_text("400\n")
    (scope / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    (c,), _ = discover_kubepods(Root(tmp_path), UNIFIED)
    assert c.pids == () and str(scope) in c.problem and "populated 1" in c.problem
    # an empty scope (no process yet, or gone) is no problem
    (scope / "cgroup.events").write_text("populated 0\nfrozen 0\n")
    (c,), _ = discover_kubepods(Root(tmp_path), UNIFIED)
    assert c.pids == () and c.problem == ""


def test_find_processes_is_breadth_first_and_bounded(tmp_path: Path) -> None:
    top = _cg(tmp_path, "scope")
    _cg(top, "a/deeper", (1,))
    _cg(top, "b", (2,))
    assert find_processes(top) == (top / "b", (2,))
    assert find_processes(_cg(tmp_path, "empty")) == (None, ())


def test_strays_are_every_kubepods_directory_that_is_no_container(tmp_path: Path) -> None:
    v2 = tmp_path / "sys/fs/cgroup"
    _cg(v2, f"{POD}/cri-containerd-{CID1}.scope", (200,))
    _cg(v2, f"{POD}/crio-conmon-{CID2}.scope", (201,))  # cri-o's monitor
    _cg(v2, f"{POD}/somert-{CID2}.scope", (202,))  # a runtime gpuguard does not know
    _cg(v2, "kubepods.slice/odd.slice", (203,))
    _proc(tmp_path, 200, "/bin/busybox")
    (c,), strays = discover_kubepods(Root(tmp_path), UNIFIED)
    assert c.container_id == CID1
    rel = {str(p.relative_to(v2)) for p in strays}
    assert rel == {
        "kubepods.slice",
        "kubepods.slice/kubepods-besteffort.slice",
        POD,
        f"{POD}/crio-conmon-{CID2}.scope",
        f"{POD}/somert-{CID2}.scope",
        "kubepods.slice/odd.slice",
    }


def test_a_stray_whose_processes_hold_nvidia_nodes_is_a_finding(tmp_path: Path) -> None:
    from gpuguard.steps.container_access.observe import gpu_strays
    from gpuguard.steps.container_access.reconcile import FINDING_UNATTRIBUTED, stray_findings

    v2 = tmp_path / "sys/fs/cgroup"
    gpu = _cg(v2, f"{POD}/somert-{CID2}.scope", (202, 205))
    quiet = _cg(v2, f"{POD}/crio-conmon-{CID2}.scope", (203,))
    for pid, target in ((202, "/dev/nvidia0"), (202, "/dev/nvidiactl"), (203, "/dev/null")):
        fd = tmp_path / f"proc/{pid}/fd"
        fd.mkdir(parents=True, exist_ok=True)
        (fd / str(len(list(fd.iterdir())) + 3)).symlink_to(target)
    # 205 is gone (no /proc entry): nothing to say of it
    got = gpu_strays(Root(tmp_path), [gpu, quiet])
    assert got == ((str(gpu), (202,), ("/dev/nvidia0", "/dev/nvidiactl")),)
    (f,) = stray_findings(got)
    assert f.kind == FINDING_UNATTRIBUTED and str(gpu) in f.summary
    assert f.fields == {"CGROUP": str(gpu), "PIDS": "202", "DEVICE": "/dev/nvidia0,/dev/nvidiactl"}


def test_a_containers_own_process_is_never_a_stray(tmp_path: Path) -> None:
    """systemd 252/257 on a hybrid host may leave a container's process in its pod
    slice's v1 devices cgroup; its cgroup2 scope says whose it is: no finding. Strays
    are taken from cgroup2 where it is mounted."""
    from gpuguard.steps.container_access.observe import gpu_strays

    v1, v2 = tmp_path / "sys/fs/cgroup/devices", tmp_path / "sys/fs/cgroup/unified"
    scope = f"{POD}/cri-containerd-{CID1}.scope"
    _cg(v2, scope, (200,))
    _cg(v1, scope)
    _cg(v1, POD, (200,))  # left in the pod slice's v1 devices cgroup
    _proc(tmp_path, 200, "/bin/busybox")
    fd = tmp_path / "proc/200/fd"
    fd.mkdir(parents=True)
    (fd / "3").symlink_to("/dev/nvidia0")
    (c,), strays = discover_kubepods(Root(tmp_path), HYBRID)
    assert all(v2 in p.parents or p == v2 for p in strays), strays
    assert gpu_strays(Root(tmp_path), [v1 / POD], set(c.pids)) == ()
