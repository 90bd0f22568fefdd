"""What the re-admission bridge counts as present and alive: every device ID form of
NVIDIA's plugin (readmit/devids.py), the driver's view and PCI + history before the
driver loads (readmit/presence.py), MIG devices recreated at boot, several resources
at once, and pods whose only running process is their sandbox (readmit/alive.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import pytest

from gpuguard.checkpoint.history import Generation, GpuIdentity, MigIdentity
from gpuguard.checkpoint.model import PodDevicesEntry
from gpuguard.devices.pci import PciFunction
from gpuguard.host.inventory import Gpu, Inventory, MigDevice
from gpuguard.host.paths import Root
from gpuguard.readmit.devids import GPU_INDEX, GPU_UUID, MIG_INDEX, MIG_LEGACY, MIG_UUID, parse_id
from gpuguard.readmit.observe import alive_pods
from gpuguard.readmit.plan import decide
from gpuguard.readmit.presence import DRIVER_NOT_LOADED, from_inventory, from_pci_history
from unit.test_devices_containers import CID1, PAUSE, UID, UID_, _cg, _proc

RESOURCES = ("nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-*")
A, B = "GPU-aaaa", "GPU-bbbb"
BUS_A, BUS_B = "0000:17:00.0", "0000:3a:00.0"


def entry(uid: str, ids: Sequence[str], resource: str = "nvidia.com/gpu") -> PodDevicesEntry:
    return PodDevicesEntry(uid, "main", resource, ((0, tuple(ids)),), b"")


def history(mig_a: tuple[MigIdentity, ...] = ()) -> Generation:
    return Generation(
        (GpuIdentity(A, BUS_A, 0, 0, mig=mig_a), GpuIdentity(B, BUS_B, 1, 1)), 1.0, "boot-1"
    )


def inventory(mig_a: tuple[MigDevice, ...] = ()) -> Inventory:
    return Inventory(
        (Gpu(A, 0, 0, "00000000:17:00.0", mig_a), Gpu(B, 1, 1, "00000000:3A:00.0")), "nvml"
    )


def fn(address: str, vendor: str = "0x10de", klass: str = "0x030200") -> PciFunction:
    return PciFunction(address, vendor, "0x2330", klass)


@pytest.mark.parametrize(
    ("raw", "form", "base"),
    [
        ("GPU-aaaa", GPU_UUID, "GPU-aaaa"),
        ("GPU-aaaa::3", GPU_UUID, "GPU-aaaa"),
        ("MIG-1234", MIG_UUID, "MIG-1234"),
        ("MIG-GPU-aaaa/1/0", MIG_LEGACY, "MIG-GPU-aaaa/1/0"),
        ("0", GPU_INDEX, "0"),
        ("1::7", GPU_INDEX, "1"),
        ("0:1", MIG_INDEX, "0:1"),
        ("0:1::2", MIG_INDEX, "0:1"),
    ],
)
def test_every_id_form_of_nvidia_s_plugin(raw: str, form: str, base: str) -> None:
    d = parse_id(raw)
    assert (d.form, d.base) == (form, base)


def test_replica_and_index_ids_are_offered_when_their_gpu_is_there() -> None:
    """Time-slicing/MPS replicas (gpu.shared too) and index IDs: main offered none."""
    node = from_inventory(inventory(), history(), "NVML")
    entries = [
        entry("pod-a", ["GPU-aaaa::0", "GPU-aaaa::3"], "nvidia.com/gpu.shared"),
        entry("pod-b", ["1"]),
        entry("pod-c", ["0::2"], "nvidia.com/gpu"),
    ]
    d = decide(entries, RESOURCES, node, frozenset())
    got = {o.resource: o.healthy for o in d.offers}
    assert got == {
        "nvidia.com/gpu.shared": ("GPU-aaaa::0", "GPU-aaaa::3"),
        "nvidia.com/gpu": ("0::2", "1"),
    }, d.why
    assert "judged on NVML" in d.why


def test_an_index_now_another_gpu_s_is_not_offered() -> None:
    """GPU A fell off the bus: B is index 0 now; the checkpoint's "0" was A's."""
    inv = Inventory((Gpu(B, 0, 1, BUS_B),), "nvml")
    d = decide(
        [entry("pod-a", ["0"])], RESOURCES, from_inventory(inv, history(), "NVML"), frozenset()
    )
    assert d.offers == ()
    assert "index 0 is the GPU in slot 0000:3a:00.0 now (was 0000:17:00.0)" in d.why


def test_recreated_mig_devices_are_never_offered_and_their_pods_are_named() -> None:
    old = (MigIdentity("MIG-old1", 1, 0), MigIdentity("MIG-old2", 2, 0))
    new = (MigDevice("MIG-new1", 1, 0), MigDevice("MIG-new2", 2, 0))
    node = from_inventory(inventory(new), history(old), "NVML")
    entries = [
        entry("pod-mig", ["MIG-old1"], "nvidia.com/mig-1g.10gb"),
        entry("pod-idx", ["0:0"], "nvidia.com/mig-1g.10gb"),
        entry("pod-gpu", [B]),
    ]
    d = decide(entries, RESOURCES, node, frozenset())
    assert [(o.resource, o.healthy) for o in d.offers] == [("nvidia.com/gpu", (B,))]
    refused = dict(d.refused)
    assert "MIG UUIDs changed" in refused["pod-mig"]
    assert "MIG layout changed" in refused["pod-idx"]
    assert "pod pod-idx" in d.why and "pod pod-mig" in d.why


def test_unchanged_mig_devices_are_offered_in_every_form() -> None:
    mig = (MigDevice("MIG-1", 1, 0), MigDevice("MIG-2", 2, 0))
    node = from_inventory(
        inventory(mig), history(tuple(MigIdentity(m.uuid, m.gi, m.ci) for m in mig)), "NVML"
    )
    entries = [
        entry("p1", ["MIG-1"], "nvidia.com/mig-1g.10gb"),
        entry("p2", ["0:1"], "nvidia.com/mig-1g.10gb"),
        entry("p3", ["MIG-GPU-aaaa/2/0"], "nvidia.com/mig-3g.40gb"),
    ]
    d = decide(entries, RESOURCES, node, frozenset())
    assert {o.resource: o.healthy for o in d.offers} == {
        "nvidia.com/mig-1g.10gb": ("0:1", "MIG-1"),
        "nvidia.com/mig-3g.40gb": ("MIG-GPU-aaaa/2/0",),
    }
    assert d.refused == ()


def test_before_the_driver_pci_and_history_vouch_for_gpus_in_their_slots() -> None:
    """GPU Operator layout at boot: no NVML, both slots hold NVIDIA GPUs."""
    node = from_pci_history([fn(BUS_A), fn(BUS_B), fn("0000:00:02.0", "0x8086")], history(), "")
    entries = [entry("pod-a", [A]), entry("pod-b", ["1::0"], "nvidia.com/gpu.shared")]
    d = decide(entries, RESOURCES, node, frozenset())
    assert {o.resource: o.healthy for o in d.offers} == {
        "nvidia.com/gpu": (A,),
        "nvidia.com/gpu.shared": ("1::0",),
    }
    assert d.evidence == DRIVER_NOT_LOADED
    assert "PCI + history, driver not loaded" in d.why


@pytest.mark.parametrize(
    ("functions", "why"),
    [
        ([fn(BUS_B)], "its slot 0000:17:00.0 (by history) is empty"),
        ([fn(BUS_A, "0x15b3", "0x020700"), fn(BUS_B)], "holds another device"),
        ([fn(BUS_A, klass="0x068000"), fn(BUS_B)], "holds another device"),  # an NVSwitch
    ],
)
def test_nothing_is_vouched_for_an_empty_slot_or_another_device(
    functions: list[PciFunction], why: str
) -> None:
    node = from_pci_history(functions, history(), "")
    d = decide([entry("pod-a", [A]), entry("pod-i", ["0"])], RESOURCES, node, frozenset())
    assert d.offers == ()
    assert why in dict(d.refused)["pod-a"]
    assert why in dict(d.refused)["pod-i"]


def test_mig_and_shifted_indices_are_never_vouched_for_without_the_driver() -> None:
    node = from_pci_history([fn(BUS_A)], history((MigIdentity("MIG-1", 1, 0),)), "")
    entries = [entry("pod-m", ["MIG-1"], "nvidia.com/mig-1g.10gb"), entry("pod-i", ["0"])]
    d = decide(entries, RESOURCES, node, frozenset())
    assert d.offers == ()
    assert "never vouched for without the driver" in dict(d.refused)["pod-m"]
    assert "indices cannot be vouched" in dict(d.refused)["pod-i"]


def test_no_history_vouches_for_nothing() -> None:
    node = from_pci_history([fn(BUS_A)], None, "no NVML")
    assert decide([entry("p", [A])], RESOURCES, node, frozenset()).offers == ()


def _pod(root: Path, uid_: str) -> str:
    qos = "sys/fs/cgroup/kubepods.slice/kubepods-besteffort.slice"
    return f"{qos}/kubepods-besteffort-pod{uid_}.slice"


def test_a_pod_whose_only_process_is_its_sandbox_is_not_alive(tmp_path: Path) -> None:
    """A crash-looping GPU container: only pause runs (main counted the pod as alive)."""
    pod = _pod(tmp_path, UID_)
    _cg(tmp_path, f"{pod}/cri-containerd-{PAUSE}.scope", (10,))
    _cg(tmp_path, f"{pod}/cri-containerd-{CID1}.scope", ())  # the GPU container, exited
    _proc(tmp_path, 10, "/pause")
    assert alive_pods(Root(tmp_path)) == frozenset()
    _cg(tmp_path, f"{pod}/cri-containerd-{CID1}.scope", (11,))
    _proc(tmp_path, 11, "/usr/bin/python3")
    assert alive_pods(Root(tmp_path)) == {UID}


def test_the_runtime_s_bundle_wins_over_a_process_named_pause(tmp_path: Path) -> None:
    pod = _pod(tmp_path, UID_)
    _cg(tmp_path, f"{pod}/cri-containerd-{CID1}.scope", (12,))
    _proc(tmp_path, 12, "/pause")  # a tenant container whose program is called pause
    bundle = tmp_path / f"run/containerd/io.containerd.runtime.v2.task/k8s.io/{CID1}"
    bundle.mkdir(parents=True)
    note = {"annotations": {"io.kubernetes.cri.container-type": "container"}}
    (bundle / "config.json").write_text(json.dumps(note))
    assert alive_pods(Root(tmp_path)) == {UID}
    note["annotations"]["io.kubernetes.cri.container-type"] = "sandbox"
    (bundle / "config.json").write_text(json.dumps(note))
    assert alive_pods(Root(tmp_path)) == frozenset()


def test_a_gpu_gone_or_replaced_is_named_for_what_it_is() -> None:
    gone = Inventory((Gpu(B, 1, 1, BUS_B),), "nvml")
    assert "has no GPU the driver sees" in from_inventory(gone, history(), "NVML").judge(A)
    other = Inventory((Gpu("GPU-new", 0, 0, BUS_A), Gpu(B, 1, 1, BUS_B)), "nvml")
    assert "holds another GPU now" in from_inventory(other, history(), "NVML").judge(A)


def test_mig_positions_are_judged_against_the_boot_before_not_this_one() -> None:
    """The pre-start hook records this boot's generation (new MIG UUIDs) before kubelet
    starts: an index or legacy MIG ID still names last boot's device."""
    old = (MigIdentity("MIG-old1", 1, 0),)
    new = (MigDevice("MIG-new1", 1, 0),)
    now = Generation(
        (GpuIdentity(A, BUS_A, 0, 0, mig=(MigIdentity("MIG-new1", 1, 0),)),), 2.0, "boot-2"
    )
    node = from_inventory(inventory(new), now, "NVML", earlier=history(old))
    for raw in ("0:0", "MIG-GPU-aaaa/1/0"):
        assert "MIG devices recreated on slot 0000:17:00.0" in node.judge(raw), raw
    same = from_inventory(inventory(new), now, "NVML", earlier=now)
    assert same.judge("0:0") == "" and same.judge("MIG-new1") == ""
