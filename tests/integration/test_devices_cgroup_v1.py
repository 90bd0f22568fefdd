"""Real kernel device cgroups: rules.py's model against the kernel's verdict.

v1: cgroups under /sys/fs/cgroup/devices/gpuguard-test-<random>/ laid out like
kubelet's cgroupfs driver (kubepods/burstable/pod<uid>/<cid>), fake GPU nodes made with
mknod in a temporary directory we own (never the host /dev), a `sleep` moved into the
container cgroup, seed 002's CPU-manager rewrite replayed, the audit's CgroupV1Allow
written, and the probe (EPERM = denied, ENXIO = allowed: no driver behind the numbers)
as the kernel's word.

v2: a cgroup2 directory under /sys/fs/cgroup/unified/gpuguard-test-<random>/ with a real
BPF_PROG_TYPE_CGROUP_DEVICE program loaded with raw bpf(2): deny 195:1, allow the rest.

Everything is removed in finalizers (processes by PID, cgroups deepest first).
"""

from __future__ import annotations

import contextlib
import os
import random
import stat
import struct
import subprocess
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest

from conftest import require_root, require_tool
from gpuguard.devices.containers import CgroupLayout, detect_layout, discover_containers
from gpuguard.devices.entitlement import read_entitlement
from gpuguard.devices.nodes import (
    DeviceNode,
    expected_nodes,
    list_nvidia_nodes,
    nvidia_majors,
    read_proc_devices,
)
from gpuguard.devices.probe import probe_open, query_device_programs
from gpuguard.devices.rules import (
    RUNC_DEFAULT_RULES,
    DeviceRules,
    WriteRejected,
    allows,
    apply_write,
)
from gpuguard.host.paths import Root
from gpuguard.steps.container_access.actuate import read_devices_list, write_allow
from gpuguard.steps.container_access.cgroups import Cgroups
from gpuguard.steps.container_access.reconcile import (
    CAUSE_REWRITE,
    CgroupV1Allow,
    V2ReportOnly,
    audit,
    verdicts_from_rules,
)
from integration.harness.bpfdev import attach

pytestmark = pytest.mark.root

V1 = Path("/sys/fs/cgroup/devices")
V2 = Path("/sys/fs/cgroup/unified")
UVM_MAJOR = 510  # as on a 550 driver; unregistered here, so an allowed open is ENXIO

PROC_DEVICES = f"""\
Character devices:
  1 mem
195 nvidia
195 nvidiactl
{UVM_MAJOR} nvidia-uvm

Block devices:
  8 sd
"""


class Gpu:
    def __init__(self, uuid_: str, index: int) -> None:
        self.uuid, self.index, self.minor, self.mig = uuid_, index, index, ()


GPUS = (Gpu("GPU-00000000-0000-0000-0000-000000000000", 0), Gpu("GPU-11111111", 1))


@pytest.fixture
def cleanup() -> Iterator[Callable[[object], None]]:
    """Register cgroup dirs (Path) and processes (Popen); all removed even on failure."""
    dirs: list[Path] = []
    procs: list[subprocess.Popen[bytes]] = []

    def add(thing: object) -> None:
        if isinstance(thing, Path):
            dirs.append(thing)
        else:
            assert isinstance(thing, subprocess.Popen)
            procs.append(thing)

    yield add
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, 9)  # by PID, the process this test started
        p.wait(timeout=10)
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        for _ in range(50):
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.02)  # a probe child still exiting
        assert not d.exists(), f"could not remove {d}"


def _mkcg(add: Callable[[object], None], base: Path, rel: str) -> Path:
    d = base
    for part in Path(rel).parts:
        d = d / part
        if not d.exists():
            d.mkdir()
            add(d)
    return d


def _write(d: Path, file: str, line: str) -> None:
    fd = os.open(d / file, os.O_WRONLY)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _mknod(path: Path, major: int, minor: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))


def _require_v1() -> None:
    require_root()
    require_tool(str(V1 / "devices.list"))


def _kernel_verdicts(cg: list[Path], nodes: dict[str, Path]) -> dict[str, bool | None]:
    return {num: probe_open(path, cg).verdict for num, path in nodes.items()}


