"""One pod entry's IDs and allocation response, translated through ONE generation's map.

remap.py picks, per entry, the generation it was written under; everything of that
entry (IDs, NUMA key, envs, annotations, CDI names, device and mount paths) goes
through that generation's map and no other, so no part of an entry can be read in one
numbering and another part in the next (an ID translated through an older generation
while its `/dev/nvidia1` is read through the newest would name another pod's GPU).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

from gpuguard.checkpoint import allocresp
from gpuguard.steps.checkpoint.deviceids import DeviceId, Matcher, classify
from gpuguard.steps.checkpoint.gpumap import GpuMap

VISIBLE = "NVIDIA_VISIBLE_DEVICES"
UUIDISH = re.compile(
    r"(?<![0-9A-Za-z-])(MIG-GPU-[0-9A-Za-z]+(?:-[0-9A-Za-z]+)+/[0-9]{1,9}/[0-9]{1,9}"
    r"|(?:GPU|MIG)-[0-9A-Za-z]+(?:-[0-9A-Za-z]+)+)(?![0-9A-Za-z])"
)
GPU_NODE = re.compile(r"/dev/nvidia([0-9]{1,7})\Z")
CAPS = "/dev/nvidia-caps/"
INDEX_FORMS = ("index", "mig-index")
UUID_FORMS = ("gpu-uuid", "mig-uuid", "mig-legacy")
CONTAINER_PATHS = (allocresp.DEVICE_CONTAINER, allocresp.MOUNT_CONTAINER)


class Failed(Exception):
    """The entry cannot be translated; the message says why (a drop's reason)."""


class Unknown(Failed):
    """No usable history knows the entry's stale IDs: nothing says which GPU they were."""


def host_path(where: str, key: str, value: str) -> bool:
    """Whether a string names a path on the host: a container path is the plugin's own
    name inside the container, a host path only when it is the same as its host path
    (`key`, allocresp.rewrite()), as NVIDIA's plugin writes them."""
    return where != allocresp.DEVICE_PERMISSIONS and (where not in CONTAINER_PATHS or value == key)


@dataclass
class Translator:
    """Translates one entry's (or registered list's) IDs through its generation's map."""

    g: GpuMap
    matcher: Matcher
    whole: bool
    rewritten: dict[bytes, Union[bytes, Failed]] = field(default_factory=dict)
    translated: dict[str, Union[str, Failed]] = field(default_factory=dict)
    nodes: dict[str, int] = field(default_factory=dict)
    how: Optional[str] = None  # how its GPUs were paired, for the journal

    def node_of(self, new_id: str, numa: Mapping[str, int]) -> int:
        """The NUMA node of the GPU behind a translated ID (-1: unknown), once per ID."""
        node = self.nodes.get(new_id)
        if node is None:
            node = self.nodes[new_id] = self.g.numa_now(self.gpu_uuid(new_id), numa)
        return node

    def raw_id(self, raw: str) -> str:
        """id() of a raw ID, each translated once per plan."""
        done = self.translated.get(raw)
        if done is None:
            try:
                done = self.id(classify(raw))
            except Failed as why:
                done = why
            self.translated[raw] = done
        if isinstance(done, Failed):
            raise done
        return done

    def id(self, d: DeviceId) -> str:
        knows = (
            self.g.knows_index(int(d.key)) if d.form in INDEX_FORMS else self.g.knows_uuid(d.key)
        )
        if knows and (self.whole or d.form not in INDEX_FORMS):
            new, why = self.g.translate(d)
        elif self.matcher.exists(d):
            return d.raw
        else:
            new, why = None, f"{d.raw} is not in the generation its entry was written under"
        if new is None:
            raise Failed(why)
        return new

    def text(self, where: str, key: str, value: str) -> str:
        path = GPU_NODE.match(value)
        if path:
            if not host_path(where, key, value):
                return value
            minor, why = self.g.minor_now(int(path.group(1)))
            if why:
                raise Failed(f"its allocation names {why}")
            return value if minor is None else f"/dev/nvidia{minor}"
        if value.startswith(CAPS) and any(m.old.minor != m.new.minor for m in self.g.matches):
            raise Failed(
                f"its allocation names {value}, whose number follows its GPU's minor, which changed"
            )
        value = UUIDISH.sub(self._token, value)
        if self.whole and (
            (where == allocresp.ENV and key == VISIBLE)
            or where in (allocresp.CDI_NAME, allocresp.ANNOTATION)
        ):
            value = ",".join(self._list_item(x) for x in value.split(","))
        return value

    def _token(self, m: re.Match[str]) -> str:
        d = classify(m.group(0))
        if not self.g.knows_uuid(d.key):
            return m.group(0)
        new, why = self.g.translate(d)
        if new is None:
            raise Failed(f"its allocation names {why}")
        return new

    def _list_item(self, item: str) -> str:
        prefix, sep, name = item.rpartition("=")  # CDI: nvidia.com/gpu=0
        d = classify(name)
        if d.form not in INDEX_FORMS or name != name.strip() or not self.g.knows_index(int(d.key)):
            return item
        new, why = self.g.translate(d)
        if new is None:
            raise Failed(f"its allocation names {why}")
        return prefix + sep + new

    def gpu_uuid(self, new_id: str) -> str:
        """The current GPU's UUID behind a translated ID (for its NUMA node)."""
        d = classify(new_id)
        for m in self.g.matches:
            if d.form in ("gpu-uuid", "mig-legacy") and d.key == m.new.uuid:
                return m.new.uuid
            if d.form in INDEX_FORMS and d.key == str(m.new.index):
                return m.new.uuid
            if d.form == "mig-uuid" and any(x.uuid == d.key for x in m.new.mig):
                return m.new.uuid
        return ""

    def old_gpu(self, raw: str) -> str:
        """The GPU an ID of this entry named when it was written (its UUID in the
        generation, or the ID itself when it is a current one kept as it is)."""
        d = classify(raw)
        if d.form in INDEX_FORMS and self.whole and self.g.knows_index(int(d.key)):
            m = self.g.of_index(int(d.key))
            return "" if m is None else m.old.uuid
        return ""
