"""kubelet's start told by kubelet.sock's listener (devices/kubeletstart.py), never by
its ctime: a touch, chmod, chown or setxattr (configuration management, restorecon) is
no start; a socket made again by a new process is.

The listener is a real process (a child of the test) on a real unix socket, so its
SO_PEERCRED credentials and /proc/PID/stat are the kernel's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import require_root
from gpuguard.devices.kubeletstart import KubeletStartWatch
from gpuguard.devices.processes import start_ticks
from gpuguard.host.paths import Root

DP = "/var/lib/kubelet/device-plugins"

# A stand-in for kubelet's registration server: binds kubelet.sock in the directory it
# is given (relative: a tmp path is past AF_UNIX's 108 bytes), listens after a line on
# stdin when asked to, and keeps the socket until its stdin closes.
LISTENER = r"""
import os, socket, sys
os.chdir(sys.argv[1])
s = socket.socket(socket.AF_UNIX)
s.bind("kubelet.sock")
if sys.argv[2] == "later":
    print("bound", flush=True)
    sys.stdin.readline()
s.listen(4)
print("listening", flush=True)
sys.stdin.read()
"""


@contextmanager
def listener(d: Path, later: bool = False) -> Iterator[subprocess.Popen[str]]:
    if (d / "kubelet.sock").exists():
        os.unlink(d / "kubelet.sock")  # what kubelet's device manager does at its start
    p = subprocess.Popen(
        [sys.executable, "-c", LISTENER, str(d), "later" if later else "now"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() in ("bound", "listening")
    try:
        yield p
    finally:
        if p.stdin is not None:
            p.stdin.close()
        p.wait()


def changes_ctime(path: Path, change: object) -> None:
    """Apply ``change`` to the socket file; its ctime must move (else it proves nothing)."""
    before = os.stat(path).st_ctime_ns
    time.sleep(0.01)  # past the filesystem's timestamp granularity
    assert callable(change)
    change(path)
    assert os.stat(path).st_ctime_ns != before


def touch(p: Path) -> None:
    os.utime(p)


def chmod(p: Path) -> None:
    os.chmod(p, 0o660)


def chown(p: Path) -> None:  # a no-op chown: the same owner and group
    st = os.stat(p)
    os.chown(p, st.st_uid, st.st_gid)


def setxattr(p: Path) -> None:  # what restorecon or a security label update does
    os.setxattr(p, "trusted.gpuguard-test", b"1", follow_symlinks=False)


def sockdir(tmp_path: Path) -> Path:
    d = tmp_path / DP.lstrip("/")
    d.mkdir(parents=True)
    return d


@pytest.mark.parametrize("change", [touch, chmod])
def test_a_touch_or_chmod_is_no_start_and_a_new_listener_is(tmp_path: Path, change: object) -> None:
    d = sockdir(tmp_path)
    w = KubeletStartWatch(Root(), d / "kubelet.sock")
    with listener(d) as first:
        run = w.look()
        assert run is not None and run.listener is not None
        assert run.listener.pid == first.pid and run.key.startswith("pid:")
        assert run.listener.start_ticks == start_ticks(Root(), first.pid)
        connects = w.connects
        assert w.look() == run and w.connects == connects  # unchanged: a stat, no connect
        changes_ctime(d / "kubelet.sock", change)
        assert w.look() == run and w.connects == connects + 1  # looked again: same one
    with listener(d) as second:  # kubelet started again: a new socket, a new process
        again = w.look()
        assert again is not None and again != run
        assert again.listener is not None and again.listener.pid == second.pid


@pytest.mark.parametrize("change", [chown, setxattr])
def test_a_chown_or_an_xattr_change_is_no_start(tmp_path: Path, change: object) -> None:
    require_root()
    d = sockdir(tmp_path)
    w = KubeletStartWatch(Root(), d / "kubelet.sock")
    with listener(d):
        run = w.look()
        assert run is not None and run.listener is not None
        changes_ctime(d / "kubelet.sock", change)
        assert w.look() == run


def test_bind_then_listen_is_one_start_and_the_stale_socket_of_a_stopped_kubelet_too(
    tmp_path: Path,
) -> None:
    d = sockdir(tmp_path)
    w = KubeletStartWatch(Root(), d / "kubelet.sock")
    with listener(d, later=True) as p:
        run = w.look()  # bound, nobody listens yet: told by its inode, looked at again
        assert run is not None and run.listener is None and run.key.startswith("inode:")
        assert "Connection refused" in run.note
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "listening"
        told = w.look()  # the same stat; the listener that made it, the same start
        assert told == run and told is not None and told.listener is not None
        assert told.listener.pid == p.pid
    # the process ended, its socket file stays: nobody listens, the same inode
    os.utime(d / "kubelet.sock")
    assert w.look() == run


def test_without_a_listener_only_a_new_inode_is_a_start(tmp_path: Path) -> None:
    d = sockdir(tmp_path)
    sock = d / "kubelet.sock"
    sock.write_text("")  # not a socket: no peer to read
    w = KubeletStartWatch(Root(), sock)
    run = w.look()
    assert run is not None and run.listener is None and run.note == "not a socket"
    changes_ctime(sock, touch)
    assert w.look() == run and w.connects == 0
    made = run.ctime
    new = d / "new"
    new.write_text("")
    os.replace(new, sock)  # a new inode
    again = w.look()
    assert again is not None and again != run
    assert run.wall() == made  # inode only: the ctime of its first look


def test_the_bridge_sees_no_kubelet_start_in_a_touch(tmp_path: Path) -> None:
    """The bridge's loop takes a new kubelet_sock() as a kubelet start: it resets its
    state and may register with the running kubelet, replacing the real plugin."""
    from unit.test_readmit import _node

    _root, r, _bridge, _said = _node(tmp_path)
    d = tmp_path / DP.lstrip("/")
    with listener(d):
        seen = r.kubelet_sock()
        assert seen is not None
        changes_ctime(d / "kubelet.sock", touch)
        assert r.kubelet_sock() == seen
        changes_ctime(d / "kubelet.sock", chmod)
        assert r.kubelet_sock() == seen
    with listener(d):
        assert r.kubelet_sock() != seen


def fake_proc(root: Path, pid: int) -> None:
    """The root's /proc: the listener's stat and the boot time, the kernel's own."""
    (root / f"proc/{pid}").mkdir(parents=True)
    (root / f"proc/{pid}/stat").write_text(Path(f"/proc/{pid}/stat").read_text())
    btime = [x for x in Path("/proc/stat").read_text().splitlines() if x.startswith("btime ")]
    (root / "proc/stat").write_text(btime[0] + "\n")


