"""deploy/gpuguard-installer against a booted Debian 12 root, as the DaemonSet pod runs it.

The root is the packaging tests' throw-away Debian (integration/pkgroot: a real
systemd as PID 1 of private namespaces, copy-on-write over a cached debootstrap).
The installer runs on the host side exactly as in a pod with hostPID: it reads the
"host" through /proc/PID/root and runs the package manager with
``nsenter -t PID -m -u -i -n -p``, PID being that root's systemd instead of 1.
A kubelet stand-in unit runs in the root; its invocation must never change.
The tests run in file order: refusals on a clean root, then install, a second
run, upgrade, rollback and removal.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

from integration.fleet_node import installed, kubelet, kubelet_starts, package_dir, start_kubelet
from integration.pkgroot import (
    DEBIAN_PATH,
    PackageRoot,
    debian_root,
    require_pkgroot_tools,
    source_version,
)

REPO = Path(__file__).resolve().parents[2]
INSTALLER = REPO / "deploy" / "gpuguard-installer"
UPGRADE_SUFFIX = "+test1"  # as test_package_install: one build per pytest run
HOST_DPKG_STATUS = Path("/var/lib/dpkg/status")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Installer:
    """Runs the entrypoint against ``ns`` as the pod would (ONESHOT: no sleep)."""

    def __init__(self, ns: PackageRoot, status: Path) -> None:
        self.ns = ns
        self.status = status

    def __call__(
        self, mode: str, packages: Path, target_pid: int = 0
    ) -> subprocess.CompletedProcess[str]:
        self.status.unlink(missing_ok=True)
        return subprocess.run(
            ["busybox", "sh", str(INSTALLER), mode],
            env=self.env(target_pid or self.ns.pid, packages),
            capture_output=True,
            text=True,
            timeout=300,
        )

    def env(self, pid: int, packages: Path) -> Dict[str, str]:
        # The default target is 1, the host: a test always names its own root.
        assert pid != 1
        return {
            "PATH": DEBIAN_PATH,
            "LC_ALL": "C.UTF-8",
            "GPUGUARD_INSTALLER_TARGET_PID": str(pid),
            "GPUGUARD_INSTALLER_PACKAGES": str(packages),
            "GPUGUARD_INSTALLER_STATUS": str(self.status),
            "GPUGUARD_INSTALLER_ONESHOT": "1",
        }

    def read_status(self) -> Dict[str, str]:
        rows = (line.split("=", 1) for line in self.status.read_text().splitlines())
        return {k: v for k, v in rows}


def upper_snapshot(ns: PackageRoot) -> Dict[str, Tuple[int, int]]:
    """Every file the root changed so far (overlay upper layer): path -> (mtime_ns, size)."""
    out: Dict[str, Tuple[int, int]] = {}
    for dirpath, _dirs, names in os.walk(ns.upper):
        for name in names:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), ns.upper)] = (
                st.st_mtime_ns,
                st.st_size,
            )
    return out


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, object]]:
    require_pkgroot_tools()
    from conftest import require_tool

    require_tool("busybox", "nsenter")
    lower, _made = debian_root()
    pkgs = tmp_path_factory.mktemp("packages")
    base = package_dir(pkgs, "")
    upgrade = package_dir(pkgs, UPGRADE_SUFFIX)
    host_dpkg = sha256(HOST_DPKG_STATUS) if HOST_DPKG_STATUS.exists() else ""
    ns = PackageRoot(tmp_path_factory.mktemp("pkgroot"), lower)
    ns.start()
    try:
        started = start_kubelet(ns)
        yield {
            "ns": ns,
            "run": Installer(ns, tmp_path_factory.mktemp("status") / "status"),
            "base": base,
            "upgrade": upgrade,
            "kubelet": started,
        }
    finally:
        ns.stop()
        # The installer only ever reached the booted root, never this machine.
        if host_dpkg:
            assert sha256(HOST_DPKG_STATUS) == host_dpkg, "the host's dpkg database changed"


def assert_kubelet_untouched(node: Dict[str, object]) -> None:
    ns: PackageRoot = node["ns"]  # type: ignore[assignment]
    assert kubelet(ns) == node["kubelet"]
    assert kubelet_starts(ns) == 1


def installer_journal(ns: PackageRoot) -> List[str]:
    return [
        str(e.get("MESSAGE"))
        for e in ns.journal()
        if e.get("SYSLOG_IDENTIFIER") == "gpuguard-installer"
    ]


OS_RELEASES = {
    "unknown": ('ID=nixos\nVERSION_ID="24.05"\n', "not a distribution gpuguard is packaged for"),
    "bottlerocket": (
        'NAME=Bottlerocket\nID=bottlerocket\nVERSION_ID="1.20.0"\n',
        "immutable OS",
    ),
    "talos": ('NAME="Talos"\nID=talos\nVERSION_ID=v1.7.0\n', "immutable OS"),
    "flatcar": ("ID=flatcar\nID_LIKE=coreos\nVERSION_ID=3815.2.0\n", "immutable OS"),
    "fedora-coreos": ("ID=fedora\nVARIANT_ID=coreos\nVERSION_ID=40\n", "rpm-ostree"),
}


@pytest.mark.parametrize("kind", sorted(OS_RELEASES))
def test_refuses_a_host_it_cannot_serve(node: Dict[str, object], kind: str) -> None:
    ns: PackageRoot = node["ns"]  # type: ignore[assignment]
    run: Installer = node["run"]  # type: ignore[assignment]
    text, reason = OS_RELEASES[kind]
    osr = ns.path("/etc/os-release")
    link = os.readlink(osr)  # Debian: ../usr/lib/os-release
    osr.unlink()
    osr.write_text(text)
    try:
        before = upper_snapshot(ns)
        res = run("install", node["base"])  # type: ignore[arg-type]
        after = upper_snapshot(ns)
    finally:
        osr.unlink()
        osr.symlink_to(link)
    assert res.returncode == 3, f"{res.returncode}\n{res.stdout}\n{res.stderr}"
    assert reason in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert run.read_status()["state"] == "refused"
    assert after == before, "a refused host was modified"
    assert not list(ns.path("/var/tmp").glob("gpuguard-installer.*"))
    assert "installed" not in installed(ns).split()
    assert_kubelet_untouched(node)


def test_refuses_a_host_without_systemd(node: Dict[str, object]) -> None:
    ns: PackageRoot = node["ns"]  # type: ignore[assignment]
    run: Installer = node["run"]  # type: ignore[assignment]
    # A Debian "host" whose init is not systemd: same files, but its own empty
    # /run (no /run/systemd/system, which exists only while systemd is PID 1).
    p = ns.popen(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount -t tmpfs tmpfs /run && exec sleep 600",
        ]
    )
    target = descendant_named(p.pid, "sleep")
    before = upper_snapshot(ns)
    res = run("install", node["base"], target_pid=target)  # type: ignore[arg-type]
    assert res.returncode == 3, f"{res.returncode}\n{res.stdout}\n{res.stderr}"
    assert "does not run systemd as PID 1" in res.stderr, res.stderr
    assert upper_snapshot(ns) == before
    assert "installed" not in installed(ns).split()


def test_a_failed_install_stays_up_not_ready_and_changes_nothing(
    node: Dict[str, object], tmp_path: Path
) -> None:
    ns: PackageRoot = node["ns"]  # type: ignore[assignment]
    run: Installer = node["run"]  # type: ignore[assignment]
    broken = tmp_path / "broken"
    broken.mkdir()
    for pkg in Path(str(node["base"])).iterdir():
        (broken / pkg.name).write_bytes(pkg.read_bytes()[:4096])  # truncated download
    before = upper_snapshot(ns)
    res = run("install", broken)
    assert res.returncode == 4, f"{res.returncode}\n{res.stdout}\n{res.stderr}"
    assert "the host cannot read the package" in res.stderr, res.stderr
    assert run.read_status()["state"] == "failed"
    assert upper_snapshot(ns) == before
    assert not list(ns.path("/var/tmp").glob("gpuguard-installer.*"))
    # As a pod (no ONESHOT): it does not exit, so Kubernetes cannot re-run the
    # package manager in a restart loop; SIGTERM ends it.
    env = dict(run.env(ns.pid, broken))
    del env["GPUGUARD_INSTALLER_ONESHOT"]
    run.status.unlink(missing_ok=True)
    p = subprocess.Popen(
        ["setpriv", "--pdeathsig", "KILL", "--", "busybox", "sh", str(INSTALLER), "install"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not run.status.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1)
        assert p.poll() is None, "exited after a failed install"
        assert run.read_status()["state"] == "failed"
        p.terminate()
        _out, err = p.communicate(timeout=10)
        assert p.returncode == 0, err
        assert "delete this pod to try again" in err
        # its sleep was sent SIGTERM too: gone within moments, not an orphan
        deadline = time.monotonic() + 10
        while live_in_group(p.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not live_in_group(p.pid), "its sleep outlived it"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert "installed" not in installed(ns).split()
    assert_kubelet_untouched(node)


def live_in_group(pgid: int) -> List[int]:
    """Processes of group ``pgid`` that are not zombies (an orphan is reaped late)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text()
        except (OSError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if d.name.isdigit() and int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d.name))
    return out


