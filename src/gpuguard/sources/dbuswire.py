"""Just enough of the D-Bus wire format to pick systemd's Reloading signal out of a
direct connection's stream (reload_socket.py), without parsing any other body.

Pure: bytes in, a few header fields out; anything malformed raises WireError (the
caller drops the connection). Spec: dbus-specification, "Message Format".
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional, Union

from gpuguard.host.systemd import MANAGER

FIXED = 16  # endianness, type, flags, version, body length, serial, fields length
MAX_MESSAGE = 16 * 1024 * 1024  # systemd's largest are property sets of ~100 KB
SIGNAL = 4
FIELD_INTERFACE, FIELD_MEMBER, FIELD_SIGNATURE = 2, 3, 8


Buffer = Union[bytes, bytearray]


class WireError(ValueError):
    """Not a D-Bus message as the specification writes one."""


@dataclass(frozen=True)
class Header:
    kind: int  # 1 call, 2 return, 3 error, 4 signal
    fields_end: int  # offset of the end of the header fields
    body_start: int  # 8-aligned after the fields
    total: int  # the whole message's length
    little: bool


def auth_request(uid: int) -> bytes:
    """The client's opening: the NUL byte, then SASL EXTERNAL with its uid in hex."""
    return b"\0AUTH EXTERNAL " + str(uid).encode().hex().encode() + b"\r\n"


def header(buf: Buffer, off: int = 0) -> Header:
    """The layout of the message at `off` in `buf`, from its first 16 bytes."""
    if len(buf) - off < FIXED:
        raise WireError(f"{len(buf) - off} header bytes, need {FIXED}")
    if buf[off] not in (ord("l"), ord("B")):
        raise WireError(f"endianness byte {buf[off]!r} is neither 'l' nor 'B'")
    little = buf[off] == ord("l")
    if buf[off + 3] != 1:
        raise WireError(f"protocol version {buf[off + 3]}, not 1")
    body_len, _serial, fields_len = struct.unpack_from("<III" if little else ">III", buf, off + 4)
    fields_end = FIXED + fields_len
    body_start = fields_end + (-fields_end % 8)
    total = body_start + body_len
    if total > MAX_MESSAGE:
        raise WireError(f"a message of {total} bytes (at most {MAX_MESSAGE})")
    return Header(buf[off + 1], fields_end, body_start, total, little)


def _fields(msg: Buffer, h: Header) -> dict[int, object]:
    """The header fields this reader needs (strings, signatures, uint32s)."""
    e = "<" if h.little else ">"
    out: dict[int, object] = {}
    pos = FIXED
    end = h.fields_end
    if end > len(msg):
        raise WireError("header fields run past the message")
    while pos < end:
        pos += -pos % 8
        if pos + 3 > end:
            raise WireError("a truncated header field")
        code, sig_len = msg[pos], msg[pos + 1]
        sig = msg[pos + 2 : pos + 2 + sig_len]
        pos += 3 + sig_len
        if sig in (b"s", b"o"):
            pos += -pos % 4
            if pos + 4 > end:
                raise WireError("a truncated string field")
            (n,) = struct.unpack_from(e + "I", msg, pos)
            if pos + 4 + n + 1 > end or msg[pos + 4 + n] != 0:
                raise WireError("a string field without its NUL")
            out[code] = bytes(msg[pos + 4 : pos + 4 + n]).decode("utf-8", "replace")
            pos += 4 + n + 1
        elif sig == b"g":
            if pos >= end:
                raise WireError("a truncated signature field")
            n = msg[pos]
            if pos + 1 + n + 1 > end:
                raise WireError("a signature field without its NUL")
            out[code] = bytes(msg[pos + 1 : pos + 1 + n]).decode("ascii", "replace")
            pos += 1 + n + 1
        elif sig in (b"u", b"h"):
            pos += -pos % 4
            if pos + 4 > end:
                raise WireError("a truncated uint32 field")
            out[code] = struct.unpack_from(e + "I", msg, pos)[0]
            pos += 4
        else:
            raise WireError(f"header field {code} of type {sig!r}")
    return out


def reloading(buf: Buffer, h: Header, off: int = 0) -> Optional[bool]:
    """systemd's Reloading(b) signal (the message at `off`): its argument; None for any
    other message."""
    # A direct connection gets every signal systemd sends (hundreds per reload): the
    # member's bytes are looked for first, the fields parsed only where they are.
    if h.kind != SIGNAL or buf.find(b"Reloading\0", off + FIXED, off + h.fields_end) < 0:
        return None
    msg = bytes(buf[off : off + h.total])
    if len(msg) < h.total:
        raise WireError("a message cut short")
    f = _fields(msg, h)
    if f.get(FIELD_MEMBER) != "Reloading" or f.get(FIELD_INTERFACE) != MANAGER:
        return None
    if f.get(FIELD_SIGNATURE) != "b" or h.body_start + 4 > len(msg):
        raise WireError("Reloading without its boolean")
    (value,) = struct.unpack_from("<I" if h.little else ">I", msg, h.body_start)
    if value > 1:
        raise WireError(f"Reloading({value}) is not a boolean")
    return bool(value)
