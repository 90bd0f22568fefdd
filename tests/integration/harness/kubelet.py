"""A real kubelet (1.20.2, 1.34.9, 1.36.2) in a private systemd namespace, on cgroup v1 (hybrid).

1.20's binary is built from Debian 12's own source package and cached by
``scripts/build-kubelet`` (``scripts/bootstrap --full`` runs it; :func:`kubelet_binary`
finds it); 1.34's is the prebuilt one beside the checkout, unpacked and run from a
KubeletConfiguration (harness/kubelet_versions.py). It runs standalone, as
``kubelet.service`` of a :class:`SystemdNamespace`
(this machine's systemd, or a Debian release's root booted with its own:
integration/kubelet_sites.py); a test adds gpuguard's real drop-in
(units/kubelet.service.d/), so that gpuguard's pre-start hook runs at each kubelet
start, as on a node (integration/kubelet_node.py):

* static pods from ``--pod-manifest-path`` (/etc/kubernetes/manifests), all with
  ``hostNetwork: true`` (no CNI), their images made here from busybox-static
  (harness/oci_image.py) and imported with ``ctr -n k8s.io images import``
  (``imagePullPolicy: Never``; a local pause image is containerd's ``sandbox_image``
  and kubelet's ``--pod-infra-container-image``);
* the remote runtime is the namespace's own containerd with its CRI plugin
  (``containerd.service``: root, state and socket in the namespace's private /run),
  runc with the systemd cgroup driver (``--cgroup-driver=systemd``, ``SystemdCgroup``),
  and a ``base_runtime_spec`` whose prestart hook plays NVIDIA's legacy runtime hook
  (harness/nvidia_hook.py). ``restrict_oom_score_adj``: these machines withhold
  CAP_SYS_RESOURCE, so runc could not lower a pod's oom_score_adj (-998 for a
  sandbox) and every sandbox would fail ("can't get final child's PID from pipe");
* pod status from kubelet's read-only port (``/pods``), read from inside the
  namespace's private network (``lo`` only);
* kubelet's kernel tunables (``vm.overcommit_memory=1``, ``kernel.panic=10``,
  ``kernel.panic_on_oops=1``, ...): read-only files holding those values are bound
  over the namespace's own /proc/sys entries, so kubelet finds them set and writes
  nothing (the host's are never reachable: /proc/sys is read-only in the namespace);
  ``/dev/kmsg``, which its OOM watcher reads, is an empty file in the private /dev.

Only v1: this machine's kernel keeps the cpu and memory controllers in their v1
hierarchies, so a private cgroup2 has no ``cpu.weight``, and runc cannot create a pod
sandbox there: containerd gives every sandbox CPU shares, which runc writes as
``cpu.weight`` (``openat2 .../cri-containerd-<id>.scope/cpu.weight: no such file or
directory``, seen with ``layout="v2"``).
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from .deviceplugin import generate
from .kubelet_versions import Kubelet, kubelet
from .oci_image import busybox_image
from .pods import API, BUSYBOX, DEVICE_PLUGINS, INVENTORY, PLUGIN_SCRIPT, VENV_PYTHON, Pod, show
from .sysns import REPO, SystemdNamespace

BUILD_SCRIPT = REPO / "scripts/build-kubelet"
HOOK_SCRIPT = REPO / "tests/integration/harness/nvidia_hook.py"
INNER = "/run/gg-kubelet"  # the test's host dir, bound read-only inside
LOG = "/run/gg-kubelet-log"  # where the hook writes what it did (read-write)
MANIFESTS = "/etc/kubernetes/manifests"
CHECKPOINT = f"{DEVICE_PLUGINS}/kubelet_internal_checkpoint"
CRI_SOCK = "/run/containerd/containerd.sock"
RUNC_ROOT = "/run/containerd/runc/k8s.io"  # runc's state of containerd's k8s.io namespace
NODE = "gpunode"
PAUSE = "gpuguard.test/pause:1"
READ_ONLY_PORT = 10255
#: kubelet 1.20's KernelTunableModify values (container_manager_linux.go)
TUNABLES = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
REQUIRED_TOOLS = ("containerd", "containerd-shim-runc-v2", "ctr", "runc", "busybox")

CONTAINERD_CONFIG = f"""\
version = 2
root = "/run/containerd-root"
state = "/run/containerd"
[grpc]
  address = "{CRI_SOCK}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE}"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      base_runtime_spec = "{INNER}/base-spec.json"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = true
