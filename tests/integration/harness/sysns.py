"""A real systemd (+ D-Bus, journald) as PID 1 of a private namespace, for tests.

Booting ``systemd --system`` on a machine where it is not PID 1 is the most
dangerous thing a test here can do: a naive ``unshare -p -f systemd`` moved the
host's processes between cgroups, ran ``systemd-tmpfiles --boot`` against the
host ``/tmp``, flushed its journal into the host ``/var/log/journal`` and made
device nodes in the host ``/dev`` (see docs/testing.md).
This harness confines it; every measure below exists for one of those hazards.

Lifetime (nothing may outlive the test, even if pytest crashes):
  * ``setpriv --pdeathsig KILL unshare --kill-child ...``: if pytest dies,
    ``unshare`` gets SIGKILL; ``--kill-child`` then SIGKILLs its child, which is
    PID 1 of the new pid namespace, and the kernel kills everything in it.
  * Stop = ``SIGRTMIN+4`` (poweroff) to systemd, SIGKILL after a timeout. The
    PID is held through a pidfd, so a recycled PID is never signalled.
    Long-running commands started with :meth:`SystemdNamespace.popen` run under
    ``setpriv --pdeathsig KILL`` and their inner process is killed first (an
    orphan would be reparented to the host PID 1, which reaps late and stalls
    the poweroff ~10 s).

cgroups (systemd must only ever touch its own subtree):
  * Per instance, a cgroup is made in EVERY hierarchy (v1 controllers, the
    named ``systemd`` one, the unified cgroup2), *below the cgroup pytest is
    already in* (so the sandbox's own memory accounting keeps applying), and the
    launcher moves itself into all of them before anything else. systemd
    ignores a v1 controller (e.g. devices) unless its root cgroup exists there.
  * The launcher then enters a new cgroup namespace rooted there, and the
    hierarchies are mounted afresh inside it, so systemd sees only its own
    cgroup as ``/`` and cannot see, let alone move, a host process.
  * At stop, the cgroups are removed deepest-first (after checking empty).
    If pytest was SIGKILLed, the next start removes empty leftovers of dead
    harness processes (``sweep_stale_cgroups``; only our own name prefix).

Layouts (``layout=``): "v1" mounts every host hierarchy afresh (v1 controllers,
the named ``systemd`` one and cgroup2 at ``unified``: systemd's hybrid mode, as
the legacy hosts of seeds 002/003 run); "v2" unmounts all of them in the
private mount namespace and mounts cgroup2 alone at /sys/fs/cgroup, so systemd
runs unified and the node looks like a current distribution's (device access
then is BPF device programs; see sysns-init.sh).

Network: by default a private network namespace (only ``lo``), so systemd's
loopback setup or any unit's networking cannot touch the host's interfaces;
AF_UNIX path sockets (the system bus, /run/systemd/private) still work.

Filesystem (all inside a private mount namespace, propagation private, so
nothing is mounted on the host and everything vanishes with the namespace):
  * ``/`` is remounted read-only first: anything not explicitly made writable
    fails with EROFS instead of writing the host disk (including the mkdir of a
    bind target).
  * ``/etc`` and ``/var`` are overlays whose upper layers live in the test's
    work dir; ``/etc/systemd/system`` is a private directory the harness fills
    (host enablement symlinks do not apply); ``/etc/machine-id`` is per
    instance; ``/var/log/journal`` is an empty tmpfs and journald is set to
    ``Storage=volatile`` and its flush unit is masked (no host journal writes).
  * Fresh tmpfs on ``/run``, ``/tmp``, ``/var/tmp`` (tmpfiles only ever sees
    those) and ``/dev`` with just null/zero/full/random/urandom/tty, a private
    devpts and shm: no console, no kmsg, no disks.
  * ``/proc/sys``, ``/proc/sysrq-trigger`` and ``/sys`` are read-only.
  * The repository is visible at the same path, read-only; test binds are
    staged under ``/run/host/binds`` while their host paths are reachable.

systemd itself:
  * ``container=gpuguard-test`` in its environment: container mode, never
    bare-metal mode (whose shutdown would detach host loop/zram devices).
  * Booted with ``--unit=basic.target --show-status=no``; udev, sysctl,
    modules-load, binfmt, timers, firstboot, sysusers, ... are masked with
    ``/run/systemd/system/<unit> -> /dev/null`` (see :data:`DEFAULT_MASKS`).
  * dbus.service is pulled into basic.target; a host-side client connects to
    :attr:`SystemdNamespace.bus_address` (through ``/proc/PID/root``).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import re
import select
import shlex
import signal
import socket
import stat
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
INIT_SCRIPT = HERE / "sysns-init.sh"
REPO = HERE.parents[2]
SYSTEMD = "/lib/systemd/systemd"
INNER_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"

#: Units masked in every instance: slow, useless in a container, or touching
#: something outside the namespace if they ever ran.
DEFAULT_MASKS: Tuple[str, ...] = (
    # udev: no udevd here, and it would create nodes / trigger host uevents
    "systemd-udevd.service",
    "systemd-udevd-control.socket",
    "systemd-udevd-kernel.socket",
    "systemd-udev-trigger.service",
    "systemd-udev-settle.service",
    "systemd-hwdb-update.service",
    # kernel-global state: sysctls, modules, binfmt, pstore, static nodes
    "systemd-sysctl.service",
    "systemd-modules-load.service",
    "kmod-static-nodes.service",
    "systemd-binfmt.service",
    "proc-sys-fs-binfmt_misc.automount",
    "proc-sys-fs-binfmt_misc.mount",
    "systemd-pstore.service",
    "systemd-remount-fs.service",
    "systemd-random-seed.service",
    "systemd-timesyncd.service",
    "systemd-pcrphase.service",
    "systemd-pcrphase-sysinit.service",
    "systemd-repart.service",
    "systemd-tmpfiles-setup-dev.service",
    # pseudo filesystems (the private /dev and /sys are all a test needs)
    "dev-hugepages.mount",
    "dev-mqueue.mount",
    "sys-fs-fuse-connections.mount",
    "sys-kernel-config.mount",
    "sys-kernel-debug.mount",
    "sys-kernel-tracing.mount",
    "tmp.mount",
    # writers of /etc and /var (overlays anyway, but slow and pointless)
    "systemd-firstboot.service",
    "systemd-sysusers.service",
    "systemd-machine-id-commit.service",
    "ldconfig.service",
    "systemd-update-done.service",
    "systemd-journal-catalog-update.service",
    "systemd-update-utmp.service",
    "systemd-update-utmp-runlevel.service",
    # journal must stay volatile, in the private /run
    "systemd-journal-flush.service",
    "systemd-journald-audit.socket",
    # consoles / password agents / initctl
    "systemd-ask-password-console.path",
    "systemd-ask-password-wall.path",
    "systemd-initctl.socket",
    "console-getty.service",
    "getty.target",
    # timers
    "systemd-tmpfiles-clean.timer",
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "dpkg-db-backup.timer",
    "e2scrub_all.timer",
    "e2scrub_reap.service",
    "fstrim.timer",
    "man-db.timer",
    "logrotate.timer",
)

#: Host binaries the harness needs.
REQUIRED_TOOLS: Tuple[str, ...] = (
    "unshare",
    "nsenter",
    "setpriv",
    SYSTEMD,
    "/usr/bin/dbus-daemon",
    "/lib/systemd/system/dbus.socket",
)

#: The cgroup layouts a namespace can boot (see the module docstring).
LAYOUTS: Tuple[str, ...] = ("v1", "v2")

_counter = itertools.count()
CGROUP_PREFIX = "gpuguard-sysns-"


def listening(path: Path) -> bool:
    """True once a unix socket accepts: its file exists from bind() on, and a client
    that connects before listen() is refused."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


