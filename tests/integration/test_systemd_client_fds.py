"""The D-Bus client frees a lost connection's socket at once. dbus-next 0.2.3 only shuts
it down and leaves the fd to the garbage collector, so each bus restart cost the
daemon an fd (seen in the soak: 10 -> 18 fds over 60 dbus restarts). The garbage
collector is off here, so what is not closed explicitly shows up as an open fd.
A real dbus-daemon (a private one, on a socket in the test's directory) is the bus.
"""

from __future__ import annotations

import asyncio
import gc
import os
import select
import socket
import subprocess
import threading
from pathlib import Path
from typing import Iterator

import pytest

from conftest import require_tool
from gpuguard.host.systemd import Systemd, SystemdError


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def _connect_and_lose(address: str, bus: subprocess.Popen[str]) -> None:
    sd = Systemd(address)
    await sd.connect()
    waiting = asyncio.ensure_future(sd.wait_for_disconnect())
    await asyncio.sleep(0.01)
    bus.kill()  # this PID only: the bus goes away under the connection
    await asyncio.wait({waiting}, timeout=10)
    assert waiting.done(), "the lost connection went unnoticed"
    waiting.exception()  # dbus-next ends it with EOFError: expected


def _bus(address: str) -> subprocess.Popen[str]:
    """A private dbus-daemon, returned once it listens. It prints its address only
    after listen(); its socket file exists from bind() on, and a client that connects
    in between is refused (seen in CI)."""
    bus = subprocess.Popen(
        [
            "dbus-daemon",
            "--session",
            "--nofork",
            "--nopidfile",
            "--print-address",
            f"--address={address}",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert bus.stdout is not None
    ready, _, _ = select.select([bus.stdout], [], [], 10)
    line = bus.stdout.readline() if ready else ""
    bus.stdout.close()
    if not line.startswith("unix:"):
        bus.kill()
        bus.wait()
        pytest.fail(f"dbus-daemon did not come up on {address} (printed {line!r})")
    return bus


def test_lost_connections_leave_no_fd(tmp_path: Path, no_gc: None) -> None:
    require_tool("dbus-daemon")
    before = _fds()
    for i in range(10):
        address = f"unix:path={tmp_path}/bus{i}"
        bus = _bus(address)
        try:
            asyncio.run(_connect_and_lose(address, bus))
        finally:
            bus.kill()
            bus.wait()
    assert _fds() == before


def test_failed_handshakes_leave_no_fd(tmp_path: Path, no_gc: None) -> None:
    """A socket that accepts and hangs up (a bus daemon going down meanwhile)."""
    path = str(tmp_path / "rude")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(16)

    def serve() -> None:
        for _ in range(10):
            conn, _ = srv.accept()
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()

    async def attempts() -> int:
        failed = 0
        for _ in range(10):
            try:
                await Systemd(f"unix:path={path}").connect()
            except SystemdError:
                failed += 1
        return failed

    before = _fds()
    assert asyncio.run(attempts()) == 10
    t.join(timeout=10)
    srv.close()
    assert _fds() == before - 1  # the listening socket, closed above
