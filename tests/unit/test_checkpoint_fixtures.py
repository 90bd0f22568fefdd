"""Every real kubelet checkpoint parses, verifies and is written back byte for byte."""

from __future__ import annotations

import csv

import pytest

from conftest import CHECKPOINTS
from gpuguard.checkpoint import load, marshal, parse, render, verify
from gpuguard.checkpoint.spew import checksum, fnv1a_32

REAL = CHECKPOINTS
FILES = sorted(REAL.glob("*.json"))


def _provenance() -> dict[str, dict[str, str]]:
    with open(REAL / "PROVENANCE.tsv", newline="") as f:
        return {row["file"]: row for row in csv.DictReader(f, delimiter="\t")}


def test_all_fixtures_present() -> None:
    assert len(FILES) == 12
    assert {f.name for f in FILES} == set(_provenance())


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_fixture_round_trip(path) -> None:  # type: ignore[no-untyped-def]
    raw = path.read_bytes()
    row = _provenance()[path.name]
    cp = parse(raw, source=str(path))
    assert cp.checksum == int(row["checksum"])
    assert verify(cp)
    assert checksum(cp) == fnv1a_32(render(cp).encode()) == cp.checksum
    assert marshal(cp) == raw  # already in Go's canonical form
    assert marshal(cp, checksum=cp.checksum) == raw
    # "v2+v1": no pod entries, so v1 and v2 kubelets hash it the same
    assert cp.format == ("any" if row["verified_format"] == "v2+v1" else "v2")
    loaded = load(path)
    assert loaded.valid and loaded.problem == "" and loaded.raw == raw


def test_tegra_rendering_is_the_documented_string() -> None:
    cp = parse((REAL / "gpu-lab-tegra.json").read_bytes(), source="tegra")
    assert render(cp) == (
        "(checkpoint.checkpointData){PodDeviceEntries:([]checkpoint.PodDevicesEntry)"
        "[{PodUID:(string)bf52b2cd-b611-4e79-86b1-280b283185c3 ContainerName:(string)check "
        "ResourceName:(string)nvidia.com/gpu DeviceIDs:(checkpoint.DevicesPerNUMA)"
        "map[-1:[tegra]] AllocResp:([]uint8)[10 31 10 22 78 86 73 68 73 65 95 86 73 83 73 "
        "66 76 69 95 68 69 86 73 67 69 83 18 5 116 101 103 114 97]}] "
        "RegisteredDevices:(map[string][]string)map[nvidia.com/gpu:[tegra]]}"
    )
    e = cp.entries[0] if cp.entries else None
    assert e is not None and e.numa_nodes == (-1,) and e.all_device_ids() == ("tegra",)


def test_multi_numa_entry_accessors() -> None:
    cp = parse((REAL / "numa-blog-09.json").read_bytes(), source="09")
    assert cp.entries is not None
    e = cp.entries[0]
    assert e.numa_nodes == (0, 1)
    assert e.all_device_ids() == (
        "GPU-77a702db-e37f-3a74-d46d-c5713f66058c",
        "GPU-9b341c59-f96b-ba85-c137-78c3652fea65",
    )
    assert cp.registered_dict()["nvidia.com/gpu"] is not None
    assert len(cp.all_device_ids()) == 3
