"""The kernel's own files read through gpuguard's reader, on this machine's real /sys.

Unit tests build fake roots of regular files, which report their true size; sysfs
attributes report 4096 whatever they hold and procfs files 0, so a reader that trusted
st_size passed every fake test and refused every real attribute (the PCI GPU count was
0 on every kernel). These tests read the real /sys and /proc, read-only, through the
same code the daemon uses (devices/pci.py, safeio.read_attr), and compare with what the
kernel shows to a plain read and to `lspci -n` where it is installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gpuguard.devices.pci import NVIDIA_VENDOR, PCI_DEVICES, read_pci_functions, read_pci_gpus
from gpuguard.host.paths import Root
from gpuguard.host.safeio import read_attr

SYS_PCI = Path(PCI_DEVICES)
needs_pci = pytest.mark.skipif(
    not SYS_PCI.is_dir() or not os.listdir(SYS_PCI),
    reason="no PCI bus in /sys (a container without the host's sysfs)",
)


def plain(path: Path) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read().strip().lower()


@needs_pci
def test_sysfs_attributes_report_a_size_the_reader_must_not_trust() -> None:
    # the premise: a sysfs attribute says 4096 whatever it holds
    first = sorted(SYS_PCI.iterdir())[0]
    assert (first / "vendor").stat().st_size == 4096
    assert len(plain(first / "vendor")) < 64


@needs_pci
def test_every_pci_function_is_read_as_the_kernel_shows_it() -> None:
    functions = read_pci_functions(Root())
    expected = {}
    for d in sorted(SYS_PCI.iterdir()):
        expected[d.name] = (plain(d / "vendor"), plain(d / "device"), plain(d / "class"))
    got = {f.address: (f.vendor, f.device_id, f.klass) for f in functions}
    assert got == expected
    assert all(re.fullmatch(r"0x[0-9a-f]{4}", v) for v, _d, _c in got.values())


@needs_pci
def test_the_gpu_count_is_the_nvidia_display_functions_the_kernel_lists() -> None:
    want = sorted(
        d.name
        for d in SYS_PCI.iterdir()
        if plain(d / "vendor") == NVIDIA_VENDOR and plain(d / "class").startswith("0x03")
    )
    assert [g.address for g in read_pci_gpus(Root())] == want


@needs_pci
@pytest.mark.skipif(shutil.which("lspci") is None, reason="lspci (pciutils) is not installed")
def test_pci_functions_match_lspci() -> None:
    out = subprocess.run(
        ["lspci", "-n", "-D"], check=True, capture_output=True, text=True, timeout=30
    ).stdout
    # 0000:00:02.0 0300: 8086:5917 (rev 07)
    shown = {}
    for line in out.splitlines():
        m = re.match(r"(\S+) ([0-9a-f]{4}): ([0-9a-f]{4}):([0-9a-f]{4})", line)
        if m:
            shown[m.group(1)] = (f"0x{m.group(3)}", f"0x{m.group(4)}", f"0x{m.group(2)}")
    got = {f.address: (f.vendor, f.device_id, f.klass[:6]) for f in read_pci_functions(Root())}
    assert shown and got == shown


def test_proc_attributes_report_size_zero_and_are_read_whole() -> None:
    path = Path(f"/proc/{os.getpid()}/comm")
    assert path.stat().st_size == 0
    assert read_attr(path) == plain(path)
    status = Path(f"/proc/{os.getpid()}/status")
    assert status.stat().st_size == 0
    assert (read_attr(status) or "").startswith("Name:")


def test_a_vanished_attribute_is_none() -> None:
    assert read_attr(Path("/proc/self/no-such-attribute")) is None
