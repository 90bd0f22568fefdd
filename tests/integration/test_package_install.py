"""Installs, upgrades and purges the .deb in a throw-away Debian 12 root.

The root is debootstrapped once (minbase + systemd, dbus, udev, procps and
gpuguard's dependencies; cached under /var/cache/gpuguard-tests/) and booted,
copy-on-write, with a real systemd as PID 1 of private namespaces
(integration/pkgroot). `apt-get install ./gpuguard_*.deb` runs inside it, so the
maintainer scripts really enable/start/restart/stop the unit; the host's package
database, /etc/systemd, /run and /dev are never touched.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Set

import pytest

from integration.pkgroot import (
    PackageRoot,
    built_packages,
    debian_root,
    require_pkgroot_tools,
    source_version,
)

UPGRADE_SUFFIX = "+test1"
APT_ENV = {"DEBIAN_FRONTEND": "noninteractive"}
#: Package-manager bookkeeping that changes with any install; everything else
#: must be back to what it was after a purge.
BOOKKEEPING = (
    "/var/lib/dpkg/",
    "/var/cache/apt/",
    "/var/lib/apt/",
    "/var/log/",
    "/var/cache/debconf/",
    "/var/cache/ldconfig/",
    "/etc/ld.so.cache",
)
INVENTORY = {
    "gpus": [
        {
            "uuid": "GPU-0b8b4f6e-6b4c-4a0a-9d5e-1f2a3b4c5d6e",
            "index": 0,
            "minor": 0,
            "pci_bus_id": "00000000:00:07.0",
        }
    ]
}

timings: Dict[str, float] = {}


def files(ns: PackageRoot) -> Set[str]:
    """Every path on the root filesystem (other mounts: /proc /sys /dev /run /tmp excluded)."""
    out = ns.run(["find", "/", "-xdev", "-mindepth", "1"], check=True, timeout=60).stdout
    return {p for p in out.splitlines() if not p.startswith(BOOKKEEPING)}


def apt(ns: PackageRoot, *args: str) -> str:
    res = ns.run(["apt-get", "-y", "--no-install-recommends", *args], env=APT_ENV, timeout=300)
    assert res.returncode == 0, f"apt-get {args}: {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res.stdout + res.stderr


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, object]]:
    require_pkgroot_tools()
    lower, made = debian_root()
    if made is not None:
        timings["debootstrap (cache miss)"] = made
    debs = tmp_path_factory.mktemp("debs")
    for suffix in ("", UPGRADE_SUFFIX):
        deb = built_packages(suffix)["deb"]
        (debs / deb.name).write_bytes(deb.read_bytes())
    ns = PackageRoot(tmp_path_factory.mktemp("pkgroot"), lower, ro_binds={"/run/host/debs": debs})
    ns.start()
    try:
        timings["boot"] = ns.boot_seconds or 0.0
        # A kubelet node: kubelet's device-plugins dir exists before gpuguard.
        ns.run(["mkdir", "-p", "/var/lib/kubelet/device-plugins"], check=True)
        before = files(ns)
        t0 = time.monotonic()
        out = apt(ns, "install", f"/run/host/debs/gpuguard_{source_version()}-1_all.deb")
        timings["apt-get install"] = time.monotonic() - t0
        yield {"ns": ns, "before": before, "install_output": out}
    finally:
        ns.stop()
        print("\ntimings (s): " + ", ".join(f"{k} {v:.2f}" for k, v in timings.items()))


def test_install_prints_kubelet_note(root: Dict[str, object]) -> None:
    out = str(root["install_output"])
    assert "takes effect at kubelet's next start; kubelet was not restarted" in out, out


def test_service_enabled_and_ready(root: Dict[str, object]) -> None:
    ns: PackageRoot = root["ns"]  # type: ignore[assignment]
    assert ns.systemctl("is-enabled", "gpuguard.service", check=False).stdout.strip() == "enabled"
    # Type=notify: "active" means the daemon sent READY=1 after its first pass.
    ns.wait_active("gpuguard.service", timeout=20)
    assert ns.unit_property("gpuguard.service", "Type") == "notify"
    assert ns.unit_property("gpuguard.service", "FragmentPath") in (
        "/usr/lib/systemd/system/gpuguard.service",
        "/lib/systemd/system/gpuguard.service",
    )


def test_cli_with_system_python(root: Dict[str, object]) -> None:
    ns: PackageRoot = root["ns"]  # type: ignore[assignment]
    head = ns.path("/usr/bin/gpuguard").read_text().splitlines()[0]
    assert head == "#!/usr/bin/python3"
    res = ns.run(["gpuguard", "--version"], check=True)
    assert res.stdout.strip().startswith(f"gpuguard {source_version()} (commit ")
    ns.path("/tmp/inventory.json").write_text(json.dumps(INVENTORY))
    res = ns.run(
        [
            "/usr/bin/python3",
            "/usr/bin/gpuguard",
            "check",
            "--dry-run",
            "--inventory",
            "/tmp/inventory.json",
        ],
        timeout=60,
    )
    assert res.returncode in (0, 1), f"{res.returncode}\n{res.stdout}\n{res.stderr}"
    assert "Traceback" not in res.stderr, res.stderr
    # The vendored NVML bindings import with the system python (no driver here).
    res = ns.run(
        [
            "/usr/bin/python3",
            "-c",
            "import sys; sys.path.append('/usr/lib/gpuguard/vendor'); "
            "import pynvml; print(pynvml.__file__)",
        ],
        check=True,
    )
    assert res.stdout.strip() == "/usr/lib/gpuguard/vendor/pynvml.py"


def test_files_in_place(root: Dict[str, object]) -> None:
    ns: PackageRoot = root["ns"]  # type: ignore[assignment]
    repo = Path(__file__).resolve().parents[2]
    assert (
        ns.path("/usr/lib/udev/rules.d/71-gpuguard.rules").read_text()
        == (repo / "udev-rules/71-gpuguard.rules").read_text()
    )
    dropin = "/usr/lib/systemd/system/kubelet.service.d/10-gpuguard.conf"
    assert (
        ns.path(dropin).read_text()
        == (repo / "units/kubelet.service.d/10-gpuguard.conf").read_text()
    )
    assert ns.path("/usr/libexec/gpuguard/kubelet-pre-start").stat().st_mode & 0o111
    assert ns.path("/var/lib/gpuguard").stat().st_mode & 0o777 == 0o700
    for d in ("/etc/gpuguard/gpuguard.conf.d", "/etc/gpuguard/hooks.d"):
        assert ns.path(d).is_dir()
    # journalctl --update-catalog ran: the catalog's entries are in the database.
    catalog = ns.path("/usr/lib/systemd/catalog/gpuguard.catalog").read_text()
    first_id = next(line[3:].strip() for line in catalog.splitlines() if line.startswith("-- "))
    res = ns.run(["journalctl", "--catalog", "--no-pager", "-x", "--list-catalog", first_id])
    assert first_id in res.stdout, res.stdout + res.stderr
    # udevd does not run here: the guarded udevadm calls did nothing.
    assert not ns.path("/run/udev/control").exists()


def test_systemd_analyze_verify_is_clean(root: Dict[str, object]) -> None:
    ns: PackageRoot = root["ns"]  # type: ignore[assignment]
    # --man=no: minbase has no man-db to resolve Documentation=man:gpuguard(8)
    # (the package's man page itself is checked by test_packaging).
    res = ns.run(
        [
            "systemd-analyze",
            "verify",
            "--man=no",
            "/usr/lib/systemd/system/gpuguard.service",
            "/usr/lib/systemd/system/gpuguard-trigger.service",
        ],
        timeout=60,
    )
    # It exits 0 on unknown keys and other warnings: any stderr line fails.
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 0 and not lines, f"{res.returncode}\n{res.stderr}"


def _entries(ns: PackageRoot, kind: str) -> List[Dict[str, Any]]:
    return [e for e in ns.journal("gpuguard.service") if e.get("GPUGUARD_KIND") == kind]


def test_quiet_start_and_one_entry_per_state(root: Dict[str, object]) -> None:
    """No driver here: "no GPU inventory" is journaled once, not on every pass; its
    catalog entry shows the reason itself; nothing warns about the netlink buffer."""
    ns: PackageRoot = root["ns"]  # type: ignore[assignment]
    ns.wait_active("gpuguard.service", timeout=20)
    for n in range(2):  # two more passes (a reload runs one)
        before = int(ns.unit_property("gpuguard.service", "ExecMainPID"))
        ns.systemctl("reload", "gpuguard.service")
        deadline = time.monotonic() + 10
        while len(_entries(ns, "config-reloaded")) < n + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert int(ns.unit_property("gpuguard.service", "ExecMainPID")) == before

    def passes() -> int:
        return int(json.loads(ns.path("/run/gpuguard/status.json").read_text())["passes"])

    deadline = time.monotonic() + 10
    while passes() < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert passes() >= 3
    assert not _entries(ns, "pass-complete")  # a pass that found nothing new: debug only
    (missing,) = _entries(ns, "inventory-unavailable")
    assert missing["PRIORITY"] == "4", missing
    assert missing["GPUGUARD_PROBLEM"].startswith("GPU inventory unavailable: "), missing
    text = ns.run(
        [
            "journalctl",
            "--no-pager",
            "-x",
            "-u",
            "gpuguard.service",
            f"MESSAGE_ID={missing['MESSAGE_ID']}",
        ],
        check=True,
    ).stdout
    assert f"No GPU inventory: {missing['GPUGUARD_PROBLEM']}" in text, text
    assert "@" not in text.split("-- Subject:", 1)[-1], text  # every @FIELD@ was filled in
    everything = ns.run(["journalctl", "--no-pager", "-u", "gpuguard.service"]).stdout
    assert "could not enlarge" not in everything
    warnings = [
        e["MESSAGE"]
        for e in ns.journal("gpuguard.service")
        if e.get("SYSLOG_IDENTIFIER") == "gpuguard" and int(e["PRIORITY"]) <= 4
    ]
    assert warnings == [missing["MESSAGE"]], warnings


def test_disable_keeps_it_off_across_driver_loads(root: Dict[str, object]) -> None:
    """The udev rule pulls in gpuguard-trigger.service when the nvidia module loads (its
    SYSTEMD_WANTS, proven with a real udevd in test_udev.py); here is what systemd then
    does with it, on the installed package: nothing while gpuguard is disabled."""
    ns: PackageRoot = root["ns"]  # type: ignore[assignment]
    ns.systemctl("disable", "--now", "gpuguard.service")
    res = ns.systemctl("start", "gpuguard-trigger.service", check=False)
    assert res.returncode == 0, res.stderr  # skipped, not failed: no alarm
    assert ns.unit_property("gpuguard.service", "ActiveState") == "inactive"
    assert ns.unit_property("gpuguard-trigger.service", "Result") in ("success", "exec-condition")
    log = ns.run(["journalctl", "--no-pager", "-u", "gpuguard-trigger.service"]).stdout
    assert "Skipped due to 'exec-condition'" in log, log
    assert ns.systemctl("is-failed", "gpuguard-trigger.service", check=False).returncode != 0

    ns.systemctl("enable", "gpuguard.service")  # the operator's choice: on again
    ns.systemctl("start", "gpuguard-trigger.service")
    ns.wait_active("gpuguard.service", timeout=20)


def test_documentation_it_names_is_installed(root: Dict[str, object]) -> None:
    """Every Documentation= of the units, and the man page a configuration error names."""
    ns: PackageRoot = root["ns"]  # type: ignore[assignment]
    docs = []
    for unit in ("gpuguard.service", "gpuguard-trigger.service"):
        docs += [d.strip('"') for d in ns.unit_property(unit, "Documentation").split()]
    assert "man:gpuguard.conf(5)" in docs
    for doc in docs:
        if doc.startswith("man:"):
            name, sec = doc[4:].rstrip(")").split("(")
            path = f"/usr/share/man/man{sec}/{name}.{sec}.gz"
        else:
            assert doc.startswith("file:///"), doc
            path = doc[7:]
        assert ns.path(path).is_file(), f"{doc}: {path} is not installed"
    if ns.run(["sh", "-c", "command -v man"]).returncode == 0:
        assert "gpuguard.conf" in ns.run(["man", "gpuguard.conf"], check=True).stdout
    dropin = ns.path("/etc/gpuguard/gpuguard.conf.d/50-typo.conf")
    dropin.write_text("[Daemon]\nAuditIntervall=1min\n")
    try:
        res = ns.run(["gpuguard", "config", "--check", "--strict"])
    finally:
        dropin.unlink()
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "gpuguard: /etc/gpuguard/gpuguard.conf.d/50-typo.conf:2: unknown key 'AuditIntervall' "
        "in [Daemon]; did you mean 'AuditInterval'? (see gpuguard.conf(5))"
    ], res.stderr
    # and the shipped defaults' own pointer
    assert "man 5 gpuguard.conf" in ns.path("/usr/lib/gpuguard/gpuguard.conf").read_text()


def test_unknown_option_shows_the_commands_usage(root: Dict[str, object]) -> None:
    ns: PackageRoot = root["ns"]  # type: ignore[assignment]
    res = ns.run(["gpuguard", "status", "--bogus"])
    assert res.returncode == 2
    assert res.stderr.startswith("usage: gpuguard status "), res.stderr
    assert res.stderr.rstrip().endswith(
        "gpuguard status: error: unrecognized arguments: --bogus"
    ), res.stderr


def test_metrics_units_and_npd_plugin_installed(root: Dict[str, object]) -> None:
    ns: PackageRoot = root["ns"]  # type: ignore[assignment]
    for unit in ("gpuguard-metrics.socket", "gpuguard-metrics.service"):
        res = ns.run(
            ["systemd-analyze", "verify", "--man=no", f"/usr/lib/systemd/system/{unit}"],
            timeout=60,
        )
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert res.returncode == 0 and not lines, f"{unit}: {res.returncode}\n{res.stderr}"
    # shipped off: metrics are served only once an operator enables the socket
    enabled = ns.run(["systemctl", "is-enabled", "gpuguard-metrics.socket"]).stdout.strip()
    assert enabled == "disabled"
    # node-problem-detector's plugin, as NPD on the host would run it
    res = ns.run(["/usr/libexec/gpuguard/npd-condition", "checkpoint"])
    assert res.returncode in (0, 1, 2) and res.stdout.count("\n") == 1, res
    assert res.stdout.strip() and len(res.stdout.strip()) <= 80
    monitor = ns.path("/usr/share/gpuguard/node-problem-detector/gpuguard-monitor.json")
    rules = json.loads(monitor.read_text())["rules"]
    assert {r["path"] for r in rules} == {"/usr/libexec/gpuguard/npd-condition"}


def test_upgrade_keeps_edited_config(root: Dict[str, object]) -> None:
    ns: PackageRoot = root["ns"]  # type: ignore[assignment]
    conf = ns.path("/etc/gpuguard/gpuguard.conf")
    edited = "# edited by the operator\n[Kubelet]\nBackupKeep=7\n"
    conf.write_text(edited)
    pid_before = ns.unit_property("gpuguard.service", "InvocationID")
    new = f"{source_version(UPGRADE_SUFFIX)}"
    t0 = time.monotonic()
    apt(ns, "install", f"/run/host/debs/gpuguard_{new}-1_all.deb")
    timings["apt-get upgrade"] = time.monotonic() - t0
    status = ns.run(["dpkg-query", "-W", "-f", "${Version}", "gpuguard"], check=True).stdout
    assert status == f"{new}-1"
    assert conf.read_text() == edited
    assert ns.run(["gpuguard", "--version"], check=True).stdout.startswith(f"gpuguard {new} ")
    assert "BackupKeep=7" in ns.run(["gpuguard", "config"], check=True).stdout
    conf.unlink()  # the operator's file: purge (next) leaves it, and says so
    # restarted on upgrade (a new invocation), and ready again
    ns.wait_active("gpuguard.service", timeout=20)
    assert ns.unit_property("gpuguard.service", "InvocationID") != pid_before


def test_purge_removes_everything(root: Dict[str, object]) -> None:
    ns: PackageRoot = root["ns"]  # type: ignore[assignment]
    t0 = time.monotonic()
    apt(ns, "purge", "gpuguard")
    timings["apt-get purge"] = time.monotonic() - t0
    after = files(ns)
    before: Set[str] = root["before"]  # type: ignore[assignment]
    left: List[str] = sorted(after - before)
    gone: List[str] = sorted(before - after)
    assert not left, f"left behind by purge: {left}"
    assert not gone, f"removed by install+purge but not ours: {gone}"
    assert ns.unit_property("gpuguard.service", "LoadState") == "not-found"
