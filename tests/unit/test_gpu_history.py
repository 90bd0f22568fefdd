"""The GPU identity history: a typed, versioned, bounded file that is safe to lose.

Anything that is not exactly what render() writes is "no history" with one line naming
the file and what is wrong, never an exception: a FIFO, a link, a directory, a huge
file, deep nesting, wrong types, out-of-range numbers, duplicates, another version.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.checkpoint import history
from gpuguard.checkpoint.history import (
    MAX_GENERATIONS,
    Generation,
    GpuIdentity,
    History,
    MigIdentity,
    advance,
    normal_bus_id,
)
from gpuguard.host.inventory import Gpu, MigDevice

A = GpuIdentity("GPU-a", "0000:17:00.0", 0, 0, 0, (MigIdentity("MIG-a1", 1, 0),))
B = GpuIdentity("GPU-b", "0000:65:00.0", 1, 1, 1)


def gen(*gpus: GpuIdentity, when: float = 100.0) -> Generation:
    return Generation(tuple(gpus), when, "boot-1", "nvml")


def doc(**change: Any) -> dict[str, Any]:
    d = json.loads(history.render(History((gen(A, B),))))
    d.update(change)
    return d


def test_render_parse_round_trip() -> None:
    h = History((gen(A), gen(A, B, when=200.0)))
    assert history.parse(history.render(h), "f") == h


@pytest.mark.parametrize(
    "bus, normal",
    [
        ("00000000:17:00.0", "0000:17:00.0"),
        ("0000:17:00.0", "0000:17:00.0"),
        ("00000001:B1:1F.7", "0001:b1:1f.7"),
        ("17:00.0", "0000:17:00.0"),
        ("  GARBAGE ", "garbage"),
    ],
)
def test_bus_ids_are_compared_in_one_form(bus: str, normal: str) -> None:
    assert normal_bus_id(bus) == normal


def test_generation_of_an_inventory() -> None:
    gpus = [Gpu("GPU-a", 0, 0, "00000000:17:00.0", (MigDevice("MIG-a1", 1, 0),))]
    g = history.generation_of(gpus, {"0000:17:00.0": 0}, when=5.0, boot_id="b", source="nvml")
    assert g.gpus == (A,)
    assert (
        history.generation_of(gpus, {}, when=5.0, boot_id="b", source="x").gpus[0].numa_node == -1
    )


def test_advance_records_only_a_change_and_keeps_the_newest_few() -> None:
    h = advance(None, gen(A))
    assert h is not None and h.newest == gen(A)
    assert advance(h, gen(A, when=999.0)) is None  # same GPUs: nothing to write
    assert advance(h, gen()) is None  # no GPU: never recorded
    h2 = advance(h, gen(A, B))
    assert h2 is not None and [len(g.gpus) for g in h2.generations] == [1, 2]
    h3 = advance(h2, gen(A, when=300.0))  # back to the first set: it moves to the end
    assert h3 is not None and [len(g.gpus) for g in h3.generations] == [2, 1]
    many = h3
    for i in range(10):
        nxt = advance(many, gen(GpuIdentity(f"GPU-{i}", "0000:01:00.0", 0, 0)))
        assert nxt is not None
        many = nxt
    assert len(many.generations) == MAX_GENERATIONS
    assert many.newest is not None and many.newest.gpus[0].uuid == "GPU-9"


def _write(path: Path, data: Any) -> None:
    path.write_bytes(data if isinstance(data, bytes) else json.dumps(data).encode())


BAD: list[tuple[str, Any, str]] = [
    ("not json", b"{", "not JSON"),
    ("not utf-8", b"\xff\xfe", "not UTF-8"),
    ("a list", [], "not an object"),
    ("other version", doc(version=2), "version"),
    ("version true", doc(version=True), "version"),
    ("no generations", {"version": 1}, "generations: missing"),
    ("too many generations", doc(generations=[doc()["generations"][0]] * 5), "(at most 4)"),
    ("gpus not a list", doc(generations=[{**doc()["generations"][0], "gpus": {}}]), "not a list"),
    ("no gpu", doc(generations=[{**doc()["generations"][0], "gpus": []}]), ": no GPU"),
    ("NaN time", b'{"version":1,"generations":[{"recorded_at":NaN}]}', "NaN"),
    ("huge number", b'{"version":1,"generations":[{"recorded_at":' + b"9" * 5000 + b"}]}",
     "5000-digit number"),
]  # fmt: skip


def _gpu_doc(**change: Any) -> dict[str, Any]:
    g = doc()["generations"][0]
    g["gpus"] = [{**g["gpus"][0], **change}, g["gpus"][1]]
    return {"version": 1, "generations": [g]}


BAD += [
    ("index a string", _gpu_doc(index="0"), "index"),
    ("index a bool", _gpu_doc(index=True), "index"),
    ("negative minor", _gpu_doc(minor=-1), "minor"),
    ("minor too big", _gpu_doc(minor=2**20), "minor"),
    ("uuid empty", _gpu_doc(uuid=""), "uuid"),
    ("uuid huge", _gpu_doc(uuid="G" * 500), "uuid"),
    ("duplicate uuid", _gpu_doc(uuid="GPU-b"), "UUID is listed twice"),
    ("duplicate index", _gpu_doc(index=1), "index is listed twice"),
    ("duplicate bus", _gpu_doc(pci_bus_id="0000:65:00.0"), "bus id is listed twice"),
    ("mig not a list", _gpu_doc(mig="MIG-x"), "not a list"),
    ("mig bad", _gpu_doc(mig=[{"uuid": "MIG-x", "gi": "1", "ci": 0}]), "gi"),
    ("mig dup", _gpu_doc(mig=[{"uuid": "M-1", "gi": 1, "ci": 0},
                              {"uuid": "M-2", "gi": 1, "ci": 0}]), "listed twice"),
    ("numa string", _gpu_doc(numa_node="0"), "numa_node"),
    ("missing key", {"version": 1, "generations": [{"gpus": []}]}, "recorded_at: missing"),
]  # fmt: skip


@pytest.mark.parametrize("name, data, what", BAD, ids=[b[0] for b in BAD])
def test_malformed_files_are_no_history_with_one_line(
    tmp_path: Path, name: str, data: Any, what: str
) -> None:
    path = tmp_path / "gpu-identity.json"
    _write(path, data)
    h, problem = history.read(path)
    assert h is None
    assert what in problem and str(path) in problem
    assert "\n" not in problem and len(problem) < 600


def test_deep_nesting_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "h.json"
    path.write_bytes(b"[" * 200_000 + b"]" * 200_000)
    h, problem = history.read(path)
    assert h is None and "too big" not in problem and str(path) in problem


def test_too_big_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "h.json"
    with path.open("wb") as f:
        f.truncate(history.MAX_BYTES + 1)
    h, problem = history.read(path)
    assert h is None and "limit" in problem


def test_fifo_link_and_directory_are_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link"
    good = tmp_path / "good"
    good.write_bytes(history.render(History((gen(A),))))
    link.symlink_to(good)
    (tmp_path / "dir").mkdir()
    for path, what in ((fifo, "not a regular file"), (link, "symbolic link"),
                       (tmp_path / "dir", "directory")):  # fmt: skip
        h, problem = history.read(path)
        assert h is None and what in problem


def test_absent_is_no_history_without_a_problem(tmp_path: Path) -> None:
    assert history.read(tmp_path / "none") == (None, "")


uuid = st.text("0123456789abcdef", min_size=4, max_size=8).map(lambda s: "GPU-" + s)


@st.composite
def generations(draw: st.DrawFn) -> Generation:
    n = draw(st.integers(1, 6))
    uuids = draw(st.lists(uuid, min_size=n, max_size=n, unique=True))
    indices = draw(st.permutations(range(n)))
    minors = draw(st.lists(st.integers(0, 255), min_size=n, max_size=n, unique=True))
    gpus = tuple(
        GpuIdentity(u, f"0000:{0x10 + i:02x}:00.0", indices[i], minors[i],
                    draw(st.integers(-1, 3)),
                    tuple(MigIdentity(f"MIG-{u[4:]}-{k}", k + 1, 0)
                          for k in range(draw(st.integers(0, 2)))))
        for i, u in enumerate(uuids)
    )  # fmt: skip
    return Generation(gpus, float(draw(st.integers(0, 2**31))), "b", "nvml")


@settings(max_examples=100, deadline=None)
@given(st.lists(generations(), min_size=1, max_size=6))
def test_advanced_histories_round_trip_and_stay_bounded(gens: list[Generation]) -> None:
    h = None
    for g in gens:
        h = advance(h, g) or h
    assert h is not None and 1 <= len(h.generations) <= MAX_GENERATIONS
    assert h.newest is not None and h.newest.identity() == gens[-1].identity()
    assert history.parse(history.render(h), "f") == h
    assert len({g.identity() for g in h.generations}) == len(h.generations)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_raise(data: bytes) -> None:
    try:
        history.parse(data, "f")
    except history.HistoryError as e:
        assert "\n" not in e.message
