"""host/unarygrpc.py against scripted HTTP/2 servers: what a server may send around a
unary answer (padding, PINGs, its SETTINGS, trailers) and how a call fails.

The call against a real gRPC server (grpcio's) is in test_plugins_allocatable.py, and
against kubelet 1.34 in tests/integration/test_kubelet_plugin_dropped.py.
"""

from __future__ import annotations

import re
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguard.host import unarygrpc as g

PATH = "/v1.PodResourcesLister/GetAllocatableResources"


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes((kind, flags))
        + struct.pack(">I", stream)
        + payload
    )


def msg(body: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(body)) + body


@pytest.fixture
def sock() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="gg-h2-", dir="/tmp"))
    try:
        yield d / "s.sock"
    finally:
        shutil.rmtree(d)


def serve(path: Path, script: bytes, seen: list[bytes], close: bool = False) -> threading.Thread:
    """Accept one connection, read what the client sends first, answer ``script``, then
    read what else it sends until it closes (``close``: close at once)."""
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(1)

    def run() -> None:
        conn, _ = srv.accept()
        with conn, srv:
            conn.settimeout(2)
            seen.append(conn.recv(65536))
            conn.sendall(script)
            if close:
                return
            try:
                while data := conn.recv(65536):
                    seen.append(data)
            except OSError:
                pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def call(path: Path, script: bytes, close: bool = False) -> tuple[bytes, list[bytes]]:
    seen: list[bytes] = []
    t = serve(path, script, seen, close)
    try:
        return g.call(PATH, str(path), b"", timeout=1.0, limit=1 << 20), seen
    finally:
        t.join(3)


def test_the_request_is_what_a_grpc_server_expects(sock: Path) -> None:
    answer = frame(g.HEADERS, g.END_HEADERS, 1, b"\x88") + frame(g.DATA, g.END_STREAM, 1, msg(b"x"))
    got, seen = call(sock, answer)
    assert got == b"x"
    sent = seen[0]
    assert sent.startswith(g.PREFACE)
    assert b"\x00\x05:path" + bytes((len(PATH),)) + PATH.encode() in sent
    assert b"\x00\x0ccontent-type\x10application/grpc" in sent
    assert sent.endswith(frame(g.DATA, g.END_STREAM, 1, msg(b"")))


def test_settings_acknowledged_pings_answered_padding_and_trailers(sock: Path) -> None:
    pad = 3
    padded = bytes((pad,)) + msg(b"hello")[:4] + b"\x00" * pad
    rest = msg(b"hello")[4:]
    answer = (
        frame(g.SETTINGS, 0, 0, struct.pack(">HI", 3, 100))
        + frame(g.PING, 0, 0, b"12345678")
        + frame(g.HEADERS, g.END_HEADERS, 1, b"\x88")
        + frame(g.WINDOW_UPDATE, 0, 0, struct.pack(">I", 10))
        + frame(g.DATA, g.PADDED, 1, padded)
        + frame(g.DATA, 0, 1, rest)
        + frame(g.HEADERS, g.END_HEADERS | g.END_STREAM, 1, b"\x40\x0bgrpc-status\x010")
    )
    got, seen = call(sock, answer)
    assert got == b"hello"
    later = b"".join(seen[1:])
    assert frame(g.SETTINGS, g.ACK, 0) in later
    assert frame(g.PING, g.ACK, 0, b"12345678") in later


@pytest.mark.parametrize(
    "answer, said",
    [
        (frame(g.HEADERS, g.END_HEADERS | g.END_STREAM, 1, b"\x88"), "no message in the answer"),
        (frame(g.RST_STREAM, 0, 1, struct.pack(">I", 7)), "reset the call (HTTP/2 error 7)"),
        (frame(g.GOAWAY, 0, 0, struct.pack(">II", 0, 2)), "went away (HTTP/2 error 2)"),
        (frame(g.DATA, g.END_STREAM, 1, b"\x01" + msg(b"x")[1:]), "compressed"),
        (frame(g.DATA, g.END_STREAM, 1, msg(b"xyz")[:-1]), "truncated"),
        (frame(g.DATA, 0, 1, msg(b"x")), "closed the connection"),
    ],
)
def test_a_call_without_an_answer_is_an_error(sock: Path, answer: bytes, said: str) -> None:
    with pytest.raises(g.CallError, match=re.escape(said)):
        call(sock, answer, close=True)


def test_an_answer_beyond_the_limit_is_refused(sock: Path) -> None:
    seen: list[bytes] = []
    t = serve(sock, frame(g.DATA, g.END_STREAM, 1, msg(b"y" * 5000)), seen)
    with pytest.raises(g.CallError, match="frame of 5005 bytes"):
        g.call(PATH, str(sock), b"", timeout=1.0, limit=100)
    t.join(3)
