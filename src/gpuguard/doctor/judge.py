"""Pure judgement: Facts -> one Check per question. No I/O, so the tests are tables.

F2 (a reload or the CPU manager drops a GPU from a running container) needs the legacy
NVIDIA hook: it grants GPUs in the cgroup behind runc's back. When the devices are in
the OCI spec instead (toolkit mode cdi/jit-cdi/csv, or the device plugin's
passDeviceSpecs / a cdi-* deviceListStrategy), runc and systemd know them and re-apply
them; failure-modes.md has the mechanisms.
"""

from __future__ import annotations

import re
from typing import Optional

from gpuguard.doctor.facts import ConfFile, Facts
from gpuguard.doctor.model import BROKEN, EXPOSED, OK, UNKNOWN, Check, Report
from gpuguard.doctor.operator_judge import check_layout, driver_awaited
from gpuguard.doctor.readmit import check_bridge
from gpuguard.engine.passes import STATUS_FILE
from gpuguard.steps.gpu_count.reconcile import DRIVER_DOWN_NEXT
from gpuguard.steps.gpu_count.reconcile import judge as judge_counts

SPEC_MODES = ("cdi", "jit-cdi", "csv")
FIXED_RUNC = (1, 1, 7)
JIT_CDI_DEFAULT = (1, 18, 0)  # the toolkit's "auto" mode means jit-cdi from here on
BROKEN_RUNC = ((1, 1, 3), (1, 1, 6))
STALE_PASS_AFTER = 3 * 3600.0  # three default audit intervals without a pass


def _unreadable(c: ConfFile, what: str) -> Optional[str]:
    if c.error == "missing":
        return f"{c.path} missing ({what})"
    return c.error or None


def toolkit_mode(f: Facts) -> Optional[str]:
    """The mode the runtime uses: "auto" (the default) resolves by version, to legacy
    before 1.18 and to jit-cdi since."""
    if f.toolkit.error:
        return None
    mode = f.toolkit.values.get("nvidia-container-runtime.mode", "auto")
    if mode != "auto":
        return mode
    v = _version(f.toolkit_version[0])
    if v is None:
        return None
    return "jit-cdi" if v >= JIT_CDI_DEFAULT else "legacy"


def specs_in_oci(f: Facts) -> Optional[bool]:
    """Whether GPU devices reach runc through the OCI spec; None when it cannot be told."""
    if toolkit_mode(f) in SPEC_MODES:
        return True
    if f.plugins and any(not p.strategy for p in f.plugins):
        return None  # a plugin whose settings could not be read
    if f.plugins and all(p.pass_device_specs or p.strategy.startswith("cdi") for p in f.plugins):
        return True
    if toolkit_mode(f) == "legacy" and f.plugins is not None:
        return False
    return None


def _f2_exposed(f: Facts, trigger: str, fix: str, evidence: str) -> Check:
    name = "kubelet-cgroup-driver" if "reload" in trigger else "kubelet-cpu-manager"
    spec = specs_in_oci(f)
    if spec is None:
        return Check(
            name,
            UNKNOWN,
            f"{evidence}; whether GPUs are in the OCI spec is unknown "
            "(see toolkit-mode and device-plugin)",
            fix,
        )
    if spec:
        return Check(name, OK, f"{evidence}; GPUs are in the OCI spec, {trigger} keeps them")
    return Check(name, EXPOSED, f"{evidence} with the legacy hook: {trigger} drops GPUs (F2)", fix)


def check_cgroup(f: Facts) -> Check:
    if not f.cgroup_layout:
        return Check("cgroup-layout", UNKNOWN, f.cgroup_evidence)
    return Check("cgroup-layout", OK, f.cgroup_evidence)


def check_cgroup_driver(f: Facts) -> Check:
    bad = _unreadable(f.kubelet, "no kubelet configuration found")
    if bad:
        return Check("kubelet-cgroup-driver", UNKNOWN, bad)
    driver = f.kubelet.values.get("cgroupDriver")
    if driver is None:  # kubelet's default is cgroupfs, but unset is not seen to be so
        return Check(
            "kubelet-cgroup-driver",
            UNKNOWN,
            f"{f.kubelet.path}: cgroupDriver is not set (kubelet's built-in default is "
            "cgroupfs; a distribution may pass it another way)",
            "set cgroupDriver explicitly in kubelet's configuration",
        )
    evidence = f"{f.kubelet.path}: cgroupDriver={driver}"
    if driver != "systemd":
        return Check(
            "kubelet-cgroup-driver", OK, evidence + "; daemon-reload leaves cgroupfs alone"
        )
    return _f2_exposed(
        f,
        "a systemctl daemon-reload",
        "toolkit mode cdi, or passDeviceSpecs=true; gpuguard re-grants meanwhile",
        evidence,
    )


