"""One GPU container's row in `gpuguard status`: who it is (its cgroup), what its pod was
given, and what this read found; built by engine/oneshot.py, counted by the summary
(reporting/summary.py), printed and written as JSON by cli/status.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

# ok: every granted node opens; denied: one does not; unknown: one could not be judged;
# unreadable: the container's cgroup could not be read (nothing judged)
Access = Literal["ok", "denied", "unknown", "unreadable"]
JsonRow = dict[str, Union[str, list[str], None]]


@dataclass(frozen=True)
class ContainerRow:
    pod_uid: str
    container_id: str
    unit: Optional[str]  # its systemd scope, where it has one
    driver: str
    layout: str
    mechanism: str  # what admits its devices (ContainerCgroup.mechanism)
    access: Access
    nodes: tuple[str, ...] = ()  # the device nodes its pod was given
    missing: tuple[str, ...] = ()  # given, and absent from the host's /dev
    denied: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    # "PATH MAJOR:MINOR" of a node whose numbers changed; None for an unreadable row,
    # which lists none (its JSON has no "stale")
    stale: Union[tuple[str, ...], None] = None
    problems: tuple[str, ...] = ()
    pod: str = ""  # namespace/name, where the runtime's records name it

    def to_json(self) -> JsonRow:
        """The row of `gpuguard status --json`, its keys in their documented order."""
        out: JsonRow = {
            "pod_uid": self.pod_uid,
            "container_id": self.container_id,
            "unit": self.unit,
            "driver": self.driver,
            "layout": self.layout,
            "mechanism": self.mechanism,
            "nodes": list(self.nodes),
            "missing": list(self.missing),
            "denied": list(self.denied),
            "unknown": list(self.unknown),
        }
        if self.stale is not None:
            out["stale"] = list(self.stale)
        out["access"] = self.access
        out["problems"] = list(self.problems)
        out["pod"] = self.pod
        return out
