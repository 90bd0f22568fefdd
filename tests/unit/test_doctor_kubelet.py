"""gpuguard doctor finds kubelet's configuration from the running kubelet's own
arguments, on each layout (kubeadm, EKS, GKE, AKS, RKE2, k3s), and checks the pre-start
hook of the unit kubelet actually runs in; and it says when gpuguard is off or
observe-only. Fake roots: /proc/PID/{comm,cmdline,cgroup} as the kernel shows them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import pytest

from gpuguard.devices import kubelettrust, nodes
from gpuguard.devices.kubeletproc import embedded_args, kubelet_processes, parse_flags, yaml_list
from gpuguard.devices.kubelettrust import kubelet_unit
from gpuguard.doctor.kubelet import parse_config
from gpuguard.doctor.model import EXPOSED, OK, UNKNOWN
from gpuguard.doctor.run import run_doctor
from gpuguard.host.paths import KUBELET_CHECKPOINT, Root
from unit.doctor_support import INVENTORY, healthy_node, write
from unit.test_devices_support import fake_stat
from unit.test_doctor import check, runc_says

UNITS = ("kubelet.service", "k3s.service", "k3s-agent.service", "rke2-agent.service")


@pytest.fixture(autouse=True)
def fake_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nodes, "_stat", fake_stat)
    # the fake root's files are the test's: its uid stands for root
    monkeypatch.setattr(kubelettrust, "ROOT_UID", os.getuid())


def process(root: Path, pid: int, comm: str, argv: Sequence[str], unit: str, exe: str = "") -> None:
    """A process as /proc shows it, its executable where its install puts it (by
    default) or at `exe`."""
    d = root / f"proc/{pid}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "comm").write_text(comm + "\n")
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (d / "cgroup").write_text(f"0::/system.slice/{unit}\n")
    exe = exe or ("/usr/bin/kubelet" if comm == "kubelet" else "/usr/local/bin/k3s")
    binary = root / exe.lstrip("/")
    binary.parent.mkdir(parents=True, exist_ok=True)
    binary.touch()
    binary.chmod(0o755)
    if not (d / "exe").is_symlink():
        (d / "exe").symlink_to(exe)


def bare_node(tmp_path: Path) -> Path:
    """The healthy node without kubeadm's config.yaml: nothing says where kubelet's is."""
    root = healthy_node(tmp_path)
    (root / "var/lib/kubelet/config.yaml").unlink()
    return root


def doctor(root: Path, observe: bool = False):  # type: ignore[no-untyped-def]
    return run_doctor(
        Root(root), INVENTORY, KUBELET_CHECKPOINT, runc_says("1.1.12"), UNITS, observe=observe
    )


def test_eks_json_config_named_by_the_process(tmp_path: Path) -> None:
    root = bare_node(tmp_path)
    write(
        root,
        "/etc/kubernetes/kubelet/kubelet-config.json",
        '{"kind": "KubeletConfiguration", "cgroupDriver": "systemd", '
        '"cpuManagerPolicy": "none", "evictionHard": {"memory.available": "100Mi"}}',
    )
    argv = ["/usr/bin/kubelet", "--config", "/etc/kubernetes/kubelet/kubelet-config.json"]
    process(root, 900, "kubelet", argv, "kubelet.service")
    verdict, evidence, _ = check(doctor(root), "kubelet-cgroup-driver")
    assert verdict == OK
    assert evidence.startswith("/etc/kubernetes/kubelet/kubelet-config.json")
    assert "kubelet (pid 900) in kubelet.service" in evidence and "cgroupDriver=systemd" in evidence


def test_a_command_line_flag_wins_over_the_file_aks(tmp_path: Path) -> None:
    root = bare_node(tmp_path)
    write(root, "/etc/default/kubeletconfig.json", '{"cgroupDriver": "cgroupfs"}')
    argv = [
        "/usr/local/bin/kubelet",
        "--config=/etc/default/kubeletconfig.json",
        "--cgroup-driver=systemd",
        "--cpu-manager-policy",
        "static",
    ]
    process(root, 901, "kubelet", argv, "kubelet.service")
    report = doctor(root)
    assert "cgroupDriver=systemd" in check(report, "kubelet-cgroup-driver")[1]
    assert "--cgroup-driver" in check(report, "kubelet-cgroup-driver")[1]
    assert "cpuManagerPolicy=static" in check(report, "kubelet-cpu-manager")[1]


def test_gke_and_kubeadm_files_without_a_running_kubelet(tmp_path: Path) -> None:
    root = bare_node(tmp_path)
    write(root, "/home/kubernetes/kubelet-config.yaml", "cgroupDriver: systemd\n")
    verdict, evidence, _ = check(doctor(root), "kubelet-cgroup-driver")
    assert "/home/kubernetes/kubelet-config.yaml (GKE layout; no running kubelet" in evidence
    assert verdict == OK


def test_rke2_kubelet_runs_in_the_agents_unit_with_a_config_dir(tmp_path: Path) -> None:
    root = bare_node(tmp_path)
    d = "/var/lib/rancher/rke2/agent/etc/kubelet.conf.d"
    write(root, f"{d}/00-rke2-defaults.conf", "cgroupDriver: cgroupfs\n")
    write(root, f"{d}/50-site.conf", "cgroupDriver: systemd\n")  # later wins
    argv = ["kubelet", f"--config-dir={d}"]
    process(root, 902, "kubelet", argv, "rke2-agent.service")
    write(root, "/usr/lib/systemd/system/rke2-agent.service.d/10-gpuguard.conf", "[Service]\n")
    report = doctor(root)
    assert "cgroupDriver=systemd" in check(report, "kubelet-cgroup-driver")[1]
    verdict, evidence, _ = check(report, "kubelet-dropin")
    assert verdict == OK and "rke2-agent.service.d/10-gpuguard.conf" in evidence
    assert kubelet_unit(Root(root), UNITS)[0] == "rke2-agent.service"


def test_k3s_embeds_kubelet_with_its_kubelet_args(tmp_path: Path) -> None:
    root = bare_node(tmp_path)
    write(
        root,
        "/etc/rancher/k3s/config.yaml",
        'token: x\nkubelet-arg:\n  - "cpu-manager-policy=static"\n  # a comment\n'
        "  - kube-reserved=cpu=1\nnode-label: [a=b]\n",
    )
    argv = ["/usr/local/bin/k3s", "agent", "--kubelet-arg=cgroup-driver=systemd"]
    process(root, 903, "k3s-agent", argv, "k3s-agent.service")
    report = doctor(root)
    driver = check(report, "kubelet-cgroup-driver")[1]
    assert "cgroupDriver=systemd" in driver and "/etc/rancher/k3s/config.yaml" in driver
    assert "cpuManagerPolicy=static" in check(report, "kubelet-cpu-manager")[1]
    # no drop-in for k3s-agent.service: the fix names that unit
    verdict, evidence, fix = check(report, "kubelet-dropin")
    assert verdict == EXPOSED and "k3s-agent.service.d/10-gpuguard.conf" in evidence + fix


def test_k3s_without_kubelet_args_is_unknown_not_guessed(tmp_path: Path) -> None:
    root = bare_node(tmp_path)
    process(root, 904, "k3s-server", ["/usr/local/bin/k3s", "server"], "k3s.service")
    verdict, evidence, _ = check(doctor(root), "kubelet-cgroup-driver")
    assert verdict == UNKNOWN and "k3s chooses those settings itself" in evidence


def test_a_missing_config_named_by_the_process_is_unknown(tmp_path: Path) -> None:
    root = bare_node(tmp_path)
    process(root, 905, "kubelet", ["kubelet", "--config=/etc/kubelet.yaml"], "kubelet.service")
    verdict, evidence, _ = check(doctor(root), "kubelet-cgroup-driver")
    assert verdict == UNKNOWN and "/etc/kubelet.yaml: missing" in evidence


def test_off_switch_and_observe_mode(tmp_path: Path) -> None:
    root = healthy_node(tmp_path)
    assert check(doctor(root), "gpuguard-mode")[0] == OK
    v, evidence, fix = check(doctor(root, observe=True), "gpuguard-mode")
    assert (v, fix.split(" ")[0]) == (EXPOSED, "set") and "Mode=observe" in evidence
    write(root, "/etc/gpuguard/disabled", "INC-42: GPU nodes drained\n")
    report = doctor(root)
    v, evidence, fix = check(report, "gpuguard-mode")
    assert v == EXPOSED and "INC-42: GPU nodes drained" in evidence and fix == "gpuguard enable"
    assert check(report, "daemon")[2] == "gpuguard enable"


def test_flag_parsing() -> None:
    assert parse_flags(["--config", "/a", "--v=2", "--fail-swap-on", "x"]) == {
        "config": "/a",
        "v": "2",
        "fail-swap-on": "true",
    }
    argv = ["k3s", "agent", "--kubelet-arg", "config=/k.yaml", "--kubelet-arg=--v=3"]
    assert embedded_args(argv) == ["--config=/k.yaml", "--v=3"]
    assert yaml_list('kubelet-arg: ["a=1", "b=2"]\n', "kubelet-arg") == ["a=1", "b=2"]
    assert parse_config('{"cgroupDriver": "systemd", "failSwapOn": false, "x": [1]}') == {
        "cgroupDriver": "systemd",
        "failSwapOn": "false",
    }


def test_processes_that_are_not_kubelet_are_ignored(tmp_path: Path) -> None:
    root = tmp_path
    process(root, 10, "kubelet-helper", ["kubelet-helper"], "x.service")
    process(root, 11, "kubelet", ["kubelet"], "kubelet.service")
    assert [p.pid for p in kubelet_processes(Root(root))] == [11]
