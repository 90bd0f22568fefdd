"""The GPU identity history from gpuguard's first look: recorded in observe mode (its own
state, not the node's) and at the first check on a node without a history whatever the
checkpoint says, so a UUID change after installation is remapped, never dropped for
want of a history; `--dry-run` still writes nothing.

The fake node of test_checkpoint_remap_cli (numa-blog-04, 3 GPUs, 2 pods), checked by
`gpuguard check` as the daemon's step and kubelet's pre-start hook check it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuguard import exitcodes
from gpuguard.checkpoint import history
from unit.test_checkpoint_remap_cli import CHECKPOINT, HISTORY, NEW, OLD, check, kinds, set_gpus
from unit.test_checkpoint_remap_cli import root as root


def observe(root: Path, on: bool) -> None:
    conf = root / "etc/gpuguard/gpuguard.conf"
    conf.write_text("[Daemon]\nMode=observe\n" if on else "")


def newest(root: Path) -> list[str]:
    h, problem = history.read(root / HISTORY)
    assert h is not None, problem
    return [g.uuid for g in h.generations[-1].gpus]


def test_a_canary_period_keeps_the_remap(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Observe mode records the GPUs of a healthy node; a UUID change during the canary
    is planned as a remap (and the history keeps the generation it needs); the node
    moved to repair remaps."""
    observe(root, True)
    before = (root / CHECKPOINT).read_bytes()
    code, _doc, journal = check(root, capsys)
    assert code == exitcodes.OK and kinds(journal, "gpu-history-recorded")
    assert newest(root) == OLD
    set_gpus(root, NEW)
    code, doc, _journal = check(root, capsys)
    assert code == exitcodes.FINDINGS and (root / CHECKPOINT).read_bytes() == before
    assert len(doc["actions"][0]["remaps"]) == 2 and newest(root) == OLD
    observe(root, False)
    code, _doc, journal = check(root, capsys)
    assert code == exitcodes.OK
    assert len(kinds(journal, "checkpoint-entry-remapped")) == 2
    assert not kinds(journal, "checkpoint-entry-dropped") and newest(root) == NEW


@pytest.mark.parametrize("mode", ["observe", "repair-report", "hook-observe"])
def test_the_first_look_records_even_a_stale_nodes_gpus(
    root: Path, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    """No history yet (gpuguard just installed) and a checkpoint of other GPUs: nothing
    older to keep, so today's GPUs are recorded at once, and their next change is a
    remap."""
    set_gpus(root, NEW)
    observe(root, mode.endswith("observe"))
    extra = {"repair-report": ["--policy", "report"], "hook-observe": ["--kubelet-stopped"]}
    code, _doc, journal = check(root, capsys, *extra.get(mode, []))
    assert code == exitcodes.FINDINGS and kinds(journal, "gpu-history-recorded")
    assert newest(root) == NEW


def test_dry_run_writes_no_history(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    observe(root, True)  # --dry-run, even in observe mode: the plan only
    code, _doc, _journal = check(root, capsys, "--dry-run")
    assert code == exitcodes.OK and not (root / HISTORY).exists()
