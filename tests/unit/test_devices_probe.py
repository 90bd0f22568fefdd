"""probe.py without a cgroup: the errno protocol and its interpretation."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from gpuguard.devices.probe import interpret_errno, probe_open, probe_open_all


@pytest.mark.parametrize(
    ("err", "verdict"),
    [
        (errno.EPERM, False),
        (0, True),
        (errno.ENXIO, True),
        (errno.ENODEV, True),
        (errno.ENOENT, None),
        (errno.EACCES, None),
    ],
)
def test_interpret_errno(err: int, verdict: bool | None) -> None:
    assert interpret_errno(err) is verdict


def test_probe_opens_in_own_cgroup(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    r = probe_open(f, [])
    assert (r.errno, r.verdict, r.detail) == (0, True, "opened")


def test_probe_missing_node(tmp_path: Path) -> None:
    r = probe_open(tmp_path / "gone", [])
    assert (r.errno, r.verdict) == (errno.ENOENT, None)


def test_probe_cannot_join(tmp_path: Path) -> None:
    r = probe_open(tmp_path, [tmp_path / "no-such-cgroup"])
    assert r.verdict is None
    assert "could not join the cgroup" in r.detail


def test_probe_all_answers_each_node_in_order_from_one_child(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    res = probe_open_all([tmp_path / "gone", f, tmp_path / "gone2"], [])
    assert [(r.node, r.errno, r.verdict) for r in res] == [
        (str(tmp_path / "gone"), errno.ENOENT, None),
        (str(f), 0, True),
        (str(tmp_path / "gone2"), errno.ENOENT, None),
    ]
    cannot = probe_open_all([f, f], [tmp_path / "no-such-cgroup"])
    assert [r.verdict for r in cannot] == [None, None]
    assert all("could not join the cgroup" in r.detail for r in cannot)
    assert probe_open_all([], []) == []
