"""The doctor's kubelet: its configuration as the running kubelet was told to read it,
and the unit whose pre-start hook repairs the checkpoint.

The configuration comes from the running kubelet's own arguments
(devices/kubeletproc.py): `--config FILE` (YAML or JSON: kubeadm, EKS, GKE, AKS and
RKE2 all pass one), then the `--config-dir` drop-ins in lexical order, then the flags
on its command line, which win over both (AKS and older EKS set `--cgroup-driver=`
there). k3s runs kubelet inside its own process: its `--kubelet-arg` values are the
flags. With no kubelet running, the first file of the known layouts that exists is
read, and the evidence says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from gpuguard.devices.kubeletproc import KubeletFlags, KubeletProcess, kubelet_flags
from gpuguard.doctor.textconf import yaml_top_scalars
from gpuguard.host.paths import Root
from gpuguard.host.statefile import parse_json

# Where each layout keeps kubelet's configuration when no running kubelet says.
KNOWN_CONFIGS = (
    ("kubeadm", "/var/lib/kubelet/config.yaml"),
    ("EKS, Amazon Linux 2023", "/etc/kubernetes/kubelet/config.json"),
    ("EKS, Amazon Linux 2", "/etc/kubernetes/kubelet/kubelet-config.json"),
    ("GKE", "/home/kubernetes/kubelet-config.yaml"),
    ("AKS", "/etc/default/kubeletconfig.json"),
    ("RKE2", "/var/lib/rancher/rke2/agent/etc/kubelet.conf.d/00-rke2-defaults.conf"),
    ("k3s", "/var/lib/rancher/k3s/agent/etc/kubelet.conf.d/00-k3s-defaults.conf"),
)
# kubelet flags that override a configuration field of the same meaning
FLAG_FIELDS = {"cgroup-driver": "cgroupDriver", "cpu-manager-policy": "cpuManagerPolicy"}
UNIT_DIRS: tuple[str, ...] = ("/etc/systemd/system", "/run/systemd/system")
UNIT_DIRS += ("/usr/lib/systemd/system", "/lib/systemd/system")
DROPIN_NAME = "10-gpuguard.conf"

# (host path) -> (text, error): error "missing" when absent, "" when read
Reader = Callable[[str], tuple[str, str]]


@dataclass(frozen=True)
class KubeletConfigFacts:
    where: str  # what was read, for the evidence (files, flags, the process)
    values: Mapping[str, str]
    error: str  # "" when values could be had; else why not ("missing": nothing found)
    process: Optional[KubeletProcess]


def parse_config(text: str) -> dict[str, str]:
    """Top-level scalar fields of a KubeletConfiguration in YAML or JSON."""
    if text.lstrip().startswith("{"):
        try:
            doc = parse_json(text.encode())  # bounded numbers and nesting
        except ValueError:
            return {}
        if not isinstance(doc, dict):
            return {}
        out = {}
        for k, v in doc.items():
            if isinstance(v, bool):
                out[str(k)] = "true" if v else "false"
            elif isinstance(v, (str, int, float)):
                out[str(k)] = str(v)
        return out
    return yaml_top_scalars(text)


def _dropins(root: Root, directory: str) -> list[str]:
    try:
        names = sorted(n for n in os.listdir(root.path(directory)) if n.endswith(".conf"))
    except OSError:
        return []
    return [f"{directory.rstrip('/')}/{n}" for n in names]


def kubelet_config(root: Root, read: Reader) -> KubeletConfigFacts:
    def text_only(path: str) -> str:
        return read(path)[0]

    flags = kubelet_flags(root, text_only)
    if flags.process is None:
        return _known_layout(read, flags)
    values: dict[str, str] = {}
    sources: list[str] = []
    config, config_dir = flags.flags.get("config"), flags.flags.get("config-dir")
    for path in ([config] if config else []) + (_dropins(root, config_dir) if config_dir else []):
        text, error = read(path)
        if error:
            what = "missing" if error == "missing" else error
            return KubeletConfigFacts(
                f"{path} (named by {flags.process.describe()})",
                {},
                f"{path}: {what} (named by {flags.evidence})",
                flags.process,
            )
        values.update(parse_config(text))
        sources.append(path)
    overridden = [f"--{flag}" for flag in FLAG_FIELDS if flag in flags.flags]
    for flag, fld in FLAG_FIELDS.items():
        if flag in flags.flags:
            values[fld] = flags.flags[flag]
    where = ", ".join(sources) or "no --config"
    if overridden:
        where += f" and {' '.join(overridden)}"
    where += f" ({flags.evidence})"
    if flags.process.embedded and not sources and not overridden:
        return KubeletConfigFacts(
            where,
            {},
            f"{flags.process.describe()} runs kubelet inside k3s with neither "
            "--kubelet-arg=config= nor --kubelet-arg=cgroup-driver=: k3s chooses those "
            "settings itself",
            flags.process,
        )
    return KubeletConfigFacts(where, values, "", flags.process)


def _known_layout(read: Reader, flags: KubeletFlags) -> KubeletConfigFacts:
    for layout, path in KNOWN_CONFIGS:
        text, error = read(path)
        if error == "missing":
            continue
        where = f"{path} ({layout} layout; {flags.evidence})"
        if error:
            return KubeletConfigFacts(where, {}, error, None)
        return KubeletConfigFacts(where, parse_config(text), "", None)
    paths = ", ".join(p for _l, p in KNOWN_CONFIGS)
    return KubeletConfigFacts(
        "no kubelet configuration", {}, f"{flags.evidence}, and none of {paths}", None
    )


def hook_dropin(root: Root, unit: str) -> tuple[str, str]:
    """(path, state) of gpuguard's pre-start drop-in for `unit`: "ok", "masked" or
    "missing" (the first directory in systemd's search order that has it)."""
    for d in UNIT_DIRS:
        path = f"{d}/{unit}.d/{DROPIN_NAME}"
        p = root.path(path)
        if os.path.islink(p) and os.readlink(p) == "/dev/null":
            return path, "masked"
        if p.is_file():
            return path, "ok"
    return "", "missing"


def units_to_check(process: Optional[KubeletProcess], candidates: Sequence[str]) -> list[str]:
    """The unit kubelet runs in, else every candidate unit."""
    if process is not None and process.unit:
        return [process.unit]
    return list(candidates)
