"""audit.py: findings, causes and actions from observations (tables)."""

from __future__ import annotations

from pathlib import Path

from gpuguard.devices.containers import ContainerCgroup
from gpuguard.devices.entitlement import Entitlement, VisibleDevices, compute_entitlement
from gpuguard.devices.nodes import DeviceNode, NvidiaMajors, expected_nodes
from gpuguard.devices.rules import RUNC_DEFAULT_RULES, parse_devices_list
from gpuguard.model import Action, Finding
from gpuguard.steps.container_access.cgroups import Cgroups
from gpuguard.steps.container_access.reconcile import (
    CAUSE_PLUGIN_UVM,
    CAUSE_REWRITE,
    CAUSE_REWRITE_V2,
    CAUSE_UNKNOWN,
    CgroupV1Allow,
    RestartContainer,
    UnitDeviceAllow,
    V2ProgramReplace,
    V2ReportOnly,
    audit,
    verdicts_from_rules,
)
from unit.test_devices_entitlement import GPUS

# each container's layout plans its re-grant (v1: devices.allow; v2: a scope's
# DeviceAllow= alone, or V2Remedy='s remedy without a scope)
OF = Cgroups().of

MAJORS = NvidiaMajors(195, 237, None)
HOST = expected_nodes(GPUS, MAJORS, {})
GPU0, GPU1, CTL, UVM, UVMT = HOST
CID = "c" * 64
RUNC_LIST = "".join(r.render() + "\n" for r in RUNC_DEFAULT_RULES)


def _container(driver: str = "cgroupfs", v1: bool = True, unit: bool = False) -> ContainerCgroup:
    return ContainerCgroup(
        pod_uid="uid-1",
        container_id=CID,
        runtime="containerd",
        driver=driver,
        cgroup_v1_devices=Path("/sys/fs/cgroup/devices/kubepods/poduid-1/" + CID) if v1 else None,
        cgroup_v2=Path("/sys/fs/cgroup/kubepods/poduid-1/" + CID),
        unit=f"cri-containerd-{CID}.scope" if unit else None,
        pids=(10,),
    )


def _ent(given: tuple[DeviceNode, ...] = (GPU0, CTL, UVM, UVMT)) -> Entitlement:
    return compute_entitlement(
        "uid-1", CID, given, HOST, GPUS, VisibleDevices("list", ("GPU-aaaa",)), {"GPU-aaaa"}
    )


def _run(
    container: ContainerCgroup, ent: Entitlement, devices_list: str
) -> tuple[tuple[Finding, ...], tuple[Action, ...]]:
    rules = parse_devices_list(devices_list)
    access = verdicts_from_rules(CID, HOST, rules)
    return audit([container], {container.key: ent}, access, cgroup_of=OF, device_rules={CID: rules})


def test_seed_002_rewrite_v1_cgroupfs() -> None:
    c = _container()
    findings, actions = _run(c, _ent(), RUNC_LIST)
    assert {f.fields["DEVICE"] for f in findings} == {
        "/dev/nvidia0",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    }
    assert {f.kind for f in findings} == {"container-device-denied"}
    assert {f.fields["CAUSE"] for f in findings} == {CAUSE_REWRITE}
    f0 = next(f for f in findings if f.fields["DEVICE"] == "/dev/nvidia0")
    assert f0.fields["DEVICE_NUMBERS"] == "195:0"
    assert f0.fields["POD_UID"] == "uid-1" and f0.fields["CONTAINER_ID"] == CID
    (a,) = actions
    assert isinstance(a, CgroupV1Allow)
    assert a.kind == "cgroup-v1-allow"
    assert a.rules == ("c 195:0 rw", "c 195:255 rw", "c 237:0 rw", "c 237:1 rw")
    assert "c 195:1 rw" not in a.rules  # GPU1 was never given
    assert a.fields()["DEVICE_NUMBERS"] == "195:0,195:255,237:0,237:1"
    assert a.to_json()["kind"] == "cgroup-v1-allow"


def test_seed_003_systemd_gets_durable_unit_action() -> None:
    c = _container(driver="systemd", unit=True)
    _, actions = _run(c, _ent(), RUNC_LIST)
    assert [a.kind for a in actions] == ["cgroup-v1-allow", "unit-device-allow"]
    u = actions[1]
    assert isinstance(u, UnitDeviceAllow)
    assert u.devices[0] == ("/dev/char/195:0", "rw")
    assert u.fields()["UNIT"] == f"cri-containerd-{CID}.scope"
    assert u.fields()["DEVICE"].startswith("/dev/nvidia0,")


