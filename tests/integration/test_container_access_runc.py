"""F2 with the real runtime: Debian's containerd 1.6.20 and runc 1.1.5, busybox rootfs.

Each test boots the systemd namespace harness with gpuguard's unit (from the repo),
a fake NVIDIA registration in /proc/devices, and a private containerd running as a
unit of that namespace (harness/runc_env.py; the device-plugin work's
harness/containerd.py runs containerd on the host with the cgroupfs driver only, so it
cannot give containers systemd scopes). Containers are made with ``ctr run --rootfs``;
their GPU nodes (fake, mknod in the test's tmp dir) are bind-mounted into their /dev
and granted in their devices.allow behind runc's back, as the legacy NVIDIA hook does.

What wipes such a grant with this runc/containerd (found here, checked by the tests):

* cgroupfs driver: nothing runc does. ``runc update --cpu-share 512`` (and
  ``--memory``, ``--pids-limit``) leaves the hand-written rule in place: the
  CPU-manager wipe of seed 002 (deny ``a``, then allow only the spec's list) came from
  older runc. The second test reproduces those exact writes on the real container's
  cgroup and shows a one-shot ``gpuguard check`` repairs them.
* systemd driver (``ctr run --runc-systemd-cgroup``, as with containerd's
  ``SystemdCgroup = true``): ANY ``runc update`` wipes it, the CPU manager's
  ``--cpu-share`` included: runc re-sends the scope's ``DevicePolicy=strict`` and
  ``DeviceAllow=`` list over D-Bus on every update and systemd re-applies the unit's
  device policy (deny all, then its list). ``systemctl daemon-reload`` and
  ``daemon-reexec`` wipe it too (seed 003). So seed 002's symptom still happens today
  on systemd-driver nodes, through systemd.
* Once gpuguard has added ``DeviceAllow=/dev/char/195:N rw`` to the scope, neither a
  ``runc update`` (systemd's DeviceAllow= setter appends, so runc's list does not
  drop gpuguard's entry) nor a daemon-reload loses the GPU.

One quirk of runc 1.1.5 + systemd 252 on this hybrid v1 layout: right after
``ctr run --runc-systemd-cgroup``, the container's process sits in its POD SLICE's
v1 devices cgroup (``a *:* rwm``), not in its scope's (systemd migrates it while
realizing the new slice; its journal says "Failed to migrate controller cgroups").
The scope's devices cgroup holds the intended rules. The test moves the process into
its scope, where runc meant it, and takes kernel verdicts from the scope's cgroup
(``probe_open`` opens the node from a child placed there: EPERM denied, ENXIO
allowed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence, Tuple

import pytest

from conftest import require_tool
from gpuguard.devices.probe import probe_open
from gpuguard.devices.rules import RUNC_DEFAULT_RULES
from gpuguard.steps.container_access.reconcile import CAUSE_REWRITE, CAUSE_REWRITE_V2
from integration.gpu_scopes import boot_node
from integration.gpuguard_ns import GPUGUARD, events, settle, wait_for
from integration.harness import SystemdNamespace
from integration.harness import layout as layout
from integration.harness import systemd_ns as systemd_ns
from integration.harness.runc_env import (
    REQUIRED_TOOLS,
    Containerd,
    RuncContainer,
    make_containers,
    prepare,
)

pytestmark = pytest.mark.root


def _boot(systemd_ns, tmp_path: Path, layout: str = "v1") -> Tuple[SystemdNamespace, Containerd]:  # type: ignore[no-untyped-def]
    require_tool(*REQUIRED_TOOLS)
    ctr_units, ctr_binds = prepare(tmp_path / "ctr")
    ns = boot_node(systemd_ns, tmp_path, layout=layout, units=ctr_units, binds=ctr_binds)
    cd = Containerd(ns)
    cd.start()
    return ns, cd


def _verdict(tmp_path: Path, ns: SystemdNamespace, c: RuncContainer, minor: int) -> Optional[bool]:
    """The kernel's answer to opening nvidia<minor> from inside c's devices cgroup."""
    return probe_open(tmp_path / f"ctr/dev/nvidia{minor}", [c.cgroup(ns)]).verdict


def _exactly_entitled(tmp_path: Path, ns: SystemdNamespace, ctrs: Sequence[RuncContainer]) -> None:
    for c in ctrs:
        mine, other = c.gpus[0], 1 - c.gpus[0]
        assert c.allows(ns, (195, mine)) and c.allows(ns, (195, 255)), c.devices_list(ns)
        assert c.allows(ns, (511, 0)) and c.allows(ns, (511, 1))
        assert not c.allows(ns, (195, other)), "granted a GPU the container was not given"
        assert _verdict(tmp_path, ns, c, mine) is True  # ENXIO: the cgroup lets it through
        assert _verdict(tmp_path, ns, c, other) is False  # EPERM: still denied


def _into_scope(ns: SystemdNamespace, cd: Containerd, c: RuncContainer) -> None:
    """Put the container's process in its scope's v1 devices cgroup (module docstring;
    on v2 runc and systemd agree on its cgroup)."""
    if ns.layout == "v1":
        (c.cgroup(ns) / "cgroup.procs").write_text(str(cd.pid(c)))


def _cpu_manager_update(
    ns: SystemdNamespace, cd: Containerd, c: RuncContainer, shares: int
) -> None:
    """The CPU manager's ``runc update``. On v2 here every controller is bound to the
    host's v1 hierarchies, so cgroup2 has no cpu.weight: the update carries no resource
    (``-r`` with ``{}``), and runc re-applies the container's device policy all the same."""
    if ns.layout == "v1":
        cd.runc(c, "update", "--cpu-share", str(shares), c.container_id)
        return
    empty = ns.path("/run/ctr-test/no-resources.json")
    if not empty.exists():
        empty.write_text("{}\n")
    cd.runc(c, "update", "-r", "/run/ctr-test/no-resources.json", c.container_id)


