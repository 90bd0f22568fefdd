"""Operating gpuguard on a fleet, proven on the .deb in a booted Debian 12 root
(integration/pkgroot), on both cgroup layouts where it touches devices.

One node per layout, in phases, each building on the last:

1. the off switch, set by "configuration management" before the package is installed:
   through a daemon-reload that takes a GPU container's device away, a kubelet restart
   (its pre-start hook) and a driver-load event (gpuguard-trigger.service), gpuguard
   changes nothing: checkpoint, cgroup, scope properties, drop-ins, device nodes and
   unit states are compared before and after;
2. observe-only (Mode=observe, turned on with `gpuguard enable`): the same events, the
   same comparison, with the daemon running, journaling its plan and exporting the
   mode;
3. repair (Mode=repair, `systemctl reload gpuguard`): the same node is repaired, which
   shows that the comparisons above could have failed; the daemon leaves the running
   kubelet alone because the inventory is a file (a simulation), kubelet's own restart
   repairs the checkpoint through the hook, each hook message once in kubelet's
   journal, and healthy passes journal nothing at info or above;
4. a reload with a broken configuration fails, naming the file and line, and the
   daemon keeps running; `gpuguard disable` stops it and the metrics say so; a switch
   dropped in place while it runs stops it at its next pass;
5. removal keeps gpuguard's per-container drop-in (the container keeps its GPU through
   the next daemon-reload) and says so; purge keeps the operator's files and the
   checkpoint backups, and names them.

Kubelet under another unit's name (k3s-agent.service) and the metrics endpoint beside
idle connections are proven on one layout (they do not depend on it).
"""

from __future__ import annotations

import hashlib
import json
import os
import textwrap
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

from integration.gpu_scopes import Container, dev_binds, fake_proc_devices, has, start
from integration.gpuguard_ns import FIXTURE, INVENTORY, MOVED_GPU, wait_for
from integration.harness import bpfdev
from integration.pkgroot import (
    PackageRoot,
    built_packages,
    debian_root,
    require_pkgroot_tools,
    source_version,
)

pytestmark = pytest.mark.root

CHECKPOINT = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"
UPGRADE = "+test1"  # as test_package_install: one build per pytest run
APT_ENV = {"DEBIAN_FRONTEND": "noninteractive"}
CTR = Container("0000a000-0000-0000-0000-00000000a000", "ab" * 32, (0,))
KUBELET_UNIT = """[Unit]
Description=kubelet stand-in
[Service]
ExecStart=/bin/sleep infinity
"""
# the driver's registration in /proc/devices (the unit gets a fresh /proc)
FAKE_DRIVER = "[Service]\nBindReadOnlyPaths=/run/fake/devices:/proc/devices\n"
NODE_CONF = "[Inventory]\nFile=/etc/gpuguard/inventory.json\n[Daemon]\nAuditInterval=1s\n"
PROMETHEUS = Path("/usr/lib/python3/dist-packages/prometheus_client")


def prometheus_client() -> Dict[str, Path]:
    """The package's Recommends, python3-prometheus-client (and its python3-decorator),
    from this machine, bound in: the root has no network; scripts/bootstrap installs it."""
    assert PROMETHEUS.is_dir(), "python3-prometheus-client missing: run scripts/bootstrap"
    decorator = PROMETHEUS.parent / "decorator.py"
    return {str(PROMETHEUS): PROMETHEUS, str(decorator): decorator}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else "-"


def apt(ns: PackageRoot, *args: str) -> str:
    res = ns.run(["apt-get", "-y", "--no-install-recommends", *args], env=APT_ENV, timeout=300)
    assert res.returncode == 0, f"apt-get {args}: {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res.stdout + res.stderr


def write_unit(ns: PackageRoot, name: str, text: str) -> None:
    """A unit or drop-in in the root's own /etc/systemd/system (systemd reloads later)."""
    p = ns.path(f"/etc/systemd/system/{name}")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def gpuguard_entries(ns: PackageRoot) -> List[Dict[str, Any]]:
    return [e for e in ns.journal() if e.get("SYSLOG_IDENTIFIER") == "gpuguard"]


