"""The names Kubernetes gives its cgroups: pods, QoS classes and container scopes, both
cgroup drivers, every runtime. The one place these patterns live; the kubepods walk
(devices/containers.py), the device plugin's process classification and the systemd
source's scope events all match with them. And the one parser of /proc/PID/cgroup,
which says in which of these cgroups a process is.

- systemd driver: ``kubepods.slice/kubepods-burstable.slice/
  kubepods-burstable-pod<uid with _ for ->.slice/cri-containerd-<id>.scope``
  (``crio-<id>.scope``, ``docker-<id>.scope``);
- cgroupfs driver: ``kubepods/burstable/pod<uid>/<id>`` (cri-o: ``crio-<id>``).
"""

from __future__ import annotations

import re
from typing import Optional

KUBEPODS_SLICE = "kubepods.slice"  # systemd driver
KUBEPODS_DIR = "kubepods"  # cgroupfs driver

# the scope / directory prefix of each runtime -> its name in journal fields
RUNTIME = {"cri-containerd": "containerd", "crio": "cri-o", "docker": "docker"}
_PREFIXES = "|".join(re.escape(p) for p in RUNTIME)

# Every pattern is used with fullmatch(): `$` also matches before a trailing newline, and
# a directory "cri-containerd-<id>.scope\n" is no scope systemd would ever load.
SYSTEMD_POD = re.compile(
    r"kubepods(?:-(?:burstable|besteffort|guaranteed))?-pod([0-9a-f_]+)\.slice"
)
SYSTEMD_QOS = re.compile(r"kubepods-(burstable|besteffort|guaranteed)\.slice")
SYSTEMD_CONTAINER = re.compile(rf"({_PREFIXES})-([0-9a-f]{{64}})\.scope")
CGROUPFS_POD = re.compile(r"pod([0-9a-f-]+)")
CGROUPFS_QOS = ("burstable", "besteffort", "guaranteed")
CGROUPFS_CONTAINER = re.compile(rf"(?:({_PREFIXES})-)?([0-9a-f]{{64}})")
# A container scope as systemd announces it (UnitNew): runtimes may name a scope by a
# shortened id, so 12 to 64 hex digits.
ANY_CONTAINER_SCOPE = re.compile(rf"({_PREFIXES})-[0-9a-f]{{12,64}}\.scope")


def has_control(name: str) -> bool:
    """A name with a control character (a newline, ESC, DEL, C1) or a line separator:
    no runtime makes one, systemd loads no unit by it, and echoed it splits log lines.
    Such a cgroup is refused with a finding, never taken for a container. (A name
    that is not UTF-8 is only skipped: no pattern matches it.)"""
    if name.isprintable():  # C speed: every name a runtime makes
        return False
    import unicodedata  # rare: kept off every command's start-up

    return any(unicodedata.category(c) in _CONTROL for c in name)


_CONTROL = frozenset({"Cc", "Cf", "Zl", "Zp"})


def scope_of_dropin_dir(name: str) -> Optional[str]:
    """The container scope whose drop-in directory is `name` (``UNIT.d``, in systemd's
    runtime or transient unit directory); None for any other unit or name."""
    unit = name[: -len(".d")] if name.endswith(".d") else ""
    return unit if ANY_CONTAINER_SCOPE.fullmatch(unit) else None


def systemd_pod_uid(name: str) -> Optional[str]:
    """The pod UID a systemd pod slice's name carries (its dashes written as "_");
    None for any other name."""
    m = SYSTEMD_POD.fullmatch(name)
    return m.group(1).replace("_", "-") if m else None


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """/proc/PID/cgroup: each controller's path (``devices``, ``name=systemd`` ...; ``""``
    for cgroup2's ``0::`` line), the first line naming it; malformed lines skipped."""
    by: dict[str, str] = {}
    for line in text.splitlines():
        _hierarchy, sep, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if not (sep and sep2):
            continue
        for c in controllers.split(",") if controllers else [""]:
            by.setdefault(c, path)
    return by
