"""The real daemon, from the repo's unit file, on a real systemd (PID 1 of a namespace)."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from gpuguard.checkpoint import parse, verify
from gpuguard.host.systemd import Systemd, SystemdError
from integration.daemon_faults import host_pid, main_pid
from integration.gpuguard_ns import (
    BEFORE_CHANGE,
    CHECKPOINT,
    INVENTORY,
    KEPT_GPU,
    MOVED_GPU,
    bus_connections,
    events,
    gpuguard_units,
    kubelet_reads,
    passes,
    settle,
    setup_node,
    status,
    wait_for,
)
from integration.harness import systemd_ns as systemd_ns

pytestmark = pytest.mark.root


def _active_enter_us(ns, unit: str) -> int:  # type: ignore[no-untyped-def]
    out = ns.run(
        [
            "busctl",
            "get-property",
            "org.freedesktop.systemd1",
            "/org/freedesktop/systemd1/unit/" + unit.replace(".", "_2e").replace("-", "_2d"),
            "org.freedesktop.systemd1.Unit",
            "ActiveEnterTimestamp",
        ],
        check=True,
    ).stdout.split()
    return int(out[1])


def _start(ns) -> None:  # type: ignore[no-untyped-def]
    r = ns.systemctl("start", "gpuguard.service")
    assert r.returncode == 0, (
        r.stderr + "\n" + ns.run(["journalctl", "-u", "gpuguard", "-n", "40"]).stdout
    )


def test_ready_only_after_the_first_pass_which_repairs_at_boot(systemd_ns) -> None:  # type: ignore[no-untyped-def]
    ns = systemd_ns(units=gpuguard_units())
    setup_node(ns, stale=True)
    _start(ns)  # Type=notify: returns once READY=1 arrived
    assert ns.unit_property("gpuguard.service", "ActiveState") == "active"
    # the unit's Nice= (a reload's repair ahead of systemd's re-apply), set by systemd
    # under the unit's system call filter, which forbids gpuguard to set it itself
    pid = host_pid(ns, main_pid(ns))
    assert pid is not None and os.getpriority(os.PRIO_PROCESS, pid) == -10
    st = status(ns)
    first = st["first_pass"]
    ready_us = _active_enter_us(ns, "gpuguard.service")
    assert first["ended"] * 1e6 <= ready_us, "READY=1 came before the first pass ended"
    assert "start-up" in first["reasons"]
    # kubelet is not running yet: the boot pass repaired the checkpoint directly.
    cp = parse(ns.path(CHECKPOINT).read_bytes(), source=CHECKPOINT)
    assert verify(cp)
    ids = [i for e in cp.entries or () for i in e.all_device_ids()]
    assert KEPT_GPU in ids and MOVED_GPU not in ids
    kinds = [e["GPUGUARD_KIND"] for e in events(ns)]
    assert kinds.index("pass-complete") < kinds.index("daemon-started")
    assert "checkpoint-repaired" in kinds
    repaired = events(ns, "checkpoint-repaired")[0]
    assert repaired["MESSAGE_ID"] and repaired["SYSLOG_IDENTIFIER"] == "gpuguard"
    assert ns.path(repaired["BACKUP"]).exists()


@pytest.mark.parametrize("verb", ["daemon-reload", "daemon-reexec"])
def test_reload_and_reexec_each_trigger_exactly_one_pass(systemd_ns, verb: str) -> None:  # type: ignore[no-untyped-def]
    ns = systemd_ns(units=gpuguard_units())
    setup_node(ns, stale=False)
    _start(ns)
    ns.systemctl("start", "kubelet.service")
    wait_for(
        lambda: "kubelet.service started" in " ".join(status(ns)["last_pass"]["reasons"]),
        what="the pass for kubelet's start",
    )
    before = settle(ns)
    for i in range(3):
        r = ns.systemctl(verb)
        assert r.returncode == 0, r.stderr
        # a reexec's new manager may come up after settle()'s quiet time: wait for a pass
        wait_for(lambda b=before: passes(ns) > b, timeout=30, what=f"a pass after {verb}")
        after = settle(ns)
        assert after == before + 1, f"{verb} #{i + 1} gave {after - before} passes"
        assert any("systemd:" in why for why in status(ns)["last_pass"]["reasons"])
        before = after
    assert ns.unit_property("gpuguard.service", "ActiveState") == "active"


def test_kubelet_restart_repairs_before_kubelet_reads(systemd_ns) -> None:  # type: ignore[no-untyped-def]
    ns = systemd_ns(units=gpuguard_units())
    setup_node(ns, stale=False)
    _start(ns)
    ns.systemctl("start", "kubelet.service")
    ns.wait_active("kubelet.service")
    before = settle(ns)
    # The GPUs change under a running kubelet: its next start must not see the old IDs.
    setup_node(ns, stale=True)
    assert ns.systemctl("restart", "kubelet.service").returncode == 0
    wait_for(lambda: passes(ns) > before, what="a pass after the kubelet restart")
    # the fake kubelet records its read a few commands after its unit is active
    reads = wait_for(lambda: kubelet_reads(ns) if len(kubelet_reads(ns)) >= 2 else None,
                     what="kubelet's second read")  # fmt: skip
    assert len(reads) == 2
    seen = parse(reads[-1], source="what kubelet read")
    assert verify(seen), "kubelet would reject the repaired checkpoint"
    ids = [i for e in seen.entries or () for i in e.all_device_ids()]
    assert MOVED_GPU not in ids and KEPT_GPU in ids
    assert "kubelet.service started" in " ".join(status(ns)["last_pass"]["reasons"])


# numa-blog-04's second pod holds MOVED_GPU; before the GPUs changed it was in the slot
# where INVENTORY now has another GPU, so the history remaps that pod's entry.
POD_B = "94283d1b-ce5a-4797-bff8-0cf0c7143b2b"
NEW_IN_SLOT = INVENTORY["gpus"][2]["uuid"]
BEFORE = BEFORE_CHANGE


def _gpus(ns, inventory) -> None:  # type: ignore[no-untyped-def]
    ns.path("/etc/gpuguard/inventory.json").write_text(json.dumps(inventory))


def _node_before_the_change(ns, config: str) -> None:  # type: ignore[no-untyped-def]
    """The original checkpoint, matching the GPUs it was written under."""
    setup_node(ns, stale=True, config=config)
    _gpus(ns, BEFORE)


def test_daemon_restarts_running_kubelet_only_for_a_pod_it_brings_back(systemd_ns) -> None:  # type: ignore[no-untyped-def]
    ns = systemd_ns(units=gpuguard_units())
    # The inventory is a file (a simulation): restarting a running kubelet for it must be
    # allowed explicitly (test_daemon_leaves_kubelet_alone_for_a_simulated_inventory)
    _node_before_the_change(ns, "[Inventory]\nAllowKubeletRestart=yes\n")
    _start(ns)
    ns.systemctl("start", "kubelet.service")
    settle(ns)
    assert ns.path("/var/lib/gpuguard/gpu-identity.json").exists()  # the healthy GPUs
    _gpus(ns, INVENTORY)  # the GPUs change under the running kubelet
    ns.systemctl("daemon-reload")  # any pass finds the remap
    left = wait_for(lambda: events(ns, "checkpoint-refused"), what="why it is left")
    assert "kubelet has no pod whose entry is remapped" in left[-1]["MESSAGE"]
    settle(ns)
    assert len(kubelet_reads(ns)) == 1 and not events(ns, "kubelet-restart")
    ns.path(f"/var/lib/kubelet/pods/{POD_B}").mkdir(parents=True)  # kubelet has the pod
    ns.systemctl("daemon-reload")
    wait_for(lambda: len(kubelet_reads(ns)) == 2, what="kubelet restarted by gpuguard")
    seen = parse(kubelet_reads(ns)[-1], source="what kubelet read")
    ids = [i for e in seen.entries or () for i in e.all_device_ids()]
    assert verify(seen) and MOVED_GPU not in ids and NEW_IN_SLOT in ids
    (restart,) = wait_for(lambda: events(ns, "kubelet-restart"), what="kubelet-restart")
    assert restart["POD_UIDS"] == POD_B and f"for pod(s) {POD_B}" in restart["MESSAGE"]


def test_daemon_start_never_restarts_kubelet(systemd_ns) -> None:  # type: ignore[no-untyped-def]
    """An install or upgrade: the daemon starts under a running kubelet whose checkpoint
    is stale, with the pod there. Neither its start nor a later pass restarts kubelet;
    kubelet's next start repairs the file (its pre-start hook)."""
    ns = systemd_ns(units=gpuguard_units())
    _node_before_the_change(ns, "[Inventory]\nAllowKubeletRestart=yes\n")
    ns.systemctl("start", "kubelet.service")  # its hook records the GPUs of before
    ns.wait_active("kubelet.service")
    invocation = ns.unit_property("kubelet.service", "InvocationID")
    ns.path(f"/var/lib/kubelet/pods/{POD_B}").mkdir(parents=True)
    _gpus(ns, INVENTORY)
    _start(ns)
    left = wait_for(lambda: events(ns, "checkpoint-refused"), what="why it is left")
    assert "stale when gpuguard started" in left[-1]["MESSAGE"]
    settle(ns)
    ns.systemctl("daemon-reload")  # a later pass: still not restarted for
    settle(ns)
    assert ns.unit_property("kubelet.service", "InvocationID") == invocation
    assert len(kubelet_reads(ns)) == 1 and not events(ns, "kubelet-restart")
    assert ns.systemctl("restart", "kubelet.service").returncode == 0  # the operator's
    wait_for(lambda: len(kubelet_reads(ns)) == 2, what="kubelet's next start")
    ids = [i for e in parse(kubelet_reads(ns)[-1], source="read").entries or () for i in
           e.all_device_ids()]  # fmt: skip
    assert MOVED_GPU not in ids and NEW_IN_SLOT in ids