class NamespaceError(RuntimeError):
    """The namespace failed to boot or misbehaved; message carries its log tail."""


def host_hierarchies() -> List[Tuple[str, str, str, Path]]:
    """(name, fstype, mount options, host dir of our current cgroup) per hierarchy.

    Only hierarchies mounted under /sys/fs/cgroup and listed in /proc/self/cgroup.
    """
    known = set()
    with open("/proc/cgroups") as f:
        for line in f:
            if not line.startswith("#"):
                known.add(line.split()[0])
    current: Dict[str, str] = {}  # controller key -> path
    with open("/proc/self/cgroup") as f:
        for line in f:
            _hid, ctrls, path = line.rstrip("\n").split(":", 2)
            current[ctrls or "<unified>"] = path
    out: List[Tuple[str, str, str, Path]] = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.rstrip("\n").split(" - ", 1)
            fields = left.split()
            root, mountpoint = fields[3], fields[4]
            fstype, _src, superopts = right.split(" ", 2)
            if fstype not in ("cgroup", "cgroup2"):
                continue
            if os.path.dirname(mountpoint) != "/sys/fs/cgroup":
                continue
            if fstype == "cgroup2":
                key, opts = "<unified>", "rw"
            else:
                toks = [t for t in superopts.split(",") if t in known or t.startswith("name=")]
                key = ",".join(toks)
                names = [t for t in toks if not t.startswith("name=")]
                opts = ",".join(toks) if names else ",".join(["none", *toks])
            if key not in current:
                continue
            rel = os.path.relpath(current[key], root) if root != "/" else current[key]
            if rel.startswith(".."):
                continue  # we are outside what this mount shows: cannot nest there
            host_dir = Path(mountpoint) / rel.lstrip("/")
            out.append((os.path.basename(mountpoint), fstype, opts, host_dir))
    return out


