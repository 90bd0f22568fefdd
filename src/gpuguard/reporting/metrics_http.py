"""`gpuguard metrics --serve`: the HTTP side of the metrics, outside the daemon.

gpuguard.service denies IP, so the daemon never listens; it writes its metrics'
values to /run/gpuguard/metrics.json after every pass, and this small server (started
by gpuguard-metrics.socket, which owns the address) renders that file with
prometheus_client (metrics.py) on every GET /metrics. It runs with no privilege and no
network of its own (docs/hardening.md): it only accepts on the socket systemd passed it
and reads two files (the metrics and the off switch, reported as gpuguard_disabled).
Whatever keeps it from rendering (no file yet, a corrupt one, no client library) is a
503 whose body says why in one line.

No client can keep another from being served: one asyncio loop serves every
connection at once; a request must be complete (request line and headers, at most
MAX_REQUEST bytes) within REQUEST_TIMEOUT of the accept, and the answer written within
WRITE_TIMEOUT, or the connection is closed; at MAX_CONNECTIONS the connection that
has waited longest without a complete request is closed to make room. Each connection
gets one answer and is closed (Prometheus opens a new one per scrape).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from gpuguard import exitcodes
from gpuguard.errors import BadInputError, ConfigError, GpuguardError
from gpuguard.reporting.metrics_state import MISSING_LIBRARY, unimportable

# metrics.json's path, whether the off switch is set -> the text exposition
RenderFile = Callable[[Path, bool], bytes]
SwitchReader = Callable[[], bool]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus text format 0.0.4
SD_LISTEN_FDS_START = 3
MAX_REQUEST = 8192  # request line and headers; a scrape sends a few hundred bytes
REQUEST_TIMEOUT = 5.0  # from accept to the end of the headers
WRITE_TIMEOUT = 10.0  # for the whole answer (a reader that does not read)
MAX_CONNECTIONS = 256
RENDERS_AT_ONCE = 2  # rendering is CPU work in a worker thread


def systemd_socket() -> Optional[socket.socket]:
    """The listening socket systemd passed (LISTEN_FDS=1 for this pid), else None."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    if os.environ.get("LISTEN_FDS") != "1":
        return None
    return socket.socket(fileno=SD_LISTEN_FDS_START)


def load_render_file() -> tuple[Optional[RenderFile], str]:
    """(metrics.render_file, ""), or (None, why) when prometheus_client cannot be
    imported (not installed, or a module it needs missing)."""
    try:
        from gpuguard.reporting.metrics import render_file
    except ImportError as e:
        why = unimportable(e)
        if why is None:
            raise
        return None, why
    return render_file, ""


