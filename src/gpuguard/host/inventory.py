"""The GPUs this host has: from NVML (pynvml), or from a JSON file standing in for it.

NVML's library is found where the driver is (host/nvmllib.py: the host's loader path,
the GPU Operator's driver root, [Inventory] DriverRoot=) and loaded by path. The file
form (``--inventory FILE``) stands in for NVML in simulations and tests::

    {"gpus": [{"uuid": "GPU-...", "index": 0, "minor": 0,
               "pci_bus_id": "00000000:00:07.0",
               "mig": [{"uuid": "MIG-...", "gi": 1, "ci": 0}]}]}

Optional additions (documented in docs/inventory.md): "name" per GPU, and
"driver_version" at the top level.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from gpuguard.errors import BadInputError, NoDriverError
from gpuguard.host import nvmllib, safeio
from gpuguard.host.numparse import clip, parse_decimal
from gpuguard.host.paths import Root

MAX_INVENTORY_BYTES = safeio.INVENTORY_MAX
MAX_MINOR = 2**20 - 1  # the kernel's MINORMASK
MAX_INDEX = 2**31 - 1


@dataclass(frozen=True)
class MigDevice:
    uuid: str
    gi: int  # GPU instance id
    ci: int  # compute instance id


@dataclass(frozen=True)
class Gpu:
    uuid: str
    index: int
    minor: int
    pci_bus_id: str
    mig: tuple[MigDevice, ...] = ()
    name: str = ""


@dataclass(frozen=True)
class Inventory:
    gpus: tuple[Gpu, ...]
    source: str  # "nvml" or the file's path
    driver_version: str = ""
    library: str = ""  # NVML's library and where it was found (NvmlLibrary.describe)

    def describe_source(self) -> str:
        return f"NVML {self.library}" if self.library else self.source

    def by_uuid(self) -> dict[str, Gpu]:
        return {g.uuid: g for g in self.gpus}

    def mig_uuids(self) -> frozenset[str]:
        return frozenset(m.uuid for g in self.gpus for m in g.mig)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "library": self.library,  # NVML's library and where it was found; "" for a file
            "driver_version": self.driver_version,
            "gpus": [
                {
                    "uuid": g.uuid,
                    "index": g.index,
                    "minor": g.minor,
                    "pci_bus_id": g.pci_bus_id,
                    "name": g.name,
                    "mig": [{"uuid": m.uuid, "gi": m.gi, "ci": m.ci} for m in g.mig],
                }
                for g in self.gpus
            ],
        }


def _json_int(text: str) -> int:
    # json's own int() would raise past 4,300 digits with a message about Python.
    value = parse_decimal(text, lo=-(2**63), hi=2**63 - 1, signed=True)
    if value is None:
        raise ValueError(f"number {clip(text)} is out of range")
    return value


def load_inventory_file(path: Path) -> Inventory:
    """Read an inventory file; any problem is a one-line BadInputError naming the file."""
    data, _st = safeio.read_bytes(
        path,
        what="inventory",
        max_bytes=MAX_INVENTORY_BYTES,
        follow=True,  # an operator's file, often a link to a shared copy
        missing="cannot read inventory: no such file — check --inventory or [Inventory] File=",
        next_step="an inventory lists a few GPUs; check the --inventory path",
    )
    try:
        doc = json.loads(data, parse_int=_json_int)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadInputError(f"{path}: inventory is not valid JSON ({clip(str(e))})") from None
    except RecursionError:
        raise BadInputError(
            f"{path}: inventory is nested too deeply to be one; fix the file "
            "(its format: gpuguard(8), INVENTORY FILE)"
        ) from None
    return parse_inventory(doc, source=str(path))


def _field(obj: dict[str, Any], key: str, typ: type, where: str, default: Any = None) -> Any:
    if key not in obj:
        if default is not None:
            return default
        raise BadInputError(f"{where}: missing '{key}'")
    value = obj[key]
    # bool is an int subclass in Python; an index of `true` is a mistake.
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise BadInputError(f"{where}: '{key}' must be a {typ.__name__}, got {clip(value)}")
    return value


def _number(obj: dict[str, Any], key: str, where: str, hi: int) -> int:
    value: int = _field(obj, key, int, where)
    if not 0 <= value <= hi:
        raise BadInputError(f"{where}: '{key}' must be 0..{hi}, got {value}")
    return value


def parse_inventory(doc: Any, *, source: str) -> Inventory:
    if not isinstance(doc, dict) or not isinstance(doc.get("gpus"), list):
        raise BadInputError(f'{source}: inventory must be an object with a "gpus" list')
    gpus: list[Gpu] = []
    for i, g in enumerate(doc["gpus"]):
        where = f"{source}: gpus[{i}]"
        if not isinstance(g, dict):
            raise BadInputError(f"{where}: must be an object")
        migs: list[MigDevice] = []
        for j, m in enumerate(_field(g, "mig", list, where, default=[])):
            mwhere = f"{where}.mig[{j}]"
            if not isinstance(m, dict):
                raise BadInputError(f"{mwhere}: must be an object")
            migs.append(
                MigDevice(
                    uuid=_field(m, "uuid", str, mwhere),
                    gi=_number(m, "gi", mwhere, MAX_INDEX),
                    ci=_number(m, "ci", mwhere, MAX_INDEX),
                )
            )
        gpus.append(
            Gpu(
                uuid=_field(g, "uuid", str, where),
                index=_number(g, "index", where, MAX_INDEX),
                minor=_number(g, "minor", where, MAX_MINOR),
                pci_bus_id=_field(g, "pci_bus_id", str, where),
                mig=tuple(migs),
                name=_field(g, "name", str, where, default=""),
            )
        )
    # A value listed twice would let the last GPU silently win (by_uuid(), the index
    # matcher, the node of a minor) and could mask a conflict: refuse the file.
    for label, key in (("UUID", "uuid"), ("index", "index"), ("minor", "minor")):
        first: dict[Any, int] = {}
        for i, g in enumerate(gpus):
            value = getattr(g, key)
            if value in first:
                raise BadInputError(
                    f"{source}: gpus[{i}]: {label} {clip(value)} listed twice (also "
                    f"gpus[{first[value]}]); each GPU has its own — fix the file"
                )
            first[value] = i
    driver = doc.get("driver_version", "")
    return Inventory(
        gpus=tuple(gpus), source=source, driver_version=driver if isinstance(driver, str) else ""
    )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class DriverPendingError(NoDriverError):
    """No NVML yet on a node whose driver comes from a container (the GPU Operator's):
    the driver container has not started or not loaded the driver. Not a broken driver,
    until a grace period says otherwise (steps/gpu_count)."""


def load_nvml_inventory(lookup: Optional[nvmllib.NvmlLookup] = None) -> Inventory:
    """Query NVML. No driver or no libnvidia-ml is a NoDriverError, never a traceback."""
    lookup = lookup or nvmllib.NvmlLookup(Root())
    try:
        import pynvml  # imported lazily: ~10 ms, and absent on hosts using --inventory
    except ImportError:
        raise NoDriverError(
            "pynvml (package nvidia-ml-py) is not installed; reinstall gpuguard or pass "
            "--inventory FILE"
        ) from None
    lib, refused = nvmllib.search(lookup)
    if lib is None:
        looked = nvmllib.where_looked(lookup)
        if refused:  # a library is there, but someone besides root controls it
            looked += f" (refused: {'; '.join(refused)[:300]})"
        if lookup.operator_node():
            raise DriverPendingError(
                f"the driver container has not started: no {nvmllib.LIBRARY} in "
                f"{looked}; check the GPU Operator's driver pod (nvidia-driver-daemonset)"
            )
        raise NoDriverError(
            f"NVIDIA driver library {nvmllib.LIBRARY} not found in {looked}: is the driver "
            "installed? (set [Inventory] DriverRoot= for a driver installed elsewhere, or "
            "pass --inventory FILE to simulate a node without a GPU)"
        )
    try:
        nvmllib.load_into(pynvml, lib)
    except OSError as e:
        raise NoDriverError(
            f"{lib.describe()}: cannot be loaded ({e}); check the driver's files"
        ) from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise _init_error(pynvml, e, lib, lookup) from None
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        gpus = tuple(_nvml_gpu(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount()))
    except pynvml.NVMLError as e:
        raise NoDriverError(
            f"NVML query failed: {e} ({lib.describe()}); check `nvidia-smi` on this host"
        ) from None
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
    return Inventory(gpus=gpus, source="nvml", driver_version=driver, library=lib.describe())


def _init_error(
    pynvml: Any, e: Exception, lib: nvmllib.NvmlLibrary, lookup: nvmllib.NvmlLookup
) -> NoDriverError:
    hint = "pass --inventory FILE to simulate a node without a GPU"
    where = lib.describe()
    if isinstance(e, pynvml.NVMLError_DriverNotLoaded):
        if lib.layout != nvmllib.HOST or lookup.operator_node():
            return DriverPendingError(
                f"the driver container has not loaded the NVIDIA kernel driver yet "
                f"({where}: {e}); check the GPU Operator's driver pod"
            )
        return NoDriverError(
            f"NVIDIA kernel driver is not loaded ({where}): run `modprobe nvidia` or check dmesg"
        )
    if isinstance(e, pynvml.NVMLError_NoPermission):
        return NoDriverError(f"no permission to talk to the NVIDIA driver ({where}): run as root")
    return NoDriverError(f"NVML could not initialise: {e} ({where}; check `nvidia-smi`; {hint})")


def _nvml_gpu(pynvml: Any, i: int) -> Gpu:
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    pci = pynvml.nvmlDeviceGetPciInfo(h)
    migs: list[MigDevice] = []
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(h)
    except pynvml.NVMLError:  # pre-Ampere GPUs do not support MIG
        current = 0
    if current == pynvml.NVML_DEVICE_MIG_ENABLE:
        for j in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                m = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
            except pynvml.NVMLError_NotFound:
                continue
            migs.append(
                MigDevice(
                    uuid=_text(pynvml.nvmlDeviceGetUUID(m)),
                    gi=int(pynvml.nvmlDeviceGetGpuInstanceId(m)),
                    ci=int(pynvml.nvmlDeviceGetComputeInstanceId(m)),
                )
            )
    return Gpu(
        uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
        index=int(pynvml.nvmlDeviceGetIndex(h)),
        minor=int(pynvml.nvmlDeviceGetMinorNumber(h)),
        pci_bus_id=_text(pci.busId),
        mig=tuple(migs),
        name=_text(pynvml.nvmlDeviceGetName(h)),
    )


def load_inventory(path: Optional[Path], nvml: Optional[nvmllib.NvmlLookup] = None) -> Inventory:
    """The file's inventory, else NVML's, found as `nvml` says (default: the real root)."""
    return load_inventory_file(path) if path is not None else load_nvml_inventory(nvml)
