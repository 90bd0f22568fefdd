"""`gpuguard check --dry-run` prints every change the real run then makes, on a real
systemd with the /dev/char links missing: the real run creates the links (device nodes
step) and then puts durable DeviceAllow= entries on the scopes, which resolve through
those links; the dry-run, which creates no link, must plan those entries too (it plans
against the host as the earlier steps' planned changes would leave it). Both layouts;
on v2 the dry-run cannot report the denial itself (see the last check)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from integration.gpu_scopes import boot_node, containers, has, start, write_config
from integration.gpuguard_ns import GPUGUARD, events, start_gpuguard
from integration.harness import layout as layout
from integration.harness import systemd_ns as systemd_ns

pytestmark = pytest.mark.root


def _changes(doc: Any) -> set[tuple[str, str, str]]:
    """The device steps' changes: kind, target and device numbers (no status words)."""
    return {
        (o["kind"], o["target"], o["fields"].get("DEVICE_NUMBERS", ""))
        for o in doc["devices"]["outcomes"]
    }


def _findings(doc: Any) -> set[tuple[str, str, str]]:
    return {
        (f["kind"], f["fields"].get("CONTAINER_ID", ""), f["fields"].get("DEVICE_NUMBERS", ""))
        for f in doc["devices"]["findings"]
    }


def test_check_dry_run_prints_the_durable_grants_the_real_run_makes_after_the_links(  # type: ignore[no-untyped-def]
    systemd_ns, tmp_path, layout
) -> None:
    wiped, intact = containers(2)
    ns = boot_node(systemd_ns, tmp_path, [wiped, intact], layout=layout)
    start(ns, wiped)
    ns.systemctl("daemon-reload")  # wipes the first (no gpuguard running)
    start(ns, intact)  # granted behind systemd's back, not durable yet
    assert not has(wiped, ns, (195, wiped.gpus[0])) and has(intact, ns, (195, intact.gpus[0]))
    assert not ns.path("/dev/char/195:0").exists()

    dry = ns.run([str(GPUGUARD), "check", "--dry-run", "--json"], timeout=60)
    assert dry.returncode == 1, dry.stdout + dry.stderr  # found, changed nothing
    dry_doc = json.loads(dry.stdout)
    assert {o["status"] for o in dry_doc["devices"]["outcomes"]} == {"dry-run"}
    assert not ns.path("/dev/char/195:0").exists() and not ns.path("/dev/nvidia0").exists()
    assert "/dev/char/" not in ns.unit_property(intact.unit, "DeviceAllow")

    real = ns.run([str(GPUGUARD), "check", "--json"], timeout=60)
    assert real.returncode == 0, real.stdout + real.stderr
    real_doc = json.loads(real.stdout)
    assert {o["status"] for o in real_doc["devices"]["outcomes"]} == {"done"}
    # The durable grant of the container whose access was intact, made once its links
    # existed: the case the dry-run used to leave out.
    durable = ("unit-device-allow", intact.unit)
    assert durable in {c[:2] for c in _changes(real_doc)}
    assert f"/dev/char/195:{intact.gpus[0]} rw" in ns.unit_property(intact.unit, "DeviceAllow")
    assert _changes(dry_doc) == _changes(real_doc)
    # and the same findings, the wiped container's denial among them: devices.list says
    # it on v1, the scope's device program read back says it on v2 (no open needed)
    denied = {f for f in _findings(real_doc) if f[0] == "container-device-denied"}
    assert {f[1] for f in denied} == {wiped.container_id}
    assert _findings(dry_doc) == _findings(real_doc)


def _journaled(ns, since: int, status: str) -> set[tuple[str, str]]:  # type: ignore[no-untyped-def]
    """The changes gpuguard journaled after the first `since` entries: kind, what."""
    return {
        (e["GPUGUARD_ACTION"], e["MESSAGE"].rsplit(" [", 1)[0])
        for e in events(ns)[since:]
        if e.get("GPUGUARD_STATUS") == status
    }


def test_a_dry_run_daemon_journals_the_durable_grants_the_real_daemon_makes(  # type: ignore[no-untyped-def]
    systemd_ns, tmp_path, layout
) -> None:
    """The daemon runs container access first and device nodes second; the links the
    second makes ask for an immediate container access pass, whose DeviceAllow= entries
    resolve through them. A dry-run daemon makes no link: its follow-up pass plans on the
    links its last pass planned, so it journals the grants the real daemon then makes."""
    (c,) = containers(1)
    ns = boot_node(systemd_ns, tmp_path, [c], layout=layout, config="[Daemon]\nDryRun=yes\n")
    start(ns, c)  # granted behind systemd's back, not durable yet
    assert not ns.path(f"/dev/char/195:{c.gpus[0]}").exists()
    start_gpuguard(ns)
    dry = _journaled(ns, 0, "dry-run")
    assert any(k == "unit-device-allow" and c.unit in w for k, w in dry), dry
    assert not ns.path(f"/dev/char/195:{c.gpus[0]}").exists()
    assert "/dev/char/" not in ns.unit_property(c.unit, "DeviceAllow")
    ns.systemctl("stop", "gpuguard.service")
    n = len(events(ns))
    write_config(ns, "")
    start_gpuguard(ns)
    real = _journaled(ns, n, "done")
    assert any(k == "unit-device-allow" and c.unit in w for k, w in real), real
    assert f"/dev/char/195:{c.gpus[0]} rw" in ns.unit_property(c.unit, "DeviceAllow")
    assert dry == real
