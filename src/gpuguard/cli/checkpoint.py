"""`gpuguard checkpoint inspect|canonical`: read kubelet's checkpoint, change nothing."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gpuguard import exitcodes
from gpuguard.cli.args import _config, _inventory_path, _nvml_lookup, _root


def _entry_json(e: Any) -> dict[str, Any]:
    ids: Any
    if e.shape == "v2":
        ids = {
            str(node): list(group) if group is not None else None for node, group in e.device_ids
        }
    elif e.device_ids is None:
        ids = None
    else:
        ids = list(e.device_ids) if e.shape == "v1" else {}
    return {
        "pod_uid": e.pod_uid,
        "container_name": e.container_name,
        "resource_name": e.resource_name,
        "device_ids": ids,
        "alloc_resp_bytes": None if e.alloc_resp is None else len(e.alloc_resp),
    }


def cmd_checkpoint_inspect(args: argparse.Namespace) -> int:
    from gpuguard.checkpoint import load
    from gpuguard.errors import BadInputError, NoDriverError
    from gpuguard.host.inventory import load_inventory
    from gpuguard.steps.checkpoint.reconcile import analyse

    root = _root(args)
    cfg = _config(args, root)
    doc: dict[str, Any] = {"file": str(args.file)}
    try:
        loaded = load(args.file)
    except BadInputError as e:
        doc.update(valid=False, error=e.message)
        if args.json:
            print(json.dumps(doc, indent=2))
        print(f"gpuguard: {e.message}", file=sys.stderr)
        return e.exit_code
    cp = loaded.checkpoint
    doc.update(
        format=cp.format,
        checksum_stored=cp.checksum,
        checksum_computed=loaded.computed,
        valid=loaded.valid,
        error=loaded.problem or None,
        registered_devices={
            r: list(ids) if ids is not None else None for r, ids in cp.registered or ()
        },
        entries=[_entry_json(e) for e in cp.entries or ()],
        inventory=None,
        stale=None,
    )
    try:
        inventory = load_inventory(_inventory_path(args, cfg), _nvml_lookup(root, cfg))
    except NoDriverError as e:
        doc["inventory_error"] = e.message
    else:
        analysis = analyse(cp, inventory, tuple(cfg.kubelet.resources))
        doc["inventory"] = inventory.source
        doc["stale"] = [f.to_json() for f in analysis.findings]
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(_render_inspect(doc))
    return exitcodes.OK if loaded.valid else exitcodes.BAD_INPUT


def _render_inspect(doc: dict[str, Any]) -> str:
    valid = "valid" if doc["valid"] else f"INVALID: {doc['error']}"
    lines = [
        f"file:       {doc['file']}",
        f"format:     {doc['format']}",
        f"checksum:   stored {doc['checksum_stored']}, "
        f"computed {doc['checksum_computed']} ({valid})",
        "registered:",
    ]
    for res, ids in doc["registered_devices"].items():
        lines.append(f"  {res}: {', '.join(ids) if ids else ids}")
    lines.append(f"entries:    {len(doc['entries'])}")
    for e in doc["entries"]:
        ids = e["device_ids"]
        shown = (
            " ".join(f"numa {n}: {', '.join(v or [])}" for n, v in ids.items())
            if isinstance(ids, dict)
            else ", ".join(ids or [])
        )
        lines.append(f"  pod {e['pod_uid']} {e['container_name']} {e['resource_name']}: {shown}")
    if doc["stale"] is None:
        lines.append(f"stale:      unknown ({doc.get('inventory_error', 'no inventory')})")
    elif not doc["stale"]:
        lines.append(f"stale:      none (inventory: {doc['inventory']})")
    else:
        lines.append(f"stale:      (inventory: {doc['inventory']})")
        lines += [f"  {f['summary']}" for f in doc["stale"]]
    return "\n".join(lines)


def cmd_checkpoint_canonical(args: argparse.Namespace) -> int:
    from gpuguard.checkpoint import load, marshal

    loaded = load(args.file)
    if not loaded.valid:
        print(f"gpuguard: warning: {loaded.problem}", file=sys.stderr)
    sys.stdout.buffer.write(marshal(loaded.checkpoint))
    sys.stdout.flush()
    return exitcodes.OK
