"""Property, judged by the kernel: gpuguard never narrows what a container's cgroup
admits, privileged containers included.

A real systemd (both layouts) runs GPU "containers" as scopes with random device
policies: DevicePolicy= auto, closed or strict with random DeviceAllow= entries (char
and block nodes, classes, any access), often none at all with auto, which is a
privileged container's scope: it admits every device. Their GPU is granted behind
systemd's back the way the legacy hook grants it (devices.allow on v1; on v2 systemd's
program replaced by one admitting its rules plus the GPU), or not at all (a loss for
gpuguard to repair); a scope that admits everything needs no grant. Then `gpuguard
check` runs its real repair (bridges, DeviceAllow=, devices.allow writes), and the
kernel is asked, from inside each container's cgroup, about every (type, major:minor,
access) of a set of nodes, before and after:

- after >= before, for every container (never narrowed: /dev/kmsg stays openable in a
  privileged one);
- after - before lies within what it was given, read/write on its GPU nodes (never
  broadened);
- a GPU container of a confined scope can open what it was given afterwards (repaired);
- a scope that admits everything gets no DeviceAllow= and no drop-in.

Cost: GPUGUARD_PROPERTY_EXAMPLES examples per layout (default 8, derandomized, ~3 s
each here, three scopes each); set it higher for a long random run.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import FrozenSet, List, Tuple

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from gpuguard.devices.bpfprog import build, grant_nodes, parse
from gpuguard.devices.bpfread import fd_by_id, read_program
from gpuguard.devices.cgroupchild import process_cgroup_dirs
from gpuguard.devices.probe import query_device_programs
from gpuguard.host.paths import Root
from integration.gpu_scopes import boot_node, make_dev_dir
from integration.gpuguard_ns import GPUGUARD, wait_for
from integration.harness import SystemdNamespace
from integration.harness import layout as layout
from integration.harness import systemd_ns as systemd_ns
from integration.harness.admitted import Access, admitted, make_nodes
from integration.harness.bpfdev import attach, detach_one

pytestmark = pytest.mark.root

EXAMPLES = int(os.environ.get("GPUGUARD_PROPERTY_EXAMPLES", "20"))
UVM = 511
GIVEN = {
    0: [(195, 0), (195, 255), (UVM, 0), (UVM, 1)],
    1: [(195, 1), (195, 255), (UVM, 0), (UVM, 1)],
}
# What is asked of the kernel: the container's nodes, the other GPU, devices a
# container commonly has or a privileged one needs (kmsg), a block device
DEVICES = [
    ("c", 1, 3), ("c", 1, 5), ("c", 1, 11), ("c", 5, 0), ("c", 10, 229), ("c", 136, 0),
    ("c", 195, 0), ("c", 195, 1), ("c", 195, 255), ("c", UVM, 0), ("c", UVM, 1), ("b", 7, 0),
]  # fmt: skip
# DeviceAllow= entries a runtime (or an operator) might set: nodes by path (the
# namespace's /dev holds them), classes, any access
ENTRIES = [
    "/dev/null", "/dev/zero", "/dev/gg-kmsg", "/dev/gg-fuse", "/dev/nvidiactl", "/dev/nvidia1",
    "char-pts", "char-mem", "block-loop", "char-*", "block-*",
]  # fmt: skip
NS_NODES = {"gg-kmsg": (1, 11), "gg-fuse": (10, 229), "nvidiactl": (195, 255), "nvidia1": (195, 1)}


@dataclass(frozen=True)
class Scope:
    policy: str  # auto | closed | strict
    allow: Tuple[Tuple[str, str], ...]  # DeviceAllow= entries
    gpu: int
    hook: bool  # the legacy hook granted its GPU (else a loss gpuguard repairs)

    @property
    def open(self) -> bool:
        """systemd admits every device: DevicePolicy=auto and no entries."""
        return self.policy == "auto" and not self.allow


def scopes() -> st.SearchStrategy[Scope]:
    access = st.sets(st.sampled_from("rwm"), min_size=1).map(lambda s: "".join(sorted(s)))
    entry = st.tuples(st.sampled_from(ENTRIES), access)
    allow = st.lists(entry, max_size=4, unique_by=lambda e: e[0]).map(tuple)
    confined = st.builds(
        Scope, st.sampled_from(["auto", "closed", "strict"]), allow, st.integers(0, 1),
        st.booleans(),
    )  # fmt: skip
    privileged = st.builds(Scope, st.just("auto"), st.just(()), st.integers(0, 1), st.just(False))
    return st.one_of(privileged, confined)


@pytest.fixture
def node(systemd_ns, tmp_path, layout) -> SystemdNamespace:  # type: ignore[no-untyped-def]
    binds = {f"/run/ctrdev/gpu{g}": make_dev_dir(tmp_path / f"dev{g}", [g]) for g in (0, 1)}
    ns = boot_node(systemd_ns, tmp_path, layout=layout, units={}, binds=binds)
    for name, (ma, mi) in NS_NODES.items():  # what DeviceAllow= entries name
        ns.run(["mknod", "-m", "666", f"/dev/{name}", "c", str(ma), str(mi)], check=True)
    return ns


def start(ns: SystemdNamespace, unit: str, pod_slice: str, s: Scope) -> subprocess.Popen[bytes]:
    """The scope with `s`'s policy, its process on its own /dev (as runc leaves it)."""
    props = ["-p", f"DevicePolicy={s.policy}"]
    for path, acc in s.allow:
        props += ["-p", f"DeviceAllow={path} {acc}"]
    p = ns.popen(
        ["systemd-run", "--scope", "--quiet", f"--unit={unit}", f"--slice={pod_slice}", *props,
         "unshare", "-m", "--propagation", "private", "bash", "-c",
         f"mount --bind /run/ctrdev/gpu{s.gpu} /dev && echo ready && exec sleep 3000"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert p.stdout is not None
    assert p.stdout.readline().strip() == b"ready", f"{unit} did not start"
    return p


def hook_grant(ns: SystemdNamespace, cg: Path, gpu: int) -> None:
    """The legacy hook's grant, additive: devices.allow (v1); systemd's program replaced
    by one admitting its rules plus the GPU nodes (v2)."""
    given = GIVEN[gpu]
    if ns.layout == "v1":
        for ma, mi in given:
            (cg / "devices.allow").write_text(f"c {ma}:{mi} rw")
        return
    for prog_id in query_device_programs(cg):
        fd = fd_by_id(prog_id)
        try:
            prog = parse(read_program(fd))
        finally:
            os.close(fd)
        attach(cg, build(grant_nodes(prog, given)), b"legacy_hook")
        detach_one(cg, prog_id)


def scope_dir(ns: SystemdNamespace, pod_slice: str, unit: str, hierarchy: str = "") -> Path:
    top = ns.cgroup_dir(hierarchy or ns.device_hierarchy)
    return top / "kubepods.slice/kubepods-besteffort.slice" / pod_slice / unit


def where(ns: SystemdNamespace, pod_slice: str, unit: str) -> List[Path]:
    """The cgroups the scope's process stands in (its v1 devices one, and cgroup2): a
    scope with no device policy has no v1 devices cgroup of its own."""
    procs = scope_dir(ns, pod_slice, unit, "unified") / "cgroup.procs"
    pid = int(procs.read_text().split()[0])
    dirs = process_cgroup_dirs(Root(Path("/")), pid)
    assert dirs, f"{unit}: pid {pid} stands nowhere"
    return dirs


def rw(gpu: int) -> FrozenSet[Access]:
    return frozenset(("c", ma, mi, a) for ma, mi in GIVEN[gpu] for a in ("r", "w", "rw"))


_n = iter(range(1 << 30))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize="GPUGUARD_PROPERTY_EXAMPLES" not in os.environ,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: each example boots scopes
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=st.lists(scopes(), min_size=1, max_size=3))
def test_gpuguard_never_narrows_and_never_broadens(
    case: List[Scope], node: SystemdNamespace, tmp_path: Path
) -> None:
    ns = node
    n = next(_n)
    nodes = make_nodes(tmp_path / "nodes", DEVICES)
    procs, units, cgs = [], [], []
    try:
        for i, s in enumerate(case):
            pod = str(uuid.UUID(int=(n << 8) + i))
            cid = hashlib.sha256(f"{n}-{i}".encode()).hexdigest()
            unit = f"cri-containerd-{cid}.scope"
            pod_slice = f"kubepods-besteffort-pod{pod.replace('-', '_')}.slice"
            procs.append(start(ns, unit, pod_slice, s))
            units.append(unit)
            cgs.append(where(ns, pod_slice, unit))
            if s.hook and not s.open:
                hook_grant(ns, scope_dir(ns, pod_slice, unit), s.gpu)
        before = [admitted(cg, nodes, tmp_path / "mk") for cg in cgs]
        check = ns.run([str(GPUGUARD), "check", "--json"], timeout=120)
        assert check.returncode in (0, 1), check.stdout + check.stderr
        doc = json.loads(check.stdout)
        # systemd applies a DeviceAllow= it answered for; a bridge is detached after it
        after = [admitted(cg, nodes, tmp_path / "mk") for cg in cgs]
        for s, unit, b, a in zip(case, units, before, after):
            ctx = f"{s} ({ns.layout}): before {sorted(b)}, after {sorted(a)}, {doc['devices']}"
            assert b <= a, f"narrowed {sorted(b - a)}: {ctx}"
            assert a - b <= rw(s.gpu), f"broadened {sorted(a - b - rw(s.gpu))}: {ctx}"
            assert rw(s.gpu) <= a, f"still denied {sorted(rw(s.gpu) - a)}: {ctx}"
            if s.open:
                assert ns.unit_property(unit, "DeviceAllow") == "", ctx
                assert not ns.path(f"/run/systemd/system/{unit}.d").exists(), ctx
    finally:
        for unit in units:
            ns.systemctl("stop", unit)
        for p in procs:
            p.wait(timeout=30)
        for unit in units:
            d = ns.path(f"/run/systemd/system/{unit}.d")
            for f in d.glob("*") if d.exists() else ():
                f.unlink()
            if d.exists():
                d.rmdir()


def test_the_oracle_sees_a_narrowing(node: SystemdNamespace, tmp_path: Path) -> None:
    """What the property would catch: a privileged scope given a DeviceAllow= by hand
    (what gpuguard did before) loses /dev/kmsg, and the kernel says so."""
    ns = node
    unit = f"cri-containerd-{'e' * 64}.scope"
    pod_slice = "kubepods-besteffort-podeeee.slice"
    p = start(ns, unit, pod_slice, Scope("auto", (), 0, False))
    try:
        nodes = make_nodes(tmp_path / "nodes", DEVICES)
        before = admitted(where(ns, pod_slice, unit), nodes, tmp_path / "mk")
        assert ("c", 1, 11, "rw") in before
        ns.systemctl("set-property", "--runtime", unit, "DeviceAllow=/dev/char/195:0 rw")
        wait_for(
            lambda: (
                ("c", 1, 11, "rw")
                not in admitted(where(ns, pod_slice, unit), nodes, tmp_path / "mk")
            )
        )
    finally:
        ns.systemctl("stop", unit)
        p.wait(timeout=30)