def changes(ns: PackageRoot) -> List[Dict[str, Any]]:
    """Every change gpuguard journaled (an outcome whose status is done)."""
    return [e for e in gpuguard_entries(ns) if e.get("GPUGUARD_STATUS") == "done"]


class Node:
    def __init__(self, ns: PackageRoot) -> None:
        self.ns = ns

    def snapshot(self) -> Dict[str, Any]:
        """What gpuguard may change, as it is now (the container's own access apart)."""
        ns = self.ns
        dev = ns.path("/dev")
        transient = ns.path("/run/systemd/transient")
        return {
            "checkpoint": sha(ns.path(CHECKPOINT)),
            "nodes": sorted(p.name for p in dev.iterdir() if p.name.startswith("nvidia")),
            "char": sorted(os.listdir(dev / "char")) if (dev / "char").is_dir() else [],
            "dropins": sorted(
                f"{p.parent.name}/{p.name}"
                for p in ns.path("/run/systemd/system").glob("*.scope.d/*")
            ),
            "transient": {
                str(p.relative_to(transient)): sha(p)
                for p in sorted(transient.rglob("*"))
                if p.is_file() and CTR.unit in str(p)
            },
            "scope": {p: ns.unit_property(CTR.unit, p) for p in ("DevicePolicy", "DeviceAllow")},
            # v2: the device programs gpuguard would attach (a bridge, a replacement);
            # systemd's own sd_devices comes and goes with its reloads
            "programs": (
                sorted(n for n in bpfdev.names(CTR.cgroup(ns)) if n.startswith("gpuguard"))
                if ns.layout == "v2"
                else "v1"
            ),
            "units": {
                u: (ns.unit_property(u, "ActiveState"), ns.unit_property(u, "InvocationID"))
                for u in ("gpuguard.service", "gpuguard-metrics.socket")
            },
            "changes": len(changes(ns)),
        }

    def kubelet_invocation(self) -> str:
        return self.ns.unit_property("kubelet.service", "InvocationID")

    def events(self) -> None:
        """A daemon-reload (the container loses its GPU to systemd), a kubelet restart
        (its pre-start hook runs) and a driver load (the udev rule's unit)."""
        ns = self.ns
        assert has(CTR, ns, (195, 0)), "the container should have its GPU before"
        ns.systemctl("daemon-reload")
        before = self.kubelet_invocation()
        ns.systemctl("restart", "kubelet.service")
        assert self.kubelet_invocation() != before
        res = ns.systemctl("start", "gpuguard-trigger.service", check=False)
        assert res.returncode == 0, res.stderr
        time.sleep(3)  # three audit passes (AuditInterval=1s) where a daemon runs

    def hook_grant(self) -> None:
        """The container gets its GPU back behind systemd's back (the legacy hook)."""
        CTR.hook_grant(self.ns)
        wait_for(lambda: has(CTR, self.ns, (195, 0)), what="the hook's grant")


def assert_unchanged(before: Dict[str, Any], after: Dict[str, Any], node: Node) -> None:
    assert after == before
    # systemd's reload took the GPU away; nothing of gpuguard gave it back
    assert not has(CTR, node.ns, (195, 0))


@pytest.fixture(scope="module", params=["v1", "v2"])
def node(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Node]:
    require_pkgroot_tools()
    lower, _made = debian_root()
    tmp = tmp_path_factory.mktemp(f"fleet-ops-{request.param}")
    debs = tmp / "debs"
    debs.mkdir()
    for suffix in ("", UPGRADE):
        deb = built_packages(suffix)["deb"]
        (debs / deb.name).write_bytes(deb.read_bytes())
    devices = fake_proc_devices(tmp / "devices")
    binds = {"/run/host/debs": debs, "/run/fake/devices": devices, "/proc/devices": devices}
    binds.update(dev_binds(tmp, [CTR]))
    binds.update(prometheus_client())
    ns = PackageRoot(tmp / "root", lower, layout=request.param, ro_binds=binds)
    ns.start()
    try:
        yield Node(ns)
    finally:
        ns.stop()


