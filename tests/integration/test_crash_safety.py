"""A repair killed at any point leaves the old file or the new one, never a mix.

The real CLI (`gpuguard check --root R --inventory I`) runs in a child process whose
os.open/write/fsync/rename/replace/unlink/fchmod/fchown are wrapped: the N-th such call
does os._exit(137) instead (no cleanup, no finally: like SIGKILL). N goes over every
such call a repair makes (counted first). After each kill the checkpoint must be
byte-identical to the old file or to the repaired one (both valid for kubelet), a
changed file must have a complete backup of the old one, and a plain re-run must
finish the repair. Then real SIGKILLs at random moments, for good measure.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from conftest import CHECKPOINTS, REPO, require_root
from gpuguard.checkpoint import marshal, parse, verify
from gpuguard.host.inventory import parse_inventory
from gpuguard.steps.checkpoint.reconcile import DEFAULT_RESOURCES, analyse

pytestmark = pytest.mark.root

CHECKPOINT = "var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"
BACKUPS = "var/lib/gpuguard/backups"
FIXTURE = CHECKPOINTS / "numa-blog-04.json"
INVENTORY = {
    "gpus": [
        {"uuid": u, "index": i, "minor": i, "pci_bus_id": f"00000000:{16 + i:02X}:00.0"}
        for i, u in enumerate(
            [
                "GPU-77a702db-e37f-3a74-d46d-c5713f66058c",
                "GPU-0b341c59-f96b-ba85-c137-78c3652fea65",  # replaced 9b341c59
                "GPU-5d3e2a10-7c4b-4f0e-9a61-2b8e4c1d7f93",  # replaced c1e9f249
            ]
        )
    ]
}
OWNER = (1234, 5678)

# Runs in the child: wrap the calls that change files, then run the CLI.
CHILD = r"""
import os, sys
kill_at = int(os.environ["KILL_AT"])
count_file = os.environ["COUNT_FILE"]
calls = 0
def wrap(name):
    real = getattr(os, name)
    def wrapper(*a, **kw):
        global calls
        calls += 1
        if calls == kill_at:
            os._exit(137)
        return real(*a, **kw)
    setattr(os, name, wrapper)
from gpuguard import cli
for name in ("write", "fsync", "rename", "replace", "unlink", "fchmod", "fchown", "open"):
    wrap(name)
code = cli.main(sys.argv[1:])
with open(count_file, "w") as f:
    f.write(str(calls))
sys.exit(code)
"""


def _setup(root: Path, policy: str) -> tuple[bytes, Optional[bytes]]:
    """(old bytes, new bytes or None for a deletion) of a node whose checkpoint is stale."""
    ckpt = root / CHECKPOINT
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    old = FIXTURE.read_bytes()
    ckpt.write_bytes(old)
    os.chmod(ckpt, 0o640)
    os.chown(ckpt, *OWNER)
    (root / "inventory.json").write_text(json.dumps(INVENTORY))
    conf = root / "etc/gpuguard/gpuguard.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(f"[Kubelet]\nPolicy={policy}\nBackupKeep=100\n")
    repaired = analyse(
        parse(old, source="fixture"),
        parse_inventory(INVENTORY, source="test"),
        DEFAULT_RESOURCES,
    ).repaired
    assert repaired is not None
    return old, (marshal(repaired) if policy == "rewrite" else None)


def _argv(root: Path) -> list[str]:
    # A bus that cannot exist: kubelet is not running, so the repair is direct.
    return [
        "check",
        "--only",
        "checkpoint",
        "--root",
        str(root),
        "--inventory",
        str(root / "inventory.json"),
        "--bus",
        f"unix:path={root}/no-bus",
        "--log-json",
    ]


def _run(root: Path, kill_at: int) -> tuple[int, int]:
    """(exit status, counted calls or -1) of one child run."""
    count = root / "calls"
    count.unlink(missing_ok=True)
    env = {**os.environ, "KILL_AT": str(kill_at), "COUNT_FILE": str(count)}
    env["PYTHONPATH"] = str(REPO / "src")
    p = subprocess.run(
        [sys.executable, "-c", CHILD, *_argv(root)],
        env=env,
        capture_output=True,
        timeout=60,
    )
    if kill_at == 0:
        assert p.returncode == 0, p.stderr.decode()
    return p.returncode, int(count.read_text()) if count.exists() else -1


def _check_invariants(root: Path, old: bytes, new: Optional[bytes], where: str) -> str:
    """Assert old-or-new and backup-when-changed; return "old", "new" or "deleted"."""
    ckpt = root / CHECKPOINT
    if ckpt.exists():
        now = ckpt.read_bytes()
        assert now in (old, new), f"{where}: checkpoint is neither the old nor the new file"
        assert verify(parse(now, source=where))
        st = ckpt.stat()
        assert (st.st_uid, st.st_gid) == OWNER and st.st_mode & 0o777 == 0o640, where
        state = "old" if now == old else "new"
    else:
        assert new is None, f"{where}: the checkpoint vanished during a rewrite"
        state = "deleted"
    if state != "old":
        backups = [p.read_bytes() for p in (root / BACKUPS).glob("*.bak")]
        assert old in backups, f"{where}: file changed without a complete backup of the old one"
    return state


def _recovers(root: Path, new: Optional[bytes], where: str) -> None:
    code, _ = _run(root, 0)
    assert code == 0, where
    ckpt = root / CHECKPOINT
    if new is None:
        assert not ckpt.exists(), where
    else:
        assert ckpt.read_bytes() == new, where
    assert not list(ckpt.parent.glob(".gpuguard-*")), f"{where}: a temp file was left"


@pytest.mark.parametrize("policy", ["rewrite", "delete"])
def test_killed_at_every_file_operation(tmp_path: Path, policy: str) -> None:
    require_root()
    base = tmp_path / "count"
    old, new = _setup(base, policy)
    _, total = _run(base, 0)
    assert total >= 8, f"only {total} file operations counted"
    assert _check_invariants(base, old, new, "count run") == ("new" if new else "deleted")
    states = []
    for n in range(1, total + 1):
        root = tmp_path / f"kill-{n}"
        old, new = _setup(root, policy)
        code, _ = _run(root, n)
        assert code == 137, f"call {n} of {total} did not kill the child (exit {code})"
        states.append(_check_invariants(root, old, new, f"killed at call {n}/{total}"))
        _recovers(root, new, f"re-run after a kill at call {n}/{total}")
    # The kills covered both sides of the switch.
    assert states[0] == "old" and states[-1] != "old", states


def test_real_sigkill_at_random_moments(tmp_path: Path) -> None:
    require_root()
    rng = random.Random(int(os.environ.get("GPUGUARD_TEST_SEED", "1234")))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    argv = [sys.executable, "-m", "gpuguard"]
    probe = tmp_path / "probe"
    _setup(probe, "rewrite")
    t0 = time.monotonic()
    subprocess.run([*argv, *_argv(probe)], env=env, check=True, capture_output=True)
    span = time.monotonic() - t0
    seen = set()
    for i in range(36):
        root = tmp_path / f"sigkill-{i}"
        old, new = _setup(root, "rewrite")
        p = subprocess.Popen(
            [*argv, *_argv(root)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        time.sleep(rng.uniform(0.3, 1.1) * span)
        p.kill()  # SIGKILL, this PID only
        p.wait(timeout=30)
        seen.add(_check_invariants(root, old, new, f"SIGKILL #{i}"))
        _recovers(root, new, f"re-run after SIGKILL #{i}")
    assert seen <= {"old", "new"}
