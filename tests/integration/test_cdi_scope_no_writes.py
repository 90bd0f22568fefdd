"""A CDI container (its devices in the OCI spec, so the runtime lists its GPU nodes in
its scope's DeviceAllow=) costs gpuguard nothing: on a real systemd, both cgroup
layouts, the new-scope fast path reads the scope's transient unit files (bounded), finds
the nodes there and makes no SetUnitProperties call and no drop-in; the passes agree;
and the container keeps its GPU through daemon-reloads. A legacy-hook container
beside it still gets its grant (the contrast: the path is not simply off)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import List

import pytest

from integration.gpu_scopes import Container, boot_node, containers, has, start
from integration.gpuguard_ns import events, settle, start_gpuguard, status, wait_for
from integration.harness import layout as layout
from integration.harness import systemd_ns as systemd_ns

pytestmark = pytest.mark.root

DROPIN = "60-gpuguard-devices.conf"


def start_cdi(ns, c: Container) -> None:  # type: ignore[no-untyped-def]
    """The scope as runc starts a CDI container's: DevicePolicy=strict with every node of
    its spec in DeviceAllow= (by /dev/char number, as runc writes them); no hook grant."""
    allow: List[str] = ["-p", "DeviceAllow=/dev/null rw"]
    for ma, mi in c.given():
        allow += ["-p", f"DeviceAllow=/dev/char/{ma}:{mi} rw"]
    name = c.container_id[:12]
    p = ns.popen(
        ["systemd-run", "--scope", "--quiet", f"--unit={c.unit}", f"--slice={c.slice}",
         "-p", "DevicePolicy=strict", *allow,
         "unshare", "-m", "--propagation", "private", "bash", "-c",
         f"read -r _ && mount --bind /run/ctrdev/{name} /dev && echo ok && exec sleep 3000"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert p.stdin is not None and p.stdout is not None
    procs = c.cgroup(ns) / "cgroup.procs"
    wait_for(lambda: procs.exists() and procs.read_text().split(), what=f"{c.unit} running")
    with p.stdin:
        p.stdin.write(b"\n")
    with p.stdout:
        assert p.stdout.readline().strip() == b"ok", f"{c.unit} did not get its own /dev"


def new_scopes(ns) -> dict:  # type: ignore[no-untyped-def,type-arg]
    return dict(status(ns).get("fast_paths", {}).get("new_scopes") or {})


def test_cdi_containers_get_no_gpuguard_write(systemd_ns, tmp_path: Path, layout: str) -> None:  # type: ignore[no-untyped-def]
    cdi, legacy = containers(2)
    ns = boot_node(systemd_ns, tmp_path, [cdi, legacy], layout=layout)
    start_gpuguard(ns)
    start_cdi(ns, cdi)
    start(ns, legacy)  # the legacy hook's grant, behind systemd's back
    wait_for(lambda: new_scopes(ns).get("handled", 0) >= 2, timeout=30, what="both handled")
    settle(ns)
    grants = {e["CONTAINER_ID"] for e in events(ns, "unit-device-allow")}
    assert grants == {legacy.container_id}, grants
    assert new_scopes(ns)["granted"] == 1
    assert not ns.path(f"/run/systemd/system/{cdi.unit}.d/{DROPIN}").exists()
    assert ns.path(f"/run/systemd/system/{legacy.unit}.d/{DROPIN}").exists()
    for _ in range(2):  # reloads: the runtime's DeviceAllow= keeps the CDI container's GPU
        assert ns.systemctl("daemon-reload").returncode == 0
        settle(ns)
        for ma, mi in cdi.given():
            assert has(cdi, ns, (ma, mi)), f"{cdi.unit} lost {ma}:{mi}"
        assert has(legacy, ns, (195, legacy.gpus[0]))
    grants = {e["CONTAINER_ID"] for e in events(ns, "unit-device-allow")}
    assert cdi.container_id not in grants, "gpuguard wrote for the CDI container"
    changes = [
        e for e in events(ns)
        if e.get("CONTAINER_ID") == cdi.container_id and e.get("GPUGUARD_STATUS") == "done"
    ]  # fmt: skip
    assert changes == [], changes  # no in-place re-grant either: nothing was lost