def test_daemon_leaves_kubelet_alone_for_a_simulated_inventory(systemd_ns) -> None:  # type: ignore[no-untyped-def]
    """docs/inventory.md: a simulation never restarts a running kubelet, whether the
    file comes from --inventory or [Inventory] File= (here). Its next start repairs it."""
    ns = systemd_ns(units=gpuguard_units())
    setup_node(ns, stale=False)
    _start(ns)
    ns.systemctl("start", "kubelet.service")
    invocation = ns.unit_property("kubelet.service", "InvocationID")
    before = settle(ns)
    setup_node(ns, stale=True)
    ns.systemctl("daemon-reload")  # a pass finds the stale checkpoint
    wait_for(lambda: passes(ns) > before, what="a pass after the reload")
    left = wait_for(lambda: events(ns, "checkpoint-refused"), what="why it is left")
    assert "(a simulation)" in left[-1]["MESSAGE"]
    settle(ns)
    assert ns.unit_property("kubelet.service", "InvocationID") == invocation
    assert len(kubelet_reads(ns)) == 1 and not events(ns, "kubelet-restart")


def test_survives_dbus_restart(systemd_ns) -> None:  # type: ignore[no-untyped-def]
    ns = systemd_ns(units=gpuguard_units())
    setup_node(ns, stale=False)
    _start(ns)
    before = settle(ns)
    connected = bus_connections(ns)
    ns.run(["systemctl", "kill", "-s", "KILL", "dbus.service"], check=True)
    wait_for(
        lambda: not status(ns).get("bus_connected", True) or passes(ns) > before,
        what="gpuguard to notice the bus going away",
    )
    ns.run(["systemctl", "start", "dbus.service"], check=True)
    wait_for(lambda: events(ns, "dbus-lost"), what="dbus-lost logged")
    wait_for(lambda: bus_connections(ns) > connected, timeout=30, what="reconnect")
    wait_for(lambda: passes(ns) > before, what="the pass after reconnecting")
    after_reconnect = settle(ns)
    assert after_reconnect > before  # a full pass after reconnecting
    assert "reconnected to the system bus" in json.dumps(status(ns))
    ns.systemctl("daemon-reload")
    assert settle(ns) == after_reconnect + 1  # and signals flow again
    assert ns.unit_property("gpuguard.service", "ActiveState") == "active"


