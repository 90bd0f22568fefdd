"""The re-admission bridge's process never becomes the failure it exists to prevent
(readmit/__init__.py, contained.py, ended.py).

- A configuration that breaks after the start (re-read every REFRESH seconds and at
  each kubelet start) keeps the last good one, said once per distinct error and in the
  state file; any other error of the loop is contained. Before, run() raised: the
  process exited 2 (never restarted) and kubelet then dropped the real plugin.
- Registrations run in parallel, each with its own deadline, and the loop keeps
  watching kubelet.sock while one is slow: before, they ran one after the other inside
  the loop.
- Its end while kubelet runs (SIGTERM; or an earlier process gone, found at the start)
  is said and written for the daemon.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from gpuguard.checkpoint.codec import marshal
from gpuguard.checkpoint.model import Checkpoint
from gpuguard.config import load_config
from gpuguard.errors import ConfigError
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.readmit import Inputs, Readmit
from gpuguard.readmit.state import ReadmitState, Recorder
from unit.test_readmit import entry

MIG = "nvidia.com/mig-1g.10gb"
WAIT = 10.0  # what a fake waits for the event it expects at most (then it fails)


class Log(EventLog):
    def __init__(self) -> None:
        super().__init__(stream_format="none")
        self.said: list[tuple[str, str, dict[str, str]]] = []

    def event(self, kind: str, msg: str, **kw: Any) -> None:  # type: ignore[override]
        self.said.append((kind, msg, dict(kw.get("fields") or {})))

    def kinds(self) -> list[str]:
        return [k for k, _m, _f in self.said]


class Bridge:
    def __init__(self, register: Optional[Callable[[str, tuple[str, ...]], None]] = None) -> None:
        self.registered: list[str] = []
        self.calls: list[str] = []
        self.how = register
        self.lock = threading.Lock()

    def serve(self, resource: str) -> None:
        pass

    def register(self, resource: str, ids: tuple[str, ...], timeout: float = 5.0) -> None:
        with self.lock:
            self.calls.append(resource)
        if self.how is not None:
            self.how(resource, ids)
        with self.lock:
            self.registered.append(resource)


class Node:
    def __init__(self, tmp: Path, bridge: Bridge, resources: tuple[str, ...] = ("nvidia.com/gpu",)):
        self.root = Root(tmp)
        self.plugins = tmp / "var/lib/kubelet/device-plugins"
        self.plugins.mkdir(parents=True)
        entries = tuple(entry(f"pod-{i}", [f"GPU-{i}"], r) for i, r in enumerate(resources))
        cp = Checkpoint("v2", entries, {}, 0)
        (self.plugins / "kubelet_internal_checkpoint").write_bytes(marshal(cp))
        (tmp / "etc/gpuguard").mkdir(parents=True)
        self.conf = tmp / "etc/gpuguard/gpuguard.conf"
        self.conf.write_text("")
        self.present = frozenset(f"GPU-{i}" for i in range(len(resources)))
        self.bridge = bridge
        self.kubelet_up = True
        self.new_process()

    def new_process(self) -> None:
        """The bridge's process (again): its journal, state writes and loop."""
        self.states: list[ReadmitState] = []
        self.recorder = Recorder(self.states.append, me=(os.getpid(), 1.0))
        self.log = Log()
        self.readmit = Readmit(
            self.root,
            self.log,
            self.inputs,
            self.bridge,  # type: ignore[arg-type]
            None,
            self.recorder,
        )
        self.readmit.kubelet_listens = lambda: self.kubelet_up  # kubelet.sock: a plain file

    def inputs(self) -> Inputs:
        return Inputs(load_config(self.root), self.present, "")

    def kubelet_starts(self) -> None:
        """kubelet makes a new kubelet.sock (a new inode: the old one still exists)."""
        new = self.plugins / ".kubelet.sock.new"
        new.write_text("")
        os.replace(new, self.plugins / "kubelet.sock")

    def run(self, until: Callable[[], bool]) -> threading.Thread:
        """The loop in a thread, returned once it has looked at kubelet.sock (a socket
        made before is a kubelet already running)."""
        deadline = time.monotonic() + WAIT
        looping = threading.Event()

        def stop() -> bool:
            looping.set()
            return until() or time.monotonic() > deadline

        t = threading.Thread(target=self.readmit.run, args=(stop,), daemon=True)
        t.start()
        assert looping.wait(WAIT)
        return t


