"""One unary gRPC call over a unix socket, HTTP/2 spoken by hand: the daemon's way to
ask a local gRPC server (kubelet's podresources API) a question.

Why not grpcio: importing it costs the daemon 10-14 MB of RSS (bench/bench_podresources.py),
half its whole footprint (bench/README.md: < 30 MB), for a call of a few hundred
bytes made at most once a pass. The bridge, a process of its own that serves streams,
uses grpcio. What a unary call needs of HTTP/2 (RFC 9113) is small: the preface, a
SETTINGS frame (our stream window large enough for any answer we accept) and a
connection WINDOW_UPDATE, one request stream (HEADERS, then DATA with the gRPC
length-prefixed message and END_STREAM), the server's SETTINGS acknowledged and its
PINGs answered, then DATA frames until the stream ends. The request headers are HPACK
literals without indexing (RFC 7541 6.2.2), so the server's decoder needs no state of
ours. The answer's header blocks (HEADERS and CONTINUATION) are decoded with
host/hpack.py (Go's server uses its dynamic table and Huffman coding): the call
fails when its trailers hold a ``grpc-status`` other than 0, a CallError naming the
code and the server's ``grpc-message`` ("code 12 UNIMPLEMENTED: unknown service
v1.PodResourcesLister"). A GOAWAY with NO_ERROR is a graceful close
(Go's server sends one when it shuts a connection down, possibly right after the
answer): the call goes on as long as the server said it processes our stream.

``peer_uid``: the server's process must run as that user, checked after connect with
SO_PEERCRED (the socket's path cannot then lead to another server).
"""

from __future__ import annotations

import socket
import struct
import time
import urllib.parse
from typing import Optional

from gpuguard.host import hpack
from gpuguard.host.echo import cut

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
CONTINUATION = 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
STREAM = 1  # the one request stream
SETTINGS_ENABLE_PUSH, SETTINGS_INITIAL_WINDOW_SIZE = 0x2, 0x4
NO_ERROR = 0
MAX_HEADER_BLOCK = 64 * 1024  # bytes of one encoded header block, CONTINUATIONs included
# https://grpc.github.io/grpc/core/md_doc_statuscodes.html
GRPC_CODES = (
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
    "UNAUTHENTICATED",
)  # fmt: skip
MAX_FRAME = 1 << 24  # the largest frame length HTTP/2 can express, minus one


class CallError(Exception):
    """The call did not return a message: the one-line reason."""


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes((kind, flags))
        + struct.pack(">I", stream)
        + payload
    )


def _literal(name: str, value: str) -> bytes:
    """HPACK: a literal header field without indexing, new name, no Huffman coding
    (lengths below 127: a 7-bit prefix each)."""
    n, v = name.encode(), value.encode()
    if len(n) > 126 or len(v) > 126:
        raise ValueError("header too long for this encoder")
    return b"\x00" + bytes((len(n),)) + n + bytes((len(v),)) + v


def request(path: str, message: bytes, window: int) -> bytes:
    """Everything the client sends, at once: preface, SETTINGS, the connection's
    WINDOW_UPDATE, the request's HEADERS and DATA."""
    settings = struct.pack(">HIHI", SETTINGS_ENABLE_PUSH, 0, SETTINGS_INITIAL_WINDOW_SIZE, window)
    headers = b"".join(
        _literal(k, v)
        for k, v in (
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "localhost"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        )
    )
    body = b"\x00" + struct.pack(">I", len(message)) + message
    return (
        PREFACE
        + _frame(SETTINGS, 0, 0, settings)
        + _frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", window))
        + _frame(HEADERS, END_HEADERS, STREAM, headers)
        + _frame(DATA, END_STREAM, STREAM, body)
    )


class _Reader:
    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline, self.buf = sock, deadline, b""

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise CallError("no answer within the timeout")
            self.sock.settimeout(left)
            try:
                got = self.sock.recv(65536)
            except socket.timeout:
                raise CallError("no answer within the timeout") from None
            if not got:
                raise CallError("the server closed the connection")
            self.buf += got
        out, self.buf = self.buf[:n], self.buf[n:]
        return out


def call(
    path: str,
    socket_path: str,
    message: bytes,
    *,
    timeout: float,
    limit: int,
    peer_uid: Optional[int] = None,
) -> bytes:
    """The answer's message (its protobuf bytes) to ``message`` on ``path``
    ("/package.Service/Method"); CallError or OSError when there is none within
    ``timeout`` seconds, it is longer than ``limit`` bytes, the call's status is not
    OK, or (``peer_uid``) the server runs as another user."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(socket_path)
        if peer_uid is not None:
            uid = peer_credentials(s)[1]
            if uid != peer_uid:
                raise PeerError(f"the server runs as uid {uid}, not {peer_uid}")
        s.sendall(request(path, message, limit + 5))
        return _answer(s, _Reader(s, deadline), limit)


class PeerError(CallError):
    """The socket's server is not the user it must be."""


