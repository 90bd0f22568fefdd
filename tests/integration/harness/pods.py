"""Static pods for the real kubelet (harness/kubelet.py): their manifests, and their
status as kubelet's read-only port shows it (``/pods``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Sequence

from .sysns import REPO

API = "/run/gg-kubelet-api"  # the generated gRPC code, read-only inside the node
BUSYBOX = "gpuguard.test/busybox:1"
DEVICE_PLUGINS = "/var/lib/kubelet/device-plugins"
INVENTORY = "/etc/gpuguard/inventory.json"
PLUGIN_SCRIPT = REPO / "tests/integration/harness/deviceplugin.py"
VENV_PYTHON = REPO / ".venv/bin/python"


@dataclass(frozen=True)
class Pod:
    """A static pod as kubelet's /pods shows it."""

    name: str
    uid: str
    phase: str
    reason: str
    message: str
    containers: Dict[str, Dict[str, Any]]  # name -> containerStatus

    @property
    def running(self) -> bool:
        return self.phase == "Running" and all(
            "running" in c.get("state", {}) for c in self.containers.values()
        )

    def errors(self) -> str:
        """The containers' waiting and last-terminated messages, joined."""
        out = []
        for c in self.containers.values():
            for state in (c.get("state", {}), c.get("lastState", {})):
                for v in state.values():
                    out.append(f"{v.get('reason', '')}: {v.get('message', '')}")
        return "\n".join(out)


def show(pods: Mapping[str, Pod]) -> str:
    return "; ".join(
        f"{p.name}: {p.phase} {p.reason} {p.message} [{p.errors()}]" for p in pods.values()
    )


def busybox_pod(name: str, uid: str, limits: Mapping[str, Any], **spec: Any) -> Dict[str, Any]:
    """A static pod whose one container ``work`` sleeps, with these resource limits
    (and the same requests). ``spec`` adds to the pod spec."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": uid},
        "spec": {
            "hostNetwork": True,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "work",
                    "image": BUSYBOX,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 1; done"],
                    "resources": {"limits": dict(limits), "requests": dict(limits)},
                }
            ],
            **spec,
        },
    }


def plugin_pod(uid: str, args: Sequence[str] = ()) -> Dict[str, Any]:
    """The device plugin double as a privileged static pod (NVIDIA's DaemonSet runs it
    privileged too): the host's /usr and this checkout give it python3 and grpc."""
    mounts = {
        "usr": ("/usr", True),
        "checkout": (str(REPO), True),
        "api": (API, True),
        "gpuguard": ("/etc/gpuguard", True),
        "plugins": (DEVICE_PLUGINS, False),
    }
    pod = busybox_pod(uid=uid, name="nvidia-device-plugin", limits={})
    ctr = pod["spec"]["containers"][0]
    ctr["name"] = "plugin"
    ctr["command"] = [str(VENV_PYTHON), str(PLUGIN_SCRIPT), "--api", API, "--inventory", INVENTORY]
    ctr["command"] += list(args)
    ctr["securityContext"] = {"privileged": True}
    ctr["volumeMounts"] = [
        {"name": n, "mountPath": p, "readOnly": ro} for n, (p, ro) in mounts.items()
    ]
    pod["spec"]["volumes"] = [{"name": n, "hostPath": {"path": p}} for n, (p, _) in mounts.items()]
    pod["spec"]["terminationGracePeriodSeconds"] = 2
    return pod