"""

CONTAINERD_UNIT = f"""[Unit]
Description=containerd with its CRI plugin, for the real kubelet
[Service]
ExecStartPre=/bin/mkdir -p /run/containerd-root
ExecStart=/usr/bin/containerd --config {INNER}/containerd.toml --log-level warn
Type=notify
Delegate=yes
KillMode=process
"""


def plugin_unit(python: str = str(VENV_PYTHON), pythonpath: str = "") -> str:
    """The device plugin double's unit, run by ``python`` (this checkout's venv on the
    host; a root's own python3 with ``pythonpath`` holding grpcio and protobuf)."""
    env = f"Environment=PYTHONPATH={pythonpath}\n" if pythonpath else ""
    return f"""[Unit]
Description=NVIDIA device plugin double (deviceplugin v1beta1 over gRPC)
[Service]
{env}ExecStart={python} {PLUGIN_SCRIPT} --api {API} --inventory {INVENTORY} $PLUGIN_ARGS
"""


PLUGIN_UNIT = plugin_unit()


def kubelet_flags(extra: Sequence[str] = ()) -> List[str]:
    return [
        f"--pod-manifest-path={MANIFESTS}",
        "--file-check-frequency=1s",
        "--container-runtime=remote",
        f"--container-runtime-endpoint=unix://{CRI_SOCK}",
        "--runtime-request-timeout=30s",
        "--cgroup-driver=systemd",
        "--fail-swap-on=false",
        f"--read-only-port={READ_ONLY_PORT}",
        "--address=127.0.0.1",
        f"--hostname-override={NODE}",
        "--node-ip=127.0.0.1",
        f"--pod-infra-container-image={PAUSE}",
        "--volume-plugin-dir=/var/lib/kubelet/volume-plugins",
        # the images cannot be pulled again: never garbage-collect them, never evict
        "--image-gc-high-threshold=100",
        "--image-gc-low-threshold=99",
        "--eviction-hard=memory.available<1Ki",
        "--sync-frequency=5s",
        "-v=2",
        *extra,
    ]


def kubelet_unit(k: Kubelet, host_dir: Path, extra_flags: Sequence[str] = ()) -> str:
    """kubelet.service for ``k``; 1.34's configuration file written into ``host_dir``
    (bound at INNER)."""
    flags = kubelet_flags()
    extra = list(extra_flags)
    k.write_config(host_dir / "kubelet-config.json", flags, extra)
    argv = k.argv(flags, extra, f"{INNER}/kubelet-config.json")
    return f"""[Unit]
Description=kubelet {k.version} (standalone, static pods)
After=containerd.service
[Service]
ExecStart={" ".join(argv)}
KillMode=process
"""


def kubelet_binary() -> Path:
    """The cached kubelet 1.20 (scripts/build-kubelet builds it); skip, or fail under CI."""
    from conftest import _missing

    res = subprocess.run([str(BUILD_SCRIPT), "--path"], capture_output=True, text=True)
    path = Path(res.stdout.strip())
    if res.returncode != 0 or not path.is_file():
        _missing(f"no cached kubelet at {path}: run scripts/build-kubelet")
    return path


def kubelet_of(version: str) -> Kubelet:
    """The kubelet of ``version`` ("1.20", "1.34", "1.36"); skip, or fail under CI, without it."""
    if version == "1.20":
        return kubelet(version, {"path": kubelet_binary()})
    return kubelet(version, {})


def api_code(dest: Path) -> Path:
    """The deviceplugin v1beta1 gRPC code, generated from the cached kubelet's tree."""
    return generate(kubelet_binary().parent / "api.proto", dest)


PAUSE_C = r"""
#include <signal.h>
#include <unistd.h>
static void bye(int sig) { (void)sig; _exit(0); }
int main(void) { signal(SIGTERM, bye); signal(SIGINT, bye); for (;;) pause(); }
"""


def pause_binary(host_dir: Path) -> bytes:
    """A static one-process ``/pause`` (as Kubernetes' pause image runs), built with gcc."""
    src = host_dir / "pause.c"
    src.write_text(PAUSE_C)
    out = host_dir / "pause"
    subprocess.run(["gcc", "-static", "-O2", "-o", str(out), str(src)], check=True, timeout=120)
    return out.read_bytes()


