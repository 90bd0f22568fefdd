"""The ``/dev/char/MAJ:MIN`` links of device nodes: what udev writes, and whether each
leads to a node with the right numbers.

runc turns a ``DeviceAllow=`` for a systemd unit into ``/dev/char/MAJ:MIN`` and only if
that link exists (failure-modes.md F2), so the expected ``/dev/char`` links are part of
the expected set of the device nodes step.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Sequence

from gpuguard.devices import nodes as devnodes
from gpuguard.devices.nodes import DeviceNode
from gpuguard.host.paths import Root


def dev_char_link(node: DeviceNode) -> tuple[str, str]:
    """(link path, target) as udev writes them: ``/dev/char/195:0 -> ../nvidia0``."""
    if not node.path.startswith("/dev/"):
        raise ValueError(f"not a /dev path: {node.path}")
    return node.dev_char, "../" + node.path[len("/dev/") :]


@dataclass(frozen=True)
class LinkState:
    node: DeviceNode
    link: str  # /dev/char/MAJ:MIN
    state: str  # "ok" | "missing" | "wrong" (points at another device or none)
    detail: str = ""


def check_dev_char_links(root: Root, nodes: Sequence[DeviceNode]) -> tuple[LinkState, ...]:
    """Whether each node's /dev/char link resolves to a node with the same numbers.

    Any target is fine (udev writes ``../nvidia0``, nvidia-ctk ``/dev/nvidia0``); only
    where it leads counts, because that is all runc checks. Targets are resolved under
    the root, never on the host when the root is a test directory."""
    out: list[LinkState] = []
    for node in nodes:
        link = node.dev_char
        host_link = root.path(link)
        try:
            target = os.readlink(host_link)
        except FileNotFoundError:
            out.append(LinkState(node, link, "missing"))
            continue
        except OSError as e:
            out.append(LinkState(node, link, "wrong", f"not a symlink: {e.strerror}"))
            continue
        resolved = root.path(target) if target.startswith("/") else host_link.parent / target
        try:
            st = devnodes._stat(resolved, True)  # through the module: tests fake it there
        except OSError as e:
            out.append(LinkState(node, link, "wrong", f"-> {target}: {e.strerror}"))
            continue
        same = stat.S_ISCHR(st.st_mode) == (node.type == "c") and (
            os.major(st.st_rdev),
            os.minor(st.st_rdev),
        ) == (node.major, node.minor)
        out.append(LinkState(node, link, "ok" if same else "wrong", "" if same else f"-> {target}"))
    return tuple(out)
