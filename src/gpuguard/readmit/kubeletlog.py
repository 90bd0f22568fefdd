"""Where the bridge reads kubelet's own log lines after a kubelet start, from that
kubelet's start on and nothing of an earlier kubelet.

* The journal, through python3-systemd's ``systemd.journal.Reader``, matched on the
  fields journald itself sets (a process cannot forge them): ``_SYSTEMD_UNIT`` the
  kubelet unit, ``_PID`` its main process (kubelet's stderr: a helper it runs, a
  ``logger`` or ``systemd-cat`` in its cgroup has another PID), ``_BOOT_ID`` this
  boot; from that process's start (the unit's ExecMainStartTimestampMonotonic, a
  boot-relative time no clock step moves); one line per entry.
* The same through ``journalctl -o json`` where python3-systemd is missing (said
  once in the journal): no pattern matching, so no PCRE2 needed.
* A log file (``[Kubelet] LogFile=``: RKE2's kubelet writes
  /var/lib/rancher/rke2/agent/logs/kubelet.log): through the bounded reader, from
  its size when the bridge saw kubelet.sock (kubelet writes its admissions after
  that; the lines before the position are an earlier kubelet's or this one's start),
  root's file that only root may write; text records must carry the PID of the
  kubelet process in the unit.

A read that fails raises LogUnreadable, one line saying what and the next step.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gpuguard.errors import GpuguardError
from gpuguard.host import commands
from gpuguard.host.echo import cut
from gpuguard.host.numparse import parse_decimal
from gpuguard.host.paths import Root
from gpuguard.host.safeio import UnsafeFileError, read_range
from gpuguard.host.statefile import SchemaError, parse_json
from gpuguard.readmit.klog import Line

MAX_LINES = 20_000  # lines taken per read; the rest the next time
READ_MAX = 4 * 1024 * 1024  # bytes of a log file per read
LINE_MAX = 64 * 1024  # a file's line longer than this is skipped whole


class LogUnreadable(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class KubeletRun:
    """The kubelet process whose records count, as systemd and /proc tell it."""

    unit: str
    pid: int  # 0: not told (``why`` says why)
    started_usec: int  # its start, CLOCK_MONOTONIC microseconds (0: not told)
    why: str = ""


def _show(unit: str) -> dict[str, str]:
    argv = [
        "systemctl",
        "show",
        "--property=MainPID",
        "--property=ExecMainStartTimestampMonotonic",
        unit,
    ]
    try:
        res = commands.run(argv, timeout=10)
    except (commands.CommandError, GpuguardError) as e:
        return {"error": str(e)}
    if res.returncode != 0:
        return {"error": f"systemctl show {unit} exited {res.returncode}: {res.stderr.strip()}"}
    out = {}
    for line in res.stdout.splitlines():
        k, sep, v = line.partition("=")
        if sep:
            out[k] = v.strip()
    return out


def kubelet_run(root: Root, unit: str, in_unit: bool) -> KubeletRun:
    """The kubelet of ``unit`` now: its main process (kubelet itself, or k3s which
    runs kubelet inside it); ``in_unit``: the kubelet process in the unit's cgroup
    (RKE2 runs kubelet as a child of rke2-agent.service)."""
    shown = _show(unit)
    if "error" in shown:
        return KubeletRun(unit, 0, 0, cut(shown["error"], 200))
    main = parse_decimal(shown.get("MainPID", ""), lo=0, hi=2**22) or 0
    started = parse_decimal(shown.get("ExecMainStartTimestampMonotonic", ""), lo=0) or 0
    if not in_unit:
        if main == 0:
            return KubeletRun(unit, 0, 0, f"{unit} has no main process (is kubelet its unit?)")
        return KubeletRun(unit, main, started)
    from gpuguard.devices.kubeletproc import kubelet_processes

    pids = [p.pid for p in kubelet_processes(root) if p.unit == unit]
    if main in pids:
        return KubeletRun(unit, main, started)
    if len(pids) == 1:
        return KubeletRun(unit, pids[0], 0)
    said = "no kubelet process" if not pids else f"{len(pids)} kubelet processes"
    return KubeletRun(unit, 0, 0, f"{said} in {unit}")


class Source(Protocol):
    def read(self) -> tuple[Line, ...]: ...

    def close(self) -> None: ...


def have_reader() -> bool:
    try:
        import systemd.journal  # noqa: F401
    except ImportError:
        return False
    return True


class JournalReader:
    """kubelet's entries through systemd.journal.Reader (python3-systemd)."""

    def __init__(self, run: KubeletRun) -> None:
        from systemd import journal

        self.started = run.started_usec
        try:
            self.r: Any = journal.Reader()
            self.r.this_boot()
            self.r.add_match(_SYSTEMD_UNIT=run.unit, _PID=str(run.pid))
            if run.started_usec:
                self.r.seek_monotonic(run.started_usec / 1e6)
        except OSError as e:
            raise LogUnreadable(f"the journal cannot be opened ({e.strerror})") from None

    def read(self) -> tuple[Line, ...]:
        out: list[Line] = []
        try:
            self.r.process()  # journal files added or rotated since
            while len(out) < MAX_LINES and self.r._next():
                mono, _boot = self.r._get_monotonic()
                if mono < self.started:
                    continue
                try:
                    msg = self.r._get("MESSAGE")
                except KeyError:
                    continue
                text = msg.decode("utf-8", "replace") if isinstance(msg, bytes) else str(msg)
                out.append(Line(text, self.r._get_realtime() / 1e6))
        except OSError as e:
            raise LogUnreadable(f"reading the journal failed ({e.strerror})") from None
        return tuple(out)

    def close(self) -> None:
        self.r.close()


