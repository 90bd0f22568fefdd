"""Operating gpuguard on a fleet, on fake roots: the off switch (`gpuguard disable` /
`enable`, /etc/gpuguard/disabled), observe-only mode, a configured inventory file that
never restarts kubelet, `gpuguard config --check`, and what status and npd say.
Booted roots from the .deb prove the same in tests/integration/test_fleet_ops.py."""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path
from typing import Any, Optional

import pytest

from conftest import log_to_stderr
from gpuguard import cli, exitcodes
from gpuguard.config import load_config, parse_config
from gpuguard.engine.daemon import Daemon
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.engine.passes import PassContext, Work
from gpuguard.host.notify import Notifier
from gpuguard.host.offswitch import OFF_SWITCH, read_off_switch
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.reporting.status import read_status
from gpuguard.reporting.status_figures import FastPaths
from gpuguard.steps.checkpoint.report import simulation
from gpuguard.steps.events import Event, EventKind
from unit.test_check_flow import CHECKPOINT, FIXTURE, INVENTORY, tree


@pytest.fixture(autouse=True)
def log_to_current_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    log_to_stderr(monkeypatch)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "node"
    (r / CHECKPOINT).parent.mkdir(parents=True)
    (r / CHECKPOINT).write_bytes(FIXTURE.read_bytes())
    (r / "etc/gpuguard").mkdir(parents=True)
    (r / "etc/gpuguard/inventory.json").write_text(json.dumps(INVENTORY))
    return r


