"""Where kubelet runs: its process, the systemd unit that process is in, and the flags
it was started with.

kubeadm, EKS, GKE and AKS run the `kubelet` binary from a unit of their own
(kubelet.service almost everywhere), with `--config FILE` and sometimes flags that
override it (`--cgroup-driver=systemd`). RKE2 starts the same binary as a child of
rke2-agent.service (rke2-server.service), so the process's cgroup, not its parent,
names the unit. k3s runs kubelet inside its own process: after k3s re-executes its
data-directory binary the process is `k3s-agent` (`k3s-server`), and kubelet's flags
are k3s's `--kubelet-arg NAME=VALUE`, on its command line or in
/etc/rancher/k3s/config.yaml (and config.yaml.d/*.yaml) as a `kubelet-arg:` list.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence, Union

from gpuguard.devices.processes import KUBELET_COMMS, classify_cgroup, read_cgroup
from gpuguard.host.numparse import parse_decimal
from gpuguard.host.paths import Root
from gpuguard.host.safeio import proc_bytes, proc_text
from gpuguard.host.structconf import Refusal, scalar_text, yaml_mapping

EMBEDDING_COMMS = KUBELET_COMMS[1:]  # k3s: kubelet inside its own process
K3S_CONFIGS = ("/etc/rancher/k3s/config.yaml", "/etc/rancher/k3s/config.yaml.d")
MAX_K3S_ENTRIES = 256  # a drop-in directory listed no further
# (host path) -> its text, or "" when it cannot be read (the caller's bounded reader)
TextReader = Callable[[str], str]
# kubelet flags that take a value (pflag also reads `--name value` for these)
VALUE_FLAGS = frozenset(
    {"config", "config-dir", "cgroup-driver", "cpu-manager-policy", "root-dir", "kubeconfig"}
)


@dataclass(frozen=True)
class KubeletProcess:
    pid: int
    comm: str
    argv: tuple[str, ...]
    unit: str  # the systemd service its cgroup is in, "" if none

    @property
    def embedded(self) -> bool:
        """kubelet runs inside another program (k3s): its flags are that program's
        --kubelet-arg values."""
        return self.comm in EMBEDDING_COMMS

    def describe(self) -> str:
        where = f" in {self.unit}" if self.unit else " (not in a systemd service)"
        return f"{self.comm} (pid {self.pid}){where}"


def _comm(root: Root, pid: int) -> str:
    try:
        return proc_text(root.path(f"/proc/{pid}/comm"), max_bytes=4096).strip()
    except OSError:
        return ""


def kubelet_processes(root: Root) -> tuple[KubeletProcess, ...]:
    """Every process that runs kubelet, by pid (`kubelet`, or k3s's own)."""
    try:
        names = os.listdir(root.path("/proc"))
    except OSError:
        return ()
    out = []
    for name in names:
        pid = parse_decimal(name, lo=1, hi=2**22)
        if pid is None:
            continue
        comm = _comm(root, pid)
        if comm not in KUBELET_COMMS:
            continue
        try:
            raw = proc_bytes(root.path(f"/proc/{pid}/cmdline"))
        except OSError:  # it exited while we looked
            continue
        argv = tuple(a.decode("utf-8", "replace") for a in raw.split(b"\0") if a)
        _kind, _cid, _rt, _pod, unit = classify_cgroup(read_cgroup(root, pid))
        out.append(KubeletProcess(pid, comm, argv, unit))
    return tuple(sorted(out, key=lambda p: p.pid))


def parse_flags(args: Sequence[str]) -> dict[str, str]:
    """kubelet's long flags (`--name=value`, `--name value` for VALUE_FLAGS, a bare
    boolean `--name` as "true"); the last one of a name wins, as in pflag."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("-") or arg in ("-", "--"):
            continue
        name, eq, value = arg.lstrip("-").partition("=")
        if not eq:
            if name in VALUE_FLAGS and i < len(args):
                value, i = args[i], i + 1
            else:
                value = "true"
        out[name] = value
    return out


def embedded_args(argv: Sequence[str]) -> list[str]:
    """k3s's `--kubelet-arg NAME=VALUE` values on its command line, as kubelet flags."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg.startswith("--kubelet-arg="):
            out.append(arg.partition("=")[2])
        elif arg == "--kubelet-arg" and i + 1 < len(argv):
            out.append(argv[i + 1])
    return ["--" + a.lstrip("-") for a in out if a]


def yaml_list(text: str, key: str) -> Union[list[str], Refusal]:
    """The items of a top-level `key:` list in k3s's config.yaml (a single string is a
    list of one), read by a YAML parser as k3s reads it; why not, if it cannot be."""
    doc = yaml_mapping(text)
    if isinstance(doc, Refusal):
        return doc
    value = doc.get(key)
    items = value if isinstance(value, list) else [] if value is None else [value]
    out = [scalar_text(i) for i in items]
    return [i for i in out if i]


@dataclass(frozen=True)
class KubeletFlags:
    """What kubelet was started with: its flags and where they were read."""

    process: Optional[KubeletProcess]
    flags: Mapping[str, str]
    evidence: str
    problem: str = ""  # why the flags cannot be known (a k3s file unreadable), else ""


def kubelet_flags(
    root: Root, read_text: TextReader, procs: Sequence[KubeletProcess], ignored: str = ""
) -> KubeletFlags:
    """The flags of the first of `procs` (the kubelets trusted: devices/kubelettrust.py;
    `ignored` says which were not). For k3s, its --kubelet-arg values from the command
    line, then its configuration files."""
    if not procs:
        why = "no running kubelet (no process named kubelet or k3s)"
        return KubeletFlags(None, {}, f"no trusted running kubelet ({ignored})" if ignored else why)
    p = procs[0]
    if not p.embedded:
        return KubeletFlags(p, parse_flags(p.argv[1:]), f"{p.describe()}: its command line")
    args = embedded_args(p.argv)
    sources = [f"{p.describe()}: --kubelet-arg"]
    files, problem = k3s_config_files(root)
    for path in files:
        text = read_text(path)
        items = yaml_list(text, "kubelet-arg") if text else []
        if isinstance(items, Refusal):
            problem = problem or f"{path}: {items.why}"
            continue
        if items:
            args += ["--" + a.lstrip("-") for a in items]
            sources.append(path)
    return KubeletFlags(p, parse_flags(args), ", ".join(sources), problem)


def k3s_config_files(root: Root) -> tuple[list[str], str]:
    """config.yaml and its drop-ins in k3s's order, and why not all (too many)."""
    main, dropins = K3S_CONFIGS
    names: list[str] = []
    try:
        with os.scandir(root.path(dropins)) as it:
            for n, entry in enumerate(it):
                if n >= MAX_K3S_ENTRIES:
                    why = f"{dropins}: more than {MAX_K3S_ENTRIES} entries, not read"
                    return [main], why
                if entry.name.endswith(".yaml"):
                    names.append(entry.name)
    except OSError:
        pass
    return [main, *(f"{dropins}/{n}" for n in sorted(names))], ""