def test_the_daemon_restarts_no_plugin_after_a_touch_of_kubelet_sock(tmp_path: Path) -> None:
    """F4: a plugin whose socket predates kubelet's latest start is restarted once the
    grace is over. A touch of kubelet.sock after the plugin registered is no start."""
    from gpuguard.steps.device_plugin.observe import PluginObservation, kubelet_started
    from gpuguard.steps.device_plugin.reconcile import assess
    from unit.test_plugins_allocatable import HOST, plugin

    d = sockdir(tmp_path)
    with listener(d) as k:
        fake_proc(tmp_path, k.pid)
        started = kubelet_started(Root(tmp_path), DP)
        assert started is not None
        registered = plugin(ctime=time.time())  # the plugin registered after kubelet
        time.sleep(0.02)
        changes_ctime(d / "kubelet.sock", touch)  # configuration management, later
        after = kubelet_started(Root(tmp_path), DP)
        assert after is not None
        o = PluginObservation(time.time() + 600, HOST, (registered,), after)
        r = assess(o, registration_grace=120)
        assert r.actions == () and r.findings == ()
        assert after == pytest.approx(started)


def test_a_clock_step_moves_no_kubelet_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listener's start is boot-relative, put on the wall clock once: a step of the
    wall clock later (NTP's first sync) does not make every plugin socket look older."""
    import gpuguard.devices.kubeletstart as ks

    d = sockdir(tmp_path)
    w = KubeletStartWatch(Root(), d / "kubelet.sock")
    with listener(d) as k:
        run = w.look()
        assert run is not None and run.boot_s is not None
        assert run.boot_s <= ks.boottime()  # the kernel's CLOCK_BOOTTIME base
        btime = next(x for x in Path("/proc/stat").read_text().splitlines() if "btime" in x)
        assert abs(run.wall() - (int(btime.split()[1]) + run.boot_s)) < 1.0
        real = time.time
        monkeypatch.setattr(ks.time, "time", lambda: real() + 3600.0)
        changes_ctime(d / "kubelet.sock", touch)
        again = w.look()
        assert again == run and again is not None and again.wall() == run.wall()
        assert again.listener is not None and again.listener.pid == k.pid


def test_the_daemon_keeps_the_first_ctime_of_an_inode_where_no_listener_is_read(
    tmp_path: Path,
) -> None:
    """No listener to read (not a socket here; permission, another pid namespace): the
    step's watch keeps kubelet.sock's ctime as first seen for its inode across passes,
    and the not-registered finding says what told kubelet's start."""
    from gpuguard.steps.device_plugin.observe import kubelet_started

    d = sockdir(tmp_path)
    (d / "kubelet.sock").write_text("")
    w = KubeletStartWatch(Root(tmp_path), d / "kubelet.sock")
    first = kubelet_started(Root(tmp_path), DP, watch=w)
    assert first == pytest.approx(os.stat(d / "kubelet.sock").st_ctime)
    changes_ctime(d / "kubelet.sock", touch)
    assert kubelet_started(Root(tmp_path), DP, watch=w) == first
    assert w.current is not None
    assert w.current.told_by() == "kubelet.sock's inode only (not a socket)"


def test_the_not_registered_finding_says_what_told_kubelets_start() -> None:
    from gpuguard.steps.device_plugin.observe import PluginObservation
    from gpuguard.steps.device_plugin.reconcile import K_NOT_REGISTERED, assess
    from unit.test_plugins_allocatable import HOST, KUBELET, plugin

    told = "kubelet.sock's inode only (connect: Permission denied)"
    o = PluginObservation(
        KUBELET + 600, HOST, (plugin(ctime=KUBELET - 5),), KUBELET, kubelet_told_by=told
    )
    (f,) = assess(o, registration_grace=120).findings
    assert f.kind == K_NOT_REGISTERED and f.fields["KUBELET_START_BY"] == told


def test_the_bridge_says_when_only_the_inode_tells_kubelets_start(tmp_path: Path) -> None:
    from unit.test_readmit import _node

    _root, r, _bridge, said = _node(tmp_path)
    sock = tmp_path / DP.lstrip("/") / "kubelet.sock"
    sock.write_text("")  # not a socket: no listener to read, for good
    r.on_kubelet_start()
    assert "warning: kubelet's start told by kubelet.sock's inode only (not a socket)" in said
    _root, r, _bridge, said = _node(tmp_path / "b")
    with listener(tmp_path / "b" / DP.lstrip("/"), later=True):  # bound, listening soon
        r.on_kubelet_start()
    assert not any(s.startswith("warning:") for s in said), said


def test_a_refusing_socket_just_changed_is_looked_at_again_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kubelet between its bind and listen refuses connections: the bridge looks again
    within milliseconds while that lasts (a new socket with the old inode number is a
    start only once its listener is read, and kubelet re-admits its pods 40-80 ms after
    its start), but not for a stopped kubelet's socket that refuses for good."""
    from gpuguard.devices import kubeletstart

    d = sockdir(tmp_path)
    w = KubeletStartWatch(Root(), d / "kubelet.sock")
    with listener(d, later=True) as p:
        assert w.look() is not None and w.unsettled  # bound, refused: look again soon
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "listening"
        told = w.look()
        assert told is not None and told.listener is not None and not w.unsettled
    # the process ended, its socket refuses: quick looks only for UNSETTLED seconds
    w2 = KubeletStartWatch(Root(), d / "kubelet.sock")
    assert w2.look() is not None and w2.unsettled
    now = time.monotonic()
    monkeypatch.setattr(kubeletstart.time, "monotonic", lambda: now + kubeletstart.UNSETTLED)
    assert not w2.unsettled