def sweep_stale_cgroups() -> List[Path]:
    """Remove empty per-instance cgroups left by a harness process that died.

    Only ``gpuguard-sysns-<pid>-*`` directories whose creating ``<pid>`` no
    longer exists and which hold no process are touched (deepest first). A
    SIGKILLed pytest leaves such empty dirs: its namespaces die with it
    (pdeathsig), but nobody is left to rmdir.
    """
    removed: List[Path] = []
    for _name, _fstype, _opts, parent in host_hierarchies():
        for top in parent.glob(f"{CGROUP_PREFIX}*"):
            m = re.match(rf"{CGROUP_PREFIX}(\d+)-", top.name)
            if not m or not top.is_dir() or os.path.exists(f"/proc/{m.group(1)}"):
                continue
            try:
                for dirpath, _dirs, _files in os.walk(top, topdown=False):
                    if (Path(dirpath) / "cgroup.procs").read_text().strip():
                        raise OSError(errno.EBUSY, "populated", dirpath)
                    os.rmdir(dirpath)
                removed.append(top)
            except OSError:
                continue
    return removed


class SystemdNamespace:
    """A systemd booted as PID 1 of private pid/mount/uts/ipc/cgroup namespaces.

    Use as a context manager (or call :meth:`start`/:meth:`stop`); ``workdir``
    must be an empty or absent directory owned by the test (e.g. ``tmp_path``).
    ``units`` maps a name below /etc/systemd/system (``x.service``,
    ``x.service.d/y.conf``) to its text. ``binds`` maps an absolute path inside to
    a host path bound read-write there; ``ro_binds`` likewise read-only.
    ``extra_mask`` adds units to :data:`DEFAULT_MASKS`. ``env`` becomes the
    manager's DefaultEnvironment (seen by every unit). ``private_network``
    (default) gives it its own network namespace with only ``lo``; the system
    bus and every other AF_UNIX path socket stay reachable from the host.
    ``layout`` is "v1" (hybrid: v1 controllers plus cgroup2) or "v2" (unified).
    """

    def __init__(
        self,
        workdir: Path,
        *,
        units: Optional[Mapping[str, str]] = None,
        binds: Optional[Mapping[str, Path]] = None,
        ro_binds: Optional[Mapping[str, Path]] = None,
        extra_mask: Sequence[str] = (),
        env: Optional[Mapping[str, str]] = None,
        private_network: bool = True,
        layout: str = "v1",
        boot_timeout: float = 30.0,
        stop_timeout: float = 10.0,
    ) -> None:
        self.workdir = Path(workdir)
        self.private_network = private_network
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r}: expected one of {LAYOUTS}")
        self.layout = layout
        self.units = dict(units or {})
        self.binds = {k: Path(v) for k, v in (binds or {}).items()}
        self.ro_binds = {k: Path(v) for k, v in (ro_binds or {}).items()}
        self.extra_mask = list(extra_mask)
        self.env = dict(env or {})
        self.boot_timeout = boot_timeout
        self.stop_timeout = stop_timeout
        self.name = f"{CGROUP_PREFIX}{os.getpid()}-{next(_counter)}-{uuid.uuid4().hex[:6]}"
        self.state = self.workdir / "state"
        self.log_path = self.workdir / "launcher.log"
        self._pid: Optional[int] = None
        self._pidfd: Optional[int] = None
        self._launcher: Optional[subprocess.Popen[bytes]] = None
        self._cgroups: Dict[str, Path] = {}
        self._children: List[subprocess.Popen[Any]] = []
        self.boot_seconds: Optional[float] = None
        self.stop_seconds: Optional[float] = None
        self.system_state: Optional[str] = None

    # ------------------------------------------------------------------ public API
    @property
    def pid(self) -> int:
        """Host PID of the namespace's systemd (PID 1 inside)."""
        if self._pid is None:
            raise NamespaceError("namespace not started")
        return self._pid

    @property
    def root(self) -> Path:
        """The namespace's root as seen from the host (/proc/PID/root)."""
        return Path(f"/proc/{self.pid}/root")

    @property
    def bus_address(self) -> str:
        """D-Bus address of the namespace's system bus, usable from the host."""
        return f"unix:path={self.root}/run/dbus/system_bus_socket"

    @property
    def units_dir(self) -> Path:
        """Host directory that is /etc/systemd/system inside."""
        return self.state / "units"

    def path(self, inner: str) -> Path:
        """Host path of ``inner`` (an absolute path inside the namespace)."""
        return self.root / inner.lstrip("/")

    def cgroup_dir(self, hierarchy: str) -> Path:
        """Host dir of the instance's root cgroup in ``hierarchy``.

        ``hierarchy`` is the mount name under /sys/fs/cgroup: "devices",
        "memory", "systemd" (name=systemd), "unified" (cgroup2), ...
        A unit's cgroup ``/system.slice/x.service`` inside is
        ``cgroup_dir(h) / "system.slice/x.service"`` on the host.
        """
        try:
            return self._cgroups[hierarchy]
        except KeyError:
            raise KeyError(f"no cgroup hierarchy {hierarchy!r}: {sorted(self._cgroups)}") from None

    @property
    def device_hierarchy(self) -> str:
        """The hierarchy where systemd enforces units' device policy: ``devices`` (v1,
        a devices.list per cgroup) or ``unified`` (v2, BPF device programs)."""
        return "unified" if self.layout == "v2" else "devices"

    def fake_node(self, major: int, minor: int) -> Path:
        """A char node ``major:minor`` in the instance's host-side work dir (never a
        /dev), to probe a cgroup's verdict with: EPERM denied, ENXIO admitted."""
        d = self.workdir / "probe-nodes"
        d.mkdir(exist_ok=True)
        path = d / f"c{major}-{minor}"
        if not path.exists():
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(major, minor))
        return path

    def command(self, argv: Sequence[str]) -> List[str]:
        """Host argv that runs ``argv`` inside the namespace (dies with its caller)."""
        return [
            "nsenter",
            "-t",
            str(self.pid),
            "-m",
            "-p",
            "-u",
            "-i",
            "-C",
            "-n",
            "--",
            "setpriv",
            "--pdeathsig",
            "KILL",
            "--",
            *argv,
        ]

    def _env(self, env: Optional[Mapping[str, str]]) -> Dict[str, str]:
        e = {
            "PATH": INNER_PATH,
            "LANG": "C.UTF-8",
            "SYSTEMD_PAGER": "",
            "SYSTEMD_COLORS": "0",
            "TERM": "dumb",
        }
        e.update(env or {})
        return e

    def run(
        self,
        argv: Sequence[str],
        *,
        check: bool = False,
        timeout: float = 30.0,
        env: Optional[Mapping[str, str]] = None,
        input: Optional[str] = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside (nsenter -t PID -m -p -u -i -C -n), capture text output."""
        p = subprocess.Popen(
            self.command(argv),
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self._env(env),
            cwd="/",
        )
        try:
            out, err = p.communicate(input, timeout=timeout)
        except BaseException:
            self._kill_child(p)  # inner process first, see _kill_child
            raise
        res = subprocess.CompletedProcess(list(argv), p.returncode, out, err)
        if check and res.returncode != 0:
            raise NamespaceError(
                f"{list(argv)} exited {res.returncode}\nstdout: {res.stdout}\nstderr: {res.stderr}"
            )
        return res

    def popen(
        self, argv: Sequence[str], *, env: Optional[Mapping[str, str]] = None, **kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Start a long-running ``argv`` inside; killed (inner process first) at stop."""
        p: subprocess.Popen[Any] = subprocess.Popen(
            self.command(argv), env=self._env(env), cwd="/", **kwargs
        )
        self._children.append(p)
        return p

    def systemctl(
        self, *args: str, check: bool = True, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        return self.run(["systemctl", "--no-pager", *args], check=check, timeout=timeout)

    def write_unit(self, name: str, text: str, *, reload: bool = False) -> Path:
        """Write /etc/systemd/system/``name`` inside (drop-ins: ``x.service.d/y.conf``)."""
        dest = self.units_dir / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
        if reload:
            self.systemctl("daemon-reload")
        return dest

    def unit_property(self, unit: str, prop: str) -> str:
        return self.systemctl("show", "-p", prop, "--value", unit).stdout.rstrip("\n")

    def wait_active(self, unit: str, timeout: float = 10.0) -> None:
        """Wait until ``unit`` is active; raise early if it fails."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.unit_property(unit, "ActiveState")
            if state == "active":
                return
            if state == "failed":
                break
            time.sleep(0.05)
        status = self.systemctl("status", unit, check=False).stdout
        journal = self.run(["journalctl", "--no-pager", "-u", unit, "-n", "50"]).stdout
        raise NamespaceError(f"{unit} is {state!r}, not active\n{status}\n{journal}")

    def journal(self, unit: Optional[str] = None) -> List[Dict[str, Any]]:
        """Journal entries (``journalctl -o json``), optionally of one unit."""
        argv = ["journalctl", "--no-pager", "-o", "json"]
        if unit:
            argv += ["-u", unit]
        out = self.run(argv, check=True).stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def cgroup_dirs(self) -> Dict[str, Path]:
        """All per-instance cgroup roots, by hierarchy name (empty once stopped)."""
        return dict(self._cgroups)

    def processes(self) -> List[int]:
        """Host PIDs of every process in the instance's cgroups."""
        pids = set()
        for top in self._cgroups.values():
            for dirpath, _dirs, _files in os.walk(top):
                try:
                    text = (Path(dirpath) / "cgroup.procs").read_text()
                except OSError:
                    continue
                pids.update(int(x) for x in text.split())
        return sorted(pids)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> SystemdNamespace:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if self._launcher is not None:
            raise NamespaceError("already started")
        t0 = time.monotonic()
        try:
            sweep_stale_cgroups()
            self._prepare_state()
            self._make_cgroups()
            self._launch()
            self._wait_booted(t0)
        except BaseException:
            self.stop()
            raise
        self.boot_seconds = time.monotonic() - t0

    def stop(self) -> None:
        """Poweroff (SIGKILL after stop_timeout), reap, remove cgroups. Idempotent."""
        t0 = time.monotonic()
        for p in self._children:
            self._kill_child(p)
        self._children.clear()
        launcher = self._launcher
        if launcher is not None:
            if launcher.poll() is None and self._pidfd is not None:
                self._signal(signal.SIGRTMIN + 4)
                if not self._wait_pidfd(self.stop_timeout):
                    self._signal(signal.SIGKILL)
                    self._wait_pidfd(5.0)
            try:
                launcher.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                launcher.kill()  # the unshare; --kill-child takes its child along
                launcher.wait()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        self._remove_cgroups()
        if launcher is not None:
            self.stop_seconds = time.monotonic() - t0

    # ------------------------------------------------------------------ internals
    def _prepare_state(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.state.mkdir()
        units = self.units_dir
        (units / "basic.target.wants").mkdir(parents=True)
        (units / "basic.target.wants" / "dbus.service").symlink_to(
            "/lib/systemd/system/dbus.service"
        )
        for name, text in self.units.items():
            self.write_unit(name, text)
        (self.state / "layout").write_text(self.layout + "\n")
        (self.state / "machine-id").write_text(uuid.uuid4().hex + "\n")
        (self.state / "hostname").write_text(self.name[:63] + "\n")
        masks = [*DEFAULT_MASKS, *self.extra_mask]
        (self.state / "masks.txt").write_text("".join(f"{m}\n" for m in dict.fromkeys(masks)))
        (self.state / "journald.conf").write_text(
            "[Journal]\nStorage=volatile\nForwardToConsole=no\nForwardToKMsg=no\n"
            "ForwardToWall=no\nRateLimitBurst=0\n"
        )
        manager = ["[Manager]", "ShowStatus=no", "DefaultTimeoutStopSec=5s"]
        if self.env:
            for k, v in self.env.items():
                if any(c in k + v for c in '\n"\\'):
                    raise ValueError(f"unsupported character in env {k}={v!r}")
            manager.append(
                "DefaultEnvironment=" + " ".join(f'"{k}={v}"' for k, v in self.env.items())
            )
        (self.state / "system.conf").write_text("\n".join(manager) + "\n")
        rows: List[Tuple[Path, str, str]] = [(REPO, str(REPO), "ro")]
        rows += [(src, dst, "rw") for dst, src in self.binds.items()]
        rows += [(src, dst, "ro") for dst, src in self.ro_binds.items()]
        lines = []
        for src, dst, mode in rows:
            if not os.path.isabs(dst) or not src.exists():
                raise ValueError(
                    f"bind {dst} <- {src}: need an absolute target and existing source"
                )
            if any(c in f"{src}{dst}" for c in "\t\n"):
                raise ValueError(f"bind {dst} <- {src}: tab/newline in path")
            lines.append(f"{src.resolve()}\t{dst}\t{mode}\n")
        (self.state / "binds.tsv").write_text("".join(lines))

    def _make_cgroups(self) -> None:
        rows = []
        for name, fstype, opts, parent in host_hierarchies():
            d = parent / self.name
            d.mkdir()
            self._cgroups[name] = d
            if name == "cpuset":
                # a new v1 cpuset has no cpus/mems: attaching a task would fail
                for knob in ("cpuset.cpus", "cpuset.mems"):
                    (d / knob).write_text((parent / knob).read_text())
            rows.append(f"{name}\t{fstype}\t{opts}\n")
        need = {"devices", "systemd"} | ({"unified"} if self.layout == "v2" else set())
        if not need <= set(self._cgroups):
            raise NamespaceError(f"unexpected cgroup layout: {sorted(self._cgroups)}")
        (self.state / "cgroups.tsv").write_text("".join(rows))

    def _launch(self) -> None:
        # The shell moves itself into every instance cgroup, then execs (same
        # PID) setpriv -> unshare, which forks the namespace's PID 1.
        script = 'set -e; for f in "$@"; do echo $$ > "$f"; done; exec ' + " ".join(
            shlex.quote(a) for a in [*self._unshare_argv(), str(INIT_SCRIPT), str(self.state)]
        )
        procs = [str(d / "cgroup.procs") for d in self._cgroups.values()]
        with open(self.log_path, "wb") as log:
            self._launcher = subprocess.Popen(
                ["/bin/sh", "-c", script, "sh", *procs],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd="/",
                env={"PATH": INNER_PATH, "LANG": "C.UTF-8"},
                start_new_session=True,
            )

    def _unshare_argv(self) -> List[str]:
        """``setpriv ... unshare ... /bin/sh``: append the init script and its args."""
        argv = ["setpriv", "--pdeathsig", "KILL", "unshare", "--kill-child", "--fork"]
        argv += ["--pid", "--mount", "--uts", "--ipc", "--cgroup", "--mount-proc"]
        if self.private_network:
            argv.append("--net")
        return [*argv, "--propagation", "private", "--", "/bin/sh"]

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def _wait_booted(self, t0: float) -> None:
        assert self._launcher is not None
        deadline = t0 + self.boot_timeout
        children = Path(f"/proc/{self._launcher.pid}/task/{self._launcher.pid}/children")
        while self._pid is None:
            if self._launcher.poll() is not None:
                raise NamespaceError(
                    f"launcher exited {self._launcher.returncode}:\n{self._log_tail()}"
                )
            if time.monotonic() > deadline:
                raise NamespaceError(f"namespace PID 1 never appeared:\n{self._log_tail()}")
            try:
                kids = children.read_text().split()
            except OSError:
                kids = []
            if kids:
                self._pid = int(kids[0])
                self._pidfd = os.pidfd_open(self._pid)
            else:
                time.sleep(0.002)
        private = Path(f"/proc/{self._pid}/root/run/systemd/private")
        while not listening(private):
            if self._launcher.poll() is not None:
                raise NamespaceError(
                    f"systemd exited {self._launcher.returncode}:\n{self._log_tail()}"
                )
            if time.monotonic() > deadline:
                raise NamespaceError(f"systemd did not come up:\n{self._log_tail()}")
            time.sleep(0.005)
        left = max(1.0, deadline - time.monotonic())
        res = self.run(["systemctl", "is-system-running", "--wait"], timeout=left)
        state = res.stdout.strip()
        if state not in ("running", "degraded"):
            raise NamespaceError(
                f"system state {state!r} ({res.stderr.strip()})\n"
                + self.run(["systemctl", "--no-pager", "--failed"]).stdout
                + self._log_tail()
            )
        self.system_state = state

    def _signal(self, sig: int) -> None:
        assert self._pidfd is not None
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._pidfd, sig)

    def _wait_pidfd(self, timeout: float) -> bool:
        """True once the systemd process has exited (pidfd readable)."""
        assert self._pidfd is not None
        r, _, _ = select.select([self._pidfd], [], [], timeout)
        return bool(r)

    @staticmethod
    def _kill_child(p: subprocess.Popen[Any]) -> None:
        # Kill the inner process first, so that nsenter (its parent) reaps it;
        # killing nsenter first would orphan it to the host's PID 1.
        if p.poll() is None:
            try:
                kids = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
            except OSError:
                kids = []
            for kid in kids:
                try:
                    fd = os.pidfd_open(int(kid))
                except OSError:
                    continue
                try:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                finally:
                    os.close(fd)
            try:
                p.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _remove_cgroups(self) -> None:
        if not self._cgroups:
            return
        deadline = time.monotonic() + 5.0
        while True:
            left = self.processes()
            if not left:
                break
            if time.monotonic() > deadline:
                raise NamespaceError(f"processes left in {self.name}: {left}")
            time.sleep(0.01)
        errors = []
        for top in self._cgroups.values():
            if not top.exists():
                continue
            for dirpath, _dirs, _files in os.walk(top, topdown=False):
                for _ in range(200):
                    try:
                        os.rmdir(dirpath)
                        break
                    except OSError as e:
                        if e.errno != errno.EBUSY:
                            errors.append(f"{dirpath}: {e}")
                            break
                        time.sleep(0.01)
                else:
                    errors.append(f"{dirpath}: still busy")
        self._cgroups.clear()
        if errors:
            raise NamespaceError("could not remove cgroups: " + "; ".join(errors))
