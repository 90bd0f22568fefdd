"""The CLI paths that print host data (`checkpoint inspect`, `disable`, `enable`) echo
it escaped and bounded, and `disable` writes nothing through a link that leaves
--root. Hostile values: ESC/OSC/BEL terminal sequences, a right-to-left override
(U+202E), and a megabyte in one value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuguard import cli, exitcodes
from gpuguard.checkpoint import marshal
from gpuguard.checkpoint.model import Checkpoint, PodDevicesEntry
from gpuguard.host.offswitch import REASON_MAX

HOSTILE = [
    "\x1b]0;pwned\x07",  # OSC: set the terminal's title
    "\x1b[2J\x1b[H",  # ESC: clear the screen
    "GPU-\u202egpj.exe",  # right-to-left override
    "\x07bell",
]
HUGE = "G" * (1024 * 1024)


def _no_raw_control(text: str) -> None:
    for bad in ("\x1b", "\x07", "\u202e"):
        assert bad not in text
    assert max(len(line) for line in text.splitlines()) < 64 * 1024


def test_checkpoint_inspect_escapes_and_bounds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    entries = tuple(
        PodDevicesEntry(v, v, "nvidia.com/gpu", (("0", (v, HUGE)),), b"") for v in [*HOSTILE, HUGE]
    )
    registered = (("nvidia.com/gpu", (*HOSTILE, HUGE, *(f"GPU-{n}" for n in range(500)))),)
    path = tmp_path / "kubelet_internal_checkpoint"
    path.write_bytes(marshal(Checkpoint("v2", entries, registered, 0, None)))
    code = cli.main(["checkpoint", "inspect", "--root", str(tmp_path), str(path)])
    out = capsys.readouterr()
    assert code in (exitcodes.OK, exitcodes.BAD_INPUT)
    _no_raw_control(out.out + out.err)
    assert "\\x1b]0;pwned\\x07" in out.out and "\\u202e" in out.out
    assert "more)" in out.out  # 505 registered IDs: the first ones, then a count
    # the JSON report carries every value whole, escaped by JSON itself
    cli.main(["checkpoint", "inspect", "--json", "--root", str(tmp_path), str(path)])
    raw = capsys.readouterr().out
    assert "\x1b" not in raw and "\u202e" not in raw
    assert json.loads(raw)["entries"][0]["pod_uid"] == HOSTILE[0]


def _disable(root: Path, reason: str) -> int:
    return cli.main(["disable", "--root", str(root), "--reason", reason])


@pytest.mark.parametrize("reason", [*HOSTILE, "a" * (65 * 1024)])
def test_disable_echoes_the_reason_escaped_and_keeps_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], reason: str
) -> None:
    assert _disable(tmp_path, reason) == exitcodes.OK
    out = capsys.readouterr()
    _no_raw_control(out.out + out.err)
    assert len(out.out) < 4096
    cli.main(["status", "--root", str(tmp_path)])
    status = capsys.readouterr().out
    _no_raw_control(status)
    if len(reason) > REASON_MAX:  # said, and the reason is not lost
        assert f"kept its first {REASON_MAX}" in out.err
        assert "a" * 100 in status
    else:
        assert reason.strip("\x07\x1b")[:3] in status or "\\x" in status


def test_disable_writes_nothing_through_a_link_out_of_the_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, outside = tmp_path / "root", tmp_path / "elsewhere"
    (root / "etc").mkdir(parents=True)
    outside.mkdir()
    (root / "etc/gpuguard").symlink_to(outside)
    code = _disable(root, "incident")
    err = capsys.readouterr().err
    assert code == exitcodes.USAGE and "outside" in err and "Traceback" not in err
    assert list(outside.iterdir()) == []
    (outside / "disabled").write_text("set by someone else\n")
    assert cli.main(["enable", "--root", str(root)]) == exitcodes.USAGE
    assert (outside / "disabled").exists()  # nothing removed outside the root either
