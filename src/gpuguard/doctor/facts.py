"""What `gpuguard doctor` reads from the host, as frozen values (nothing is judged here).

Every read goes through `paths.Root`; a file that cannot be read becomes an error text
the judge turns into "unknown" with the reason. Versions come from the files a package
installs where possible (systemd), else from `--version` through the injected runner.
"""

from __future__ import annotations

import errno
import glob
import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

from gpuguard.devices.caps import read_cap_minors
from gpuguard.devices.devchar import LinkState, check_dev_char_links
from gpuguard.devices.kubelettrust import runs_as_root
from gpuguard.devices.nodes import (
    NvidiaMajors,
    expected_nodes,
    list_nvidia_nodes,
    nvidia_majors,
    read_loaded_modules,
    read_proc_devices,
)
from gpuguard.devices.pci import read_pci_gpus
from gpuguard.doctor.kubelet import hook_dropin, kubelet_config, units_to_check
from gpuguard.doctor.operator import (
    OperatorFacts,
    containerd_config,
    read_operator,
    toolkit_config,
)
from gpuguard.doctor.readmit import BridgeFacts, read_bridge
from gpuguard.doctor.textconf import Unreadable, toml_scalars, toml_tables
from gpuguard.host import safeio
from gpuguard.host.inventory import Inventory
from gpuguard.host.offswitch import OffSwitch, read_off_switch
from gpuguard.host.paths import Root
from gpuguard.host.statefile import load
from gpuguard.reporting.status import SPEC as STATUS_SPEC
from gpuguard.reporting.status import STATUS_FILE, Status
from gpuguard.steps.gpu_count.reconcile import GpuCounts, registered_gpus

TOOLKIT_CONFIG = "/etc/nvidia-container-runtime/config.toml"
CONTAINERD_CONFIG = "/etc/containerd/config.toml"
CRIO_CONFIGS = ("/etc/crio/crio.conf", "/etc/crio/crio.conf.d")
TOOLKIT_RUNTIMES = (
    "/usr/bin/nvidia-container-runtime",
    "/usr/local/nvidia/toolkit/nvidia-container-runtime",  # the GPU operator's install
)
RUNC_PATHS = ("/usr/local/sbin/runc", "/usr/local/bin/runc", "/usr/sbin/runc", "/usr/bin/runc")
# Debian puts it under the multiarch dir (/usr/lib/x86_64-linux-gnu/systemd).
SYSTEMD_SHARED = ("/usr/lib/systemd", "/usr/lib/*/systemd", "/usr/lib64/systemd", "/lib/systemd")
PLUGIN_COMMS = ("nvidia-device-p", "nvidia-device-plugin")  # comm is cut at 15 bytes
MAX_CONFIG_BYTES = 1024 * 1024

# argv -> stdout; raises gpuguard.host.commands.CommandError (or OSError) when it cannot run.
Runner = Callable[[Sequence[str]], str]


@dataclass(frozen=True)
class ConfFile:
    path: str  # host path
    values: Mapping[str, str] = field(default_factory=dict)
    tables: tuple[str, ...] = ()
    error: str = ""  # "" read; "missing"; else why it could not be read


@dataclass(frozen=True)
class PluginSettings:
    pid: int
    strategy: str  # deviceListStrategy as the plugin runs it (default envvar)
    pass_device_specs: bool
    evidence: str  # where the values came from


@dataclass(frozen=True)
class DaemonState:
    status: Optional[Status]
    error: str  # "" when status is set
    alive: Optional[bool]  # the status file's pid still runs


