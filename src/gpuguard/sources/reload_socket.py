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
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Callable, Optional

from gpuguard.log import EventLog
from gpuguard.sources.dbuswire import FIXED, WireError, auth_request, header, reloading

AUTH_TIMEOUT = 5.0
CHUNK = 256 * 1024
BACKOFF_FIRST, BACKOFF_MAX = 0.25, 30.0


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
        self._writer: Optional[asyncio.StreamWriter] = None

    def stop(self) -> None:
        self._stopping = True
        if self._writer is not None:
            self._writer.close()

    async def run(self) -> None:
        backoff = BACKOFF_FIRST
        told = False  # a failure to connect is journaled once, until a connection works
        while not self._stopping:
            try:
                reader = await self._connect()
            except (OSError, asyncio.TimeoutError, WireError) as e:
                why = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or "timeout"
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                why = "closed, or no answer line, during authentication"
            else:
                why = ""
            if why:
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
            why = "closed by systemd"
            try:
                await self._read(reader)
            except (OSError, asyncio.IncompleteReadError) as e:
                why = getattr(e, "strerror", None) or "closed by systemd"
            except WireError as e:
                why = f"unexpected data ({e})"
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
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    async def _connect(self) -> asyncio.StreamReader:
        reader, writer = await asyncio.open_unix_connection(str(self.path))
        self._writer = writer
        try:
            writer.write(auth_request(self.uid))
            line = await asyncio.wait_for(reader.readuntil(b"\r\n"), AUTH_TIMEOUT)
            if not line.startswith(b"OK "):
                raise WireError(f"authentication refused: {line[:60]!r}")
            writer.write(b"BEGIN\r\n")
            await writer.drain()
        except BaseException:
            writer.close()
            self._writer = None
            raise
        return reader

    async def _read(self, reader: asyncio.StreamReader) -> None:
        # Whole chunks into one buffer, each message judged in place (a reload brings
        # hundreds ahead of the signal: a read per message would cost more than them).
        buf = bytearray()
        while not self._stopping:
            data = await reader.read(CHUNK)
            if not data:
                raise asyncio.IncompleteReadError(bytes(buf), None)
            buf += data
            off = 0
            while len(buf) - off >= FIXED:
                h = header(buf, off)
                if len(buf) - off < h.total:
                    break
                active = reloading(buf, h, off)
                off += h.total
                if active is not None:
                    self.report(active)
            del buf[:off]
