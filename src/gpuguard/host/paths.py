"""One root prefix for every host path, so tests and simulations run against a directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Root:
    """The host's filesystem as gpuguard sees it: `/` in production, a temp dir in tests."""

    prefix: Path = Path("/")

    def path(self, host_path: str | Path) -> Path:
        """Map an absolute host path (e.g. `/var/lib/kubelet`) under the prefix."""
        p = Path(host_path)
        if not p.is_absolute():
            raise ValueError(f"host path must be absolute: {host_path}")
        return self.prefix.joinpath(*p.parts[1:])

    @property
    def is_host(self) -> bool:
        return self.prefix == Path("/")


# Well-known host paths, always passed through Root.path().
KUBELET_CHECKPOINT = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"
DEVICE_PLUGINS_DIR = "/var/lib/kubelet/device-plugins"
STATE_DIR = "/var/lib/gpuguard"
BACKUP_DIR = "/var/lib/gpuguard/backups"
# checkpoint entries gpuguard dropped, kept as evidence (checkpoint/dropped.py)
DROPPED_ENTRIES_FILE = "/var/lib/gpuguard/checkpoint-dropped.json"
# each GPU's identity across boots, for the checkpoint remap (checkpoint/history.py)
GPU_HISTORY_FILE = "/var/lib/gpuguard/gpu-identity.json"
CONFIG_FILE = "/etc/gpuguard/gpuguard.conf"
CONFIG_DROPIN_DIR = "/etc/gpuguard/gpuguard.conf.d"
# the package's defaults, read when /etc/gpuguard/gpuguard.conf does not exist
CONFIG_DEFAULTS_FILE = "/usr/lib/gpuguard/gpuguard.conf"
HOOKS_DIR = "/etc/gpuguard/hooks.d"
KUBELET_DROPIN = "/etc/systemd/system/kubelet.service.d/10-gpuguard.conf"
KUBELET_DROPIN_VENDOR = "/usr/lib/systemd/system/kubelet.service.d/10-gpuguard.conf"