class Journalctl:
    """The same entries through ``journalctl -o json`` (no python3-systemd)."""

    def __init__(self, run: KubeletRun) -> None:
        self.run = run
        self.cursor = ""

    def read(self) -> tuple[Line, ...]:
        argv = ["journalctl", "--no-pager", "-o", "json", "--output-fields=MESSAGE", "-b"]
        argv += [f"_SYSTEMD_UNIT={self.run.unit}", f"_PID={self.run.pid}"]
        if self.cursor:
            argv.append(f"--after-cursor={self.cursor}")
        try:
            res = commands.run(argv, timeout=10)
        except (commands.CommandError, GpuguardError) as e:
            raise LogUnreadable(cut(str(e), 200)) from None
        if res.returncode != 0:
            err = res.stderr.strip().splitlines()
            raise LogUnreadable(
                f"journalctl exited {res.returncode}: {cut(err[0] if err else '', 200)}"
            )
        out: list[Line] = []
        for raw in res.stdout.splitlines():
            try:
                entry = parse_json(raw.encode("utf-8", "replace"))
            except SchemaError:
                continue
            if not isinstance(entry, dict):
                continue
            if len(out) >= MAX_LINES:  # the rest the next time, from this cursor on
                break
            if isinstance(entry.get("__CURSOR"), str):
                self.cursor = entry["__CURSOR"]
            mono = parse_decimal(str(entry.get("__MONOTONIC_TIMESTAMP", "")), lo=0) or 0
            if mono < self.run.started_usec:
                continue
            msg = entry.get("MESSAGE")
            if isinstance(msg, list) and all(isinstance(b, int) and 0 <= b < 256 for b in msg):
                msg = bytes(msg).decode("utf-8", "replace")
            if not isinstance(msg, str):
                continue
            real = parse_decimal(str(entry.get("__REALTIME_TIMESTAMP", "")), lo=0) or 0
            out.append(Line(msg, real / 1e6 if real else time.time()))
        return tuple(out)

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Position:
    """Where a log file stood when kubelet made kubelet.sock."""

    ino: int  # 0: the file was not there (kubelet makes it: read from its start)
    offset: int


def position(path: Path) -> Position:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return Position(0, 0)
    return Position(st.st_ino, st.st_size if stat.S_ISREG(st.st_mode) else 0)


class LogFile:
    """kubelet's log file, read on from its position at kubelet's start."""

    def __init__(self, path: Path, at: Position, check_owner: bool) -> None:
        self.path = path
        self.ino = at.ino
        self.offset = at.offset
        self.check_owner = check_owner
        self.skipping = False  # inside a line longer than LINE_MAX

    def _trusted(self, st: os.stat_result) -> None:
        if (self.check_owner and st.st_uid != 0) or st.st_mode & 0o022:
            raise LogUnreadable(
                f"{self.path}: not root's file that only root may write "
                f"(owner {st.st_uid}, mode {stat.filemode(st.st_mode)}): not read; "
                "make it root's, mode 0644 or tighter"
            )

    def read(self) -> tuple[Line, ...]:
        try:
            data, st = read_range(
                self.path,
                what="kubelet log",
                offset=self.offset,
                max_bytes=READ_MAX,
                missing="does not exist — is [Kubelet] LogFile= the file kubelet writes?",
            )
            self._trusted(st)
            if st.st_ino != self.ino or st.st_size < self.offset:  # replaced or truncated
                self.ino, self.offset, self.skipping = st.st_ino, 0, False
                data, st = read_range(self.path, what="kubelet log", offset=0, max_bytes=READ_MAX)
        except UnsafeFileError as e:
            raise LogUnreadable(cut(e.message, 300)) from None
        end = data.rfind(b"\n")
        if end < 0:
            if len(data) >= LINE_MAX:  # one line too long to be a record: skipped
                self.offset += len(data)
                self.skipping = True
            return ()
        whole = data[: end + 1]
        self.offset += len(whole)
        lines = whole.split(b"\n")[:-1]
        if self.skipping and lines:
            lines, self.skipping = lines[1:], False
        now = time.time()
        return tuple(
            Line(b[:LINE_MAX].decode("utf-8", "replace"), now) for b in lines if len(b) <= LINE_MAX
        )

    def close(self) -> None:
        pass