def test_sighup_with_broken_config_keeps_the_old_one(systemd_ns) -> None:  # type: ignore[no-untyped-def]
    ns = systemd_ns(units=gpuguard_units())
    setup_node(ns, stale=False)
    _start(ns)
    settle(ns)
    conf = ns.path("/etc/gpuguard/gpuguard.conf")
    good = conf.read_text()
    conf.write_text(good + "[Daemon]\nQuietPeriod=banana\n")
    # systemctl reload checks the file first (ExecReload=gpuguard config --check): it
    # fails, and the daemon never sees the signal
    res = ns.systemctl("reload", "gpuguard.service", check=False)
    assert res.returncode != 0
    assert not events(ns, "config-rejected") and not events(ns, "config-reloaded")
    # a SIGHUP sent directly: the daemon itself keeps the previous configuration
    ns.run(["systemctl", "kill", "-s", "HUP", "gpuguard.service"], check=True)
    rejected = wait_for(lambda: events(ns, "config-rejected"), what="config-rejected")
    assert "gpuguard.conf" in rejected[0]["MESSAGE"] and "QuietPeriod" in rejected[0]["MESSAGE"]
    assert ns.unit_property("gpuguard.service", "ActiveState") == "active"
    conf.write_text(good + "[Daemon]\nQuietPeriod=50ms\n")
    ns.run(["systemctl", "kill", "-s", "HUP", "gpuguard.service"], check=True)
    wait_for(lambda: events(ns, "config-reloaded"), what="config-reloaded")
    # SIGTERM: finishes and exits 0 (no failed state)
    ns.run(["systemctl", "kill", "-s", str(int(signal.SIGTERM)), "gpuguard.service"], check=True)
    wait_for(lambda: ns.unit_property("gpuguard.service", "ActiveState") in ("inactive", "failed"))
    assert ns.unit_property("gpuguard.service", "Result") == "success"


