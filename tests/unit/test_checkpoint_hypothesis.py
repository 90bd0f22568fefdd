"""Round trips over generated checkpoints: parse(marshal(cp)) == cp, checksum stable."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.checkpoint import Checkpoint, PodDevicesEntry, marshal, parse, render, verify
from gpuguard.checkpoint.spew import checksum, fnv1a_32

text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
ids = st.one_of(st.none(), st.lists(text, max_size=4).map(tuple))
numa_key = st.one_of(st.integers(-3, 20), st.integers(-(2**63), 2**63 - 1))


def _numa(pairs: dict[int, Optional[tuple[str, ...]]]) -> Any:
    # Go writes map keys sorted as strings, so that is the order a parse gives back.
    return tuple(sorted(pairs.items(), key=lambda p: str(p[0])))


numa = st.one_of(st.none(), st.dictionaries(numa_key, ids, max_size=4).map(_numa))
plain = st.one_of(st.none(), st.lists(text, max_size=4).map(tuple))
alloc = st.one_of(st.none(), st.binary(max_size=64))


def entries(devices: Any) -> Any:
    entry = st.builds(PodDevicesEntry, text, text, text, devices, alloc)
    return st.one_of(st.none(), st.lists(entry, max_size=4).map(tuple))


registered = st.one_of(
    st.none(), st.dictionaries(text, ids, max_size=4).map(lambda d: tuple(sorted(d.items())))
)


@st.composite
def checkpoints(draw: Any) -> Checkpoint:
    fmt = draw(st.sampled_from(["v1", "v2"]))
    ents = draw(entries(numa if fmt == "v2" else plain))
    boot = draw(st.one_of(st.none(), text.filter(bool))) if fmt == "v2" else None
    if not ents:
        fmt = "any"  # nothing says which; both hash the same
    cp = Checkpoint(fmt, ents, draw(registered), 0, boot)
    return dataclasses.replace(cp, checksum=checksum(cp))


@settings(max_examples=300, deadline=None)
@given(checkpoints())
def test_round_trip(cp: Checkpoint) -> None:
    raw = marshal(cp)
    assert marshal(cp, checksum=cp.checksum) == raw
    back = parse(raw, source="generated")
    assert back == cp
    assert verify(back)
    assert checksum(back) == cp.checksum == fnv1a_32(render(cp).encode("utf-8"))
    assert marshal(back) == raw
    json.loads(raw)  # plain JSON too


@settings(max_examples=100, deadline=None)
@given(checkpoints(), st.integers(0, 2**64 - 1))
def test_stored_checksum_is_kept_and_judged(cp: Checkpoint, stored: int) -> None:
    raw = marshal(cp, checksum=stored)
    back = parse(raw, source="generated")
    assert back.checksum == stored
    assert back.entries == cp.entries and back.registered == cp.registered
    assert verify(back) == (stored == cp.checksum) or back.format != cp.format


@settings(max_examples=100, deadline=None)
@given(checkpoints())
def test_whitespace_key_case_and_order_do_not_matter(cp: Checkpoint) -> None:
    doc = json.loads(marshal(cp))
    data = doc.pop("Data")
    shuffled = {"checksum": doc.pop("Checksum"), "unknown": [1, {"x": None}], **doc}
    shuffled["DATA"] = dict(reversed(list(data.items())))
    raw = json.dumps(shuffled, indent=2).encode()
    assert parse(raw, source="generated") == cp
