"""A private containerd for tests: own config, root, state and socket in a temp dir.

Confinement:
  * containerd runs under ``setpriv --pdeathsig KILL unshare -m --propagation private``
    with a fresh tmpfs on ``/run``: its runc root (/run/containerd/runc/<ns>), shim
    sockets and fifos never touch the host's /run.
  * A tmpfs at ``<work>/nsdev``, mounted only inside that namespace, holds the fake
    NVIDIA nodes (``mknod c 195 N``): never the host /dev. From the host they are
    reachable as ``/proc/<containerd pid>/root/<work>/nsdev`` (:attr:`host_dev`).
  * Containers are created from OCI specs written here (``ctr run --config``), so
    their device list (``linux.devices``) names /dev/nvidia* with any numbers without
    a node on the client side, and their cgroup is a kubepods-like path under a
    unique prefix (``/gg-dp-<rand>/kubepods/besteffort/pod<uid>/<id>``).
  * :meth:`stop`: kill and delete every task and container, SIGTERM containerd by
    PID (SIGKILL after a timeout), kill leftover shims by PID (found by our socket
    address in their command line), remove the cgroups made under the prefix in
    every hierarchy (deepest first), then the temp dir.

The rootfs is busybox-static plus the host's /usr bound read-only (for python3,
which serves a plugin's unix socket: busybox's nc has no -U).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONFINE = ("setpriv", "--pdeathsig", "KILL", "unshare", "-m", "--propagation", "private")

CONFIG = """\
version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = "{sock}"

[ttrpc]
  address = "{sock}.ttrpc"