@dataclass(frozen=True)
class Facts:
    cgroup_layout: str  # "v2", "hybrid", "v1" or ""
    cgroup_evidence: str
    kubelet: ConfFile
    toolkit: ConfFile
    containerd: ConfFile
    crio: tuple[ConfFile, ...]
    plugins: Optional[tuple[PluginSettings, ...]]  # None: /proc unreadable
    majors: NvidiaMajors
    missing_nodes: tuple[str, ...]
    links: tuple[LinkState, ...]
    runc: tuple[str, str]  # (version or "", evidence or the reason there is none)
    toolkit_version: tuple[str, str]
    systemd: tuple[str, str]
    dropin: tuple[str, str]  # (path in effect or "", state: "ok" | "masked" | "missing")
    daemon: DaemonState
    counts: GpuCounts
    counts_evidence: str
    now: float
    kubelet_unit: str = "kubelet.service"  # the unit whose pre-start hook was checked
    off_switch: Optional[OffSwitch] = None  # host/offswitch.py: gpuguard is off
    observe: bool = False  # Mode=observe (or DryRun=yes)
    operator: Optional[OperatorFacts] = None  # the node's layout (doctor/operator.py)
    bridge: Optional[BridgeFacts] = None  # the re-admission bridge (doctor/readmit.py)


def read_conf(root: Root, path: str, parse: Callable[[str], Mapping[str, str]]) -> ConfFile:
    p = root.path(path)
    try:  # configs may be links (config management); never a FIFO, never unbounded
        data, _st = safeio.read_bytes(
            p, what="configuration", max_bytes=MAX_CONFIG_BYTES, follow=True
        )
    except safeio.UnsafeFileError as e:
        if e.errno == errno.ENOENT:
            return ConfFile(path, error="missing")
        return ConfFile(path, error=f"cannot read {path}: {e.message}")
    text = data.decode("utf-8", errors="replace")
    try:
        tables = tuple(toml_tables(text)) if parse is toml_scalars else ()
        return ConfFile(path, parse(text), tables)
    except Unreadable as e:  # as its owner would refuse it, or past the parser's bounds
        return ConfFile(path, error=f"cannot parse {path}: {e}")


def cgroup_layout(root: Root) -> tuple[str, str]:
    cg = root.path("/sys/fs/cgroup")
    if (cg / "cgroup.controllers").exists():
        return "v2", "/sys/fs/cgroup is cgroup2 (unified)"
    if (cg / "devices").is_dir():
        if (cg / "unified" / "cgroup.controllers").exists():
            return "hybrid", "/sys/fs/cgroup/devices (v1) with /sys/fs/cgroup/unified"
        return "v1", "/sys/fs/cgroup/devices (v1)"
    return "", "/sys/fs/cgroup has neither cgroup.controllers nor devices/"


def _split0(data: bytes) -> list[str]:
    return [a.decode(errors="replace") for a in data.split(b"\0") if a]


def plugin_settings(argv: Sequence[str], env: Mapping[str, str], pid: int) -> PluginSettings:
    """deviceListStrategy and passDeviceSpecs the way the plugin reads them (urfave/cli:
    a flag wins over its environment variable; a bare bool flag means true)."""
    flags: dict[str, str] = {}
    args = list(argv[1:])
    for i, a in enumerate(args):
        if not a.startswith("--"):
            continue
        name, eq, value = a[2:].partition("=")
        if not eq:
            nxt = args[i + 1] if i + 1 < len(args) else ""
            value = "true" if name == "pass-device-specs" or nxt.startswith("-") else nxt
        flags[name] = value
    strategy = flags.get("device-list-strategy") or env.get("DEVICE_LIST_STRATEGY") or "envvar"
    specs = flags.get("pass-device-specs") or env.get("PASS_DEVICE_SPECS") or "false"
    src = "args" if {"device-list-strategy", "pass-device-specs"} & flags.keys() else "env"
    return PluginSettings(
        pid,
        strategy,
        specs.lower() in ("true", "1", "yes"),
        f"/proc/{pid}/cmdline+environ ({src}): deviceListStrategy={strategy} "
        f"passDeviceSpecs={specs.lower()}",
    )


