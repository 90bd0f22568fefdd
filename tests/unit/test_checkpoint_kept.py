"""Without a history, an entry naming one present and one changed GPU is left and
reported by `gpuguard check`, and the GPUs are recorded all the same: the next change
of UUIDs is then remapped, not dropped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import log_to_stderr
from gpuguard import exitcodes
from gpuguard.checkpoint import parse
from unit.test_check_flow import CHECKPOINT, FIXTURE, INVENTORY, MOVED, check

HISTORY = "var/lib/gpuguard/gpu-identity.json"
PRESENT = "GPU-9b341c59-f96b-ba85-c137-78c3652fea65"  # pod B's other GPU, still here


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log_to_stderr(monkeypatch)
    r = tmp_path / "node"
    (r / CHECKPOINT).parent.mkdir(parents=True)
    (r / CHECKPOINT).write_bytes(FIXTURE.read_bytes())
    (r / "etc/gpuguard").mkdir(parents=True)
    (r / "proc/1").mkdir(parents=True)
    (r / "proc/1/comm").write_text("systemd\n")
    return r


def test_an_entry_holding_a_present_gpu_is_left_reported_and_the_gpus_recorded(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gpus = [dict(g) for g in INVENTORY["gpus"]]
    gpus[1]["uuid"] = PRESENT
    (root / "etc/gpuguard/inventory.json").write_text(json.dumps({"gpus": gpus}))
    code, out, _err = check(root, capsys)
    assert code == exitcodes.OK and "result:     repaired" in out  # the registered IDs
    entries = parse((root / CHECKPOINT).read_bytes(), source="t").entries or ()
    assert len(entries) == 2 and MOVED in entries[1].all_device_ids()
    assert "left as it is, not dropped" in out
    (root / HISTORY).unlink()  # recorded after the repair; now by a pass with no repair
    code, out, _err = check(root, capsys)  # nothing to write: left, said, GPUs recorded
    assert code == exitcodes.FINDINGS and "left as they are" in out
    assert (root / CHECKPOINT).read_bytes() != FIXTURE.read_bytes()
    assert PRESENT in (root / HISTORY).read_text()