"""

SOCKET_SERVER = (  # a device plugin's socket; exits on SIGTERM (pid 1 needs a handler)
    "import os,signal,socket,sys,time\n"
    "signal.signal(signal.SIGTERM, lambda *a: os._exit(0))\n"
    "p=sys.argv[1]\n"
    "try: os.unlink(p)\n"
    "except OSError: pass\n"
    "s=socket.socket(socket.AF_UNIX); s.bind(p); s.listen(8)\n"
    "time.sleep(1e9)\n"
)


class ContainerdError(RuntimeError):
    pass


def busybox_rootfs(path: Path) -> Path:
    """A minimal root: busybox-static, sh, and mount points for /usr, lib links."""
    busybox = shutil.which("busybox") or "/bin/busybox"
    (path / "bin").mkdir(parents=True)
    shutil.copy2(busybox, path / "bin/busybox")
    for app in ("sh", "ls", "sleep", "cat"):
        os.symlink("busybox", path / "bin" / app)
    for d in ("usr", "proc", "sys", "dev", "tmp", "etc", "var/lib/kubelet/device-plugins"):
        (path / d).mkdir(parents=True, exist_ok=True)
    os.symlink("usr/lib", path / "lib")
    os.symlink("usr/lib64", path / "lib64")
    return path


class PrivateContainerd:
    def __init__(self, namespace: str = "default") -> None:
        self.work = Path(tempfile.mkdtemp(prefix="gg-dp-", dir="/tmp"))
        self.sock = str(self.work / "c.sock")
        self.namespace = namespace
        self.cgroup_prefix = f"/gg-dp-{secrets.token_hex(4)}"
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.containers: list[str] = []
        self._base_spec: Optional[dict[str, Any]] = None

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def ns_dev(self) -> Path:
        """The fake node tmpfs, as a path inside the private namespace."""
        return self.work / "nsdev"

    @property
    def host_dev(self) -> Path:
        """The same tmpfs seen from the host (through containerd's root link)."""
        return Path(f"/proc/{self.pid}/root{self.ns_dev}")

    def start(self, timeout: float = 15.0) -> None:
        cfg = self.work / "config.toml"
        cfg.write_text(
            CONFIG.format(root=self.work / "root", state=self.work / "state", sock=self.sock)
        )
        self.ns_dev.mkdir()
        script = (
            "set -e; mount -t tmpfs -o mode=755 tmpfs /run; "
            f"mount -t tmpfs -o mode=755 tmpfs {self.ns_dev}; "
            f"exec containerd --config {cfg} --log-level warn"
        )
        log = open(self.work / "containerd.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*CONFINE, "sh", "-c", script],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ContainerdError(f"containerd exited: {self.log_tail()}")
            if os.path.exists(self.sock) and self._ctr_ok("version"):
                return
            time.sleep(0.05)
        raise ContainerdError(f"containerd not ready in {timeout}s: {self.log_tail()}")

    def log_tail(self) -> str:
        try:
            return (self.work / "containerd.log").read_text()[-2000:]
        except OSError:
            return ""

    def _ctr_ok(self, *args: str) -> bool:
        r = subprocess.run(self.ctr_argv(*args), capture_output=True, timeout=10)
        return r.returncode == 0

    def ctr_argv(self, *args: str) -> list[str]:
        """ctr run inside containerd's mount namespace (its fifos live in the private /run)."""
        ns = ["nsenter", "-t", str(self.pid), "-m"]
        return [*ns, "ctr", "--address", self.sock, "-n", self.namespace, *args]

    def ctr(self, *args: str, check: bool = True, timeout: float = 30) -> str:
        r = subprocess.run(self.ctr_argv(*args), capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise ContainerdError(f"ctr {' '.join(args)}: {r.stderr.strip() or r.stdout.strip()}")
        return r.stdout

    def nsrun(self, *argv: str) -> None:
        subprocess.run(["nsenter", "-t", str(self.pid), "-m", *argv], check=True, timeout=10)

    def mknod(self, name: str, major: int, minor: int) -> None:
        """A fake node in the private tmpfs (never the host /dev)."""
        self.nsrun("mknod", "-m", "666", str(self.ns_dev / name), "c", str(major), str(minor))

    # -- containers ----------------------------------------------------------------------

    def base_spec(self) -> dict[str, Any]:
        if self._base_spec is None:
            out = subprocess.run(["ctr", "oci", "spec"], capture_output=True, text=True, check=True)
            self._base_spec = json.loads(out.stdout)
        return json.loads(json.dumps(self._base_spec))

    def cgroup_path(self, pod_uid: str, cid: str) -> str:
        return f"{self.cgroup_prefix}/kubepods/besteffort/pod{pod_uid}/{cid}"

    def run(
        self,
        cid: str,
        args: Sequence[str],
        *,
        pod_uid: str,
        devices: Iterable[tuple[str, int, int]] = (),
        binds: Iterable[tuple[str, str, bool]] = (),
    ) -> int:
        """Start a container; returns its init's host pid."""
        rootfs = busybox_rootfs(self.work / f"rootfs-{cid[:12]}")
        spec = self.base_spec()
        spec["root"] = {"path": str(rootfs), "readonly": False}
        spec["process"]["args"] = list(args)
        spec["process"]["terminal"] = False
        spec["process"]["env"] = ["PATH=/usr/bin:/bin"]
        mounts = spec.setdefault("mounts", [])
        mounts.append(
            {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]}
        )
        for src, dst, rw in binds:
            opts = ["rbind", "rw" if rw else "ro"]
            mounts.append({"destination": dst, "type": "bind", "source": src, "options": opts})
        linux = spec["linux"]
        linux["cgroupsPath"] = self.cgroup_path(pod_uid, cid)
        res = linux.setdefault("resources", {}).setdefault("devices", [])
        for path, major, minor in devices:
            linux.setdefault("devices", []).append(
                {"path": path, "type": "c", "major": major, "minor": minor, "fileMode": 0o666}
            )
            res.append(
                {"allow": True, "type": "c", "major": major, "minor": minor, "access": "rwm"}
            )
        spec_file = self.work / f"spec-{cid[:12]}.json"
        spec_file.write_text(json.dumps(spec))
        self.containers.append(cid)
        self.ctr("run", "-d", "--null-io", "--config", str(spec_file), cid)
        return self.task_pid(cid)

    def task_pid(self, cid: str) -> int:
        for line in self.ctr("task", "ls").splitlines()[1:]:
            f = line.split()
            if f and f[0] == cid:
                return int(f[1])
        raise ContainerdError(f"no task {cid}")

    def task_status(self, cid: str) -> str:
        for line in self.ctr("task", "ls").splitlines()[1:]:
            f = line.split()
            if f and f[0] == cid:
                return f[2]
        return "GONE"

    def remove(self, cid: str) -> None:
        self.ctr("task", "kill", "-s", "SIGKILL", cid, check=False)
        deadline = time.monotonic() + 10
        while self.task_status(cid) == "RUNNING" and time.monotonic() < deadline:
            time.sleep(0.05)
        self.ctr("task", "delete", "-f", cid, check=False)
        self.ctr("container", "delete", cid, check=False)
        if cid in self.containers:
            self.containers.remove(cid)

    # -- teardown --------------------------------------------------------------------------

    def _shim_pids(self) -> list[int]:
        out = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd and cmd[0].endswith(b"containerd-shim-runc-v2") and self.sock.encode() in cmd:
                out.append(int(name))
        return out

    def cgroup_dirs(self) -> list[Path]:
        """Every cgroup directory under our prefix, deepest first."""
        found: list[Path] = []
        for hier in CGROUP_ROOT.iterdir():
            top = hier / self.cgroup_prefix.lstrip("/")
            if top.is_dir() and not top.is_symlink():
                found += [Path(d) for d, _s, _f in os.walk(top)]
        return sorted(found, key=lambda p: len(p.parts), reverse=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for cid in list(self.containers):
                with contextlib.suppress(Exception):
                    self.remove(cid)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        deadline = time.monotonic() + 5
        while self._shim_pids() and time.monotonic() < deadline:  # they exit on their own
            time.sleep(0.05)
        for pid in self._shim_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for d in self.cgroup_dirs():
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)
        shutil.rmtree(self.work, ignore_errors=True)

    def __enter__(self) -> PrivateContainerd:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
