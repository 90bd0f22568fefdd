"""deploy/build-image builds the installer image with buildah (FROM scratch, no
registry), and the image itself installs gpuguard on a booted Debian root.

buildah keeps its storage in the test's directory (--root/--runroot, vfs), never
in the host's /var/lib/containers. The image's root filesystem is then run the
way a pod with hostPID runs it: its own (read-only) mount namespace, sharing the
pid namespace of the "node" (integration/pkgroot), so the entrypoint's default
target, PID 1, is that node's systemd, and the readiness probe of
deploy/daemonset.yaml is run in it against the status file on an emptyDir.
Last, the image runs under a private containerd + runc with the OCI spec that
deploy/daemonset.yaml's container gets (privileged, read-only root, the node's
pid namespace, the emptyDir): it installs, stays up Ready, and ends on SIGTERM.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from pathlib import Path
from typing import Dict, Iterator, List, Set

import pytest
import yaml

from integration.fleet_node import installed, kubelet, kubelet_starts, start_kubelet
from integration.harness.containerd import PrivateContainerd
from integration.installer_images import Buildah, build_image
from integration.pkgroot import (
    DEBIAN_PATH,
    PackageRoot,
    built_packages,
    debian_root,
    require_pkgroot_tools,
    source_version,
)

REPO = Path(__file__).resolve().parents[2]
HOST_CONTAINERS = Path("/var/lib/containers")


def tree(path: Path) -> Set[str]:
    return {str(p) for p in path.rglob("*")} if path.exists() else set()


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, object]]:
    require_pkgroot_tools()
    from conftest import require_tool

    require_tool("buildah", "busybox", "chroot")
    host_containers = tree(HOST_CONTAINERS)
    tmp = tmp_path_factory.mktemp("image")
    buildah = Buildah(tmp)
    pkgs = built_packages("")
    tag = build_image(buildah, pkgs)
    container = buildah("from", tag)
    try:
        yield {
            "buildah": buildah,
            "tag": tag,
            "rootfs": Path(buildah("mount", container)),
            "packages": pkgs,
        }
    finally:
        buildah("umount", container)
        buildah("rm", container)
        assert tree(HOST_CONTAINERS) == host_containers, "buildah wrote to /var/lib/containers"


def test_image_carries_both_packages_and_the_entrypoint(image: Dict[str, object]) -> None:
    buildah: Buildah = image["buildah"]  # type: ignore[assignment]
    rootfs: Path = image["rootfs"]  # type: ignore[assignment]
    pkgs: Dict[str, Path] = image["packages"]  # type: ignore[assignment]
    carried = sorted((rootfs / "usr/share/gpuguard-installer").iterdir())
    assert [p.name for p in carried] == sorted(p.name for p in pkgs.values())
    for p in carried:
        assert p.read_bytes() == (pkgs["deb" if p.suffix == ".deb" else "rpm"]).read_bytes()
    entry = rootfs / "usr/local/bin/gpuguard-installer"
    assert entry.read_bytes() == (REPO / "deploy/gpuguard-installer").read_bytes()
    fmt = "{{.OCIv1.Config.Entrypoint}} {{.OCIv1.Config.Cmd}}"
    config = buildah("inspect", "--type", "image", "--format", fmt, str(image["tag"]))
    assert config == "[/bin/sh /usr/local/bin/gpuguard-installer] [install]"
    # Everything the entrypoint and the probe call inside the container exists.
    for tool in ("sh", "nsenter", "sed", "tr", "tail", "mkdir", "mv", "basename", "sleep", "grep"):
        assert os.access(rootfs / "bin" / tool, os.X_OK), tool


def pod(
    ns: PackageRoot, rootfs: Path, status_dir: Path, argv: List[str]
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in the image as a hostPID pod on node ``ns`` would run it."""
    script = (
        "set -e; R=$1; S=$2; shift 2; "
        'mount --bind "$R" "$R"; mount -o remount,bind,ro "$R"; '
        'mount -t proc proc "$R/proc"; '
        'mount -t tmpfs -o mode=755 tmpfs "$R/dev"; mknod -m 666 "$R/dev/null" c 1 3; '
        'mkdir -p "$S"; mount -t tmpfs tmpfs "$R/run"; mkdir "$R/run/gpuguard-installer"; '
        'mount --bind "$S" "$R/run/gpuguard-installer"; '
        'exec chroot "$R" /bin/env -i PATH=/bin GPUGUARD_INSTALLER_ONESHOT=1 "$@"'
    )
    # The pod's mount namespace is private; its pid namespace is the node's.
    argv = [
        "setpriv", "--pdeathsig", "KILL", "--",
        "nsenter", "-t", str(ns.pid), "-p", "--",
        "unshare", "-m", "--propagation", "private", "--",
        "sh", "-c", script, "sh", str(rootfs), str(status_dir), *argv,
    ]  # fmt: skip
    return subprocess.run(
        argv, env={"PATH": DEBIAN_PATH}, capture_output=True, text=True, timeout=300
    )


@pytest.fixture()
def node(tmp_path: Path) -> Iterator[PackageRoot]:
    lower, _made = debian_root()
    ns = PackageRoot(tmp_path / "pkgroot", lower)
    ns.start()
    try:
        yield ns
    finally:
        ns.stop()


