"""deploy/gpuguard-installer's host detection, as a table of host roots.

`gpuguard-installer detect` only reads the host (GPUGUARD_INSTALLER_HOST_ROOT
points at a fake one here) and says how it would be served; refusals exit 3 with
one line naming the reason and write state=refused for the readiness probe. The
installs themselves are proven in integration/test_fleet_installer.py. Run with
the image's shell (busybox) and with dash, so the script stays POSIX.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTALLER = REPO / "deploy" / "gpuguard-installer"

DEB = ("apt-get",)
RPM_DNF = ("dnf",)

#: name -> (os-release, package managers present, expected line or refusal reason)
SERVED = {
    "debian 12": ('ID=debian\nVERSION_ID="12"\n', DEB, "host debian 12: deb packages with apt-get"),
    "ubuntu 22.04": (
        'ID=ubuntu\nID_LIKE=debian\nVERSION_ID="22.04"\n',
        DEB,
        "host ubuntu 22.04: deb packages with apt-get",
    ),
    "pop (ID_LIKE)": (
        'ID=pop\nID_LIKE="ubuntu debian"\nVERSION_ID="22.04"\n',
        DEB,
        "host pop 22.04: deb packages with apt-get",
    ),
    "rocky 9": (
        'ID="rocky"\nID_LIKE="rhel centos fedora"\nVERSION_ID="9.3"\n',
        RPM_DNF,
        "host rocky 9.3: rpm packages with dnf",
    ),
    "rhel 9": ('ID="rhel"\nID_LIKE="fedora"\nVERSION_ID="9.4"\n', RPM_DNF, "host rhel 9.4"),
    "almalinux": ('ID="almalinux"\nVERSION_ID="9.4"\n', RPM_DNF, "rpm packages with dnf"),
    "centos": ('ID="centos"\nVERSION_ID="9"\n', RPM_DNF, "rpm packages with dnf"),
    "fedora": ("ID=fedora\nVERSION_ID=40\n", RPM_DNF, "host fedora 40: rpm packages with dnf"),
    "amazon linux 2 (yum only)": (
        'ID="amzn"\nID_LIKE="centos rhel fedora"\nVERSION_ID="2"\n',
        ("yum",),
        "host amzn 2: rpm packages with yum",
    ),
    "amazon linux 2023": (
        'ID="amzn"\nID_LIKE="fedora"\nVERSION_ID="2023"\n',
        ("dnf", "yum"),
        "host amzn 2023: rpm packages with dnf",
    ),
    "oracle (ID_LIKE fedora)": ('ID="ol"\nID_LIKE="fedora"\n', RPM_DNF, "rpm packages with dnf"),
}

REFUSED = {
    "bottlerocket": ("ID=bottlerocket\nVERSION_ID=1.20.0\n", (), "immutable OS"),
    "talos": ("ID=talos\nVERSION_ID=v1.7.0\n", (), "immutable OS"),
    "flatcar": ("ID=flatcar\nID_LIKE=coreos\n", (), "immutable OS"),
    "rhcos": ('ID="rhcos"\nID_LIKE="rhel fedora"\n', RPM_DNF, "immutable OS"),
    "fedora coreos": ("ID=fedora\nVARIANT_ID=coreos\n", RPM_DNF, "rpm-ostree"),
    "container-optimized os": ("ID=cos\n", (), "immutable OS"),
    "unknown": ("ID=nixos\n", (), "not a distribution gpuguard is packaged for"),
    "arch": ("ID=arch\n", (), "not a distribution gpuguard is packaged for"),
    "debian without apt-get": ("ID=debian\n", (), "has no /usr/bin/apt-get"),
    "rhel without dnf or yum": ('ID="rhel"\n', (), "has neither dnf nor yum"),
}


def shells() -> List[Any]:
    return [pytest.param(["/bin/sh"], id="dash"), pytest.param(["busybox", "sh"], id="busybox")]


def host_root(
    tmp_path: Path,
    os_release: Optional[str],
    managers: Tuple[str, ...],
    systemd: bool = True,
    ostree: bool = False,
) -> Path:
    root = tmp_path / "host"
    (root / "etc").mkdir(parents=True)
    (root / "usr/bin").mkdir(parents=True)
    if os_release is not None:
        (root / "usr/lib").mkdir()
        (root / "usr/lib/os-release").write_text(os_release)
        (root / "etc/os-release").symlink_to("../usr/lib/os-release")
    for m in managers:
        (root / "usr/bin" / m).write_text("#!/bin/sh\nexit 99\n")
        (root / "usr/bin" / m).chmod(0o755)
    if systemd:
        (root / "run/systemd/system").mkdir(parents=True)
    if ostree:
        (root / "run").mkdir(exist_ok=True)
        (root / "run/ostree-booted").touch()
    return root


def detect(
    shell: List[str],
    tmp_path: Path,
    root: Path,
    mode: str = "detect",
) -> Tuple[subprocess.CompletedProcess[str], Dict[str, str]]:
    if shell[0] == "busybox":
        from conftest import require_tool

        require_tool("busybox")
    status = tmp_path / "status"
    env = {
        "PATH": "/usr/bin:/bin",
        "GPUGUARD_INSTALLER_HOST_ROOT": str(root),
        # A PID that no process has: anything reaching nsenter fails loudly.
        "GPUGUARD_INSTALLER_TARGET_PID": "2147483647",
        "GPUGUARD_INSTALLER_STATUS": str(status),
        "GPUGUARD_INSTALLER_ONESHOT": "1",
    }
    res = subprocess.run(
        [*shell, str(INSTALLER), mode], env=env, capture_output=True, text=True, timeout=30
    )
    fields: Dict[str, str] = {}
    if status.exists():
        fields = dict(line.split("=", 1) for line in status.read_text().splitlines())
    return res, fields


@pytest.mark.parametrize("shell", shells())
@pytest.mark.parametrize("name", sorted(SERVED))
def test_served_hosts(shell: List[str], name: str, tmp_path: Path) -> None:
    text, managers, line = SERVED[name]
    res, status = detect(shell, tmp_path, host_root(tmp_path, text, managers))
    assert res.returncode == 0, res.stderr
    assert line in res.stdout, res.stdout
    assert not status  # detect records nothing


@pytest.mark.parametrize("shell", shells())
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_hosts(shell: List[str], name: str, tmp_path: Path) -> None:
    text, managers, reason = REFUSED[name]
    for mode in ("detect", "install", "uninstall"):
        res, status = detect(shell, tmp_path, host_root(tmp_path / mode, text, managers), mode)
        assert res.returncode == 3, (mode, res.returncode, res.stdout, res.stderr)
        (line,) = res.stderr.splitlines()
        assert line.startswith("gpuguard-installer: ") and reason in line, line
        assert (status["state"], status["action"]) == ("refused", "none")
        assert status["message"] in line


@pytest.mark.parametrize("shell", shells())
def test_refuses_without_systemd_as_pid1(shell: List[str], tmp_path: Path) -> None:
    root = host_root(tmp_path, "ID=debian\nVERSION_ID=12\n", DEB, systemd=False)
    res, status = detect(shell, tmp_path, root, "install")
    assert res.returncode == 3
    assert "does not run systemd as PID 1" in res.stderr
    assert status["state"] == "refused"


@pytest.mark.parametrize("shell", shells())
def test_refuses_an_ostree_host_whatever_its_id(shell: List[str], tmp_path: Path) -> None:
    root = host_root(tmp_path, 'ID="rhel"\nVERSION_ID="9.4"\n', RPM_DNF, ostree=True)
    res, _status = detect(shell, tmp_path, root, "install")
    assert res.returncode == 3 and "rpm-ostree" in res.stderr, res.stderr


@pytest.mark.parametrize("shell", shells())
def test_refuses_without_os_release_or_host_view(shell: List[str], tmp_path: Path) -> None:
    res, _ = detect(shell, tmp_path, host_root(tmp_path, None, DEB))
    assert res.returncode == 3 and "no /etc/os-release on the host" in res.stderr, res.stderr
    res, _ = detect(shell, tmp_path, tmp_path / "absent")
    assert res.returncode == 3 and "run with hostPID: true" in res.stderr, res.stderr


@pytest.mark.parametrize("shell", shells())
def test_bad_usage(shell: List[str], tmp_path: Path) -> None:
    res, status = detect(shell, tmp_path, tmp_path, "reinstall")
    assert res.returncode == 2 and res.stderr.startswith("usage: gpuguard-installer"), res.stderr
    assert not status


#: os-release texts that are data, never shell: each is refused (exit 3), in one line of
#: a few hundred bytes at most, whatever it holds (issue 28).
HOSTILE = {
    "glob in ID": ("ID=*\nVERSION_ID=12\n", "not an os-release ID"),
    "two words in ID": ('ID="evilos debian"\nVERSION_ID=12\n', "not an os-release ID"),
    "command in ID": ("ID=$(touch /tmp/pwned)\n", "not an os-release ID"),
    "backquotes in ID": ("ID=`id`\n", "not an os-release ID"),
    "huge ID": ("ID=" + "a" * 200_000 + "\n", "not an os-release ID"),
    "control characters": ("ID=deb\x1b[31mian\x07\n", "not an os-release ID"),
    "glob in ID_LIKE only": ("ID=evilos\nID_LIKE=*\n", "not a distribution gpuguard is packaged"),
    "debian hidden in a glob": ("ID=evilos\nID_LIKE=deb*\n", "not a distribution gpuguard"),
    "empty": ("", "not an os-release ID"),
}


@pytest.mark.parametrize("shell", shells())
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_os_release_is_parsed_as_data(shell: List[str], name: str, tmp_path: Path) -> None:
    text, reason = HOSTILE[name]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "debian").write_text("a file named debian, where a glob would find it\n")
    root = host_root(tmp_path, text, DEB)
    res, status = detect_in(shell, tmp_path, root, "install", cwd)
    assert res.returncode == 3, (res.stdout, res.stderr)
    (line,) = res.stderr.splitlines()
    assert reason in line and len(line.encode()) < 400, line
    assert line.isprintable() and "\x1b" not in line
    assert status["state"] == "refused" and status["message"] in line
    assert not Path("/tmp/pwned").exists()


@pytest.mark.parametrize("shell", shells())
def test_an_absolute_os_release_link_is_the_hosts_file(shell: List[str], tmp_path: Path) -> None:
    # the host's /etc/os-release -> /usr/lib/os-release.d/bottlerocket (absolute): read in
    # the host's root, never this container's own /usr/lib/os-release.d
    root = host_root(tmp_path, None, DEB)
    (root / "usr/lib/os-release.d").mkdir(parents=True)
    (root / "usr/lib/os-release.d/bottlerocket").write_text("ID=bottlerocket\nVERSION_ID=1.20\n")
    (root / "etc/os-release").symlink_to("/usr/lib/os-release.d/bottlerocket")
    res, _ = detect(shell, tmp_path, root, "install")
    assert res.returncode == 3 and "bottlerocket 1.20, an immutable OS" in res.stderr, res.stderr
    # a link that climbs above the root stays inside it
    (root / "etc/os-release").unlink()
    climb = "/".join([".."] * 5)  # more ".." than the host root has parents
    (root / "etc/os-release").symlink_to(f"{climb}/usr/lib/os-release.d/bottlerocket")
    res, _ = detect(shell, tmp_path, root, "install")
    assert res.returncode == 3 and "bottlerocket" in res.stderr, res.stderr


@pytest.mark.parametrize("shell", shells())
def test_a_fifo_or_a_link_loop_for_os_release_is_refused_at_once(
    shell: List[str], tmp_path: Path
) -> None:
    root = host_root(tmp_path, None, DEB)
    os.mkfifo(root / "etc/os-release")
    res, _ = detect(shell, tmp_path, root, "install")
    assert res.returncode == 3 and "no /etc/os-release on the host" in res.stderr
    (root / "etc/os-release").unlink()
    (root / "etc/os-release").symlink_to("os-release")
    res, _ = detect(shell, tmp_path, root, "install")
    assert res.returncode == 3 and "no /etc/os-release on the host" in res.stderr


def detect_in(
    shell: List[str], tmp_path: Path, root: Path, mode: str, cwd: Path
) -> Tuple[subprocess.CompletedProcess[str], Dict[str, str]]:
    """detect() run from `cwd` (where a glob would find files)."""
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return detect(shell, tmp_path, root, mode)
    finally:
        os.chdir(old)