def check_cpu_manager(f: Facts) -> Check:
    bad = _unreadable(f.kubelet, "no kubelet configuration found")
    if bad:
        return Check("kubelet-cpu-manager", UNKNOWN, bad)
    policy = f.kubelet.values.get("cpuManagerPolicy")
    if policy is None:  # kubelet's default is none, but unset is not seen to be so
        return Check(
            "kubelet-cpu-manager",
            UNKNOWN,
            f"{f.kubelet.path}: cpuManagerPolicy is not set (kubelet's built-in default is none)",
            "set cpuManagerPolicy explicitly in kubelet's configuration",
        )
    evidence = f"{f.kubelet.path}: cpuManagerPolicy={policy}"
    if policy != "static":
        return Check("kubelet-cpu-manager", OK, evidence)
    return _f2_exposed(
        f,
        "the CPU manager's runc update",
        "passDeviceSpecs=true (Helm compatWithCPUManager=true) or toolkit mode cdi",
        evidence,
    )


def check_toolkit(f: Facts) -> Check:
    bad = _unreadable(f.toolkit, "toolkit not installed, or configured elsewhere")
    if bad:
        return Check("toolkit-mode", UNKNOWN, bad)
    mode = toolkit_mode(f)
    configured = f.toolkit.values.get("nvidia-container-runtime.mode", "auto (unset)")
    evidence = f"{f.toolkit.path}: mode={configured}"
    if mode and not configured.startswith(mode):
        evidence += f", which is {mode} for toolkit {f.toolkit_version[0]}"
    if mode in SPEC_MODES:
        return Check("toolkit-mode", OK, evidence + "; devices go through the OCI spec")
    fix = 'mode = "cdi" under [nvidia-container-runtime] (jit-cdi is 1.18\'s default)'
    if mode == "legacy":
        if specs_in_oci(f):
            return Check("toolkit-mode", OK, evidence + "; the device plugin passes device specs")
        return Check(
            "toolkit-mode", EXPOSED, evidence + ": the hook grants GPUs behind runc (F2)", fix
        )
    if mode is None:
        return Check(
            "toolkit-mode",
            UNKNOWN,
            f"{evidence}: legacy or jit-cdi by toolkit version, which is unknown "
            f"({f.toolkit_version[1]})",
            "set mode explicitly",
        )
    return Check("toolkit-mode", UNKNOWN, f"{evidence}: unknown mode", "set mode explicitly")


def _runtime_in(c: ConfFile, default_suffix: str) -> str:
    """Which nvidia runtime a containerd or CRI-O config defines ("" when none)."""
    names = {t.split(".runtimes.", 1)[1].split(".")[0] for t in c.tables if ".runtimes." in t}
    nvidia = sorted(n for n in names if "nvidia" in n)
    default = next((v for k, v in c.values.items() if k.endswith(default_suffix)), "")
    if "nvidia" in default:
        return f"{c.path}: default runtime {default}"
    if nvidia:
        return (
            f"{c.path}: runtime {', '.join(nvidia)} "
            f"(default {default or 'runc'}: GPU pods need its runtimeClassName)"
        )
    return ""


def check_runtime(f: Facts) -> Check:
    found, readable = [], []
    configs = [(f.containerd, "default_runtime_name")]
    configs += [(c, "crio.runtime.default_runtime") for c in f.crio]
    for c, default_suffix in configs:
        if c.error == "missing":
            continue
        if c.error:
            return Check("container-runtime", UNKNOWN, c.error)
        readable.append(c.path)
        hit = _runtime_in(c, default_suffix)
        if hit:
            found.append(hit)
    if found:
        return Check("container-runtime", OK, "; ".join(found))
    if not readable:
        return Check("container-runtime", UNKNOWN, "no containerd or CRI-O configuration found")
    return Check(
        "container-runtime",
        UNKNOWN,
        f"{', '.join(readable)}: no nvidia runtime (unknown runtime, or CDI in the runtime itself)",
        "nvidia-ctk runtime configure --runtime=containerd (or crio)",
    )