def _regrant_kind(ns: SystemdNamespace) -> str:
    """What re-grants a wiped node: devices.allow on v1, the scope's DeviceAllow= on v2."""
    return "cgroup-v1-allow" if ns.layout == "v1" else "unit-device-allow"


def test_systemd_driver_update_and_reload_wipe_daemon_restores(
    systemd_ns, tmp_path, layout
) -> None:  # type: ignore[no-untyped-def]
    ns, cd = _boot(systemd_ns, tmp_path, layout)
    a, b = make_containers(2, systemd=True)
    for c in (a, b):
        cd.run(c)  # hook_grant: devices.allow written behind runc's back
        _into_scope(ns, cd, c)
        assert c.allows(ns, (195, c.gpus[0])) and _verdict(tmp_path, ns, c, c.gpus[0]) is True
        assert "/dev/char/195:" not in ns.unit_property(c.unit, "DeviceAllow")

    if layout == "v1":
        # The CPU manager's update, through runc's systemd driver: the grant is gone.
        # (On v2 here an update carries no resource, see _cpu_manager_update, and left
        # the hook's program in place: the reload below is what loses it there.)
        _cpu_manager_update(ns, cd, a, 512)
        assert not a.allows(ns, (195, a.gpus[0])) and not a.allows(ns, (195, 255))
        assert _verdict(tmp_path, ns, a, a.gpus[0]) is False
        assert b.allows(ns, (195, b.gpus[0]))
    # seed 003: a daemon-reload re-applies every scope.
    ns.systemctl("daemon-reload")
    for c in (a, b):
        assert not c.allows(ns, (195, c.gpus[0]))
        assert _verdict(tmp_path, ns, c, c.gpus[0]) is False

    assert ns.systemctl("start", "gpuguard.service").returncode == 0
    settle(ns)
    _exactly_entitled(tmp_path, ns, (a, b))
    denied = events(ns, "container-device-denied")
    assert {e["CONTAINER_ID"] for e in denied} == {a.container_id, b.container_id}
    cause = CAUSE_REWRITE if layout == "v1" else CAUSE_REWRITE_V2
    assert {e["CAUSE"] for e in denied if e["DEVICE"].startswith("/dev/nvidia")} == {cause}
    for c in (a, b):
        allow = ns.unit_property(c.unit, "DeviceAllow")
        assert f"/dev/char/195:{c.gpus[0]} rw" in allow, allow
        assert f"/dev/char/195:{1 - c.gpus[0]}" not in allow
    regrants = len(events(ns, _regrant_kind(ns)))

    # Durable now: neither runc's updates nor reloads/reexecs lose the GPU.
    for _ in range(3):
        for c in (a, b):
            _cpu_manager_update(ns, cd, c, 256)
            assert c.allows(ns, (195, c.gpus[0])), f"runc update lost it ({layout})"
        ns.systemctl("daemon-reload")
        assert all(c.allows(ns, (195, c.gpus[0])) for c in (a, b))
    ns.systemctl("daemon-reexec")
    wait_for(lambda: all(c.allows(ns, (195, c.gpus[0])) for c in (a, b)), timeout=15)
    settle(ns)
    assert not events(ns, "reconciler-crashed")
    assert len(events(ns, _regrant_kind(ns))) == regrants, "durable grants needed re-granting"
    _exactly_entitled(tmp_path, ns, (a, b))
    cd.remove_all()