def _answer(code: int, body: bytes, ctype: str, head: bool) -> bytes:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}
    reason.update({431: "Request Header Fields Too Large", 503: "Service Unavailable"})
    lines = [
        f"HTTP/1.1 {code} {reason.get(code, 'Error')}",
        "Server: gpuguard-metrics",
        f"Content-Type: {ctype}",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (b"" if head else body)


class MetricsServer:
    """The HTTP server on a listening socket; serve_forever() blocks (on its own
    asyncio loop), shutdown() from another thread ends it."""

    def __init__(
        self,
        sock: socket.socket,
        path: Path,
        render_file: Optional[RenderFile],
        disabled: SwitchReader = lambda: False,
        missing: str = MISSING_LIBRARY,
    ) -> None:
        self.sock = sock
        self.path = path
        self.render_file = render_file
        self.disabled = disabled
        self.missing = missing  # why there is no render_file
        self.server_address = sock.getsockname()
        # connection -> when it was accepted, while its request is not complete
        self.waiting: dict[asyncio.StreamWriter, float] = {}
        self.open = 0
        self.peak = 0
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self._started = threading.Event()
        self._done = threading.Event()

    def serve_forever(self) -> None:
        try:
            asyncio.run(self._serve())
        finally:
            self._done.set()

    def shutdown(self) -> None:
        """Stop serving and wait until the loop has let go of the socket."""
        self._started.wait(10)
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._done.wait(10)

    def server_close(self) -> None:
        self.sock.close()

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self.sock.setblocking(False)
        renders = asyncio.Semaphore(RENDERS_AT_ONCE)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._connection(reader, writer, renders)

        server = await asyncio.start_server(handle, sock=self.sock, limit=MAX_REQUEST)
        self._started.set()
        async with server:
            await self._stop.wait()

    def _make_room(self) -> None:
        """At MAX_CONNECTIONS: close the one that has waited longest for its request."""
        if self.open >= MAX_CONNECTIONS and self.waiting:
            oldest = min(self.waiting, key=self.waiting.__getitem__)
            self.waiting.pop(oldest)
            oldest.close()

    async def _connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, renders: asyncio.Semaphore
    ) -> None:
        self._make_room()
        self.open += 1
        self.peak = max(self.peak, self.open)
        self.waiting[writer] = time.monotonic()
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
            except asyncio.LimitOverrunError:
                head = None
            finally:
                self.waiting.pop(writer, None)
            if head is None:
                out = _answer(431, b"request too large\n", "text/plain", False)
            else:
                out = await self._respond(head, renders)
            writer.write(out)
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError):
            pass  # a slow, idle or vanished client: its connection is closed, nothing else
        finally:
            self.open -= 1
            self.waiting.pop(writer, None)
            writer.close()

    async def _respond(self, head: bytes, renders: asyncio.Semaphore) -> bytes:
        words = head.split(b"\r\n", 1)[0].split()
        if len(words) != 3 or not words[2].startswith(b"HTTP/"):
            return _answer(400, b"bad request\n", "text/plain", False)
        method, target = words[0], words[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return _answer(405, b"gpuguard serves GET /metrics only\n", "text/plain", False)
        is_head = method == b"HEAD"
        if target not in (b"/metrics", b"/"):
            return _answer(404, b"gpuguard serves /metrics only\n", "text/plain", is_head)
        if self.render_file is None:
            body = f"no metrics: {self.missing}\n".encode()
            return _answer(503, body, "text/plain", is_head)
        async with renders:
            try:
                disabled = self.disabled()
                text = await asyncio.to_thread(self.render_file, self.path, disabled)
            except BadInputError as e:
                return _answer(503, f"no metrics: {e.message}\n".encode(), "text/plain", is_head)
        return _answer(200, text, CONTENT_TYPE, is_head)


def make_server(
    sock: socket.socket,
    path: Path,
    render_file: Optional[RenderFile],
    disabled: SwitchReader = lambda: False,
    missing: str = MISSING_LIBRARY,
) -> MetricsServer:
    """`missing`: why there is no `render_file` (every scrape's 503 says it)."""
    return MetricsServer(sock, path, render_file, disabled, missing)


def listen(address: str) -> socket.socket:
    """A listening socket on HOST:PORT (for tests and running by hand)."""
    host, _, port = address.rpartition(":")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), int(port)))
    sock.listen(socket.SOMAXCONN)  # as systemd's Backlog= default: a burst is queued
    return sock


def print_file(path: Path, disabled: bool = False) -> int:
    """`gpuguard metrics`: the metrics the daemon wrote, rendered, on stdout."""
    render_file, why = load_render_file()
    if render_file is None:
        raise GpuguardError(why, exit_code=exitcodes.USAGE)
    sys.stdout.buffer.write(render_file(path, disabled))
    return exitcodes.OK


def serve(path: Path, address: Optional[str], disabled: SwitchReader) -> int:
    """`gpuguard metrics --serve`: on systemd's socket, or `address` (by hand, tests)."""
    try:
        sock = listen(address) if address else systemd_socket()
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot listen on {address}: {e}") from None
    if sock is None:
        raise ConfigError(
            "no socket from systemd (start gpuguard-metrics.socket) and no --listen HOST:PORT"
        )
    render_file, why = load_render_file()
    if render_file is None:  # said once here (the journal); every scrape gets a 503
        print(f"gpuguard: {why}; every scrape gets a 503", file=sys.stderr)
    try:
        make_server(sock, path, render_file, disabled, why).serve_forever()
    except OSError as e:
        raise GpuguardError(f"metrics server stopped: {e}", exit_code=exitcodes.USAGE) from None
    return exitcodes.OK
