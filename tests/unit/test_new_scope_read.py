"""A new scope's read, on fake roots: the scope found in its pod slice without a walk,
and its container judged only once its process has left the runtime's init and sees a
/dev of its own (before that it sees the host's, with every GPU)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuguard.devices.containers import CgroupLayout, find_scope, with_fresh_pids
from gpuguard.devices.entitlement import own_dev_pending
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.host.paths import Root
from gpuguard.steps.container_access.newscope import PodDeviceIds, read_new_scope

CID = "c" * 64
UNIT = f"cri-containerd-{CID}.scope"
UID = "0dbd65af-6693-11eb-994b-246e9634b5c8"
POD = f"kubepods-besteffort-pod{UID.replace('-', '_')}.slice"
V1 = CgroupLayout("/sys/fs/cgroup/devices", None)


def _scope(root: Path, pids: tuple[int, ...], unit: str = UNIT) -> Path:
    d = root / "sys/fs/cgroup/devices/kubepods.slice/kubepods-besteffort.slice" / POD / unit
    d.mkdir(parents=True, exist_ok=True)
    (d / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    (root / "sys/fs/cgroup/devices/devices.list").write_text("a *:* rwm\n")
    return d


def _process(root: Path, pid: int, comm: str, *, own_dev: bool) -> None:
    proc = root / f"proc/{pid}"
    proc.mkdir(parents=True)
    (proc / "comm").write_text(comm + "\n")
    (proc / "cmdline").write_bytes(comm.encode() + b"\0")
    (root / "dev").mkdir(exist_ok=True)
    if own_dev:
        (proc / "root/dev").mkdir(parents=True)
    else:  # still in the host's root, as `runc init` is before it switches
        os.symlink(root, proc / "root")


def test_the_scope_is_found_in_its_pod_slice(tmp_path: Path) -> None:
    d = _scope(tmp_path, (42,))
    _scope(tmp_path, (43,), unit=f"cri-containerd-{'d' * 64}.scope")
    c = find_scope(Root(tmp_path), UNIT, V1)
    assert c is not None
    assert (c.pod_uid, c.container_id, c.unit, c.pids) == (UID, CID, UNIT, (42,))
    assert c.cgroup_v1_devices == d and c.driver == "systemd"
    assert find_scope(Root(tmp_path), f"cri-containerd-{'e' * 64}.scope", V1) is None
    assert find_scope(Root(tmp_path), "session-3.scope", V1) is None


def test_fresh_pids_and_a_gone_scope(tmp_path: Path) -> None:
    d = _scope(tmp_path, ())
    c = find_scope(Root(tmp_path), UNIT, V1)
    assert c is not None and c.pids == ()
    (d / "cgroup.procs").write_text("42\n")
    again = with_fresh_pids(Root(tmp_path), c)
    assert again is not None and again.pids == (42,)
    _process(tmp_path, 42, "pause", own_dev=True)  # the pod's sandbox, not a container
    assert with_fresh_pids(Root(tmp_path), c) is None
    (d / "cgroup.procs").write_text("43\n")
    (d / "cgroup.procs").unlink()
    d.rmdir()
    assert with_fresh_pids(Root(tmp_path), c) is None


@pytest.mark.parametrize(
    ("comm", "own_dev", "pending"),
    [
        ("runc:[2:INIT]", True, "still the runtime's init"),
        ("crun", True, "still the runtime's init"),
        ("sh", False, "still sees the host's /dev"),
        ("sleep", True, ""),
    ],
)
def test_judged_only_once_it_has_its_own_dev(
    tmp_path: Path, comm: str, own_dev: bool, pending: str
) -> None:
    _scope(tmp_path, (42,))
    _process(tmp_path, 42, comm, own_dev=own_dev)
    c = find_scope(Root(tmp_path), UNIT, V1)
    assert c is not None
    why = own_dev_pending(Root(tmp_path), c)
    assert (pending in why) if pending else why == ""


def test_no_process_yet_is_pending_and_remembered(tmp_path: Path) -> None:
    _scope(tmp_path, ())
    got = read_new_scope(Root(tmp_path), UNIT, V1, (), PodDeviceIds("/nonexistent"))
    assert got.pending == "no process in its cgroup yet" and got.view is None
    assert got.container is not None  # a retry reads its cgroup.procs only


def test_a_gone_scope_is_nothing_to_do(tmp_path: Path) -> None:
    _scope(tmp_path, (42,), unit=f"cri-containerd-{'d' * 64}.scope")
    got = read_new_scope(Root(tmp_path), UNIT, V1, (), PodDeviceIds("/nonexistent"))
    assert got.gone and got.view is None and not got.pending


def test_durable_grants_off_leaves_new_scopes_to_the_pass() -> None:
    """DurableGrants=no: nothing is queued (no D-Bus call); the pass is asked for at once,
    as a new scope always did."""
    import dataclasses

    from gpuguard.config import Config
    from gpuguard.journal.log import EventLog
    from gpuguard.steps.container_access import ContainerAccessStep

    cfg = Config()
    cfg = dataclasses.replace(cfg, devices=dataclasses.replace(cfg.devices, durable_grants=False))

    class Svc:
        root = Root(Path("/nonexistent"))
        config = cfg
        log = EventLog(level="error")
        apply = ChangeExecutor()
        bus_address = ""
        systemd = None

    asked: list[str] = []
    step = ContainerAccessStep()
    step.on_new_scope(Svc(), UNIT, (), asked.append)  # type: ignore[arg-type]
    assert asked == [f"systemd: new container scope {UNIT}"]
    scopes = step.state.scopes
    assert scopes.busy() == frozenset() and scopes.queue.handled == 0


@pytest.mark.parametrize("qos", ["kubepods-besteffort.slice/", ""], ids=["qos", "guaranteed"])
def test_a_hybrid_host_finds_the_scope_in_both_hierarchies(tmp_path: Path, qos: str) -> None:
    """Searched once, then the same path in the other hierarchy; other pods around it."""
    hybrid = CgroupLayout("/sys/fs/cgroup/devices", "/sys/fs/cgroup/unified")
    found = {}
    for h in ("devices", "unified"):
        kubepods = tmp_path / f"sys/fs/cgroup/{h}/kubepods.slice"
        for other in ("1", "2"):  # pods that do not hold it, one with a scope of its own
            pod = kubepods / qos / f"kubepods-pod{other * 8}_1111_2222_3333_444455556666.slice"
            (pod / f"cri-containerd-{other * 64}.scope").mkdir(parents=True)
        (kubepods / "kubepods-burstable.slice").mkdir(parents=True, exist_ok=True)
        (kubepods / "not-a-pod.slice" / UNIT).mkdir(parents=True)  # never taken for one
        found[h] = kubepods / qos / POD / UNIT
        found[h].mkdir(parents=True)
    (found["unified"] / "cgroup.procs").write_text("42\n")
    c = find_scope(Root(tmp_path), UNIT, hybrid)
    assert c is not None
    assert (c.cgroup_v1_devices, c.cgroup_v2) == (found["devices"], found["unified"])
    assert (c.pod_uid, c.container_id, c.pids) == (UID, CID, (42,))
    # only in one hierarchy: found there alone
    found["devices"].rmdir()
    c = find_scope(Root(tmp_path), UNIT, hybrid)
    assert c is not None and (c.cgroup_v1_devices, c.cgroup_v2) == (None, found["unified"])


def test_a_hybrid_scope_not_yet_in_the_devices_hierarchy_is_pending(tmp_path: Path) -> None:
    """systemd makes a new scope's cgroups one hierarchy at a time; seen by its cgroup2
    directory alone it would be judged by a layout whose kernel does not decide its opens
    (and pass for one that admits every device). Found again at the next try."""
    hybrid = CgroupLayout("/sys/fs/cgroup/devices", "/sys/fs/cgroup/unified")
    unified = tmp_path / "sys/fs/cgroup/unified/kubepods.slice/kubepods-besteffort.slice" / POD
    (unified / UNIT).mkdir(parents=True)
    (unified / UNIT / "cgroup.procs").write_text("42\n")
    _process(tmp_path, 42, "sleep", own_dev=True)
    got = read_new_scope(Root(tmp_path), UNIT, hybrid, (), PodDeviceIds("/nonexistent"))
    assert got.pending == "its cgroup in the v1 devices hierarchy is not there yet"
    assert got.container is None and got.view is None  # the next try looks for it again
    _scope(tmp_path, (42,))
    got = read_new_scope(Root(tmp_path), UNIT, hybrid, (), PodDeviceIds("/nonexistent"))
    assert got.pending != "its cgroup in the v1 devices hierarchy is not there yet"
