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
from gpuguard.devices.kubelettrust import kubelets
from gpuguard.doctor.textconf import Unreadable, yaml_top_scalars
from gpuguard.host.paths import Root
from gpuguard.host.statefile import parse_json
from gpuguard.host.structconf import scalar_text

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
MAX_DROPIN_ENTRIES = 256  # a --config-dir listed no further

# (host path) -> (text, error): error "missing" when absent, "" when read
Reader = Callable[[str], tuple[str, str]]


@dataclass(frozen=True)
class KubeletConfigFacts:
    where: str  # what was read, for the evidence (files, flags, the process)
    values: Mapping[str, str]
    error: str  # "" when values could be had; else why not ("missing": nothing found)
    process: Optional[KubeletProcess]


def parse_config(text: str) -> dict[str, str]:
    """Top-level scalar fields of a KubeletConfiguration in YAML or JSON (JSON through
    the bounded JSON reader, anything else through YAML); raises Unreadable."""
    body = text.lstrip()
    if body.startswith("---") and body[3:4] in ("\n", "\r", " ", "\t"):
        body = body[3:].lstrip()  # JSON after a document start (PyYAML refuses some JSON)
    if body.startswith("{"):
        try:
            doc = parse_json(body.encode())  # bounded numbers and nesting
        except ValueError:
            doc = None  # YAML is a superset: let its parser say why
        if isinstance(doc, dict):
            out = {}
            for k, v in doc.items():
                value = scalar_text(v)
                if value is not None:
                    out[str(k)] = value
            return out
    return yaml_top_scalars(text)


def config_path_problem(flag: str, path: str) -> str:
    """Why a path kubelet was given is not read (relative, or with `..`), else ""."""
    if not path.startswith("/"):
        return (
            f"--{flag}={path[:200]!r} is relative to kubelet's working directory: not read; "
            "give kubelet an absolute path"
        )
    if ".." in path.split("/"):
        return f"--{flag}={path[:200]!r} has '..': not read; give kubelet a plain absolute path"
    return ""


def _dropins(root: Root, directory: str) -> list[str]:
    names: list[str] = []
    try:
        with os.scandir(root.path(directory)) as it:
            for n, entry in enumerate(it):
                if n >= MAX_DROPIN_ENTRIES:
                    raise Unreadable(f"more than {MAX_DROPIN_ENTRIES} entries")
                if entry.name.endswith(".conf"):
                    names.append(entry.name)
    except OSError:
        return []
    return [f"{directory.rstrip('/')}/{n}" for n in sorted(names)]


def kubelet_config(root: Root, read: Reader, units: Sequence[str]) -> KubeletConfigFacts:
    """kubelet's configuration as the trusted running kubelet (a process in one of
    `units`: devices/kubelettrust.py) was told to read it, else a known layout's."""

    def text_only(path: str) -> str:
        return read(path)[0]

    found = kubelets(root, units)
    flags = kubelet_flags(root, text_only, found.trusted, found.describe_refused())
    if flags.process is None:
        return _known_layout(read, flags)
    named = f"named by {flags.process.describe()}"

    def unknown(where: str, why: str) -> KubeletConfigFacts:
        return KubeletConfigFacts(where, {}, why, flags.process)

    if flags.problem:
        return unknown(flags.evidence, flags.problem)
    values: dict[str, str] = {}
    sources: list[str] = []
    config, config_dir = flags.flags.get("config"), flags.flags.get("config-dir")
    for flag, given in (("config", config), ("config-dir", config_dir)):
        problem = config_path_problem(flag, given) if given else ""
        if problem:
            return unknown(f"{flags.process.describe()}: its --{flag}", problem)
    try:
        paths = ([config] if config else []) + (_dropins(root, config_dir) if config_dir else [])
    except Unreadable as e:
        return unknown(f"{config_dir} ({named})", f"{config_dir}: {e}")
    for path in paths:
        text, error = read(path)
        if error:
            what = "missing" if error == "missing" else error
            return unknown(f"{path} ({named})", f"{path}: {what} (named by {flags.evidence})")
        try:
            values.update(parse_config(text))
        except Unreadable as e:
            return unknown(f"{path} ({named})", f"{path}: {e} ({named})")
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
        return unknown(
            where,
            f"{flags.process.describe()} runs kubelet inside k3s with neither "
            "--kubelet-arg=config= nor --kubelet-arg=cgroup-driver=: k3s chooses those "
            "settings itself",
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
        try:
            return KubeletConfigFacts(where, parse_config(text), "", None)
        except Unreadable as e:
            return KubeletConfigFacts(where, {}, f"{path}: {e}", None)
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