# ---------------------------------------------------------------------------- phases


def test_1_off_switch_changes_nothing(node: Node) -> None:
    ns = node.ns
    # configuration management's files, before the package: the off switch first
    etc = ns.path("/etc/gpuguard")
    (etc / "gpuguard.conf.d").mkdir(parents=True)
    (etc / "disabled").write_text("canary pool frozen (CHG-1)\n")
    (etc / "inventory.json").write_text(json.dumps(INVENTORY))
    (etc / "gpuguard.conf.d/10-node.conf").write_text(NODE_CONF)
    write_unit(ns, "gpuguard.service.d/60-fake-driver.conf", FAKE_DRIVER)
    write_unit(ns, "kubelet.service", KUBELET_UNIT)
    ckpt = ns.path(CHECKPOINT)
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(FIXTURE.read_bytes())  # names a GPU this node no longer has
    out = apt(ns, "install", f"/run/host/debs/gpuguard_{source_version()}-1_all.deb")
    assert "gpuguard-metrics.socket" in out and "port 9835" in out  # the address, said
    assert ns.unit_property("gpuguard.service", "ActiveState") == "inactive"
    assert ns.unit_property("gpuguard.service", "ConditionResult") == "no"
    ns.systemctl("start", "kubelet.service")
    start(ns, CTR)
    before = node.snapshot()
    node.events()
    ns.systemctl("start", "gpuguard.service")  # by hand: still off
    res = ns.systemctl("reload", "gpuguard.service", check=False)
    assert res.returncode != 0  # nothing to reload: it does not run
    # a package upgrade keeps it off (the file is not the package's)
    apt(ns, "install", f"/run/host/debs/gpuguard_{source_version(UPGRADE)}-1_all.deb")
    assert ns.path("/etc/gpuguard/disabled").read_text() == "canary pool frozen (CHG-1)\n"
    assert_unchanged(before, node.snapshot(), node)
    # visible: status, doctor, npd, metrics, journal
    status = ns.run(["gpuguard", "status"], check=True).stdout
    assert "OFF: gpuguard is disabled" in status and "canary pool frozen (CHG-1)" in status
    doctor = ns.run(["gpuguard", "doctor", "--json"], timeout=60).stdout
    mode = {c["check"]: c for c in json.loads(doctor)["checks"]}["gpuguard-mode"]
    assert mode["verdict"] == "exposed" and mode["fix"] == "gpuguard enable"
    npd = ns.run(["gpuguard", "npd", "checkpoint"])
    assert npd.returncode == 2 and "canary pool frozen" in npd.stdout

    def skips() -> List[Dict[str, Any]]:
        return [e for e in gpuguard_entries(ns) if e.get("GPUGUARD_KIND") == "disabled-skip"]

    wait_for(lambda: len(skips()) == 2, what="the hook's two skips")
    assert all(e.get("_SYSTEMD_UNIT") == "kubelet.service" for e in skips())


