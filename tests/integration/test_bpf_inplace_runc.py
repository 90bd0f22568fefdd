"""V2Remedy=inplace against real runc's own device program (cgroup v2, cgroupfs driver).

The systemd namespace harness booted unified, a private containerd 1.6 + runc 1.1 with
the cgroupfs driver (harness/runc_env.py): runc attaches its own BPF device program to
the container's cgroup, built from the spec, which here lacks the GPU (as after the CPU
manager's ``runc update`` regenerated it without the hook's nodes). ``gpuguard check``
with ``V2Remedy=inplace`` must parse runc's program, add exactly the container's nodes,
and leave one program; the kernel's verdict (ENXIO vs EPERM on fake nodes) judges.
"""

from __future__ import annotations

import json
import os

import pytest

from gpuguard.devices.bpfprog import parse
from gpuguard.devices.bpfread import fd_by_id as _fd_by_id
from gpuguard.devices.bpfread import read_program
from gpuguard.devices.probe import query_device_programs
from integration.gpuguard_ns import GPUGUARD
from integration.harness import systemd_ns as systemd_ns
from integration.harness.runc_env import make_containers
from integration.test_container_access_runc import _boot, _verdict

pytestmark = pytest.mark.root


def test_runc_program_on_v2_is_extended_in_place(systemd_ns, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ns, cd = _boot(systemd_ns, tmp_path, "v2")
    (ns.path("/etc/gpuguard") / "gpuguard.conf").write_text(
        "[Inventory]\nFile=/etc/gpuguard/inventory.json\n[Devices]\nV2Remedy=inplace\n"
    )
    cd.make_dev_nodes()
    ctrs = make_containers(2, systemd=False)
    for c in ctrs:
        cd.run(c, hook_grant=False)  # runc's program alone: the GPU is not in it
        (prog,) = query_device_programs(c.cgroup(ns))
        fd = _fd_by_id(prog)
        try:
            runc_rules = parse(read_program(fd))  # runc's own shape parses
        finally:
            os.close(fd)
        assert runc_rules.admits("c", 1, 3, 6) and not runc_rules.admits("c", 195, 0, 6)
        assert _verdict(tmp_path, ns, c, c.gpus[0]) is False

    dry = ns.run([str(GPUGUARD), "check", "--dry-run", "--json"], timeout=60)
    assert dry.returncode == 1, dry.stdout + dry.stderr  # findings left as they are
    planned = json.loads(dry.stdout)["devices"]["outcomes"]
    assert {o["kind"] for o in planned if o["status"] == "dry-run"} >= {"v2-program-replace"}
    assert all(_verdict(tmp_path, ns, c, c.gpus[0]) is False for c in ctrs)

    check = ns.run([str(GPUGUARD), "check", "--json"], timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    outcomes = json.loads(check.stdout)["devices"]["outcomes"]
    done = [o for o in outcomes if o["kind"] == "v2-program-replace" and o["status"] == "done"]
    assert len(done) == len(ctrs), outcomes
    for c in ctrs:
        assert _verdict(tmp_path, ns, c, c.gpus[0]) is True  # ENXIO: admitted
        assert _verdict(tmp_path, ns, c, 1 - c.gpus[0]) is False  # never granted
        assert len(query_device_programs(c.cgroup(ns))) == 1
    cd.remove_all()
