"""`gpuguard checkpoint inspect|canonical`: read kubelet's checkpoint, change nothing."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from gpuguard import exitcodes
from gpuguard.cli.args import config_from, inventory_path, nvml_lookup, root_from
from gpuguard.host.echo import cut


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
    from gpuguard.steps.checkpoint.observe import remap_inputs
    from gpuguard.steps.checkpoint.reconcile import analyse

    root = root_from(args)
    cfg = config_from(args, root)
    doc: dict[str, Any] = {"file": str(args.file)}
    try:
        loaded = load(args.file)
    except BadInputError as e:
        doc.update(valid=False, error=e.message)
        if args.json:
            print(json.dumps(doc, indent=2))
        print(f"gpuguard: {cut(e.message, 400)}", file=sys.stderr)
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
        inventory = load_inventory(inventory_path(args, cfg), nvml_lookup(root, cfg))
    except NoDriverError as e:
        doc["inventory_error"] = e.message
    else:
        # judged as `gpuguard check` judges it: through the GPU identity history
        inputs = remap_inputs(root, inventory, os.stat(args.file).st_mtime)
        analysis = analyse(cp, inventory, tuple(cfg.kubelet.resources), inputs)
        doc["inventory"] = inventory.source
        doc["stale"] = [f.to_json() for f in analysis.findings]
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(_render_inspect(doc))
    return exitcodes.OK if loaded.valid else exitcodes.BAD_INPUT


VALUE_MAX = 128  # characters of one ID or name echoed
LIST_MAX = 64  # IDs listed on one line, then how many more


def _show(value: object, limit: int = VALUE_MAX) -> str:
    """A value from the file, escaped (ESC, OSC, BEL, U+202E...) and cut: one line."""
    return cut(str(value), limit)


def _ids(ids: Any) -> str:
    if not ids:
        return str(ids)
    shown = ", ".join(_show(i) for i in ids[:LIST_MAX])
    return shown + (f", … ({len(ids) - LIST_MAX} more)" if len(ids) > LIST_MAX else "")


def _render_inspect(doc: dict[str, Any]) -> str:
    """The text report: every value that comes from the file escaped and bounded (the
    JSON report carries them whole; json.dumps escapes them)."""
    valid = "valid" if doc["valid"] else f"INVALID: {_show(doc['error'], 400)}"
    lines = [
        f"file:       {_show(doc['file'], 400)}",
        f"format:     {_show(doc['format'])}",
        f"checksum:   stored {_show(doc['checksum_stored'])}, "
        f"computed {_show(doc['checksum_computed'])} ({valid})",
        "registered:",
    ]
    for res, ids in doc["registered_devices"].items():
        lines.append(f"  {_show(res)}: {_ids(ids)}")
    lines.append(f"entries:    {len(doc['entries'])}")
    for e in doc["entries"]:
        ids = e["device_ids"]
        shown = (
            " ".join(f"numa {_show(n)}: {_ids(v or [])}" for n, v in list(ids.items())[:LIST_MAX])
            if isinstance(ids, dict)
            else _ids(ids or [])
        )
        who = " ".join(_show(e[k]) for k in ("pod_uid", "container_name", "resource_name"))
        lines.append(f"  pod {who}: {shown}")
    if doc["stale"] is None:
        why = _show(doc.get("inventory_error", "no inventory"), 400)
        lines.append(f"stale:      unknown ({why})")
    elif not doc["stale"]:
        lines.append(f"stale:      none (inventory: {_show(doc['inventory'], 400)})")
    else:
        lines.append(f"stale:      (inventory: {_show(doc['inventory'], 400)})")
        lines += [f"  {_show(f['summary'], 400)}" for f in doc["stale"]]
    return "\n".join(lines)


def cmd_checkpoint_canonical(args: argparse.Namespace) -> int:
    from gpuguard.checkpoint import load, marshal

    loaded = load(args.file)
    if not loaded.valid:
        print(f"gpuguard: warning: {cut(loaded.problem, 400)}", file=sys.stderr)
    sys.stdout.buffer.write(marshal(loaded.checkpoint))
    sys.stdout.flush()
    return exitcodes.OK
