"""NVML wherever the driver is, through the real pynvml and the fake libnvidia-ml.so.1
(tests/fakenvml): the host's loader path, the GPU Operator's driver root, a configured
driver root, and NVML's errors (driver not loaded, unknown error, a GPU lost)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import fakenvml
from conftest import require_tool
from fakenvml import DRIVER_NOT_LOADED, GPU_IS_LOST, UNKNOWN, FakeGpu
from gpuguard.errors import NoDriverError
from gpuguard.host.inventory import DriverPendingError, load_inventory
from gpuguard.host.nvmllib import CONFIGURED, HOST, OPERATOR, NvmlLookup, find_library
from gpuguard.host.paths import Root

THREE = fakenvml.gpus(3)


@pytest.fixture(autouse=True)
def _gcc() -> None:
    require_tool("gcc")


def operator_root(root: Path, gpu_list: list[FakeGpu] | None = THREE) -> Path:
    """The Operator's layout: the library only in the driver container's root, reached
    through the absolute link its own loader would follow."""
    lib_dir = root / "run/nvidia/driver/usr/lib/x86_64-linux-gnu"
    fakenvml.build(lib_dir, "libnvidia-ml.so.580.82.07")
    os.symlink("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.82.07", lib_dir / fakenvml.LIBRARY)
    (root / "usr/local/nvidia/toolkit").mkdir(parents=True)
    if gpu_list is not None:
        fakenvml.write_conf(lib_dir, gpu_list)
    return lib_dir


def test_host_loader_path(tmp_path: Path) -> None:
    lib = fakenvml.build(tmp_path / "usr/lib64")
    fakenvml.write_conf(lib.parent, THREE)
    inv = load_inventory(None, NvmlLookup(Root(tmp_path)))
    assert [g.uuid for g in inv.gpus] == [g.uuid for g in THREE]
    assert [g.pci_bus_id for g in inv.gpus] == [g.bus_id for g in THREE]
    assert [g.minor for g in inv.gpus] == [0, 1, 2] and inv.driver_version == "580.82.07"
    assert inv.source == "nvml"
    assert inv.library == "/usr/lib64/libnvidia-ml.so.1 (the host's loader path)"


def test_ld_so_conf_directories_and_includes(tmp_path: Path) -> None:
    lib = fakenvml.build(tmp_path / "opt/nvidia/lib")
    fakenvml.write_conf(lib.parent, THREE[:1])
    (tmp_path / "etc/ld.so.conf.d").mkdir(parents=True)
    (tmp_path / "etc/ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    (tmp_path / "etc/ld.so.conf.d/nvidia.conf").write_text("# driver\n/opt/nvidia/lib\n")
    found = find_library(NvmlLookup(Root(tmp_path)))
    assert found is not None and found.layout == HOST
    assert found.shown == "/opt/nvidia/lib/libnvidia-ml.so.1"


def test_operator_driver_root_only(tmp_path: Path) -> None:
    operator_root(tmp_path)
    inv = load_inventory(None, NvmlLookup(Root(tmp_path)))
    assert len(inv.gpus) == 3
    assert inv.library == (
        "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1 "
        "(the GPU Operator's driver root /run/nvidia/driver)"
    )
    found = find_library(NvmlLookup(Root(tmp_path)))
    assert found is not None and found.layout == OPERATOR
    # the absolute link was followed inside the driver root, never on the host
    assert found.real == str(
        tmp_path / "run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.82.07"
    )


def test_host_library_comes_before_the_operator_root(tmp_path: Path) -> None:
    operator_root(tmp_path)
    host = fakenvml.build(tmp_path / "usr/lib/x86_64-linux-gnu")
    fakenvml.write_conf(host.parent, THREE[:1])
    inv = load_inventory(None, NvmlLookup(Root(tmp_path)))
    assert len(inv.gpus) == 1 and "host's loader path" in inv.library


def test_configured_driver_root(tmp_path: Path) -> None:
    lib = fakenvml.build(tmp_path / "opt/driver/usr/lib64")
    fakenvml.write_conf(lib.parent, THREE[:2])
    with pytest.raises(NoDriverError, match="not found in"):
        load_inventory(None, NvmlLookup(Root(tmp_path)))
    inv = load_inventory(None, NvmlLookup(Root(tmp_path), "/opt/driver"))
    assert len(inv.gpus) == 2
    assert inv.library.endswith("([Inventory] DriverRoot= /opt/driver)")
    found = find_library(NvmlLookup(Root(tmp_path), "/opt/driver/"))
    assert found is not None and found.layout == CONFIGURED


def test_a_library_others_may_write_is_not_loaded(tmp_path: Path) -> None:
    lib = fakenvml.build(tmp_path / "usr/lib64")
    lib.chmod(0o666)
    assert find_library(NvmlLookup(Root(tmp_path))) is None


def test_operator_driver_container_not_started(tmp_path: Path) -> None:
    (tmp_path / "usr/local/nvidia/toolkit").mkdir(parents=True)
    with pytest.raises(DriverPendingError, match="driver container has not started") as e:
        load_inventory(None, NvmlLookup(Root(tmp_path)))
    assert "/run/nvidia/driver" in e.value.message and "\n" not in e.value.message


def test_no_library_on_a_plain_node_is_no_driver(tmp_path: Path) -> None:
    with pytest.raises(NoDriverError) as e:
        load_inventory(None, NvmlLookup(Root(tmp_path)))
    assert not isinstance(e.value, DriverPendingError)
    assert "libnvidia-ml.so.1 not found" in e.value.message and e.value.exit_code == 4


def test_driver_not_loaded(tmp_path: Path) -> None:
    lib = fakenvml.build(tmp_path / "usr/lib64")  # no fakenvml.conf: no kernel driver
    with pytest.raises(NoDriverError, match="modprobe nvidia") as e:
        load_inventory(None, NvmlLookup(Root(tmp_path)))
    assert not isinstance(e.value, DriverPendingError)
    fakenvml.write_conf(lib.parent, THREE, init_error=DRIVER_NOT_LOADED)
    with pytest.raises(NoDriverError, match="not loaded"):
        load_inventory(None, NvmlLookup(Root(tmp_path)))


def test_driver_not_loaded_in_the_operator_root_is_pending(tmp_path: Path) -> None:
    operator_root(tmp_path, gpu_list=None)
    with pytest.raises(DriverPendingError, match="has not loaded the NVIDIA kernel driver"):
        load_inventory(None, NvmlLookup(Root(tmp_path)))


def test_driver_appearing_late(tmp_path: Path) -> None:
    """Nothing, then the driver container's root with its library, then the driver
    loaded: each read sees what is there now (the library re-reads at nvmlInit)."""
    (tmp_path / "usr/local/nvidia/toolkit").mkdir(parents=True)
    lookup = NvmlLookup(Root(tmp_path))
    with pytest.raises(DriverPendingError, match="not started"):
        load_inventory(None, lookup)
    lib_dir = tmp_path / "run/nvidia/driver/usr/lib64"
    fakenvml.build(lib_dir)
    with pytest.raises(DriverPendingError, match="not loaded"):
        load_inventory(None, lookup)
    fakenvml.write_conf(lib_dir, THREE)
    assert len(load_inventory(None, lookup).gpus) == 3


def test_a_gpu_lost(tmp_path: Path) -> None:
    lib = fakenvml.build(tmp_path / "usr/lib64")
    lost = [THREE[0], FakeGpu(THREE[1].uuid, 1, THREE[1].bus_id, code=GPU_IS_LOST)]
    fakenvml.write_conf(lib.parent, lost)
    with pytest.raises(NoDriverError, match="GPU is lost") as e:
        load_inventory(None, NvmlLookup(Root(tmp_path)))
    assert "NVML query failed" in e.value.message and "/usr/lib64" in e.value.message
    fakenvml.write_conf(lib.parent, THREE[:1])  # the lost GPU gone from the driver
    assert len(load_inventory(None, NvmlLookup(Root(tmp_path))).gpus) == 1


@pytest.mark.parametrize("where", ["init", "count"])
def test_nvml_unknown_error(tmp_path: Path, where: str) -> None:
    lib = fakenvml.build(tmp_path / "usr/lib64")
    kw = {"init_error": UNKNOWN} if where == "init" else {"count_error": UNKNOWN}
    fakenvml.write_conf(lib.parent, THREE, **kw)
    with pytest.raises(NoDriverError, match="Unknown Error") as e:
        load_inventory(None, NvmlLookup(Root(tmp_path)))
    assert not isinstance(e.value, DriverPendingError) and "\n" not in e.value.message


def test_mig_devices(tmp_path: Path) -> None:
    lib = fakenvml.build(tmp_path / "usr/lib64")
    mig = FakeGpu(THREE[0].uuid, 0, THREE[0].bus_id, mig=(("MIG-aaaa", 1, 0), ("MIG-bbbb", 2, 0)))
    fakenvml.write_conf(lib.parent, [mig, THREE[1]])
    inv = load_inventory(None, NvmlLookup(Root(tmp_path)))
    assert [(m.uuid, m.gi, m.ci) for m in inv.gpus[0].mig] == [
        ("MIG-aaaa", 1, 0),
        ("MIG-bbbb", 2, 0),
    ]
    assert inv.gpus[1].mig == () and inv.mig_uuids() == {"MIG-aaaa", "MIG-bbbb"}