def read_plugins(root: Root) -> Optional[tuple[PluginSettings, ...]]:
    try:
        pids = sorted(int(n) for n in os.listdir(root.path("/proc")) if n.isdigit())
    except OSError:
        return None
    out = []
    for pid in pids:
        base = root.path(f"/proc/{pid}")
        try:
            comm = safeio.proc_text(base / "comm").strip()
        except OSError:
            continue
        if comm not in PLUGIN_COMMS or not runs_as_root(root, pid):
            continue  # on the host, a user's process so named says nothing of the plugin
        try:
            argv = _split0(safeio.proc_bytes(base / "cmdline"))
            env_items = _split0(safeio.proc_bytes(base / "environ"))
        except OSError as e:  # environ needs ptrace access: root
            out.append(PluginSettings(pid, "", False, f"cannot read /proc/{pid}: {e.strerror}"))
            continue
        env = dict(e.partition("=")[::2] for e in env_items)
        out.append(plugin_settings(argv, env, pid))
    return tuple(out)


def binary_version(
    root: Root, run: Runner, paths: Sequence[str], pattern: str, name: str
) -> tuple[str, str]:
    """(version, evidence) from the first of `paths` that is executable, `--version`."""
    for path in paths:
        if os.access(root.path(path), os.X_OK):
            try:
                out = run([str(root.path(path)), "--version"])
            except Exception as e:  # CommandError, OSError: say why, never a traceback
                return "", f"{path} --version failed: {e}"
            m = re.search(pattern, out)
            if m:
                return m.group(1), f"{path} --version: {m.group(1)}"
            return "", f"{path} --version printed no version"
    return "", f"no {name} in {', '.join(paths)}"


def runc_version(root: Root, run: Runner) -> tuple[str, str]:
    return binary_version(root, run, RUNC_PATHS, r"runc version (\S+)", "runc")


def systemd_version(root: Root) -> tuple[str, str]:
    for d in SYSTEMD_SHARED:
        hits = sorted(glob.glob(str(root.path(d) / "libsystemd-shared-*.so")))
        for h in hits:
            m = re.match(r"libsystemd-shared-(\d+)", os.path.basename(h))
            if m:
                return m.group(1), "/" + os.path.relpath(h, root.prefix)
    return "", "no libsystemd-shared-*.so under " + ", ".join(SYSTEMD_SHARED)


def kubelet_dropin(
    root: Root, run: Runner, live: bool, units: Sequence[str]
) -> tuple[str, str, str]:
    """(path, state, unit) of the pre-start drop-in of the first of `units` that has
    one (else of the first unit): "ok", "masked", "missing", or "not-loaded" when
    systemd (asked only on the live host) has not read the file yet."""
    found = [(u, *hook_dropin(root, u)) for u in units] or [("kubelet.service", "", "missing")]
    unit, path, state = next((x for x in found if x[2] != "missing"), found[0])
    if state == "ok" and live:
        try:
            loaded = run(["systemctl", "show", unit, "-p", "DropInPaths", "--value"])
        except Exception:  # no systemd, no bus: the file is the evidence
            return path, state, unit
        if loaded.strip() and path not in loaded.split():
            return path, "not-loaded", unit
    return path, state, unit


def _read_text(root: Root, path: str) -> tuple[str, str]:
    """A kubelet configuration's text and "", or "" and why not ("missing")."""
    c = read_conf(root, path, lambda text: {"text": text})
    return c.values.get("text", ""), c.error


def daemon_state(root: Root) -> DaemonState:
    """The daemon's status file through its one loader (reporting/status.py)."""
    got = load(root.path(STATUS_FILE), STATUS_SPEC)
    if got.value is None:
        return DaemonState(None, f"no {STATUS_FILE}" if got.absent else got.why, None)
    return DaemonState(got.value, "", root.path(f"/proc/{got.value.pid}").is_dir())


