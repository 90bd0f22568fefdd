"""NVIDIA device nodes: majors from /proc/devices, the nodes in a /dev, the expected set.

The driver's conventions (nvidia-modprobe's nvidia-modprobe-utils.[ch], the
container toolkit's internal/info/proc/devices):

- GPUs are ``/dev/nvidia<minor>`` on major 195 (nvidia-modprobe hardcodes 195);
  ``/dev/nvidiactl`` is 195:255 and ``/dev/nvidia-modeset`` 195:254. In /proc/devices
  the major is named ``nvidia-frontend`` before driver 550.40 and ``nvidia`` (plus
  ``nvidiactl``) since.
- ``/dev/nvidia-uvm`` and ``/dev/nvidia-uvm-tools`` are minors 0 and 1 of the dynamic
  ``nvidia-uvm`` major.
- MIG capabilities are ``/dev/nvidia-caps/nvidia-cap<N>`` on the dynamic ``nvidia-caps``
  major, N being ``DeviceFileMinor:`` in /proc/driver/nvidia/capabilities/.../access
  (gpu<minor>/mig/gi<G>/access, .../gi<G>/ci<C>/access, mig/config, mig/monitor).
- Names must match exactly: ``nvidia-caps-imex-channels`` is another major
  (kubernetes-sigs/dra-driver-nvidia-gpu#304 created cap nodes on it by substring match).

The MIG capability minors are read in caps.py, the ``/dev/char`` links checked in
devchar.py.
"""

from __future__ import annotations

import functools
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Protocol, Sequence

from gpuguard.devices.rules import allow_line
from gpuguard.host.numparse import parse_decimal
from gpuguard.host.paths import Root
from gpuguard.host.safeio import read_kernel_text

log = logging.getLogger(__name__)
MAX_MAJOR = 4095  # the kernel's majors are 12 bits
MAX_MINOR = 2**20 - 1  # MINORMASK

NVIDIA_MAJOR = 195
CTL_MINOR = 255
MODESET_MINOR = 254
UVM_MINOR = 0
UVM_TOOLS_MINOR = 1

# /proc/devices names of the GPU major, newest first (550.40 renamed nvidia-frontend).
GPU_MAJOR_NAMES = ("nvidia", "nvidiactl", "nvidia-frontend")
UVM_NAME = "nvidia-uvm"
CAPS_NAME = "nvidia-caps"

ROLE_GPU = "gpu"
ROLE_CTL = "ctl"
ROLE_MODESET = "modeset"
ROLE_UVM = "uvm"
ROLE_UVM_TOOLS = "uvm-tools"
ROLE_CAP = "cap"
ROLE_OTHER = "other"  # e.g. nvidia-nvswitch*, nvidia-nvlink: never granted by us


class MigLike(Protocol):
    @property
    def uuid(self) -> str: ...
    @property
    def gi(self) -> int: ...
    @property
    def ci(self) -> int: ...


class GpuLike(Protocol):
    """What gpuguard needs of a GPU (gpuguard.host.inventory.Gpu fits)."""

    @property
    def uuid(self) -> str: ...
    @property
    def index(self) -> int: ...
    @property
    def minor(self) -> int: ...
    @property
    def mig(self) -> Sequence[MigLike]: ...


@dataclass(frozen=True)
class ProcDevices:
    """/proc/devices: (major, name) per section, in file order."""

    char: tuple[tuple[int, str], ...] = ()
    block: tuple[tuple[int, str], ...] = ()

    def char_major(self, name: str) -> Optional[int]:
        for major, n in self.char:
            if n == name:
                return major
        return None


def parse_proc_devices(text: str) -> ProcDevices:
    """Parse /proc/devices. Only the ``Character devices:`` section names NVIDIA majors
    (the toolkit's parser ignores sections; a block driver named nvidia* would fool it)."""
    char: list[tuple[int, str]] = []
    block: list[tuple[int, str]] = []
    section: Optional[list[tuple[int, str]]] = None
    for raw in text.split("\n"):
        line = raw.strip()
        if line == "Character devices:":
            section = char
            continue
        if line == "Block devices:":
            section = block
            continue
        parts = line.split(None, 1)
        major = parse_decimal(parts[0], hi=MAX_MAJOR) if len(parts) == 2 else None
        if section is None or major is None:
            continue
        section.append((major, parts[1].strip()))
    return ProcDevices(tuple(char), tuple(block))