def prepare(
    host_dir: Path, api_dir: Path, *, real_pause: bool = False
) -> Tuple[Dict[str, Path], Dict[str, Path]]:
    """Config, base spec, images and tunables in ``host_dir``: (binds, ro_binds).
    ``real_pause``: the sandbox runs one ``/pause`` process (:func:`pause_binary`), as a
    real node's does, where gpuguard tells sandboxes from containers (readmit/alive.py);
    else a busybox shell loop."""
    host_dir.mkdir(parents=True, exist_ok=True)
    (host_dir / "containerd.toml").write_text(CONTAINERD_CONFIG)
    spec = json.loads(
        subprocess.run(["ctr", "oci", "spec"], capture_output=True, text=True, check=True).stdout
    )
    hook_argv = ["python3", str(HOOK_SCRIPT), INVENTORY, f"{LOG}/hook.log"]
    spec["hooks"] = {"prestart": [{"path": "/usr/bin/python3", "args": hook_argv}]}
    (host_dir / "base-spec.json").write_text(json.dumps(spec))
    pause = "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait; done"
    extra = {"pause": pause_binary(host_dir)} if real_pause else {}
    entry = ["/pause"] if real_pause else ["/bin/sh", "-c", pause]
    busybox_image(host_dir / "images.tar", [(BUSYBOX, ["/bin/sh"]), (PAUSE, entry)], extra)
    for name, value in TUNABLES.items():
        p = host_dir / "sysctl" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(value + "\n")
    (host_dir / "kmsg").touch()
    (host_dir / "log").mkdir()
    ro = {INNER: host_dir, API: api_dir, "/dev/kmsg": host_dir / "kmsg"}
    ro |= {f"/proc/sys/{name}": host_dir / "sysctl" / name for name in TUNABLES}
    return {LOG: host_dir / "log"}, ro


@dataclass(frozen=True)
class Container:
    """A pod container as containerd knows it (namespace k8s.io)."""

    id: str
    pod: str  # pod name without the node suffix
    pod_uid: str
    name: str
    env: Dict[str, str]
    status: str  # RUNNING, STOPPED, ... (ctr task ls), "" without a task

    @property
    def scope(self) -> str:
        """Its systemd scope unit (the systemd cgroup driver's name)."""
        return f"cri-containerd-{self.id}.scope"

    @property
    def visible(self) -> str:
        return self.env.get("NVIDIA_VISIBLE_DEVICES", "")