def gpu_counts(
    root: Root,
    inventory: Optional[Inventory],
    registered: Optional[Sequence[tuple[str, Optional[Sequence[str]]]]],
    driver_wait: str = "",
) -> tuple[GpuCounts, str]:
    try:
        pci: Optional[int] = len(read_pci_gpus(root))
        where = "/sys/bus/pci/devices"
    except OSError as e:
        pci, where = None, f"/sys/bus/pci/devices unreadable ({e.strerror})"
    nvml = len(inventory.gpus) if inventory is not None else None
    mig = inventory is not None and any(g.mig for g in inventory.gpus)
    reg = registered_gpus(registered, "nvidia.com/gpu") if registered is not None else None
    nvml_src = inventory.describe_source() if inventory is not None else "no inventory"
    return (
        GpuCounts(pci, nvml, reg, mig=mig, driver_wait=driver_wait),
        f"{where}, {nvml_src}, kubelet checkpoint RegisteredDevices",
    )


def gather(
    root: Root,
    inventory: Optional[Inventory],
    registered: Optional[Sequence[tuple[str, Optional[Sequence[str]]]]],
    run: Runner,
    live: Optional[bool] = None,
    kubelet_units: Sequence[str] = ("kubelet.service",),
    observe: bool = False,
    driver_wait: str = "",
    driver_root: str = "",
) -> Facts:
    """`live`: whether to ask systemd too (default: only when the root is "/");
    `kubelet_units`: where kubelet may run ([Systemd] KubeletUnits=); `driver_wait`:
    why NVML is awaited on a node whose driver is a container ("" when it is not)."""
    live = root.is_host if live is None else live
    kc = kubelet_config(root, lambda path: _read_text(root, path), kubelet_units)
    dropin_path, dropin_state, unit = kubelet_dropin(
        root, run, live, units_to_check(kc.process, kubelet_units)
    )
    layout, cg_evidence = cgroup_layout(root)
    crio = [read_conf(root, CRIO_CONFIGS[0], toml_scalars)]
    try:
        dropins = sorted(os.listdir(root.path(CRIO_CONFIGS[1])))
    except OSError:
        dropins = []
    crio += [read_conf(root, f"{CRIO_CONFIGS[1]}/{n}", toml_scalars) for n in dropins]
    majors = nvidia_majors(read_proc_devices(root))
    gpus = inventory.gpus if inventory is not None else ()
    modeset = "nvidia_modeset" in read_loaded_modules(root)
    want = expected_nodes(gpus, majors, read_cap_minors(root), modeset=modeset)
    have = {n.key for n in list_nvidia_nodes(root, majors)}
    missing = tuple(n.path for n in want if n.key not in have)
    present = tuple(n for n in want if n.key in have)
    counts, counts_evidence = gpu_counts(root, inventory, registered, driver_wait)
    return Facts(
        cgroup_layout=layout,
        cgroup_evidence=cg_evidence,
        kubelet=ConfFile(kc.where, kc.values, (), kc.error),
        toolkit=read_conf(root, toolkit_config(root), toml_scalars),
        containerd=read_conf(root, containerd_config(root), toml_scalars),
        crio=tuple(c for c in crio if c.error != "missing"),
        plugins=read_plugins(root),
        majors=majors,
        missing_nodes=missing,
        links=check_dev_char_links(root, present),
        runc=runc_version(root, run),
        toolkit_version=binary_version(
            root, run, TOOLKIT_RUNTIMES, r"version (\d+\.\d+\.\d+)", "nvidia-container-runtime"
        ),
        systemd=systemd_version(root),
        dropin=(dropin_path, dropin_state),
        daemon=daemon_state(root),
        counts=counts,
        counts_evidence=counts_evidence,
        now=time.time(),
        kubelet_unit=unit,
        off_switch=read_off_switch(root),
        observe=observe,
        operator=read_operator(root, inventory, driver_wait, driver_root),
        bridge=read_bridge(root),
    )