@dataclass(frozen=True)
class NvidiaMajors:
    """The NVIDIA character majors this host has registered (None: module not loaded)."""

    nvidia: Optional[int]
    uvm: Optional[int]
    caps: Optional[int]


def nvidia_majors(proc: ProcDevices) -> NvidiaMajors:
    gpu: Optional[int] = None
    for name in GPU_MAJOR_NAMES:
        gpu = proc.char_major(name)
        if gpu is not None:
            break
    return NvidiaMajors(nvidia=gpu, uvm=proc.char_major(UVM_NAME), caps=proc.char_major(CAPS_NAME))


@dataclass(frozen=True)
class DeviceNode:
    """A device node, by its path on the host (``/dev/nvidia0``) and its numbers."""

    path: str
    major: int
    minor: int
    role: str
    type: str = "c"
    mode: Optional[int] = None  # permission bits when read from stat(); None when expected
    cap: str = ""  # for ROLE_CAP: the capability, e.g. "gpu0/mig/gi1/access"
    # When the node was (re)made, when listed with it: the device plugin step compares a
    # plugin's view with the host's by it (a node remade after the plugin started). One
    # type for every lister, so the fields are the union of what each needs.
    ctime: Optional[float] = None

    @functools.cached_property  # a key of every access verdict: asked thousands of times a pass
    def numbers(self) -> str:
        return f"{self.major}:{self.minor}"

    @property
    def key(self) -> tuple[str, int, int]:
        """What the kernel checks: type and numbers (paths are irrelevant to it)."""
        return (self.type, self.major, self.minor)

    @property
    def dev_char(self) -> str:
        """The ``/dev/char/MAJ:MIN`` path systemd/runc use for DeviceAllow=."""
        return f"/dev/{'char' if self.type == 'c' else 'block'}/{self.numbers}"

    def allow_line(self, access: str = "rw") -> str:
        return allow_line(self.type, self.major, self.minor, access)


def classify(name: str, major: int, minor: int, majors: NvidiaMajors) -> str:
    """The role of a node called ``name`` (relative to /dev) with these numbers.

    The numbers decide, not the name (a container may name nodes differently); names
    only tell apart nodes on a major we do not know."""
    if majors.nvidia is not None and major == majors.nvidia:
        if minor == CTL_MINOR:
            return ROLE_CTL
        if minor == MODESET_MINOR:
            return ROLE_MODESET
        return ROLE_GPU
    if majors.uvm is not None and major == majors.uvm:
        if minor == UVM_MINOR:
            return ROLE_UVM
        if minor == UVM_TOOLS_MINOR:
            return ROLE_UVM_TOOLS
        return ROLE_OTHER
    if majors.caps is not None and major == majors.caps:
        return ROLE_CAP
    return ROLE_OTHER


def _stat(path: Path, follow_symlinks: bool) -> os.stat_result:
    """os.stat, one indirection so unit tests can fake device nodes without CAP_MKNOD."""
    return os.stat(path, follow_symlinks=follow_symlinks)


def _is_nvidia_name(name: str) -> bool:
    return name.startswith("nvidia")


def list_dev_dir(
    host_dir: Path,
    wanted: Callable[[str], bool],
    majors: Optional[NvidiaMajors] = None,
    *,
    sub: str = "",
    block: bool = False,
    ctime: bool = False,
) -> Optional[tuple[DeviceNode, ...]]:
    """The device nodes in ``host_dir`` whose names are ``wanted`` (None: not listable),
    as seen from that /dev (``/dev/<sub><name>``). lstat: a link is not a node. Character
    nodes, block ones too with ``block``; roles from ``majors`` (ROLE_OTHER without: the
    device plugin step compares nodes by numbers, never by role); ``ctime`` keeps it."""
    try:
        names = sorted(os.listdir(host_dir))
    except OSError as e:
        log.debug("cannot list %s: %s", host_dir, e.strerror)
        return None
    out: list[DeviceNode] = []
    for name in names:
        if not wanted(name):
            continue
        try:
            st = _stat(host_dir / name, False)
        except OSError as e:
            log.debug("skipping %s: %s", host_dir / name, e.strerror)
            continue
        if stat.S_ISCHR(st.st_mode):
            t = "c"
        elif block and stat.S_ISBLK(st.st_mode):
            t = "b"
        else:
            continue
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        out.append(
            DeviceNode(
                path=f"/dev/{sub}{name}",
                major=major,
                minor=minor,
                role=classify(sub + name, major, minor, majors) if majors else ROLE_OTHER,
                type=t,
                mode=None if ctime else stat.S_IMODE(st.st_mode),
                ctime=st.st_ctime if ctime else None,
            )
        )
    return tuple(out)