def wait(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


# -- the configuration breaks later -------------------------------------------------------


def test_a_configuration_broken_later_keeps_the_last_good_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpuguard.readmit as readmit

    monkeypatch.setattr(readmit, "REFRESH", 0.0)  # read again at every turn of the loop
    monkeypatch.setattr(readmit, "POLL", 0.01)
    node = Node(tmp_path, Bridge())
    node.recorder.kubelet_started("", 0.0, 0.0)  # a state to write the error into
    good = node.readmit.inputs
    node.conf.write_text("[Daemon]\nMode=sometimes\n")
    turns = [0]

    def until() -> bool:
        turns[0] += 1
        return turns[0] > 20

    node.run(until).join(WAIT + 1)
    assert turns[0] > 20, "the loop went on"
    assert node.readmit.inputs is good
    errors = [m for k, m, _f in node.log.said if k == "readmit-config-error"]
    assert len(errors) == 1, node.log.said  # once per distinct error, not once a turn
    assert "keeps the last good one" in errors[0] and "Mode" in errors[0]
    assert node.states[-1].config_error and "Mode" in node.states[-1].config_error
    # fixed: said, and out of the state file; a kubelet start then uses it
    node.conf.write_text("[Daemon]\nMode=observe\n")
    turns[0] = 0
    node.run(until).join(WAIT + 1)
    assert node.log.kinds().count("readmit-config-ok") == 1
    assert node.states[-1].config_error == "" and node.readmit.inputs.cfg.daemon.observe


def test_a_read_that_raises_anything_is_contained(tmp_path: Path) -> None:
    node = Node(tmp_path, Bridge())
    calls = [0]

    def broken() -> Inputs:
        calls[0] += 1
        raise (ConfigError("gpuguard.conf:3: bad") if calls[0] % 2 else OSError("EIO"))

    node.readmit.read_inputs = broken
    for _ in range(4):
        node.readmit.refresh()
    said = [m for k, m, _f in node.log.said if k == "readmit-config-error"]
    assert len(said) == 4 and "gpuguard.conf:3: bad" in said[0] and "OSError: EIO" in said[1]


def test_any_error_of_the_loop_is_contained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpuguard.readmit as readmit

    monkeypatch.setattr(readmit, "POLL", 0.01)
    node = Node(tmp_path, Bridge())
    calls = [0]
    real = node.readmit.kubelet_sock

    def flaky() -> Optional[tuple[int, int]]:
        calls[0] += 1
        if calls[0] in (3, 4, 5):
            raise RuntimeError("a bug")
        return real()

    node.readmit.kubelet_sock = flaky  # type: ignore[method-assign]
    node.run(lambda: calls[0] > 12).join(WAIT + 1)
    assert calls[0] > 12, "the loop went on after the error"
    errors = [m for k, m, _f in node.log.said if k == "error"]
    assert len(errors) == 1 and "RuntimeError: a bug" in errors[0], node.log.said


# -- registrations in parallel ------------------------------------------------------------


def test_registrations_run_in_parallel_each_with_its_own_deadline(tmp_path: Path) -> None:
    """Each resource's registration waits for the other's to have started: one after
    the other, the first would time out and the second then fail."""
    both = threading.Barrier(2, timeout=WAIT / 2)

    def meet(resource: str, ids: tuple[str, ...]) -> None:
        both.wait()

    node = Node(tmp_path, Bridge(meet), ("nvidia.com/gpu", MIG))
    node.kubelet_starts()
    node.readmit.on_kubelet_start()
    assert sorted(node.bridge.registered) == ["nvidia.com/gpu", MIG]
    assert "readmit-failed" not in node.log.kinds()
    assert sorted(r.resource for r in node.states[-1].registrations) == ["nvidia.com/gpu", MIG]


def test_a_failing_registration_never_stops_another(tmp_path: Path) -> None:
    def refuse(resource: str, ids: tuple[str, ...]) -> None:
        if resource == "nvidia.com/gpu":
            raise RuntimeError("kubelet refused\nsecond line")

    node = Node(tmp_path, Bridge(refuse), ("nvidia.com/gpu", MIG))
    node.kubelet_starts()
    node.readmit.on_kubelet_start()
    assert node.bridge.registered == [MIG]
    (failed,) = [m for k, m, _f in node.log.said if k == "readmit-failed"]
    assert failed == "registering nvidia.com/gpu failed: kubelet refused"
    assert [r.resource for r in node.states[-1].registrations] == [MIG]


def test_a_slow_registration_never_hides_kubelet_s_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpuguard.readmit as readmit

    monkeypatch.setattr(readmit, "POLL", 0.01)
    release = threading.Event()
    first = [True]

    def slow_first(resource: str, ids: tuple[str, ...]) -> None:
        if first[0]:  # kubelet's first run does not answer (until released)
            first[0] = False
            release.wait(WAIT)

    node = Node(tmp_path, Bridge(slow_first))
    done = threading.Event()
    t = node.run(done.is_set)
    try:
        node.kubelet_starts()
        wait(lambda: len(node.bridge.calls) == 1, "the first kubelet start handled")
        first_run = node.recorder.current()
        node.kubelet_starts()  # kubelet restarted while the first registration hangs
        wait(lambda: len(node.bridge.registered) == 1, "the second start registered")
        second = node.recorder.current()
        assert first_run is not None and second is not None
        assert second.kubelet_sock != first_run.kubelet_sock
        assert [r.resource for r in second.registrations] == ["nvidia.com/gpu"]
    finally:
        release.set()
        wait(lambda: len(node.bridge.registered) == 2, "the first returned")
        done.set()
        t.join(WAIT)
    # the first run's late answer is not recorded as the second run's
    last = node.recorder.current()
    assert last is not None and last.kubelet_sock == second.kubelet_sock
    assert len(last.registrations) == 1 and last.registrations[0].registered_at == (
        second.registrations[0].registered_at
    )


# -- its own end while kubelet runs -------------------------------------------------------


def test_its_stop_while_kubelet_runs_is_said_and_written_once(tmp_path: Path) -> None:
    node = Node(tmp_path, Bridge())
    node.kubelet_starts()
    node.readmit.on_kubelet_start()
    node.readmit.stopping()
    (said,) = [(m, f) for k, m, f in node.log.said if k == "readmit-streams-ended"]
    assert said[1] == {"RESOURCES": "nvidia.com/gpu", "HOW": "stop"}
    assert "kubelet drops the device plugin that replaced them" in said[0]
    last = node.states[-1]
    assert last.streams_ended is not None and last.pid == os.getpid()
    node.new_process()  # the next process, in the same kubelet run: already said
    node.readmit.resume(last)
    assert "readmit-streams-ended" not in node.log.kinds()


def test_a_new_process_finds_an_earlier_one_s_registration_gone(tmp_path: Path) -> None:
    node = Node(tmp_path, Bridge())
    node.readmit.stopping()  # kubelet never started: nothing to say
    assert "readmit-streams-ended" not in node.log.kinds()
    node.kubelet_starts()
    node.readmit.on_kubelet_start()
    prior = node.states[-1]  # then killed: it wrote nothing more
    node.new_process()
    node.readmit.resume(prior)
    (said,) = [f for k, _m, f in node.log.said if k == "readmit-streams-ended"]
    assert said["HOW"] == "gone" and node.states[-1].streams_ended is not None
    # kubelet stopped (its socket left): no stream of the bridge's is kept
    node.new_process()
    node.kubelet_up = False
    node.readmit.resume(prior)
    assert "readmit-streams-ended" not in node.log.kinds()
    node.kubelet_up = True
    # kubelet restarted meanwhile (a new kubelet.sock): nothing of this run ended
    node.kubelet_starts()
    node.new_process()
    node.readmit.resume(prior)
    assert "readmit-streams-ended" not in node.log.kinds() and node.states == []


def test_kubelet_listens_only_while_it_serves_its_socket() -> None:
    import socket
    import tempfile

    from gpuguard.readmit.ended import kubelet_listens

    d = Path(tempfile.mkdtemp(prefix="gg-", dir="/tmp"))
    deep = d / ("x" * 100)  # past AF_UNIX's 108 bytes
    deep.mkdir()
    try:
        assert not kubelet_listens(deep)  # no socket
        s = socket.socket(socket.AF_UNIX)
        fd = os.open(deep, os.O_PATH)
        s.bind(f"/proc/self/fd/{fd}/kubelet.sock")
        os.close(fd)
        assert not kubelet_listens(deep)  # there, nobody listening: a stopped kubelet's
        s.listen(1)
        assert kubelet_listens(deep)
        s.close()
        assert not kubelet_listens(deep)
    finally:
        for p in deep.iterdir():
            p.unlink()
        deep.rmdir()
        d.rmdir()


def test_a_run_first_told_by_its_inode_is_the_same_run_to_a_later_process() -> None:
    """The bridge's first look found kubelet.sock between kubelet's bind and listen and
    recorded the run by its inode; the process after a SIGKILL reads the listener. The
    same run when the listener started before the run was recorded; a later kubelet on
    a socket that got the same inode number is not."""
    from gpuguard.devices.kubeletstart import KubeletStart, Listener
    from gpuguard.readmit.ended import same_run

    def now(started_boot_s: float) -> KubeletStart:
        listener = Listener(4242, 0, int(started_boot_s * 100))
        return KubeletStart("pid:4242:x", 7, 99, listener, 0.0, 0.0, offset=1000.0)

    recorded_at = 1000.0 + 50.0  # the socket's ctime at the first look (Unix time)
    assert same_run("inode:7:99", recorded_at, now(45.0))  # kubelet started at +45 s
    assert not same_run("inode:7:99", recorded_at, now(80.0))  # a later kubelet
    assert not same_run("inode:7:98", recorded_at, now(45.0))  # another socket
    assert same_run("pid:4242:x", recorded_at, now(80.0))  # told by its listener
    assert not same_run("", recorded_at, now(45.0)) and not same_run("inode:7:99", 0.0, None)
