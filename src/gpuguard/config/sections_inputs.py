"""The configuration sections about gpuguard's inputs and outputs: [Inventory], [Metrics]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from gpuguard.config.keyspec import DEFAULT_ORIGIN as DEFAULT_ORIGIN
from gpuguard.config.keyspec import SEE_ALSO as SEE_ALSO
from gpuguard.config.keyspec import KeySpec as KeySpec
from gpuguard.config.keyspec import _key
from gpuguard.config.types import (
    AbsPath,
    Bool,
    TimeSpan,
)


@dataclass(frozen=True)
class InventoryConfig:
    SECTION: ClassVar[str] = "Inventory"

    file: str | None = _key(
        "File",
        AbsPath(optional=True),
        "",
        "A JSON GPU inventory to use instead of asking NVML (for simulations and "
        "tests); empty: ask NVML.",
    )
    allow_kubelet_restart: bool = _key(
        "AllowKubeletRestart",
        Bool(),
        "no",
        "With File= set (a simulation), still restart or stop a running kubelet for a "
        "checkpoint repair. no: the daemon reports the plan and leaves a running kubelet "
        "alone, as `gpuguard check --inventory` does without --allow-kubelet-restart.",
    )
    driver_root: str | None = _key(
        "DriverRoot",
        AbsPath(optional=True),
        "",
        "Where a containerized driver's files are (the NVIDIA container toolkit's `root` "
        "setting), searched for libnvidia-ml.so.1 after the host's loader path and the GPU "
        "Operator's /run/nvidia/driver; empty: those two only. Set, the node's driver "
        "comes from a container: NVML missing is waited for (DriverStartGrace=).",
    )
    driver_start_grace: float = _key(
        "DriverStartGrace",
        TimeSpan(0.0),
        "10min",
        "On a node whose driver comes from a container (the GPU Operator's, or "
        "DriverRoot=), how long NVML may be missing before the GPU count calls it a "
        "problem; until then the node's GPU count is unknown, with the reason (the driver "
        "container has not started), and the daemon looks again every few seconds.",
    )


@dataclass(frozen=True)
class MetricsConfig:
    SECTION: ClassVar[str] = "Metrics"

    textfile_directory: str | None = _key(
        "TextfileDirectory",
        AbsPath(optional=True),
        "",
        "Write gpuguard.prom (Prometheus metrics) here after every pass, atomically, for "
        "node_exporter's textfile collector (its default directory is "
        "/var/lib/prometheus/node-exporter, which gpuguard.service may write); empty: off. "
        "The daemon then renders the file itself, with python3-prometheus-client, which "
        "costs it about 6.5 MB of resident memory.",
    )
