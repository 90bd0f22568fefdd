"""systemd's Reloading signal straight from its private socket, before the bus has it.

After a daemon-reload systemd writes its Reloading(false) to every direct connection
(/run/systemd/private, the socket systemctl itself uses) and to the bus broker in the
same moment; the broker then routes the hundreds of unit signals queued ahead of it to
its clients before it. Measured with 200 GPU scopes (bench/bench_container_access.py,
part c): on the private socket the signal came 10 ms (p50) *before* `systemctl
daemon-reload` returned, through dbus-daemon 24 ms (p50) and 57 ms (p99) after. Every
GPU container that lost its devices waits that long.

So the systemd source (sources/systemd.py) takes each Reloading from whichever path
delivers it first and drops the other's copy (it counts both). A direct connection
receives every signal systemd sends (no match rules); this reader looks at each one's
header only and parses no body but Reloading's (dbuswire.py). It only reports: it
never calls systemd. It reconnects with back-off (a daemon-reexec or a systemd restart
closes it; the end of that reexec then comes through the bus). Any malformed message
drops the connection, with a warning.

Messages are judged in the loop callback that read them (an asyncio Protocol, no
stream and no task switch between the socket and the report): when the private
socket and the bus are readable in the same wake-up, the private copy, written first
by systemd, is reported first.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Callable, Optional

from gpuguard.journal.log import EventLog
from gpuguard.sources.dbuswire import FIXED, WireError, auth_request, header, reloading

AUTH_TIMEOUT = 5.0
AUTH_LINE_MAX = 4096  # systemd answers "OK <32 hex digits>\r\n"
BACKOFF_FIRST, BACKOFF_MAX = 0.25, 30.0


class _Connection(asyncio.Protocol):
    """One connection to the private socket: the opening (AUTH EXTERNAL, systemd's OK,
    BEGIN), then every message judged in place as its bytes arrive."""

    def __init__(self, uid: int, report: Callable[[bool], None]) -> None:
        self.uid = uid
        self.report = report
        loop = asyncio.get_running_loop()
        # Results, never exceptions but a bug's: "" once authenticated, else why not;
        # why the connection ended.
        self.authenticated: asyncio.Future[str] = loop.create_future()
        self.closed: asyncio.Future[str] = loop.create_future()
        self.transport: Optional[asyncio.Transport] = None
        self._buf = bytearray()
        self._why = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(auth_request(self.uid))

    def data_received(self, data: bytes) -> None:
        self._buf += data
        try:
            if not self.authenticated.done() and not self._opening():
                return
            self._judge()
        except WireError as e:
            self._drop(f"unexpected data ({e})")
        except Exception as e:  # a bug in the report: it ends the watch, loudly
            if not self.closed.done():
                self.closed.set_exception(e)
            self._drop("a bug")

    def _opening(self) -> bool:
        end = self._buf.find(b"\r\n")
        if end < 0:
            if len(self._buf) > AUTH_LINE_MAX:
                raise WireError(f"no answer line in {len(self._buf)} bytes")
            return False
        line = bytes(self._buf[: end + 2])
        del self._buf[: end + 2]
        if not line.startswith(b"OK "):
            raise WireError(f"authentication refused: {line[:60]!r}")
        assert self.transport is not None
        self.transport.write(b"BEGIN\r\n")
        self.authenticated.set_result("")
        return True

    def _judge(self) -> None:
        # A reload brings hundreds of messages ahead of the signal, often in one read:
        # each is judged in place in the one buffer, which is cut once per read.
        buf, off = self._buf, 0
        try:
            while len(buf) - off >= FIXED:
                h = header(buf, off)
                if len(buf) - off < h.total:
                    break
                active = reloading(buf, h, off)
                off += h.total
                if active is not None:
                    self.report(active)
        finally:
            del buf[:off]

    def _drop(self, why: str) -> None:
        self._why = why
        if self.transport is not None:
            self.transport.abort()  # connection_lost follows, with the why

    def connection_lost(self, exc: Optional[Exception]) -> None:
        why = self._why or (exc.strerror if isinstance(exc, OSError) and exc.strerror else "")
        for fut, default in ((self.authenticated, "closed during authentication"),
                             (self.closed, "closed by systemd")):  # fmt: skip
            if not fut.done():
                fut.set_result(why or default)


class PrivateReloadWatch:
    def __init__(
        self, path: Path, report: Callable[[bool], None], log: EventLog, *, uid: int = -1
    ) -> None:
        self.path = path  # the host's /run/systemd/private, through the root prefix
        self.report = report  # Reloading(active), as the bus would have delivered it
        self.log = log
        self.uid = os.geteuid() if uid < 0 else uid
        self.connected = False
        self.on_connect: Callable[[], None] = lambda: None  # counts from here (systemd.py)
        self._stopping = False
        self._conn: Optional[_Connection] = None

    def stop(self) -> None:
        self._stopping = True
        self._close()

    async def run(self) -> None:
        backoff = BACKOFF_FIRST
        told = False  # a failure to connect is journaled once, until a connection works
        while not self._stopping:
            try:
                conn = await self._connect()
            except (OSError, asyncio.TimeoutError, WireError) as e:
                why = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or "timeout"
                if not told:
                    self.log.event(
                        "dbus-lost",
                        f"{self.path}: {why}; systemd's reloads come through the bus "
                        f"meanwhile, retrying every {BACKOFF_MAX:.0f}s at most",
                        fields={"VIA": "private-socket"},
                    )
                    told = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)
                continue
            backoff, told = BACKOFF_FIRST, False
            self.connected = True
            self.on_connect()
            self.log.event(
                "dbus-connected",
                f"reading systemd's Reloading signal from {self.path}",
                fields={"VIA": "private-socket"},
            )
            try:
                why = await conn.closed
            finally:
                self._close()
            if self._stopping:
                return
            self.log.event(
                "dbus-lost",
                f"{self.path}: {why}; reconnecting (reloads come through the bus meanwhile)",
                level="warning" if why.startswith("unexpected") else "info",
                fields={"VIA": "private-socket"},
            )
            await asyncio.sleep(backoff)

    def _close(self) -> None:
        self.connected = False
        conn, self._conn = self._conn, None
        if conn is not None and conn.transport is not None:
            conn.transport.close()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        uid, report = self.uid, self.report
        _, conn = await loop.create_unix_connection(
            lambda: _Connection(uid, report), str(self.path)
        )
        self._conn = conn
        try:
            why = await asyncio.wait_for(asyncio.shield(conn.authenticated), AUTH_TIMEOUT)
        except BaseException:
            self._close()
            raise
        if why:
            self._close()
            raise WireError(why)
        return conn
