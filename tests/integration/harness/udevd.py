"""A real systemd-udevd in a throw-away sandbox, and helpers to feed it uevents.

Safety (see docs/testing.md):

- everything runs under ``setpriv --pdeathsig KILL unshare --kill-child -m -p --fork
  --mount-proc --propagation private``: if pytest dies, the sandbox dies; udevd is
  PID 1 of its own PID namespace, so its workers die with it;
- before exec, fresh tmpfs over /run, /dev (a handful of basic nodes), every udev
  rules directory of the host, and /sys is remounted read-only, so udevd can neither
  apply the host's rules nor touch the host's /dev, /run or sysfs; only the rules
  under test are copied to /run/udev/rules.d;
- mounts live only in the private mount namespace: nothing to unmount afterwards;
- udevd is stopped by its PID (SIGTERM, then SIGKILL).

Without ``net=True`` udevd shares the host's network namespace: it receives the
kernel's real uevents and broadcasts what it processed on the "udev" netlink
group, where a host-side libudev monitor (gpuguard's UdevSource) receives it.
With ``net=True`` it gets a private network namespace: it still receives the
kernel's real uevents (the kernel broadcasts to every netns of the initial user
namespace), and uevents may be *injected* there (:class:`UeventInjector`) without
any other listener on the host seeing them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path
from typing import Iterator, Mapping, Sequence

UDEVD = "/usr/lib/systemd/systemd-udevd"
UDEVADM = "/usr/bin/udevadm"
NETLINK_KOBJECT_UEVENT = 15
CLONE_NEWNET = 0x40000000

# Rules directories udev reads (systemd 252: /etc, /run, /usr/local/lib, /usr/lib,
# and /lib on split-usr systems). All are hidden by a tmpfs in the sandbox.
_RULES_DIRS = (
    "/etc/udev/rules.d",
    "/usr/local/lib/udev/rules.d",
    "/usr/lib/udev/rules.d",
    "/lib/udev/rules.d",
)

# Runs inside the new namespaces as root, before exec'ing $@. Set -e: a failed
# mount must abort rather than start udevd against host paths.
_SETUP = r"""
set -eu
rules_src=$1; shift
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /run
mkdir -p /run/udev/rules.d
cp "$rules_src"/*.rules /run/udev/rules.d/
mount -t tmpfs -o mode=0755,nosuid tmpfs /dev
mknod -m 0666 /dev/null c 1 3
mknod -m 0666 /dev/zero c 1 5
mknod -m 0666 /dev/full c 1 7
mknod -m 0666 /dev/random c 1 8
mknod -m 0666 /dev/urandom c 1 9
mknod -m 0666 /dev/tty c 5 0
mkdir -p /dev/pts /dev/shm /dev/char /dev/block
for d in {rules_dirs}; do
    if [ -d "$d" ]; then mount -t tmpfs -o mode=0755,ro tmpfs "$d"; fi
done
mount -o remount,bind,ro /sys
exec "$@"
"""


def _rules_dirs() -> list[str]:
    # On merged-usr (Debian 12) /lib is a symlink to /usr/lib: mount once only.
    seen: dict[str, str] = {}
    for d in _RULES_DIRS:
        if os.path.isdir(d):
            seen.setdefault(os.path.realpath(d), d)
    return sorted(seen)


def sandbox_argv(rules_dir: Path, argv: Sequence[str], *, net: bool = False) -> list[str]:
    """Command line that runs ``argv`` in a fresh udev sandbox with only the
    ``*.rules`` files of ``rules_dir`` installed (in /run/udev/rules.d)."""
    script = _SETUP.replace("{rules_dirs}", " ".join(shlex.quote(d) for d in _rules_dirs()))
    unshare = ["unshare", "--kill-child", "-m", "-p", "--fork", "--mount-proc"]
    unshare += ["--propagation", "private"]
    if net:
        unshare.append("-n")
    return [
        "setpriv",
        "--pdeathsig",
        "KILL",
        *unshare,
        "sh",
        "-c",
        script,
        "udev-sandbox",
        str(rules_dir),
        *argv,
    ]


def write_rules(dest: Path, rules: Mapping[str, str]) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for name, text in rules.items():
        (dest / name).write_text(text)
    return dest


def udevadm_test(
    workdir: Path, rules: Mapping[str, str], syspath: str, action: str = "add"
) -> subprocess.CompletedProcess[str]:
    """``udevadm test`` in a sandbox (it writes /run/udev and /dev/char wherever
    it runs). It exits 0 even when a rule does not parse: callers grep."""
    rules_dir = write_rules(workdir / "rules", rules)
    argv = sandbox_argv(rules_dir, [UDEVADM, "test", f"--action={action}", syspath])
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


class Udevd:
    """A running sandboxed systemd-udevd. Use as a context manager."""

    def __init__(
        self, workdir: Path, rules: Mapping[str, str], *, net: bool = False, debug: bool = False
    ) -> None:
        self.workdir = workdir
        self.rules_dir = write_rules(workdir / "rules", rules)
        self.net = net
        self.debug = debug
        self.log_path = workdir / "udevd.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self.pid = 0  # systemd-udevd's PID in the host PID namespace
        self.ready_s = 0.0

    def start(self, timeout: float = 10.0) -> Udevd:
        argv = [UDEVD] + (["--debug"] if self.debug else [])
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                sandbox_argv(self.rules_dir, argv, net=self.net),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            self.pid = self._wait_for_udevd(t0 + timeout)
            self._wait_ready(t0 + timeout)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - t0
        return self

    def _wait_for_udevd(self, deadline: float) -> int:
        # setpriv exec()s unshare (same PID); unshare forks one child (PID 1 of the
        # new PID namespace) which is sh and then exec()s udevd.
        assert self._proc is not None
        children = Path(f"/proc/{self._proc.pid}/task/{self._proc.pid}/children")
        while time.monotonic() < deadline:
            self._check_alive()
            with contextlib.suppress(OSError):
                pids = children.read_text().split()
                if pids:
                    pid = int(pids[0])
                    with contextlib.suppress(OSError):
                        if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd-udevd":
                            return pid
            time.sleep(0.002)
        raise TimeoutError(f"systemd-udevd did not start; log:\n{self.log()}")

    def _wait_ready(self, deadline: float) -> None:
        # Cheap check first: the control socket appears in *its* /run.
        control = Path(f"/proc/{self.pid}/root/run/udev/control")
        while time.monotonic() < deadline:
            self._check_alive()
            if (
                control.exists()
                and self.udevadm("control", "--ping", "--timeout=2").returncode == 0
            ):
                return
            time.sleep(0.005)
        raise TimeoutError(f"systemd-udevd never answered a ping; log:\n{self.log()}")

    def ping(self, attempts: int = 5) -> bool:
        """``udevadm control --ping``; True once udevd answered."""
        for _ in range(attempts):
            if self.udevadm("control", "--ping", "--timeout=2").returncode == 0:
                return True
            time.sleep(0.01)
        return False

    def _check_alive(self) -> None:
        assert self._proc is not None
        if self._proc.poll() is not None:
            raise RuntimeError(
                f"udev sandbox exited with {self._proc.returncode}; log:\n{self.log()}"
            )

    def udevadm(self, *args: str) -> subprocess.CompletedProcess[str]:
        """udevadm inside udevd's mount namespace (so it finds its /run/udev) and
        PID namespace: udevd drops control messages whose sender it cannot see
        ("Failed to receive credentials of ctrl connection: No data available",
        the client gets EPIPE), which failed 60 of 100 pings with ``-m`` alone."""
        argv = ["nsenter", "-t", str(self.pid), "-m", "-p", UDEVADM, *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 5.0) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            if self.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                # unshare --kill-child SIGKILLs udevd (PID 1 of its namespace, so
                # all workers go with it) when unshare itself dies.
                with contextlib.suppress(ProcessLookupError):
                    if self.pid:
                        os.kill(self.pid, signal.SIGKILL)
                proc.kill()
                proc.wait(timeout=timeout)
        self._proc = None

    def __enter__(self) -> Udevd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int, nstype: int) -> None:
    if _libc.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def in_netns(pid: int) -> Iterator[None]:
    """Run the block with this thread in ``pid``'s network namespace.

    Sockets created inside stay in that namespace after the block: that is how a
    test gets a host-process monitor (and injector) into a sandbox's netns.
    Network namespaces are per thread, so this needs no single-threaded process.
    """
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        _setns(target, CLONE_NEWNET)
        try:
            yield
        finally:
            _setns(own, CLONE_NEWNET)
    finally:
        os.close(target)
        os.close(own)


def _netns_inode(path: str) -> int:
    return os.stat(path).st_ino


# The namespace this process started in (the host's): /proc/1/ns is not always
# readable (here PID 1 is not dumpable to us), so remember our own at import.
_START_NETNS = _netns_inode("/proc/self/ns/net")


class UeventInjector:
    """Sends fabricated uevents that the kernel re-broadcasts as its own.

    The kernel accepts a uevent written to a NETLINK_KOBJECT_UEVENT socket from a
    CAP_SYS_ADMIN sender (lib/kobject_uevent.c, uevent_net_rcv), adds SEQNUM and
    broadcasts it on the kernel group *of the sender's network namespace* with
    sender port 0, exactly like a real uevent. So udevd and libudev accept it.

    Must be created inside a private netns (``with in_netns(pid):``): in the
    host's namespace it would show fake NVIDIA devices to every listener there.
    """

    def __init__(self) -> None:
        if _netns_inode("/proc/thread-self/ns/net") == _START_NETNS:
            raise RuntimeError("refusing to inject uevents into the host network namespace")
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_KOBJECT_UEVENT)
        self.sock.bind((0, 0))

    def send(self, action: str, devpath: str, subsystem: str, **props: str) -> None:
        fields = {"ACTION": action, "DEVPATH": devpath, "SUBSYSTEM": subsystem, **props}
        body = f"{action}@{devpath}\0".encode()
        body += b"".join(f"{k}={v}\0".encode() for k, v in fields.items())
        # nlmsghdr: len, type (>= NLMSG_MIN_TYPE or the kernel skips it), NLM_F_REQUEST.
        header = struct.pack("=IHHII", 16 + len(body), 0x10, 0x1, 0, 0)
        self.sock.sendto(header + body, (0, 0))

    def close(self) -> None:
        self.sock.close()