def descendant_named(pid: int, comm: str, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        todo = [pid]
        while todo:
            p = todo.pop()
            try:
                if Path(f"/proc/{p}/comm").read_text().strip() == comm:
                    return p
                for task in Path(f"/proc/{p}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split()]
            except FileNotFoundError:
                continue
        time.sleep(0.05)
    raise AssertionError(f"no {comm} under PID {pid}")


def test_installs(node: Dict[str, object]) -> None:
    ns: PackageRoot = node["ns"]  # type: ignore[assignment]
    run: Installer = node["run"]  # type: ignore[assignment]
    version = f"{source_version()}-1"
    res = run("install", node["base"])  # type: ignore[arg-type]
    assert res.returncode == 0, f"{res.returncode}\n{res.stdout}\n{res.stderr}"
    status = run.read_status()
    assert (status["state"], status["action"], status["version"]) == ("ok", "installed", version)
    assert status["host"] == "debian 12"
    assert installed(ns) == f"install ok installed {version}"
    ns.wait_active("gpuguard.service", timeout=20)
    assert not list(ns.path("/var/tmp").glob("gpuguard-installer.*"))
    assert any(
        m.startswith(f"installed gpuguard {version} (was: none)") for m in installer_journal(ns)
    )
    assert_kubelet_untouched(node)


def test_second_run_changes_nothing(node: Dict[str, object]) -> None:
    ns: PackageRoot = node["ns"]  # type: ignore[assignment]
    run: Installer = node["run"]  # type: ignore[assignment]
    daemon = ns.unit_property("gpuguard.service", "InvocationID")
    dpkg_status = sha256(ns.path("/var/lib/dpkg/status"))
    journal_before = installer_journal(ns)
    res = run("install", node["base"])  # type: ignore[arg-type]
    assert res.returncode == 0, f"{res.returncode}\n{res.stdout}\n{res.stderr}"
    assert run.read_status()["action"] == "unchanged"
    assert "already installed" in res.stdout
    assert sha256(ns.path("/var/lib/dpkg/status")) == dpkg_status
    assert ns.unit_property("gpuguard.service", "InvocationID") == daemon
    assert installer_journal(ns) == journal_before
    assert not list(ns.path("/var/tmp").glob("gpuguard-installer.*"))
    assert_kubelet_untouched(node)


def test_upgrades_and_keeps_edited_config(node: Dict[str, object]) -> None:
    ns: PackageRoot = node["ns"]  # type: ignore[assignment]
    run: Installer = node["run"]  # type: ignore[assignment]
    conf = ns.path("/etc/gpuguard/gpuguard.conf")
    edited = "# edited by the operator\n[Kubelet]\nBackupKeep=7\n"
    conf.write_text(edited)
    daemon = ns.unit_property("gpuguard.service", "InvocationID")
    new = f"{source_version(UPGRADE_SUFFIX)}-1"
    res = run("install", node["upgrade"])  # type: ignore[arg-type]
    assert res.returncode == 0, f"{res.returncode}\n{res.stdout}\n{res.stderr}"
    status = run.read_status()
    assert (status["action"], status["version"]) == ("updated", new)
    assert installed(ns) == f"install ok installed {new}"
    assert conf.read_text() == edited
    ns.wait_active("gpuguard.service", timeout=20)
    assert ns.unit_property("gpuguard.service", "InvocationID") != daemon
    assert_kubelet_untouched(node)


def test_rolls_back_to_the_image_version(node: Dict[str, object]) -> None:
    ns: PackageRoot = node["ns"]  # type: ignore[assignment]
    run: Installer = node["run"]  # type: ignore[assignment]
    old = f"{source_version()}-1"
    res = run("install", node["base"])  # type: ignore[arg-type]
    assert res.returncode == 0, f"{res.returncode}\n{res.stdout}\n{res.stderr}"
    assert (run.read_status()["action"], installed(ns)) == (
        "updated",
        f"install ok installed {old}",
    )
    assert_kubelet_untouched(node)


def pod(run: Installer, packages: Path, **env: str) -> subprocess.Popen[str]:
    """The entrypoint as the pod runs it (no ONESHOT), looking at the daemon every second."""
    e = dict(run.env(run.ns.pid, packages))
    del e["GPUGUARD_INSTALLER_ONESHOT"]
    e.update(GPUGUARD_INSTALLER_WATCH="1", **env)
    run.status.unlink(missing_ok=True)
    return subprocess.Popen(
        ["setpriv", "--pdeathsig", "KILL", "--", "busybox", "sh", str(INSTALLER), "install"],
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_state(run: Installer, state: str, timeout: float = 60.0) -> Dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if run.status.exists() and run.read_status().get("state") == state:
            return run.read_status()
        time.sleep(0.2)
    raise AssertionError(
        f"status never {state}: {run.read_status() if run.status.exists() else '-'}"
    )


def test_a_broken_upgrade_stays_not_ready_with_the_reason(node: Dict[str, object]) -> None:
    """A drop-in the new version refuses: the upgrade does not restart the running
    daemon (postinst checks first), and the pod stays not Ready naming the file and
    line, without running the package manager again; fixed, it turns Ready."""
    ns: PackageRoot = node["ns"]  # type: ignore[assignment]
    run: Installer = node["run"]  # type: ignore[assignment]
    ns.wait_active("gpuguard.service", timeout=20)
    daemon = ns.unit_property("gpuguard.service", "InvocationID")
    broken = ns.path("/etc/gpuguard/gpuguard.conf.d/50-broken.conf")
    broken.write_text("[Daemon]\nMode=fix-everything\n")
    try:
        res = run("install", node["upgrade"])  # type: ignore[arg-type]
        assert res.returncode == 5, f"{res.returncode}\n{res.stdout}\n{res.stderr}"
        assert "refreshing the host's package index (apt-get update)" in res.stdout
        assert "NOT restarted after the upgrade" in res.stdout + res.stderr
        status = run.read_status()
        assert (status["state"], status["action"], status["daemon"]) == (
            "not-ready",
            "updated",
            "config-invalid",
        )
        assert "/etc/gpuguard/gpuguard.conf.d/50-broken.conf:2: " in status["message"]
        # the previous daemon still runs (not restarted into a failure)
        assert ns.unit_property("gpuguard.service", "InvocationID") == daemon
        assert ns.unit_property("gpuguard.service", "ActiveState") == "active"
        dpkg_status = sha256(ns.path("/var/lib/dpkg/status"))
        p = pod(run, node["upgrade"])  # type: ignore[arg-type]
        try:
            status = wait_state(run, "not-ready")
            time.sleep(3)  # three more looks: still up, still not Ready, nothing re-run
            assert p.poll() is None and run.read_status()["state"] == "not-ready"
            assert sha256(ns.path("/var/lib/dpkg/status")) == dpkg_status
            broken.unlink()
            ns.systemctl("restart", "gpuguard.service")
            status = wait_state(run, "ok")
            assert status["daemon"] == "active"
            p.terminate()
            _out, err = p.communicate(timeout=10)
            assert p.returncode == 0, err
            assert err.count("not ready: the configuration is invalid") == 1, err
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    finally:
        broken.unlink(missing_ok=True)
    assert any("not ready: the configuration is invalid" in m for m in installer_journal(ns))
    assert any(m.startswith("ready again: ") for m in installer_journal(ns))
    assert_kubelet_untouched(node)


def test_a_failed_daemon_is_not_ready_and_an_off_switch_is(node: Dict[str, object]) -> None:
    ns: PackageRoot = node["ns"]  # type: ignore[assignment]
    run: Installer = node["run"]  # type: ignore[assignment]
    ns.systemctl("kill", "-s", "KILL", "gpuguard.service")  # a crash ...
    ns.systemctl("stop", "gpuguard.service")  # ... that is not restarted
    res = run("install", node["upgrade"])  # type: ignore[arg-type]
    assert res.returncode == 5, f"{res.returncode}\n{res.stdout}\n{res.stderr}"
    status = run.read_status()
    # killed, then stopped before its restart: failed or inactive, as systemd saw it
    assert status["state"] == "not-ready" and status["daemon"] in ("failed", "inactive"), status
    assert f"gpuguard.service is {status['daemon']} (result: " in status["message"]
    res = ns.run(["gpuguard", "disable", "--reason", "INC-7"])
    assert res.returncode == 0, res.stderr
    res = run("install", node["upgrade"])  # type: ignore[arg-type]
    assert res.returncode == 0, f"{res.returncode}\n{res.stdout}\n{res.stderr}"
    status = run.read_status()
    assert (status["state"], status["daemon"]) == ("ok", "off"), status
    assert "turned off with gpuguard disable: INC-7" in status["message"]
    assert ns.run(["gpuguard", "enable"]).returncode == 0
    ns.wait_active("gpuguard.service", timeout=20)
    assert_kubelet_untouched(node)


def test_uninstall_removes_the_package(node: Dict[str, object]) -> None:
    ns: PackageRoot = node["ns"]  # type: ignore[assignment]
    run: Installer = node["run"]  # type: ignore[assignment]
    res = run("uninstall", node["base"])  # type: ignore[arg-type]
    assert res.returncode == 0, f"{res.returncode}\n{res.stdout}\n{res.stderr}"
    assert run.read_status()["action"] == "removed"
    # remove, not purge: the operator's configuration stays, like apt-get remove.
    assert installed(ns).startswith("deinstall ok config-files")
    assert ns.unit_property("gpuguard.service", "LoadState") == "not-found"
    assert ns.path("/etc/gpuguard/gpuguard.conf").exists()
    res = run("uninstall", node["base"])  # type: ignore[arg-type]
    assert res.returncode == 0 and run.read_status()["action"] == "unchanged", res.stdout
    assert_kubelet_untouched(node)


def test_a_missing_dependency_is_named(node: Dict[str, object]) -> None:
    """A host whose repositories lack a dependency: the index refresh fails (no
    network here) and is said, the install fails naming what is missing, and the node
    keeps what it had."""
    ns: PackageRoot = node["ns"]  # type: ignore[assignment]
    run: Installer = node["run"]  # type: ignore[assignment]
    ns.run(["dpkg", "--purge", "python3-pyudev"], check=True)
    # the host's repositories know no python3-pyudev: empty lists over its own
    ns.run(["mount", "-t", "tmpfs", "tmpfs", "/var/lib/apt/lists"], check=True)
    try:
        ns.run(["mkdir", "/var/lib/apt/lists/partial"], check=True)
        res = run("install", node["base"])  # type: ignore[arg-type]
    finally:
        ns.run(["umount", "/var/lib/apt/lists"], check=True)
    assert res.returncode == 4, f"{res.returncode}\n{res.stdout}\n{res.stderr}"
    assert "the package index could not be refreshed" in res.stderr
    status = run.read_status()
    assert status["state"] == "failed"
    assert "missing dependencies: python3-pyudev" in status["message"], status
    assert "installed" not in installed(ns).split()
    assert_kubelet_untouched(node)
