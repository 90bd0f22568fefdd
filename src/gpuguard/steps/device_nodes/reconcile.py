"""NVIDIA device nodes and their /dev/char links (F2, F3), as a pure plan.

The driver registers its majors in /proc/devices when its modules load, but the
nodes themselves appear only when something creates them: nvidia-modprobe (run by
the driver's userspace on first use), a udev rule, or nobody. /dev/nvidia-uvm in
particular is created lazily, so a device plugin that starts first never sees it
(F3). And runc writes a DeviceAllow= entry for a device only if /dev/char/MAJ:MIN
exists, which udev does not create for NVIDIA nodes (F2). gpuguard keeps both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from gpuguard.devices.devchar import LinkState, dev_char_link
from gpuguard.devices.nodes import ROLE_CAP, DeviceNode
from gpuguard.model import Action, Finding
from gpuguard.steps.registry import DEVICE_NODES

NAME = DEVICE_NODES
DEFAULT_MODE = 0o666  # the driver's default (NVreg_DeviceFileMode)
CAP_MODE = 0o444  # nvidia-modprobe's mode for MIG capability nodes


@dataclass(frozen=True)
class CreateDeviceNode(Action):
    path: str = ""
    major: int = 0
    minor: int = 0
    mode: int = DEFAULT_MODE
    role: str = ""

    @property
    def kind(self) -> str:
        return "device-node-created"

    def describe(self) -> str:
        return f"create {self.path} (c {self.major}:{self.minor}, {self.mode:o}): {self.reason}"

    def fields(self) -> Mapping[str, str]:
        return {"DEVICE": self.path, "DEVICE_NUMBERS": f"{self.major}:{self.minor}"}


@dataclass(frozen=True)
class CreateCharLink(Action):
    link: str = ""  # /dev/char/195:0
    points_to: str = ""  # ../nvidia0
    replace: bool = False

    @property
    def kind(self) -> str:
        return "char-link-created"

    def describe(self) -> str:
        verb = "replace" if self.replace else "create"
        return f"{verb} {self.link} -> {self.points_to}: {self.reason}"

    def fields(self) -> Mapping[str, str]:
        return {"LINK": self.link, "DEVICE": "/dev/" + self.points_to.removeprefix("../")}


def plan(
    expected: Sequence[DeviceNode],
    existing: Sequence[DeviceNode],
    links: Sequence[LinkState],
    *,
    create_nodes: bool,
    create_links: bool,
) -> tuple[tuple[Finding, ...], tuple[Action, ...]]:
    """What to create so every expected node exists with its /dev/char link.

    A node that exists with other numbers is reported and left alone: something else
    owns it, and replacing a device node under running containers is not ours to do.
    """
    have = {n.path: n for n in existing}
    findings: list[Finding] = []
    actions: list[Action] = []
    usable: set[str] = set()
    for node in expected:
        cur = have.get(node.path)
        if cur is None:
            if create_nodes:
                mode = CAP_MODE if node.role == ROLE_CAP else DEFAULT_MODE
                actions.append(
                    CreateDeviceNode(
                        NAME,
                        f"the driver registered {node.role} {node.numbers} but {node.path} "
                        "does not exist",
                        node.path,
                        path=node.path,
                        major=node.major,
                        minor=node.minor,
                        mode=mode,
                        role=node.role,
                    )
                )
                usable.add(node.path)
            else:
                findings.append(
                    Finding(
                        "device-node-missing",
                        NAME,
                        f"{node.path} ({node.numbers}) is missing; CreateNodes=no",
                        {"DEVICE": node.path, "DEVICE_NUMBERS": node.numbers},
                    )
                )
        elif (cur.major, cur.minor) != (node.major, node.minor):
            findings.append(
                Finding(
                    "device-node-mismatch",
                    NAME,
                    f"{node.path} is {cur.numbers} but the driver says {node.numbers}; "
                    "left as it is (check what created it)",
                    {"DEVICE": node.path, "DEVICE_NUMBERS": cur.numbers},
                    severity="error",
                )
            )
        else:
            usable.add(node.path)
    for ls in links:
        if ls.state == "ok" or ls.node.path not in usable:
            continue
        link, target = dev_char_link(ls.node)
        if not create_links:
            findings.append(
                Finding(
                    "char-link-missing",
                    NAME,
                    f"{link} is {ls.state}; CreateCharLinks=no, so DeviceAllow= grants of "
                    f"{ls.node.path} cannot be made durable",
                    {"LINK": link, "DEVICE": ls.node.path},
                )
            )
            continue
        actions.append(
            CreateCharLink(
                NAME,
                f"{link} is {ls.state}{' (' + ls.detail + ')' if ls.detail else ''}; runc and "
                "systemd resolve DeviceAllow= through it",
                link,
                link=link,
                points_to=target,
                replace=ls.state == "wrong",
            )
        )
    return tuple(findings), tuple(actions)
