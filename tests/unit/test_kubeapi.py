"""host/kubeapi.py against a local HTTPS server: kubelet's kubeconfig read as kubelet
writes it (certificate files, or -data; a token, a tokenFile; insecure-skip-tls-verify),
the node's name from the identity, the node's pods as typed rows, and the bounds (the
answer's size, its deadline, an HTTP error)."""

from __future__ import annotations

import base64
import json
import shutil
import ssl
import subprocess
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

from gpuguard.errors import BadInputError
from gpuguard.host import kubeapi
from gpuguard.host.kubeapi import Client, KubeApiError, load_kubeconfig, node_name, parse_kubeconfig

NODE = "gpu-node-1"


def pod(uid: str, name: str, **kw: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "uid": uid,
        "namespace": kw.get("ns", "default"),
        "name": name,
        "creationTimestamp": "2026-11-28T12:00:00Z",
    }
    if "owner" in kw:
        meta["ownerReferences"] = [{"kind": "ReplicaSet", "name": kw["owner"], "uid": "rs-1"}]
    if "mirror" in kw:
        meta["annotations"] = {kubeapi.MIRROR: kw["mirror"]}
    if kw.get("deleting"):
        meta["deletionTimestamp"] = "2026-11-28T12:05:00Z"
    return {"metadata": meta, "status": {"phase": kw.get("phase", "Running")}}


@dataclass
class Server:
    url: str
    dir: Path
    pods: list[dict[str, Any]]
    seen: list[tuple[str, str, str, bool]] = field(default_factory=list)  # method, path, auth, cert
    user: str = f"system:node:{NODE}"
    status: int = 200
    pad: int = 0  # bytes of padding in the pods answer
    delay: float = 0.0


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _cert(d: Path, name: str, san: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.crt"), "-days", "2",
        "-subj", f"/CN={name}", "-addext", f"subjectAltName={san}",
    )  # fmt: skip


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make the test's certificates")
    d = tmp_path_factory.mktemp("kubeapi")
    _cert(d, "server", "IP:127.0.0.1")
    _cert(d, "client", "DNS:client")
    srv = Server("", d, [])

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_a: Any) -> None:
            pass

        def _answer(self, code: int, body: Any, pad: int = 0) -> None:
            data = json.dumps(body).encode() + b" " * pad
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _seen(self) -> None:
            cert = bool(self.connection.getpeercert())  # type: ignore[attr-defined]
            auth = self.headers.get("Authorization", "")
            srv.seen.append((self.command, self.path, auth, cert))

        def do_POST(self) -> None:
            self._seen()
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.path != "/apis/authentication.k8s.io/v1/selfsubjectreviews":
                return self._answer(404, {"kind": "Status", "message": "not found"})
            review = {"kind": "SelfSubjectReview", "status": {"userInfo": {"username": srv.user}}}
            self._answer(201, review)

        def do_GET(self) -> None:
            self._seen()
            if srv.delay:
                time.sleep(srv.delay)
            if self.path.startswith("/api/v1/nodes/"):
                found = self.path == f"/api/v1/nodes/{NODE}"
                return self._answer(200 if found else 404, {"kind": "Node" if found else "Status"})
            if srv.status != 200:
                return self._answer(srv.status, {"kind": "Status", "message": "pods is forbidden"})
            q = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
            node = q.get("fieldSelector", [""])[0].removeprefix("spec.nodeName=")
            items = srv.pods if node == NODE else []
            self._answer(200, {"kind": "PodList", "items": items}, srv.pad)

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(d / "server.crt", d / "server.key")
    ctx.load_verify_locations(d / "client.crt")
    ctx.verify_mode = ssl.CERT_OPTIONAL  # a token client sends none

    class Quiet(ThreadingHTTPServer):
        def handle_error(self, *_a: Any) -> None:  # a client that gave up (the deadline)
            pass

    httpd = Quiet(("127.0.0.1", 0), Handler)
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    srv.url = f"https://127.0.0.1:{httpd.server_address[1]}"
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        httpd.shutdown()
        httpd.server_close()


def kubeconfig(path: Path, cluster: dict[str, Any], user: dict[str, Any]) -> Path:
    import yaml  # type: ignore[import-untyped,unused-ignore]

    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "default-cluster", "cluster": cluster}],
        "contexts": [
            {"name": "other", "context": {"cluster": "nowhere", "user": "nobody"}},
            {"name": "default-context", "context": {"cluster": "default-cluster", "user": "u"}},
        ],
        "current-context": "default-context",
        "users": [{"name": "u", "user": user}],
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def b64(p: Path) -> str:
    return base64.b64encode(p.read_bytes()).decode()


