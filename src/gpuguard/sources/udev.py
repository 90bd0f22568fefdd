"""udev source: NVIDIA driver modules and NVIDIA PCI functions coming and going.

The source only EMITS events (an NVIDIA module or PCI function changed, and why; the
registry says which steps that wakes); it never touches the host. It is a pyudev
netlink monitor whose fd sits on the daemon's asyncio loop (``loop.add_reader``): no
thread.

Which netlink source to use
---------------------------
``source="udev"`` (the default, what the daemon uses whenever udevd runs): events
arrive *after* systemd-udevd has applied the rules, so device nodes and symlinks
already exist and 71-gpuguard.rules has added ``TAG+="gpuguard"`` and
``GPUGUARD_KIND``. libudev only subscribes such a monitor when
``/run/udev/control`` exists or ``/dev`` is a devtmpfs; otherwise it silently
receives nothing, hence the warning in :meth:`UdevSource.start`.

``source="kernel"``: raw kernel uevents, before udevd (if any) has processed them.
Use it where no udevd runs at all (early boot before systemd-udevd.service, minimal
hosts, a daemon running in a container without udev). Device nodes may not exist
yet when the event arrives; the steps re-observe the host anyway and the
coalescer's quiet period absorbs the gap. :func:`choose_source` picks one.

Classification uses only properties the kernel puts in the uevent itself
(SUBSYSTEM, ACTION, DEVPATH, PCI_ID, MODALIAS), so both sources give the same events
and a ``remove`` (when sysfs attributes are already gone) still classifies.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
from typing import Any, Callable, Iterable, Mapping

from gpuguard.steps.events import Event, EventKind

# A driver module load/unload changes device nodes (majors, /dev/nvidia-uvm), what
# containers may open, and what the device plugin advertises (NVIDIA_MODULE); the set of
# GPUs (and so the checkpoint) is a PCI matter (NVIDIA_PCI): the registry says which
# steps each wakes.

DEFAULT_MODULES: tuple[str, ...] = ("nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_drm")
NVIDIA_PCI_VENDOR = "10DE"
DEFAULT_PCI_VENDORS: tuple[str, ...] = (NVIDIA_PCI_VENDOR,)

MODULE_ACTIONS = frozenset({"add", "remove", "change"})
PCI_ACTIONS = frozenset({"add", "remove", "bind", "unbind", "change"})
# Something appeared / became usable: run without waiting for the quiet period.
# Removals and changes wait for it (an unload is usually followed by a reload).
URGENT_ACTIONS = frozenset({"add", "bind"})

# Kernel netlink family for uevents (<linux/netlink.h>); Python's socket module
# has no constant for it.
NETLINK_KOBJECT_UEVENT = 15
# Bursts (driver reload with 8 GPUs, coldplug `udevadm trigger`) must not overflow
# the socket: an overflow loses events (ENOBUFS), which we then treat as "resync all".
RECEIVE_BUFFER_BYTES = 8 * 1024 * 1024
MAX_EVENTS_PER_WAKEUP = 1024


def size_receive_buffer(fd: int, want: int) -> int:
    """Ask for a `want`-byte receive buffer on socket `fd`; the size the kernel granted.

    SO_RCVBUF never fails for lack of privilege: the kernel caps it at net.core.rmem_max.
    SO_RCVBUFFORCE (what libudev's set_receive_buffer_size tries) needs CAP_NET_ADMIN,
    which gpuguard.service does not have, so it is not used."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        # On failure the kernel's default buffer stays; an overflow resyncs everything.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, want)
        # The kernel reports twice what it reserves for data (its bookkeeping overhead).
        return int(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)) // 2
    finally:
        sock.close()


Emit = Callable[[Event], None]


