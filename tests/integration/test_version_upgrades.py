"""Builds of different commits, and the release before, through apt-get -y and the installer.

Three packages of real commits, each built by that commit's own packaging/build-deb in
a clone: the previous release's layout (the last commit of version 0.1.0, whose package
shipped /etc/gpuguard/gpuguard.conf as a conffile), this checkout's HEAD (A) and
a commit made on top of it a minute later (B). They go into one booted Debian 12 root
(integration/pkgroot) in file order: the old release with an edited configuration,
`apt-get -y` to A (no prompt, `ii`, the setting kept), apt to B and back to A, then the
installer DaemonSet's script to B and back to A, and its readiness when someone else
changes the version behind its back. The installer's output is kept in
build/test-logs/installer-rollout.log (the rollout log of an upgrade and a downgrade).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, Iterator

import pytest

from integration.pkgroot import DEBIAN_PATH, PackageRoot, debian_env, debian_root
from integration.pkgroot import require_pkgroot_tools as _require_pkgroot_tools

REPO = Path(__file__).resolve().parents[2]
INSTALLER = REPO / "deploy" / "gpuguard-installer"
LOG = REPO / "build" / "test-logs" / "installer-rollout.log"
APT_ENV = {"DEBIAN_FRONTEND": "noninteractive"}
CONF = "/etc/gpuguard/gpuguard.conf"
SETTING = "\n[Kubelet]\nBackupKeep=7\n"  # the operator's edit


def git(*argv: str, cwd: Path, env: Dict[str, str] | None = None) -> str:
    res = subprocess.run(
        ["git", *argv], cwd=cwd, capture_output=True, text=True, env=env, timeout=120
    )
    assert res.returncode == 0, f"git {argv}: {res.stderr}"
    return res.stdout.strip()


def previous_layout_commit() -> str:
    """The last commit of version 0.1.0, with its conffile: the parent of the commit that
    brought versions from git (found by content, so a rebase does not break it)."""
    pickaxe = '-S__commit__ = ""'
    found = subprocess.run(
        ["git", "log", "--reverse", "--format=%H", pickaxe, "--", "src/gpuguard/__init__.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout.split()
    parent = (
        subprocess.run(
            ["git", "rev-parse", "--verify", "-q", f"{found[0]}^"],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
        if found
        else ""
    )
    if not parent:
        msg = "needs the git history back to version 0.1.0 (a full clone)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg + ": clone with fetch-depth 0")
        pytest.skip(msg)
    return parent


def build(tmp: Path, name: str, commit: str, *, later: bool = False) -> Path:
    """The .deb that `commit`'s packaging/build-deb makes (with one more, empty commit
    made a minute after it when `later`)."""
    clone = tmp / name
    git("clone", "-q", "--shared", "--no-checkout", str(REPO), str(clone), cwd=tmp)
    git("checkout", "-q", commit, cwd=clone)
    if later:
        when = int(git("log", "-1", "--format=%ct", cwd=clone)) + 60
        env = dict(os.environ, GIT_COMMITTER_DATE=f"@{when}", GIT_AUTHOR_DATE=f"@{when}")
        env.update(GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.org")
        env.update(GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.org")
        git("commit", "-q", "--allow-empty", "-m", "a later commit", cwd=clone, env=env)
    env = debian_env()
    env.pop("GPUGUARD_VERSION_SUFFIX", None)
    env["DIST"] = str(tmp / f"dist-{name}")
    res = subprocess.run(
        [str(clone / "packaging" / "build-deb")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, f"build-deb at {commit}: {res.stdout}\n{res.stderr}"
    deb = Path(res.stdout.strip().splitlines()[-1])
    out = tmp / "debs" / name
    out.mkdir(parents=True)
    (out / deb.name).write_bytes(deb.read_bytes())
    return out / deb.name


def deb_version(deb: Path) -> str:
    res = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True)
    return res.stdout.strip()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, object]]:
    _require_pkgroot_tools()
    from conftest import require_tool

    require_tool("git", "busybox", "nsenter")
    old_commit = previous_layout_commit()
    head = git("rev-parse", "HEAD", cwd=REPO)
    tmp = tmp_path_factory.mktemp("builds")
    debs = {
        "old": build(tmp, "old", old_commit),
        "a": build(tmp, "a", head),
        "b": build(tmp, "b", head, later=True),
    }
    lower, _made = debian_root()
    ns = PackageRoot(
        tmp_path_factory.mktemp("pkgroot"), lower, ro_binds={"/run/host/debs": tmp / "debs"}
    )
    ns.start()
    LOG.parent.mkdir(parents=True, exist_ok=True)
    LOG.write_text("")
    try:
        yield {"ns": ns, "debs": debs, "status": tmp_path_factory.mktemp("st") / "status"}
    finally:
        ns.stop()


def inner(deb: Path) -> str:
    return f"/run/host/debs/{deb.parent.name}/{deb.name}"


def apt(ns: PackageRoot, *args: str) -> str:
    """apt-get -y as an operator or unattended job runs it: no dpkg option, stdin closed."""
    res = ns.run(["apt-get", "-y", "--no-install-recommends", *args], env=APT_ENV, timeout=300)
    assert res.returncode == 0, f"apt-get {args}: {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res.stdout + res.stderr


def state(ns: PackageRoot) -> str:
    res = ns.run(["dpkg-query", "-W", "-f", "${db:Status-Abbrev}${Version}", "gpuguard"])
    return res.stdout


def test_the_builds_are_distinct_and_ordered(node: Dict[str, object]) -> None:
    debs: Dict[str, Path] = node["debs"]  # type: ignore[assignment]
    old, a, b = (deb_version(debs[k]) for k in ("old", "a", "b"))
    assert old == "0.1.0-1" and len({old, a, b}) == 3
    for lo, hi in ((old, a), (a, b)):
        assert subprocess.run(["dpkg", "--compare-versions", lo, "lt", hi]).returncode == 0


def test_apt_y_over_an_edited_configuration_keeps_it(node: Dict[str, object]) -> None:
    ns: PackageRoot = node["ns"]  # type: ignore[assignment]
    debs: Dict[str, Path] = node["debs"]  # type: ignore[assignment]
    ns.run(["mkdir", "-p", "/var/lib/kubelet/device-plugins"], check=True)
    apt(ns, "install", inner(debs["old"]))
    assert state(ns) == "ii 0.1.0-1"
    conf = ns.path(CONF)
    edited = conf.read_text() + SETTING
    conf.write_text(edited)
    out = apt(ns, "install", inner(debs["a"]))  # 0.1.0's conffile: no prompt
    assert state(ns) == f"ii {deb_version(debs['a'])}", out
    assert conf.read_text() == edited
    assert f"your edited {CONF} is kept and read" in out
    assert ns.path("/usr/lib/gpuguard/gpuguard.conf").is_file()
    shown = ns.run(["gpuguard", "config"], check=True).stdout
    assert "BackupKeep=7" in shown
    ns.wait_active("gpuguard.service", timeout=30)


def test_apt_upgrades_and_downgrades_between_commits(node: Dict[str, object]) -> None:
    ns: PackageRoot = node["ns"]  # type: ignore[assignment]
    debs: Dict[str, Path] = node["debs"]  # type: ignore[assignment]
    for key in ("b", "a"):
        apt(ns, "--allow-downgrades", "install", inner(debs[key]))
        version = deb_version(debs[key])
        assert state(ns) == f"ii {version}"
        line = ns.run(["gpuguard", "--version"], check=True).stdout.strip()
        commit = git("-C", str(debs[key].parents[2] / key), "rev-parse", "HEAD", cwd=REPO)
        assert line == f"gpuguard {version[:-2]} (commit {commit[:12]})"
        assert "BackupKeep=7" in ns.run(["gpuguard", "config"], check=True).stdout
        ns.wait_active("gpuguard.service", timeout=30)


def installer_env(ns: PackageRoot, packages: Path, status: Path) -> Dict[str, str]:
    assert ns.pid != 1
    return {
        "PATH": DEBIAN_PATH,
        "LC_ALL": "C.UTF-8",
        "GPUGUARD_INSTALLER_TARGET_PID": str(ns.pid),
        "GPUGUARD_INSTALLER_PACKAGES": str(packages),
        "GPUGUARD_INSTALLER_STATUS": str(status),
    }


def read_status(status: Path) -> Dict[str, str]:
    return dict(line.split("=", 1) for line in status.read_text().splitlines())


def test_the_installer_upgrades_and_downgrades_to_its_image(node: Dict[str, object]) -> None:
    ns: PackageRoot = node["ns"]  # type: ignore[assignment]
    debs: Dict[str, Path] = node["debs"]  # type: ignore[assignment]
    status: Path = node["status"]  # type: ignore[assignment]
    for key, was in (("b", "a"), ("a", "b")):
        env = installer_env(ns, debs[key].parent, status)
        env["GPUGUARD_INSTALLER_ONESHOT"] = "1"
        res = subprocess.run(
            ["busybox", "sh", str(INSTALLER), "install"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        with LOG.open("a") as log:
            log.write(f"$ gpuguard-installer install  # image with {debs[key].name}\n")
            log.write(res.stdout + res.stderr + f"(exit {res.returncode})\n\n")
        assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
        version, old = deb_version(debs[key]), deb_version(debs[was])
        got = read_status(status)
        assert (got["state"], got["action"], got["version"]) == ("ok", "updated", version), got
        assert state(ns) == f"ii {version}"
        assert f"installed (was: {old})" in got["message"]
        assert "BackupKeep=7" in ns.run(["gpuguard", "config"], check=True).stdout


def test_readiness_names_another_version_and_never_quotes_its_errors(
    node: Dict[str, object],
) -> None:
    """Its image carries A; the host is moved to B by hand, whose check would fail on a
    drop-in: the pod says which version the host has, not B's error."""
    ns: PackageRoot = node["ns"]  # type: ignore[assignment]
    debs: Dict[str, Path] = node["debs"]  # type: ignore[assignment]
    status: Path = node["status"]  # type: ignore[assignment]
    status.unlink(missing_ok=True)
    env = installer_env(ns, debs["a"].parent, status)
    env["GPUGUARD_INSTALLER_WATCH"] = "1"
    p = subprocess.Popen(
        ["setpriv", "--pdeathsig", "KILL", "--", "busybox", "sh", str(INSTALLER), "install"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    broken = ns.path("/etc/gpuguard/gpuguard.conf.d/50-broken.conf")
    try:
        deadline = time.monotonic() + 60
        while not (status.exists() and read_status(status).get("state") == "ok"):
            assert time.monotonic() < deadline and p.poll() is None, p.poll()
            time.sleep(0.2)
        assert read_status(status)["action"] == "unchanged"
        broken.parent.mkdir(parents=True, exist_ok=True)
        broken.write_text("[Daemon]\nAuditInterval=forever\n")
        apt(ns, "install", inner(debs["b"]))
        # (while dpkg works, the reason shows its state: "... (dpkg: install ok unpacked)")
        want = f"the host has gpuguard {deb_version(debs['b'])}, not {deb_version(debs['a'])}"
        deadline = time.monotonic() + 60
        while want not in read_status(status).get("message", ""):
            assert time.monotonic() < deadline, read_status(status)
            time.sleep(0.2)
        got = read_status(status)
        assert (got["state"], got["daemon"]) == ("not-ready", "other-version"), got
        assert "AuditInterval" not in got["message"] and "invalid" not in got["message"]
        p.terminate()
        out, err = p.communicate(timeout=10)
        with LOG.open("a") as log:
            log.write("$ gpuguard-installer install  # pod; the host moved to B by hand\n")
            log.write(out + err + "\n")
    finally:
        broken.unlink(missing_ok=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def test_an_unchanged_shipped_configuration_goes(node: Dict[str, object]) -> None:
    ns: PackageRoot = node["ns"]  # type: ignore[assignment]
    debs: Dict[str, Path] = node["debs"]  # type: ignore[assignment]
    apt(ns, "purge", "gpuguard")
    ns.run(["rm", "-rf", "/etc/gpuguard"], check=True)
    apt(ns, "install", inner(debs["old"]))
    assert ns.path(CONF).is_file()
    apt(ns, "install", inner(debs["a"]))
    assert state(ns) == f"ii {deb_version(debs['a'])}"
    assert not ns.path(CONF).exists()
    assert ns.path("/etc/gpuguard/gpuguard.conf.d").is_dir()
    ns.wait_active("gpuguard.service", timeout=30)


def test_readiness_scrapes_the_metrics_endpoint_where_it_is_enabled(
    node: Dict[str, object],
) -> None:
    """Enabled metrics without python3-prometheus-client (the root has no network to get
    it) answer 503: not Ready, saying so; with it, Ready, naming the scrape."""
    ns: PackageRoot = node["ns"]  # type: ignore[assignment]
    debs: Dict[str, Path] = node["debs"]  # type: ignore[assignment]
    status: Path = node["status"]  # type: ignore[assignment]
    env = installer_env(ns, debs["a"].parent, status)
    env["GPUGUARD_INSTALLER_ONESHOT"] = "1"
    argv = ["busybox", "sh", str(INSTALLER), "install"]
    ns.systemctl("enable", "--now", "gpuguard-metrics.socket")
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    got = read_status(status)
    assert res.returncode == 5 and got["daemon"] == "metrics-failed", (res.stdout, got)
    assert (
        "a scrape of gpuguard-metrics.socket (http://127.0.0.1:9835/metrics) failed: "
        in (got["message"])
    )
    assert "HTTP 503" in got["message"], got
    client = Path("/usr/lib/python3/dist-packages/prometheus_client")
    if not client.is_dir():
        pytest.fail("python3-prometheus-client missing here: run scripts/bootstrap")
    site = "/usr/local/lib/python3.11/dist-packages"
    ns.run(["mkdir", "-p", site], check=True)
    shutil.copytree(client, ns.path(f"{site}/prometheus_client"))
    decorator = client.parent / "decorator.py"  # what this machine's package imports
    if decorator.exists():
        shutil.copy(decorator, ns.path(f"{site}/decorator.py"))
    ns.systemctl("restart", "gpuguard-metrics.socket")
    ns.systemctl("stop", "gpuguard-metrics.service")
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    got = read_status(status)
    assert res.returncode == 0 and got["state"] == "ok", (res.stdout, res.stderr, got)
    assert "metrics answer at http://127.0.0.1:9835/metrics" in got["message"], got
