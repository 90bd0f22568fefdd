"""A real Kubernetes control plane beside the real kubelet (harness/kubelet.py), inside
the same private systemd namespace: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler as units, kubectl to apply workloads.

The binaries (1.34.9, etcd 3.6.5) are the prebuilt static ones in ``../shared/cluster/``
beside the checkout (its README.md gives their source, build and the flags used here;
``GPUGUARD_CLUSTER_DIR`` names the directory elsewhere), unpacked once into the test
cache (``$GPUGUARD_TEST_CACHE/cluster-1.34.9-<the apiserver xz's sha256, 16 hex>/``) and
checked against their recorded sha256, as harness/kubelet_versions.py does for kubelet.
Without them a test skips, and fails under ``CI=true``.

Everything is the test's own and loopback only (the namespace has only ``lo``):

* tokens: a static token file (``--token-auth-file``): ``admin`` in ``system:masters``
  (kubectl, the controller-manager, the scheduler) and ``system:node:gpunode`` in
  ``system:nodes`` (kubelet's kubeconfig; the Node authorizer and NodeRestriction then
  hold it to its own Node and pods, as on a fleet's node);
* service-account keys: an RSA key made by ``openssl genrsa`` per test;
* serving certificate: the apiserver's self-signed one in ``--cert-dir``; clients skip
  its verification (``insecure-skip-tls-verify``), the controller-manager hands it to
  pods as the root CA;
* etcd's data in the namespace's /var (the test's overlay), without fsync;
* kubelet's network: containerd's CNI configuration names a no-op plugin
  (:data:`CNI_CONF`), so the runtime reports its network ready and the Node goes
  Ready; the test's own pods are ``hostNetwork: true``; a pod that is not (deploy/'s
  installer) gets its own network namespace with only ``lo``, the no-op standing in for
  the ``loopback`` plugin that containerd 1.7 calls too, and an address
  that nothing carries (:data:`POD_PLUGIN`).

Units stop with the namespace (its poweroff), as everything else inside.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, TypeVar

from .kubelet_versions import CACHE, _sha256, unpack_xz
from .sysns import REPO, SystemdNamespace

T = TypeVar("T")
SHARED = REPO.parent / "shared" / "cluster"
DIR = Path(os.environ.get("GPUGUARD_CLUSTER_DIR", SHARED))
RELEASE = "1.34.9"
#: name -> (its xz in DIR, the unpacked binary's sha256: ../shared/cluster/README.md)
BINARIES = {
    "etcd": (
        "etcd-3.6.5-embed.xz",
        "6278059699080d03c87235442b97175307d14f39d79e5fc1e5253399c9c31670",
    ),
    "kube-apiserver": (
        "kube-apiserver-1.34.9.xz",
        "8dca422e864e51f973890950d19745f18d6997331a8c893904a24557fc9b1eb5",
    ),
    "kube-controller-manager": (
        "kube-controller-manager-1.34.9.xz",
        "365cc1f03cd9c7c43ab66f762177ae8813087e0ea1e8335145e5a62da30d93ba",
    ),
    "kube-scheduler": (
        "kube-scheduler-1.34.9.xz",
        "6d677d73a741244ce54275971a8970021788ce5fe9dbb49b8938597e8c1216f4",
    ),
    "kubectl": (
        "kubectl-1.34.9.xz",
        "27940e1d7b3db337fa2613a365732952b67324cc702c2547d46bc18586a07c03",
    ),
}
INNER = "/run/gg-cluster"  # the test's tokens, keys and kubeconfigs, read-only inside
CNI_INNER = "/run/gg-cni"  # containerd's CNI configuration and the no-op plugin
ETCD_DATA = "/var/lib/gg-etcd"
CERT_DIR = "/var/lib/gg-apiserver"
SERVER = "https://127.0.0.1:6443"
SERVER_UNITS = ("etcd.service", "kube-apiserver.service")
#: started once the apiserver is ready (each exits if it cannot reach it at its start)
CLIENT_UNITS = ("kube-controller-manager.service", "kube-scheduler.service")
CNI_CONF = {"cniVersion": "0.4.0", "name": "gg-hostnetwork", "type": "gg-noop"}
NOOP_PLUGIN = '#!/bin/sh\necho \'{"cniVersion": "0.4.0"}\'\n'
#: the network's plugin: containerd takes a pod's address from its result's eth0, and
#: refuses a sandbox without one ("failed to find network info"); nothing is made (the
#: pod has only ``lo``) and every such pod is said to have this one address.
POD_PLUGIN = (
    "#!/bin/sh\n"
    'echo \'{"cniVersion": "0.4.0", '
    '"interfaces": [{"name": "eth0", "sandbox": "\'"$CNI_NETNS"\'"}], '
    '"ips": [{"version": "4", "address": "10.88.0.2/32", "interface": 0}]}\'\n'
)
#: containerd's CRI plugin reads CNI from here (harness/kubelet.py's configuration + this)
CONTAINERD_CNI = f"""
[plugins."io.containerd.grpc.v1.cri".cni]
  bin_dir = "{CNI_INNER}/bin"
  conf_dir = "{CNI_INNER}/net.d"
