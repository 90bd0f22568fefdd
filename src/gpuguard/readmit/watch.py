"""Waking the bridge when kubelet makes its socket: inotify on kubelet's
device-plugins directory (a creation or a rename into it), so that the bridge costs
no CPU while it waits and answers within a millisecond of kubelet's socket.

Where the directory cannot be watched (it does not exist yet: kubelet never ran, so no
checkpoint either, or inotify is refused) it looks again every POLL_MISSING seconds.
"""

from __future__ import annotations

import os
import select
import time
from pathlib import Path

from gpuguard.host.inotify import DIR_MASK, IN_CLOEXEC, IN_IGNORED, IN_NONBLOCK
from gpuguard.host.inotify import events as _events
from gpuguard.host.libc import c_library as _libc

POLL_MISSING = 0.5


class DirWatch:
    """inotify on one directory; :meth:`wait` returns when something may have been
    created there, or at the timeout."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.libc = _libc()
        self.fd = int(self.libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC))
        self.wd = -1

    def _watch(self) -> bool:
        if self.fd < 0:
            return False
        if self.wd < 0:
            wd = int(self.libc.inotify_add_watch(self.fd, os.fsencode(self.dir), DIR_MASK))
            self.wd = wd if wd >= 0 else -1
        return self.wd >= 0

    def wait(self, timeout: float) -> None:
        if not self._watch():
            time.sleep(min(timeout, POLL_MISSING))
            return
        ready, _w, _x = select.select([self.fd], [], [], timeout)
        if not ready:
            return
        try:
            data = os.read(self.fd, 64 * 1024)
        except BlockingIOError:
            return
        if any(mask & IN_IGNORED for _wd, mask, _name in _events(data)):
            self.wd = -1  # the directory went away: watched again next time

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
