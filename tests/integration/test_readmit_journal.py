"""The re-admission bridge's rejection watch on a real journald (readmit/rejected.py,
kubeletlog.py): a unit named kubelet.service, in a private systemd namespace, logs
kubelet-like klog lines to its journal, forged ones among them, and the watch reads
them through python3-systemd's Reader and through journalctl.

* the previous kubelet (the same unit, an earlier process) logged a SyncLoop ADD and
  a rejection of a held pod: neither is this kubelet's;
* this kubelet logs a probe failure whose multi-line output carries a tenant's forged
  rejection line, behind a tab and raw with klog's whole header and kubelet's PID;
  a helper in its cgroup (systemd-cat: the same _SYSTEMD_UNIT, another _PID) logs
  one with kubelet's header too; then one real rejection of a pod the checkpoint
  held, and one of a pod it did not hold (a new pod: no re-admission).

Only the real rejection of the held pod is named, and the first admission is this
kubelet's own.
"""

from __future__ import annotations

import json
from typing import Any, Dict

import pytest

from gpuguard.checkpoint.codec import marshal
from gpuguard.checkpoint.model import Checkpoint, PodDevicesEntry
from integration.gpuguard_ns import wait_for
from integration.harness import systemd_ns as systemd_ns
from integration.harness.sysns import REPO, SystemdNamespace

pytestmark = pytest.mark.root

PYTHON = REPO / ".venv/bin/python"
CHECKPOINT = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"
SCRIPT = "/etc/kubelet-like.sh"
VICTIM = "5be161ab-85e5-5281-8e74-7c9c806b281d"  # held: named only if forged lines count
REAL = "7f0e7a52-1b7c-4c8e-9d1e-3a8f1c2b4d60"  # held: kubelet really rejects it
NEW = "0c7b1c6e-0000-4000-8000-000000000001"  # not held: a pod judged after the start
UNIT = """[Unit]
Description=kubelet-like: klog lines on its stderr
[Service]
ExecStart=/bin/sh /etc/kubelet-like.sh
"""
DENIED = (
    '"Pod admission denied" podUID="%s" pod="%s" reason="UnexpectedAdmissionError" '
    'message="Allocate failed due to %s"'
)
HEAD = "I1128 12:20:35.%06d %7d %s] "
PREVIOUS = f"""p=$$
printf '{HEAD}"SyncLoop ADD" source="file"\\n' 9 $p kubelet.go:2 >&2
printf '{HEAD}{DENIED}\\n' 10 $p allocation_manager.go:702 {VICTIM} prod/victim-0 old >&2
echo done-previous
exec sleep infinity
"""
THIS = f"""p=$$
echo "Flag --cgroup-driver has been deprecated, raw" >&2
printf '{HEAD}"SyncLoop ADD" source="file"\\n' 1 $p kubelet.go:2 >&2
printf '{HEAD}"Probe failed" pod="tenant/probe-0" output=<\\n' 2 $p prober.go:107 >&2
printf '\\t{DENIED}\\n' {VICTIM} prod/victim-0 tab >&2
printf '{HEAD}{DENIED}\\n' 3 $p allocation_manager.go:702 {VICTIM} prod/victim-0 raw >&2
printf ' > containerName="c"\\n' >&2
systemd-cat -t kubelet printf '{HEAD}{DENIED}\\n' 4 $p a.go:1 {VICTIM} prod/victim-0 helper
printf '{HEAD}{DENIED}\\n' 5 $p allocation_manager.go:702 {REAL} prod/gpu-a real >&2
printf '{HEAD}{DENIED}\\n' 6 $p allocation_manager.go:702 {NEW} default/new-7d9f late >&2
echo done-this
exec sleep infinity
"""
PROBE = """
import json, sys
from gpuguard.config import parse_config
from gpuguard.host.paths import Root
from gpuguard.readmit import kubeletlog
from gpuguard.readmit.rejected import RejectionWatch

if sys.argv[1] == "journalctl":
    kubeletlog.have_reader = lambda: False
said = {"rejected": [], "admitted": [], "problems": [], "notes": []}
w = RejectionWatch(
    Root(),
    "kubelet.service",
    lambda r: said["rejected"].append([r.pod_uid, r.pod, r.message]),
    said["admitted"].append,
    said["problems"].append,
    lambda level, text: said["notes"].append([level, text]),
    every=0.0,
)
w.follow(w.begin(parse_config("")), rounds=1)
print(json.dumps(said))
"""


def _checkpoint(ns: SystemdNamespace) -> None:
    entries = tuple(
        PodDevicesEntry(u, "main", "nvidia.com/gpu", ((0, (f"GPU-{u[:4]}",)),), b"\n\x03abc")
        for u in (VICTIM, REAL)
    )
    path = ns.path(CHECKPOINT)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(marshal(Checkpoint("v2", entries, {}, 0)))


def _run(ns: SystemdNamespace, script: str, marker: str) -> None:
    ns.path(SCRIPT).write_text(script)
    ns.systemctl("start", "kubelet.service")

    def logged() -> bool:
        out = ns.run(["journalctl", "--no-pager", "-u", "kubelet.service", "-o", "cat"]).stdout
        return marker in out

    wait_for(logged, 20, f"kubelet-like's {marker}")


def _probe(ns: SystemdNamespace, how: str) -> Dict[str, Any]:
    r = ns.run([str(PYTHON), "-c", PROBE, how], timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_only_this_kubelets_own_records_of_held_pods_are_named(systemd_ns: Any) -> None:
    ns = systemd_ns(units={"kubelet.service": UNIT})
    _checkpoint(ns)
    _run(ns, PREVIOUS, "done-previous")
    ns.systemctl("stop", "kubelet.service")
    _run(ns, THIS, "done-this")
    # the forged lines are in kubelet's journal, under its unit
    entries = ns.journal("kubelet.service")
    assert sum(VICTIM in str(e.get("MESSAGE", "")) for e in entries) == 4, entries
    for how in ("reader", "journalctl"):
        said = _probe(ns, how)
        assert said["problems"] == [], (how, said)
        assert [r[0] for r in said["rejected"]] == [REAL], (how, said)
        assert said["rejected"][0][2] == "Allocate failed due to real"
        (at,) = said["admitted"]
        assert round(at % 1, 6) == 0.000001, (how, at)  # this kubelet's SyncLoop ADD
        debug = [t for lvl, t in said["notes"] if lvl == "debug"]
        assert len(debug) == 1 and NEW in debug[0], (how, said)
        notices = [t for lvl, t in said["notes"] if lvl == "notice"]
        assert bool(notices) == (how == "journalctl"), (how, said)
