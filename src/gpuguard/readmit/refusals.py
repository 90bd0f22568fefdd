"""The waiting pods the bridge does not (fully) offer for, with the reason (pure).

A pod whose held device is not vouched for (readmit/presence.py: a MIG device
recreated with a new UUID, a slot that is empty, an index now another GPU's) is named
in the decision's ``why`` and journal fields, so the operator knows which pods kubelet
will reject and why, before kubelet says so.
"""

from __future__ import annotations

from typing import Callable, Mapping

from gpuguard.host.echo import cut

NAMED = 3  # pods named in the one-line ``why``; the rest counted


def refusals(
    held: Mapping[str, Mapping[str, set[str]]],
    verdicts: Mapping[str, str],
    waiting: set[str],
    norm: Callable[[str], str],
) -> tuple[tuple[str, str], ...]:
    """(pod uid, why) per waiting pod with a held device not present: the first such
    device and its reason, sorted by pod."""
    out: dict[str, str] = {}
    for resource in sorted(held):
        for uid, ids in sorted(held[resource].items()):
            if norm(uid) not in waiting or uid in out:
                continue
            bad = sorted(i for i in ids if verdicts.get(i))
            if bad:
                more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
                out[uid] = f"{resource} {cut(bad[0], 80)}{more}: {verdicts[bad[0]]}"
    return tuple(sorted(out.items()))


def describe(refused: tuple[tuple[str, str], ...], evidence: str) -> str:
    """The tail of the decision's ``why``: the evidence, and the pods not offered."""
    said = f"; devices judged on {evidence}" if evidence else ""
    if refused:
        named = "; ".join(f"pod {cut(u, 64)}: {w}" for u, w in refused[:NAMED])
        more = f" (+{len(refused) - NAMED} more pods)" if len(refused) > NAMED else ""
        said += f"; not offered: {named}{more}"
    return said


def refused_field(refused: tuple[tuple[str, str], ...]) -> str:
    """The journal field REFUSED: every pod not offered, "uid: why" each, bounded."""
    return cut("; ".join(f"{u}: {w}" for u, w in refused), 2000)
