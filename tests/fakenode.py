"""A fake GPU node under a directory, and the CLI run in-process against it.

The root holds what gpuguard reads on a host: /proc/devices, the host's NVIDIA nodes
(real character nodes made with mknod, in the test directory only), a cgroup v1
devices hierarchy with kubepods containers (devices.list, devices.allow, cgroup.procs
as regular files), each container's process (/proc/PID/root/dev, environ, cmdline),
and optionally a kubelet checkpoint. Used by the hostile-input regressions and by the
fuzz suite (tests/fuzz/).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence
from unittest import mock

from gpuguard import cli
from gpuguard.checkpoint import Checkpoint, PodDevicesEntry, marshal
from gpuguard.journal.log import EventLog

CHECKPOINT = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"
BACKUPS = "/var/lib/gpuguard/backups"
V1 = "/sys/fs/cgroup/devices"
NVIDIA, UVM = 195, 511
PROC_DEVICES = (
    f"Character devices:\n  1 mem\n{NVIDIA} nvidia\n{UVM} nvidia-uvm\n\nBlock devices:\n  8 sd\n"
)
# What runc leaves in a container's devices.list: no GPU (a daemon-reload wiped it).
RUNC_LIST = "c 1:3 rwm\nc 1:5 rwm\nc 1:7 rwm\nc 5:0 rwm\nc 5:2 rwm\nc 136:* rwm\n"
EXIT_CODES = {0, 1, 2, 3, 4, 5}  # docs/operations.md's table, less 70 (a bug)


def gpu_uuid(minor: int) -> str:
    return f"GPU-{minor:08x}-0000-4000-8000-{minor:012x}"


def inventory(n_gpus: int) -> dict[str, Any]:
    return {
        "gpus": [
            {
                "uuid": gpu_uuid(i),
                "index": i,
                "minor": i,
                "pci_bus_id": f"00000000:{i + 16:02X}:00.0",
            }
            for i in range(n_gpus)
        ]
    }


@dataclass(frozen=True)
class FakeContainer:
    pod: int  # pod number (its UID is derived from it)
    number: int  # container number (its ID and PID are derived from it)
    gpus: tuple[int, ...]  # minors in its /dev
    visible: Optional[str] = None  # NVIDIA_VISIBLE_DEVICES; None: the UUIDs of `gpus`
    devices_list: str = RUNC_LIST
    cgroup_procs: Optional[str] = None  # None: its PID

    @property
    def pod_uid(self) -> str:
        return f"{self.pod:08x}-aaaa-4bbb-8ccc-{self.pod:012x}"

    @property
    def container_id(self) -> str:
        return f"{self.number:064x}"

    @property
    def pid(self) -> int:
        return 1000 + self.number

    @property
    def cgroup(self) -> str:
        return f"{V1}/kubepods/pod{self.pod_uid}/{self.container_id}"


def _mknod(path: Path, major: int, minor: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))


def _nodes(dev: Path, gpus: Sequence[int]) -> None:
    for minor in gpus:
        _mknod(dev / f"nvidia{minor}", NVIDIA, minor)
    _mknod(dev / "nvidiactl", NVIDIA, 255)
    _mknod(dev / "nvidia-uvm", UVM, 0)
    _mknod(dev / "nvidia-uvm-tools", UVM, 1)


def write(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)


def checkpoint_for(containers: Sequence[FakeContainer]) -> bytes:
    """A valid v2 checkpoint giving each pod the GPUs in its containers' /dev."""
    entries = tuple(
        PodDevicesEntry(
            c.pod_uid,
            f"c{c.number}",
            "nvidia.com/gpu",
            (("0", tuple(gpu_uuid(m) for m in c.gpus)),),
            b"",
        )
        for c in containers
        if c.gpus
    )
    registered = (
        ("nvidia.com/gpu", tuple(sorted({gpu_uuid(m) for c in containers for m in c.gpus}))),
    )
    return marshal(Checkpoint("v2", entries, registered, 0, None))