def test_image_installs_on_a_node_and_becomes_ready(
    image: Dict[str, object], node: PackageRoot, tmp_path: Path
) -> None:
    rootfs: Path = image["rootfs"]  # type: ignore[assignment]
    ds = yaml.safe_load((REPO / "deploy/daemonset.yaml").read_text())
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    probe = container["readinessProbe"]["exec"]["command"]
    entry = ["/bin/sh", "/usr/local/bin/gpuguard-installer"]
    started = start_kubelet(node)
    status = tmp_path / "emptydir"

    res = pod(node, rootfs, status, probe)
    # grep: 1 no match, 2 no file (127 would be a broken image)
    assert res.returncode in (1, 2), f"ready before anything was installed: {res}"

    res = pod(node, rootfs, status, [*entry, *container["args"]])
    assert res.returncode == 0, f"{res.returncode}\n{res.stdout}\n{res.stderr}"
    version = f"{source_version()}-1"
    assert f"installing gpuguard {version} with apt-get" in res.stdout, res.stdout
    assert installed(node) == f"install ok installed {version}"
    node.wait_active("gpuguard.service", timeout=20)
    res = pod(node, rootfs, status, probe)
    assert res.returncode == 0, f"not ready: {shlex.join(probe)}\n{res.stderr}"
    assert "action=installed" in (status / "status").read_text()

    # The uninstall DaemonSet's pod: same image, argument "uninstall".
    res = pod(node, rootfs, status, [*entry, "uninstall"])
    assert res.returncode == 0, f"{res.returncode}\n{res.stdout}\n{res.stderr}"
    assert installed(node).startswith("deinstall ok config-files")
    assert pod(node, rootfs, status, probe).returncode == 0
    assert kubelet(node) == started and kubelet_starts(node) == 1


#: Capabilities by number; a privileged container gets all its runtime may give.
CAPS = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID",
    "CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE", "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW",
    "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
    "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN", "CAP_SYSLOG", "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ",
    "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE",
]  # fmt: skip


def bounding_set() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapBnd:"):
            return int(line.split()[1], 16)
    raise AssertionError("no CapBnd in /proc/self/status")


def pod_spec(cd: PrivateContainerd, rootfs: Path, node: PackageRoot, emptydir: Path) -> Path:
    """The OCI spec of deploy/daemonset.yaml's container, as kubelet + runc would make it."""
    ds = yaml.safe_load((REPO / "deploy/daemonset.yaml").read_text())
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["hostPID"] and c["securityContext"]["privileged"]
    spec = cd.base_spec()
    spec["root"] = {"path": str(rootfs), "readonly": c["securityContext"]["readOnlyRootFilesystem"]}
    spec["process"].update(
        args=["/bin/sh", "/usr/local/bin/gpuguard-installer", *c["args"]],
        terminal=False,
        env=["PATH=/bin"],
    )
    caps = [name for bit, name in enumerate(CAPS) if bounding_set() >> bit & 1]
    spec["process"]["capabilities"] = {k: caps for k in ("bounding", "effective", "permitted")}
    linux = spec["linux"]
    # hostPID: the pod shares the node's pid namespace (here the booted root's).
    for ns in linux["namespaces"]:
        if ns["type"] == "pid":
            ns["path"] = f"/proc/{node.pid}/ns/pid"
    linux.pop("maskedPaths", None)
    linux.pop("readonlyPaths", None)
    linux.pop("seccomp", None)
    linux["resources"] = {"devices": [{"allow": True, "access": "rwm"}]}
    linux["cgroupsPath"] = cd.cgroup_path("installer", "gpuguard-installer")
    (mount,) = c["volumeMounts"]
    spec["mounts"].append(
        {
            "destination": mount["mountPath"],
            "type": "bind",
            "source": str(emptydir),
            "options": ["rbind", "rw"],
        }
    )
    path = cd.work / "installer-spec.json"
    path.write_text(json.dumps(spec))
    return path


def test_image_runs_under_runc_as_the_daemonset_pod(
    image: Dict[str, object], node: PackageRoot, tmp_path: Path
) -> None:
    from conftest import require_tool

    require_tool("containerd", "ctr", "runc")
    rootfs: Path = image["rootfs"]  # type: ignore[assignment]
    started = start_kubelet(node)
    emptydir = tmp_path / "emptydir"
    emptydir.mkdir()
    status = emptydir / "status"
    cid = "gpuguard-installer"
    with PrivateContainerd() as cd:
        spec = pod_spec(cd, rootfs, node, emptydir)
        cd.containers.append(cid)
        cd.ctr("run", "-d", "--null-io", "--config", str(spec), cid)
        deadline = time.monotonic() + 240
        while not status.exists() and time.monotonic() < deadline:
            assert cd.task_status(cid) == "RUNNING", cd.log_tail()
            time.sleep(0.2)
        fields = dict(line.split("=", 1) for line in status.read_text().splitlines())
        assert (fields["state"], fields["action"]) == ("ok", "installed"), fields
        # Installed and sleeping: the pod stays up and its readiness probe passes.
        time.sleep(0.5)
        assert cd.task_status(cid) == "RUNNING"
        ds = yaml.safe_load((REPO / "deploy/daemonset.yaml").read_text())
        probe = ds["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]
        cd.ctr("task", "exec", "--exec-id", "probe", cid, *probe["command"])
        # Kubernetes stops the pod with SIGTERM: it ends at once, with status 0.
        cd.ctr("task", "kill", "-s", "SIGTERM", cid)
        deadline = time.monotonic() + 10
        while cd.task_status(cid) == "RUNNING" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cd.task_status(cid) == "STOPPED"
    assert installed(node) == f"install ok installed {source_version()}-1"
    node.wait_active("gpuguard.service", timeout=20)
    # The daemon runs under the node's systemd, not in the pod's cgroup.
    cgroup = node.unit_property("gpuguard.service", "ControlGroup")
    assert cgroup == "/system.slice/gpuguard.service", cgroup
    assert kubelet(node) == started and kubelet_starts(node) == 1
