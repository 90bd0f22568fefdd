"""HPACK (RFC 7541) decoding, for the header blocks of a gRPC answer (host/unarygrpc.py).

A gRPC server's answer carries its outcome in header fields: ``grpc-status`` and
``grpc-message`` in the trailers (or in the one header block of a "Trailers-Only"
answer). Go's HTTP/2 server (kubelet's) codes them with the static table, its
dynamic table and Huffman-coded strings: all of RFC 7541's representations are read
here (indexed, literal with and without indexing, never indexed, table size
updates). One Decoder per connection: the dynamic table lives as long as it.
Bounded: a header block's decoded size (MAX_LIST), each string, each integer.
Any malformed input is a HpackError (a ValueError), never an IndexError.
"""

from __future__ import annotations

from typing import Optional

MAX_LIST = 16 * 1024  # decoded bytes of one header block (names + values + 32 each)
MAX_TABLE = 4096  # SETTINGS_HEADER_TABLE_SIZE's default: we never announce another

STATIC: tuple[tuple[str, str], ...] = (
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
)

# The Huffman code's lengths for the symbols 0-255 (RFC 7541 Appendix B); the code is
# canonical (codes assigned in order of length, then symbol), so the lengths define it.
# EOS (256) is 30 bits of ones.
_LENGTHS = bytes.fromhex(
    "0d171c1c1c1c1c1c1c181e1c1c1e1c1c1c1c1c1c1c1c1e1c1c1c1c1c1c1c1c1c060a0a0c0d06080b"
    "0a0a080b080606060505050606060606060607080f060c0a0d060707070707070707070707070707"
    "07070707070707070807080d130d0e060f0506050605060606050707060606050607060505060707"
    "0707070f0b0e0d1c1416141416161617161717171717181718181617181717171715161716171718"
    "16151416161717151716161815161717151516151716171714161616171616171a1a141316171619"
    "1a1a1a1b1b1a181913151a1b1b1a1b1815151a1a1c1b1b1b14181415161515171616191918181a17"
    "1a1b1a1a1b1b1b1b1b1c1b1b1b1b1b1a"
)


def _canonical(lengths: bytes) -> dict[tuple[int, int], int]:
    """(length, code) -> symbol, for the symbols 0-255."""
    out: dict[tuple[int, int], int] = {}
    code, prev = -1, 0
    for sym in sorted(range(len(lengths)), key=lambda s: (lengths[s], s)):
        n = lengths[sym]
        code = (code + 1) << (n - prev) if code >= 0 else 0
        prev = n
        out[(n, code)] = sym
    return out


_CODES = _canonical(_LENGTHS)


class HpackError(ValueError):
    """A header block that is not valid HPACK."""


def huffman_decode(data: bytes) -> bytes:
    out = bytearray()
    code = n = 0
    for byte in data:
        for shift in range(7, -1, -1):
            code = (code << 1) | ((byte >> shift) & 1)
            n += 1
            sym = _CODES.get((n, code)) if n >= 5 else None
            if sym is not None:
                out.append(sym)
                code = n = 0
            elif n >= 30:
                raise HpackError("a Huffman string with EOS or an invalid code")
    if n > 7 or code != (1 << n) - 1:  # padding: at most 7 bits, the EOS prefix (ones)
        raise HpackError("a Huffman string with invalid padding")
    return bytes(out)


class Decoder:
    """The decoding context of one connection (its dynamic table)."""

    def __init__(self, max_table: int = MAX_TABLE) -> None:
        self.max_table = max_table  # what we allow the peer (SETTINGS)
        self.limit = max_table  # the table's size as the peer last set it
        self.table: list[tuple[str, str]] = []  # newest first
        self.size = 0

    def _entry(self, index: int) -> tuple[str, str]:
        if index <= 0:
            raise HpackError("header index 0")
        if index <= len(STATIC):
            return STATIC[index - 1]
        i = index - len(STATIC) - 1
        if i >= len(self.table):
            raise HpackError(f"header index {index} beyond the tables")
        return self.table[i]

    def _add(self, name: str, value: str) -> None:
        size = len(name.encode()) + len(value.encode()) + 32
        self.table.insert(0, (name, value))
        self.size += size
        self._evict()

    def _evict(self) -> None:
        while self.size > self.limit and self.table:
            n, v = self.table.pop()
            self.size -= len(n.encode()) + len(v.encode()) + 32

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        """The header fields of one complete header block, in order."""
        r = _Reader(block)
        out: list[tuple[str, str]] = []
        total = 0
        while not r.done():
            b = r.peek()
            name: Optional[str]
            if b & 0x80:  # indexed field
                name, value = self._entry(r.integer(7))
            elif b & 0xC0 == 0x40:  # literal, with incremental indexing
                index = r.integer(6)
                name = self._entry(index)[0] if index else r.string()
                value = r.string()
                self._add(name, value)
            elif b & 0xE0 == 0x20:  # dynamic table size update
                size = r.integer(5)
                if size > self.max_table:
                    raise HpackError(f"a table size of {size} beyond {self.max_table}")
                self.limit = size
                self._evict()
                continue
            else:  # literal without indexing (0000) or never indexed (0001)
                index = r.integer(4)
                name = self._entry(index)[0] if index else r.string()
                value = r.string()
            total += len(name) + len(value) + 32
            if total > MAX_LIST:
                raise HpackError(f"a header block over {MAX_LIST} bytes")
            out.append((name, value))
        return out


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def done(self) -> bool:
        return self.pos >= len(self.data)

    def peek(self) -> int:
        if self.pos >= len(self.data):
            raise HpackError("a truncated header block")
        return self.data[self.pos]

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise HpackError("a truncated header block")
        self.pos += 1
        return self.data[self.pos - 1]

    def integer(self, prefix: int) -> int:
        mask = (1 << prefix) - 1
        value = self.byte() & mask
        if value < mask:
            return value
        shift = 0
        while True:
            b = self.byte()
            value += (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value
            if shift > 28:
                raise HpackError("an integer over 2^28")

    def string(self) -> str:
        huffman = bool(self.peek() & 0x80)
        n = self.integer(7)
        if n > MAX_LIST:
            raise HpackError(f"a string of {n} bytes")
        raw = self.data[self.pos : self.pos + n]
        if len(raw) != n:
            raise HpackError("a truncated header string")
        self.pos += n
        return (huffman_decode(raw) if huffman else raw).decode("utf-8", "replace")
