"""The host as a pass found it: read once, shared by every step of the pass.

Why (issue 10): the checkpoint step may rewrite the kubelet checkpoint in the middle of a
pass, and the container_access step judges containers against that same file. A step
that re-read the file after the repair decided from evidence gpuguard itself had just
removed, so a real run granted what its dry-run had declined. Every step of a pass
now decides from this snapshot.

Each part is read on first use and then kept for the pass: a pass after a
daemon-reload repairs container access from its cache and must not wait for a
1,000-entry checkpoint it does not need. "Before any step acts" still holds, because
the only step that changes the checkpoint decides from `checkpoint()` too: the snapshot
is read before that write, whichever step asks first.

Across passes, the repair records the entries it drops or remaps (checkpoint/dropped.py),
and `pod_device_ids` is the checkpoint's entries (a remapped entry's record in place of
the IDs gpuguard wrote), or for a pod the checkpoint no longer names, those records: what
the checkpoint said before gpuguard touched it. A record never widens a live entry
(issue 28: a stale record naming another GPU made a live pod entitled to both).

Within a dry-run, `planned` holds what an earlier step would have created and did not
(device nodes, /dev/char links), so later steps plan against the host as the real run
would leave it, and the dry-run prints what the real run then does (the durable
DeviceAllow= entries that resolve through links made in the same run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional, Union

from gpuguard.checkpoint import Loaded, dropped, load
from gpuguard.errors import BadInputError
from gpuguard.host.paths import DROPPED_ENTRIES_FILE, Root

if TYPE_CHECKING:  # loaded where used: kubelet's pre-start hook reads the checkpoint only
    from gpuguard.devices.containers import ContainerCgroup, Kubepods
    from gpuguard.devices.nodes import DeviceNode, NvidiaMajors


@dataclass
class Planned:
    """What a dry-run's earlier steps would have created on the host and did not. Empty
    in a real run, whose changes are on the host itself."""

    nodes: dict[str, DeviceNode] = field(default_factory=dict)  # path -> node
    links: set[str] = field(default_factory=set)  # /dev/char/MAJ:MIN

    def host_nodes(self, listed: tuple[DeviceNode, ...]) -> tuple[DeviceNode, ...]:
        """The host's nodes as listed, plus those planned and not there yet."""
        have = {n.path for n in listed}
        return listed + tuple(n for p, n in sorted(self.nodes.items()) if p not in have)


@dataclass(frozen=True)
class HostSnapshot:
    root: Root
    checkpoint_path: str
    dropped_path: str = DROPPED_ENTRIES_FILE
    planned: Planned = field(default_factory=Planned, compare=False, hash=False)

    @cached_property
    def _checkpoint(self) -> Union[Loaded, BadInputError, None]:
        path = self.root.path(self.checkpoint_path)
        if not path.exists() and not path.is_symlink():
            return None
        try:
            return load(path)
        except BadInputError as e:
            return e

    def checkpoint(self) -> Optional[Loaded]:
        """The checkpoint as read at the first call of the pass (None: no file). A file
        that cannot be read raises the same BadInputError at every call. A wrong checksum
        is reported in the result (`valid`), as checkpoint.load() does."""
        c = self._checkpoint
        if isinstance(c, BadInputError):
            raise BadInputError(c.message)
        return c

    @cached_property
    def dropped_entries(self) -> tuple[tuple[dropped.DroppedEntry, ...], str]:
        """The recorded dropped entries, and why they could not be read ("" if they could)."""
        try:
            return dropped.read(self.root.path(self.dropped_path)), ""
        except BadInputError as e:
            return (), e.message

    @cached_property
    def pod_device_ids(self) -> Mapping[str, frozenset[str]]:
        """pod UID -> the device IDs the checkpoint gives it: its live entries, or, for
        a pod whose entries gpuguard dropped, those (dropped.pod_device_ids).

        An unreadable checkpoint gives no evidence (the checkpoint step reports it); a
        checksum kubelet would reject does not make the entries less true."""
        c = self._checkpoint
        entries = c.checkpoint.entries or () if isinstance(c, Loaded) else ()
        return dropped.pod_device_ids(entries, self.dropped_entries[0])

    @cached_property
    def pod_recorded_ids(self) -> Mapping[str, frozenset[str]]:
        """pod UID -> what its dropped entries named (never a grant: entitlement.py)."""
        return dropped.recorded_device_ids(self.dropped_entries[0])

    @cached_property
    def majors(self) -> NvidiaMajors:
        """The NVIDIA majors of /proc/devices, parsed once for every step of the pass (a
        module loaded since is the next pass's: its udev event marks one)."""
        from gpuguard.devices.nodes import nvidia_majors, read_proc_devices

        return nvidia_majors(read_proc_devices(self.root))

    @cached_property
    def _kubepods(self) -> dict[str, Kubepods]:
        return {}

    def _walk(self, cgroup_root: str) -> Kubepods:
        got = self._kubepods.get(cgroup_root)
        if got is None:
            from gpuguard.devices.containers import discover_kubepods

            got = self._kubepods[cgroup_root] = discover_kubepods(
                self.root, cgroup_root=cgroup_root
            )
        return got

    def containers(self, cgroup_root: str = "/") -> tuple[ContainerCgroup, ...]:
        """The kubepods containers under kubelet's ``cgroup_root``, walked once per pass
        for every step (container access and the device plugin step both judge them)."""
        return self._walk(cgroup_root)[0]

    def strays(self, cgroup_root: str = "/") -> tuple[Path, ...]:
        """The directories of the same walk that are no container (kubepods, QoS
        classes, pods, names no runtime gives): where a process gpuguard cannot
        attribute to a container would be."""
        return self._walk(cgroup_root)[1]
