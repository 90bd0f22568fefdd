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
from typing import Any

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


# -- the answer's headers and a graceful GOAWAY ------------------------------------------


def trailers(status: str, message: str = "") -> bytes:
    block = b"\x40\x0bgrpc-status" + bytes((len(status),)) + status.encode()
    if message:
        block += b"\x00\x0cgrpc-message" + bytes((len(message),)) + message.encode()
    return frame(g.HEADERS, g.END_HEADERS | g.END_STREAM, 1, block)


def test_a_goaway_with_no_error_after_the_answer_is_not_a_failure(sock: Path) -> None:
    answer = (
        frame(g.HEADERS, g.END_HEADERS, 1, b"\x88")
        + frame(g.GOAWAY, 0, 0, struct.pack(">II", 1, g.NO_ERROR))  # ours is answered
        + frame(g.DATA, 0, 1, msg(b"x"))
        + trailers("0")
    )
    got, _seen = call(sock, answer)
    assert got == b"x"


def test_a_goaway_before_our_stream_is_an_error(sock: Path) -> None:
    answer = frame(g.GOAWAY, 0, 0, struct.pack(">II", 0, g.NO_ERROR) + b"shutting down")
    with pytest.raises(g.CallError, match=re.escape("went away (HTTP/2 error 0: shutting down)")):
        call(sock, answer, close=True)


def test_a_refusal_says_its_status_and_message_split_over_continuation(sock: Path) -> None:
    t = trailers("12", "unknown service v1.PodResourcesLister")
    head, block = t[:9], t[9:]
    answer = (
        frame(g.HEADERS, g.END_HEADERS, 1, b"\x88")
        + frame(g.HEADERS, g.END_STREAM, 1, block[:7])  # the block continues
        + frame(g.CONTINUATION, g.END_HEADERS, 1, block[7:])
    )
    assert head[3] == g.HEADERS
    with pytest.raises(
        g.CallError, match=re.escape("code 12 UNIMPLEMENTED: unknown service v1.PodResourcesLister")
    ):
        call(sock, answer, close=True)


def test_a_message_beside_an_error_status_is_not_taken(sock: Path) -> None:
    answer = (
        frame(g.HEADERS, g.END_HEADERS, 1, b"\x88")
        + frame(g.DATA, 0, 1, msg(b"x"))
        + trailers("13", "boom%0Anext line")
    )
    with pytest.raises(g.CallError, match=re.escape(r"code 13 INTERNAL: boom\nnext line")):
        call(sock, answer, close=True)


# -- a real gRPC server (grpcio): its HPACK (Huffman, dynamic table), its GOAWAY --------


@pytest.fixture
def grpc_server(sock: Path) -> Iterator[tuple[Any, Path, list[Any]]]:
    """A grpcio server on `sock` whose handlers the test sets (service "t.S")."""
    grpc = pytest.importorskip("grpc")
    from concurrent import futures

    handlers: list[Any] = []

    class Generic(grpc.GenericRpcHandler):  # type: ignore[misc]
        def service(self, details: Any) -> Any:
            for h in handlers:
                if details.method == h[0]:
                    return grpc.unary_unary_rpc_method_handler(h[1])
            return None

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((Generic(),))
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    try:
        yield server, sock, handlers
    finally:
        server.stop(0)


def test_grpcio_refusals_read_their_status_and_details(
    grpc_server: tuple[Any, Path, list[Any]],
) -> None:
    grpc = pytest.importorskip("grpc")
    _server, sock, handlers = grpc_server

    def deny(_req: bytes, ctx: Any) -> bytes:
        ctx.abort(grpc.StatusCode.PERMISSION_DENIED, "pods are not yours: ünïcode\nand a line")

    handlers.append(("/t.S/Deny", deny))
    with pytest.raises(g.CallError) as e:
        g.call("/t.S/Deny", str(sock), b"", timeout=5.0, limit=1 << 20)
    assert str(e.value) == r"code 7 PERMISSION_DENIED: pods are not yours: ünïcode\nand a line"
    with pytest.raises(g.CallError, match=re.escape("code 12 UNIMPLEMENTED: ")):
        g.call("/t.S/Nothing", str(sock), b"", timeout=5.0, limit=1 << 20)
    handlers.append(("/t.S/Echo", lambda req, _ctx: b"answer:" + req))
    for _ in range(3):  # one connection each: the decoder starts empty every time
        assert g.call("/t.S/Echo", str(sock), b"q", timeout=5.0, limit=1 << 20) == b"answer:q"


def test_grpcio_shutting_down_during_the_call_still_answers_it(
    grpc_server: tuple[Any, Path, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """server.stop(grace) sends GOAWAY(NO_ERROR) on the open connection, then lets the
    call in progress finish: the answer comes after the GOAWAY."""
    server, sock, handlers = grpc_server
    inside, release, goaway = threading.Event(), threading.Event(), threading.Event()
    header = g._header

    def seen(h: bytes) -> tuple[int, int, int, int]:
        out = header(h)
        if out[1] == g.GOAWAY:
            goaway.set()
        return out

    monkeypatch.setattr(g, "_header", seen)

    def slow(_req: bytes, _ctx: Any) -> bytes:
        inside.set()
        release.wait(10)
        return b"late"

    handlers.append(("/t.S/Slow", slow))
    got: list[Any] = []

    def client() -> None:
        try:
            got.append(g.call("/t.S/Slow", str(sock), b"", timeout=10.0, limit=1 << 20))
        except g.CallError as e:
            got.append(e)

    t = threading.Thread(target=client)
    t.start()
    assert inside.wait(10)
    stopped = server.stop(10)  # GOAWAY now; the handler still runs
    received = goaway.wait(10)  # the client has read it before the answer exists
    release.set()
    t.join(10)
    stopped.wait(10)
    assert received, "grpcio sent no GOAWAY"
    assert got == [b"late"], got
