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
ours. The answer's headers are not decoded (Huffman-coded, with a dynamic table): a
complete message means success (a gRPC server sends none with an error status), its
absence an error whose status is not read.
"""

from __future__ import annotations

import socket
import struct
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, ACK, END_HEADERS, PADDED = 0x1, 0x1, 0x4, 0x8
STREAM = 1  # the one request stream
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
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
    settings = struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, window)
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


def call(path: str, socket_path: str, message: bytes, *, timeout: float, limit: int) -> bytes:
    """The answer's message (its protobuf bytes) to ``message`` on ``path``
    ("/package.Service/Method"); CallError or OSError when there is none within
    ``timeout`` seconds, or it is longer than ``limit`` bytes."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(socket_path)
        s.sendall(request(path, message, limit + 5))
        r = _Reader(s, deadline)
        body = b""
        while True:
            length, kind, flags, stream = _header(r.exactly(9))
            if length > limit + 4096:
                raise CallError(f"a frame of {length} bytes")
            payload = r.exactly(length)
            if kind == SETTINGS and not flags & ACK and stream == 0:
                s.sendall(_frame(SETTINGS, ACK, 0))
            elif kind == PING and not flags & ACK:
                s.sendall(_frame(PING, ACK, 0, payload))
            elif kind == GOAWAY:
                code = struct.unpack(">I", payload[4:8])[0] if len(payload) >= 8 else -1
                raise CallError(f"the server went away (HTTP/2 error {code})")
            elif stream != STREAM:
                continue
            elif kind == RST_STREAM:
                code = struct.unpack(">I", payload[:4])[0] if len(payload) >= 4 else -1
                raise CallError(f"the server reset the call (HTTP/2 error {code})")
            elif kind == DATA:
                body += _unpad(payload, flags)
                if len(body) > limit + 5:
                    raise CallError(f"an answer longer than {limit} bytes")
            if stream == STREAM and kind in (DATA, HEADERS) and flags & END_STREAM:
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
        raise CallError("no message in the answer (an error status)")
    if len(body) < 5 or body[0] != 0:
        raise CallError("a malformed or compressed gRPC message")
    n = struct.unpack(">I", body[1:5])[0]
    if len(body) != 5 + n:
        raise CallError("a truncated gRPC message")
    return body[5:]
