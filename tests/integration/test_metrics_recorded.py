"""The recorded scrapes in tests/fixtures/metrics/ are what the real daemon serves.

The repo's gpuguard.service and gpuguard-metrics.socket run on a real systemd (as in
test_metrics_prometheus.py) and the endpoint is scraped over TCP in each state the
alert rules in deploy/monitoring/ speak of: a healthy node, a damaged node in observe
mode, the same node after its repair, the off switch set, and a node gpuguard cannot
judge (no inventory: no NVML); and, on cgroup v1, a GPU container that lost its device
at a daemon-reload while gpuguard observed, then re-granted in repair mode. Each
scrape's shape (every metric name with its label
names, and which condition has which status) must match the recorded file, so a
change to the exposition shows here and in the promtool tests built from the files
(tests/unit/test_monitoring_rules.py). `GPUGUARD_RECORD_METRICS=1` rewrites the files
from this run instead (tests/fixtures/metrics/README.md)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Set, Tuple

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO, require_tool
from gpuguard.checkpoint import Checkpoint, marshal
from integration.gpu_scopes import (
    FAKE_DRIVER,
    boot_node,
    containers,
    fake_proc_devices,
    gpu_inventory,
    has,
    start,
    write_config,
)
from integration.gpuguard_ns import (
    CHECKPOINT,
    FIXTURE,
    INVENTORY,
    gpuguard_units,
    setup_node,
    status,
    wait_for,
)
from integration.harness import systemd_ns as systemd_ns
from integration.test_metrics_prometheus import PORTS, fetch, metrics_units

pytestmark = pytest.mark.root

FIXTURES = REPO / "tests/fixtures/metrics"
RECORD = os.environ.get("GPUGUARD_RECORD_METRICS") == "1"
BASE = "[Daemon]\nAuditInterval=1s\n"


def fake_pci(base: Path, inventory: Dict[str, Any] = INVENTORY) -> Path:
    """The inventory's GPUs on the PCI bus (3D controllers, as sysfs shows them)."""
    pci = base / "pci-devices"
    for gpu in inventory["gpus"]:
        d = pci / str(gpu["pci_bus_id"])[4:].lower()
        d.mkdir(parents=True)
        (d / "vendor").write_text("0x10de\n")
        (d / "class").write_text("0x030200\n")
        (d / "device").write_text("0x2330\n")
    return pci


def registering_all(ns: Any) -> None:
    """The checkpoint as kubelet leaves it once the device plugin has registered every
    GPU the node has (setup_node's repaired one lists only the GPUs it kept)."""
    from dataclasses import replace

    from gpuguard.checkpoint import marshal, parse

    path = ns.path(CHECKPOINT)
    uuids = tuple(str(g["uuid"]) for g in INVENTORY["gpus"])
    ckpt = replace(parse(path.read_bytes(), source="test"), registered=(("nvidia.com/gpu", uuids),))
    path.write_bytes(marshal(ckpt))


def shape(text: str) -> Tuple[Set[Tuple[str, Tuple[str, ...]]], Set[Tuple[str, str]]]:
    """(metric name, label names) of every sample, and the (condition, status) pairs
    whose gpuguard_node_condition_status is 1."""
    names, conditions = set(), set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            names.add((s.name, tuple(sorted(s.labels))))
            if s.name == "gpuguard_node_condition_status" and s.value == 1:
                conditions.add((s.labels["condition"], s.labels["status"]))
    return names, conditions


def recorded(scraped: Dict[str, str]) -> None:
    """Write the scrapes (GPUGUARD_RECORD_METRICS=1), or compare them with the files."""
    if RECORD:
        FIXTURES.mkdir(exist_ok=True)
        for name, text in scraped.items():
            (FIXTURES / f"{name}.prom").write_text(text)
    for name, text in scraped.items():
        want = shape((FIXTURES / f"{name}.prom").read_text())
        assert shape(text) == want, name


