"""A container scope's device access set at runtime over the bus, announced by the
file systemd writes for it.

systemd sends no change signal for a unit's DevicePolicy= or DeviceAllow= (`busctl
introspect` shows no emits-change flag on either). A client can still set them on a
running scope: a runtime's systemd driver on an update, or an operator's `systemctl
set-property`. systemd then re-applies the scope's device policy, and a DeviceAllow=
emptied and refilled without the GPU takes the GPU away. runc's driver sends an empty
DeviceAllow= before the spec's list whenever it sends device properties. With runc
1.1.5 and systemd 252, `runc update` left gpuguard's entry in place
(tests/integration/test_container_access_runc.py). Without this watch, gpuguard would
see such a reset only at its next audit (AuditInterval=, 5 min by default).

For a transient unit (every container scope), systemd writes each property set at
runtime to /run/systemd/transient/UNIT.d/50-NAME.conf, atomically: the file arrives by
a rename. A change to DevicePolicy= or DeviceAllow= there is a SCOPE_DEVICES_SET event at
once (the registry: the container access step).

gpuguard's own DeviceAllow= writes the same file, so each of its grants brings one more
pass. That pass finds the grant in place and writes nothing, so there is no loop
(tests/integration/test_runtime_device_reset.py counts the passes). A source only emits
events (sources/__init__.py).

inotify is not recursive. The transient directory is watched for each scope's new `.d`
directory, and each such directory for its files. While the transient directory does
not exist yet, /run/systemd is watched for it.
"""

from __future__ import annotations

import asyncio
import errno
import os
from typing import Callable, Optional

from gpuguard.devices.cgroupnames import scope_of_dropin_dir
from gpuguard.host import inotify
from gpuguard.host.inotify import (
    DIR_MASK,
    IN_CLOSE_WRITE,
    IN_DONT_FOLLOW,
    IN_IGNORED,
    IN_ISDIR,
    IN_MOVED_TO,
    IN_ONLYDIR,
    IN_Q_OVERFLOW,
    InotifyError,
)
from gpuguard.steps.events import Event, EventKind

Emit = Callable[[Event], None]

RUN_SYSTEMD = "/run/systemd"
TRANSIENT = "transient"
# the runtime properties that decide a scope's device access
WATCHED_FILES = frozenset({"50-DeviceAllow.conf", "50-DevicePolicy.conf"})

FILE_MASK = IN_CLOSE_WRITE | IN_MOVED_TO | IN_ONLYDIR | IN_DONT_FOLLOW


class TransientWatch:
    """A SCOPE_DEVICES_SET event when a runtime sets a container scope's DevicePolicy=
    or DeviceAllow= (or when such a change may have been missed). `run_systemd`:
    /run/systemd through the root prefix."""

    def __init__(self, loop: asyncio.AbstractEventLoop, emit: Emit, run_systemd: str) -> None:
        self.loop = loop
        self.emit = emit
        self.run_systemd = run_systemd
        self.transient = os.path.join(run_systemd, TRANSIENT)
        self.fd = -1
        self.dirs: dict[int, str] = {}  # watch descriptor -> a scope's unit name
        self.top = -1  # the watch on the transient directory (or on /run/systemd)
        self.top_is_parent = False

    def start(self) -> None:
        self.fd = inotify.init()
        self._watch_top()
        self.loop.add_reader(self.fd, self._readable)

    def close(self) -> None:
        if self.fd >= 0:
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1
            self.dirs.clear()

    def _add(self, path: str, mask: int) -> int:
        return inotify.add_watch(self.fd, path, mask)

    def _watch_top(self) -> None:
        """The transient directory and each scope's directory in it; /run/systemd
        alone while the transient directory does not exist yet."""
        try:
            self.top, self.top_is_parent = self._add(self.transient, DIR_MASK), False
        except InotifyError as e:
            if e.errno != errno.ENOENT:
                raise
            self.top, self.top_is_parent = self._add(self.run_systemd, DIR_MASK), True
            return
        try:
            names = os.listdir(self.transient)
        except OSError:
            return
        for name in names:
            self._watch_scope(name, announce=False)

    def _watch_scope(self, name: str, *, announce: bool) -> None:
        """Watch a scope's `.d` directory; `announce`: it is new, and systemd may have
        written its files before the watch was there."""
        unit = scope_of_dropin_dir(name)
        if unit is None:
            return
        path = os.path.join(self.transient, name)
        try:
            wd = self._add(path, FILE_MASK)
        except InotifyError:
            return  # gone meanwhile, a link, not a directory, or no watch left: the audit
        self.dirs[wd] = unit
        if announce and WATCHED_FILES & set(_listdir(path)):
            self._set(unit, "DevicePolicy= or DeviceAllow=")

    def _set(self, unit: str, what: str) -> None:
        why = f"systemd: {unit}: {what} set at runtime (a runtime's update, or a grant)"
        self.emit(Event(EventKind.SCOPE_DEVICES_SET, why, unit=unit))

    def _readable(self) -> None:
        try:
            data = os.read(self.fd, 64 * 1024)
        except BlockingIOError:
            return
        for wd, mask, name in inotify.events(data):
            if mask & IN_Q_OVERFLOW:  # events lost: a pass looks at every container
                self.emit(Event(EventKind.SCOPE_DEVICES_SET, "inotify queue overflowed"))
            elif mask & IN_IGNORED:  # the directory went away
                self.dirs.pop(wd, None)
                if wd == self.top:
                    self._rewatch()
            elif wd == self.top and self.top_is_parent:
                if name == TRANSIENT and mask & IN_ISDIR:
                    inotify.rm_watch(self.fd, wd)
                    self._rewatch()
                    for unit in self.dirs.values():
                        self._set(unit, "DevicePolicy= or DeviceAllow=")
            elif wd == self.top:
                if mask & IN_ISDIR:
                    self._watch_scope(name, announce=True)
            elif wd in self.dirs and name in WATCHED_FILES:
                self._set(self.dirs[wd], f"{name[3:-5]}=")

    def _rewatch(self) -> None:
        """The top watch again, from the loop: where that fails (no watch left), the
        audit is the backstop, and a pass looks now."""
        try:
            self._watch_top()
        except InotifyError:
            self.top = -1
            lost = "runtime property watch lost"
            self.emit(Event(EventKind.SCOPE_DEVICES_SET, lost))


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def make_transient_watch(
    loop: asyncio.AbstractEventLoop, emit: Emit, run_systemd: str
) -> Optional[TransientWatch]:
    """The watch, started; None where /run/systemd does not exist (not systemd)."""
    if not os.path.isdir(run_systemd):
        return None
    w = TransientWatch(loop, emit, run_systemd)
    w.start()
    return w
