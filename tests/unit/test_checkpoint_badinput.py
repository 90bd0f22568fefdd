"""Every way the checkpoint file can be wrong gives one BadInputError naming the file."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import CHECKPOINTS, REPO
from gpuguard.checkpoint import load, read_checkpoint
from gpuguard.errors import BadInputError

GOOD = (CHECKPOINTS / "gpu-lab-tegra.json").read_bytes()
ALLOC = b'"Ch8KFk5WSURJQV9WSVNJQkxFX0RFVklDRVMSBXRlZ3Jh"'
EMPTY_OK = b'{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{"nvidia.com/gpu":["GPU-0650a168-e770-3ea8-8ac3-8a1d419763e0"]}},"Checksum":3952659280}'  # noqa: E501


def expect_bad(path: Path, *words: str) -> str:
    small = path.is_file() and path.stat().st_size < 1 << 20
    before = path.read_bytes() if small and os.access(path, os.R_OK) else None
    with pytest.raises(BadInputError) as info:
        read_checkpoint(path)
    msg = info.value.message
    assert msg.startswith(f"{path}: "), msg
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg
    if before is not None:
        assert path.read_bytes() == before  # reading never modifies
    return msg


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"", ("is empty",)),
        (b"not json", ("not valid JSON",)),
        (GOOD[:-20], ("truncated",)),
        (GOOD + b"x", ("not valid JSON",)),
        (b"[1,2]", ("not an object",)),
        (b'{"Data":{},"Checksum":NaN}', ("not valid JSON",)),
        (EMPTY_OK.replace(b"3952659280", b'"3952659280"'), ("Checksum", "unsigned 64-bit")),
        (EMPTY_OK.replace(b"3952659280", b"-1"), ("Checksum -1",)),
        (EMPTY_OK.replace(b"3952659280", b"-0"), ("Checksum -0",)),
        (EMPTY_OK.replace(b"3952659280", b"3952659280.0"), ("Checksum 3952659280.0",)),
        (EMPTY_OK.replace(b"3952659280", b"1e3"), ("Checksum 1e3",)),
        (EMPTY_OK.replace(b"3952659280", b"18446744073709551616"), ("unsigned 64-bit",)),
        (EMPTY_OK.replace(b',"Checksum":3952659280', b""), ("no Checksum",)),
        (EMPTY_OK.replace(b"3952659280", b"null"), ("no Checksum",)),
        (
            EMPTY_OK.replace(b"3952659280", b"3952659281"),
            ("checksum mismatch", "stored 3952659281", "computed 3952659280", "backup"),
        ),
        (EMPTY_OK.replace(b"3952659280", b"18446744073709551615"), ("checksum mismatch",)),
        (GOOD.replace(ALLOC, b'"YQ"'), ("AllocResp", "base64")),  # Go wants padding
        (GOOD.replace(ALLOC, b'"YQ==YQ=="'), ("AllocResp", "base64")),
        (GOOD.replace(ALLOC, b'"Y-Q="'), ("AllocResp", "base64")),
        (GOOD.replace(ALLOC, b'"Y Q=="'), ("AllocResp", "base64")),
        (GOOD.replace(b'"AllocResp":"', b'"AllocResp":1,"x":"'), ("AllocResp",)),
        (GOOD.replace(b'{"-1":["tegra"]}', b'{"x":["tegra"]}'), ("DeviceIDs",)),
        (GOOD.replace(b'{"-1":["tegra"]}', b'{"9223372036854775808":["tegra"]}'), ("int64",)),
        (GOOD.replace(b'"PodUID":"bf52', b'"PodUID":5,"x":"bf52'), ("PodUID",)),
        (GOOD.replace(b'"check"', b"[]"), ("ContainerName",)),
        (GOOD.replace(b'"RegisteredDevices":{', b'"RegisteredDevices":{"a":"b",'), ("list",)),
        (GOOD.replace(b"[{", b'[{"DeviceIDs":["x"]},{'), ("mixes v1", "v2")),
        (GOOD.replace(b"check", b"ch\xffck"), ("checksum mismatch",)),  # U+FFFD, as Go
        (GOOD.replace(b"check", b"ch\\ud800ck"), ("checksum mismatch",)),
        (b"\xef\xbb\xbf" + GOOD, ("not valid JSON",)),  # Go rejects a BOM too
        (b'{"Data":' * 3000 + b"1", ("not valid JSON",)),
    ],
)
def test_bad_content(tmp_path: Path, content: bytes, words: tuple[str, ...]) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    path.write_bytes(content)
    expect_bad(path, *words)


def test_mismatch_can_still_be_inspected(tmp_path: Path) -> None:
    path = tmp_path / "cp"
    path.write_bytes(EMPTY_OK.replace(b"3952659280", b"5"))
    loaded = load(path)
    assert not loaded.valid and loaded.computed == 3952659280
    assert loaded.problem.startswith(f"{path}: checksum mismatch (stored 5, computed 3952659280)")
    cp, raw, st = read_checkpoint(path, verify=False)
    assert cp.checksum == 5 and raw == path.read_bytes() and stat.S_ISREG(st.st_mode)


def test_replacement_characters_hash_like_go(tmp_path: Path) -> None:
    from gpuguard.checkpoint import marshal, parse

    cp = parse(GOOD.replace(b"check", b"ch\xe2\x82ck"), source="x")
    assert cp.entries is not None and cp.entries[0].container_name == "ch\ufffd\ufffdck"
    path = tmp_path / "cp"
    path.write_bytes(GOOD.replace(b"check", b"ch\xe2\x82ck").replace(b"3660592824", b"0"))
    fixed = marshal(load(path).checkpoint)
    path.write_bytes(fixed)
    assert read_checkpoint(path)[0].entries == cp.entries


def test_too_big_is_refused_by_size_without_reading(tmp_path: Path) -> None:
    path = tmp_path / "big"
    with open(path, "wb") as f:
        f.truncate(100 * 1024 * 1024)  # sparse: 100 MB
    start = time.perf_counter()
    expect_bad(path, "limit")
    assert time.perf_counter() - start < 0.5


def test_limit_checked_on_bytes_read(tmp_path: Path) -> None:
    path = tmp_path / "cp"
    path.write_bytes(GOOD)
    with pytest.raises(BadInputError, match="limit"):
        read_checkpoint(path, max_bytes=len(GOOD) - 1)
    assert read_checkpoint(path, max_bytes=len(GOOD))[1] == GOOD


def test_symlink(tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(GOOD)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real")
    expect_bad(link, "symbolic link")


def test_directory(tmp_path: Path) -> None:
    expect_bad(tmp_path, "directory")


def test_fifo_does_not_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    expect_bad(fifo, "not a regular file")


def test_missing(tmp_path: Path) -> None:
    expect_bad(tmp_path / "nope", "does not exist")


_CHILD = """
import sys
from pathlib import Path
from gpuguard.checkpoint import read_checkpoint
from gpuguard.errors import BadInputError
try:
    read_checkpoint(Path(sys.argv[1]))
except BadInputError as e:
    print(e.message)
"""


def test_unreadable(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        path = tmp_path / "cp"
        path.write_bytes(GOOD)
        path.chmod(0)
        expect_bad(path, "permission denied")
        return
    # Root reads anything, so read as nobody in a child process. A private 0755
    # directory: pytest's tmp_path sits under a 0700 directory nobody cannot enter.
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)
        path = Path(d) / "cp"
        path.write_bytes(GOOD)
        path.chmod(0)
        # nobody may not enter the checkout (a clone under a 0700 directory): give it
        # a copy of the package and the interpreter the venv links to.
        shutil.copytree(REPO / "src" / "gpuguard", Path(d) / "src" / "gpuguard")
        env = {**os.environ, "PYTHONPATH": str(Path(d) / "src")}
        out = subprocess.run(
            [os.path.realpath(sys.executable), "-c", _CHILD, str(path)],
            user=65534,
            group=65534,
            extra_groups=[],
            env=env,
            cwd="/",
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.stdout.startswith(f"{path}: "), out.stderr
        assert "permission denied" in out.stdout