def _pci_vendor(props: Mapping[str, str]) -> str | None:
    """Upper-case PCI vendor id from the uevent's own properties, if any."""
    pci_id = props.get("PCI_ID", "")
    if ":" in pci_id:
        return pci_id.split(":", 1)[0].upper()
    # MODALIAS=pci:v000010DEd00002330sv... is also kernel-provided; a fallback for
    # events that were stripped of PCI_ID by some relay.
    modalias = props.get("MODALIAS", "")
    if modalias.startswith("pci:v") and len(modalias) >= 13:
        return modalias[9:13].upper()
    return None


def classify(
    props: Mapping[str, str],
    *,
    modules: Iterable[str] = DEFAULT_MODULES,
    pci_vendors: Iterable[str] = DEFAULT_PCI_VENDORS,
) -> tuple[EventKind, str] | None:
    """What kind of event a uevent is, and a human 'why'; None to ignore it.

    Pure: looks only at the uevent's properties. ``modules`` / ``pci_vendors`` are
    parameters so tests can widen the match to hardware present on a machine
    without NVIDIA parts.
    """
    action = props.get("ACTION", "")
    subsystem = props.get("SUBSYSTEM", "")
    devpath = props.get("DEVPATH", "")
    name = devpath.rsplit("/", 1)[-1]
    if not action or not name:
        return None

    if subsystem == "module":
        if action in MODULE_ACTIONS and name in frozenset(modules):
            return EventKind.NVIDIA_MODULE, f"udev: module {name} {action}"
        return None

    if subsystem == "pci":
        vendor = _pci_vendor(props)
        wanted = frozenset(v.upper() for v in pci_vendors)
        if action in PCI_ACTIONS and vendor is not None and vendor in wanted:
            why = f"udev: pci {name} ({props.get('PCI_ID', vendor)}) {action}"
            driver = props.get("DRIVER")
            if driver:
                why += f" driver={driver}"
            # A 'change' on a PCI function is what AER error recovery sends
            # (ERROR_EVENT=..., DEVICE_ONLINE=...): the GPU may have been reset.
            err = props.get("ERROR_EVENT")
            if err:
                why += f" ERROR_EVENT={err}"
            return EventKind.NVIDIA_PCI, why
        return None

    return None


def is_urgent(props: Mapping[str, str]) -> bool:
    return props.get("ACTION", "") in URGENT_ACTIONS


def choose_source(run_dir: str = "/run") -> str:
    """ "udev" when systemd-udevd is running (its control socket exists), else "kernel"."""
    return "udev" if os.path.exists(os.path.join(run_dir, "udev", "control")) else "kernel"


class UdevSourceError(RuntimeError):
    """The monitor could not be set up; the message says what to do."""