def test_seed_004_uvm_denied_gpu_ok() -> None:
    c = _container()
    listing = RUNC_LIST + "c 195:255 rw\nc 195:0 rw\n"
    findings, actions = _run(c, _ent(), listing)
    assert {f.fields["DEVICE"] for f in findings} == {"/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}
    assert {f.fields["CAUSE"] for f in findings} == {CAUSE_PLUGIN_UVM}
    (a,) = actions
    assert isinstance(a, CgroupV1Allow) and a.rules == ("c 237:0 rw", "c 237:1 rw")


def test_uvm_absent_from_dev_is_reported_not_granted() -> None:
    c = _container()
    listing = RUNC_LIST + "c 195:255 rw\nc 195:0 rw\n"
    findings, actions = _run(c, _ent((GPU0, CTL)), listing)
    assert [(f.kind, f.fields["DEVICE"], f.fields["CAUSE"]) for f in findings] == [
        ("container-device-missing", "/dev/nvidia-uvm", CAUSE_PLUGIN_UVM),
        ("container-device-missing", "/dev/nvidia-uvm-tools", CAUSE_PLUGIN_UVM),
    ]
    assert actions == ()


def test_all_allowed_nothing_to_do() -> None:
    findings, actions = _run(_container(), _ent(), "a *:* rwm\n")
    assert findings == () and actions == ()


def test_partial_unknown_cause() -> None:
    listing = RUNC_LIST + "c 195:255 rw\nc 237:0 rw\nc 237:1 rw\n"
    findings, _ = _run(_container(), _ent(), listing + "c 195:1 rw\n")
    assert [(f.fields["DEVICE"], f.fields["CAUSE"]) for f in findings] == [
        ("/dev/nvidia0", CAUSE_REWRITE)
    ]
    # not a runc-looking list: cause unknown
    findings, _ = _run(_container(), _ent(), "c 195:255 rw\nc 237:0 rw\nc 237:1 rw\n")
    assert findings[0].fields["CAUSE"] == CAUSE_UNKNOWN


def test_v2_cgroupfs_report_or_restart() -> None:
    c = _container(v1=False)
    ent = _ent()
    access = {(CID, n.numbers): n.role != "gpu" for n in HOST}
    findings, actions = audit([c], {c.key: ent}, access, cgroup_of=OF)
    assert findings[0].fields["CAUSE"] == CAUSE_REWRITE_V2
    (a,) = actions
    assert isinstance(a, V2ReportOnly) and a.cgroup_dir.endswith(CID)
    _, actions = audit([c], {c.key: ent}, access, cgroup_of=OF, remedy="restart-container")
    (r,) = actions
    assert isinstance(r, RestartContainer) and r.kind == "restart-container"
    assert r.fields()["RUNTIME"] == "containerd"
    # V2Remedy=inplace: exactly the denied GPU node, in the container's own cgroup
    _, actions = audit([c], {c.key: ent}, access, cgroup_of=OF, remedy="inplace")
    (p,) = actions
    assert isinstance(p, V2ProgramReplace) and p.kind == "v2-program-replace"
    assert p.cgroup_dir.endswith(CID)
    assert p.numbers == tuple(n.numbers for n in HOST if n.role == "gpu" and n in ent.nodes)


def test_v2_systemd_uses_unit() -> None:
    c = _container(driver="systemd", v1=False, unit=True)
    access = {(CID, n.numbers): False for n in HOST}
    _, actions = audit([c], {c.key: _ent()}, access, cgroup_of=OF)
    assert [a.kind for a in actions] == ["unit-device-allow"]


def test_unknown_verdicts_do_nothing_and_unreadable_skipped() -> None:
    c = _container()
    findings, actions = audit([c], {c.key: _ent()}, {}, cgroup_of=OF)
    assert findings == () and actions == ()
    findings, actions = audit([c], {}, {(CID, "195:0"): False}, cgroup_of=OF)
    assert findings == () and actions == ()


def test_conflict_finding() -> None:
    c = _container()
    ent = compute_entitlement(
        "uid-1", CID, (GPU1, CTL), HOST, GPUS, VisibleDevices("list", ("0",)), {"0"}
    )
    access = {(CID, n.numbers): False for n in HOST}
    findings, actions = audit([c], {c.key: ent}, access, cgroup_of=OF)
    kinds = [(f.kind, f.fields["DEVICE"]) for f in findings]
    assert ("container-device-conflict", "/dev/nvidia1") in kinds
    assert all("195:1" not in a.fields()["DEVICE_NUMBERS"] for a in actions)
