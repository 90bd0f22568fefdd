from __future__ import annotations

import socket
from pathlib import Path

from gpuguard.host.notify import Notifier, watchdog_interval


def test_notify_datagram(tmp_path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    n = Notifier(str(tmp_path / "notify"))
    n.ready("pass 1: ok")
    msg = sock.recv(4096).decode().split("\n")
    assert msg[:2] == ["READY=1", "STATUS=pass 1: ok"]
    assert msg[2].startswith("MAINPID=")
    sock.close()


def test_notify_disabled_without_socket() -> None:
    assert Notifier("").send("READY=1") is False


def test_watchdog_interval(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", "1")  # for another process
    assert watchdog_interval() is None