"""


def require_cluster() -> Dict[str, Path]:
    """Every control-plane binary, unpacked and checked; skip (fail under CI) without."""
    from conftest import _missing, require_tool

    require_tool("openssl", "xz")
    missing = [xz for xz, _ in BINARIES.values() if not (DIR / xz).is_file()]
    if missing:
        _missing(f"no control plane at {DIR} (../shared/cluster/ beside the checkout): {missing}")
    apiserver_xz = DIR / BINARIES["kube-apiserver"][0]
    dest = CACHE / f"cluster-{RELEASE}-{_sha256(apiserver_xz)[:16]}"
    return {
        name: unpack_xz(DIR / xz, sha256, dest / name) for name, (xz, sha256) in BINARIES.items()
    }


def kubeconfig(token: str) -> str:
    """A kubeconfig (JSON) for the loopback apiserver with a bearer token."""
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "t", "cluster": {"server": SERVER, "insecure-skip-tls-verify": True}}
            ],
            "users": [{"name": "u", "user": {"token": token}}],
            "contexts": [{"name": "c", "context": {"cluster": "t", "user": "u"}}],
            "current-context": "c",
        }
    )


def _unit(what: str, argv: Sequence[str], after: str = "") -> str:
    order = f"After={after}\n" if after else ""
    return f"""[Unit]
