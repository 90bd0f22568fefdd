"""A small read-only client of the Kubernetes API server, with kubelet's own credentials.

The re-admission bridge asks the API server one question at a node's boot: which pods
are bound to this node now (readmit/apipods.py). It reads kubelet's kubeconfig
(``[Kubelet] Kubeconfig=``: its current context's cluster and user) through the
bounded reader, and speaks HTTPS with the standard library only (http.client and
ssl): the cluster's certificate authority (``certificate-authority`` or its
``-data``), or no verification where the kubeconfig says ``insecure-skip-tls-verify``;
a client certificate and key (files, or ``-data`` handed to ssl through a memfd, never
a file on disk), or a bearer token (``token`` or ``tokenFile``). Every call has a
deadline for the whole answer and a bounded answer size; every answer becomes typed,
frozen rows (ApiPod), never a dict crossing modules.

The node's name is the identity the API server sees (``system:node:NAME`` from a
SelfSubjectReview, API servers 1.28 and later), else ``[Kubelet] NodeName=``, else
the host name in lowercase (kubelet's default without ``--hostname-override``).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import os
import socket
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

from gpuguard.errors import BadInputError
from gpuguard.host.echo import cut
from gpuguard.host.paths import Root
from gpuguard.host.safeio import decode_utf8, read_bytes
from gpuguard.host.structconf import Refusal, yaml_documents

if TYPE_CHECKING:  # ssl and http.client are loaded by the bridge's calls only: the
    import ssl  # daemon imports readmit/ (its state file) and never loads ssl

MAX_KUBECONFIG = 1 << 20  # bytes: a kubeconfig with embedded certificates is a few KiB
MAX_CREDENTIAL = 256 << 10  # bytes: a certificate, key or token file
MAX_ANSWER = 32 << 20  # bytes: a node's pods (110 by default, 250 at most) fit in far less
TIMEOUT = 2.0  # seconds for a whole call: connect, TLS, request, answer
MIRROR = "kubernetes.io/config.mirror"  # a mirror pod's annotation: its static pod's UID
NODE_USER = "system:node:"
IDENTITY = "the API server's identity"  # node_name()'s ``how`` when the server said it


class KubeApiError(Exception):
    """A call did not give an answer: one line, with the HTTP status (0: none)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class KubeConfig:
    """What a call needs from a kubeconfig's current context."""

    path: str  # the kubeconfig, for messages
    server: str  # https://host:port[/prefix]
    insecure: bool = False  # insecure-skip-tls-verify
    ca_file: Optional[str] = None
    ca_data: Optional[str] = None  # PEM
    cert_file: Optional[str] = None
    cert_data: Optional[bytes] = None  # PEM
    key_file: Optional[str] = None
    key_data: Optional[bytes] = None  # PEM
    token: str = ""  # a bearer token ("" none)
    token_file: Optional[str] = None


@dataclass(frozen=True)
class OwnerRef:
    kind: str
    name: str
    uid: str
    controller: bool = False  # the pod's managing controller (at most one per pod)


