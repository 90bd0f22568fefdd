"""A node laid out like the GPU Operator's: libnvidia-ml.so.1 only in the driver
container's root (/run/nvidia/driver), no configuration, the toolkit under
/usr/local/nvidia/toolkit. Through the real pynvml and the fake driver library
(tests/fakenvml): `check --dry-run` lists the GPUs from NVML and plans the remap of
GPUs back with new UUIDs, the daemon's GPU count (and `npd gpu-count`) is OK, and
doctor's GPU count is OK and names the layout. Before the driver pod starts, nothing
says the driver is broken: unknown, with the reason, until the grace period ends."""

from __future__ import annotations

import asyncio
import io
import json
import os
import time
from pathlib import Path

import pytest

import fakenvml
from conftest import log_to_stderr, require_tool
from fakenvml import FakeGpu
from gpuguard import cli, exitcodes
from gpuguard.config import load_config
from gpuguard.engine.daemon import Daemon
from gpuguard.engine.passes import Work
from gpuguard.host.notify import Notifier
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.reporting.npd import OK, UNKNOWN, answer
from gpuguard.steps.gpu_count import GpuCountStep
from unit.test_checkpoint_remap_cli import CHECKPOINT, NEW, OLD, make_root

LIB_DIR = "run/nvidia/driver/usr/lib/x86_64-linux-gnu"
LIBRARY = "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"


@pytest.fixture(autouse=True)
def _setup(monkeypatch: pytest.MonkeyPatch) -> None:
    require_tool("gcc")
    log_to_stderr(monkeypatch)


def operator_node(tmp_path: Path, driver: bool = True) -> Path:
    r = make_root(tmp_path / "node")
    (r / "etc/gpuguard/inventory.json").unlink()  # NVML, not a file
    (r / "usr/local/nvidia/toolkit").mkdir(parents=True)
    for i in range(3):  # the GPUs on the PCI bus, in make_root's slots
        d = r / f"sys/bus/pci/devices/0000:{0x82 + i:02x}:00.0"
        (d / "vendor").write_text("0x10de\n")
        (d / "device").write_text("0x20b0\n")
        (d / "class").write_text("0x030200\n")
    if driver:
        start_driver(r, OLD)
    return r


def start_driver(r: Path, uuids: list[str]) -> None:
    lib_dir = r / LIB_DIR
    if not (lib_dir / fakenvml.LIBRARY).exists():
        fakenvml.build(lib_dir)
    gpus = [FakeGpu(u, i, f"00000000:{0x82 + i:02X}:00.0") for i, u in enumerate(uuids)]
    fakenvml.write_conf(lib_dir, gpus)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    return code, capsys.readouterr().out


def test_check_lists_the_gpus_from_nvml_and_plans_the_remap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r = operator_node(tmp_path)
    check = ["check", "--root", str(r), "--only", "checkpoint", "--json"]
    code, out = run(capsys, *check)  # healthy: records the GPUs' identities
    assert code == exitcodes.OK, out
    start_driver(r, NEW)  # the driver pod back after a reboot: same slots, new UUIDs
    before = (r / CHECKPOINT).read_bytes()
    code, out = run(capsys, *check, "--dry-run")
    assert code == exitcodes.FINDINGS and (r / CHECKPOINT).read_bytes() == before
    doc = json.loads(out)
    assert [g["uuid"] for g in doc["inventory"]["gpus"]] == NEW  # listed from NVML
    assert doc["inventory"]["library"].startswith(f"{LIBRARY} (the GPU Operator's")
    (planned,) = doc["actions"]
    assert [(x["old_device_ids"], x["new_device_ids"]) for x in planned["remaps"]] == [
        ([OLD[0]], [NEW[0]]),
        ([OLD[1], OLD[2]], [NEW[1], NEW[2]]),
    ]
    code, out = run(
        capsys, "checkpoint", "inspect", "--root", str(r), "--json", str(r / CHECKPOINT)
    )
    assert json.loads(out)["inventory"] == "nvml"


def test_doctor_gpu_count_is_ok_and_names_the_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r = operator_node(tmp_path)
    _code, out = run(capsys, "doctor", "--root", str(r), "--json")
    checks = {c["check"]: c for c in json.loads(out)["checks"]}
    count = checks["gpu-count"]
    assert count["verdict"] == "ok", count
    assert count["evidence"].startswith("PCI 3, NVML 3")
    assert f"{LIBRARY} (the GPU Operator's driver root /run/nvidia/driver)" in count["evidence"]
    layout = checks["node-layout"]
    assert layout["verdict"] == "ok" and layout["evidence"].startswith(
        "GPU Operator layout: driver root /run/nvidia/driver, toolkit /usr/local/nvidia/toolkit"
    )