Description={what} (the test's control plane, loopback only)
{order}[Service]
ExecStart={" ".join(argv)}
"""


@dataclass(frozen=True)
class ControlPlane:
    """The test's control plane: its files (``host_dir``, bound at INNER), binaries
    and node name."""

    host_dir: Path
    bins: Mapping[str, Path]
    node: str

    @property
    def admin_kubeconfig(self) -> str:
        return f"{INNER}/admin.kubeconfig"

    @property
    def node_kubeconfig(self) -> str:
        """kubelet's (``--kubeconfig``): the node's identity."""
        return f"{INNER}/node.kubeconfig"

    def units(self) -> Dict[str, str]:
        b, kc = self.bins, self.admin_kubeconfig
        etcd = [
            str(b["etcd"]),
            "--name t",
            f"--data-dir {ETCD_DATA}",
            "--listen-client-urls http://127.0.0.1:2379",
            "--listen-peer-urls http://127.0.0.1:2380",
            "--log-level warn",
            "--unsafe-no-fsync",
        ]
        apiserver = [
            str(b["kube-apiserver"]),
            "--etcd-servers=http://127.0.0.1:2379",
            "--bind-address=127.0.0.1",
            "--secure-port=6443",
            "--advertise-address=127.0.0.1",
            f"--cert-dir={CERT_DIR}",
            f"--token-auth-file={INNER}/tokens.csv",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            "--allow-privileged=true",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={INNER}/sa.pub",
            f"--service-account-signing-key-file={INNER}/sa.key",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--endpoint-reconciler-type=none",
            "--v=1",
        ]
        auth = [f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}"]
        auth += [f"--authorization-kubeconfig={kc}", "--bind-address=127.0.0.1"]
        auth += ["--leader-elect=false", "--v=1"]
        controllers = [
            str(b["kube-controller-manager"]),
            *auth,
            "--secure-port=10257",
            f"--service-account-private-key-file={INNER}/sa.key",
            f"--root-ca-file={CERT_DIR}/apiserver.crt",
            "--use-service-account-credentials=true",
        ]
        scheduler = [str(b["kube-scheduler"]), *auth, "--secure-port=10259"]
        return {
            "etcd.service": _unit("etcd", etcd),
            "kube-apiserver.service": _unit("kube-apiserver", apiserver, "etcd.service"),
            "kube-controller-manager.service": _unit(
                "kube-controller-manager", controllers, "kube-apiserver.service"
            ),
            "kube-scheduler.service": _unit("kube-scheduler", scheduler, "kube-apiserver.service"),
        }

    def ro_binds(self) -> Dict[str, Path]:
        bins = {str(p.parent): p.parent for p in self.bins.values()}
        return {INNER: self.host_dir, CNI_INNER: self.host_dir / "cni", **bins}


def control_plane(host_dir: Path, bins: Mapping[str, Path], node: str) -> ControlPlane:
    """Tokens, keys, kubeconfigs and the CNI files written into ``host_dir``."""
    host_dir.mkdir(parents=True, exist_ok=True)
    admin, kubelet = secrets.token_hex(16), secrets.token_hex(16)
    (host_dir / "tokens.csv").write_text(
        f'{admin},admin,admin,"system:masters"\n'
        f'{kubelet},system:node:{node},node-{node},"system:nodes"\n'
    )
    key = host_dir / "sa.key"
    subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True)
    subprocess.run(
        ["openssl", "rsa", "-in", str(key), "-pubout", "-out", str(host_dir / "sa.pub")],
        check=True,
        capture_output=True,
    )
    for p in host_dir.iterdir():
        p.chmod(0o600)
    (host_dir / "admin.kubeconfig").write_text(kubeconfig(admin))
    (host_dir / "node.kubeconfig").write_text(kubeconfig(kubelet))
    cni = host_dir / "cni"
    (cni / "net.d").mkdir(parents=True)
    (cni / "bin").mkdir()
    (cni / "net.d" / "10-gg-hostnetwork.conf").write_text(json.dumps(CNI_CONF))
    # containerd 1.7 also calls "loopback" for a pod of its own network namespace
    # (deploy/'s installer is not hostNetwork): lo is all such a pod has here.
    for name, text in ((CNI_CONF["type"], POD_PLUGIN), ("loopback", NOOP_PLUGIN)):
        plugin = cni / "bin" / name
        plugin.write_text(text)
        plugin.chmod(0o755)
    return ControlPlane(host_dir, dict(bins), node)


@dataclass(frozen=True)
class ApiPod:
    """A pod as the API server has it (``kubectl get pods -o json``)."""

    name: str
    uid: str
    phase: str
    reason: str
    message: str
    node: str
    owner: str  # "ReplicaSet/web-5d9f" ("" for a bare pod)
    labels: Mapping[str, str]
    deleting: bool  # metadata.deletionTimestamp set
    containers: Mapping[str, Mapping[str, Any]]  # name -> containerStatus
    conditions: Mapping[str, Mapping[str, Any]]  # type -> condition

    @property
    def running(self) -> bool:
        return (
            self.phase == "Running"
            and bool(self.containers)
            and all("running" in c.get("state", {}) for c in self.containers.values())
        )

    def container_ids(self) -> List[str]:
        """Its containers' runtime IDs as the API has them ("containerd://...")."""
        return sorted(str(c.get("containerID", "")) for c in self.containers.values())

    def messages(self) -> str:
        """The pod's own and its containers' reasons and messages, joined."""
        out = [f"{self.reason}: {self.message}"]
        for c in self.containers.values():
            for state in (c.get("state", {}), c.get("lastState", {})):
                for v in state.values():
                    out.append(f"{v.get('reason', '')}: {v.get('message', '')}")
        return "\n".join(out)


def api_pod(item: Mapping[str, Any]) -> ApiPod:
    meta, spec, status = item["metadata"], item.get("spec", {}), item.get("status", {})
    owners = meta.get("ownerReferences") or []
    return ApiPod(
        meta["name"],
        meta["uid"],
        status.get("phase", ""),
        status.get("reason", ""),
        status.get("message", ""),
        spec.get("nodeName", ""),
        f"{owners[0]['kind']}/{owners[0]['name']}" if owners else "",
        dict(meta.get("labels") or {}),
        "deletionTimestamp" in meta,
        {c["name"]: c for c in status.get("containerStatuses") or []},
        {c["type"]: c for c in status.get("conditions") or []},
    )


def show_api(pods: Sequence[ApiPod]) -> str:
    return "; ".join(
        f"{p.name}({p.uid[:8]}) {p.phase} on {p.node or '-'}"
        + (" deleting" if p.deleting else "")
        + f" [{p.messages().strip()}]"
        for p in pods
    )


class Cluster:
    """Drives the control plane inside ``ns``: started, waited for, kubectl."""

    def __init__(self, ns: SystemdNamespace, cp: ControlPlane) -> None:
        self.ns = ns
        self.cp = cp

    def start(self, timeout: float = 90) -> None:
        """etcd, the apiserver (until /readyz) and the controllers; the default
        ServiceAccount made (pods need it)."""
        for unit in SERVER_UNITS:
            self.ns.systemctl("start", "--no-block", unit)
        self.wait(
            lambda: self.kubectl("get", "--raw", "/readyz", check=False) == "ok",
            timeout,
            "apiserver ready",
        )
        for unit in CLIENT_UNITS:
            self.ns.systemctl("start", "--no-block", unit)
        for unit in (*SERVER_UNITS, *CLIENT_UNITS):
            self.ns.wait_active(unit, timeout=timeout)
        self.wait(
            lambda: self.kubectl("get", "serviceaccount", "default", "-o", "name", check=False),
            timeout,
            "the default ServiceAccount",
        )

    def kubectl(self, *args: str, input: Optional[str] = None, check: bool = True) -> str:
        argv = [str(self.cp.bins["kubectl"]), f"--kubeconfig={self.cp.admin_kubeconfig}", *args]
        res = self.ns.run(argv, input=input, timeout=60)
        if check and res.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {res.stderr.strip() or res.stdout}")
        return res.stdout.strip() if res.returncode == 0 else ""

    def apply(self, *objects: Mapping[str, Any]) -> None:
        self.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}),
        )

    def get(self, kind: str, name: str = "", namespace: str = "default") -> Dict[str, Any]:
        args = ["get", kind, *([name] if name else []), "-n", namespace, "-o", "json"]
        return dict(json.loads(self.kubectl(*args)))

    def pods(self, namespace: str = "default") -> List[ApiPod]:
        return [api_pod(i) for i in self.get("pods", namespace=namespace)["items"]]

    def node(self, name: str) -> Dict[str, Any]:
        out = self.kubectl("get", "node", name, "-o", "json", check=False)
        return dict(json.loads(out)) if out else {}

    def node_ready(self, name: str) -> bool:
        conds = self.node(name).get("status", {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    def allocatable(self, name: str, resource: str = "nvidia.com/gpu") -> int:
        return int(self.node(name).get("status", {}).get("allocatable", {}).get(resource, 0))

    def wait_pods(
        self, cond: Callable[[List[ApiPod]], bool], timeout: float, what: str
    ) -> List[ApiPod]:
        """Poll the API's pods until ``cond(pods)`` holds."""
        deadline = time.monotonic() + timeout
        pods: List[ApiPod] = []
        while time.monotonic() < deadline:
            pods = self.pods()
            if cond(pods):
                return pods
            time.sleep(0.5)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}: {show_api(pods)}")

    @staticmethod
    def wait(cond: Callable[[], T], timeout: float, what: str) -> T:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = cond()
            if got:
                return got
            time.sleep(0.5)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")

    def log(self, unit: str, lines: int = 30) -> str:
        argv = ["journalctl", "--no-pager", "-o", "cat", "-u", unit, "-n", str(lines)]
        return self.ns.run(argv).stdout
