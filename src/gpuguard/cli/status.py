"""`gpuguard status`: the node's GPUs, containers and the daemon's last passes."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import TYPE_CHECKING, Optional, Sequence

from gpuguard import exitcodes
from gpuguard.cli.args import config_or_fallback, inventory_path, nvml_lookup, root_from

if TYPE_CHECKING:  # imported where used: status loads only what it prints
    from gpuguard.host.paths import Root
    from gpuguard.reporting.container_row import ContainerRow
    from gpuguard.reporting.status import Status

# `gpuguard status`: what admits a container's devices (ContainerCgroup.mechanism)
MECHANISM_TEXT = {
    "v1-rule": "v1 rule",
    "scope-device-allow": "scope DeviceAllow=",
    "own-program": "own BPF program",
}


def cmd_status(args: argparse.Namespace) -> int:
    from gpuguard.engine.oneshot import container_status, daemon_status
    from gpuguard.errors import NoDriverError
    from gpuguard.host.inventory import load_inventory

    root = root_from(args)
    cfg = config_or_fallback(args, root)
    try:
        inventory = load_inventory(inventory_path(args, cfg), nvml_lookup(root, cfg))
        gpus_from = inventory.describe_source()
    except NoDriverError as e:
        inventory, gpus_from = None, f"unavailable: {e.message}"
    from gpuguard.devices.podnames import pod_names
    from gpuguard.host.echo import cut
    from gpuguard.host.offswitch import read_off_switch
    from gpuguard.reporting.status import status_json
    from gpuguard.reporting.summary import node_summary, render

    read = container_status(root, cfg, inventory)
    names = pod_names(root, (r.container_id for r in read))
    rows = [
        replace(r, pod=str(names[r.container_id])) if r.container_id in names else r for r in read
    ]
    daemon = daemon_status(root)
    summary = node_summary(root, rows)
    off = read_off_switch(root)
    observe = cfg.daemon.observe or (daemon is not None and daemon.mode == "observe")
    if args.json:
        doc = {
            "summary": summary.to_json(),
            "daemon": status_json(daemon) if daemon is not None else None,
            "containers": [r.to_json() for r in rows],
            "off_switch": off.to_json() if off is not None else None,
            "mode": "observe" if observe else "repair",
            "gpus_from": gpus_from,  # NVML's library and where it was found, or a file
        }
        print(json.dumps(doc, indent=2))
    else:
        if off is not None:
            print(f"gpuguard:   OFF: {off.describe()}; nothing is checked or repaired")
            print("            turn it back on: gpuguard enable")
        elif observe:
            print("gpuguard:   observe-only (Mode=observe): findings are reported, nothing changed")
        print("\n".join(render(summary)))
        if daemon is None:
            print("daemon:     not running (no usable status file)")
        else:
            last = daemon.last_pass
            reasons = ", ".join(cut(r, 120) for r in last.reasons[:2]) if last else "none"
            found = len(last.findings) if last else 0
            print(
                f"daemon:     pid {daemon.pid}, {daemon.passes} pass(es); last: "
                f"{reasons} with {found} finding(s)"
            )
        print(f"GPUs from:  {cut(gpus_from, 300)}")
        print(containers_line(root, rows, daemon))
        for r in rows:
            what = r.access if r.access != "denied" else "DENIED " + ", ".join(r.denied)
            how = MECHANISM_TEXT.get(r.mechanism, r.mechanism)
            pod = f"{r.pod} ({r.pod_uid})" if r.pod else r.pod_uid
            print(
                f"  pod {pod} {r.container_id[:12]} {', '.join(r.nodes)}: {what}"
                f" ({r.layout}, {how})"
            )
            for p in r.problems:
                print(f"    {cut(p, 300)}")
    # 1: a problem now (the daemon's latest results or a container read now); an
    # unknown verdict is printed as UNKNOWN, never as OK, and is not a finding
    bad = summary.verdict == "problem" or any(r.access != "ok" or r.missing for r in rows)
    return exitcodes.FINDINGS if bad else exitcodes.OK


def containers_line(root: Root, rows: Sequence[ContainerRow], daemon: Optional[Status]) -> str:
    """How many GPU containers were read now, and what that count leaves out: no NVIDIA
    driver registered (nothing could be judged, which is no "0"), or containers the
    daemon's latest step results name that this read did not list."""
    from gpuguard.devices.nodes import nvidia_majors, read_proc_devices
    from gpuguard.reporting.summary import named_containers

    if not rows and nvidia_majors(read_proc_devices(root)).nvidia is None:
        return "containers: not read now (no NVIDIA driver in /proc/devices)"
    line = f"containers: {len(rows)} with GPUs"
    more = sorted(named_containers(daemon) - {r.container_id for r in rows})
    if more:
        ids = ", ".join(c[:12] for c in more[:4]) + (" ..." if len(more) > 4 else "")
        line += (
            f"; the daemon's latest results name {len(more)} more ({ids}), not read "
            "now as GPU containers"
        )
    return line