def check_plugin(f: Facts) -> Check:
    if f.plugins is None:
        return Check("device-plugin", UNKNOWN, "/proc unreadable")
    if not f.plugins:
        return Check("device-plugin", UNKNOWN, "no nvidia-device-plugin process in /proc")
    evidence = "; ".join(p.evidence for p in f.plugins)
    if any(not p.strategy for p in f.plugins):
        return Check("device-plugin", UNKNOWN, evidence + " (run as root)")
    if all(p.pass_device_specs or p.strategy.startswith("cdi") for p in f.plugins):
        return Check("device-plugin", OK, evidence + ": devices in the OCI spec")
    mode = toolkit_mode(f)
    if mode in SPEC_MODES:
        return Check("device-plugin", OK, evidence + f" (toolkit mode {mode} covers it)")
    fix = "Helm compatWithCPUManager=true (passDeviceSpecs) or deviceListStrategy=cdi-cri"
    if mode == "legacy":
        return Check(
            "device-plugin", EXPOSED, evidence + ": devices only through the legacy hook", fix
        )
    return Check("device-plugin", UNKNOWN, evidence + "; toolkit mode unknown", fix)


def check_driver(f: Facts) -> Check:
    awaited = driver_awaited(f)  # a GPU Operator node's driver pod not there yet
    if awaited is not None:
        return awaited
    if f.majors.nvidia is None:
        return Check(
            "driver",
            BROKEN,
            "/proc/devices has no nvidia major: driver not loaded",
            "modprobe nvidia; check dmesg",
        )
    if f.missing_nodes:
        uvm_only = all("uvm" in p for p in f.missing_nodes)
        return Check(
            "driver",
            EXPOSED if uvm_only else BROKEN,
            f"driver loaded, missing {', '.join(f.missing_nodes)}" + (" (F3)" if uvm_only else ""),
            "gpuguard daemon creates them (CreateNodes=yes), or nvidia-modprobe -u -c0",
        )
    return Check("driver", OK, f"/proc/devices: nvidia major {f.majors.nvidia}, every node present")


def check_links(f: Facts) -> Check:
    if f.majors.nvidia is None:
        return Check("dev-char-links", UNKNOWN, "no NVIDIA driver: no nodes to link")
    bad = [f"{s.link} {s.state}" for s in f.links if s.state != "ok"]
    if bad:
        return Check(
            "dev-char-links",
            EXPOSED,
            ", ".join(bad[:4])
            + (" ..." if len(bad) > 4 else "")
            + ": runc/systemd drop DeviceAllow= for them (F2)",
            "gpuguard daemon (CreateCharLinks=yes), or "
            "nvidia-ctk system create-dev-char-symlinks --create-all",
        )
    return Check("dev-char-links", OK, f"{len(f.links)} /dev/char link(s) present")


def _version(text: str) -> Optional[tuple[int, ...]]:
    m = re.match(r"v?(\d+)\.(\d+)\.(\d+)", text)  # 1.1.5+ds1, 1.1.12-0ubuntu1
    return tuple(int(g) for g in m.groups()) if m else None


def check_runc(f: Facts) -> Check:
    version, evidence = f.runc
    v = _version(version) if version else None
    if v is None:
        return Check("runc", UNKNOWN, evidence)
    if BROKEN_RUNC[0] <= v <= BROKEN_RUNC[1]:
        links_ok = all(s.state == "ok" for s in f.links) and f.majors.nvidia is not None
        if links_ok:
            return Check(
                "runc", OK, evidence + " (drops DeviceAllow= without /dev/char links; they exist)"
            )
        return Check(
            "runc",
            EXPOSED,
            evidence + ": 1.1.3-1.1.6 drop DeviceAllow= without a /dev/char link",
            "runc >= 1.1.7, and keep the /dev/char links",
        )
    return Check("runc", OK, evidence)


def check_systemd(f: Facts) -> Check:
    version, evidence = f.systemd
    return Check(
        "systemd",
        OK if version else UNKNOWN,
        f"systemd {version} ({evidence})" if version else evidence,
    )