def test_kubelets_kubeconfig_with_certificate_files_lists_the_nodes_pods(
    api: Server, tmp_path: Path
) -> None:
    """kubelet.conf as kubeadm writes it: the CA inline, the client certificate and key
    in one file (/var/lib/kubelet/pki/kubelet-client-current.pem)."""
    pem = tmp_path / "kubelet-client-current.pem"
    pem.write_bytes((api.dir / "client.crt").read_bytes() + (api.dir / "client.key").read_bytes())
    kc = kubeconfig(
        tmp_path / "kubelet.conf",
        {"server": api.url, "certificate-authority-data": b64(api.dir / "server.crt")},
        {"client-certificate": str(pem), "client-key": str(pem)},
    )
    api.pods[:] = [
        pod("uid-a", "train-a", owner="train-7d9"),
        pod("uid-m", "gpu-static-node", ns="kube-system", mirror="static-uid"),
        pod("uid-d", "old", deleting=True, phase="Failed"),
        {"metadata": {"name": "no-uid"}},  # skipped
    ]
    client = Client(load_kubeconfig(kc, "/etc/kubernetes/kubelet.conf"))
    name, how = node_name(client, None)
    assert (name, how) == (NODE, "the API server's identity")
    rows = client.node_pods(name)
    assert [r.uid for r in rows] == ["uid-a", "uid-m", "uid-d"]
    a, m, d = rows
    assert a.pod == "default/train-a" and a.owners[0].kind == "ReplicaSet" and not a.terminal
    assert a.created == "2026-11-28T12:00:00Z"
    assert m.mirror_of == "static-uid" and m.namespace == "kube-system"
    assert d.deleting and d.terminal
    method, path, auth, cert = api.seen[-1]
    assert method == "GET" and auth == "" and cert  # the client certificate was presented
    assert urllib.parse.unquote(path).endswith(f"fieldSelector=spec.nodeName={NODE}")


def test_inline_certificate_data_a_relative_ca_file_and_tokens(api: Server, tmp_path: Path) -> None:
    (tmp_path / "pki").mkdir()
    shutil.copy(api.dir / "server.crt", tmp_path / "pki/ca.crt")
    kc = kubeconfig(
        tmp_path / "kubelet.conf",
        {"server": api.url, "certificate-authority": "pki/ca.crt"},  # relative: its directory
        {
            "client-certificate-data": b64(api.dir / "client.crt"),
            "client-key-data": b64(api.dir / "client.key"),
        },
    )
    Client(load_kubeconfig(kc, str(kc))).node_pods(NODE)
    assert api.seen[-1][3], "no client certificate from -data"
    token = tmp_path / "token"
    token.write_text("s3cr3t\n")
    kc = kubeconfig(
        tmp_path / "token.conf",
        {"server": api.url, "insecure-skip-tls-verify": True},
        {"tokenFile": str(token)},
    )
    Client(load_kubeconfig(kc, str(kc))).node_pods(NODE)
    assert api.seen[-1][2:] == ("Bearer s3cr3t", False)


def test_a_server_it_cannot_verify_is_refused(api: Server, tmp_path: Path) -> None:
    kc = kubeconfig(
        tmp_path / "kubelet.conf",
        {"server": api.url, "certificate-authority-data": b64(api.dir / "client.crt")},
        {"token": "t"},
    )
    with pytest.raises(KubeApiError, match="CERTIFICATE_VERIFY_FAILED"):
        Client(load_kubeconfig(kc, str(kc))).node_pods(NODE)


