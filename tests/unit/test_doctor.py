"""gpuguard doctor on fake roots: one healthy node, then each check driven to each verdict."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional, Sequence

import pytest

from gpuguard import cli
from gpuguard.devices import nodes
from gpuguard.doctor.facts import plugin_settings
from gpuguard.doctor.model import BROKEN, EXPOSED, OK, UNKNOWN, Report
from gpuguard.doctor.run import run_doctor
from gpuguard.doctor.textconf import Unreadable, toml_scalars, yaml_top_scalars
from gpuguard.host.inventory import Inventory
from gpuguard.host.paths import KUBELET_CHECKPOINT, Root
from unit.doctor_support import (
    INVENTORY,
    UUIDS,
    healthy_node,
    pci_gpu,
    plugin_process,
    status_file,
    write,
    write_checkpoint,
)
from unit.test_devices_support import fake_stat


@pytest.fixture(autouse=True)
def fake_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nodes, "_stat", fake_stat)


def runc_says(version: str, toolkit: str = "1.17.8") -> Callable[[Sequence[str]], str]:
    def run(argv: Sequence[str]) -> str:
        assert argv[-1] == "--version"
        if argv[0].endswith("nvidia-container-runtime"):
            return f"NVIDIA Container Runtime version {toolkit}\ncommit: 0123abc\n"
        return f"runc version {version}\ncommit: v{version}\nspec: 1.0.2-dev\n"

    return run


def doctor(
    root: Path, inv: Optional[Inventory] = INVENTORY, runc: str = "1.1.12", toolkit: str = "1.17.8"
) -> Report:
    return run_doctor(Root(root), inv, KUBELET_CHECKPOINT, runc_says(runc, toolkit))


def verdicts(report: Report) -> dict[str, str]:
    return {c.name: c.verdict for c in report.checks}


def check(report: Report, name: str) -> tuple[str, str, str]:
    c = next(c for c in report.checks if c.name == name)
    return c.verdict, c.evidence, c.fix


def test_healthy_node_is_ok_everywhere(tmp_path: Path) -> None:
    report = doctor(healthy_node(tmp_path))
    assert set(verdicts(report).values()) == {OK}, report.render()
    assert report.exit_code == 0
    assert check(report, "gpu-count")[1] == "PCI 2, NVML 2, kubelet 2 (nvidia.com/gpu)"
    assert "mode=cdi" in check(report, "toolkit-mode")[1]
    assert "default runtime nvidia" in check(report, "container-runtime")[1]


def test_legacy_mode_without_device_specs_is_exposed(tmp_path: Path) -> None:
    root = healthy_node(tmp_path)
    write(
        root,
        "/etc/nvidia-container-runtime/config.toml",
        '[nvidia-container-runtime]\nmode = "legacy"\n',
    )
    plugin_process(root, ["nvidia-device-plugin", "--device-list-strategy=envvar"], ["PATH=/bin"])
    report = doctor(root)
    v = verdicts(report)
    assert v["toolkit-mode"] == EXPOSED
    assert v["device-plugin"] == EXPOSED
    assert v["kubelet-cgroup-driver"] == EXPOSED  # systemd driver: daemon-reload drops GPUs
    assert v["kubelet-cpu-manager"] == EXPOSED  # static policy: runc update drops them
    assert report.verdict == EXPOSED and report.exit_code == 1
    assert "compatWithCPUManager" in check(report, "kubelet-cpu-manager")[2]


def test_legacy_mode_with_pass_device_specs_is_ok(tmp_path: Path) -> None:
    root = healthy_node(tmp_path)
    write(
        root,
        "/etc/nvidia-container-runtime/config.toml",
        '[nvidia-container-runtime]\nmode = "legacy"\n',
    )
    plugin_process(root, ["nvidia-device-plugin", "--pass-device-specs"], [])
    v = verdicts(doctor(root))
    assert v["toolkit-mode"] == v["device-plugin"] == v["kubelet-cgroup-driver"] == OK


def test_cgroupfs_driver_and_no_cpu_manager_are_ok_even_in_legacy_mode(tmp_path: Path) -> None:
    root = healthy_node(tmp_path)
    write(
        root,
        "/etc/nvidia-container-runtime/config.toml",
        '[nvidia-container-runtime]\nmode = "legacy"\n',
    )
    config = "kind: KubeletConfiguration\ncgroupDriver: cgroupfs\ncpuManagerPolicy: none\n"
    write(root, "/var/lib/kubelet/config.yaml", config)
    v = verdicts(doctor(root))
    assert v["kubelet-cgroup-driver"] == OK and v["kubelet-cpu-manager"] == OK
    # a key that is not set is not seen to be at kubelet's default: unknown, never OK
    write(root, "/var/lib/kubelet/config.yaml", "kind: KubeletConfiguration\n")
    v = verdicts(doctor(root))
    assert v["kubelet-cgroup-driver"] == UNKNOWN and v["kubelet-cpu-manager"] == UNKNOWN


@pytest.mark.parametrize(
    "breakage, name, reason",
    [
        (
            lambda r: os.remove(r / "etc/nvidia-container-runtime/config.toml"),
            "toolkit-mode",
            "config.toml missing",
        ),
        (
            lambda r: write(
                r, "/etc/nvidia-container-runtime/config.toml", "[nvidia-container-runtime]\n"
            ),
            "toolkit-mode",
            "mode=auto (unset): legacy or jit-cdi by toolkit version, which is unknown",
        ),
        (
            lambda r: os.remove(r / "var/lib/kubelet/config.yaml"),
            "kubelet-cgroup-driver",
            "none of /var/lib/kubelet/config.yaml",
        ),
        (
            lambda r: write(
                r,
                "/etc/containerd/config.toml",
                'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n'
                '  default_runtime_name = "runc"\n',
            ),
            "container-runtime",
            "no nvidia runtime",
        ),
        (
            lambda r: os.remove(r / "etc/containerd/config.toml"),
            "container-runtime",
            "no containerd or CRI-O",
        ),
        (lambda r: os.remove(r / "proc/777/comm"), "device-plugin", "no nvidia-device-plugin"),
        (lambda r: os.remove(r / "usr/bin/runc"), "runc", "no runc"),
        (
            lambda r: os.remove(r / "usr/lib/x86_64-linux-gnu/systemd/libsystemd-shared-252.so"),
            "systemd",
            "no libsystemd-shared",
        ),
        (
            lambda r: write(r, "/run/gpuguard/status.json", '{"pid": 42, "last_pa'),
            "daemon",
            "not JSON",
        ),
        (lambda r: write(r, "/run/gpuguard/status.json", "[1, 2]"), "daemon", "not an object"),
        (
            lambda r: os.remove(r / "sys/fs/cgroup/cgroup.controllers"),
            "cgroup-layout",
            "neither cgroup.controllers nor devices/",
        ),
    ],
)
def test_unreadable_or_missing_evidence_is_unknown_with_the_reason(
    tmp_path: Path, breakage: Callable[[Path], object], name: str, reason: str
) -> None:
    root = healthy_node(tmp_path)
    breakage(root)
    verdict, evidence, _ = check(doctor(root), name)
    assert verdict == UNKNOWN
    assert reason in evidence


def test_unreadable_file_is_unknown_not_a_traceback(tmp_path: Path) -> None:
    root = healthy_node(tmp_path)
    p = root / "etc/nvidia-container-runtime/config.toml"
    p.unlink()
    p.mkdir()  # reading a directory fails with EISDIR even for root
    verdict, evidence, _ = check(doctor(root), "toolkit-mode")
    assert (
        verdict == UNKNOWN and "cannot read /etc/nvidia-container-runtime/config.toml" in evidence
    )


def test_crio_nvidia_runtime_is_found(tmp_path: Path) -> None:
    root = healthy_node(tmp_path)
    os.remove(root / "etc/containerd/config.toml")
    write(
        root,
        "/etc/crio/crio.conf.d/99-nvidia.conf",
        '[crio.runtime]\ndefault_runtime = "nvidia"\n[crio.runtime.runtimes.nvidia]\n'
        'runtime_path = "/usr/bin/nvidia-container-runtime"\n',
    )
    verdict, evidence, _ = check(doctor(root), "container-runtime")
    assert verdict == OK and "99-nvidia.conf: default runtime nvidia" in evidence


def test_driver_not_loaded_is_broken(tmp_path: Path) -> None:
    root = healthy_node(tmp_path)
    write(root, "/proc/devices", "Character devices:\n  1 mem\n")
    report = doctor(root)
    assert check(report, "driver")[0] == BROKEN
    assert check(report, "dev-char-links")[0] == UNKNOWN
    assert report.verdict == BROKEN and report.exit_code == 1


def test_missing_uvm_node_is_exposed_missing_gpu_node_broken(tmp_path: Path) -> None:
    root = healthy_node(tmp_path)
    os.remove(root / "dev/nvidia-uvm")
    verdict, evidence, _ = check(doctor(root), "driver")
    assert verdict == EXPOSED and "/dev/nvidia-uvm" in evidence and "F3" in evidence
    os.remove(root / "dev/nvidia1")
    assert check(doctor(root), "driver")[0] == BROKEN


def test_missing_dev_char_link_is_exposed_and_makes_old_runc_exposed(tmp_path: Path) -> None:
    root = healthy_node(tmp_path)
    assert check(doctor(root, runc="1.1.5"), "runc")[0] == OK  # links present
    os.remove(root / "dev/char/195:1")
    report = doctor(root, runc="1.1.5+ds1")
    verdict, evidence, fix = check(report, "dev-char-links")
    assert verdict == EXPOSED and "/dev/char/195:1 missing" in evidence and "create-dev-char" in fix
    assert check(report, "runc")[0] == EXPOSED
    assert check(doctor(root, runc="1.1.7"), "runc")[0] == OK
    assert check(doctor(root, runc="1.2.5"), "runc")[0] == OK


def test_masked_or_missing_dropin_is_exposed(tmp_path: Path) -> None:
    root = healthy_node(tmp_path)
    os.remove(root / "usr/lib/systemd/system/kubelet.service.d/10-gpuguard.conf")
    assert check(doctor(root), "kubelet-dropin")[0] == EXPOSED
    masked = root / "etc/systemd/system/kubelet.service.d/10-gpuguard.conf"
    masked.parent.mkdir(parents=True)
    os.symlink("/dev/null", masked)
    verdict, evidence, _ = check(doctor(root), "kubelet-dropin")
    assert verdict == EXPOSED and "masked" in evidence


def test_daemon_states(tmp_path: Path) -> None:
    root = healthy_node(tmp_path)
    assert "last pass 3" in check(doctor(root), "daemon")[1]
    status_file(root, age=5 * 3600)
    assert check(doctor(root), "daemon")[0] == EXPOSED
    os.rmdir(root / "proc/4242")
    verdict, evidence, _ = check(doctor(root), "daemon")
    assert verdict == EXPOSED and "pid 4242 is gone" in evidence
    os.remove(root / "run/gpuguard/status.json")
    verdict, evidence, _ = check(doctor(root), "daemon")
    assert verdict == EXPOSED and "not running" in evidence


def test_gpu_count_says_which_layer_lost_gpus(tmp_path: Path) -> None:
    root = healthy_node(tmp_path)
    pci_gpu(root, "0000:13:00.0")  # a third GPU NVML does not see
    verdict, evidence, fix = check(doctor(root), "gpu-count")
    assert verdict == BROKEN and "NVML sees 2 of the 3" in evidence and "dmesg" in fix
    os.rename(root / "sys/bus/pci/devices/0000:13:00.0", root / "pci-gone")
    write_checkpoint(root, UUIDS[:1])  # the plugin registered one of two
    verdict, evidence, fix = check(doctor(root), "gpu-count")
    assert verdict == BROKEN and "kubelet has 1 of 2" in evidence and "device plugin" in fix
    write_checkpoint(root, [*UUIDS, "GPU-33333333-3333-3333-3333-333333333333"])
    assert "stale registrations" in check(doctor(root), "gpu-count")[1]
    write_checkpoint(root, [f"{u}::{r}" for u in UUIDS for r in range(4)])  # time-slicing
    assert check(doctor(root), "gpu-count")[0] == OK


def test_gpu_count_without_nvml_while_gpus_are_on_the_bus_names_the_driver(
    tmp_path: Path,
) -> None:
    root = healthy_node(tmp_path)
    write_checkpoint(root, UUIDS[:1])
    verdict, evidence, fix = check(doctor(root, inv=None), "gpu-count")
    assert verdict == BROKEN and "NVML is unavailable while 2 NVIDIA GPU(s)" in evidence
    assert "driver" in evidence and "dkms status" in fix


def test_plugin_flags_win_over_environment() -> None:
    s = plugin_settings(
        ["p", "--pass-device-specs=false", "--device-list-strategy", "cdi-cri"],
        {"PASS_DEVICE_SPECS": "true"},
        1,
    )
    assert (s.strategy, s.pass_device_specs) == ("cdi-cri", False)
    s = plugin_settings(["p"], {}, 1)
    assert (s.strategy, s.pass_device_specs) == ("envvar", False)


def test_text_readers_take_only_what_they_understand() -> None:
    toml = (
        'a = 1\n[x."y.z".w]\nk = "v" # c\narr = [1, 2]\n[[t]]\nk = "no"\n'
        "[s]\nlit = 'single'\nb = true\n"
    )
    assert toml_scalars(toml) == {"a": "1", "x.y.z.w.k": "v", "s.lit": "single", "s.b": "true"}
    yaml = 'cgroupDriver: "systemd"\nnested:\n  cgroupDriver: cgroupfs\nx: {a: 1}\n'
    assert yaml_top_scalars(yaml) == {"cgroupDriver": "systemd"}
    with pytest.raises(Unreadable, match="not valid YAML"):  # kubelet refuses it too
        yaml_top_scalars(yaml + "- item\n")


def test_cli_doctor_json_and_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = healthy_node(tmp_path)
    inv = write(root, "/inventory.json", json.dumps(INVENTORY.to_json()))
    (root / "usr/bin/runc").write_text("#!/bin/sh\necho 'runc version 1.1.12'\n")
    code = cli.main(["doctor", "--root", str(root), "--inventory", str(inv), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["verdict"] == OK and doc["exit_code"] == 0
    assert {c["check"] for c in doc["checks"]} >= {"toolkit-mode", "gpu-count", "runc", "daemon"}
    os.remove(root / "dev/char/195:0")
    assert cli.main(["doctor", "--root", str(root), "--inventory", str(inv)]) == 1
    out = capsys.readouterr().out
    assert "EXPOSED  dev-char-links" in out and out.rstrip().endswith("node: exposed")


def test_pci_listing_fewer_than_nvml_is_unknown_not_broken(tmp_path: Path) -> None:
    root = healthy_node(tmp_path)
    os.rename(root / "sys/bus/pci/devices/0000:11:00.0", root / "elsewhere")
    verdict, evidence, _ = check(doctor(root), "gpu-count")
    assert verdict == UNKNOWN and "NVML sees more GPUs than this /sys lists" in evidence


def test_dropin_not_loaded_by_systemd_is_exposed(tmp_path: Path) -> None:
    root = healthy_node(tmp_path)
    vendor = "/usr/lib/systemd/system/kubelet.service.d/10-gpuguard.conf"
    answers = {"systemctl": "/etc/systemd/system/kubelet.service.d/10-kubeadm.conf\n"}

    def run(argv: Sequence[str]) -> str:
        if argv[0] == "systemctl":
            assert argv[1:] == ["show", "kubelet.service", "-p", "DropInPaths", "--value"]
            return answers["systemctl"]
        return runc_says("1.1.12")(argv)

    from gpuguard.doctor.facts import gather
    from gpuguard.doctor.judge import judge

    def verdict() -> tuple[str, str, str]:
        return check(judge(gather(Root(root), INVENTORY, None, run, live=True)), "kubelet-dropin")

    v, evidence, fix = verdict()
    assert v == EXPOSED and "not in kubelet.service's DropInPaths" in evidence
    assert fix == "systemctl daemon-reload"
    answers["systemctl"] = f"/etc/x.conf {vendor}\n"
    assert verdict()[0] == OK


def test_unreadable_plugin_environment_is_unknown(tmp_path: Path) -> None:
    root = healthy_node(tmp_path)
    write(
        root,
        "/etc/nvidia-container-runtime/config.toml",
        '[nvidia-container-runtime]\nmode = "legacy"\n',
    )
    env = root / "proc/777/environ"
    env.unlink()
    env.mkdir()  # EISDIR stands in for EACCES (root reads everything)
    report = doctor(root)
    verdict, evidence, _ = check(report, "device-plugin")
    assert verdict == UNKNOWN and "cannot read /proc/777" in evidence and "run as root" in evidence
    assert check(report, "kubelet-cgroup-driver")[0] == UNKNOWN  # not wrongly "exposed"


def test_auto_mode_is_legacy_before_118_and_jit_cdi_since(tmp_path: Path) -> None:
    root = healthy_node(tmp_path)
    write(
        root,
        "/etc/nvidia-container-runtime/config.toml",
        '[nvidia-container-runtime]\nmode = "auto"\n',
    )
    plugin_process(root, ["nvidia-device-plugin"], [])  # envvar strategy, no device specs
    write(root, "/usr/bin/nvidia-container-runtime", "").chmod(0o755)
    verdict, evidence, _ = check(doctor(root, toolkit="1.17.8"), "toolkit-mode")
    assert verdict == EXPOSED and "mode=auto, which is legacy for toolkit 1.17.8" in evidence
    report = doctor(root, toolkit="1.18.0")
    verdict, evidence, _ = check(report, "toolkit-mode")
    assert verdict == OK and "which is jit-cdi for toolkit 1.18.0" in evidence
    assert check(report, "device-plugin")[0] == OK  # jit-cdi covers it
    assert check(report, "kubelet-cgroup-driver")[0] == OK
