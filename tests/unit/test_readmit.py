"""The re-admission bridge's pure parts: what it offers kubelet (readmit/plan.py), the
protobuf bytes it sends (readmit/wire.py, read back with grpc_tools' generated code of
kubelet's api.proto where the test cache has it), and how it tells a kubelet's version
(readmit/observe.py). The bridge against a real kubelet 1.34:
tests/integration/test_kubelet_f1.py (``host-1.34-*``) and test_readmit_bridge.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.checkpoint.model import PodDevicesEntry
from gpuguard.host.paths import Root
from gpuguard.host.protowire import fields
from gpuguard.readmit import Readmit, wire
from gpuguard.readmit.observe import KubeletVersion, kubelet_version
from gpuguard.readmit.plan import decide
from gpuguard.readmit.serve import endpoint

GLOBS = ("nvidia.com/gpu", "nvidia.com/mig-*")


def entry(uid: str, ids: Sequence[str], resource: str = "nvidia.com/gpu") -> PodDevicesEntry:
    return PodDevicesEntry(uid, "main", resource, ((0, tuple(ids)),), b"\n\x03abc")


def test_after_a_reboot_it_offers_exactly_the_held_gpus_that_are_present() -> None:
    entries = [entry("pod-a", ["GPU-a"]), entry("pod-b", ["GPU-b"]), entry("pod-c", ["GPU-gone"])]
    d = decide(entries, GLOBS, frozenset({"GPU-a", "GPU-b", "GPU-free"}), frozenset())
    (offer,) = d.offers
    assert offer.healthy == ("GPU-a", "GPU-b")  # never GPU-free: not held
    assert offer.absent == ("GPU-gone",)  # held, not on the node: never vouched
    assert offer.pods == ("pod-a", "pod-b", "pod-c")
    assert "3 of 3" in d.why


def test_a_kubelet_restart_with_every_gpu_pod_running_gets_no_offer() -> None:
    entries = [entry("6b1e1ad0-0000-4000-8000-00000000f300", ["GPU-a"])]
    alive = frozenset({"6b1e1ad0_0000_4000_8000_00000000f300"})  # systemd's spelling
    d = decide(entries, GLOBS, frozenset({"GPU-a"}), alive)
    assert d.offers == () and "running" in d.why


def test_one_pod_down_is_enough_and_other_resources_are_left_alone() -> None:
    entries = [
        entry("pod-a", ["GPU-a"]),
        entry("pod-b", ["MIG-1"], "nvidia.com/mig-1g.10gb"),
        entry("pod-x", ["nic-1"], "example.com/nic"),
    ]
    d = decide(entries, GLOBS, frozenset({"GPU-a", "MIG-1", "nic-1"}), frozenset({"pod-a"}))
    assert [(o.resource, o.healthy) for o in d.offers] == [
        ("nvidia.com/gpu", ("GPU-a",)),
        ("nvidia.com/mig-1g.10gb", ("MIG-1",)),
    ]


@pytest.mark.parametrize(
    ("entries", "present", "why"),
    [
        ([], {"GPU-a"}, "no pod"),
        ([entry("p", [])], {"GPU-a"}, "no pod"),
        ([entry("p", ["GPU-old"])], {"GPU-a"}, "none of the checkpoint's GPUs"),
        ([entry("p", ["nic"], "example.com/nic")], {"nic"}, "no pod"),
    ],
)
def test_nothing_to_offer(entries: list[PodDevicesEntry], present: set[str], why: str) -> None:
    d = decide(entries, GLOBS, frozenset(present), frozenset())
    assert d.offers == () and why in d.why


ids = st.lists(st.sampled_from([f"GPU-{i}" for i in range(6)]), max_size=3)


@given(
    st.lists(st.tuples(st.sampled_from("abcd"), ids), max_size=6),
    st.sets(st.sampled_from([f"GPU-{i}" for i in range(6)])),
    st.sets(st.sampled_from("abcd")),
)
def test_never_vouches_for_a_device_not_held_or_not_present(
    rows: list[tuple[str, list[str]]], present: set[str], alive: set[str]
) -> None:
    entries = [entry(uid, gpus) for uid, gpus in rows]
    held = {i for _uid, gpus in rows for i in gpus}
    d = decide(entries, GLOBS, frozenset(present), frozenset(alive))
    for o in d.offers:
        assert set(o.healthy) <= held & present
        assert len(o.healthy) <= len(present)
    if d.offers:
        assert {u for u, g in rows if g} - alive, "offered while every pod runs"


def test_wire_messages_decode_to_their_fields() -> None:
    req = fields(wire.register_request("nvidia.com/gpu", endpoint("nvidia.com/gpu")))
    assert req[1] == [b"v1beta1"]
    assert req[2] == [b"gpuguard/readmit-nvidia.com_gpu.sock"]
    assert req[3] == [b"nvidia.com/gpu"]
    assert req[4] == [b""]  # empty DevicePluginOptions
    resp = fields(wire.list_and_watch_response(["GPU-a", "GPU-" + "b" * 200]))
    devices = [fields(d) for d in resp[1]]
    assert [d[1][0] for d in devices] == [b"GPU-a", b"GPU-" + b"b" * 200]
    assert all(d[2] == [b"Healthy"] for d in devices)
    assert wire.list_and_watch_response([]) == b""


def test_wire_matches_the_generated_code_of_kubelets_proto(tmp_path: Path) -> None:
    """The same bytes protobuf's own encoder makes from kubelet 1.20's api.proto (the
    v1beta1 API has not changed for these messages since)."""
    proto = Path(os.environ.get("GPUGUARD_TEST_CACHE", "/var/cache/gpuguard-tests"))
    proto = proto / "kubelet-1.20.2" / "api.proto"
    if not proto.is_file():
        pytest.skip(f"no {proto} (scripts/build-kubelet caches it)")
    import sys

    from integration.harness.deviceplugin import generate

    sys.path.insert(0, str(generate(proto, tmp_path)))
    try:
        import api_pb2  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    req = api_pb2.RegisterRequest(
        version="v1beta1",
        endpoint="gpuguard/readmit-nvidia.com_gpu.sock",
        resource_name="nvidia.com/gpu",
        options=api_pb2.DevicePluginOptions(),
    )
    ours = wire.register_request("nvidia.com/gpu", "gpuguard/readmit-nvidia.com_gpu.sock")
    assert api_pb2.RegisterRequest.FromString(ours) == req
    devs = [api_pb2.Device(ID=i, health="Healthy") for i in ("GPU-a", "GPU-b")]
    resp = api_pb2.ListAndWatchResponse.FromString(wire.list_and_watch_response(["GPU-a", "GPU-b"]))
    assert resp == api_pb2.ListAndWatchResponse(devices=devs)


@pytest.mark.parametrize(
    ("version", "needs"),
    [("1.20", False), ("1.25", False), ("1.26", True), ("1.34", True), ("2.0", True), ("", None)],
)
def test_the_bridge_is_for_kubelet_1_26_and_later(version: str, needs: bool | None) -> None:
    assert KubeletVersion("/usr/bin/kubelet", "1:2:3:4", version, "").needs_bridge is needs


def test_the_version_is_asked_once_per_binary_and_only_of_a_kubelet(tmp_path: Path) -> None:
    root = Root(tmp_path)
    exe = tmp_path / "usr/bin/kubelet"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\necho 'Kubernetes v1.34.9-openshift-microshift-release-4.21'\n")
    exe.chmod(0o755)
    if os.geteuid() != 0:
        pytest.skip("a root-owned executable needs root")
    kv = kubelet_version(root, "/usr/bin/kubelet", None)
    assert (kv.version, kv.needs_bridge) == ("1.34", True)
    assert kubelet_version(root, "/usr/bin/kubelet", kv) is kv  # same file: not asked
    exe.write_text("#!/bin/sh\necho 'Kubernetes v1.20.2'\n")  # replaced: asked again
    assert kubelet_version(root, "/usr/bin/kubelet", kv).version == "1.20"
    other = tmp_path / "bin/sh-like"
    other.parent.mkdir(parents=True)
    other.write_text("#!/bin/sh\necho v9.9.9\n")
    other.chmod(0o755)
    assert kubelet_version(root, "/bin/sh-like", None).version == ""  # not run
    k3s = tmp_path / "usr/local/bin/k3s-agent"  # a stand-in: python3's "Python 3.11.2"
    k3s.parent.mkdir(parents=True)
    k3s.write_text("#!/bin/sh\necho 'Python 3.11.2'\n")
    k3s.chmod(0o755)
    assert kubelet_version(root, "/usr/local/bin/k3s-agent", None).version == ""
    k3s.write_text("#!/bin/sh\necho 'k3s version v1.28.5+k3s1 (5b2d1271)'\n")
    assert kubelet_version(root, "/usr/local/bin/k3s-agent", None).version == "1.28"
    exe.chmod(0o777)  # anyone may write it: not run
    assert kubelet_version(root, "/usr/bin/kubelet", None).version == ""


# -- the loop's decision at a kubelet start (readmit/__init__.py), on a fake root ---------


class FakeBridge:
    def __init__(self) -> None:
        self.registered: list[tuple[str, tuple[str, ...]]] = []
        self.served: set[str] = set()

    def register(self, resource: str, ids: tuple[str, ...], timeout: float = 5.0) -> None:
        self.registered.append((resource, ids))

    def serve(self, resource: str) -> None:
        self.served.add(resource)


def _node(tmp_path: Path, config: str = "") -> tuple[Root, Readmit, FakeBridge, list[str]]:
    from gpuguard.checkpoint.codec import marshal
    from gpuguard.checkpoint.model import Checkpoint
    from gpuguard.config import load_config
    from gpuguard.journal.log import EventLog
    from gpuguard.readmit import Inputs

    root = Root(tmp_path)
    plugins = tmp_path / "var/lib/kubelet/device-plugins"
    plugins.mkdir(parents=True)
    cp = Checkpoint("v2", (entry("pod-a", ["GPU-a"]), entry("pod-b", ["GPU-b"])), {}, 0)
    (plugins / "kubelet_internal_checkpoint").write_bytes(marshal(cp))
    (tmp_path / "etc/gpuguard").mkdir(parents=True)
    (tmp_path / "etc/gpuguard/gpuguard.conf").write_text(config)
    said: list[str] = []

    class Log(EventLog):
        def event(self, kind: str, msg: str, **kw: Any) -> None:  # type: ignore[override]
            said.append(f"{kind}: {msg}")

    bridge = FakeBridge()

    def inputs() -> Inputs:
        return Inputs(load_config(root), frozenset({"GPU-a", "GPU-b", "GPU-c"}), "")

    r = Readmit(root, Log(stream_format="none"), inputs, bridge)  # type: ignore[arg-type]
    return root, r, bridge, said


def test_a_kubelet_start_after_a_reboot_registers_the_held_gpus(tmp_path: Path) -> None:
    _root, r, bridge, said = _node(tmp_path)
    r.prepare()  # before kubelet's start: its endpoint made then
    assert bridge.served == {"nvidia.com/gpu"}
    r.on_kubelet_start()
    assert bridge.registered == [("nvidia.com/gpu", ("GPU-a", "GPU-b"))]
    assert said[-1].startswith("readmit-offered: kubelet started: reported 2 nvidia.com/gpu")


def test_observe_mode_the_off_switch_and_a_plugin_first_register_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _root, r, bridge, said = _node(tmp_path, "[Daemon]\nMode=observe\n")
    r.on_kubelet_start()
    assert bridge.registered == [] and said[-1].startswith("readmit-observe:")
    _root, r, bridge, said = _node(tmp_path / "off")
    (tmp_path / "off/etc/gpuguard/disabled").write_text("INC-1\n")
    r.on_kubelet_start()
    assert bridge.registered == [] and "gpuguard is off" in said[-1]
    import socket

    _root, r, bridge, said = _node(tmp_path / "plugin")
    s = socket.socket(socket.AF_UNIX)
    monkeypatch.chdir(tmp_path / "plugin/var/lib/kubelet/device-plugins")
    s.bind("nvidia-gpu.sock")  # relative: a tmp path is past AF_UNIX's 108 bytes
    try:
        r.on_kubelet_start()
    finally:
        s.close()
    assert bridge.registered == [] and "a device plugin serves already" in said[-1]


def test_a_checkpoint_rewritten_after_the_decision_is_read_again(tmp_path: Path) -> None:
    from gpuguard.checkpoint.codec import marshal
    from gpuguard.checkpoint.model import Checkpoint

    _root, r, bridge, _said = _node(tmp_path)
    r.prepare()
    cp = Checkpoint("v2", (entry("pod-a", ["GPU-c"]),), {}, 0)  # the pre-start hook's remap
    path = tmp_path / "var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"
    tmp = path.with_name(".new")
    tmp.write_bytes(marshal(cp))
    tmp.rename(path)
    r.on_kubelet_start()
    assert bridge.registered == [("nvidia.com/gpu", ("GPU-c",))]


def test_the_pods_kubelet_rejected_are_read_from_its_log() -> None:
    """kubelet 1.34.9's own lines (allocation_manager.go), as journald keeps them."""
    from gpuguard.readmit.rejected import rejections

    log = (
        'I1128 12:20:35.778873     757 allocation_manager.go:702] "Pod admission denied" '
        'podUID="5be161ab-85e5-5281-8e74-7c9c806b281d" pod="default/gpu-a-gpunode" '
        'reason="UnexpectedAdmissionError" message="Allocate failed due to no healthy '
        "devices present; cannot allocate unhealthy devices nvidia.com/gpu, which is "
        'unexpected"\n'
        'I1128 12:20:35.778949     757 allocation_manager.go:702] "Pod admission denied" '
        'podUID="u2" pod="default/big" reason="OutOfmemory" message="Node didn\'t have '
        'enough resource: memory"\n'
    )
    (r,) = rejections(log, 757)
    assert (r.pod, r.pod_uid, r.reason) == (
        "default/gpu-a-gpunode",
        "5be161ab-85e5-5281-8e74-7c9c806b281d",
        "UnexpectedAdmissionError",
    )
    assert r.message.startswith("Allocate failed due to no healthy devices present")


