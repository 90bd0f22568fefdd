"""`gpuguard protect`'s plan (pure): each GPU container's present grant, made durable
before something else (the package's own `systemctl daemon-reload`) re-applies its
scope's device policy.

Present means what the kernel admits now: an entitled node whose verdict is "admitted"
is kept, a denied or unknown one is left as it is (protect repairs nothing, so it is the
same in observe and repair mode). Never for a scope that admits every device already
(durable.py: a DeviceAllow= would narrow it), a container whose files could not be read,
or a node the scope's gpuguard drop-in already lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from gpuguard.steps.container_access.view import AccessView

Device = tuple[str, str]  # ("/dev/char/195:0", "rw"), as actuate/dropins.py writes it


@dataclass(frozen=True)
class Protection:
    """One GPU container: what the drop-in must add (`add`), what it holds already
    (`kept`), and the entitled nodes the kernel denies or could not say (left alone)."""

    unit: str
    pod_uid: str
    container_id: str
    add: tuple[Device, ...]
    nodes: tuple[str, ...]  # the host paths of `add`, same order
    kept: tuple[str, ...]
    denied: tuple[str, ...]
    unknown: tuple[str, ...]


def plan_protect(
    view: AccessView, dropins: Mapping[str, Optional[Sequence[Device]]]
) -> tuple[Protection, ...]:
    """One Protection per GPU container in a systemd scope. `dropins`: the devices each
    scope's gpuguard drop-in lists now (absent or None: no drop-in)."""
    out = []
    for c in view.containers:
        ent = view.entitlements.get(c.key)
        if c.unit is None or ent is None or not ent.readable or not ent.is_gpu_container:
            continue
        if c.container_id in view.broken or c.container_id in view.unconfined:
            continue
        have = {d for d, p in dropins.get(c.unit) or () if {"r", "w"} <= set(p)}
        add, nodes, kept, denied, unknown = [], [], [], [], []
        for n in ent.nodes:
            verdict = view.access.get((c.container_id, n.numbers))
            if verdict is False:
                denied.append(n.path)
            elif verdict is None:
                unknown.append(n.path)
            elif n.dev_char in have:
                kept.append(n.path)
            else:
                # systemd parses /dev/char/MAJ:MIN itself: the link need not exist
                add.append((n.dev_char, "rw"))
                nodes.append(n.path)
        out.append(
            Protection(
                c.unit,
                c.pod_uid,
                c.container_id,
                tuple(add),
                tuple(nodes),
                tuple(kept),
                tuple(denied),
                tuple(unknown),
            )
        )
    return tuple(out)
