"""The few deviceplugin v1beta1 messages the bridge sends, in protobuf's wire format.

Four messages, strings and one nested message only (and the device IDs of an
AllocateRequest read back, for the journal), encoded with host/protowire.py
instead of python3-protobuf and code generated from kubelet's ``api.proto``
(pkg/kubelet/apis/deviceplugin/v1beta1). Field numbers are the proto's.
What kubelet sends the bridge (``Empty``, ``ListAndWatch``'s request) is never read,
but for an ``AllocateRequest``'s device IDs, journaled.
"""

from __future__ import annotations

from typing import Iterable

from gpuguard.host.protowire import field, fields, text

API_VERSION = "v1beta1"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
REGISTER = "/v1beta1.Registration/Register"
SERVICE = "v1beta1.DevicePlugin"


def register_request(resource: str, endpoint: str) -> bytes:
    """RegisterRequest{version, endpoint, resource_name, options: {}} (no
    pre-start call, no preferred allocation: the bridge allocates nothing)."""
    return text(1, API_VERSION) + text(2, endpoint) + text(3, resource) + field(4, b"")


def device_plugin_options() -> bytes:
    """DevicePluginOptions{} (every option false)."""
    return b""


def list_and_watch_response(ids: Iterable[str], health: str = HEALTHY) -> bytes:
    """ListAndWatchResponse{devices: [Device{ID, health}, ...]} (Healthy or Unhealthy)."""
    return b"".join(field(1, text(1, i) + text(2, health)) for i in ids)


def allocate_request_ids(data: bytes) -> tuple[str, ...]:
    """The device IDs of an AllocateRequest{container_requests: [{devices_ids}]}, for
    the journal (bounded; ValueError on what is not one)."""
    ids: list[str] = []
    for req in fields(data).get(1, [])[:64]:
        ids.extend(i.decode("utf-8", "replace")[:256] for i in fields(req).get(1, [])[:64])
    return tuple(ids)