def build_node(
    base: Path,
    containers: Sequence[FakeContainer],
    *,
    n_gpus: int = 2,
    proc_devices: str = PROC_DEVICES,
    checkpoint: Optional[bytes] = None,
) -> Path:
    """The node under `base`; returns the inventory file's path."""
    write(base / "proc/devices", proc_devices)
    _nodes(base / "dev", range(n_gpus))
    write(base / V1.lstrip("/") / "devices.list", "a *:* rwm\n")
    for c in containers:
        cg = base / c.cgroup.lstrip("/")
        write(cg / "devices.list", c.devices_list)
        write(cg / "devices.allow", "")
        procs = f"{c.pid}\n" if c.cgroup_procs is None else c.cgroup_procs
        write(cg / "cgroup.procs", procs)
        proc = base / f"proc/{c.pid}"
        _nodes(proc / "root/dev", c.gpus)
        visible = c.visible if c.visible is not None else ",".join(gpu_uuid(m) for m in c.gpus)
        write(proc / "environ", f"PATH=/bin\0NVIDIA_VISIBLE_DEVICES={visible}\0")
        write(proc / "cmdline", b"/usr/bin/python3\0app.py\0")
    if checkpoint is not None:
        write(base / CHECKPOINT.lstrip("/"), checkpoint)
    inv = base / "inventory.json"
    write(inv, json.dumps(inventory(n_gpus)))
    return inv


def tree(root: Path) -> dict[str, str]:
    """Every entry under `root`: kind, mode and content hash (or link target, device)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            rel = str(p.relative_to(root))
            if stat.S_ISREG(st.st_mode):
                out[rel] = f"f {st.st_mode:o} " + hashlib.sha256(p.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = "l " + os.readlink(p)
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                out[rel] = f"d {st.st_mode:o} {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
            else:
                out[rel] = f"o {st.st_mode:o}"
    return out


@dataclass(frozen=True)
class Run:
    code: int
    out: str
    err: str

    def json(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.out)
        return doc


class _Stdout(io.TextIOWrapper):
    """A stdout with a .buffer, as `checkpoint canonical` writes bytes."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO(), encoding="utf-8", errors="replace", write_through=True)

    def getvalue(self) -> str:
        raw = self.buffer
        assert isinstance(raw, io.BytesIO)
        return raw.getvalue().decode("utf-8", errors="replace")


@contextlib.contextmanager
def _captured() -> Iterator[tuple[_Stdout, io.StringIO]]:
    out, err = _Stdout(), io.StringIO()

    def auto(
        cls: type[EventLog],
        *,
        level: str = "info",
        force_json: bool = False,
        root: Path = Path("/"),
    ) -> EventLog:
        return cls(level=level, stream=err)  # captured, never the host's journal

    with (
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        mock.patch.object(EventLog, "auto", classmethod(auto)),
    ):
        yield out, err


def run_cli(*argv: str) -> Run:
    """gpuguard.cli.main(argv) in this process; SystemExit (argparse) counts as its code."""
    with _captured() as (out, err):
        try:
            code = cli.main(list(argv))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
    return Run(code, out.getvalue(), err.getvalue())


ERROR_LINE_MAX = 520  # "gpuguard: " and the 500 characters cli.ERROR_MAX keeps
LOG_LINE_MAX = 2100  # a journal entry as text: journal.log.MESSAGE_MAX, level and kind
_LOG_LEVELS = ("debug: ", "info: ", "notice: ", "warning: ", "error: ")


def assert_clean(run: Run, argv: Sequence[str] = ()) -> None:
    """No traceback, a documented exit code (70 is a bug), errors on one bounded line,
    every line printable (nothing echoed raw)."""
    assert "Traceback" not in run.err, (argv, run.err[-3000:])
    assert run.code in EXIT_CODES, (argv, run.code, run.err[-3000:])
    for line in run.err.splitlines():
        if line.startswith("gpuguard: "):
            log = line[len("gpuguard: ") :].startswith(_LOG_LEVELS)
            assert len(line) <= (LOG_LINE_MAX if log else ERROR_LINE_MAX), (argv, line[:300])
            assert line.isprintable(), (argv, line[:300])
            assert "set_int_max_str_digits" not in line, line


# Where a file should be, what a hostile or broken host may have put instead.
PLACEMENTS = ("fifo", "dev-zero", "link-dev-zero", "link-outside", "directory", "huge", "absent")


def place(path: Path, kind: str, data: bytes = b"") -> None:
    """Put `kind` at `path`: `data` as a regular file ("bytes"), a FIFO nobody writes, a
    character device like /dev/zero (mknod: root, in the test's directory), a link to
    /dev/zero, a link to a file outside the root, a directory, 64 MiB of zeros (sparse),
    or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "bytes":
        path.write_bytes(data)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        os.mknod(path, stat.S_IFCHR | 0o644, os.makedev(1, 5))
    elif kind == "link-dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "link-outside":
        path.symlink_to("/etc/hostname")
    elif kind == "directory":
        path.mkdir()
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(64 * 1024 * 1024)
    elif kind != "absent":
        raise ValueError(kind)


def python_exe() -> str:
    return sys.executable
