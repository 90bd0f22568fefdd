"""Run a function in a forked child placed in a process's cgroups, and read its report.

The skeleton both of gpuguard's probes stand on: `devices/probe.py` (may this cgroup
open a device node?) and the device plugin step's NVML probe (can NVML start where a
plugin stands?). Only the kernel's own checks answer those questions faithfully, and
they apply to a process by the cgroup it is in, so the question is asked by a child
that joins the cgroup(s) first:

1. fork; the child writes its pid into each ``cgroup.procs`` (a v1 devices directory
   and/or a v2 directory: v1 the devices controller only, so no other controller sees
   it), calls ``work()`` and writes its bytes, framed, to a pipe, then ``_exit``\\ s;
2. the parent reads the report with a timeout, SIGKILLs a child that does not answer
   (a frozen cgroup, a hung driver, a loader lock a thread of the parent held at the
   fork) and always reaps it, so nothing is left behind: the child leaves the cgroup
   with its exit.

Why a fork and not a thread: moving into a cgroup moves the calling process, and the
daemon must stay in its own. Call :func:`run_in_cgroups` from a worker thread of the
daemon; it blocks up to ``timeout``. ``work`` runs in the child only: it may change the
child's state at will (namespaces, capabilities), never the parent's.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from gpuguard.devices.cgroupnames import parse_proc_cgroup
from gpuguard.devices.containers import detect_layout
from gpuguard.host.paths import Root
from gpuguard.host.safeio import proc_text

# Report frame: status (1 byte), errno (int32), payload length (uint32), payload.
_HEADER = struct.Struct("<BiI")
MAX_REPORT = 60000  # below a pipe's 64 KiB, so the child's one write never waits

DONE = "done"  # work() returned; `data` is what it returned
JOIN = "join"  # the child could not join a cgroup; `data` names its cgroup.procs
ERROR = "error"  # work() raised; `data` is the exception's repr
TIMEOUT = "timeout"  # no whole report in time; the child was killed
_STATUS = {0: DONE, 1: JOIN, 2: ERROR}


@dataclass(frozen=True)
class ChildReport:
    status: str  # DONE | JOIN | ERROR | TIMEOUT
    data: bytes = b""
    errno: int = 0  # JOIN: why joining failed

    @property
    def text(self) -> str:
        return self.data.decode(errors="replace")


def _child(procs_files: Sequence[bytes], work: Callable[[], bytes], wfd: int) -> None:
    """Runs in the forked child: join, work, report, _exit (never returns)."""
    status, err, data = 2, 0, b"unexpected error"
    try:
        pid = str(os.getpid()).encode()
        joined = True
        for pf in procs_files:
            try:
                # never through a link, never waiting on a FIFO put in its place
                fd = os.open(pf, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
                try:
                    os.write(fd, pid)
                finally:
                    os.close(fd)
            except OSError as e:
                status, err, data, joined = 1, e.errno or 0, pf, False
                break
        if joined:
            try:
                status, data = 0, work()[:MAX_REPORT]
            except BaseException as e:  # anything must become a report
                status, data = 2, repr(e).encode(errors="replace")[:MAX_REPORT]
    finally:
        try:
            os.write(wfd, _HEADER.pack(status, err, len(data)) + data)
        finally:
            os._exit(0)


def _read_exactly(rfd: int, need: int, deadline: float) -> Optional[bytes]:
    data = b""
    while len(data) < need:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([rfd], [], [], left)
        if not ready:
            return None
        chunk = os.read(rfd, need - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def run_in_cgroups(
    cgroup_dirs: Sequence[Path], work: Callable[[], bytes], *, timeout: float
) -> ChildReport:
    """``work()`` in a child placed in every directory of ``cgroup_dirs`` (host paths
    under the root; empty: the child stays in ours). Returns once the child is reaped."""
    procs = [os.fsencode(d / "cgroup.procs") for d in cgroup_dirs]
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        os.close(rfd)
        _child(procs, work, wfd)
    os.close(wfd)
    report: Optional[ChildReport] = None
    try:
        deadline = time.monotonic() + timeout
        head = _read_exactly(rfd, _HEADER.size, deadline)
        if head is not None:
            code, err, size = _HEADER.unpack(head)
            data = _read_exactly(rfd, size, deadline)
            if data is not None and code in _STATUS:
                report = ChildReport(_STATUS[code], data, err)
    finally:
        os.close(rfd)
        if report is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return report or ChildReport(TIMEOUT)


def process_cgroup_dirs(root: Root, pid: int) -> list[Path]:
    """The v1 devices directory and the v2 directory of process ``pid`` (those that
    exist, host paths under the root): where a child must go to stand where it stands."""
    try:
        text = proc_text(root.path(f"/proc/{pid}/cgroup"))
    except OSError:
        return []
    by = parse_proc_cgroup(text)
    v1, v2 = by.get("devices", ""), by.get("", "")
    layout = detect_layout(root)
    out: list[Path] = []
    for mount, rel in ((layout.v1_devices, v1), (layout.v2, v2)):
        if mount and rel:
            d = root.path(f"{mount.rstrip('/')}/{rel.lstrip('/')}".rstrip("/") or "/")
            if d.is_dir():
                out.append(d)
    return out
