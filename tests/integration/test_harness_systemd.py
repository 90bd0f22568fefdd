"""The systemd-in-a-namespace harness boots a usable systemd and leaves nothing behind."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import pytest

from integration.harness import SystemdNamespace, require_systemd_ns
from integration.harness import systemd_ns as systemd_ns

pytestmark = pytest.mark.root

Factory = Callable[..., SystemdNamespace]

NOTIFY_SCRIPT = """\
import os
import time

import systemd.daemon

print("notify-unit GREETING=" + os.environ.get("GREETING", "<unset>"), flush=True)
with open("/run/harness/out/ready", "w") as f:
    f.write(str(os.getpid()))
systemd.daemon.notify("READY=1")
time.sleep(300)
"""

NOTIFY_UNIT = """\
[Unit]
Description=harness Type=notify test unit

[Service]
Type=notify
ExecStart=/usr/bin/python3 /run/harness/notify.py
"""

WATCHED = ("/dev", "/run/systemd", "/etc/systemd/system", "/var/log/journal")
TMPFILES_NAMES = (".X11-unix", ".ICE-unix", ".XIM-unix", ".font-unix", ".Test-unix")


def _listing(top: str) -> List[str]:
    """Recursive listing (paths and symlink targets) of a host directory."""
    if not os.path.lexists(top):
        return ["<absent>"]
    out = []
    for dirpath, dirs, files in os.walk(top):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            out.append(p + (" -> " + os.readlink(p) if os.path.islink(p) else ""))
    return sorted(out)


def _host_state(marker: str) -> Dict[str, List[str]]:
    state = {top: _listing(top) for top in WATCHED}
    # what systemd-tmpfiles --boot would create in a /tmp it could reach
    state["/tmp"] = [n for n in TMPFILES_NAMES if os.path.lexists(os.path.join("/tmp", n))]
    with open("/proc/self/mountinfo") as f:
        state["mounts"] = [line for line in f if marker in line or "gpuguard-sysns" in line]
    return state


def _start_time(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None


def _assert_gone(ns: SystemdNamespace, procs: List[Tuple[int, Optional[str]]]) -> None:
    for pid, started in procs:
        assert started is not None
        assert _start_time(pid) != started, f"process {pid} of {ns.name} survived"


def test_boots_to_running_and_cleans_up(systemd_ns: Factory, tmp_path: Path) -> None:
    before = _host_state(str(tmp_path))
    ns = systemd_ns()
    assert ns.system_state in ("running", "degraded")
    assert ns.run(["cat", "/proc/1/comm"], check=True).stdout.strip() == "systemd"
    assert ns.run(["systemd-detect-virt", "--container"]).stdout.strip() == "container-other"
    # the journal is volatile, in the private /run
    machine_id = ns.path("/etc/machine-id").read_text().strip()
    assert ns.path(f"/run/log/journal/{machine_id}/system.journal").is_file()
    assert not any(ns.path("/var/log/journal").iterdir())
    # systemd sees its instance cgroup as "/", and its PID is in <instance>/init.scope
    assert "/init.scope" in ns.run(["cat", "/proc/1/cgroup"], check=True).stdout
    init_scope = ns.cgroup_dir("systemd") / "init.scope" / "cgroup.procs"
    assert str(ns.pid) in init_scope.read_text().split()
    # the host's /tmp is not what it sees
    assert ns.run(["test", "-e", str(tmp_path)]).returncode != 0
    # private network: only lo
    net_dev = ns.run(["cat", "/proc/net/dev"], check=True).stdout.splitlines()[2:]
    assert [line.split(":")[0].strip() for line in net_dev] == ["lo"]
    # the host root is read-only inside
    assert ns.run(["touch", "/harness-must-not-exist"]).returncode != 0
    assert not os.path.lexists("/harness-must-not-exist")

    cgroups = ns.cgroup_dirs()
    assert {"devices", "systemd", "unified", "memory"} <= set(cgroups)
    procs = [(pid, _start_time(pid)) for pid in [ns.pid, *ns.processes()]]
    assert len(procs) > 2  # systemd, journald, dbus-daemon
    ns.stop()
    assert ns.stop_seconds is not None and ns.stop_seconds < 5.0
    _assert_gone(ns, procs)
    assert not any(d.exists() for d in cgroups.values())
    assert _host_state(str(tmp_path)) == before


def test_notify_unit_and_journal(systemd_ns: Factory, tmp_path: Path) -> None:
    script = tmp_path / "notify.py"
    script.write_text(NOTIFY_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    ns = systemd_ns(
        units={"harness-notify.service": NOTIFY_UNIT},
        binds={"/run/harness/out": out},
        ro_binds={"/run/harness/notify.py": script},
        env={"GREETING": "hello world"},
    )
    ns.systemctl("start", "harness-notify.service", timeout=15)
    ns.wait_active("harness-notify.service")
    assert ns.unit_property("harness-notify.service", "Type") == "notify"
    messages = [e.get("MESSAGE") for e in ns.journal("harness-notify.service")]
    assert "notify-unit GREETING=hello world" in messages
    # written through the read-write bind, seen on the host
    main_pid = ns.unit_property("harness-notify.service", "MainPID")
    assert (out / "ready").read_text() == main_pid
    # the read-only bind really is read-only
    assert ns.run(["touch", "/run/harness/notify.py"]).returncode != 0
    ns.systemctl("restart", "harness-notify.service", timeout=15)
    ns.wait_active("harness-notify.service")


def test_daemon_reload_seen_by_host_dbus_client(systemd_ns: Factory) -> None:
    from dbus_next import BusType
    from dbus_next.aio import MessageBus

    ns = systemd_ns()
    ns.run(["busctl", "status", "org.freedesktop.systemd1"], check=True)

    async def scenario() -> List[bool]:
        bus = await MessageBus(bus_address=ns.bus_address, bus_type=BusType.SYSTEM).connect()
        try:
            path = "/org/freedesktop/systemd1"
            intro = await bus.introspect("org.freedesktop.systemd1", path)
            obj = bus.get_proxy_object("org.freedesktop.systemd1", path, intro)
            manager = obj.get_interface("org.freedesktop.systemd1.Manager")
            seen: List[bool] = []
            done = asyncio.Event()

            def on_reloading(active: bool) -> None:
                seen.append(active)
                if not active:
                    done.set()

            manager.on_reloading(on_reloading)
            await manager.call_subscribe()
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, lambda: ns.systemctl("daemon-reload", timeout=30))
            await asyncio.wait_for(done.wait(), 10)
            return seen
        finally:
            bus.disconnect()

    assert asyncio.run(scenario()) == [True, False]


def test_scope_device_policy_visible_in_v1_devices_cgroup(systemd_ns: Factory) -> None:
    ns = systemd_ns()
    ns.popen(
        [
            "systemd-run",
            "--scope",
            "--unit=harness-dev.scope",
            "-p",
            "DevicePolicy=strict",
            "-p",
            "DeviceAllow=/dev/null rw",
            "sleep",
            "300",
        ]
    )
    ns.wait_active("harness-dev.scope")
    devices_list = ns.cgroup_dir("devices") / "system.slice" / "harness-dev.scope" / "devices.list"
    rules = devices_list.read_text().split("\n")
    assert "c 1:3 rw" in rules
    assert "a *:* rwm" not in rules
    # the sleep runs in that scope (host PIDs in the instance's devices cgroup)
    procs = (devices_list.parent / "cgroup.procs").read_text().split()
    assert len(procs) == 1
    cgroups = ns.cgroup_dirs()
    tracked = [(pid, _start_time(pid)) for pid in [ns.pid, *ns.processes()]]
    ns.stop()
    _assert_gone(ns, tracked)
    assert not any(d.exists() for d in cgroups.values())


def test_instances_run_concurrently_and_one_after_another(systemd_ns: Factory) -> None:
    a = systemd_ns()
    b = systemd_ns()
    assert a.pid != b.pid
    ids = {ns.path("/etc/machine-id").read_text() for ns in (a, b)}
    assert len(ids) == 2
    a.write_unit("harness-only-a.service", "[Service]\nExecStart=/bin/sleep 300\n", reload=True)
    a.systemctl("start", "harness-only-a.service")
    a.wait_active("harness-only-a.service")
    assert b.unit_property("harness-only-a.service", "LoadState") == "not-found"
    assert a.cgroup_dir("devices") != b.cgroup_dir("devices")
    a.stop()
    assert b.run(["systemctl", "is-system-running"]).stdout.strip() in ("running", "degraded")
    c = systemd_ns()
    assert c.system_state in ("running", "degraded")


def test_context_manager_stops_on_exception(tmp_path: Path) -> None:
    require_systemd_ns()
    before = _host_state(str(tmp_path))
    holder: Dict[str, SystemdNamespace] = {}
    tracked: List[Tuple[int, Optional[str]]] = []
    with pytest.raises(ZeroDivisionError), SystemdNamespace(tmp_path / "ns") as ns:
        holder["ns"] = ns
        tracked.extend((pid, _start_time(pid)) for pid in [ns.pid, *ns.processes()])
        cgroups = ns.cgroup_dirs()
        1 / 0  # noqa: B018
    _assert_gone(holder["ns"], tracked)
    assert not any(d.exists() for d in cgroups.values())
    assert _host_state(str(tmp_path)) == before


def test_v2_layout_boots_unified_and_enforces_scope_device_policy(
    systemd_ns: Factory, tmp_path: Path
) -> None:
    """A unified node: cgroup2 alone at /sys/fs/cgroup (no v1 mount in mountinfo),
    systemd unified, a scope's DeviceAllow= enforced by its BPF device program."""
    import stat

    from gpuguard.devices.probe import probe_open, query_device_programs

    nodes = tmp_path / "nodes"
    nodes.mkdir()
    for minor in (0, 1):
        os.mknod(nodes / f"nvidia{minor}", stat.S_IFCHR | 0o666, os.makedev(195, minor))
    ns = systemd_ns(layout="v2", ro_binds={"/run/nodes": nodes})
    assert ns.run(["stat", "-fc", "%T", "/sys/fs/cgroup"], check=True).stdout.strip() == "cgroup2fs"
    mounts = ns.run(["cat", "/proc/1/mountinfo"], check=True).stdout
    cgroup_mounts = [ln.split()[4] for ln in mounts.splitlines() if " - cgroup" in ln]
    assert cgroup_mounts == ["/sys/fs/cgroup"], cgroup_mounts
    # this kernel still has the host's v1 hierarchies: /proc/PID/cgroup lists them
    # (at the namespace's root), but systemd only manages the cgroup2 line
    assert "0::/init.scope" in ns.run(["cat", "/proc/1/cgroup"], check=True).stdout.split()
    ns.run(["ln", "-s", "/run/nodes/nvidia1", "/dev/char/195:1"], check=True)
    ns.popen(
        [
            "systemd-run",
            "--scope",
            "--unit=harness-dev.scope",
            "-p",
            "DevicePolicy=strict",
            "-p",
            "DeviceAllow=/dev/null rw",
            "-p",
            "DeviceAllow=/dev/char/195:1 rw",
            "sleep",
            "300",
        ]
    )
    ns.wait_active("harness-dev.scope")
    scope = ns.cgroup_dir("unified") / "system.slice" / "harness-dev.scope"
    assert query_device_programs(scope), "systemd attached no device program"
    assert probe_open(nodes / "nvidia0", [scope]).verdict is False  # EPERM
    assert probe_open(nodes / "nvidia1", [scope]).verdict is True  # ENXIO
    cgroups = ns.cgroup_dirs()
    tracked = [(pid, _start_time(pid)) for pid in [ns.pid, *ns.processes()]]
    ns.stop()
    _assert_gone(ns, tracked)
    assert not any(d.exists() for d in cgroups.values())