def test_missing_char_link_dropped_by_runc_lost_on_reload_repaired(  # type: ignore[no-untyped-def]
    systemd_ns, tmp_path, layout
) -> None:
    """F2's other road (issue 12): the GPU is in runc's spec, but its /dev/char link is
    missing, so runc's systemd driver leaves it out of the scope's DeviceAllow= while
    its own rules (v1 devices.allow; v2 its own device program) admit it. The next
    daemon-reload applies the scope's list alone: EPERM. gpuguard creates the link and
    puts the GPU on the scope, which then survives reloads."""
    ns, cd = _boot(systemd_ns, tmp_path, layout)
    cd.make_dev_nodes()
    a, b = make_containers(2, systemd=True)
    for c in (a, b):
        cd.run(c, hook_grant=False, spec_devices=True)
        _into_scope(ns, cd, c)
        assert c.allows(ns, (195, c.gpus[0])), "runc did not admit its spec's GPU"
        assert not c.allows(ns, (195, 1 - c.gpus[0]))
        assert "/dev/char/195:" not in ns.unit_property(c.unit, "DeviceAllow")
    assert not ns.path("/dev/char/195:0").exists()

    ns.systemctl("daemon-reload")
    for c in (a, b):
        assert not c.allows(ns, (195, c.gpus[0])), f"reload kept the GPU on {layout}"
        assert _verdict(tmp_path, ns, c, c.gpus[0]) is False  # EPERM

    assert ns.systemctl("start", "gpuguard.service").returncode == 0
    settle(ns)
    assert ns.path("/dev/char/195:0").is_symlink()
    _exactly_entitled(tmp_path, ns, (a, b))
    for c in (a, b):
        allow = ns.unit_property(c.unit, "DeviceAllow")
        assert f"/dev/char/195:{c.gpus[0]} rw" in allow, allow
        assert f"/dev/char/195:{1 - c.gpus[0]}" not in allow
    regrants = len(events(ns, _regrant_kind(ns)))
    for _ in range(5):
        ns.systemctl("daemon-reload")
        assert all(c.allows(ns, (195, c.gpus[0])) for c in (a, b))
    settle(ns)
    assert len(events(ns, _regrant_kind(ns))) == regrants, "durable grants needed re-granting"
    assert not events(ns, "reconciler-crashed")
    _exactly_entitled(tmp_path, ns, (a, b))
    cd.remove_all()


def _old_runc_rewrite(cgroup: Path, spec_rules: Sequence[str] = ()) -> None:
    """What runc < 1.0 wrote on every update (seed 002's strace): deny everything,
    then allow its default list and the spec's devices, one rule per write."""
    with open(cgroup / "devices.deny", "w") as f:
        f.write("a")
    with open(cgroup / "devices.allow", "w") as f:
        for rule in [r.render() for r in RUNC_DEFAULT_RULES] + list(spec_rules):
            f.write(rule)
            f.flush()


def test_cgroupfs_driver_update_keeps_rule_old_runc_rewrite_repaired(systemd_ns, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ns, cd = _boot(systemd_ns, tmp_path)
    ctrs = make_containers(2, systemd=False)
    for c in ctrs:
        cd.run(c)
        assert c.allows(ns, (195, c.gpus[0]))

    # Today's runc (1.1.5, cgroupfs): the CPU manager's update leaves the hook's rule.
    for args in (["--cpu-share", "512"], ["--memory", "268435456"], ["--pids-limit", "200"]):
        for c in ctrs:
            cd.runc(c, "update", *args, c.container_id)
            assert c.allows(ns, (195, c.gpus[0])), f"runc update {args[0]} wiped it"
            assert _verdict(tmp_path, ns, c, c.gpus[0]) is True

    # Old runc's writes, on the real containers' cgroups.
    for c in ctrs:
        _old_runc_rewrite(c.cgroup(ns))
        assert not c.allows(ns, (195, c.gpus[0])) and not c.allows(ns, (511, 0))
        assert _verdict(tmp_path, ns, c, c.gpus[0]) is False
        assert "c 1:3 rwm" in c.devices_list(ns)

    check = ns.run([str(GPUGUARD), "check", "--json"], timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    doc = json.loads(check.stdout)["devices"]
    done = [o for o in doc["outcomes"] if o["status"] == "done"]
    assert {o["kind"] for o in done} >= {"cgroup-v1-allow"}
    assert "unit-device-allow" not in {o["kind"] for o in doc["outcomes"]}  # no scope
    _exactly_entitled(tmp_path, ns, ctrs)
    denied = [f for f in doc["findings"] if f["kind"] == "container-device-denied"]
    assert {f["fields"]["CONTAINER_ID"] for f in denied} == {c.container_id for c in ctrs}
    assert {f["fields"]["CAUSE"] for f in denied} == {CAUSE_REWRITE}
    cd.remove_all()
