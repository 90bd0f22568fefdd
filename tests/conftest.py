"""Shared test guards.

Tests that need root or a real component call require_root()/require_tool(). On a
developer machine without them they skip; under CI=true they FAIL, so CI can never
pass by skipping the integration tests.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
CHECKPOINTS = FIXTURES / "kubelet-checkpoint"
sys.path.insert(0, str(REPO / "tests"))


def log_to_stderr(monkeypatch: pytest.MonkeyPatch, level: str = "") -> None:
    """Commands run in this test log to the current sys.stderr (pytest's capture), at
    `level` or the one the command asks for, never to the host's journal. EventLog's
    `stream=sys.stderr` default is bound at import time: under pytest it would keep
    writing to the first test's (closed) capture."""
    from gpuguard.journal.log import EventLog

    def auto(cls: type[EventLog], **kw: Any) -> EventLog:
        return cls(level=level or kw.get("level", "info"), stream=sys.stderr)

    monkeypatch.setattr(EventLog, "auto", classmethod(auto))


def _missing(reason: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true but {reason}: this test must run in CI", pytrace=False)
    pytest.skip(reason)


def require_root() -> None:
    if os.geteuid() != 0:
        _missing("needs root")


def require_tool(*names: str) -> None:
    for name in names:
        if shutil.which(name) is None and not Path(name).exists():
            _missing(f"needs {name}")


@pytest.fixture(autouse=True)
def _catalog_fields_carried(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every journal entry a test makes carries the fields its catalog text shows."""
    from catalog_fields import lacking
    from gpuguard.journal.log import EventLog

    original = EventLog.event
    wrong: list[str] = []

    def event(self: EventLog, kind: str, msg: str, **kw: Any) -> None:
        gap = lacking(kind, kw.get("fields"), kw.get("exc"), self.static)
        if gap:
            wrong.append(f"{kind} entry {msg!r} lacks {sorted(gap)} (its catalog shows them)")
        original(self, kind, msg, **kw)

    monkeypatch.setattr(EventLog, "event", event)
    yield
    assert not wrong, "\n".join(wrong)


@pytest.fixture(autouse=True)
def _module_loggers_reset() -> Iterator[None]:
    """A command run in a test routes the gpuguard.* loggers to its EventLog
    (EventLog.route_modules); the next test starts from Python's defaults."""
    yield
    import logging

    logger = logging.getLogger("gpuguard")
    logger.handlers.clear()
    logger.propagate = True
    logger.setLevel(logging.NOTSET)


@pytest.fixture
def v1_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake root's v1 devices cgroup kept as the kernel keeps it: a write to its
    devices.allow also updates its devices.list, through gpuguard's model of the kernel
    (devices/rules.apply_write, held to the real kernel by test_devices_cgroup_v1.py),
    so that a grant read back after its write (actuate.confirm_v1) is found."""
    from gpuguard.devices.rules import apply_write, parse_devices_list
    from gpuguard.steps.container_access import actuate

    real = actuate.write_allow

    def write_allow(cgroup_dir: Path, rules: Iterable[str]) -> None:
        lines = list(rules)
        real(cgroup_dir, lines)
        listing = cgroup_dir / "devices.list"
        state = parse_devices_list(listing.read_text())
        for line in lines:
            state = apply_write(state, "devices.allow", line)
        listing.write_text(state.render_list())

    monkeypatch.setattr(actuate, "write_allow", write_allow)


@pytest.fixture(autouse=True)
def _hook_deadline_in_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """kubelet's pre-start hook run in-process (cli.main) must never end pytest's own
    process at its deadline: the expiry is recorded instead, and no SIGALRM is armed.
    The real end of the process is proven by a test that runs the hook as a process."""
    from gpuguard.steps.checkpoint import kubelet_hook

    expired: list[str] = []
    original = kubelet_hook.HookRun.arm

    def arm(self: Any, seconds: float, on_expiry: Any = None) -> None:
        original(self, seconds, on_expiry or (lambda message, code: expired.append(message)))

    monkeypatch.setattr(kubelet_hook.HookRun, "arm", arm)
    yield expired


# The re-admission bridge races kubelet 1.26+: kubelet re-admits its pods 40-80 ms after
# its registration server starts, and the bridge registers 15-35 ms after kubelet.sock
# appears, 50-80 ms when the node's 2 cores are busy with kubelet's own start
# (docs/checkpoint.md). A real-kubelet test that fails because kubelet rejected a pod
# at that moment ("no healthy devices present") is run once more and said so in the
# summary; a second such failure, or any other failure, stands.
RACE_LOST = "Allocate failed due to no healthy devices present"
_race_reruns: list[str] = []


def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Any:
    from _pytest.runner import runtestprotocol

    module = getattr(getattr(item, "module", None), "__name__", "")
    if not module.rsplit(".", 1)[-1].startswith("test_kubelet"):
        return None
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    reports = runtestprotocol(item, nextitem=nextitem, log=False)
    lost = [r for r in reports if r.failed and RACE_LOST in str(r.longrepr)]
    if lost and not hasattr(item, "_race_rerun"):
        item._race_rerun = True  # type: ignore[attr-defined]
        _race_reruns.append(item.nodeid)
        item._initrequest()  # type: ignore[attr-defined]  # fresh function-scoped fixtures
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
    for r in reports:
        item.ihook.pytest_runtest_logreport(report=r)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for nodeid in _race_reruns:
        terminalreporter.write_line(
            f"RERUN {nodeid}: kubelet rejected a pod before the bridge registered "
            "(the re-admission race lost once)"
        )