class KubeletNode:
    """Drives the namespace's containerd, kubelet and static pods."""

    def __init__(self, ns: SystemdNamespace, k: Optional[Kubelet] = None) -> None:
        self.ns = ns
        self.kubelet = k or Kubelet("1.20", Path("kubelet"))

    # -- containerd ------------------------------------------------------------------------
    def start_runtime(self) -> None:
        self.ns.systemctl("start", "containerd.service")
        self.ns.wait_active("containerd.service")
        self.ctr("images", "import", f"{INNER}/images.tar")

    def ctr(self, *args: str, check: bool = True, timeout: float = 60) -> str:
        res = self.ns.run(["ctr", "--address", CRI_SOCK, "-n", "k8s.io", *args], timeout=timeout)
        if check and res.returncode != 0:
            raise AssertionError(f"ctr {' '.join(args)}: {res.stderr.strip() or res.stdout}")
        return res.stdout

    def tasks(self) -> Dict[str, str]:
        """container id -> task status."""
        rows = (line.split() for line in self.ctr("tasks", "ls").splitlines()[1:])
        return {r[0]: r[2] for r in rows if len(r) >= 3}

    def containers(self) -> List[Container]:
        """Every pod container (not sandboxes), with its environment and task status."""
        tasks = self.tasks()
        out = []
        for cid in self.ctr("containers", "ls", "-q").split():
            text = self.ctr("containers", "info", cid, check=False)
            if not text:  # removed since the listing (kubelet's garbage collection)
                continue
            info = json.loads(text)
            labels = info.get("Labels") or {}
            if labels.get("io.cri-containerd.kind") != "container":
                continue
            env = info["Spec"]["process"].get("env") or []
            out.append(
                Container(
                    cid,
                    labels["io.kubernetes.pod.name"].removesuffix(f"-{NODE}"),
                    labels["io.kubernetes.pod.uid"],
                    labels["io.kubernetes.container.name"],
                    dict(e.split("=", 1) for e in env if "=" in e),
                    tasks.get(cid, ""),
                )
            )
        return out

    def running(self, pod: str) -> Container:
        """The pod's one running container (AssertionError if none, or several)."""
        found = [c for c in self.containers() if c.pod == pod and c.status == "RUNNING"]
        assert len(found) == 1, f"{pod}: running containers {found}"
        return found[0]

    def devices_cgroup(self, c: Container) -> Path:
        """Host path of the v1 devices cgroup that the container's process is in."""
        systemd = self.ns.cgroup_dir("systemd")
        (scope,) = systemd.glob(f"kubepods.slice/**/{c.scope}")
        pid = (scope / "cgroup.procs").read_text().split()[0]
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _hid, ctrls, path = line.split(":", 2)
            if "devices" in ctrls.split(","):
                return Path("/sys/fs/cgroup/devices") / path.lstrip("/")
        raise AssertionError(f"{c.id[:12]}: no devices cgroup")

    def made_by(self, c: Container) -> str:
        """The OCI runtime whose state the container has: runc keeps ``state.json`` in
        its state directory (containerd's runc root for the k8s.io namespace)."""
        state = self.ns.path(f"{RUNC_ROOT}/{c.id}")
        return "runc" if (state / "state.json").is_file() else f"unknown ({state})"

    def kill_all(self) -> None:
        """Every pod's processes killed, as a power cut would (then containerd again)."""
        for cid, status in self.tasks().items():
            if status == "RUNNING":
                self.ctr("tasks", "kill", "-s", "SIGKILL", cid, check=False)
        deadline = time.monotonic() + 20
        while any(s == "RUNNING" for s in self.tasks().values()):
            assert time.monotonic() < deadline, f"tasks still running: {self.tasks()}"
            time.sleep(0.1)
        self.ns.systemctl("restart", "containerd.service")
        self.ns.wait_active("containerd.service")

    # -- kubelet ---------------------------------------------------------------------------
    def start_kubelet(self) -> float:
        """Start kubelet.service (its ExecStartPre= first); time.monotonic() before it."""
        t0 = time.monotonic()
        self.ns.systemctl("start", "kubelet.service", timeout=60)
        self.ns.wait_active("kubelet.service", timeout=60)
        return t0

    def kubelet_log(self) -> str:
        """What this kubelet.service run has logged so far."""
        inv = self.ns.unit_property("kubelet.service", "InvocationID")
        argv = ["journalctl", "--no-pager", "-o", "cat", f"_SYSTEMD_INVOCATION_ID={inv}"]
        return self.ns.run(argv, timeout=30).stdout

    def registrations(self, resource: str = "nvidia.com/gpu") -> int:
        """How often this kubelet run has had the plugin of ``resource`` register and
        push its devices."""
        return self.kubelet.registrations(self.kubelet_log(), resource)

    def wait_registered(self, more_than: int = 0, timeout: float = 30) -> None:
        """Until this kubelet run has had the GPU plugin register (``more_than`` times
        before). A pod admitted before that gets no device in kubelet 1.20, which then
        allocates at container start, racing other pods into a panic."""
        deadline = time.monotonic() + timeout
        while self.registrations() <= more_than:
            assert time.monotonic() < deadline, f"the GPU plugin never registered:\n{self.log()}"
            time.sleep(0.2)

    def runtime_seen(self) -> str:
        """What this kubelet run says its container runtime is ("containerd 1.7.24~ds1,
        apiVersion v1alpha2"), from its own log line at start-up; "" before it."""
        return self.kubelet.runtime_seen(self.kubelet_log())

    def stop_kubelet(self) -> None:
        self.ns.systemctl("stop", "kubelet.service")

    def write_pod(self, pod: Mapping[str, Any]) -> None:
        d = self.ns.path(MANIFESTS)
        d.mkdir(parents=True, exist_ok=True)
        name = pod["metadata"]["name"]
        tmp = d / f".{name}.tmp"  # a dot file: kubelet ignores it
        tmp.write_text(json.dumps(pod))
        tmp.rename(d / f"{name}.json")

    def pods(self) -> Dict[str, Pod]:
        """Static pods by name (without the node suffix), from kubelet's /pods."""
        script = (
            "import sys,urllib.request as u;"
            f"sys.stdout.write(u.urlopen('http://127.0.0.1:{READ_ONLY_PORT}/pods',timeout=5)"
            ".read().decode())"
        )
        res = self.ns.run(["python3", "-c", script], timeout=15)
        if res.returncode != 0:
            return {}
        out = {}
        for item in json.loads(res.stdout).get("items") or []:
            meta, status = item["metadata"], item.get("status", {})
            name = meta["name"].removesuffix(f"-{NODE}")
            out[name] = Pod(
                name,
                meta["uid"],
                status.get("phase", ""),
                status.get("reason", ""),
                status.get("message", ""),
                {c["name"]: c for c in status.get("containerStatuses") or []},
            )
        return out

    def wait_pods(
        self,
        cond: Callable[[Dict[str, Pod]], bool],
        timeout: float,
        what: str,
        never: Optional[Callable[[Dict[str, Pod]], bool]] = None,
    ) -> Dict[str, Pod]:
        """Poll /pods until ``cond`` holds; fail at once when ``never`` does."""
        deadline = time.monotonic() + timeout
        pods: Dict[str, Pod] = {}
        while time.monotonic() < deadline:
            pods = self.pods()
            if cond(pods):
                return pods
            if never is not None and never(pods):
                raise AssertionError(f"{what}: never, pods are {show(pods)}")
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}: {show(pods)}")

    def log(self, unit: str = "kubelet.service", lines: int = 40) -> str:
        argv = ["journalctl", "--no-pager", "-o", "cat", "-u", unit, "-n", str(lines)]
        return self.ns.run(argv).stdout