def test_model_matches_kernel_on_random_writes(
    tmp_path: Path, cleanup: Callable[[object], None]
) -> None:
    """200 random writes to a real child cgroup under a restricted parent: devices.list
    text, refusals and access verdicts all agree with rules.apply_write/allows."""
    _require_v1()
    base = _mkcg(cleanup, V1, f"gpuguard-test-{uuid.uuid4().hex[:12]}")
    parent = _mkcg(cleanup, base, "parent")
    _write(parent, "devices.deny", "a")
    for line in ("c 195:* rwm", "c 1:* rwm", "b 8:0 r"):
        _write(parent, "devices.allow", line)
    parent_model = read_devices_list(parent)
    child = _mkcg(cleanup, parent, "child")
    model: DeviceRules = read_devices_list(child)
    assert model == parent_model  # a new cgroup copies its parent
    nodes = {"195:0": tmp_path / "n0", "195:3": tmp_path / "n3", "1:3": tmp_path / "null"}
    _mknod(nodes["195:0"], 195, 0)
    _mknod(nodes["195:3"], 195, 3)
    _mknod(nodes["1:3"], 1, 3)
    rng = random.Random(20240605)
    for step in range(200):
        line = "{} {}:{} {}".format(
            rng.choice("abcc"),
            rng.choice(["1", "195", "*", "8"]),
            rng.choice(["0", "3", "*"]),
            "".join(ch for ch in "rwm" if rng.random() < 0.6) or rng.choice(["", "x", "r"]),
        )
        file = rng.choice(["devices.allow", "devices.deny"])
        try:
            expected: DeviceRules | None = apply_write(model, file, line, parent=parent_model)
            want_err = None
        except WriteRejected as e:
            expected, want_err = None, e.errno_name
        try:
            _write(child, file, line)
            got_err = None
        except OSError as e:
            got_err = {1: "EPERM", 22: "EINVAL"}.get(e.errno or 0, str(e.errno))
        ctx = f"step {step}: {file} <- {line!r}"
        assert got_err == want_err, ctx
        if expected is not None:
            model = expected
        assert (child / "devices.list").read_text() == model.render_list(), ctx
        if step % 5 == 0:
            for num, path in nodes.items():
                major, minor = (int(x) for x in num.split(":"))
                assert probe_open(path, [child]).verdict == allows(
                    model, "c", major, minor, "rw"
                ), f"{ctx}: {num}"