def test_bounded_dbus_calls_survive_hundreds_in_flight(systemd_ns) -> None:  # type: ignore[no-untyped-def]
    """500 concurrent calls through the daemon's D-Bus layer: none fails, none is lost."""
    ns = systemd_ns()
    scopes = []
    for i in range(20):
        unit = f"gg-test-{i}.scope"
        ns.popen(
            [
                "systemd-run",
                "--scope",
                f"--unit={unit}",
                "-p",
                "DevicePolicy=closed",
                "sleep",
                "300",
            ]
        )
        scopes.append(unit)
    wait_for(
        lambda: all(ns.unit_property(u, "ActiveState") == "active" for u in scopes),
        what="scopes active",
    )

    async def main() -> tuple[list[str], str]:
        sd = Systemd(ns.bus_address, max_in_flight=64)
        await sd.connect()
        try:
            calls = []
            for i in range(300):
                calls.append(sd.unit_state(scopes[i % len(scopes)]))
            for i in range(200):
                dev = ("/dev/null", "rw") if i % 2 else ("/dev/zero", "rw")
                calls.append(
                    sd.set_unit_properties(
                        scopes[i % len(scopes)], True, [("DeviceAllow", _variant([dev]))]
                    )
                )
            results = await asyncio.gather(*calls, return_exceptions=True)
            errors = [repr(r) for r in results if isinstance(r, BaseException)]
            try:
                await sd.call("GetUnit", "s", ["no-such-unit.service"])
                missing = ""
            except SystemdError as e:
                missing = e.name
            return errors, missing
        finally:
            sd.disconnect()

    errors, missing = asyncio.run(main())
    assert errors == [], f"{len(errors)} calls failed, e.g. {errors[:2]}"
    assert missing == "org.freedesktop.systemd1.NoSuchUnit"  # error replies are raised
    allow = ns.cgroup_dir("devices") / "system.slice" / scopes[1] / "devices.list"
    assert "c 1:3 rw" in allow.read_text()


def _variant(devices: list[tuple[str, str]]):  # type: ignore[no-untyped-def]
    from dbus_next import Variant

    return Variant("a(ss)", [list(d) for d in devices])


def test_operator_hook_gets_the_pass_as_json(systemd_ns) -> None:  # type: ignore[no-untyped-def]
    ns = systemd_ns(units=gpuguard_units())
    setup_node(ns, stale=True)
    hooks = ns.path("/etc/gpuguard/hooks.d")
    hooks.mkdir(parents=True)
    # Hooks run inside gpuguard's sandbox: /run/gpuguard is one of the few writable paths.
    record = hooks / "10-record"
    record.write_text(
        "#!/bin/sh\ncat > /run/gpuguard/hook-stdin.json\n"
        'echo "$GPUGUARD_EVENT|$GPUGUARD_FINDINGS|$GPUGUARD_KINDS" > /run/gpuguard/hook-env\n'
    )
    record.chmod(0o755)
    unsafe = hooks / "20-writable"
    unsafe.write_text("#!/bin/sh\ntouch /run/gpuguard/should-not-run\n")
    unsafe.chmod(0o777)
    _start(ns)
    env = ns.path("/run/gpuguard/hook-env")  # the shell creates it, then writes it
    seen = wait_for(lambda: env.exists() and env.read_text().endswith("\n"), what="hook ran")
    assert seen
    doc = json.loads(ns.path("/run/gpuguard/hook-stdin.json").read_text())
    assert doc["event"] == "start-up"
    assert {f["kind"] for f in doc["findings"]} >= {"checkpoint-stale-entry"}
    assert [a["status"] for a in doc["actions"] if a["kind"] == "checkpoint-repaired"] == ["done"]
    event, count, kinds = ns.path("/run/gpuguard/hook-env").read_text().strip().split("|")
    assert event == "start-up" and int(count) >= 2 and "checkpoint-repaired" in kinds
    assert not ns.path("/run/gpuguard/should-not-run").exists()
    assert any("20-writable" in e["MESSAGE"] for e in events(ns, "hook-refused"))
