"""host/statefile.py, the one loader of gpuguard's state files, and its writer."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

import statusdoc
from gpuguard.actuate.statefile import write_state
from gpuguard.host.statefile import Obj, StateFile, load, parse_json
from gpuguard.reporting.status import SPEC as STATUS_SPEC


@dataclass(frozen=True)
class Seen:
    uuid: str
    slot: str
    first: float
    count: int


SPEC: StateFile[tuple[Seen, ...]] = StateFile(
    path="/var/lib/gpuguard/example.json",
    what="example history",
    version=2,
    parse=lambda o: o.items(
        "gpus",
        lambda v, w: (
            lambda g: Seen(
                g.text("uuid", max_len=64),
                g.text("slot", max_len=16),
                g.real("first"),
                g.integer("count", hi=1000),
            )
        )(Obj(v, w)),
        max_items=64,
    ),
    render=lambda gpus: {
        "gpus": [{"uuid": g.uuid, "slot": g.slot, "first": g.first, "count": g.count} for g in gpus]
    },
    mode=0o600,
)
GPUS = (Seen("GPU-a", "0000:3b:00.0", 1.5e9, 3),)


def test_a_new_state_file_is_a_spec_a_parser_and_a_renderer(tmp_path: Path) -> None:
    path = tmp_path / "var/lib/gpuguard/example.json"
    assert load(path, SPEC).absent
    write_state(path, SPEC, GPUS)
    assert path.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "var/lib/gpuguard").stat().st_mode & 0o777 == 0o700
    assert json.loads(path.read_text())["version"] == 2
    got = load(path, SPEC)
    assert got.value == GPUS and got.why == "" and not got.absent


@pytest.mark.parametrize(
    ("doc", "why"),
    [
        ('{"version": 1, "gpus": []}', "version 1, this gpuguard reads version 2"),
        ('{"version": 2}', "document.gpus: missing"),
        ('{"version": 2, "gpus": {}}', "document.gpus: not a list"),
        ('{"version": 2, "gpus": [[]]}', "document.gpus[0]: not an object"),
        (
            '{"version": 2, "gpus": [{"uuid": 7, "slot": "", "first": 1, "count": 1}]}',
            "document.gpus[0].uuid: not a string",
        ),
        (
            '{"version": 2, "gpus": [{"uuid": "", "slot": "", "first": 1, "count": 1001}]}',
            "count: 1001 is out of range [0, 1000]",
        ),
        (
            '{"version": 2, "gpus": [{"uuid": "", "slot": "", "first": true, "count": 1}]}',
            "first: not a number",
        ),
        ('{"version": 2, "gpus": [' + "1" * 400 + "]}", "a 400-digit number"),
        ('{"version": 2, "gpus": [1e400]}', "out of range"),
        ('{"version": NaN}', "NaN is not a number gpuguard writes"),
        ("[" * 100_000, "nested too deep"),
        ("\udcff", "not UTF-8"),
        ("", "not JSON"),
    ],
)
def test_anything_else_is_unknown_with_one_line(tmp_path: Path, doc: str, why: str) -> None:
    path = tmp_path / "example.json"
    path.write_bytes(doc.encode("utf-8", "surrogateescape"))
    got = load(path, SPEC)
    assert got.value is None and not got.absent
    assert why in got.why and str(path) in got.why
    assert len(got.why) <= 400 and got.why.isprintable()


def test_a_lone_surrogate_is_read_as_a_replacement_character() -> None:
    assert Obj(parse_json(b'{"a": "x\\ud800y"}')).text("a") == "x\ufffdy"


def test_what_the_writer_wrote_reads_back_the_same_counts_included() -> None:
    status = statusdoc.model(
        {
            "steps": {"gpu_count": {"gauges": {"gpus_pci": 2, "ratio": 0.5}}},
            "fast_paths": {"new_scopes": {"granted": 5, "first_try_ms": [0.1, 0.3]}},
        }
    )
    again = STATUS_SPEC.decode(STATUS_SPEC.encode(status))
    assert again == status
    assert type(again.steps["gpu_count"].gauges["gpus_pci"]) is int
    assert again.fast_paths.new_scopes["granted"] == 5
    text = STATUS_SPEC.encode(status).decode()
    assert '"granted": 5.0' not in text and '"gpus_pci": 2.0' not in text


def test_the_writer_refuses_a_linked_state_directory(tmp_path: Path) -> None:
    from gpuguard.errors import BadInputError

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "var/lib").mkdir(parents=True)
    os.symlink(tmp_path / "elsewhere", tmp_path / "var/lib/gpuguard")
    with pytest.raises(BadInputError, match="symbolic link"):
        write_state(tmp_path / "var/lib/gpuguard/example.json", SPEC, GPUS)
    assert list((tmp_path / "elsewhere").iterdir()) == []