@pytest.mark.parametrize(("evidence", "again"), [("PCI + history, driver not loaded", True),
                                                 ("NVML libnvidia-ml.so.1", False)])  # fmt: skip
def test_the_pci_view_is_read_again_when_the_history_changed(
    tmp_path: Path, evidence: str, again: bool
) -> None:
    """A GPU Operator node: the bridge vouched from PCI + history before the driver; the
    driver arrived with new UUIDs, gpuguard remapped the checkpoint (GPU-a, GPU-b) and
    recorded them in the history, then restarted kubelet: the bridge's next decision
    reads the node again and offers the remapped GPUs. The driver's view is not read
    again for a history change (its own refresh, every REFRESH seconds)."""
    from gpuguard.config import load_config
    from gpuguard.host.paths import GPU_HISTORY_FILE
    from gpuguard.readmit import Inputs
    from gpuguard.readmit.presence import NodeDevices

    root, r, bridge, said = _node(tmp_path)
    seen = {"ids": frozenset({"GPU-old-a", "GPU-old-b"})}
    reads: list[int] = []

    def inputs() -> Inputs:
        reads.append(1)
        return Inputs(load_config(root), NodeDevices.of_ids(seen["ids"], evidence), "")

    r.read_inputs = inputs
    r.inputs = inputs()
    r.prepare()
    r.on_kubelet_start()
    assert bridge.registered == [] and said[-1].startswith("readmit-skip:"), said
    seen["ids"] = frozenset({"GPU-a", "GPU-b"})
    history = root.path(GPU_HISTORY_FILE)
    history.parent.mkdir(parents=True, exist_ok=True)
    history.write_text("{}")
    r.prepare()
    r.on_kubelet_start()
    assert len(reads) == (2 if again else 1)
    if again:
        assert bridge.registered == [("nvidia.com/gpu", ("GPU-a", "GPU-b"))]
    else:
        assert bridge.registered == []


def test_a_refresh_after_the_decision_made_ahead_makes_it_stale(tmp_path: Path) -> None:
    """The order seen on a GPU Operator node with new UUIDs: the pre-start hook wrote the
    remapped checkpoint (the loop decided ahead on it, the history not yet written),
    then the history; at kubelet's start the loop's own refresh (right after it handed
    the start to its thread) read the new history first. The decision made ahead, from
    the inputs before that refresh, must not be the one kubelet's start gets."""
    from gpuguard.config import load_config
    from gpuguard.readmit import Inputs

    root, r, bridge, said = _node(tmp_path)
    seen = {"ids": frozenset({"GPU-old-a", "GPU-old-b"})}

    def inputs() -> Inputs:
        return Inputs(load_config(root), seen["ids"], "")

    r.read_inputs = inputs
    r.inputs = inputs()
    r.prepare()  # decided ahead: none of the checkpoint's GPUs present
    seen["ids"] = frozenset({"GPU-a", "GPU-b"})
    assert r.refresh()  # the loop's refresh, the checkpoint unchanged
    r.on_kubelet_start()
    assert bridge.registered == [("nvidia.com/gpu", ("GPU-a", "GPU-b"))], said
