"""Operator hooks: which files are admitted, and running real executables in tmp dirs.

These tests run real (tiny /bin/sh) hooks on purpose: what is under test is the
process handling (process groups, pipes, timeouts), which a fake would not exercise.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import List, Optional

import pytest

from conftest import require_root
from gpuguard.engine.hooks import OUTPUT_LIMIT, HookResult, plan_hooks, run_hooks
from gpuguard.host.paths import HOOKS_DIR, Root
from gpuguard.model import Action, Finding, Outcome

NOBODY = 65534


@dataclass(frozen=True)
class RestartUnit(Action):
    @property
    def kind(self) -> str:
        return "restart-unit"


FINDING = Finding("checkpoint-stale-entry", "checkpoint", "stale entry", {"GPU_UUID": "GPU-1"})
OUTCOME = Outcome(RestartUnit("checkpoint", "reload checkpoint", "kubelet.service"), "done")


def hooks_dir(tmp_path: Path, mode: int = 0o755) -> Path:
    d = Root(tmp_path).path(HOOKS_DIR)
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(mode)
    return d


def make_hook(
    directory: Path, name: str, body: str = "exit 0\n", *, mode: int = 0o755, uid: int = 0
) -> Path:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(mode)
    if uid != os.geteuid():
        os.chown(path, uid, -1)
    return path


def alive(pid: int) -> bool:
    """True while `pid` is a live process (a zombie waiting for its reaper is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def gone_within(pid: int, seconds: float = 3.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.02)
    return not alive(pid)


def run(
    hooks: List[Path],
    *,
    timeout: float = 10.0,
    env: Optional[dict[str, str]] = None,
    findings: tuple[Finding, ...] = (FINDING,),
    outcomes: tuple[Outcome, ...] = (OUTCOME,),
    dry_run: bool = False,
) -> List[HookResult]:
    return asyncio.run(
        run_hooks(
            hooks,
            event="pass",
            findings=findings,
            outcomes=outcomes,
            timeout=timeout,
            env_base=env if env is not None else {"PATH": os.environ["PATH"]},
            mode="observe" if dry_run else "repair",
            host="node-1",
        )
    )


# ----------------------------------------------------------------------------- planning

# (name, mode, owner uid, fragment of the refusal reason or None if runnable)
PLAN = [
    ("10-ok", 0o755, 0, None),
    ("11-owner-only", 0o700, 0, None),
    ("20-not-executable", 0o644, 0, "not executable; chmod +x"),
    ("30-not-root", 0o755, NOBODY, f"owned by uid {NOBODY}, not root"),
    ("40-group-writable", 0o775, 0, "writable by group or others (mode 0775)"),
    ("41-world-writable", 0o757, 0, "writable by group or others (mode 0757)"),
    ("50-backup~", 0o755, 0, "backup or package manager leftover"),
    ("50-x.dpkg-old", 0o755, 0, "backup or package manager leftover"),
    ("50-x.dpkg-dist", 0o755, 0, "backup or package manager leftover"),
    ("50-x.rpmnew", 0o755, 0, "backup or package manager leftover"),
    ("50-x.rpmsave", 0o755, 0, "backup or package manager leftover"),
    (".50-hidden", 0o755, 0, "hidden file"),
]


@pytest.mark.parametrize(("name", "mode", "uid", "reason"), PLAN)
def test_plan_admits_only_safe_executables(
    tmp_path: Path, name: str, mode: int, uid: int, reason: Optional[str]
) -> None:
    require_root()  # chown to nobody
    d = hooks_dir(tmp_path)
    path = make_hook(d, name, mode=mode, uid=uid)
    runnable, refused = plan_hooks(Root(tmp_path), HOOKS_DIR)
    if reason is None:
        assert (runnable, refused) == ([path], [])
    else:
        assert runnable == []
        assert len(refused) == 1 and refused[0][0] == path
        assert reason in refused[0][1], refused[0][1]


def test_plan_lexical_order_and_mixed_entries(tmp_path: Path) -> None:
    d = hooks_dir(tmp_path)
    for name in ("b", "a", "9-x", "10-x"):
        make_hook(d, name)
    make_hook(d, "05-off", mode=0o644)
    (d / "60-dir").mkdir()
    (d / "70-dangling").symlink_to(tmp_path / "nowhere")
    runnable, refused = plan_hooks(Root(tmp_path))
    assert [p.name for p in runnable] == ["10-x", "9-x", "a", "b"]
    reasons = {p.name: why for p, why in refused}
    assert set(reasons) == {"05-off", "60-dir", "70-dangling"}
    assert "not a regular file" in reasons["60-dir"]
    assert "cannot stat" in reasons["70-dangling"]


def test_plan_missing_directory_means_no_hooks(tmp_path: Path) -> None:
    assert plan_hooks(Root(tmp_path)) == ([], [])


@pytest.mark.parametrize(("mode", "uid"), [(0o757, 0), (0o775, 0), (0o755, NOBODY)])
def test_plan_refuses_everything_in_an_unsafe_directory(
    tmp_path: Path, mode: int, uid: int
) -> None:
    require_root()
    d = hooks_dir(tmp_path, mode)
    make_hook(d, "10-ok")
    os.chown(d, uid, -1)
    runnable, refused = plan_hooks(Root(tmp_path))
    assert runnable == []
    assert [(p.name, f"the hooks directory {d} is" in why) for p, why in refused] == [
        ("10-ok", True)
    ]


def test_plan_symlinks_judged_by_their_target(tmp_path: Path) -> None:
    d = hooks_dir(tmp_path)
    safe = tmp_path / "lib"
    safe.mkdir(mode=0o755)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (d / "10-safe-link").symlink_to(make_hook(safe, "real"))
    (d / "20-unsafe-link").symlink_to(make_hook(shared, "real"))
    runnable, refused = plan_hooks(Root(tmp_path))
    assert [p.name for p in runnable] == ["10-safe-link"]
    assert [p.name for p, _ in refused] == ["20-unsafe-link"]
    assert f"the link target's directory {shared} is writable by group or others" in refused[0][1]


# ------------------------------------------------------------------------------ running


def test_hook_receives_json_on_stdin_and_environment(tmp_path: Path) -> None:
    d = hooks_dir(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    hook = make_hook(
        d, "10-record", 'cat > "$OUT/stdin.json"\nenv > "$OUT/env"\npwd > "$OUT/pwd"\n'
    )
    env = {
        "PATH": os.environ["PATH"],
        "OUT": str(out),
        "NOTIFY_SOCKET": "/run/x",
        "WATCHDOG_USEC": "1",
    }
    [result] = run([hook], env=env, dry_run=True)
    assert result.ok, result
    assert result.returncode == 0 and not result.timed_out and result.error == ""

    doc = json.loads((out / "stdin.json").read_text())
    assert doc["event"] == "pass"
    assert doc["findings"] == [FINDING.to_json()]
    assert doc["actions"] == [OUTCOME.to_json()]
    assert doc["actions"][0]["status"] == "done"
    assert doc["host"] == "node-1"
    assert doc["dry_run"] is True
    assert datetime.fromisoformat(doc["time"]).utcoffset() is not None

    got = dict(line.split("=", 1) for line in (out / "env").read_text().splitlines() if "=" in line)
    assert got["GPUGUARD_EVENT"] == "pass"
    assert got["GPUGUARD_FINDINGS"] == "1"
    assert got["GPUGUARD_ACTIONS"] == "1"
    assert got["GPUGUARD_KINDS"] == "checkpoint-stale-entry restart-unit"
    assert got["GPUGUARD_DRY_RUN"] == "1"
    assert got["OUT"] == str(out)
    assert "NOTIFY_SOCKET" not in got and "WATCHDOG_USEC" not in got
    assert (out / "pwd").read_text().strip() == "/"


def test_failing_hook_is_reported_not_raised(tmp_path: Path) -> None:
    d = hooks_dir(tmp_path)
    hook = make_hook(d, "10-fail", "echo out\necho 'no pager configured' >&2\nexit 3\n")
    [result] = run([hook])
    assert (result.returncode, result.timed_out, result.ok) == (3, False, False)
    assert result.stdout_tail == "out\n"
    assert result.stderr_tail == "no pager configured\n"
    assert result.describe().endswith(
        "failed with exit status 3 after " + f"{result.duration:.2f}s: no pager configured"
    )


def test_timeout_kills_the_process_group_quickly(tmp_path: Path) -> None:
    d = hooks_dir(tmp_path)
    pids = tmp_path / "pids"
    hook = make_hook(
        d, "10-slow", f"echo $$ > {pids}\nsleep 60 &\necho $! >> {pids}\necho started\nwait\n"
    )
    start = time.monotonic()
    [result] = run([hook], timeout=0.2)
    elapsed = time.monotonic() - start
    assert elapsed < 3, elapsed
    assert result.timed_out and not result.ok
    assert result.returncode == -9
    assert result.stdout_tail == "started\n"  # what it wrote before the kill is kept
    assert "killed after" in result.describe()
    shell, sleeper = (int(p) for p in pids.read_text().split())
    assert gone_within(shell) and gone_within(sleeper)


def test_background_child_holding_output_is_killed_at_timeout(tmp_path: Path) -> None:
    d = hooks_dir(tmp_path)
    pids = tmp_path / "pids"
    hook = make_hook(d, "10-daemonizes", f"sleep 60 &\necho $! > {pids}\nexit 0\n")
    start = time.monotonic()
    [result] = run([hook], timeout=0.3)
    assert time.monotonic() - start < 3
    assert result.timed_out  # the leftover kept stdout open past the timeout
    assert result.returncode == 0  # the hook itself had exited
    assert gone_within(int(pids.read_text()))


def test_cancelling_the_run_kills_the_hook(tmp_path: Path) -> None:
    d = hooks_dir(tmp_path)
    pids = tmp_path / "pids"
    hook = make_hook(d, "10-slow", f"echo $$ > {pids}\nexec sleep 60\n")

    async def cancel_midway() -> None:
        task = asyncio.ensure_future(
            run_hooks([hook], event="pass", findings=[], outcomes=[], timeout=60, env_base={})
        )
        for _ in range(200):
            if pids.exists() and pids.read_text().strip():
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    assert gone_within(int(pids.read_text()))


def test_output_is_bounded_to_the_tail(tmp_path: Path) -> None:
    d = hooks_dir(tmp_path)
    hook = make_hook(d, "10-chatty", "head -c 200000 /dev/zero | tr '\\0' x\necho END\n")
    [result] = run([hook])
    assert result.ok
    dropped = 200000 + 4 - OUTPUT_LIMIT
    assert result.stdout_tail.startswith(f"[{dropped} bytes dropped]\n")
    assert result.stdout_tail.endswith("xxxEND\n")
    assert len(result.stdout_tail) < OUTPUT_LIMIT + 100


def test_hook_that_ignores_a_large_stdin(tmp_path: Path) -> None:
    d = hooks_dir(tmp_path)
    hook = make_hook(d, "10-ignores-stdin", "exit 0\n")
    many = tuple(Finding("k", "r", "x" * 100) for _ in range(3000))  # ~0.5 MB of JSON
    [result] = run([hook], findings=many, timeout=5)
    assert result.ok and not result.timed_out


def test_stuck_hook_that_never_reads_a_large_stdin_is_killed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = hooks_dir(tmp_path)
    pids = tmp_path / "pids"
    hook = make_hook(d, "10-stuck", f"echo $$ > {pids}\nexec sleep 60\n")
    many = tuple(Finding("k", "r", "x" * 100) for _ in range(3000))
    start = time.monotonic()
    [result] = run([hook], findings=many, timeout=0.3)
    assert time.monotonic() - start < 4
    assert result.timed_out and result.returncode == -9
    assert gone_within(int(pids.read_text()))
    gc.collect()  # asyncio reports unretrieved pipe errors when their futures are freed
    assert "never retrieved" not in caplog.text


def test_unstartable_hook_does_not_stop_the_others(tmp_path: Path) -> None:
    d = hooks_dir(tmp_path)
    bad = d / "10-no-shebang"
    bad.write_bytes(b"\x00\x01garbage")
    bad.chmod(0o755)
    good = make_hook(d, "20-good")
    first, second = run([bad, good, d / "30-vanished"])[:2]
    assert first.returncode is None and first.error and not first.ok
    assert "could not run" in first.describe()
    assert second.ok


def test_no_hooks_no_work() -> None:
    assert run([]) == []


def test_environment_defaults_path(tmp_path: Path) -> None:
    d = hooks_dir(tmp_path)
    out = tmp_path / "path"
    hook = make_hook(d, "10-path", f'echo "$PATH" > {out}\n')
    [result] = run([hook], env={}, findings=(), outcomes=())
    assert result.ok
    assert "/usr/bin" in out.read_text()