def test_2_observe_mode_changes_nothing(node: Node) -> None:
    ns = node.ns
    ns.path("/etc/gpuguard/gpuguard.conf.d/20-canary.conf").write_text("[Daemon]\nMode=observe\n")
    res = ns.run(["gpuguard", "enable"], timeout=120)
    assert res.returncode == 0 and "gpuguard.service started" in res.stdout, res
    ns.wait_active("gpuguard.service", timeout=30)
    node.hook_grant()
    time.sleep(2)
    before = node.snapshot()
    node.events()
    res = ns.systemctl("reload", "gpuguard.service", check=False)
    assert res.returncode == 0, res.stderr
    time.sleep(2)
    after = node.snapshot()
    assert after.pop("changes") == before.pop("changes")
    assert_unchanged(before, after, node)
    # it found the losses, journaled the plan once, and says it observes
    kinds = [e.get("GPUGUARD_KIND") for e in gpuguard_entries(ns)]
    assert "observe-only" in kinds and "container-device-denied" in kinds
    plans = [e for e in gpuguard_entries(ns) if e.get("GPUGUARD_STATUS") == "dry-run"]
    assert plans and all(int(e["PRIORITY"]) == 6 for e in plans)
    res = ns.run(["gpuguard", "status", "--json"])
    assert res.returncode == 1, res  # the losses it left as they are: a problem, never OK
    status = json.loads(res.stdout)
    assert status["mode"] == "observe" and status["summary"]["verdict"] == "problem"
    metrics = json.loads(ns.path("/run/gpuguard/metrics.json").read_text())["families"]
    assert metrics["gpuguard_mode"] == [{"labels": ["observe"], "value": 1.0}]
    # as quiet as repair mode: the loss that lasts was journaled when it appeared, and
    # each later event (a daemon-reload: the fast path, then a pass) adds nothing. The
    # first reload may plan what only a reload plans (v2: the bridge), journaled once.
    ns.systemctl("daemon-reload")
    time.sleep(2)
    n0 = len(gpuguard_entries(ns))
    for _ in range(3):
        ns.systemctl("daemon-reload")
        time.sleep(1)
    loud = [e for e in gpuguard_entries(ns)[n0:] if int(e["PRIORITY"]) <= 6]
    assert not loud, [e["MESSAGE"] for e in loud]


def test_3_repair_mode_repairs_and_stays_quiet(node: Node) -> None:
    ns = node.ns
    ns.path("/etc/gpuguard/gpuguard.conf.d/20-canary.conf").unlink()
    kubelet = node.kubelet_invocation()
    res = ns.systemctl("reload", "gpuguard.service", check=False)
    assert res.returncode == 0, res.stderr
    wait_for(lambda: has(CTR, ns, (195, 0)), timeout=30, what="the container re-granted")
    wait_for(
        lambda: ns.path(f"/run/systemd/system/{CTR.unit}.d/60-gpuguard-devices.conf").exists(),
        what="the durable grant's drop-in",
    )
    assert ns.path("/dev/nvidia0").exists() and ns.path("/dev/char/195:0").is_symlink()
    # The checkpoint is stale, but the inventory is a file (a simulation): the daemon
    # never restarts the running kubelet for it (the bug)
    time.sleep(2)
    assert node.kubelet_invocation() == kubelet
    assert MOVED_GPU in ns.path(CHECKPOINT).read_text()
    wait_for(
        lambda: any("(a simulation)" in str(e.get("MESSAGE")) for e in gpuguard_entries(ns)),
        what="why the checkpoint waits for kubelet's next start",
    )
    # kubelet's own restart: its pre-start hook repairs it; each message once there
    ns.systemctl("restart", "kubelet.service")
    assert MOVED_GPU not in ns.path(CHECKPOINT).read_text()
    assert list(ns.path("/var/lib/gpuguard/backups").iterdir())

    def repaired() -> List[str]:  # the hook's entry (journald may take a moment)
        return [
            str(e["MESSAGE"])
            for e in gpuguard_entries(ns)
            if e.get("GPUGUARD_KIND") == "checkpoint-repaired"
            and e.get("_SYSTEMD_UNIT") == "kubelet.service"
        ]

    (message,) = wait_for(repaired, what="the hook's checkpoint-repaired entry")
    kubelet_log = ns.run(["journalctl", "--no-pager", "-u", "kubelet.service"]).stdout
    detail = message.split("; previous file saved as", 1)[0]
    assert kubelet_log.count(detail) == 1, kubelet_log
    # healthy now: passes go on (AuditInterval=1s) and journal nothing at info or above
    time.sleep(3)
    n0 = len(gpuguard_entries(ns))
    passes0 = json.loads(ns.path("/run/gpuguard/status.json").read_text())["passes"]
    time.sleep(5)
    passes1 = json.loads(ns.path("/run/gpuguard/status.json").read_text())["passes"]
    loud = [e for e in gpuguard_entries(ns)[n0:] if int(e["PRIORITY"]) <= 6]
    assert passes1 >= passes0 + 3
    assert not loud, [e["MESSAGE"] for e in loud]


