"""`gpuguard status`: the node's GPUs, containers and the daemon's last passes."""

from __future__ import annotations

import argparse
import json

from gpuguard import exitcodes
from gpuguard.cli.args import _config, _inventory_path, _root

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

    root = _root(args)
    cfg = _config(args, root)
    try:
        inventory = load_inventory(_inventory_path(args, cfg))
    except NoDriverError:
        inventory = None
    from gpuguard.host.echo import cut
    from gpuguard.reporting.status import status_json
    from gpuguard.reporting.summary import node_summary, render

    rows = container_status(root, cfg, inventory)
    daemon = daemon_status(root)
    summary = node_summary(root, rows)
    if args.json:
        doc = status_json(daemon) if daemon is not None else None
        print(json.dumps({"summary": summary, "daemon": doc, "containers": rows}, indent=2))
    else:
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
        print(f"containers: {len(rows)} with GPUs")
        for r in rows:
            what = r["access"] if r["access"] != "denied" else "DENIED " + ", ".join(r["denied"])
            how = MECHANISM_TEXT.get(r["mechanism"], r["mechanism"])
            print(
                f"  pod {r['pod_uid']} {r['container_id'][:12]} {', '.join(r['nodes'])}: {what}"
                f" ({r['layout']}, {how})"
            )
            for p in r["problems"]:
                print(f"    {cut(p, 300)}")
    # 1: a problem now (the daemon's latest results or a container read now); an
    # unknown verdict is printed as UNKNOWN, never as OK, and is not a finding
    bad = summary["verdict"] == "problem" or any(r["access"] != "ok" or r["missing"] for r in rows)
    return exitcodes.FINDINGS if bad else exitcodes.OK
