"""kubelet's start, told by what a touch cannot fake: the process that listens on
``kubelet.sock``.

kubelet's device manager removes ``kubelet.sock`` and makes a new one at each start.
The socket's ctime is no witness: a chmod, chown, touch, restorecon or setxattr
changes it, and the socket may get its old inode number again. What tells a start:

- the listener: a connect to the socket (harmless: kubelet's registration server
  accepts and waits for a Register; it is closed at once) and SO_PEERCRED give the
  pid of the process that listens, /proc/PID/stat field 22 its start in clock ticks
  since boot (CLOCK_BOOTTIME, the base /proc/stat's btime is the wall-clock time of).
  A new (pid, start) is a new kubelet run; a new inode with the same listener is not
  (where /proc/PID/stat cannot be read, the pid alone tells the process);
- where no listener can be read (no permission, not a socket, nobody listening: a
  kubelet that stopped, or one between its bind and its listen), the inode alone: a new
  (device, inode) is a new run, never a new ctime alone. An inode number used again by
  a kubelet whose listener cannot be read then goes unseen: said in ``note``.

It stays cheap: every look is one ``stat``; the socket is connected to only when the
stat changed (or the last connect found nobody listening, which a listen() that follows
its bind() ends without changing the stat). The connect goes through an O_PATH
descriptor of the file just looked at, so it reaches that inode, whatever the length
of its path.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
import stat
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from gpuguard.devices.processes import start_ticks
from gpuguard.host.paths import Root

CLK_TCK = os.sysconf("SC_CLK_TCK")
CONNECT_TIMEOUT = 0.5  # seconds; kubelet's server accepts at once
UNSETTLED = 2.0  # seconds after a change of the socket that a refusal is looked at again
# a connect that may succeed at the next look: nobody listens yet, the backlog is full
_TRANSIENT = {errno.ECONNREFUSED, errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR}


def boottime() -> float:
    """Seconds since boot, suspend included (the clock /proc/PID/stat's start is on)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@dataclass(frozen=True)
class Listener:
    """The process that listens on the socket (SO_PEERCRED: who called listen())."""

    pid: int
    uid: int
    start_ticks: Optional[int]  # /proc/PID/stat field 22: clock ticks since boot

    @property
    def boot_s(self) -> Optional[float]:
        return self.start_ticks / CLK_TCK if self.start_ticks is not None else None


@dataclass(frozen=True)
class Look:
    """One look at kubelet.sock: its stat and, where read, its listener."""

    dev: int
    ino: int
    ctime_ns: int
    listener: Optional[Listener]
    why_not: str = ""  # why no listener was read ("" when it was)
    transient: bool = False  # the reason may be gone at the next look


def peer(root: Root, fd: int) -> tuple[Optional[Listener], str, bool]:
    """(listener, why not, transient) of the socket file open as O_PATH ``fd``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(CONNECT_TIMEOUT)
        try:
            s.connect(f"/proc/self/fd/{fd}")
        except OSError as e:
            code = e.errno or 0
            return None, f"connect: {os.strerror(code) if code else e}", code in _TRANSIENT
        creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    finally:
        s.close()
    pid, uid, _gid = struct.unpack("3i", creds)
    if pid <= 0:
        return None, "no peer process (SO_PEERCRED)", False
    # no readable /proc/PID/stat (another /proc): the pid alone tells the process
    return Listener(pid, uid, start_ticks(root, pid)), "", False


def look(root: Root, path: Path) -> Optional[Look]:
    """kubelet.sock looked at, its listener read (None: no such file)."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISSOCK(st.st_mode):
            return Look(st.st_dev, st.st_ino, st.st_ctime_ns, None, "not a socket")
        listener, why, transient = peer(root, fd)
        return Look(st.st_dev, st.st_ino, st.st_ctime_ns, listener, why, transient)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class KubeletStart:
    """One kubelet run, as first told; equal to another only by ``key``."""

    key: str  # "pid:PID:TICKS" (its listener) or "inode:DEV:INO" (no listener read)
    dev: int = field(compare=False)
    ino: int = field(compare=False)
    listener: Optional[Listener] = field(compare=False)
    ctime: float = field(compare=False)  # the socket's ctime at this run's first look
    seen_boot: float = field(compare=False)  # boottime() at this run's first look
    # the wall clock's offset from boottime() when the listener was first read: the
    # start in Unix time is stamped once, like a file's time, so a later clock step
    # moves neither it nor the plugin sockets' ctimes it is compared with
    offset: float = field(default=0.0, compare=False)
    note: str = field(default="", compare=False)  # why the inode alone tells it
    # the note's reason may be gone at the next look (nobody listening yet: kubelet
    # between its bind and its listen), when the listener is read and the run kept
    transient: bool = field(default=False, compare=False)

    @property
    def boot_s(self) -> Optional[float]:
        """The listener's start, seconds since boot (None: no listener read)."""
        return self.listener.boot_s if self.listener is not None else None

    def wall(self) -> float:
        """Unix time of the start: the listener's, on the wall clock as it was when it
        was first read, else the socket's ctime at this run's first look (a later
        touch does not move it)."""
        b = self.boot_s
        return self.offset + b if b is not None else self.ctime

    def told_by(self) -> str:
        if self.listener is not None:
            return f"kubelet.sock's listener (pid {self.listener.pid})"
        return f"kubelet.sock's inode only ({self.note})"


def _offset() -> float:
    """Unix time minus boottime(): /proc/stat's btime, unrounded, now."""
    return time.time() - boottime()


def _start(lk: Look, now_boot: float) -> KubeletStart:
    if lk.listener is not None:
        ticks = lk.listener.start_ticks
        key = f"pid:{lk.listener.pid}:{ticks if ticks is not None else '-'}"
    else:
        key = f"inode:{lk.dev}:{lk.ino}"
    return KubeletStart(
        key,
        lk.dev,
        lk.ino,
        lk.listener,
        lk.ctime_ns / 1e9,
        now_boot,
        _offset(),
        lk.why_not[:200],
        lk.transient,
    )


def same_run(cur: KubeletStart, lk: Look) -> bool:
    """Whether a new look is still the run ``cur`` (pure)."""
    same_inode = (lk.dev, lk.ino) == (cur.dev, cur.ino)
    if lk.listener is None:
        return same_inode  # inode only: a touch keeps it, a new socket does not
    if cur.listener is not None:
        a, b = lk.listener, cur.listener
        return (a.pid, a.start_ticks) == (b.pid, b.start_ticks)
    # first told by its inode (nobody listened yet): the same run when the listener
    # started before that look, so it made the socket; a later one is a new kubelet
    began = lk.listener.boot_s
    return same_inode and (began is None or began <= cur.seen_boot)


class KubeletStartWatch:
    """kubelet's latest start, looked at as often as wanted: a stat per look."""

    def __init__(self, root: Root, path: Path) -> None:
        self.root = root
        self.path = path
        self.current: Optional[KubeletStart] = None
        self._stat: Optional[tuple[int, int, int]] = None
        self._again = False  # connect at the next look even with the same stat
        self._changed = -1e9  # time.monotonic() of the last stat change
        self.connects = 0  # how often the socket was connected to (tests, bench)

    def look(self) -> Optional[KubeletStart]:
        """The current run (None: no kubelet.sock). Its ``key`` changes only at a
        kubelet start."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            self._stat = None
            return None
        key = (st.st_dev, st.st_ino, st.st_ctime_ns)
        if key == self._stat and not self._again and self.current is not None:
            return self.current
        lk = look(self.root, self.path)
        if lk is None:
            self._stat = None
            return None
        self.connects += lk.why_not != "not a socket"
        if (lk.dev, lk.ino, lk.ctime_ns) != self._stat:
            self._changed = time.monotonic()
        self._stat = (lk.dev, lk.ino, lk.ctime_ns)
        self._again = lk.transient
        cur = self.current
        if cur is None or not same_run(cur, lk):
            self.current = _start(lk, boottime())
        elif cur.listener is None and lk.listener is not None:  # the same run, now told
            self.current = KubeletStart(
                cur.key, lk.dev, lk.ino, lk.listener, cur.ctime, cur.seen_boot, _offset()
            )
        elif (lk.dev, lk.ino) != (cur.dev, cur.ino):  # same listener, new inode
            self.current = dataclasses.replace(cur, dev=lk.dev, ino=lk.ino)
        return self.current

    @property
    def unsettled(self) -> bool:
        """The socket changed within UNSETTLED seconds and refused the last connect
        (kubelet between its bind and listen): look again within milliseconds, as a
        new socket that got the old inode number is told a start only by its
        listener, and kubelet re-admits its pods 40-80 ms after it starts."""
        return self._again and time.monotonic() - self._changed < UNSETTLED
