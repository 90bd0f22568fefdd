"""kubelet's pre-start hook loads only what its path needs (bench/README.md,
"bench_check_process.py"), each path run in a fresh interpreter on a node under a
temporary root:

- unchanged since last verified (the memo matches): the configuration, the inventory,
  the memo and the hook's own records, and nothing that parses, judges or reports;
- healthy but not remembered (a full check that finds nothing): the checkpoint's
  parse and analysis, and nothing of the status file, node conditions, the device
  steps, the pass machinery or the repair's writer beyond the history's;
- `gpuguard --version`, the CLI's start every command pays: the parser alone.

A module added to these paths fails here: load it where it is used instead."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import CHECKPOINTS, REPO

CHECKPOINT = "var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"
MEMO = "var/lib/gpuguard/kubelet-hook.memo.json"
# the fixture's pods hold GPUs replaced since: the first run repairs it
INVENTORY = {
    "gpus": [
        {"uuid": u, "index": i, "minor": i, "pci_bus_id": f"00000000:{16 + i:02X}:00.0"}
        for i, u in enumerate(
            [
                "GPU-77a702db-e37f-3a74-d46d-c5713f66058c",
                "GPU-0b341c59-f96b-ba85-c137-78c3652fea65",
                "GPU-5d3e2a10-7c4b-4f0e-9a61-2b8e4c1d7f93",
            ]
        )
    ]
}

PROBE = """
import json, sys
from gpuguard.cli import main
try:
    code = main(sys.argv[2:])
except SystemExit as e:
    code = e.code
mods = sorted(m for m in sys.modules if sys.modules[m] is not None)
with open(sys.argv[1], "w") as f:
    json.dump({"code": code, "modules": mods}, f)
"""

#: Every gpuguard module the hook loads on an unchanged healthy node.
UNCHANGED = {
    "gpuguard",
    "gpuguard.actuate",
    "gpuguard.actuate.files",
    "gpuguard.actuate.statefile",
    "gpuguard.cli",
    "gpuguard.cli.args",
    "gpuguard.cli.check",
    "gpuguard.config",
    "gpuguard.config.keyspec",
    "gpuguard.config.parse",
    "gpuguard.config.reference",
    "gpuguard.config.schema",
    "gpuguard.config.sections_devices",
    "gpuguard.config.sections_inputs",
    "gpuguard.config.sections_node",
    "gpuguard.config.types",
    "gpuguard.errors",
    "gpuguard.exitcodes",
    "gpuguard.host",
    "gpuguard.host.echo",
    "gpuguard.host.inventory",
    "gpuguard.host.numparse",
    "gpuguard.host.nvmllib",
    "gpuguard.host.offswitch",
    "gpuguard.host.paths",
    "gpuguard.host.pathtrust",  # nvmllib trusts the library's directory chain
    "gpuguard.host.safeio",
    "gpuguard.host.statefile",
    "gpuguard.reporting",
    "gpuguard.reporting.npd_names",
    "gpuguard.steps",
    "gpuguard.steps.checkpoint",
    "gpuguard.steps.checkpoint.kubelet_hook",
    "gpuguard.steps.checkpoint.memo",
}
#: What a run that reports nothing never needs, on any of the three paths.
NEVER = {
    "gpuguard.reporting.npd",
    "gpuguard.reporting.status",
    "gpuguard.reporting.status_figures",
    "gpuguard.engine.oneshot",
    "gpuguard.engine.passes",
    "gpuguard.engine.runner",
    "gpuguard.devices.containers",
    "gpuguard.devices.kubepods",
    "gpuguard.devices.nodes",
    "gpuguard.devices.podnames",
    "secrets",
}


def run(out: Path, *argv: str) -> tuple[int, set[str]]:
    p = subprocess.run(
        [sys.executable, "-c", PROBE, str(out), *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads(out.read_text())
    return doc["code"], set(doc["modules"])


def test_the_hook_loads_only_what_its_path_needs(tmp_path: Path) -> None:
    root = tmp_path / "node"
    (root / CHECKPOINT).parent.mkdir(parents=True)
    (root / CHECKPOINT).write_bytes((CHECKPOINTS / "numa-blog-04.json").read_bytes())
    (root / "proc/1").mkdir(parents=True)
    (root / "proc/1/comm").write_text("systemd\n")
    inventory = tmp_path / "inventory.json"
    inventory.write_text(json.dumps(INVENTORY))
    hook = ["check", "--only", "checkpoint", "--kubelet-stopped", "--root", str(root)]
    hook += ["--inventory", str(inventory)]
    out = tmp_path / "modules.json"

    assert run(out, *hook)[0] == 0  # the repair
    assert not (root / MEMO).exists()
    code, full = run(out, *hook)  # healthy, not remembered yet: the full check
    assert code == 0 and (root / MEMO).exists()
    code, unchanged = run(out, *hook)
    assert code == 0
    code, version = run(out, "--version")
    assert code == 0

    assert {m for m in unchanged if m.startswith("gpuguard")} == UNCHANGED
    assert "gpuguard.steps.checkpoint.reconcile" in full  # the full check did run
    for name, loaded in (("unchanged", unchanged), ("full", full), ("--version", version)):
        assert loaded & NEVER == set(), name
    assert {m for m in version if m.startswith("gpuguard")} < UNCHANGED
    assert "dataclasses" not in version and "gpuguard.config" not in version
    # the repair's writer: only the history's record on a healthy full check
    assert "gpuguard.steps.checkpoint.actuate" in full
    assert "gpuguard.actuate.units" not in full and "gpuguard.steps.checkpoint.kubelet" not in full
