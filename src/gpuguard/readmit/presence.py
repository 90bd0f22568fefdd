"""Which checkpointed device IDs the node still has, and on what evidence (pure).

Two views of the node's GPUs, each a :class:`NodeDevices`:

- **the driver's** (NVML, or the inventory file standing in for it): each GPU's UUID,
  index, PCI slot and its MIG devices as they are now;
- **PCI + history, driver not loaded** (the GPU Operator's layout at boot: the driver
  is a container that kubelet itself starts): sysfs lists the PCI functions without a
  driver, and gpuguard's GPU identity history (checkpoint/history.py, written by the
  daemon from NVML) says which GPU each slot held. A GPU of the history whose slot
  still holds an NVIDIA display function (vendor 0x10de, class 0x0300 or 0x0302) is
  vouched for; nothing is vouched for a slot that is empty or holds another device.

An ID (readmit/devids.py) is present when its base device is:

- a GPU UUID: a GPU with that UUID (vouched, in the PCI view);
- a GPU index: the GPU at that index, in the slot the history had at that index (the
  PCI view also needs the history's set of GPU slots unchanged: NVML numbers GPUs in
  PCI order, so one gone renumbers the rest);
- a MIG device: only through the driver, never vouched for from the PCI bus (MIG
  devices are destroyed at each boot and recreated, by the MIG manager, with new
  UUIDs): ``MIG-<uuid>`` when that MIG UUID exists now; the older
  ``MIG-GPU-<uuid>/<gi>/<ci>`` and the index form ``<gpu>:<mig>`` when the GPU is
  there with the same MIG devices (UUID for UUID) as the history's generation before
  this boot recorded, since those IDs name a position that a recreated layout may
  fill with another device (another profile: a slice held twice);
- a replica ``<id>::<n>`` (time-slicing, MPS): when ``<id>`` is.

``judge`` says why an ID is not present, for the decision's ``why`` (pods named).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from gpuguard.checkpoint.history import Generation, GpuIdentity, MigIdentity, normal_bus_id
from gpuguard.devices.pci import NVIDIA_VENDOR, PciFunction
from gpuguard.host.echo import cut
from gpuguard.host.inventory import Inventory
from gpuguard.readmit.devids import (
    GPU_INDEX,
    GPU_UUID,
    MIG_LEGACY,
    MIG_UUID,
    DeviceId,
    parse_id,
)

DRIVER_NOT_LOADED = "PCI + history, driver not loaded"
# the history's newest generation was recorded this boot (by the daemon, from NVML):
# its MIG devices are this boot's, as the driver last showed them
THIS_BOOT = "PCI + this boot's history (NVML as gpuguard last read it)"
GPU_CLASSES = ("0x0300", "0x0302")  # VGA, 3D controller (PCI class, subclass)
NOT_VOUCHED_MIG = "MIG devices are recreated at each boot: never vouched for without the driver"


@dataclass(frozen=True)
class SlotGpu:
    """One GPU the view vouches for, in its PCI slot."""

    bus: str  # normal_bus_id() form
    uuid: str
    index: int
    mig: tuple[MigIdentity, ...] = ()  # its MIG devices now (the driver's view only)


_SlotMatch = Callable[[SlotGpu], bool]
_HistMatch = Callable[[GpuIdentity], bool]


@dataclass(frozen=True)
class NodeDevices:
    """The node's GPUs as one view shows them (see the module's docstring)."""

    evidence: str  # "NVML ...", "inventory <file>", DRIVER_NOT_LOADED; "" when nothing
    gpus: tuple[SlotGpu, ...] = ()
    driver: bool = False  # the driver's view: MIG devices are known
    history: Optional[Generation] = None  # the newest generation, for index and MIG
    # the newest generation of an earlier boot (MIG positions are judged against it)
    earlier: Optional[Generation] = None
    slots: tuple[str, ...] = ()  # the PCI view: the NVIDIA GPU slots on the bus now
    unvouched: tuple[tuple[str, str], ...] = ()  # the PCI view: history's bus -> why not
    problem: str = ""  # why the node's devices are not known ("" when they are)
    exact: Optional[frozenset[str]] = field(default=None)  # a plain ID set (see of_ids)

    @classmethod
    def of_ids(cls, ids: frozenset[str], evidence: str = "") -> NodeDevices:
        """A view that is a plain set of IDs (each replica by its base ID)."""
        return cls(evidence, exact=frozenset(ids))

    def judge(self, raw: str) -> str:
        """ "" when the checkpointed ID ``raw`` is present, else why not (one line)."""
        d = parse_id(raw)
        if self.exact is not None:
            return "" if raw in self.exact or d.base in self.exact else "not on the node"
        if not self.evidence:
            return f"the node's GPUs are not known ({self.problem or 'no driver, no history'})"
        if d.form == GPU_UUID:
            return self._gpu(lambda g: g.uuid == d.gpu_uuid, lambda h: h.uuid == d.gpu_uuid)
        if d.form == GPU_INDEX:
            return self._index(d)
        if d.is_mig:
            return self._mig(d) if self.driver else NOT_VOUCHED_MIG
        return "not a device ID form of NVIDIA's plugin"

    # -- GPUs ------------------------------------------------------------------------

    def _old(self, match: _HistMatch) -> Optional[GpuIdentity]:
        gen = self.history
        return next((h for h in gen.gpus if match(h)), None) if gen is not None else None

    def _gpu(self, now: _SlotMatch, then: _HistMatch) -> str:
        if any(now(g) for g in self.gpus):
            return ""
        old = self._old(then)
        if old is not None:
            why = dict(self.unvouched).get(old.pci_bus_id)
            if why:
                return why
            if any(g.bus == old.pci_bus_id for g in self.gpus):
                return f"its slot {old.pci_bus_id} (by history) holds another GPU now"
            return f"its slot {old.pci_bus_id} (by history) has no GPU the driver sees"
        return "not on the node" if self.driver else "not in gpuguard's GPU history"

    def _index(self, d: DeviceId) -> str:
        at = next((g for g in self.gpus if g.index == d.gpu_index), None)
        old = self._old(lambda h: h.index == d.gpu_index)
        if not self.driver:
            if old is None:
                return f"index {d.gpu_index} is not in gpuguard's GPU history"
            if at is None:
                return dict(self.unvouched).get(old.pci_bus_id, "not on the node")
            was = sorted(h.pci_bus_id for h in self.history.gpus) if self.history else []
            if was != sorted(self.slots):
                return (
                    f"GPU slots changed since the history (was {len(was)}, now "
                    f"{len(self.slots)}): indices cannot be vouched for without the driver"
                )
            return ""
        if at is None:
            return f"no GPU has index {d.gpu_index}"
        if old is not None and old.pci_bus_id != at.bus:
            return f"index {d.gpu_index} is the GPU in slot {at.bus} now (was {old.pci_bus_id})"
        return ""

    # -- MIG devices (the driver's view) -----------------------------------------------

    def _mig(self, d: DeviceId) -> str:
        if d.form == MIG_UUID:
            if any(m.uuid == d.base for g in self.gpus for m in g.mig):
                return ""
            old = self._old(lambda h: any(m.uuid == d.base for m in h.mig))
            if old is not None and any(g.bus == old.pci_bus_id for g in self.gpus):
                return f"MIG devices recreated on slot {old.pci_bus_id}: its MIG UUIDs changed"
            return "no such MIG device on the node"
        if d.form == MIG_LEGACY:
            at = next((g for g in self.gpus if g.uuid == d.gpu_uuid), None)
            if at is None:
                return "its GPU is not on the node"
            if (d.gi, d.ci) not in {(m.gi, m.ci) for m in at.mig}:
                return f"no MIG device at GPU instance {d.gi}, compute instance {d.ci}"
            return self._same_mig(at)
        at = next((g for g in self.gpus if g.index == d.gpu_index), None)  # MIG_INDEX
        if at is None:
            return f"no GPU has index {d.gpu_index}"
        if not at.mig:
            return f"GPU {d.gpu_index} has no MIG device now"
        return self._same_mig(at)

    def _same_mig(self, at: SlotGpu) -> str:
        """The index and legacy forms name a position, which MIG devices recreated
        (with new UUIDs, perhaps other profiles) may fill with another device: present
        only while the slot's MIG devices are those of the generation before this boot
        (the newest, when none is older), UUID for UUID."""
        gen = self.earlier or self.history
        old = next((h for h in gen.gpus if h.pci_bus_id == at.bus), None) if gen else None
        if old is None:
            return (
                f"slot {at.bus} is not in gpuguard's GPU history: whether its MIG devices "
                "are the checkpoint's cannot be told"
            )
        same = {m.uuid for m in old.mig} == {m.uuid for m in at.mig}
        return "" if same else f"MIG devices recreated on slot {at.bus}: its MIG layout changed"


def from_inventory(
    inv: Inventory,
    history: Optional[Generation],
    evidence: str,
    earlier: Optional[Generation] = None,
) -> NodeDevices:
    """The driver's view: every GPU of ``inv`` with its MIG devices."""
    gpus = tuple(
        SlotGpu(
            normal_bus_id(g.pci_bus_id),
            g.uuid,
            g.index,
            tuple(MigIdentity(m.uuid, m.gi, m.ci) for m in g.mig),
        )
        for g in inv.gpus
    )
    return NodeDevices(cut(evidence, 200), gpus, driver=True, history=history, earlier=earlier)