def test_bounds_and_errors(api: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    insecure = {"server": api.url, "insecure-skip-tls-verify": True}
    kc = kubeconfig(tmp_path / "k.conf", insecure, {"token": "t"})
    client = Client(load_kubeconfig(kc, str(kc)), timeout=0.5)
    api.user = "system:serviceaccount:kube-system:x"  # not a node: the configured name
    assert node_name(client, "cfg-node")[0] == "cfg-node"
    api.user = f"system:node:{NODE}"
    try:
        api.status = 403
        with pytest.raises(KubeApiError, match="HTTP 403: pods is forbidden") as e:
            client.node_pods(NODE)
        assert e.value.status == 403
        api.status = 200
        api.pad = 4096
        monkeypatch.setattr(kubeapi, "MAX_ANSWER", 2048)
        with pytest.raises(KubeApiError, match="answer over 2048 bytes"):
            client.node_pods(NODE)
        api.pad = 0
        api.delay = 1.5
        with pytest.raises(KubeApiError, match=r"timed out|within"):
            client.node_pods(NODE)
    finally:
        api.status, api.pad, api.delay = 200, 0, 0.0


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "no mapping"),
        ("current-context: x\n", "no context 'x'"),
        (
            "current-context: c\ncontexts: [{name: c, context: {cluster: k, user: u}}]\n"
            "clusters: [{name: k, cluster: {server: 'http://10.0.0.1:6443'}}]\n"
            "users: [{name: u, user: {token: t}}]\n",
            "not an https:// URL",
        ),
        (
            "current-context: c\ncontexts: [{name: c, context: {cluster: k, user: u}}]\n"
            "clusters: [{name: k, cluster: {server: 'https://10.0.0.1:6443'}}]\n"
            "users: [{name: u, user: {client-certificate: /x.pem}}]\n",
            "without its key",
        ),
        (
            "current-context: c\ncontexts: [{name: c, context: {cluster: k, user: u}}]\n"
            "clusters: [{name: k, cluster: {server: 'https://h', certificate-authority-data: "
            "'%%%'}}]\nusers: [{name: u, user: {token: t}}]\n",
            "not base64",
        ),
    ],
)
def test_a_kubeconfig_it_cannot_use_is_one_line_with_the_path(text: str, why: str) -> None:
    with pytest.raises(BadInputError) as e:
        parse_kubeconfig(text, "/etc/kubernetes/kubelet.conf")
    assert why in e.value.message and e.value.message.startswith("/etc/kubernetes/kubelet.conf:")
    assert "\n" not in e.value.message


def test_the_bridges_reader_standalone_read_and_a_wrong_node_name(
    api: Server, tmp_path: Path
) -> None:
    """readmit/apipods.py's one read: no kubeconfig is a kubelet without an API server;
    a node name not from the identity must be a Node (a wrong one would list no pod,
    and every pod would be taken as deleted)."""
    from gpuguard.config import load_config
    from gpuguard.host.paths import Root
    from gpuguard.readmit.apipods import Reader
    from gpuguard.readmit.plan import READ, STANDALONE, UNREAD

    root = Root(tmp_path)
    (tmp_path / "etc/gpuguard").mkdir(parents=True)
    conf = tmp_path / "etc/gpuguard/gpuguard.conf"
    conf.write_text("")
    read = Reader(root, lambda: load_config(root))
    view = read()
    assert view.source == STANDALONE and "/etc/kubernetes/kubelet.conf" in view.detail
    (tmp_path / "etc/kubernetes").mkdir()
    insecure = {"server": api.url, "insecure-skip-tls-verify": True}
    # the files it names are read under the root prefix too
    (tmp_path / "etc/kubernetes/token").write_text("t-under-root\n")
    user = {"tokenFile": "/etc/kubernetes/token"}
    kubeconfig(tmp_path / "etc/kubernetes/kubelet.conf", insecure, user)
    api.pods[:] = [pod("uid-a", "a")]
    view = read()
    assert (view.source, view.node, [p.uid for p in view.pods]) == (READ, NODE, ["uid-a"])
    assert api.seen[-1][2] == "Bearer t-under-root"
    api.user = "system:serviceaccount:x:y"
    try:
        conf.write_text("[Kubelet]\nNodeName=not-this-node\n")
        read = Reader(root, lambda: load_config(root))
        view = read()
        assert view.source == UNREAD and "no Node 'not-this-node'" in view.detail
        conf.write_text(f"[Kubelet]\nNodeName={NODE}\n")
        assert read().source == READ
    finally:
        api.user = f"system:node:{NODE}"


def test_a_kubeconfig_others_may_write_is_refused(tmp_path: Path) -> None:
    kc = tmp_path / "kubelet.conf"
    kc.write_text("current-context: c\n")
    kc.chmod(0o666)
    with pytest.raises(BadInputError, match="others may write it"):
        load_kubeconfig(kc, "/etc/kubernetes/kubelet.conf")