def test_recorded_scrapes_are_what_the_daemon_serves(systemd_ns, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    require_tool("promtool")
    ns = systemd_ns(
        units={**gpuguard_units(), **metrics_units(0), **FAKE_DRIVER},
        extra_mask=(),
        ro_binds={
            "/sys/bus/pci/devices": fake_pci(tmp_path),
            "/run/fake/devices": fake_proc_devices(tmp_path / "devices"),
        },
    )
    port = int(ns.run(["python3", "-c", PORTS], check=True).stdout.split()[0])
    ns.write_unit(
        "gpuguard-metrics.socket.d/50-test.conf",
        f"[Socket]\nListenStream=\nListenStream=127.0.0.1:{port}\n",
        reload=True,
    )
    conf = ns.path("/etc/gpuguard/gpuguard.conf")
    scraped: Dict[str, str] = {}

    def settled(n: int = 3) -> None:
        start = int(status(ns).get("passes", 0))
        wait_for(lambda: int(status(ns).get("passes", 0)) >= start + n, what=f"{n} passes")

    def scrape(name: str) -> None:
        scraped[name] = fetch(ns, f"http://127.0.0.1:{port}/metrics")

    def reconfigure(config: str) -> None:
        conf.write_text(config)
        assert ns.systemctl("reload", "gpuguard.service").returncode == 0
        settled()

    setup_node(ns, stale=False, config=BASE)
    registering_all(ns)
    inventory = conf.read_text()
    ns.systemctl("start", "gpuguard.service")
    ns.systemctl("start", "gpuguard-metrics.socket")
    settled()
    scrape("healthy")

    reconfigure(inventory + "Mode=observe\n")  # first: repair mode would repair it at once
    ns.path(CHECKPOINT).write_bytes(FIXTURE.read_bytes())  # names a GPU no longer there
    settled()
    scrape("observe-damaged")

    reconfigure(inventory)  # repair mode: repaired now, or at kubelet's next start
    ns.systemctl("restart", "kubelet.service")
    settled()
    scrape("repaired")

    ns.path("/etc/gpuguard/disabled").write_text("maintenance window\n")
    scrape("disabled")  # read at each scrape, whether or not the daemon saw it yet
    ns.path("/etc/gpuguard/disabled").unlink()

    conf.write_text(BASE)  # no inventory: no NVML here, so nothing can be judged
    # the daemon may have stopped at the switch (as `gpuguard disable` stops it)
    assert ns.systemctl("restart", "gpuguard.service").returncode == 0
    settled()
    scrape("unknown")

    recorded(scraped)
    # each state is what its name says (so the rules' tests read the right file)
    cond = {n: shape(t)[1] for n, t in scraped.items()}
    assert ("KubeletCheckpointStale", "false") in cond["healthy"]
    assert ("KubeletCheckpointStale", "true") in cond["observe-damaged"]
    assert 'gpuguard_mode{mode="observe"} 1.0' in scraped["observe-damaged"]
    assert ("KubeletCheckpointStale", "false") in cond["repaired"]
    assert {s for _, s in cond["disabled"]} == {"unknown"}
    assert "\ngpuguard_disabled 1.0\n" in scraped["disabled"]
    assert ("KubeletCheckpointStale", "unknown") in cond["unknown"]
    problems: Any = [c for c in cond["healthy"] if c[1] != "false"]
    assert not problems, problems


def test_recorded_scrapes_of_a_gpu_container_losing_its_device(systemd_ns, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """F2 on cgroup v1: a GPU container (a systemd scope granted its GPU behind systemd's
    back, as the legacy NVIDIA hook does) loses it at a daemon-reload while gpuguard only
    observes (`observe-access-lost`: GPUDeviceAccessLost true, the re-grant a dry-run),
    then gpuguard in repair mode re-grants it (`access-repaired`)."""
    require_tool("promtool")
    (ctr,) = containers(1)
    gpus = gpu_inventory(2)
    ns = boot_node(
        systemd_ns,
        tmp_path,
        [ctr],
        layout="v1",
        config="[Daemon]\nAuditInterval=1s\nMode=observe\n",
        units=metrics_units(0),
        binds={"/sys/bus/pci/devices": fake_pci(tmp_path, gpus)},
    )
    port = int(ns.run(["python3", "-c", PORTS], check=True).stdout.split()[0])
    ns.write_unit(
        "gpuguard-metrics.socket.d/50-test.conf",
        f"[Socket]\nListenStream=\nListenStream=127.0.0.1:{port}\n",
        reload=True,
    )
    uuids = tuple(str(g["uuid"]) for g in gpus["gpus"])
    ckpt = ns.path(CHECKPOINT)
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    ckpt.write_bytes(marshal(Checkpoint("v2", (), (("nvidia.com/gpu", uuids),), 0, None)))
    scraped: Dict[str, str] = {}

    def settled(n: int = 3) -> None:
        start_at = int(status(ns).get("passes", 0))
        wait_for(lambda: int(status(ns).get("passes", 0)) >= start_at + n, what=f"{n} passes")

    ns.systemctl("start", "gpuguard.service")
    ns.systemctl("start", "gpuguard-metrics.socket")
    start(ns, ctr)
    settled()
    assert has(ctr, ns, (195, ctr.gpus[0]))
    ns.systemctl("daemon-reload")  # systemd re-applies the scope's DeviceAllow=: F2
    settled()
    assert not has(ctr, ns, (195, ctr.gpus[0]))  # observe mode changed nothing
    scraped["observe-access-lost"] = fetch(ns, f"http://127.0.0.1:{port}/metrics")

    write_config(ns, "[Daemon]\nAuditInterval=1s\n")
    assert ns.systemctl("reload", "gpuguard.service").returncode == 0
    wait_for(lambda: has(ctr, ns, (195, ctr.gpus[0])), what="the GPU re-granted")
    settled()
    scraped["access-repaired"] = fetch(ns, f"http://127.0.0.1:{port}/metrics")

    recorded(scraped)
    lost, repaired = (shape(scraped[n])[1] for n in ("observe-access-lost", "access-repaired"))
    assert ("GPUDeviceAccessLost", "true") in lost
    assert ("GPUDeviceAccessLost", "false") in repaired
    assert 'kind="cgroup-v1-allow",outcome="dry-run"' in scraped["observe-access-lost"]
    assert 'kind="cgroup-v1-allow",outcome="done"' in scraped["access-repaired"]