def test_seed_002_rewrite_and_exact_regrant(
    tmp_path: Path, cleanup: Callable[[object], None]
) -> None:
    _require_v1()
    name = f"gpuguard-test-{uuid.uuid4().hex[:12]}"
    pod_uid = str(uuid.uuid4())
    cid = uuid.uuid4().hex + uuid.uuid4().hex
    base = _mkcg(cleanup, V1, name)
    ctr = _mkcg(cleanup, base, f"kubepods/burstable/pod{pod_uid}/{cid}")

    # The host: nodes made in our temporary directory, a /proc/devices sample.
    host = tmp_path / "host"
    for n, (ma, mi) in {
        "nvidia0": (195, 0),
        "nvidia1": (195, 1),
        "nvidiactl": (195, 255),
        "nvidia-uvm": (UVM_MAJOR, 0),
        "nvidia-uvm-tools": (UVM_MAJOR, 1),
    }.items():
        _mknod(host / "dev" / n, ma, mi)
    (host / "proc").mkdir()
    (host / "proc/devices").write_text(PROC_DEVICES)
    hroot = Root(host)
    majors = nvidia_majors(read_proc_devices(hroot))
    host_nodes = list_nvidia_nodes(hroot, majors)
    assert {n.path for n in host_nodes} == {n.path for n in expected_nodes(GPUS, majors, {})}
    node_files = {n.numbers: host / n.path.lstrip("/") for n in host_nodes}

    # The "container": a sleep in the cgroup, given GPU0 + ctl + uvm by the legacy hook.
    p = subprocess.Popen(["sleep", "300"])
    cleanup(p)
    _write(ctr, "cgroup.procs", str(p.pid))
    _write(ctr, "devices.deny", "a")  # runc create
    for r in RUNC_DEFAULT_RULES:
        _write(ctr, "devices.allow", r.render())
    for line in ("c 195:0 rwm", "c 195:255 rwm", f"c {UVM_MAJOR}:0 rwm", f"c {UVM_MAJOR}:1 rwm"):
        _write(ctr, "devices.allow", line)  # the hook, behind runc's back
    rootfs = tmp_path / "rootfs"
    for n in ("nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
        src = host / "dev" / n
        st = os.stat(src)
        _mknod(rootfs / "dev" / n, os.major(st.st_rdev), os.minor(st.st_rdev))
    (host / f"proc/{p.pid}").mkdir()
    (host / f"proc/{p.pid}/root").symlink_to(rootfs)
    (host / f"proc/{p.pid}/environ").write_bytes(
        f"NVIDIA_VISIBLE_DEVICES={GPUS[0].uuid}\0".encode()
    )

    def check_agreement() -> dict[str, bool | None]:
        rules = read_devices_list(ctr)
        kernel = _kernel_verdicts([ctr], node_files)
        model = {n.numbers: allows(rules, "c", n.major, n.minor, "rw") for n in host_nodes}
        assert kernel == model, (rules.render_list(), kernel)
        return kernel

    before = check_agreement()
    assert before == {"195:0": True, "195:1": False, "195:255": True, "510:0": True, "510:1": True}

    # Seed 002: kubelet's CPU manager -> runc update: deny all, allow runc's list only.
    _write(ctr, "devices.deny", "a *:* rwm")
    for r in RUNC_DEFAULT_RULES:
        _write(ctr, "devices.allow", r.render())
    wiped = check_agreement()
    assert set(wiped.values()) == {False}

    # Observe like the daemon: discover, entitle, evaluate, audit.
    layout = detect_layout(Root(Path("/")))
    assert layout.v1_devices == str(V1)
    (c,) = discover_containers(Root(Path("/")), layout, cgroup_root=f"/{name}")
    assert (c.pod_uid, c.container_id, c.driver, c.pids) == (pod_uid, cid, "cgroupfs", (p.pid,))
    assert c.cgroup_v1_devices == ctr
    ent = read_entitlement(hroot, c, host_nodes, majors, GPUS, {pod_uid: {GPUS[0].uuid}})
    assert sorted(n.numbers for n in ent.nodes) == ["195:0", "195:255", "510:0", "510:1"]
    rules = read_devices_list(ctr)
    access = verdicts_from_rules(cid, host_nodes, rules)
    findings, actions = audit(
        [c], {c.key: ent}, access, cgroup_of=Cgroups().of, device_rules={cid: rules}
    )
    assert {f.fields["CAUSE"] for f in findings} == {CAUSE_REWRITE}
    assert len(findings) == 4
    (action,) = actions
    assert isinstance(action, CgroupV1Allow)

    write_allow(Path(action.cgroup_dir), action.rules)
    after = check_agreement()
    assert after == before  # exactly what it was given: GPU1 still denied
    assert after["195:1"] is False
    again = verdicts_from_rules(cid, host_nodes, read_devices_list(ctr))
    assert audit([c], {c.key: ent}, again, cgroup_of=Cgroups().of) == ((), ())


# --- cgroup v2: a real BPF device program ------------------------------------------


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def _deny_195_1() -> bytes:
    """BPF_PROG_TYPE_CGROUP_DEVICE: return 0 (deny) for 195:1, 1 (allow) otherwise.
    ctx is struct bpf_cgroup_dev_ctx {u32 access_type; u32 major; u32 minor}."""
    return b"".join(
        [
            _insn(0x61, dst=2, src=1, off=4),  # r2 = ctx->major
            _insn(0x61, dst=3, src=1, off=8),  # r3 = ctx->minor
            _insn(0x55, dst=2, off=3, imm=195),  # if r2 != 195 goto allow
            _insn(0x55, dst=3, off=2, imm=1),  # if r3 != 1 goto allow
            _insn(0xB7, dst=0, imm=0),  # r0 = 0
            _insn(0x95),  # exit
            _insn(0xB7, dst=0, imm=1),  # allow: r0 = 1
            _insn(0x95),  # exit
        ]
    )


def test_v2_bpf_program_probe(tmp_path: Path, cleanup: Callable[[object], None]) -> None:
    require_root()
    require_tool(str(V2 / "cgroup.procs"))
    name = f"gpuguard-test-{uuid.uuid4().hex[:12]}"
    pod_uid = str(uuid.uuid4())
    cid = uuid.uuid4().hex + uuid.uuid4().hex
    base = _mkcg(cleanup, V2, name)
    ctr = _mkcg(cleanup, base, f"kubepods/pod{pod_uid}/{cid}")
    attach(ctr, _deny_195_1(), b"gpuguard_test", flags=0)
    assert len(query_device_programs(ctr)) == 1
    assert query_device_programs(base) == ()

    layout = detect_layout(Root(Path("/")))
    assert layout == CgroupLayout(str(V1) if V1.exists() else None, str(V2))
    found = discover_containers(Root(Path("/")), layout, cgroup_root=f"/{name}")
    (c,) = found
    assert (c.cgroup_v2, c.cgroup_v1_devices, c.pod_uid) == (ctr, None, pod_uid)

    n0, n1 = tmp_path / "nvidia0", tmp_path / "nvidia1"
    _mknod(n0, 195, 0)
    _mknod(n1, 195, 1)
    r0, r1 = probe_open(n0, [ctr]), probe_open(n1, [ctr])
    assert (r0.verdict, r0.detail) == (True, os.strerror(6))  # ENXIO: past the program
    assert (r1.verdict, r1.errno) == (False, 1)  # EPERM from the BPF program
    # Outside the cgroup the same node opens fine: the verdict is the program's.
    assert probe_open(n1, []).verdict is True

    from gpuguard.devices.entitlement import compute_entitlement, parse_visible_devices

    gpu1 = DeviceNode("/dev/nvidia1", 195, 1, "gpu")
    ent = compute_entitlement(
        pod_uid, cid, (gpu1,), (gpu1,), GPUS, parse_visible_devices("1"), None
    )
    access = {(cid, "195:1"): r1.verdict}
    findings, actions = audit([c], {c.key: ent}, access, cgroup_of=Cgroups().of)
    assert [f.fields["DEVICE_NUMBERS"] for f in findings] == ["195:1"]
    (a,) = actions
    assert isinstance(a, V2ReportOnly) and a.cgroup_dir == str(ctr)
