"""Every input class the fuzz campaign of issue 10 crashed, hung or exhausted gpuguard
with, one regression each, through the real CLI entry (in-process, and a few as
subprocesses to prove there is no hang)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import CHECKPOINTS, REPO
from fakenode import (
    BACKUPS,
    CHECKPOINT,
    FakeContainer,
    assert_clean,
    build_node,
    checkpoint_for,
    run_cli,
    tree,
    write,
)
from gpuguard import cli, exitcodes
from gpuguard.host.numparse import parse_decimal
from gpuguard.steps.checkpoint.deviceids import classify

STALE = CHECKPOINTS / "numa-blog-04.json"  # names a GPU the inventory below lacks
INVENTORY = {
    "gpus": [
        {"uuid": u, "index": i, "minor": i, "pci_bus_id": f"00000000:{16 + i:02X}:00.0"}
        for i, u in enumerate(
            [
                "GPU-77a702db-e37f-3a74-d46d-c5713f66058c",
                "GPU-9b341c59-f96b-ba85-c137-78c3652fea65",
                "GPU-5d3e2a10-7c4b-4f0e-9a61-2b8e4c1d7f93",
            ]
        )
    ]
}


def _one_error(err: str, *needles: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("gpuguard: ")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _inv(tmp_path: Path, doc: object) -> Path:
    p = tmp_path / "inv.json"
    p.write_text(json.dumps(doc))
    return p


def _checkpoint_root(tmp_path: Path, data: bytes) -> Path:
    write(tmp_path / CHECKPOINT.lstrip("/"), data)
    return tmp_path


# ------------------------------------------------------------- hangs and memory


def test_config_linked_to_dev_zero_is_refused(tmp_path: Path) -> None:
    conf = tmp_path / "etc/gpuguard/gpuguard.conf"
    conf.parent.mkdir(parents=True)
    conf.symlink_to("/dev/zero")
    run = run_cli("config", "--root", str(tmp_path))
    assert run.code == exitcodes.USAGE
    _one_error(run.err, str(conf), "not a regular file")


@pytest.mark.parametrize("which", ["config", "dropin", "inventory"])
def test_fifo_is_refused_without_hanging(tmp_path: Path, which: str) -> None:
    # A subprocess with a timeout: a blocking open of a FIFO would hang forever.
    inv = _inv(tmp_path, INVENTORY)
    fifo = {
        "config": tmp_path / "etc/gpuguard/gpuguard.conf",
        "dropin": tmp_path / "etc/gpuguard/gpuguard.conf.d/50-x.conf",
        "inventory": tmp_path / "fifo.json",
    }[which]
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    args = [
        "check",
        "--root",
        str(tmp_path),
        "--inventory",
        str(fifo if which == "inventory" else inv),
    ]
    out = subprocess.run(
        [sys.executable, "-m", "gpuguard", *args],
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == (exitcodes.BAD_INPUT if which == "inventory" else exitcodes.USAGE)
    _one_error(out.stderr, str(fifo), "not a regular file")


def test_status_file_that_is_a_fifo_or_nonsense_is_no_daemon(tmp_path: Path) -> None:
    status = tmp_path / "run/gpuguard/status.json"
    status.parent.mkdir(parents=True)
    os.mkfifo(status)
    run = run_cli("status", "--root", str(tmp_path), "--json")
    assert run.code == exitcodes.OK and run.json()["daemon"] is None
    status.unlink()
    status.write_text('{"pid": "x", "last_pass": [1]}')
    run = run_cli("status", "--root", str(tmp_path))
    assert_clean(run)
    assert "not running" in run.out


# ------------------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    ("name", "old", "new"),
    [
        ("checksum_past_int_digit_limit", b'"Checksum":', b'"Checksum":' + b"9" * 5000 + b","),
        ("numa_key_past_int_digit_limit", b'"DeviceIDs":{"', b'"DeviceIDs":{"' + b"7" * 5000),
    ],
)
def test_numbers_past_the_int_conversion_limit(
    tmp_path: Path, name: str, old: bytes, new: bytes
) -> None:
    data = STALE.read_bytes()
    assert old in data, name
    if name.startswith("checksum"):
        data = data[: data.index(old)] + new[:-1] + b"}"
    else:
        data = data.replace(old, new, 1)
    path = tmp_path / "cp"
    path.write_bytes(data)
    run = run_cli("checkpoint", "inspect", str(path))
    assert run.code == exitcodes.BAD_INPUT
    line = _one_error(run.err, str(path))
    assert len(line) < 600 and "int_max_str_digits" not in line


@pytest.mark.parametrize(
    "raw",
    [
        "GPU-77a702db-e37f-3a74-d46d-c5713f66058c::" + "9" * 5000,  # replica suffix
        "MIG-GPU-77a702db-e37f-3a74-d46d-c5713f66058c/" + "1" * 5000 + "/0",  # MIG suffix
        "GPU-77a702db-e37f-3a74-d46d-c5713f66058c::\u0663",  # Arabic-Indic 3
        "\u0661:\u0662",  # index form in non-ASCII digits
    ],
)
def test_device_id_suffixes_are_bounded_ascii(raw: str) -> None:
    assert classify(raw).form == "unknown"


def test_replica_past_the_limit_through_check(tmp_path: Path) -> None:
    text = STALE.read_text().replace(
        'GPU-77a702db-e37f-3a74-d46d-c5713f66058c"]',
        "GPU-77a702db-e37f-3a74-d46d-c5713f66058c::" + "9" * 5000 + '"]',
        1,
    )
    root = _checkpoint_root(tmp_path, text.encode())
    run = run_cli("check", "--root", str(root), "--inventory", str(_inv(tmp_path, INVENTORY)))
    assert_clean(run)


def test_non_ascii_digits_are_not_numbers() -> None:
    for text in ("\u0663", "\u00b2", "1\u0663", "+\u0663", " 1", "1_000", ""):
        assert parse_decimal(text, signed=True) is None, text
    assert parse_decimal("0" * 10000 + "7") == 7  # leading zeros cost nothing
    assert parse_decimal("9" * 5000) is None


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("QuietPeriod=" + "9" * 5000 + "s", "5001 characters long (at most 4096)"),
        ("QuietPeriod=" + "9" * 4000 + "s", "too long"),
        ("MaxDelay=" + "9" * 25 + "w", "longer than a year"),
        ("AuditInterval=1e999s", "unknown time unit"),
        ("QuietPeriod=\u0661s", "not a time span"),
    ],
)
def test_time_spans_that_overflowed(tmp_path: Path, line: str, needle: str) -> None:
    write(tmp_path / "etc/gpuguard/gpuguard.conf", f"[Daemon]\n{line}\n")
    run = run_cli("config", "--root", str(tmp_path))
    assert run.code == exitcodes.USAGE
    msg = _one_error(run.err, "gpuguard.conf:2", needle)
    assert len(msg) < 600


def test_config_integer_in_non_ascii_digits(tmp_path: Path) -> None:
    write(tmp_path / "etc/gpuguard/gpuguard.conf", "[Kubelet]\nBackupKeep=\u0663\n")
    run = run_cli("config", "--root", str(tmp_path))
    assert run.code == exitcodes.USAGE
    _one_error(run.err, "gpuguard.conf:2", "not an integer")


# ------------------------------------------------------------------- bad documents


def test_allocresp_base64_of_non_ascii_text(tmp_path: Path) -> None:
    data = STALE.read_bytes()
    start = data.index(b'"AllocResp":"') + len(b'"AllocResp":"')
    end = data.index(b'"', start)
    path = tmp_path / "cp"
    path.write_bytes(data[:start] + "CkIKFk5W\u00e9\u00e9==".encode() + data[end:])
    run = run_cli("checkpoint", "inspect", str(path))
    assert run.code == exitcodes.BAD_INPUT
    _one_error(run.err, str(path), "base64")


def test_deeply_nested_inventory(tmp_path: Path) -> None:
    inv = tmp_path / "inv.json"
    inv.write_text('{"gpus": ' + "[" * 100_000 + "]" * 100_000 + "}")
    run = run_cli("check", "--root", str(tmp_path), "--inventory", str(inv))
    assert run.code == exitcodes.BAD_INPUT
    _one_error(run.err, str(inv), "nested too deeply")


@pytest.mark.parametrize(
    ("field", "values", "needle"),
    [
        ("minor", (0, 0), "minor 0 listed twice"),
        ("index", (1, 1), "index 1 listed twice"),
        ("minor", (0, -1), "'minor' must be 0.."),
        ("index", (-5, 0), "'index' must be 0.."),
        ("minor", (0, 1 << 40), "'minor' must be 0.."),
    ],
)
def test_inventory_duplicate_or_negative_numbers(
    tmp_path: Path, field: str, values: tuple[int, int], needle: str
) -> None:
    doc = json.loads(json.dumps(INVENTORY))
    doc["gpus"] = doc["gpus"][:2]
    for g, v in zip(doc["gpus"], values):
        g[field] = v
    inv = _inv(tmp_path, doc)
    run = run_cli("check", "--root", str(tmp_path), "--inventory", str(inv))
    assert run.code == exitcodes.BAD_INPUT
    _one_error(run.err, str(inv), needle)


def test_inventory_number_past_the_int_conversion_limit(tmp_path: Path) -> None:
    inv = tmp_path / "inv.json"
    inv.write_text('{"gpus": [{"uuid": "GPU-a", "index": ' + "1" * 5000 + "}]}")
    run = run_cli("check", "--root", str(tmp_path), "--inventory", str(inv))
    assert run.code == exitcodes.BAD_INPUT
    line = _one_error(run.err, str(inv))
    assert len(line) < 600


# ------------------------------------------------------------------------ messages


@pytest.mark.parametrize("sep", ["\f", "\u2028", "\u2029", "\x1c", "\x85"])
def test_line_numbers_survive_form_feeds_and_unicode_separators(tmp_path: Path, sep: str) -> None:
    write(tmp_path / "etc/gpuguard/gpuguard.conf", f"# a{sep}b{sep}c\n[Daemon]\nNope=1\n")
    run = run_cli("config", "--check", "--strict", "--root", str(tmp_path))
    assert run.code == exitcodes.USAGE
    _one_error(run.err, "gpuguard.conf:3:", "unknown key 'Nope'")


def test_echoed_values_are_bounded(tmp_path: Path) -> None:
    write(tmp_path / "etc/gpuguard/gpuguard.conf", "[Daemon]\nDryRun=" + "x" * 100_000 + "\n")
    run = run_cli("config", "--root", str(tmp_path))
    assert run.code == exitcodes.USAGE
    line = _one_error(run.err, "gpuguard.conf:2", "…")
    assert len(line) < 600
    write(tmp_path / "etc/gpuguard/gpuguard.conf", "[" + "S" * 100_000 + "]\n")
    line = _one_error(run_cli("config", "--root", str(tmp_path)).err, "gpuguard.conf:1")
    assert len(line) < 600


# ------------------------------------------------------- one top-level handler (70)


def test_a_bug_is_exit_70_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(args: object) -> int:
        raise RuntimeError("x" * 10_000 + "\nsecond line")

    monkeypatch.setitem(cli.COMMANDS, "config", boom)
    run = run_cli("config", "--root", str(tmp_path))
    assert run.code == exitcodes.INTERNAL
    line = _one_error(run.err, "internal error: RuntimeError:", "a bug: please report it")
    assert len(line) < 600 and len(run.err.splitlines()) == 1
    debug = run_cli("config", "--root", str(tmp_path), "--log-level", "debug")
    assert debug.code == exitcodes.INTERNAL and "Traceback" in debug.err
    write(tmp_path / "etc/gpuguard/gpuguard.conf", "[Daemon]\nLogLevel=debug\n")
    assert "Traceback" in run_cli("config", "--root", str(tmp_path)).err


def test_a_bug_in_a_subprocess_is_exit_70_not_1(tmp_path: Path) -> None:
    # The installed entry point: python -m gpuguard, a bug planted by a sitecustomize.
    site = tmp_path / "site"
    write(
        site / "sitecustomize.py",
        "import gpuguard.cli as c\n"
        "def boom(args):\n    raise KeyError('planted')\n"
        "c.COMMANDS['catalog'] = boom\n",
    )
    out = subprocess.run(
        [sys.executable, "-m", "gpuguard", "catalog"],
        env={**os.environ, "PYTHONPATH": f"{site}:{REPO / 'src'}"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == exitcodes.INTERNAL, out.stderr
    _one_error(out.stderr, "internal error: KeyError: 'planted'")


# ------------------------------------------------------------ backups, state dirs


def _stale_root(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "root"
    _checkpoint_root(root, STALE.read_bytes())
    return root, _inv(tmp_path, INVENTORY)


@pytest.mark.parametrize("kind", ["regular-file", "symlink", "parent-symlink", "other-owner"])
def test_unsafe_backup_dir_is_refused_and_nothing_written(tmp_path: Path, kind: str) -> None:
    root, inv = _stale_root(tmp_path)
    backups = root / BACKUPS.lstrip("/")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if kind == "regular-file":
        write(backups, b"not a directory")
    elif kind == "symlink":
        backups.parent.mkdir(parents=True)
        backups.symlink_to(elsewhere)
    elif kind == "parent-symlink":
        backups.parent.parent.mkdir(parents=True, exist_ok=True)
        backups.parent.symlink_to(elsewhere)
    else:
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        backups.mkdir(parents=True)
        os.chown(backups, 65534, 65534)
    before = tree(root)
    run = run_cli("check", "--root", str(root), "--inventory", str(inv))
    assert run.code == exitcodes.BAD_INPUT, run.err
    assert_clean(run)
    assert tree(root) == before  # the checkpoint untouched, no backup anywhere
    assert list(elsewhere.iterdir()) == []
    assert "not modified" in run.out + run.err


def test_state_dir_symlink_is_refused_for_the_status_file(tmp_path: Path) -> None:
    from gpuguard.actuate.files import UnsafeDirError, write_new

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run/gpuguard").symlink_to(elsewhere)
    with pytest.raises(UnsafeDirError, match="symbolic link"):
        write_new(tmp_path / "run/gpuguard/status.json", b"{}")
    assert list(elsewhere.iterdir()) == []


# ------------------------------------------- one bad container costs that one only


GOOD = FakeContainer(1, 1, (0,))


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        (FakeContainer(2, 2, (1,), devices_list="c 195:0 rwm\nbogus line\n"), "devices.list"),
        (FakeContainer(2, 2, (1,), devices_list="c 195:" + "9" * 5000 + " rw\n"), "devices.list"),
        (FakeContainer(2, 2, (1,), cgroup_procs="1002\nnot-a-pid\n"), "cgroup.procs:2"),
        (FakeContainer(2, 2, (1,), cgroup_procs="\u00b2\n"), "cgroup.procs:1"),
        (FakeContainer(2, 2, (1,), cgroup_procs="9" * 5000 + "\n"), "cgroup.procs:1"),
    ],
    ids=[
        "devices-list-line",
        "devices-list-number",
        "procs-word",
        "procs-superscript",
        "procs-huge",
    ],
)
def test_one_bad_container_costs_that_container_only(
    tmp_path: Path, bad: FakeContainer, needle: str
) -> None:
    inv = build_node(tmp_path, [GOOD, bad], checkpoint=checkpoint_for([GOOD, bad]))
    allow_good = tmp_path / GOOD.cgroup.lstrip("/") / "devices.allow"
    allow_bad = tmp_path / bad.cgroup.lstrip("/") / "devices.allow"
    run = run_cli("check", "--root", str(tmp_path), "--inventory", str(inv), "--json")
    assert_clean(run)
    assert run.code == exitcodes.FINDINGS  # the bad container is a problem left
    findings = run.json()["devices"]["findings"]
    unread = [f for f in findings if f["kind"] == "container-unreadable"]
    assert [f["fields"]["CONTAINER_ID"] for f in unread] == [bad.container_id]
    assert needle in unread[0]["summary"] and len(unread[0]["summary"]) < 1000
    # the good one is still repaired, the bad one granted nothing
    assert "c 195:0 rw" in allow_good.read_text()
    assert allow_bad.read_text() == ""
    status = run_cli("status", "--root", str(tmp_path), "--inventory", str(inv), "--json")
    assert_clean(status)
    rows = {r["container_id"]: r for r in status.json()["containers"]}
    assert rows[bad.container_id]["access"] == "unreadable"
    assert rows[GOOD.container_id]["access"] == "denied"  # fake devices.list stays as it was


@pytest.mark.parametrize("which", ["devices.list", "cgroup.procs", "environ"])
def test_a_fifo_in_one_container_costs_that_container_only(tmp_path: Path, which: str) -> None:
    bad = FakeContainer(2, 2, (1,))
    inv = build_node(tmp_path, [GOOD, bad])
    path = (
        tmp_path / f"proc/{bad.pid}/environ"
        if which == "environ"
        else tmp_path / bad.cgroup.lstrip("/") / which
    )
    path.unlink()
    os.mkfifo(path)
    run = run_cli("check", "--root", str(tmp_path), "--inventory", str(inv), "--json")
    assert_clean(run)
    unread = [f for f in run.json()["devices"]["findings"] if f["kind"] == "container-unreadable"]
    assert [f["fields"]["CONTAINER_ID"] for f in unread] == [bad.container_id]
    assert "not a regular file" in unread[0]["summary"]
    assert "c 195:0 rw" in (tmp_path / GOOD.cgroup.lstrip("/") / "devices.allow").read_text()


def test_cgroup_procs_zero_is_a_process_outside_our_namespace(tmp_path: Path) -> None:
    from gpuguard.devices.containers import read_pids

    (tmp_path / "cgroup.procs").write_text("0\n1002\n0\n")
    assert read_pids(tmp_path) == (1002,)


def test_proc_devices_majors_are_bounded_ascii() -> None:
    from gpuguard.devices.nodes import nvidia_majors, parse_proc_devices

    for major in ("\u0661\u0669\u0665", "9" * 5000, "4096"):
        text = f"Character devices:\n{major} nvidia\n511 nvidia-uvm\n"
        assert nvidia_majors(parse_proc_devices(text)).nvidia is None, major
    ok = parse_proc_devices("Character devices:\n195 nvidia\n511 nvidia-uvm\n")
    assert nvidia_majors(ok).nvidia == 195


@given(st.integers(-(2**70), 2**70), st.text(max_size=30))
def test_parse_decimal_is_int_on_ascii_and_never_raises(n: int, junk: str) -> None:
    lo, hi = -(2**63), 2**63 - 1
    assert parse_decimal(str(n), lo=lo, hi=hi, signed=True) == (n if lo <= n <= hi else None)
    got = parse_decimal(junk, lo=lo, hi=hi, signed=True)
    ascii_int = re.fullmatch(r"[+-]?[0-9]+", junk)
    assert got == (int(junk) if ascii_int and lo <= int(junk) <= hi else None)


def test_oversized_configuration_is_refused_unread(tmp_path: Path) -> None:
    conf = tmp_path / "etc/gpuguard/gpuguard.conf"
    conf.parent.mkdir(parents=True)
    with open(conf, "wb") as f:
        f.truncate(64 * 1024 * 1024)  # sparse
    run = run_cli("config", "--root", str(tmp_path))
    assert run.code == exitcodes.USAGE
    _one_error(run.err, str(conf), "limit")
