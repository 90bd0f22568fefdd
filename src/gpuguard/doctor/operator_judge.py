"""Pure judgement of the node's layout: the GPU Operator's (a driver container, the
toolkit under /usr/local/nvidia/toolkit, CDI) or a host-installed driver, and what a
driver not there yet means on each. Facts from operator.py (through doctor/facts.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from gpuguard.doctor.model import OK, UNKNOWN, Check

if TYPE_CHECKING:
    from gpuguard.doctor.facts import Facts

DRIVER_POD_NEXT = (
    "wait for the GPU Operator's driver pod, or check it: kubectl -n gpu-operator get pods "
    "-l app=nvidia-driver-daemonset, then its log"
)


def _cdi(f: Facts) -> str:
    """What CDI looks like here (told, not judged: the toolkit's spec-dirs may be
    elsewhere, and its jit-cdi mode writes none)."""
    op = f.operator
    specs = op.cdi_specs if op is not None else ()
    mode = f.toolkit.values.get("nvidia-container-runtime.mode", "") if not f.toolkit.error else ""
    enable = next((v for k, v in f.containerd.values.items() if k.endswith(".enable_cdi")), "")
    text = f"CDI specs {', '.join(specs)}" if specs else "no NVIDIA CDI spec in /var/run/cdi"
    said = [f"toolkit mode={mode}"] * bool(mode) + [f"containerd enable_cdi={enable}"] * bool(
        enable
    )
    if said:
        text += f" ({', '.join(said)})"
    return text


def check_layout(f: Facts) -> Check:
    op = f.operator
    if op is None:
        return Check("node-layout", UNKNOWN, "the node's layout was not read")
    cdi = _cdi(f)
    if op.operator:
        root = op.driver_root + ("" if op.driver_root_present else " (not mounted yet)")
        toolkit = "toolkit /usr/local/nvidia/toolkit" if op.toolkit_dir else "no toolkit directory"
        head = f"GPU Operator layout: driver root {root}, {toolkit}"
    else:
        head = "host-installed driver"
    conf = f"toolkit config {f.toolkit.path}, containerd config {f.containerd.path}"
    if op.nvml:
        nvml = f"GPUs from {op.nvml.split(' (', 1)[0]}"  # the layout is said above
    elif op.driver_wait:
        nvml = f"NVML not yet: {op.driver_wait}"
    else:
        nvml = "NVML unavailable"
    evidence = f"{head}; {nvml}; {cdi}; {conf}"  # what a cut at 400 characters may lose last
    if not op.nvml:
        return Check("node-layout", UNKNOWN, evidence, DRIVER_POD_NEXT if op.driver_wait else "")
    return Check("node-layout", OK, evidence)


def driver_awaited(f: Facts) -> Optional[Check]:
    """A driver container not there yet is not a broken driver: "unknown", with why."""
    op = f.operator
    if op is None or not op.driver_wait or f.majors.nvidia is not None:
        return None
    return Check("driver", UNKNOWN, f"GPU Operator node: {op.driver_wait}", DRIVER_POD_NEXT)
