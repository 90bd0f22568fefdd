"""Stop a container through its runtime, so kubelet recreates it from its pod spec.

The one implementation, for the container access step's V2Remedy=restart-container and
for device plugin restarts: ``crictl --runtime-endpoint EP stop --timeout N ID`` when
crictl exists, else (or when crictl failed) containerd's own client,
``ctr --address SOCK -n NAMESPACE task kill -s SIGTERM ID`` (kubelet's containers live
in containerd namespace ``k8s.io``). Every command runs with a timeout (host/commands.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

from gpuguard.host.commands import run_async


@dataclass(frozen=True)
class StopResult:
    ok: bool
    method: str  # crictl | ctr | none (no runtime client applies)
    detail: str  # what was done, or why each client failed
    errors: tuple[str, ...] = ()


def _endpoint_path(endpoint: str) -> str:
    return endpoint[len("unix://") :] if endpoint.startswith("unix://") else endpoint


class ContainerStopper:
    def __init__(
        self,
        *,
        crictl: str = "/usr/bin/crictl",
        cri_endpoint: str = "unix:///run/containerd/containerd.sock",
        ctr: str = "/usr/bin/ctr",
        ctr_address: Optional[str] = None,
        ctr_namespace: str = "k8s.io",
        command_timeout: float = 30.0,
        stop_timeout: int = 10,
    ) -> None:
        self.crictl = crictl
        self.cri_endpoint = cri_endpoint
        self.ctr = ctr
        self.ctr_address = ctr_address or _endpoint_path(cri_endpoint)
        self.ctr_namespace = ctr_namespace
        self.command_timeout = command_timeout
        self.stop_timeout = stop_timeout

    def plan(self, runtime: str = "unknown") -> Optional[str]:
        """The client tried first for a container of `runtime`; None when none applies."""
        if runtime in ("containerd", "cri-o", "unknown") and os.access(self.crictl, os.X_OK):
            return "crictl"
        if runtime in ("containerd", "unknown") and os.access(self.ctr, os.X_OK):
            return "ctr"
        return None

    async def _run(self, argv: Sequence[str]) -> tuple[int, str]:
        return await run_async(argv, timeout=self.command_timeout)

    async def stop(self, container_id: str, runtime: str = "unknown") -> StopResult:
        errors: list[str] = []
        method = self.plan(runtime)
        if method == "crictl":
            argv = [self.crictl, "--runtime-endpoint", self.cri_endpoint, "stop"]
            argv += ["--timeout", str(self.stop_timeout), container_id]
            rc, out = await self._run(argv)
            if rc == 0:
                return StopResult(True, "crictl", f"crictl stop {container_id[:13]}")
            errors.append(f"crictl exited {rc}: {out}")
            method = "ctr" if os.access(self.ctr, os.X_OK) else None
        if method == "ctr":
            argv = [self.ctr, "--address", self.ctr_address, "-n", self.ctr_namespace]
            argv += ["task", "kill", "-s", "SIGTERM", container_id]
            rc, out = await self._run(argv)
            if rc == 0:
                detail = f"ctr -n {self.ctr_namespace} task kill -s SIGTERM {container_id[:13]}"
                return StopResult(True, "ctr", detail)
            errors.append(f"ctr exited {rc}: {out}")
        detail = "; ".join(errors) or f"neither {self.crictl} nor {self.ctr} can be run"
        return StopResult(False, "none", detail, tuple(errors))
