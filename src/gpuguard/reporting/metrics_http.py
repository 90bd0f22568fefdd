"""`gpuguard metrics --serve`: the HTTP side of the metrics, outside the daemon.

gpuguard.service denies IP, so the daemon never listens; it writes its metrics'
values to /run/gpuguard/metrics.json after every pass, and this small server (started
by gpuguard-metrics.socket, which owns the address) renders that file with
prometheus_client (metrics.py) on every GET /metrics. It runs with no privilege and no
network of its own (docs/hardening.md): it only accepts on the socket systemd passed it
and reads one file. Whatever keeps it from rendering (no file yet, a corrupt one, no
client library) is a 503 whose body says why in one line.
"""

from __future__ import annotations

import os
import socket
import socketserver
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, Callable, Optional

from gpuguard import exitcodes
from gpuguard.errors import BadInputError, ConfigError, GpuguardError
from gpuguard.reporting.metrics_state import MISSING_LIBRARY

RenderFile = Callable[[Path], bytes]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus text format 0.0.4
SD_LISTEN_FDS_START = 3


def systemd_socket() -> Optional[socket.socket]:
    """The listening socket systemd passed (LISTEN_FDS=1 for this pid), else None."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    if os.environ.get("LISTEN_FDS") != "1":
        return None
    return socket.socket(fileno=SD_LISTEN_FDS_START)


def load_render_file() -> Optional[RenderFile]:
    """metrics.render_file, or None without prometheus_client."""
    try:
        from gpuguard.reporting.metrics import render_file
    except ImportError as e:
        if not (e.name or "").startswith("prometheus_client"):
            raise
        return None
    return render_file


def _handler(path: Path, render_file: Optional[RenderFile]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "gpuguard-metrics"

        def _reply(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self._reply(404, b"gpuguard serves /metrics only\n", "text/plain")
                return
            if render_file is None:
                self._reply(503, f"no metrics: {MISSING_LIBRARY}\n".encode(), "text/plain")
                return
            try:
                body = render_file(path)
            except BadInputError as e:
                self._reply(503, f"no metrics: {e.message}\n".encode(), "text/plain")
                return
            self._reply(200, body, CONTENT_TYPE)

        do_HEAD = do_GET

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per scrape would flood the journal

    return Handler


class _SocketServer(HTTPServer):
    """An HTTPServer on a socket it is given. TCPServer.__init__ would create a socket
    of its own first, which the unit's RestrictAddressFamilies=AF_UNIX refuses."""

    def __init__(self, sock: socket.socket, handler: type[BaseHTTPRequestHandler]) -> None:
        socketserver.BaseServer.__init__(self, sock.getsockname()[:2], handler)
        self.socket = sock


def make_server(sock: socket.socket, path: Path, render_file: Optional[RenderFile]) -> HTTPServer:
    return _SocketServer(sock, _handler(path, render_file))


def listen(address: str) -> socket.socket:
    """A listening socket on HOST:PORT (for tests and running by hand)."""
    host, _, port = address.rpartition(":")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), int(port)))
    sock.listen(16)
    return sock


def print_file(path: Path) -> int:
    """`gpuguard metrics`: the metrics the daemon wrote, rendered, on stdout."""
    render_file = load_render_file()
    if render_file is None:
        raise GpuguardError(MISSING_LIBRARY, exit_code=exitcodes.USAGE)
    sys.stdout.buffer.write(render_file(path))
    return exitcodes.OK


def serve(path: Path, address: Optional[str]) -> int:
    """`gpuguard metrics --serve`: on systemd's socket, or `address` (by hand, tests)."""
    try:
        sock = listen(address) if address else systemd_socket()
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot listen on {address}: {e}") from None
    if sock is None:
        raise ConfigError(
            "no socket from systemd (start gpuguard-metrics.socket) and no --listen HOST:PORT"
        )
    render_file = load_render_file()
    if render_file is None:  # said once here (the journal); every scrape gets a 503
        print(f"gpuguard: {MISSING_LIBRARY}; every scrape gets a 503", file=sys.stderr)
    try:
        make_server(sock, path, render_file).serve_forever()
    except OSError as e:
        raise GpuguardError(f"metrics server stopped: {e}", exit_code=exitcodes.USAGE) from None
    return exitcodes.OK
