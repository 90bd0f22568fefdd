"""What container findings say: absent vs stale nodes, and not the device plugin's own."""

from __future__ import annotations

from typing import Any

from gpuguard.devices.entitlement import Entitlement, VisibleDevices, compute_entitlement
from gpuguard.devices.nodes import DeviceNode
from gpuguard.devices.rules import parse_devices_list
from gpuguard.model import Action, Finding
from gpuguard.steps.container_access.reconcile import (
    CAUSE_RELOADED,
    CgroupV1Allow,
    audit,
    verdicts_from_rules,
)
from unit.test_devices_audit import CID, CTL, GPU0, HOST, OF, RUNC_LIST, UVM, UVMT, _container
from unit.test_devices_entitlement import GPUS


def _ent(given: tuple[DeviceNode, ...]) -> Entitlement:
    return compute_entitlement(
        "uid-1", CID, given, HOST, GPUS, VisibleDevices("list", ("GPU-aaaa",)), {"GPU-aaaa"}
    )


# /dev/nvidia-uvm as the container got it before nvidia_uvm was reloaded with major 237
OLD_UVM = DeviceNode("/dev/nvidia-uvm", 236, 0, UVM.role)
OLD_UVMT = DeviceNode("/dev/nvidia-uvm-tools", 236, 1, UVMT.role)


def _audit(
    ent: Entitlement, allow: str, **kw: Any
) -> tuple[tuple[Finding, ...], tuple[Action, ...]]:
    c = _container()
    rules = parse_devices_list(allow)
    access = verdicts_from_rules(CID, HOST, rules)
    return audit([c], {c.key: ent}, access, cgroup_of=OF, device_rules={CID: rules}, **kw)


ALL_ALLOWED = "a *:* rwm\n"


def test_stale_numbers_are_not_absent() -> None:
    e = _ent((GPU0, CTL, OLD_UVM, OLD_UVMT))
    assert e.missing == ()  # present, with other numbers: not "missing"
    assert e.stale == ((OLD_UVM, UVM), (OLD_UVMT, UVMT))
    findings, actions = _audit(e, ALL_ALLOWED)
    assert [f.kind for f in findings] == ["container-device-stale"] * 2
    f = findings[0]
    assert f.summary == (
        f"pod uid-1 container {CID[:12]} has /dev/nvidia-uvm with stale numbers "
        f"(236:0, host has 237:0): {CAUSE_RELOADED}; recreate the container"
    )
    assert f.severity == "warning"
    assert f.fields["DEVICE_NUMBERS"] == "237:0"
    assert f.fields["CONTAINER_DEVICE_NUMBERS"] == "236:0"
    assert actions == ()  # never a grant of the new numbers it was not given


def test_absent_node_is_missing_at_warning() -> None:
    findings, _ = _audit(_ent((GPU0, CTL, OLD_UVM)), ALL_ALLOWED)
    kinds = {(f.kind, f.fields["DEVICE"]) for f in findings}
    assert kinds == {
        ("container-device-stale", "/dev/nvidia-uvm"),
        ("container-device-missing", "/dev/nvidia-uvm-tools"),
    }
    missing = next(f for f in findings if f.kind == "container-device-missing")
    assert "has no /dev/nvidia-uvm-tools in its /dev" in missing.summary
    assert missing.severity == "warning"


def test_the_device_plugins_own_container_is_left_to_the_plugin_step() -> None:
    e = _ent((GPU0, CTL))  # the plugin started before nvidia-uvm existed
    findings, _ = _audit(e, ALL_ALLOWED)
    assert {f.kind for f in findings} == {"container-device-missing"}
    findings, _ = _audit(e, ALL_ALLOWED, plugin_containers=frozenset({CID}))
    assert findings == ()
    # ...but its lost access is still re-granted like any container's
    findings, actions = _audit(e, RUNC_LIST, plugin_containers=frozenset({CID}))
    assert {f.kind for f in findings} == {"container-device-denied"}
    assert [type(a) for a in actions] == [CgroupV1Allow]