def run(root: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main([*argv[:1], "--root", str(root), "--log-json", *argv[1:]])
    out = capsys.readouterr()
    return code, out.out, out.err


def kinds(err: str) -> list[str]:
    return [json.loads(line)["kind"] for line in err.splitlines() if line.startswith("{")]


# ------------------------------------------------------------------- the off switch


def test_disable_then_enable(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(root, capsys, "disable", "--reason", "INC-42:  drained\tnodes")
    assert code == 0 and "gpuguard enable" in out
    off = read_off_switch(Root(root))
    assert off is not None and off.reason == "INC-42: drained nodes"
    assert (root / OFF_SWITCH.lstrip("/")).stat().st_mode & 0o777 == 0o644
    assert "gpuguard-disabled" in kinds(err)
    code, out, err = run(root, capsys, "enable")
    assert code == 0 and "enabled" in out and "gpuguard-enabled" in kinds(err)
    assert read_off_switch(Root(root)) is None
    code, out, _ = run(root, capsys, "enable")
    assert code == 0 and "was not disabled" in out


def test_anything_at_the_path_is_off(tmp_path: Path) -> None:
    p = tmp_path / OFF_SWITCH.lstrip("/")
    p.parent.mkdir(parents=True)
    p.write_text("")
    off = read_off_switch(Root(tmp_path))
    assert off is not None and off.reason == ""
    p.unlink()
    p.mkdir()  # a directory someone made
    assert read_off_switch(Root(tmp_path)) is not None
    p.rmdir()
    p.write_text("# only a comment\n\n  the reason  \nmore\n")
    off = read_off_switch(Root(tmp_path))
    assert off is not None and off.reason == "the reason"


def test_the_kubelet_hook_changes_nothing_while_disabled(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(root, capsys, "disable", "--reason", "incident")
    # a broken configuration does not matter: the switch is read first
    (root / "etc/gpuguard/gpuguard.conf").write_text("[Daemon]\nNoSuchKey=1\n")
    before = tree(root)
    code, out, err = run(
        root, capsys, "check", "--only", "checkpoint", "--kubelet-stopped", "--inventory",
        str(root / "etc/gpuguard/inventory.json"),
    )  # fmt: skip
    assert code == 0 and out == ""
    assert kinds(err) == ["disabled-skip"] and "incident" in err
    assert tree(root) == before  # no repair, no result file, no memo


def test_a_check_while_disabled_is_a_dry_run(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(root, capsys, "disable")
    before = tree(root)
    inv = str(root / "etc/gpuguard/inventory.json")
    code, out, err = run(root, capsys, "check", "--only", "checkpoint", "--inventory", inv)
    assert code == exitcodes.FINDINGS and "dry run: nothing modified" in out
    assert "disabled-skip" in kinds(err)
    assert tree(root) == before


class Recording:
    """A step with both fast paths, recording what ran."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    async def __call__(self, svc: Any, ctx: PassContext) -> None:
        self.ran.append("step")

    def on_reload(self, svc: Any, signal: float) -> Optional[float]:
        self.ran.append("reload fast path")
        return None

    def fast_status(self) -> FastPaths:
        return FastPaths()

    def on_new_scope(self, svc: Any, unit: str, gpus: Any, again: Any) -> None:
        self.ran.append("scope fast path")


def test_the_daemon_stops_when_it_sees_the_switch(root: Path) -> None:
    step = Recording()
    every = {kind: frozenset({"s"}) for kind in EventKind}
    out = io.StringIO()
    r = Root(root)
    d = Daemon(root=r, config=load_config(r), config_path=None, log=EventLog(stream=out),
               notifier=Notifier(""), inventory_path=None, bus_address="unix:path=/none",
               steps={"s": step}, step_order=("s",), wakes=every)  # fmt: skip
    now = time.monotonic()
    asyncio.run(d._run_pass(Work(frozenset({"s"}), ("test",), now, now)))
    d.on_event(Event(EventKind.SYSTEMD_RELOADED, "reload", urgent=True, at=now))
    assert step.ran == ["step", "reload fast path"] and not d.apply.dry_run
    (root / OFF_SWITCH.lstrip("/")).write_text("maintenance\n")
    asyncio.run(d._run_pass(Work(frozenset({"s"}), ("test",), now, now)))
    d.on_event(Event(EventKind.SYSTEMD_RELOADED, "reload", urgent=True, at=now))
    scope = "cri-containerd-" + "a" * 64 + ".scope"
    d.on_event(Event(EventKind.SCOPE_STARTED, "new scope", unit=scope))
    assert step.ran == ["step", "reload fast path"], "a step ran after the switch was set"
    assert d.apply.dry_run and d.coalescer._stopping
    entries = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["kind"] for e in entries].count("gpuguard-disabled") == 1
    status, why = read_status(r, alive=False)  # the fake root has no /proc
    assert status is not None, why
    assert status.off_switch is not None and status.off_switch.reason == "maintenance"
    assert status.mode == "observe"


def test_npd_and_status_never_say_ok_while_disabled(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(root, capsys, "disable", "--reason", "why not")
    code, out, _ = run(root, capsys, "npd", "checkpoint")
    assert code == 2 and "gpuguard is disabled" in out and "why not" in out
    code, out, _ = run(root, capsys, "status")
    assert out.startswith("gpuguard:   OFF: gpuguard is disabled")
    _, out, _ = run(root, capsys, "status", "--json")
    assert json.loads(out)["off_switch"]["reason"] == "why not"


# ------------------------------------------------------------------ observe-only mode


def test_observe_mode_is_a_dry_run_everywhere(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (root / "etc/gpuguard/gpuguard.conf").write_text("[Daemon]\nMode=observe\n")
    cfg = load_config(Root(root))
    assert cfg.daemon.observe and not parse_config("").daemon.observe
    assert parse_config("[Daemon]\nDryRun=yes\n").daemon.observe
    before = tree(root)
    inv = str(root / "etc/gpuguard/inventory.json")
    code, out, _ = run(
        root, capsys, "check", "--only", "checkpoint", "--kubelet-stopped", "--inventory", inv
    )
    assert code == exitcodes.FINDINGS and "dry run: nothing modified" in out
    # nothing on the node; gpuguard's own state only: /run/gpuguard (the hook's
    # result) and the GPU identity history, recorded at gpuguard's first look
    after = tree(root)
    assert after.pop("var/lib/gpuguard/gpu-identity.json", None)
    assert after.pop("run/gpuguard/kubelet-hook.result", None)  # what the hook found
    new_dirs = {"var/lib/gpuguard": "dir", "run": "dir", "run/gpuguard": "dir"}
    assert after == {**before, **new_dirs}
    r = Root(root)
    d = Daemon(root=r, config=cfg, config_path=None, log=EventLog(stream=io.StringIO()),
               notifier=Notifier(""), inventory_path=None, bus_address="unix:path=/none",
               steps={})  # fmt: skip
    assert d.apply.dry_run
    (root / "etc/gpuguard/gpuguard.conf").write_text("[Daemon]\nMode=repair\n")
    d.reload_config()
    assert not d.apply.dry_run
    d2 = Daemon(root=r, config=load_config(r), config_path=None, apply=ChangeExecutor(dry_run=True),
                log=EventLog(stream=io.StringIO()), notifier=Notifier(""),
                inventory_path=None, bus_address="unix:path=/none", steps={})  # fmt: skip
    d2.reload_config()
    assert d2.apply.dry_run, "a reload dropped the command line's --dry-run"


# ------------------------------------------------- a configured inventory file is a simulation


def test_a_configured_inventory_file_never_restarts_kubelet() -> None:
    cfg = parse_config("[Inventory]\nFile=/etc/gpuguard/inv.json\n").inventory
    assert "a simulation" in simulation("/etc/gpuguard/inv.json", False, cfg)
    assert simulation("nvml", False, cfg) == ""
    allowed = parse_config("[Inventory]\nFile=/i.json\nAllowKubeletRestart=yes\n").inventory
    assert simulation("/i.json", False, allowed) == ""
    # --inventory on the command line needs its own flag, whatever the file says
    assert "--allow-kubelet-restart" in simulation("/i.json", True, allowed)
    assert simulation("/i.json", True, cfg, allow=True) == ""


# ------------------------------------------------------------------- config --check


def test_config_check_is_silent_when_valid_and_names_the_line(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["config", "--check", "--root", str(root)]) == 0
    assert capsys.readouterr().out == ""
    d = root / "etc/gpuguard/gpuguard.conf.d"
    d.mkdir()
    (d / "50-bad.conf").write_text("[Daemon]\n\nMode=fix\n")
    assert cli.main(["config", "--check", "--root", str(root)]) == exitcodes.USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"gpuguard: {d}/50-bad.conf:3: ")
