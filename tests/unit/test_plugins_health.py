"""The pure device plugin reconciler: tables of observations -> findings and restarts."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest

from gpuguard.devices.nodes import ROLE_OTHER
from gpuguard.devices.plugins import NodeInfo, PluginInfo, resource_for_socket
from gpuguard.devices.processes import ProcessInfo, classify_cgroup, process_info
from gpuguard.host.paths import Root
from gpuguard.steps.device_plugin.observe import ContainerDev, PluginObservation
from gpuguard.steps.device_plugin.reconcile import (
    CAUSE_STALE,
    CAUSE_UNREGISTERED,
    K_CONTAINER_NO_UVM,
    K_MISSING_DEVICE,
    K_NOT_REGISTERED,
    K_NOT_SERVING,
    assess,
)

T0 = 1_700_000_000.0
CID = "a" * 64
UVM_MAJOR = 510


def node(path: str, major: int, minor: int, ctime: float = T0 - 1000) -> NodeInfo:
    return NodeInfo(path, major, minor, ROLE_OTHER, ctime=ctime)


GPU0 = node("/dev/nvidia0", 195, 0)
CTL = node("/dev/nvidiactl", 195, 255)
UVM = node("/dev/nvidia-uvm", UVM_MAJOR, 0, T0 + 50)
UVM_TOOLS = node("/dev/nvidia-uvm-tools", UVM_MAJOR, 1, T0 + 50)
HOST = (GPU0, CTL, UVM, UVM_TOOLS)


def proc(start: float = T0, pid: int = 4242, **kw: str) -> ProcessInfo:
    base = dict(kind="container", container_id=CID, runtime="containerd", pod_uid="p-1")
    base.update(kw)
    return ProcessInfo(pid, start, "nvidia-device-plugin", **base)


def plugin(
    dev: Optional[tuple[NodeInfo, ...]],
    process: Optional[ProcessInfo] = None,
    *,
    ctime: float = T0,
    name: str = "nvidia-gpu.sock",
) -> PluginInfo:
    sock = f"/var/lib/kubelet/device-plugins/{name}"
    return PluginInfo(sock, resource_for_socket(name), ctime, process or proc(), dev)


def obs(*plugins: PluginInfo, **kw: object) -> PluginObservation:
    args: dict[str, object] = dict(now=T0 + 600, host_nodes=HOST, kubelet_started=None)
    args.update(kw)
    return PluginObservation(plugins=tuple(plugins), **args)  # type: ignore[arg-type]


def test_healthy_plugin_sees_every_host_node() -> None:
    r = assess(obs(plugin(HOST)), registration_grace=120)
    assert r.findings == () and r.actions == ()
    assert r.healthy == ("nvidia.com/gpu",)


def test_seed_004_plugin_without_uvm_is_restarted() -> None:
    r = assess(obs(plugin((GPU0, CTL))), registration_grace=120)
    (f,) = r.findings
    # warning: gpuguard acts on it, and the restart (or why not) is journaled on its own
    assert f.kind == K_MISSING_DEVICE and f.severity == "warning"
    assert f.fields["MISSING"] == "/dev/nvidia-uvm /dev/nvidia-uvm-tools"
    assert "(absent from its /dev: /dev/nvidia-uvm, /dev/nvidia-uvm-tools)" in f.summary
    (a,) = r.actions
    assert a.cause == CAUSE_STALE and a.identity == "nvidia.com/gpu"
    assert a.fields()["CONTAINER_ID"] == CID
    assert a.missing == ("/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


def test_node_with_other_numbers_counts_as_missing() -> None:
    old_uvm = node("/dev/nvidia-uvm", 509, 0)
    r = assess(obs(plugin((GPU0, CTL, old_uvm, UVM_TOOLS))), registration_grace=120)
    (a,) = r.actions
    assert a.missing == ("/dev/nvidia-uvm",)
    summary = r.findings[0].summary
    # present, with the numbers of before the module reload: not "absent"
    assert f"(present with stale numbers: /dev/nvidia-uvm (509:0, host has {UVM_MAJOR}:0))" in (
        summary
    )
    assert "absent" not in summary and "lacks" not in summary


def test_absent_and_stale_nodes_are_told_apart() -> None:
    old_uvm = node("/dev/nvidia-uvm", 509, 0)
    r = assess(obs(plugin((GPU0, CTL, old_uvm))), registration_grace=120)
    (a,) = r.actions
    assert a.missing == ("/dev/nvidia-uvm-tools", "/dev/nvidia-uvm")
    assert (
        "(absent from its /dev: /dev/nvidia-uvm-tools; present with stale numbers: "
        f"/dev/nvidia-uvm (509:0, host has {UVM_MAJOR}:0))"
    ) in r.findings[0].summary


@pytest.mark.parametrize(
    ("uvm_ctime", "stale"),
    [(T0 + 50, True), (T0 - 50, False), (T0 + 1, False)],  # +1: within start precision
)
def test_unreadable_view_uses_node_creation_vs_plugin_start(uvm_ctime: float, stale: bool) -> None:
    host = (GPU0, CTL, node("/dev/nvidia-uvm", UVM_MAJOR, 0, uvm_ctime))
    r = assess(obs(plugin(None), host_nodes=host), registration_grace=120)
    assert bool(r.actions) == stale


def test_no_driver_no_verdict() -> None:
    r = assess(obs(plugin(()), host_nodes=()), registration_grace=120)
    assert r.findings == () and r.actions == ()


def test_socket_without_listener_is_reported_not_restarted() -> None:
    p = PluginInfo(
        "/var/lib/kubelet/device-plugins/nvidia-gpu.sock", "nvidia.com/gpu", T0, None, None
    )
    r = assess(obs(p), registration_grace=120)
    assert [f.kind for f in r.findings] == [K_NOT_SERVING] and r.actions == ()


# -- F4: kubelet restart without re-registration ------------------------------------

KUBELET = T0 + 300


@pytest.mark.parametrize(
    ("now", "sock_ctime", "expect"),
    [
        (KUBELET + 60, T0, False),  # inside the grace period: wait
        (KUBELET + 121, T0, True),  # grace over, socket predates kubelet's start
        (KUBELET + 121, KUBELET + 5, False),  # re-registered in time
        (KUBELET + 5000, KUBELET + 200, False),  # registered late, but registered
    ],
)
def test_registration_after_kubelet_restart(now: float, sock_ctime: float, expect: bool) -> None:
    o = obs(plugin(HOST, ctime=sock_ctime), now=now, kubelet_started=KUBELET)
    r = assess(o, registration_grace=120)
    assert (K_NOT_REGISTERED in [f.kind for f in r.findings]) == expect
    assert bool(r.actions) == expect
    if expect:
        assert r.actions[0].cause == CAUSE_UNREGISTERED


def test_socket_gone_and_process_alive_restarts_the_remembered_process() -> None:
    p = proc()
    o = obs(now=KUBELET + 121, kubelet_started=KUBELET, remembered={"nvidia.com/gpu": p})
    r = assess(o, registration_grace=120)
    (a,) = r.actions
    assert a.process == p and a.cause == CAUSE_UNREGISTERED and a.socket == ""
    assert "socket is gone" in r.findings[0].summary


def test_socket_gone_and_process_gone_is_only_reported() -> None:
    o = obs(now=KUBELET + 121, kubelet_started=KUBELET, remembered={"nvidia.com/gpu": None})
    r = assess(o, registration_grace=120)
    assert [f.kind for f in r.findings] == [K_NOT_REGISTERED] and r.actions == ()
    assert "nothing to restart" in r.findings[0].summary


def test_kubelet_not_running_means_no_registration_verdict() -> None:
    o = obs(plugin(HOST, ctime=T0), now=T0 + 99999, kubelet_started=None)
    assert assess(o, registration_grace=120).findings == ()


def test_stale_and_unregistered_is_one_restart() -> None:
    o = obs(plugin((GPU0, CTL), ctime=T0), now=KUBELET + 500, kubelet_started=KUBELET)
    r = assess(o, registration_grace=120)
    assert len(r.actions) == 1 and r.actions[0].cause == CAUSE_STALE
    assert {f.kind for f in r.findings} == {K_MISSING_DEVICE, K_NOT_REGISTERED}


# -- GPU containers without uvm --------------------------------------------------------


def test_gpu_container_without_uvm_must_be_recreated() -> None:
    bad = ContainerDev("b" * 64, "pod-b", "containerd", 10, (GPU0, CTL))
    good = ContainerDev("c" * 64, "pod-c", "containerd", 11, (GPU0, CTL, UVM))
    cpu = ContainerDev("d" * 64, "pod-d", "containerd", 12, ())
    r = assess(obs(plugin((GPU0, CTL)), containers=(bad, good, cpu)), registration_grace=120)
    (f,) = [f for f in r.findings if f.kind == K_CONTAINER_NO_UVM]
    assert f.fields["CONTAINER_ID"] == "b" * 64 and "recreated" in f.summary
    assert "nvidia.com/gpu" in f.summary  # names the stale plugin


def test_no_uvm_on_host_no_container_finding() -> None:
    c = ContainerDev("b" * 64, "pod-b", "containerd", 10, (GPU0, CTL))
    r = assess(
        obs(plugin((GPU0, CTL)), host_nodes=(GPU0, CTL), containers=(c,)), registration_grace=1
    )
    assert r.findings == ()


# -- heuristics --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "resource"),
    [
        ("nvidia-gpu.sock", "nvidia.com/gpu"),
        ("nvidia.sock", "nvidia.com/gpu"),
        ("nvidia-mig-1g.10gb.sock", "nvidia.com/mig-1g.10gb"),
        ("nvidia-gpu.shared.sock", "nvidia.com/gpu.shared"),
        ("kubelet.sock", ""),
        ("rdma-hca.sock", ""),
    ],
)
def test_socket_name_heuristic(name: str, resource: str) -> None:
    assert resource_for_socket(name) == resource


def test_socket_name_extra_patterns_come_first() -> None:
    assert resource_for_socket("aliyungpushare.sock", {"aliyun*.sock": "aliyun.com/gpu-mem"}) == (
        "aliyun.com/gpu-mem"
    )


@pytest.mark.parametrize(
    ("cgroup", "expect"),
    [
        (
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1234_ab.slice/"
            f"cri-containerd-{CID}.scope",
            ("container", CID, "containerd", "1234-ab", ""),
        ),
        (f"/kubepods/besteffort/pod1234-ab/{CID}", ("container", CID, "unknown", "1234-ab", "")),
        (f"/custom-root/kubepods/pod99/crio-{CID}", ("container", CID, "cri-o", "99", "")),
        (
            "/system.slice/nvidia-device-plugin.service",
            ("service", "", "", "", "nvidia-device-plugin.service"),
        ),
        ("/user.slice/user-0.slice/session-1.scope", ("process", "", "", "", "")),
    ],
)
def test_classify_cgroup(cgroup: str, expect: tuple[str, ...]) -> None:
    assert classify_cgroup(cgroup) == expect


_SCOPE = (
    "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1234_ab.slice/"
    f"cri-containerd-{CID}.scope"
)


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        # unified node: only the cgroup2 line
        (f"0::{_SCOPE}\n", ("container", CID, "containerd", "1234-ab")),
        # unified systemd on a kernel that still has v1 hierarchies: the devices line
        # is the namespace's root, the container is in the cgroup2 line (issue 12)
        (
            f"12:name=systemd:/\n5:devices:/\n4:memory:/\n0::{_SCOPE}\n",
            ("container", CID, "containerd", "1234-ab"),
        ),
        # hybrid node: the devices line names it (cgroup2 sits elsewhere)
        (
            f"5:devices:/kubepods/besteffort/pod1234-ab/{CID}\n0::/\n",
            ("container", CID, "unknown", "1234-ab"),
        ),
        (
            "5:devices:/\n0::/system.slice/nvidia-device-plugin.service\n",
            ("service", "", "", ""),
        ),
        ("5:devices:/\n0::/user.slice/session-1.scope\n", ("process", "", "", "")),
    ],
)
def test_plugin_process_is_a_container_on_either_layout(
    tmp_path: Path, text: str, expect: tuple[str, ...]
) -> None:
    proc = tmp_path / "proc/4242"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(text)
    (proc / "comm").write_text("nvidia-device-p\n")
    (proc / "stat").write_text("4242 (nvidia-device-p) S " + "0 " * 18 + "100 0 0\n")
    info = process_info(Root(tmp_path), 4242, btime=T0)
    assert info is not None
    assert (info.kind, info.container_id, info.runtime, info.pod_uid) == expect
