"""Whether each harness GPU container has its GPU, asked many times a second: its
devices.list on v1, the kernel itself on v2 (a prober process per container). Shared
by bench/bench_container_access.py and bench/soak.py."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Dict, List, Sequence

from integration.gpu_scopes import Container
from integration.harness import SystemdNamespace

PROBE_CGROUP = "gg-bench-probe"  # the prober's child cgroup inside the scope


class Prober:
    """A child process inside a v2 container's cgroup that opens the container's fake GPU
    node whenever asked (one byte over a pipe) and answers the errno: the kernel's
    verdict for 200 containers in a few ms, where a fork per check would take 100s."""

    def __init__(self, cgroup: Path, node: Path) -> None:
        # A child cgroup of the scope: the scope's programs bind it (the kernel's
        # effective set), and gpuguard reads only the scope's own cgroup.procs, which
        # would show a process of the host's PID namespace as 0.
        cgroup = cgroup / PROBE_CGROUP
        cgroup.mkdir(exist_ok=True)
        ask_r, self.ask = os.pipe()
        self.answer, ans_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: raw syscalls only, then _exit
            try:
                lo, hi = sorted((ask_r, ans_w))  # other probers' pipes too: EOF must reach them
                os.closerange(3, lo)
                os.closerange(lo + 1, hi)
                os.closerange(hi + 1, 4096)
                fd = os.open(cgroup / "cgroup.procs", os.O_WRONLY)
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
                while os.read(ask_r, 1):
                    err = 0
                    try:
                        os.close(os.open(node, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY))
                    except OSError as e:
                        err = e.errno or 255
                    os.write(ans_w, bytes([err]))
            finally:
                os._exit(0)
        os.close(ask_r)
        os.close(ans_w)

    def close(self) -> None:
        os.close(self.ask)  # the child reads EOF and exits
        os.close(self.answer)
        os.waitpid(self.pid, 0)


class Access:
    """Whether each container has its GPU: devices.list on v1, the kernel on v2. Not
    thread-safe: a caller that samples from a thread holds its own lock around these."""

    def __init__(self, ns: SystemdNamespace) -> None:
        self.ns = ns
        self.probers: Dict[str, Prober] = {}

    def add(self, ctrs: Sequence[Container]) -> None:
        if self.ns.layout == "v2":
            for c in ctrs:
                node = self.ns.fake_node(195, c.gpus[0])
                self.probers[c.unit] = Prober(c.cgroup(self.ns), node)

    def remove(self, c: Container) -> None:
        """Before the container's scope is stopped: its prober exits first."""
        p = self.probers.pop(c.unit, None)
        if p is not None:
            p.close()

    def lacking(self, ctrs: Sequence[Container]) -> List[Container]:
        """The containers denied their GPU now; one whose cgroup is gone counts as
        lacking on v1 (it cannot be read)."""
        if self.ns.layout == "v1":
            out = []
            for c in ctrs:
                try:
                    if f"c 195:{c.gpus[0]} rw" not in c.devices_list(self.ns):
                        out.append(c)
                except OSError:
                    out.append(c)
            return out
        ps = [self.probers[c.unit] for c in ctrs]
        for p in ps:  # ask all, then collect: the children answer in parallel
            os.write(p.ask, b"?")
        verdicts = [os.read(p.answer, 1) for p in ps]
        return [c for c, v in zip(ctrs, verdicts) if v == bytes([errno.EPERM])]

    def close(self) -> None:
        while self.probers:
            self.probers.popitem()[1].close()