def is_gpu(f: PciFunction) -> bool:
    return f.vendor == NVIDIA_VENDOR and f.klass[:6] in GPU_CLASSES


def from_pci_history(
    functions: Sequence[PciFunction],
    history: Optional[Generation],
    why_no_driver: str,
    boot_id: str = "",
    earlier: Optional[Generation] = None,
) -> NodeDevices:
    """The view without a driver: the history's GPUs whose slot holds an NVIDIA GPU.
    A newest generation recorded in this boot (``boot_id``) is what the driver showed
    the daemon this boot: its MIG devices are known too."""
    if history is None:
        return NodeDevices("", problem=f"{why_no_driver}; gpuguard's GPU history has no generation")
    this_boot = bool(boot_id) and history.boot_id == boot_id
    by_slot = {f.address: f for f in functions}
    slots = tuple(sorted(f.address for f in functions if is_gpu(f)))
    gpus, unvouched = [], []
    for h in history.gpus:
        f = by_slot.get(h.pci_bus_id)
        if f is None:
            unvouched.append((h.pci_bus_id, f"its slot {h.pci_bus_id} (by history) is empty"))
        elif not is_gpu(f):
            unvouched.append(
                (
                    h.pci_bus_id,
                    f"its slot {h.pci_bus_id} (by history) holds another device "
                    f"(vendor {cut(f.vendor, 8)}, class {cut(f.klass, 10)})",
                )
            )
        else:
            gpus.append(SlotGpu(h.pci_bus_id, h.uuid, h.index, h.mig if this_boot else ()))
    return NodeDevices(
        THIS_BOOT if this_boot else DRIVER_NOT_LOADED,
        tuple(gpus),
        driver=this_boot,
        earlier=earlier,
        history=history,
        slots=slots,
        unvouched=tuple(unvouched),
    )