def test_4_reload_fails_on_a_broken_configuration(node: Node) -> None:
    ns = node.ns
    pid = ns.unit_property("gpuguard.service", "MainPID")
    bad = ns.path("/etc/gpuguard/gpuguard.conf.d/50-typo.conf")
    bad.write_text("[Daemon]\n\nAuditInterval=forever\n")
    try:
        res = ns.systemctl("reload", "gpuguard.service", check=False)
        assert res.returncode != 0
        text = ns.run(["systemctl", "status", "--no-pager", "-n", "20", "gpuguard"]).stdout
        assert "/etc/gpuguard/gpuguard.conf.d/50-typo.conf:3: invalid value 'forever'" in text
    finally:
        bad.unlink()
    assert ns.unit_property("gpuguard.service", "ActiveState") == "active"
    assert ns.unit_property("gpuguard.service", "MainPID") == pid


def test_5_the_off_switch_at_run_time(node: Node) -> None:
    ns = node.ns
    res = ns.run(["gpuguard", "disable", "--reason", "INC-9: Xid storm"], timeout=60)
    assert res.returncode == 0 and "gpuguard.service stopped" in res.stdout, res
    assert ns.unit_property("gpuguard.service", "ActiveState") == "inactive"
    node.snapshot()  # readable while off
    metrics = ns.run(["gpuguard", "metrics"])
    assert metrics.returncode == 0 and "\ngpuguard_disabled 1.0\n" in metrics.stdout, metrics
    res = ns.run(["gpuguard", "enable"], timeout=120)
    assert res.returncode == 0, res
    ns.wait_active("gpuguard.service", timeout=30)
    # configuration management drops the file while the daemon runs: it stops itself
    ns.path("/etc/gpuguard/disabled").write_text("rollback (CHG-2)\n")
    before = node.snapshot()
    ns.systemctl("daemon-reload")
    wait_for(
        lambda: ns.unit_property("gpuguard.service", "ActiveState") == "inactive",
        what="the daemon to stop itself",
    )
    assert ns.unit_property("gpuguard.service", "Result") == "success"
    after = node.snapshot()
    assert after["changes"] == before["changes"] and after["checkpoint"] == before["checkpoint"]
    wait_for(
        lambda: any(
            e.get("GPUGUARD_KIND") == "gpuguard-disabled" and "rollback (CHG-2)" in e["MESSAGE"]
            for e in gpuguard_entries(ns)
        ),
        what="the daemon's gpuguard-disabled entry",
    )
    assert ns.run(["gpuguard", "enable"], timeout=120).returncode == 0
    ns.wait_active("gpuguard.service", timeout=30)


def test_6_remove_and_purge(node: Node) -> None:
    ns = node.ns
    dropin = ns.path(f"/run/systemd/system/{CTR.unit}.d/60-gpuguard-devices.conf")
    wait_for(dropin.exists, what="the durable grant's drop-in")
    hook = ns.path("/etc/gpuguard/hooks.d/50-page-oncall")  # an operator's hook
    hook.write_text("#!/bin/sh\n")
    out = apt(ns, "remove", "gpuguard")
    assert "kept 1 per-container drop-in(s)" in out, out
    assert dropin.exists()  # nothing of gpuguard is left to give the GPU back
    ns.systemctl("daemon-reload")
    wait_for(lambda: has(CTR, ns, (195, 0)), what="the container's GPU after the reload")
    out = apt(ns, "purge", "gpuguard")
    kept = [line for line in out.splitlines() if line.startswith("gpuguard: kept")]
    assert any("hooks.d/50-page-oncall" in k and "inventory.json" in k for k in kept), out
    assert any("checkpoint backup(s) in /var/lib/gpuguard/backups" in k for k in kept), out
    assert ns.path("/etc/gpuguard/gpuguard.conf.d/10-node.conf").exists() and hook.exists()
    assert list(ns.path("/var/lib/gpuguard/backups").iterdir())
    assert not ns.path("/etc/gpuguard/gpuguard.conf").exists()  # the package's own
    assert sorted(p.name for p in ns.path("/var/lib/gpuguard").iterdir()) == ["backups"]