def test_doctor_before_the_driver_pod_says_unknown_not_broken(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r = operator_node(tmp_path, driver=False)
    _code, out = run(capsys, "doctor", "--root", str(r), "--json")
    checks = {c["check"]: c for c in json.loads(out)["checks"]}
    for name in ("driver", "gpu-count", "node-layout"):
        assert checks[name]["verdict"] == "unknown", checks[name]
    assert "driver container has not started" in checks["gpu-count"]["evidence"]
    assert "modprobe" not in json.dumps(checks)
    assert "not mounted yet" in checks["node-layout"]["evidence"]


def daemon_pass(r: Path, grace: str = "") -> tuple[Daemon, list[str]]:
    if grace:
        (r / "etc/gpuguard/gpuguard.conf").write_text(f"[Inventory]\nDriverStartGrace={grace}\n")
    root = Root(r)
    (r / f"proc/{os.getpid()}").mkdir(parents=True, exist_ok=True)  # the daemon, alive
    d = Daemon(root=root, config=load_config(root), config_path=None,
               log=EventLog(stream=io.StringIO()), notifier=Notifier(""),
               inventory_path=None, bus_address="unix:path=/nonexistent",
               steps={"gpu_count": GpuCountStep()}, step_order=("gpu_count",))  # fmt: skip
    marks: list[str] = []
    d.coalescer.mark = lambda names, why, urgent: marks.append(why)  # type: ignore[method-assign]

    async def one() -> None:
        now = time.monotonic()
        await d._run_pass(Work(frozenset({"gpu_count"}), ("test",), now, now))

    asyncio.run(one())
    return d, marks


def test_npd_gpu_count_is_ok_from_nvml(tmp_path: Path) -> None:
    r = operator_node(tmp_path)
    daemon_pass(r)
    code, message = answer(Root(r), "gpu-count")
    assert code == OK, message


def test_driver_pod_not_started_is_unknown_then_a_problem_after_the_grace(
    tmp_path: Path,
) -> None:
    r = operator_node(tmp_path, driver=False)
    d, _ = daemon_pass(r)
    code, message = answer(Root(r), "gpu-count")
    assert code == UNKNOWN and "driver container has not started" in message, message
    assert d._followups, "the step looks again soon for the driver"
    assert min(d._followups.values()) - time.monotonic() < 6
    (r / "run/gpuguard/status.json").unlink()
    daemon_pass(r, grace="0")
    code, message = answer(Root(r), "gpu-count")
    assert code == 1 and "grace period" in message, message


def test_status_says_which_library(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = operator_node(tmp_path)
    _code, out = run(capsys, "status", "--root", str(r))
    assert f"GPUs from:  NVML {LIBRARY} (the GPU Operator's driver root /run/nvidia/driver)" in out
    _code, out = run(capsys, "status", "--root", str(r), "--json")
    assert json.loads(out)["gpus_from"].startswith(f"NVML {LIBRARY}")
    (r / LIB_DIR / "fakenvml.conf").unlink()  # the driver unloaded
    _code, out = run(capsys, "status", "--root", str(r), "--json")
    assert "has not loaded the NVIDIA kernel driver" in json.loads(out)["gpus_from"]


def test_doctor_reads_the_operators_toolkit_containerd_and_cdi(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r = operator_node(tmp_path)
    conf = r / "usr/local/nvidia/toolkit/.config/nvidia-container-runtime/config.toml"
    conf.parent.mkdir(parents=True)
    conf.write_text('[nvidia-container-runtime]\nmode = "cdi"\n')
    dropin = r / "etc/containerd/conf.d/99-nvidia.toml"
    dropin.parent.mkdir(parents=True)
    dropin.write_text(
        'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  enable_cdi = true\n'
        '[plugins."io.containerd.grpc.v1.cri".containerd]\n  default_runtime_name = "nvidia"\n'
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n'
        '  runtime_type = "io.containerd.runc.v2"\n'
    )
    (r / "var/run/cdi").mkdir(parents=True)
    (r / "var/run/cdi/nvidia.yaml").write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\n")
    _code, out = run(capsys, "doctor", "--root", str(r), "--json")
    checks = {c["check"]: c for c in json.loads(out)["checks"]}
    toolkit = checks["toolkit-mode"]
    assert toolkit["verdict"] == "ok" and str(conf.relative_to(r)) in toolkit["evidence"], toolkit
    runtime = checks["container-runtime"]
    assert runtime["verdict"] == "ok", runtime
    assert "/etc/containerd/conf.d/99-nvidia.toml: default runtime nvidia" in runtime["evidence"]
    layout = checks["node-layout"]["evidence"]
    assert (
        "CDI specs /var/run/cdi/nvidia.yaml (toolkit mode=cdi, containerd enable_cdi=true)"
    ) in layout, layout
    assert "toolkit config /usr/local/nvidia/toolkit/.config/" in layout, layout
    assert not layout.endswith("…"), "cut: the evidence must fit"