def list_nvidia_nodes(
    root: Root, majors: NvidiaMajors, dev_dir: str = "/dev"
) -> tuple[DeviceNode, ...]:
    """The character nodes named nvidia* in ``dev_dir`` and ``dev_dir``/nvidia-caps.

    ``dev_dir`` is a host path (``/dev``, or ``/proc/<pid>/root/dev`` for a container);
    the returned paths are as seen from that /dev (``/dev/nvidia0``). Entries that vanish
    or are not character devices are skipped."""
    out: list[DeviceNode] = []
    for sub in ("", "nvidia-caps/"):
        host_dir = root.path(dev_dir.rstrip("/") + "/" + sub)
        out += list_dev_dir(host_dir, _is_nvidia_name, majors, sub=sub) or ()
    return tuple(out)


def expected_nodes(
    gpus: Sequence[GpuLike],
    majors: NvidiaMajors,
    cap_minors: Mapping[str, int],
    *,
    modeset: bool = False,
) -> tuple[DeviceNode, ...]:
    """The nodes this host should have for its GPUs, in a stable order.

    ``modeset``: whether nvidia-modeset is loaded (/proc/modules): only then does
    /dev/nvidia-modeset make sense. uvm nodes are expected once the nvidia-uvm major is
    registered, even though the driver creates them lazily (F3)."""
    out: list[DeviceNode] = []
    if majors.nvidia is not None:
        for g in sorted(gpus, key=lambda g: g.minor):
            out.append(DeviceNode(f"/dev/nvidia{g.minor}", majors.nvidia, g.minor, ROLE_GPU))
        out.append(DeviceNode("/dev/nvidiactl", majors.nvidia, CTL_MINOR, ROLE_CTL))
        if modeset:
            out.append(
                DeviceNode("/dev/nvidia-modeset", majors.nvidia, MODESET_MINOR, ROLE_MODESET)
            )
    if majors.uvm is not None:
        out.append(DeviceNode("/dev/nvidia-uvm", majors.uvm, UVM_MINOR, ROLE_UVM))
        out.append(DeviceNode("/dev/nvidia-uvm-tools", majors.uvm, UVM_TOOLS_MINOR, ROLE_UVM_TOOLS))
    if majors.caps is not None:
        for cap, minor in sorted(cap_minors.items(), key=lambda kv: kv[1]):
            out.append(
                DeviceNode(
                    f"/dev/nvidia-caps/nvidia-cap{minor}", majors.caps, minor, ROLE_CAP, cap=cap
                )
            )
    return tuple(out)


def read_proc_devices(root: Root) -> ProcDevices:
    # A /proc/devices gpuguard refuses to read (a FIFO or link in a fake root) is one
    # line naming it (UnsafeFileError), not a hang.
    text = read_kernel_text(root.path("/proc/devices"), what="/proc/devices")
    if text is None:
        log.debug("cannot read /proc/devices: it does not exist")
        return ProcDevices()
    return parse_proc_devices(text)


def read_loaded_modules(root: Root) -> frozenset[str]:
    """Module names from /proc/modules (``nvidia_modeset``, ``nvidia_uvm``, ...)."""
    text = read_kernel_text(root.path("/proc/modules"), what="/proc/modules")
    if text is None:
        return frozenset()
    return frozenset(line.split(None, 1)[0] for line in text.split("\n") if line.strip())
