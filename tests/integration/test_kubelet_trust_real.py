"""The trust rule (devices/kubelettrust.py) on a real kernel's /proc: a process named
kubelet running a root-owned /usr/local/bin/kubelet is trusted, even from another mount
namespace where only it sees that file (as with a containerised kubelet, or the
daemon's ProtectHome=); run by `nobody`, or from a binary `nobody` owns, it is not.
Each kubelet is a copy of sleep on a tmpfs mounted over /usr/local/bin in a private
mount namespace (unshare -m): the host's /usr/local/bin is never touched, and every
process is killed by its PID."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from conftest import require_root, require_tool
from gpuguard.devices.kubeletproc import KubeletProcess
from gpuguard.devices.kubelettrust import exe_why, process_why
from gpuguard.host.paths import Root

pytestmark = pytest.mark.root
NOBODY = 65534
SETUP = (
    "mount --make-rprivate / && mount -t tmpfs -o mode=0755 tmpfs /usr/local/bin && "
    "cp /bin/sleep /usr/local/bin/kubelet && chmod 0755 /usr/local/bin/kubelet && {chown}"
    "exec {run} /usr/local/bin/kubelet 300"
)


def _kubelet(*, as_nobody: bool = False, owned_by_nobody: bool = False) -> subprocess.Popen[bytes]:
    require_root()
    require_tool("unshare", "setpriv", "mount")
    run = f"setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups" if as_nobody else ""
    chown = f"chown {NOBODY} /usr/local/bin/kubelet && " if owned_by_nobody else ""
    script = SETUP.format(run=run, chown=chown)
    p = subprocess.Popen(["unshare", "-m", "sh", "-c", script])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{p.pid}/comm").read_text().strip() == "kubelet":
                return p
        except OSError:
            pass
        assert p.poll() is None, "the kubelet stand-in did not start"
        time.sleep(0.02)
    p.kill()
    raise AssertionError("the kubelet stand-in never ran")


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    made: list[subprocess.Popen[bytes]] = []
    yield made
    for p in made:
        p.kill()
        p.wait(timeout=10)


def _why(pid: int) -> str:
    p = KubeletProcess(pid, "kubelet", ("kubelet",), "kubelet.service")
    return process_why(Root(), p, ("kubelet.service",))


def test_a_root_kubelet_from_an_install_path_is_trusted_across_namespaces(
    procs: list[subprocess.Popen[bytes]],
) -> None:
    p = _kubelet()
    procs.append(p)
    assert exe_why(Root(), p.pid) == "" and _why(p.pid) == ""
    if not Path("/usr/local/bin/kubelet").exists():  # only its namespace has the file
        assert Path(f"/proc/{p.pid}/root/usr/local/bin/kubelet").is_file()


def test_nobody_running_it_is_refused(procs: list[subprocess.Popen[bytes]]) -> None:
    p = _kubelet(as_nobody=True)
    procs.append(p)
    assert _why(p.pid) == f"it runs as uid {NOBODY}, not root"


def test_a_binary_nobody_owns_is_refused(procs: list[subprocess.Popen[bytes]]) -> None:
    p = _kubelet(owned_by_nobody=True)
    procs.append(p)
    why = exe_why(Root(), p.pid)
    assert why == f"its executable /usr/local/bin/kubelet is owned by uid {NOBODY}, not root"


def test_doctor_reads_no_plugin_settings_from_a_users_process(
    procs: list[subprocess.Popen[bytes]],
) -> None:
    """A process `nobody` names nvidia-device-plugin, claiming --pass-device-specs, is
    not the plugin: doctor would call the node safe from F2 on its word."""
    from gpuguard.doctor.facts import read_plugins

    require_tool("setpriv")
    argv = ["--pass-device-specs=true", "--device-list-strategy=cdi-cri"]
    script = (
        "mount -t tmpfs -o mode=0755 tmpfs /usr/local/bin && "
        "cp -L /usr/bin/python3 /usr/local/bin/nvidia-device-plugin && exec {run} "
        "/usr/local/bin/nvidia-device-plugin -c 'import time; time.sleep(300)' " + " ".join(argv)
    )
    found = {}
    for who, run in (("nobody", f"setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups"),
                     ("root", "")):  # fmt: skip
        p = subprocess.Popen(["unshare", "-m", "sh", "-c", script.format(run=run)])
        procs.append(p)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and p.poll() is None:
            try:
                if Path(f"/proc/{p.pid}/comm").read_text().strip() == "nvidia-device-p":
                    break
            except OSError:
                pass
            time.sleep(0.02)
        assert p.poll() is None, f"the {who} stand-in exited"
        found[who] = p.pid
    plugins = {s.pid for s in read_plugins(Root()) or ()}
    assert found["nobody"] not in plugins and found["root"] in plugins


def test_a_users_kubelet_is_no_running_kubelet(procs: list[subprocess.Popen[bytes]]) -> None:
    """kubelet_pids, which makes a repair wait for kubelet (the pre-start hook refuses
    while one runs; `check` will not write under a kubelet outside systemd): a user's
    process named kubelet is none."""
    from gpuguard.devices.processes import kubelet_pids

    mine = _kubelet(as_nobody=True)
    procs.append(mine)
    root_one = _kubelet()
    procs.append(root_one)
    pids = kubelet_pids(Root())
    assert mine.pid not in pids and root_one.pid in pids
