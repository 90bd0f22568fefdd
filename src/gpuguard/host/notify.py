"""sd_notify(3) without libsystemd: one datagram to $NOTIFY_SOCKET.

Kept tiny and dependency-free so READY=1/STATUS=/WATCHDOG=1 work the same with or
without python3-systemd.
"""

from __future__ import annotations

import os
import socket
from typing import Optional


class Notifier:
    def __init__(self, address: Optional[str] = None) -> None:
        self.address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        self._sock: Optional[socket.socket] = None

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def send(self, *lines: str) -> bool:
        if not self.address:
            return False
        addr = self.address
        if addr.startswith("@"):  # abstract namespace
            addr = "\0" + addr[1:]
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.sendto("\n".join(lines).encode(), addr)
        except OSError:
            return False
        return True

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def reloading(self) -> None:
        self.send("RELOADING=1")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")


def watchdog_interval() -> Optional[float]:
    """Half the watchdog period systemd expects (WATCHDOG_USEC for our PID), or None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(0.05, int(usec) / 2e6)
    except ValueError:
        return None
