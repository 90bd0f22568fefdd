"""host/hpack.py: RFC 7541's own examples (Appendix C, with and without Huffman
coding, the dynamic table across requests and its evictions), a Huffman round trip
for any bytes, and any input either decoded or refused with HpackError, never
another exception."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fuzz.budget import budget
from gpuguard.host import hpack

# RFC 7541 C.4: three requests on one connection, Huffman-coded
C4 = (
    "828684418cf1e3c2e5f23a6ba0ab90f4ff",
    "828684be5886a8eb10649cbf",
    "828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf",
)
C4_FIELDS = [
    [(":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com")],
    [(":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com"),
     ("cache-control", "no-cache")],
    [(":method", "GET"), (":scheme", "https"), (":path", "/index.html"),
     (":authority", "www.example.com"), ("custom-key", "custom-value")],
]  # fmt: skip
# RFC 7541 C.6: responses, Huffman-coded, a 256-byte table (evictions)
C6 = (
    "488264025885aec3771a4b6196d07abe941054d444a8200595040b8166e082a62d1bff6e919d29ad1718"
    "63c78f0b97c8e9ae82ae43d3",
    "4883640effc1c0bf",
    "88c16196d07abe941054d444a8200595040b8166e084a62d1bffc05a839bd9ab77ad94e7821dd7f2e6c7"
    "b335dfdfcd5b3960d5af27087f3672c1ab270fb5291f9587316065c003ed4ee5b1063d5007",
)


def test_rfc7541_requests_with_the_dynamic_table() -> None:
    d = hpack.Decoder()
    assert [d.decode(bytes.fromhex(h)) for h in C4] == C4_FIELDS
    assert d.size == 164  # C.4.3's table size


def test_rfc7541_responses_with_evictions() -> None:
    d = hpack.Decoder()
    d.limit = 256  # the example's SETTINGS_HEADER_TABLE_SIZE
    got = [d.decode(bytes.fromhex(h)) for h in C6]
    assert got[1][0] == (":status", "307") and got[1][1:] == got[0][1:]
    assert got[2][-1] == ("set-cookie", "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1")
    assert d.size == 215 and [n for n, _v in d.table] == ["set-cookie", "content-encoding", "date"]


def huffman_encode(data: bytes) -> bytes:
    codes = {sym: (n, code) for (n, code), sym in hpack._CODES.items()}
    bits = n_bits = 0
    for b in data:
        n, code = codes[b]
        bits, n_bits = (bits << n) | code, n_bits + n
    pad = -n_bits % 8
    bits, n_bits = (bits << pad) | ((1 << pad) - 1), n_bits + pad
    return bits.to_bytes(n_bits // 8, "big")


@budget(300)
@given(st.binary(max_size=200))
def test_huffman_round_trip(data: bytes) -> None:
    assert hpack.huffman_decode(huffman_encode(data)) == data


@budget(500)
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_any_input_is_decoded_or_refused(blocks: list[bytes]) -> None:
    d = hpack.Decoder()
    for block in blocks:
        try:
            fields = d.decode(block)
        except hpack.HpackError:
            continue
        assert all(isinstance(n, str) and isinstance(v, str) for n, v in fields)
        assert d.size <= d.limit
