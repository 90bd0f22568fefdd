"""The kubelets the suite runs (harness/kubelet.py): 1.20.2, 1.34.9 and 1.36.2.

* ``1.20``: built from Debian 12's source package by ``scripts/build-kubelet`` and
  cached; configured by flags, as it was deployed then.
* ``1.34``: the prebuilt static binary in ``../shared/kubelet/`` beside the checkout
  (its README.md gives its source, toolchain and build; ``GPUGUARD_KUBELET_134=XZ``
  names it elsewhere), unpacked once into the test
  cache (``$GPUGUARD_TEST_CACHE/kubelet-1.34.9-<the xz's sha256, 16 hex>/kubelet``,
  under the cache's kubelet lock) and checked against its recorded sha256. Flags it
  removed (``--container-runtime``, most of the rest moved) are a
  KubeletConfiguration file (``--config``); ``failCgroupV1: false`` lets it run on
  cgroup v1 (the only layout these machines can run pods on: harness/kubelet.py).
* ``1.36``: the same for ``kubelet-1.36.2.xz`` (``GPUGUARD_KUBELET_136=XZ``), run with
  1.34's configuration (its README: the same fields work).

Both speak the same deviceplugin v1beta1 API: the plugin double's code is generated
from 1.20's tree's ``api.proto`` for either. Without the binary a test skips, and
fails under ``CI=true``.

Their logs differ: 1.20 writes ``State pushed for device plugin nvidia.com/gpu``,
1.34 structured lines (``"State pushed for device plugin" resource="nvidia.com/gpu"``);
:meth:`Kubelet.registrations` and :meth:`Kubelet.runtime_seen` read either.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence

from .sysns import REPO

VERSIONS = ("1.20", "1.34", "1.36")
SHARED = REPO.parent / "shared" / "kubelet"
#: ``GPUGUARD_KUBELET_134`` names the xz where a checkout has no ../shared beside it
XZ_134 = Path(os.environ.get("GPUGUARD_KUBELET_134", SHARED / "kubelet-1.34.9.xz"))
SHA256_134 = "b540eb1c6009de11bca958cea1823a173e2cf285dd391b555e0dc1245f9a0047"
#: ``GPUGUARD_KUBELET_136``: the same for 1.36.2
XZ_136 = Path(os.environ.get("GPUGUARD_KUBELET_136", SHARED / "kubelet-1.36.2.xz"))
SHA256_136 = "5402bb8b8a8b6f1748ff102427da1d830ac1ad56fc1b3cdf9d8127a6bad16b6e"
#: version -> (the xz, its full version, the unpacked binary's sha256)
PREBUILT = {"1.34": (XZ_134, "1.34.9", SHA256_134), "1.36": (XZ_136, "1.36.2", SHA256_136)}
CACHE = Path(os.environ.get("GPUGUARD_TEST_CACHE", "/var/cache/gpuguard-tests"))
#: the flags the suite gives its kubelets, as KubeletConfiguration fields for 1.34
FLAG_FIELDS = {
    "--cpu-manager-policy": "cpuManagerPolicy",
    "--reserved-cpus": "reservedSystemCPUs",
    "--cpu-manager-reconcile-period": "cpuManagerReconcilePeriod",
}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def unpack_134() -> Path:
    """kubelet 1.34.9 from ``../shared/kubelet/``, unpacked once into the test cache."""
    return unpack("1.34")


def unpack(version: str) -> Path:
    """The prebuilt kubelet ``version`` (:data:`PREBUILT`) from ``../shared/kubelet/``,
    unpacked once into the test cache and checked against its recorded sha256."""
    from conftest import _missing

    xz, full, sha = PREBUILT[version]
    if not xz.is_file():
        _missing(f"no kubelet {version} at {xz} (../shared/kubelet/ beside the checkout)")
    dest = CACHE / f"kubelet-{full}-{_sha256(xz)[:16]}" / "kubelet"
    if dest.is_file():
        return dest
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / ".kubelet.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if dest.is_file():
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(".kubelet.tmp")
        with tmp.open("wb") as out:
            subprocess.run(["xz", "-dc", str(xz)], stdout=out, check=True, timeout=300)
        if _sha256(tmp) != sha:
            tmp.unlink()
            raise AssertionError(f"{xz} unpacks to another binary than its README's sha256")
        tmp.chmod(0o755)
        tmp.rename(dest)
    return dest


@dataclass(frozen=True)
class Kubelet:
    """One kubelet version: its binary and how the suite runs it."""

    version: str  # "1.20", "1.34" or "1.36"
    binary: Path

    @property
    def uses_config(self) -> bool:
        return self.version != "1.20"

    def config(self, base: Sequence[str], extra: Sequence[str]) -> Dict[str, Any]:
        """1.34's KubeletConfiguration for the suite's flags (kubelet_flags)."""
        flags = dict(f.split("=", 1) for f in [*base, *extra] if "=" in f)
        cfg: Dict[str, Any] = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "staticPodPath": flags["--pod-manifest-path"],
            "fileCheckFrequency": flags["--file-check-frequency"],
            "containerRuntimeEndpoint": flags["--container-runtime-endpoint"],
            "runtimeRequestTimeout": flags["--runtime-request-timeout"],
            "cgroupDriver": flags["--cgroup-driver"],
            "failSwapOn": False,
            "failCgroupV1": False,
            "readOnlyPort": int(flags["--read-only-port"]),
            "address": flags["--address"],
            "volumePluginDir": flags["--volume-plugin-dir"],
            "imageGCHighThresholdPercent": int(flags["--image-gc-high-threshold"]),
            "imageGCLowThresholdPercent": int(flags["--image-gc-low-threshold"]),
            "evictionHard": dict([flags["--eviction-hard"].split("<", 1)]),
            "syncFrequency": flags["--sync-frequency"],
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
        }
        for flag, value in flags.items():
            if flag in FLAG_FIELDS:
                cfg[FLAG_FIELDS[flag]] = value
        return cfg

    def argv(self, flags: Sequence[str], extra: Sequence[str], config_at: str) -> List[str]:
        """kubelet's command line: 1.20's flags, or 1.34's ``--config`` and the few
        flags that stay flags."""
        if not self.uses_config:
            return [str(self.binary), *flags, *extra]
        keep = ("--hostname-override", "--node-ip", "-v")
        return [
            str(self.binary),
            f"--config={config_at}",
            *[f for f in flags if f.split("=", 1)[0] in keep],
        ]

    def write_config(self, path: Path, flags: Sequence[str], extra: Sequence[str]) -> None:
        if self.uses_config:
            path.write_text(json.dumps(self.config(flags, extra), indent=1))

    @staticmethod
    def registrations(log: str, resource: str = "nvidia.com/gpu") -> int:
        """How often an endpoint registered ``resource`` and pushed its devices, in a
        kubelet run's log (gpuguard's bridge included: neither logs the endpoint)."""
        res = re.escape(resource)
        return len(re.findall(rf'State pushed for device plugin"?\s+(?:resource=")?{res}', log))

    @staticmethod
    def capacities(log: str) -> List[int]:
        """Every GPU capacity 1.34 logged ("resourceCapacity=3", "capacity=3")."""
        return [int(n) for n in re.findall(r"\b(?:resourceCapacity|capacity)=(\d+)", log)]

    @staticmethod
    def runtime_seen(log: str) -> str:
        """What the kubelet run says its container runtime is ("containerd 1.6.20~ds1,
        apiVersion v1"), from its line at start-up; "" before it."""
        m = re.search(
            r"Container runtime (\S+) initialized, version: ([^,]+), apiVersion: (\S+)", log
        ) or re.search(
            r'Container runtime initialized" containerRuntime="([^"]+)" version="([^"]+)" '
            r'apiVersion="([^"]+)"',
            log,
        )
        return f"{m[1]} {m[2]}, apiVersion {m[3]}" if m else ""


def kubelet(version: str, build_1_20: Mapping[str, Path]) -> Kubelet:
    """The kubelet of ``version`` ("1.20": the cached build, from ``build_1_20``)."""
    if version == "1.20":
        return Kubelet(version, build_1_20["path"])
    if version in PREBUILT:
        return Kubelet(version, unpack(version))
    raise ValueError(f"no kubelet {version!r}: one of {VERSIONS}")