class UdevSource:
    """pyudev netlink monitor on the asyncio loop; emits events, never acts."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        emit: Emit,
        *,
        modules: Iterable[str] = DEFAULT_MODULES,
        pci_vendors: Iterable[str] = DEFAULT_PCI_VENDORS,
        source: str = "udev",
        log: logging.Logger,
        trace: Callable[[Mapping[str, str]], None] | None = None,
    ) -> None:
        if source not in ("udev", "kernel"):
            raise ValueError(f"udev source must be 'udev' or 'kernel', not {source!r}")
        self._loop = loop
        self._emit = emit
        self._modules = tuple(modules)
        self._pci_vendors = tuple(v.upper() for v in pci_vendors)
        self._source = source
        self._log = log
        # Optional: called with the properties of every event that passed the
        # subsystem filter, before classification (tests, --debug tracing).
        self._trace = trace
        self._monitor: Any = None
        self._fd: int | None = None

    @property
    def source(self) -> str:
        return self._source

    def start(self) -> None:
        import pyudev  # imported here so the pure classify() needs no libudev

        if self._monitor is not None:
            return
        if self._source == "udev" and not os.path.exists("/run/udev/control"):
            # libudev then only subscribes if /dev is a devtmpfs; in a container
            # it would silently receive nothing at all.
            self._log.warning(
                "udev: /run/udev/control does not exist (systemd-udevd not running); "
                "the udev monitor gets no events until udevd starts, and none at all "
                "if /dev is not a devtmpfs. Use the kernel source where no udevd runs."
            )
        try:
            context = pyudev.Context()
            monitor = pyudev.Monitor.from_netlink(context, source=self._source)
            # Filters are attached as a BPF program in the socket for udev-format
            # messages, so unrelated devices (block, net, input...) never wake us.
            monitor.filter_by("module")
            monitor.filter_by("pci")
            monitor.start()
        except OSError as exc:
            raise UdevSourceError(self._explain_open_failure(exc)) from exc
        self._monitor = monitor
        self._fd = monitor.fileno()
        rcvbuf = size_receive_buffer(self._fd, RECEIVE_BUFFER_BYTES)
        self._loop.add_reader(self._fd, self._on_readable)
        self._log.info(
            "udev: monitoring %s events (modules %s; receive buffer %d KiB%s)",
            self._source,
            self._modules,
            rcvbuf // 1024,
            ", as net.core.rmem_max allows" if rcvbuf < RECEIVE_BUFFER_BYTES else "",
        )

    def stop(self) -> None:
        if self._fd is not None:
            self._loop.remove_reader(self._fd)
            self._fd = None
        # Dropping the last reference unrefs the libudev monitor and closes the fd.
        self._monitor = None

    def _explain_open_failure(self, exc: OSError) -> str:
        # pyudev reports a failed udev_monitor_new_from_netlink() without errno;
        # open the same kind of socket ourselves to learn why.
        reason = exc.strerror or str(exc)
        try:
            probe = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_KOBJECT_UEVENT)
            probe.close()
        except OSError as probe_exc:
            reason = probe_exc.strerror or str(probe_exc)
            if probe_exc.errno in (errno.EPERM, errno.EACCES, errno.EAFNOSUPPORT):
                return (
                    f"cannot open the {self._source} uevent netlink socket ({reason}). "
                    "gpuguard needs AF_NETLINK: run it as root and make sure the unit's "
                    "RestrictAddressFamilies= (or a seccomp/container policy) allows "
                    "AF_NETLINK."
                )
        return (
            f"cannot open the {self._source} uevent netlink monitor ({reason}). "
            "Check that libudev is installed and that gpuguard runs as root."
        )

    def _on_readable(self) -> None:
        """Drain every pending event without blocking: a burst is one wake-up."""
        monitor = self._monitor
        if monitor is None:
            return
        # Bounded so one flood cannot starve the loop; whatever is left keeps the
        # fd readable and brings us back on the next iteration.
        for _ in range(MAX_EVENTS_PER_WAKEUP):
            try:
                device = monitor.poll(timeout=0)
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    # The kernel dropped events: we no longer know what changed.
                    lost = "udev: monitor overflowed, events lost"
                    self._emit(Event(EventKind.UDEV_EVENTS_LOST, lost, urgent=True))
                    continue
                # A garbled or untrusted message (libudev rejects it with an errno);
                # it has been consumed, so go on with the next one.
                self._log.warning("udev: skipping unreadable event: %s", exc)
                continue
            except Exception as exc:  # never raise into the event loop
                self._log.warning("udev: skipping unreadable event: %r", exc)
                continue
            if device is None:
                return
            try:
                self._handle(device)
            except Exception:
                self._log.exception("udev: error while handling an event; skipped")

    def _handle(self, device: Any) -> None:
        try:
            props = {str(k): str(v) for k, v in device.properties.items()}
        except Exception as exc:  # undecodable property values
            self._log.warning("udev: skipping event with unreadable properties: %r", exc)
            return
        if self._trace is not None:
            self._trace(props)
        result = classify(props, modules=self._modules, pci_vendors=self._pci_vendors)
        if result is None:
            return
        kind, why = result
        self._log.debug("%s", why)
        self._emit(Event(kind, why, urgent=is_urgent(props)))