# ------------------------------------------------------- kubelet in k3s, metrics endpoint


K3S_UNIT = """[Unit]
Description=k3s agent stand-in: kubelet inside its own process
[Service]
ExecStart=/usr/local/bin/k3s-agent -c "import time; time.sleep(1e9)" agent \\
  --kubelet-arg=cgroup-driver=systemd
"""
SCRAPE = textwrap.dedent(
    """
    import socket, sys, time, urllib.request
    idle = [socket.create_connection(("127.0.0.1", 9835)) for _ in range(50)]
    slow = [socket.create_connection(("127.0.0.1", 9835)) for _ in range(20)]
    for s in slow:
        s.sendall(b"GET /metr")
    t0 = time.monotonic()
    with urllib.request.urlopen("http://127.0.0.1:9835/metrics", timeout=10) as r:
        body = r.read()
        print(r.status, round((time.monotonic() - t0) * 1000, 1), b"gpuguard_mode" in body)
    for s in idle + slow:
        s.setblocking(False)
        try:
            assert s.recv(1) != b"", "a held connection was closed before its timeout"
        except BlockingIOError:
            pass
    """
)


@pytest.fixture(scope="module")
def k3s_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PackageRoot]:
    require_pkgroot_tools()
    lower, _made = debian_root()
    tmp = tmp_path_factory.mktemp("fleet-ops-k3s")
    debs = tmp / "debs"
    debs.mkdir()
    deb = built_packages("")["deb"]
    (debs / deb.name).write_bytes(deb.read_bytes())
    binds = {"/run/host/debs": debs, **prometheus_client()}
    ns = PackageRoot(tmp / "root", lower, ro_binds=binds)
    ns.start()
    try:
        yield ns
    finally:
        ns.stop()