def check_dropin(f: Facts) -> Check:
    path, state = f.dropin
    unit = f.kubelet_unit
    if state == "ok":
        return Check(
            "kubelet-dropin",
            OK,
            f"{path} present ({unit}'s ExecStartPre= repairs the checkpoint)",
        )
    fix = (
        f"copy /usr/lib/systemd/system/kubelet.service.d/10-gpuguard.conf to "
        f"/etc/systemd/system/{unit}.d/; systemctl daemon-reload"
    )
    if state == "not-loaded":
        return Check(
            "kubelet-dropin",
            EXPOSED,
            f"{path} present but not in {unit}'s DropInPaths (no daemon-reload since)",
            "systemctl daemon-reload",
        )
    if state == "masked":
        return Check(
            "kubelet-dropin",
            EXPOSED,
            f"{path} masked: stale checkpoints reach kubelet at boot (F1)",
            f"remove the mask: rm {path}; systemctl daemon-reload",
        )
    return Check(
        "kubelet-dropin",
        EXPOSED,
        f"no {unit}.d/10-gpuguard.conf: stale checkpoints reach kubelet at boot (F1)",
        fix,
    )


def check_mode(f: Facts) -> Check:
    """Is gpuguard on, and does it repair? (the off switch, Mode=observe)"""
    if f.off_switch is not None:
        return Check(
            "gpuguard-mode",
            EXPOSED,
            f"{f.off_switch.describe()}: nothing is checked or repaired",
            "gpuguard enable",
        )
    if f.observe:
        return Check(
            "gpuguard-mode",
            EXPOSED,
            "Mode=observe: findings are reported and nothing is repaired",
            "set Mode=repair in a drop-in of /etc/gpuguard/gpuguard.conf.d/; "
            "systemctl reload gpuguard",
        )
    return Check("gpuguard-mode", OK, "Mode=repair, no off switch")


def check_daemon(f: Facts) -> Check:
    d = f.daemon
    fix = "systemctl enable --now gpuguard; journalctl -u gpuguard"
    if f.off_switch is not None:
        return Check("daemon", EXPOSED, "stopped by the off switch", "gpuguard enable")
    if d.status is None:
        if d.error.startswith("no "):
            return Check(
                "daemon", EXPOSED, f"{d.error}: gpuguard daemon not running, nothing repairs", fix
            )
        return Check("daemon", UNKNOWN, d.error)
    pid = d.status.pid
    if not d.alive:
        return Check("daemon", EXPOSED, f"{STATUS_FILE}: pid {pid} is gone (stale status)", fix)
    last = d.status.last_pass
    if last is None:
        return Check("daemon", UNKNOWN, f"{STATUS_FILE}: pid {pid} running, no pass finished yet")
    age = f.now - last.ended
    evidence = (
        f"{STATUS_FILE}: pid {pid}, last pass {last.number} {age:.0f}s ago, "
        f"{len(last.findings)} finding(s), node {d.status.node}"
    )
    if age > STALE_PASS_AFTER:
        return Check("daemon", EXPOSED, evidence + ": no pass for hours", fix)
    return Check("daemon", OK, evidence)


def check_gpu_count(f: Facts) -> Check:
    layer, text = judge_counts(f.counts)
    if layer is not None:
        fix = {
            "driver": DRIVER_DOWN_NEXT
            if f.counts.nvml is None
            else "check dmesg (Xid) and nvidia-smi; reset or reboot the GPU",
            "device-plugin": "restart the device plugin pod",
            "kubelet": "gpuguard check (repairs the checkpoint)",
        }.get(layer, "")
        return Check("gpu-count", BROKEN, f"{text} ({f.counts_evidence})", fix)
    c = f.counts
    if c.nvml is None and c.driver_wait:
        return Check("gpu-count", UNKNOWN, f"{text}: {c.driver_wait}")
    if c.pci is not None and c.nvml is not None and c.nvml > c.pci:
        return Check(
            "gpu-count",
            UNKNOWN,
            f"{text}: NVML sees more GPUs than this /sys lists "
            "(simulated inventory, or not the host's /sys?)",
        )
    known = [v for v in (c.pci, c.nvml, c.registered) if v is not None]
    if len(known) < 2:
        return Check("gpu-count", UNKNOWN, f"{text}: too few layers readable ({f.counts_evidence})")
    nvml = f.operator.nvml if f.operator is not None else ""
    return Check("gpu-count", OK, f"{text}; {nvml}" if nvml.startswith("NVML ") else text)


CHECKS = (
    check_cgroup,
    check_cgroup_driver,
    check_cpu_manager,
    check_toolkit,
    check_runtime,
    check_plugin,
    check_driver,
    check_links,
    check_runc,
    check_systemd,
    check_dropin,
    check_mode,
    check_daemon,
    check_gpu_count,
    check_layout,
    lambda f: check_bridge(f.bridge),
)


def judge(f: Facts) -> Report:
    return Report(tuple(c(f) for c in CHECKS))
