"""kubelet's pre-start hook and its caller: the result record, and when a repair made
during a kubelet restart counts as verified (kubelet_hook.judge is a pure table)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pytest

from conftest import CHECKPOINTS, log_to_stderr
from gpuguard import cli, exitcodes
from gpuguard.host.paths import Root
from gpuguard.steps.checkpoint import kubelet_hook as kh

CHECKPOINT = "var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"
FIXTURE = CHECKPOINTS / "numa-blog-04.json"
KEPT = "GPU-77a702db-e37f-3a74-d46d-c5713f66058c"
INVENTORY = {
    "gpus": [
        {"uuid": u, "index": i, "minor": i, "pci_bus_id": f"00000000:{16 + i:02X}:00.0"}
        for i, u in enumerate(
            [
                KEPT,
                "GPU-9b341c59-f96b-ba85-c137-78c3652fea65",
                "GPU-5d3e2a10-7c4b-4f0e-9a61-2b8e4c1d7f93",
            ]
        )
    ]
}


def result(token: str = "t1", outcome: str = kh.REPAIRED, after: str = "bb") -> kh.HookResult:
    return kh.HookResult(token, outcome, "detail", "aa", after, 0.0, 0)


@pytest.mark.parametrize(
    ("rec", "stale", "error", "current", "verified", "says"),
    [
        (result(), 0, "", "bb", True, "the file is the one the hook wrote"),
        (result(), 0, "", "cc", True, "kubelet has rewritten it since"),
        (result(outcome=kh.HEALTHY), 0, "", "bb", True, "verified"),
        (None, 0, "", "bb", False, "left no result for this restart"),
        (result(token="old"), 0, "", "bb", False, "left no result for this restart"),
        (result(outcome=kh.SKIPPED), 0, "", "bb", False, "hook skipped (exit 0): detail"),
        (result(outcome=kh.FAILED), 0, "", "bb", False, "hook failed"),
        (result(outcome=kh.NOT_REPAIRED), 3, "", "aa", False, "hook not-repaired"),
        (result(), 2, "", "bb", False, "still names 2 stale"),
        (result(), None, "truncated", "", False, "cannot be re-read after the restart: trunc"),
    ],
)
def test_judge(
    rec: Optional[kh.HookResult],
    stale: Optional[int],
    error: str,
    current: str,
    verified: bool,
    says: str,
) -> None:
    v = kh.judge("t1", rec, stale_after=stale, reread_error=error, current_sha256=current)
    assert v.verified is verified
    assert says in v.detail and "\n" not in v.detail


def test_request_and_result_round_trip(tmp_path: Path) -> None:
    root = Root(tmp_path)
    assert kh.read_request_token(root) == ("", "") and kh.read_result(root) is None
    token = kh.new_token()
    kh.write_request(root, token)
    assert kh.read_request_token(root) == (token, "")
    assert (tmp_path / "run/gpuguard/kubelet-hook.request").stat().st_mode & 0o777 == 0o600
    kh.write_result(root, result(token))
    assert kh.read_result(root) == result(token)
    kh.clear_request(root)
    assert kh.read_request_token(root) == ("", "")
    (tmp_path / "run/gpuguard/kubelet-hook.request").write_text('{"version": 1, "token": 7}')
    token, why = kh.read_request_token(root)
    assert token == "" and "token: not a string" in why and len(why) <= 400
    (tmp_path / "run/gpuguard/kubelet-hook.result").write_text("{")
    assert kh.read_result(root) is None  # a torn or foreign record is no result


@pytest.fixture(autouse=True)
def log_to_current_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    log_to_stderr(monkeypatch)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "node"
    (r / CHECKPOINT).parent.mkdir(parents=True)
    (r / CHECKPOINT).write_bytes(FIXTURE.read_bytes())
    (r / "etc/gpuguard").mkdir(parents=True)
    (r / "proc/1").mkdir(parents=True)
    (r / "proc/1/comm").write_text("systemd\n")
    return r


def hook(root: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, list[dict]]:  # type: ignore[type-arg]
    code = cli.main(
        ["check", "--only", "checkpoint", "--kubelet-stopped", "--root", str(root), *extra]
    )
    err = capsys.readouterr().err
    return code, [json.loads(x) for x in err.splitlines() if x.startswith("{")]


def record(root: Path) -> dict:  # type: ignore[type-arg]
    return dict(json.loads((root / "run/gpuguard/kubelet-hook.result").read_text()))


def test_no_driver_exit_0_said_once_per_state(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kh.write_request(Root(root), "70c0")
    code, log = hook(root, capsys)
    assert code == exitcodes.OK
    assert [e["kind"] for e in log] == ["kubelet-hook-skipped"]
    assert "NVML" in log[0]["msg"] or "driver" in log[0]["msg"]
    rec = record(root)
    assert rec["outcome"] == "skipped" and rec["token"] == "70c0" and rec["exit_code"] == 0
    assert rec["before_sha256"] == rec["after_sha256"] != ""
    assert (root / CHECKPOINT).read_bytes() == FIXTURE.read_bytes()
    code, log = hook(root, capsys)  # kubelet's next start on the same node: quiet
    assert code == exitcodes.OK and log == []


def test_no_checkpoint_exit_0_skipped(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / CHECKPOINT).unlink()
    (root / "etc/gpuguard/inventory.json").write_text(json.dumps(INVENTORY))
    code, log = hook(root, capsys, "--inventory", str(root / "etc/gpuguard/inventory.json"))
    assert code == exitcodes.OK
    # nothing to reconcile: the GPUs are recorded for a later remap (once)
    assert [e["kind"] for e in log] == ["gpu-history-recorded", "kubelet-hook-skipped"]
    assert record(root)["outcome"] == "skipped"


def test_repair_records_digests_and_token(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / "etc/gpuguard/inventory.json").write_text(json.dumps(INVENTORY))
    kh.write_request(Root(root), "70c0")
    code, _ = hook(root, capsys, "--inventory", str(root / "etc/gpuguard/inventory.json"))
    assert code == exitcodes.OK
    rec = record(root)
    assert rec["outcome"] == "repaired" and rec["token"] == "70c0"
    assert rec["before_sha256"] == kh.file_sha256(FIXTURE)
    assert rec["after_sha256"] == kh.file_sha256(root / CHECKPOINT) != rec["before_sha256"]


def test_bad_config_records_failed_exit_2(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / "etc/gpuguard/gpuguard.conf").write_text("[Kubelet]\nPolicy=sometimes\n")
    code, _ = hook(root, capsys)
    assert code == exitcodes.USAGE
    rec = record(root)
    assert rec["outcome"] == "failed" and "gpuguard.conf:2" in rec["detail"]


def test_an_unusable_request_or_memo_is_said_once_and_the_full_check_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    log_to_stderr(monkeypatch)
    root = tmp_path
    (root / CHECKPOINT).parent.mkdir(parents=True)
    (root / CHECKPOINT).write_bytes(FIXTURE.read_bytes())
    inv = root / "inv.json"
    inv.write_text(json.dumps(INVENTORY))
    (root / "run/gpuguard").mkdir(parents=True)
    (root / "run/gpuguard/kubelet-hook.request").write_text("[" * 50_000)
    (root / "var/lib/gpuguard").mkdir(parents=True)
    (root / "var/lib/gpuguard/kubelet-hook.memo.json").write_text('{"format": 1e400}')
    argv = ["check", "--only", "checkpoint", "--kubelet-stopped", "--root", str(root)]
    assert cli.main([*argv, "--inventory", str(inv)]) == 0
    err = capsys.readouterr().err
    ignored = [line for line in err.splitlines() if "ignoring" in line]
    assert len(ignored) == 1 and "kubelet-hook.request" in ignored[0], err
    assert "nested too deep" in ignored[0]
    rec = kh.read_result(Root(root))
    assert rec is not None and rec.outcome == kh.REPAIRED and rec.token == ""


def test_an_unusable_memo_is_said_once_and_the_full_check_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    log_to_stderr(monkeypatch)
    (tmp_path / CHECKPOINT).parent.mkdir(parents=True)
    (tmp_path / CHECKPOINT).write_bytes(FIXTURE.read_bytes())
    inv = tmp_path / "inv.json"
    inv.write_text(json.dumps(INVENTORY))
    (tmp_path / "var/lib/gpuguard").mkdir(parents=True)
    (tmp_path / "var/lib/gpuguard/kubelet-hook.memo.json").write_text('{"format": 1e400}')
    argv = ["check", "--only", "checkpoint", "--kubelet-stopped", "--root", str(tmp_path)]
    assert cli.main([*argv, "--inventory", str(inv)]) == 0
    ignored = [line for line in capsys.readouterr().err.splitlines() if "ignoring" in line]
    assert len(ignored) == 1 and "kubelet-hook.memo.json" in ignored[0]
    assert "out of range" in ignored[0]