@dataclass(frozen=True)
class ApiPod:
    """One pod the API server holds, as the bridge needs it."""

    uid: str
    namespace: str
    name: str
    phase: str  # Pending, Running, Succeeded, Failed, Unknown ("" when not set)
    deleting: bool  # metadata.deletionTimestamp is set
    owners: tuple[OwnerRef, ...]
    mirror_of: str  # a mirror pod's kubernetes.io/config.mirror: its static pod's UID
    created: str  # metadata.creationTimestamp (RFC 3339, as the API server wrote it)

    @property
    def pod(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def terminal(self) -> bool:
        """Succeeded or Failed: kubelet never runs it again."""
        return self.phase in ("Succeeded", "Failed")


def _bad(path: str, what: str) -> BadInputError:
    return BadInputError(
        f"{path}: {what} — check kubelet's kubeconfig, or set [Kubelet] Kubeconfig= "
        "(see gpuguard.conf(5))"
    )


def _items(doc: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """The mappings of list ``key`` (anything else: none)."""
    v = doc.get(key)
    return [i for i in v if isinstance(i, dict)] if isinstance(v, list) else []


def _named(doc: dict[str, Any], key: str, name: str) -> Optional[dict[str, Any]]:
    """The ``contexts``/``clusters``/``users`` item called ``name``: its inner mapping."""
    inner = {"contexts": "context", "clusters": "cluster", "users": "user"}[key]
    for item in _items(doc, key):
        if item.get("name") == name:
            found = item.get(inner)
            return found if isinstance(found, dict) else None
    return None


def _text(d: dict[str, Any], key: str, path: str) -> Optional[str]:
    v = d.get(key)
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise _bad(path, f"{key} is not a string")
    return v


def _b64(d: dict[str, Any], key: str, path: str) -> Optional[bytes]:
    v = _text(d, key, path)
    if v is None:
        return None
    try:
        return base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(path, f"{key} is not base64") from None


def _file(base: Path, v: Optional[str]) -> Optional[str]:
    """A path of the kubeconfig, relative ones to its own directory (as kubectl does)."""
    if v is None:
        return None
    return v if v.startswith("/") else str(base / v)


def parse_kubeconfig(text: str, path: str) -> KubeConfig:
    """The current context's cluster and user of kubeconfig ``text`` (read from
    ``path``, its relative paths taken from there). BadInputError on what it lacks."""
    docs = yaml_documents(text)
    if isinstance(docs, Refusal):
        raise _bad(path, f"not readable YAML ({docs.why})")
    doc = docs[0] if docs else None
    if not isinstance(doc, dict):
        raise _bad(path, "is not a kubeconfig (no mapping)")
    current = doc.get("current-context")
    contexts = _items(doc, "contexts")
    if not current and len(contexts) == 1:
        current = contexts[0].get("name")
    if not isinstance(current, str) or not current:
        raise _bad(path, "has no current-context")
    ctx = _named(doc, "contexts", current)
    if ctx is None:
        raise _bad(path, f"has no context {cut(current)!r}")
    cluster = _named(doc, "clusters", str(ctx.get("cluster", "")))
    if cluster is None:
        raise _bad(path, f"context {cut(current)!r} names no cluster it has")
    user = _named(doc, "users", str(ctx.get("user", ""))) or {}
    server = _text(cluster, "server", path)
    if server is None:
        raise _bad(path, "its cluster has no server")
    parts = urllib.parse.urlsplit(server)
    if parts.scheme != "https" or not parts.hostname:
        raise _bad(path, f"server {cut(server)!r} is not an https:// URL")
    base = Path(path).parent
    ca_data = _b64(cluster, "certificate-authority-data", path)
    cfg = KubeConfig(
        path=path,
        server=server.rstrip("/"),
        insecure=cluster.get("insecure-skip-tls-verify") is True,
        ca_file=_file(base, _text(cluster, "certificate-authority", path)),
        ca_data=ca_data.decode("ascii", "replace") if ca_data else None,
        cert_file=_file(base, _text(user, "client-certificate", path)),
        cert_data=_b64(user, "client-certificate-data", path),
        key_file=_file(base, _text(user, "client-key", path)),
        key_data=_b64(user, "client-key-data", path),
        token=_text(user, "token", path) or "",
        token_file=_file(base, _text(user, "tokenFile", path)),
    )
    has_cert = cfg.cert_file is not None or cfg.cert_data is not None
    has_key = cfg.key_file is not None or cfg.key_data is not None
    if has_cert != has_key:
        raise _bad(path, "its user has a client certificate without its key, or a key alone")
    if not has_cert and not cfg.token and cfg.token_file is None:
        raise _bad(path, "its user has no client certificate and no token")
    return cfg


def load_kubeconfig(path: Path, shown: str) -> KubeConfig:
    """The kubeconfig at ``path`` (``shown`` in messages), owned by root (this process's
    user) and written by no one else. BadInputError as the bounded reader gives it (its
    errno is ENOENT when the file does not exist)."""
    data, st = read_bytes(path, what="kubeconfig", max_bytes=MAX_KUBECONFIG, follow=True)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        # it names the server whose word leaves pods out: only its owner's (root's)
        raise _bad(shown, "is not owned by root, or others may write it; refusing to use it")
    return parse_kubeconfig(decode_utf8(data, Path(shown), "kubeconfig"), shown)


@contextlib.contextmanager
def _pem_path(data: bytes) -> Iterator[str]:
    """A path ssl can load ``data`` from: a memfd (never on disk), else a private
    temporary file removed at once."""
    try:
        fd = os.memfd_create("gpuguard-kubeconfig", getattr(os, "MFD_CLOEXEC", 1))
    except (AttributeError, OSError):
        fd, name = tempfile.mkstemp(prefix=".gpuguard-kube-")  # mode 0600
        try:
            os.write(fd, data)
            os.close(fd)
            yield name
        finally:
            os.unlink(name)
        return
    try:
        os.write(fd, data)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def _credential(path: str, what: str, root: Optional[Root]) -> bytes:
    where = root.path(path) if root is not None else Path(path)
    data, _st = read_bytes(where, what=what, max_bytes=MAX_CREDENTIAL, follow=True)
    return data


def tls_context(cfg: KubeConfig, root: Optional[Root] = None) -> ssl.SSLContext:
    """The TLS context the kubeconfig describes. BadInputError on unreadable files,
    ssl.SSLError on certificates or keys ssl refuses."""
    import ssl

    if cfg.insecure:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif cfg.ca_data is not None:
        ctx = ssl.create_default_context(cadata=cfg.ca_data)
    elif cfg.ca_file is not None:
        ca = _credential(cfg.ca_file, "certificate authority", root).decode("ascii", "replace")
        ctx = ssl.create_default_context(cadata=ca)
    else:
        ctx = ssl.create_default_context()  # the system's authorities
    cert = cfg.cert_data
    if cert is None and cfg.cert_file is not None:
        cert = _credential(cfg.cert_file, "client certificate", root)
    key = cfg.key_data
    if key is None and cfg.key_file is not None:
        key = (
            cert if cfg.key_file == cfg.cert_file else _credential(cfg.key_file, "client key", root)
        )
    if cert is not None and key is not None:
        with _pem_path(cert) as c, _pem_path(key) as k:
            ctx.load_cert_chain(c, k)
    return ctx


def bearer(cfg: KubeConfig, root: Optional[Root] = None) -> str:
    """The bearer token ("" none): ``token``, else ``tokenFile``'s first line."""
    if cfg.token:
        return cfg.token
    if cfg.token_file is None:
        return ""
    text = _credential(cfg.token_file, "token", root).decode("utf-8", "replace")
    return text.strip().splitlines()[0] if text.strip() else ""


class Client:
    """Read-only calls on one API server, each on a new connection, each bounded by
    ``timeout`` for the whole answer and MAX_ANSWER bytes."""

    def __init__(
        self, cfg: KubeConfig, timeout: float = TIMEOUT, root: Optional[Root] = None
    ) -> None:
        self.cfg = cfg
        self.timeout = timeout
        self.ctx = tls_context(cfg, root)  # the files it names, under ``root``'s prefix
        self.token = bearer(cfg, root)
        parts = urllib.parse.urlsplit(cfg.server)
        self.host = parts.hostname or ""
        self.port = parts.port or 443
        self.prefix = parts.path.rstrip("/")

    def call(self, method: str, path: str, body: Optional[dict[str, Any]] = None) -> Any:
        """The JSON answer to ``method path``. KubeApiError when there is none."""
        import http.client

        deadline = time.monotonic() + self.timeout
        shown = f"{method} {path.split('?')[0]}"
        headers = {"Accept": "application/json", "User-Agent": "gpuguard-readmit"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        conn = http.client.HTTPSConnection(
            self.host, self.port, context=self.ctx, timeout=self.timeout
        )
        try:
            conn.request(method, self.prefix + path, payload, headers)
            resp = conn.getresponse()
            chunks: list[bytes] = []
            size = 0
            while True:
                if time.monotonic() > deadline:
                    raise KubeApiError(f"{shown}: no whole answer within {self.timeout:g} s")
                chunk = resp.read1(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > MAX_ANSWER:
                    raise KubeApiError(f"{shown}: answer over {MAX_ANSWER} bytes")
                chunks.append(chunk)
            status = resp.status
        except (OSError, http.client.HTTPException) as e:
            why = "timed out" if isinstance(e, socket.timeout) else cut(str(e) or type(e).__name__)
            raise KubeApiError(f"{shown} on {cut(self.cfg.server)}: {why}") from None
        finally:
            conn.close()
        data = b"".join(chunks)
        try:
            answer = json.loads(data) if data else None
        except ValueError:
            answer = None
        if not 200 <= status < 300:
            said = answer.get("message") if isinstance(answer, dict) else ""
            said = f": {cut(said, 200)}" if isinstance(said, str) and said else ""
            raise KubeApiError(f"{shown}: HTTP {status}{said}", status)
        if answer is None:
            raise KubeApiError(f"{shown}: the answer is not JSON")
        return answer

    def user(self) -> str:
        """The user name the API server sees (a SelfSubjectReview, API server 1.28+)."""
        review = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
        answer = self.call("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews", review)
        name = _get(answer, "status", "userInfo", "username")
        if not isinstance(name, str):
            raise KubeApiError("POST selfsubjectreviews: the answer names no user")
        return name

    def node_exists(self, node: str) -> bool:
        """Whether the API server has a Node ``node`` (a node may read its own).
        KubeApiError on any answer but the Node or 404."""
        try:
            self.call("GET", f"/api/v1/nodes/{urllib.parse.quote(node, safe='')}")
        except KubeApiError as e:
            if e.status == 404:
                return False
            raise
        return True

    def node_pods(self, node: str) -> tuple[ApiPod, ...]:
        """The pods bound to ``node``, every namespace."""
        query = urllib.parse.urlencode({"fieldSelector": f"spec.nodeName={node}"})
        answer = self.call("GET", f"/api/v1/pods?{query}")
        return parse_pods(answer)


def _get(v: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(v, dict):
            return None
        v = v.get(k)
    return v


def _s(v: Any, limit: int = 253) -> str:
    return v[:limit] if isinstance(v, str) else ""


def parse_pods(answer: Any) -> tuple[ApiPod, ...]:
    """A PodList's items as rows (items that are not pods with a UID are skipped).
    KubeApiError when ``answer`` is not a PodList."""
    if _get(answer, "kind") != "PodList" or not isinstance(_get(answer, "items"), list):
        raise KubeApiError("GET pods: the answer is not a PodList")
    rows = []
    for item in answer["items"]:
        meta = _get(item, "metadata")
        uid = _s(_get(meta, "uid"), 64)
        if not uid:
            continue
        refs = _get(meta, "ownerReferences")
        owners = tuple(
            OwnerRef(
                _s(_get(o, "kind"), 64),
                _s(_get(o, "name")),
                _s(_get(o, "uid"), 64),
                _get(o, "controller") is True,
            )
            for o in (refs if isinstance(refs, list) else [])[:16]
            if isinstance(o, dict)
        )
        rows.append(
            ApiPod(
                uid=uid,
                namespace=_s(_get(meta, "namespace"), 63),
                name=_s(_get(meta, "name")),
                phase=_s(_get(item, "status", "phase"), 32),
                deleting=_get(meta, "deletionTimestamp") is not None,
                owners=owners,
                mirror_of=_s(_get(meta, "annotations", MIRROR), 64),
                created=_s(_get(meta, "creationTimestamp"), 64),
            )
        )
    return tuple(rows)


def node_name(client: Client, configured: Optional[str]) -> tuple[str, str]:
    """This node's name and where it came from: the API server's ``system:node:NAME``
    for the client's credentials, else ``configured``, else the host name."""
    why = ""
    try:
        user = client.user()
        if user.startswith(NODE_USER) and len(user) > len(NODE_USER):
            return user[len(NODE_USER) :], IDENTITY
        why = f"user {cut(user)!r} is not a node's"
    except KubeApiError as e:
        why = str(e)
    if configured:
        return configured, f"[Kubelet] NodeName= ({why})"
    return socket.gethostname().lower(), f"the host name ({why})"
