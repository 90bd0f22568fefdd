"""A new GPU container's scope gets its durable grant on its own, not from a pass (issue
13): on a real systemd, both cgroup layouts. Passes are held off with a one-minute quiet
period, so every grant seen before the next pass is the fast path's; a burst gets one
grant per scope, the pass that follows grants nothing again, nothing is granted beyond
what each container's /dev holds (also when its process still sees the host's /dev for
a while, as `runc init` does), and a dry run sets nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import pytest

from integration.gpu_scopes import Container, boot_node, containers, has, start, write_config
from integration.gpuguard_ns import events, passes, settle, start_gpuguard, wait_for
from integration.harness import layout as layout
from integration.harness import systemd_ns as systemd_ns

pytestmark = pytest.mark.root

HELD = "[Daemon]\nQuietPeriod=1h\nMaxDelay=1h\n"  # no pass but the urgent ones


def _boot(systemd_ns, tmp_path: Path, ctrs: List[Container], layout: str, conf: str):  # type: ignore[no-untyped-def]
    ns = boot_node(systemd_ns, tmp_path, ctrs, layout=layout, config=conf)
    start_gpuguard(ns)
    # the node has both GPUs' nodes and links: what a container must not get by mistake
    assert ns.path("/dev/nvidia1").exists() and ns.path("/dev/char/195:1").is_symlink()
    return ns


def _grants(ns) -> Dict[str, List[Any]]:  # type: ignore[no-untyped-def]
    out: Dict[str, List[Any]] = {}
    for e in events(ns, "unit-device-allow"):
        out.setdefault(e["CONTAINER_ID"], []).append(e)
    return out


def _device_allow(ns, c: Container) -> str:  # type: ignore[no-untyped-def]
    res = ns.systemctl("show", "-p", "DeviceAllow", "--value", c.unit)
    return str(res.stdout)


def _own_gpu_only(ns, c: Container) -> None:  # type: ignore[no-untyped-def]
    mine, other = c.gpus[0], 1 - c.gpus[0]
    allow = _device_allow(ns, c)
    assert f"/dev/char/195:{mine} rw" in allow, allow
    assert f"/dev/char/195:{other}" not in allow, f"{c.unit} got a GPU it was not given"


def test_scopes_started_while_passes_are_held_get_one_grant_each(
    systemd_ns, tmp_path, layout
) -> None:  # type: ignore[no-untyped-def]
    ctrs = containers(8)
    ns = _boot(systemd_ns, tmp_path, ctrs, layout, HELD)
    before = passes(ns)
    for c in ctrs:
        start(ns, c)  # each granted behind systemd's back, as the legacy NVIDIA hook does
    wait_for(lambda: len(_grants(ns)) == len(ctrs), timeout=30, what="a grant for every scope")
    assert passes(ns) == before, "a pass ran: the grants must be the fast path's"
    grants = _grants(ns)
    assert set(grants) == {c.container_id for c in ctrs}
    for c in ctrs:
        (entry,) = grants[c.container_id]
        assert entry["UNIT"] == c.unit and entry["GPUGUARD_STATUS"] == "done"
        numbers = entry["DEVICE_NUMBERS"].split(",")
        assert f"195:{c.gpus[0]}" in numbers and f"195:{1 - c.gpus[0]}" not in numbers
        _own_gpu_only(ns, c)
    # The full pass (the backstop) runs once passes are no longer held: nothing again.
    write_config(ns, "")
    ns.systemctl("reload", "gpuguard.service")
    wait_for(lambda: passes(ns) > before, what="the full pass")
    settle(ns)
    assert {k: len(v) for k, v in _grants(ns).items()} == {c.container_id: 1 for c in ctrs}
    # durable: a reload keeps each container's own GPU, and only that one
    ns.systemctl("daemon-reload")
    for c in ctrs:
        assert has(c, ns, (195, c.gpus[0])) and not has(c, ns, (195, 1 - c.gpus[0]))


def test_a_scope_still_on_the_hosts_dev_is_waited_for_not_judged(
    systemd_ns, tmp_path, layout
) -> None:  # type: ignore[no-untyped-def]
    """runc's systemd driver starts the scope with `runc init` in it, which sees the
    host's /dev (every GPU) until it switches to the container's root: judged then, the
    container would be given every GPU of the node."""
    (c,) = containers(1)
    ns = _boot(systemd_ns, tmp_path, [c], layout, HELD)
    ns.popen(
        [
            "systemd-run", "--scope", "--quiet", f"--unit={c.unit}", f"--slice={c.slice}",
            "-p", "DevicePolicy=strict", "-p", "DeviceAllow=/dev/null rw",
            "unshare", "-m", "--propagation", "private", "sh", "-c",
            f"sleep 1.5; mount --bind /run/ctrdev/{c.container_id[:12]} /dev && exec sleep 3000",
        ]
    )  # fmt: skip
    procs = c.cgroup(ns) / "cgroup.procs"
    wait_for(lambda: procs.exists() and procs.read_text().strip(), what="the scope's process")
    c.hook_grant(ns)
    wait_for(lambda: c.container_id in _grants(ns), timeout=30, what="the grant")
    _own_gpu_only(ns, c)
    (entry,) = _grants(ns)[c.container_id]
    assert f"195:{1 - c.gpus[0]}" not in entry["DEVICE_NUMBERS"].split(",")


def test_dry_run_sets_nothing(systemd_ns, tmp_path, layout) -> None:  # type: ignore[no-untyped-def]
    ctrs = containers(2)
    ns = _boot(systemd_ns, tmp_path, ctrs, layout, HELD)  # nodes and links made first
    write_config(ns, HELD + "DryRun=yes\n")
    ns.systemctl("reload", "gpuguard.service")
    wait_for(lambda: events(ns, "config-reloaded"), what="the dry-run configuration")
    for c in ctrs:
        start(ns, c)
    wait_for(lambda: len(_grants(ns)) == len(ctrs), timeout=30, what="the dry-run entries")
    assert {e["GPUGUARD_STATUS"] for v in _grants(ns).values() for e in v} == {"dry-run"}
    for c in ctrs:
        assert "/dev/char/195:" not in _device_allow(ns, c)


def test_real_runc_container_gets_its_grant_from_the_fast_path(
    systemd_ns, tmp_path, layout
) -> None:  # type: ignore[no-untyped-def]
    """Real containerd 1.6 + runc 1.1 with the systemd driver: the scope's first process
    is `runc init` (host /dev, runc's environment); the grant waits for the container and
    holds its own GPU only."""
    from conftest import require_tool
    from integration.harness.runc_env import REQUIRED_TOOLS, Containerd, make_containers, prepare

    require_tool(*REQUIRED_TOOLS)
    ctr_units, ctr_binds = prepare(tmp_path / "ctr")
    ns = boot_node(
        systemd_ns, tmp_path, layout=layout, config=HELD, units=ctr_units, binds=ctr_binds
    )
    cd = Containerd(ns)
    cd.start()
    start_gpuguard(ns)
    assert ns.path("/dev/nvidia1").exists()  # the node's GPUs: both
    before = passes(ns)
    ctrs = make_containers(2, systemd=True)
    for c in ctrs:
        cd.run(c)  # hook_grant: granted behind runc's back, as the legacy NVIDIA hook does
    wait_for(lambda: len(_grants(ns)) == len(ctrs), timeout=30, what="a grant for each")
    assert passes(ns) == before, "a pass ran: the grants must be the fast path's"
    for c in ctrs:
        (entry,) = _grants(ns)[c.container_id]
        assert entry["GPUGUARD_STATUS"] == "done"
        allow = ns.unit_property(c.unit, "DeviceAllow")
        assert f"/dev/char/195:{c.gpus[0]} rw" in allow, allow
        assert f"/dev/char/195:{1 - c.gpus[0]}" not in allow, "a GPU it was not given"
    cd.remove_all()