def test_kubelet_under_another_units_name(k3s_node: PackageRoot) -> None:
    ns = k3s_node
    etc = ns.path("/etc/gpuguard")
    (etc / "gpuguard.conf.d").mkdir(parents=True)
    (etc / "inventory.json").write_text(json.dumps(INVENTORY))
    (etc / "gpuguard.conf.d/10-node.conf").write_text(
        "[Inventory]\nFile=/etc/gpuguard/inventory.json\nAllowKubeletRestart=yes\n"
    )
    ckpt = ns.path(CHECKPOINT)
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(FIXTURE.read_bytes())  # stale, while "kubelet" runs
    # k3s as installed: a root-owned binary at /usr/local/bin/k3s, run through a link
    # named k3s-agent (its process's name), so a kubelet gpuguard trusts
    ns.run(["cp", "-L", "/usr/bin/python3", "/usr/local/bin/k3s"], check=True)
    ns.run(["ln", "-s", "/usr/local/bin/k3s", "/usr/local/bin/k3s-agent"], check=True)
    write_unit(ns, "k3s-agent.service", K3S_UNIT)
    ns.systemctl("daemon-reload")
    ns.systemctl("start", "k3s-agent.service")
    before = ns.unit_property("k3s-agent.service", "InvocationID")
    # installed while it runs (AuditInterval=1s: passes after the first one): neither
    # the install nor the daemon restarts k3s-agent.service, the whole agent, for a
    # checkpoint that was stale before (RestartPolicy=); the package's drop-in for that
    # unit repairs the file at the agent's next start
    (etc / "gpuguard.conf.d/20-audit.conf").write_text("[Daemon]\nAuditInterval=1s\n")
    apt(ns, "install", f"/run/host/debs/gpuguard_{source_version()}-1_all.deb")
    drop = ns.unit_property("k3s-agent.service", "DropInPaths")
    assert "/usr/lib/systemd/system/k3s-agent.service.d/10-gpuguard.conf" in drop
    ns.wait_active("gpuguard.service", timeout=30)
    left = wait_for(
        lambda: [e for e in gpuguard_entries(ns) if e.get("GPUGUARD_KIND") == "checkpoint-refused"],
        what="why the repair is left to the agent's next start",
    )
    assert "stale when gpuguard started" in left[-1]["MESSAGE"], left
    status = ns.path("/run/gpuguard/status.json")
    wait_for(lambda: json.loads(status.read_text())["passes"] >= 4, what="later passes")
    assert ns.unit_property("k3s-agent.service", "InvocationID") == before
    assert MOVED_GPU in ckpt.read_text()
    assert not [e for e in gpuguard_entries(ns) if e.get("GPUGUARD_KIND") == "kubelet-restart"]
    assert ns.unit_property("gpuguard.service", "NRestarts") == "0"
    assert ns.unit_property("kubelet.service", "LoadState") == "not-found"

    def hook_repairs() -> List[Dict[str, Any]]:
        return [
            e
            for e in gpuguard_entries(ns)
            if e.get("GPUGUARD_KIND") == "checkpoint-repaired"
            and e.get("_SYSTEMD_UNIT") == "k3s-agent.service"
        ]

    ns.systemctl("restart", "k3s-agent.service")  # the operator's, or the next boot's
    assert MOVED_GPU not in ckpt.read_text()
    wait_for(lambda: len(hook_repairs()) == 1, what="the hook's repair entry")
    # stale again: a plain restart of that unit runs the hook, which repairs it; a pass
    # of the daemon while the unit restarts leaves the file to the hook (one writer)
    ckpt.write_bytes(FIXTURE.read_bytes())
    t0 = time.time()
    ns.systemctl("restart", "k3s-agent.service")
    assert MOVED_GPU not in ckpt.read_text()
    result = json.loads(ns.path("/run/gpuguard/kubelet-hook.result").read_text())
    assert result["time"] >= t0 and result["outcome"] in ("repaired", "healthy"), result
    wait_for(lambda: len(hook_repairs()) == 2, what="the second repair's entry")
    repairs = [e for e in gpuguard_entries(ns) if e.get("GPUGUARD_KIND") == "checkpoint-repaired"]
    assert {e.get("_SYSTEMD_UNIT") for e in repairs} == {"k3s-agent.service"}, repairs
    # doctor reads kubelet's flags from the running k3s process and checks its unit
    doc = json.loads(ns.run(["gpuguard", "doctor", "--json"], timeout=60).stdout)
    checks = {c["check"]: c for c in doc["checks"]}
    driver = checks["kubelet-cgroup-driver"]["evidence"]
    assert "cgroupDriver=systemd" in driver and "k3s-agent (pid" in driver, driver
    assert "in k3s-agent.service" in driver
    assert checks["kubelet-dropin"]["verdict"] == "ok"
    assert "k3s-agent.service.d/10-gpuguard.conf" in checks["kubelet-dropin"]["evidence"]


def test_a_scrape_answers_beside_idle_and_slow_connections(k3s_node: PackageRoot) -> None:
    ns = k3s_node
    ns.systemctl("enable", "--now", "gpuguard-metrics.socket")
    wait_for(lambda: ns.path("/run/gpuguard/metrics.json").exists(), what="metrics.json")
    res = ns.run(["python3", "-c", SCRAPE], timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    status, ms, has_mode = res.stdout.split()
    assert status == "200" and has_mode == "True"
    print(f"\nscrape beside 50 idle and 20 slow connections: {ms} ms (bench/README.md)")