def peer_credentials(s: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that made the other end (SO_PEERCRED)."""
    raw = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def _answer(s: socket.socket, r: _Reader, limit: int) -> bytes:
    decoder = hpack.Decoder()
    body = b""
    block = b""  # a header block until END_HEADERS
    block_ends_stream = False
    headers: list[list[tuple[str, str]]] = []  # each header block of our stream
    while True:
        length, kind, flags, stream = _header(r.exactly(9))
        if length > limit + 4096:
            raise CallError(f"a frame of {length} bytes")
        payload = r.exactly(length)
        if block and kind != CONTINUATION:
            raise CallError("a header block interrupted by another frame")
        if kind == SETTINGS and not flags & ACK and stream == 0:
            s.sendall(_frame(SETTINGS, ACK, 0))
        elif kind == PING and not flags & ACK:
            s.sendall(_frame(PING, ACK, 0, payload))
        elif kind == GOAWAY:
            last, code = struct.unpack(">II", payload[:8]) if len(payload) >= 8 else (0, -1)
            if code != NO_ERROR or last & 0x7FFFFFFF < STREAM:
                debug = cut(payload[8:].decode("utf-8", "replace"), 120)
                raise CallError(
                    f"the server went away (HTTP/2 error {code}"
                    + (f": {debug}" if debug else "")
                    + ")"
                )
            # graceful: our stream is still answered
        elif kind in (HEADERS, CONTINUATION):
            if kind == HEADERS:
                block_ends_stream = bool(flags & END_STREAM)
                payload = _unpad(payload, flags)
                if flags & PRIORITY:
                    payload = payload[5:]
            block += payload
            if len(block) > MAX_HEADER_BLOCK:
                raise CallError(f"a header block over {MAX_HEADER_BLOCK} bytes")
            if not flags & END_HEADERS:
                continue
            try:  # decoded whatever its stream: the dynamic table is the connection's
                fields = decoder.decode(block)
            except hpack.HpackError as e:
                raise CallError(f"unreadable answer headers: {e}") from None
            block = b""
            if stream == STREAM:
                headers.append(fields)
                if block_ends_stream:
                    return _outcome(headers, body)
        elif stream != STREAM:
            continue
        elif kind == RST_STREAM:
            code = struct.unpack(">I", payload[:4])[0] if len(payload) >= 4 else -1
            raise CallError(f"the server reset the call (HTTP/2 error {code})")
        elif kind == DATA:
            body += _unpad(payload, flags)
            if len(body) > limit + 5:
                raise CallError(f"an answer longer than {limit} bytes")
            if flags & END_STREAM:
                return _outcome(headers, body)


def _outcome(headers: list[list[tuple[str, str]]], body: bytes) -> bytes:
    """The message, unless the answer's last header block (the trailers, or a
    Trailers-Only answer's only block) holds a grpc-status other than 0: CallError."""
    last = dict(headers[-1]) if headers else {}
    status = last.get("grpc-status")
    if status is not None and status != "0":
        code = int(status) if status.isdigit() and len(status) < 3 else -1
        name = GRPC_CODES[code] if 0 <= code < len(GRPC_CODES) else "?"
        message = cut(urllib.parse.unquote(last.get("grpc-message", "")), 200)
        raise CallError(f"code {cut(status, 8)} {name}: {message or 'no message'}")
    if status is None and not body:
        http = dict(headers[0]).get(":status", "") if headers else ""
        said = f" (HTTP status {cut(http, 8)})" if http and http != "200" else ""
        raise CallError(f"no message in the answer and no grpc-status{said}")
    return _message(body)


def _header(h: bytes) -> tuple[int, int, int, int]:
    length = int.from_bytes(h[:3], "big")
    return length, h[3], h[4], int.from_bytes(h[5:9], "big") & 0x7FFFFFFF


def _unpad(payload: bytes, flags: int) -> bytes:
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise CallError("a malformed padded DATA frame")
    return payload[1 : len(payload) - payload[0]]


def _message(body: bytes) -> bytes:
    """The one length-prefixed message of a unary answer."""
    if not body:
        raise CallError("no message in an OK answer")
    if len(body) < 5 or body[0] != 0:
        raise CallError("a malformed or compressed gRPC message")
    n = struct.unpack(">I", body[1:5])[0]
    if len(body) != 5 + n:
        raise CallError("a truncated gRPC message")
    return body[5:]
