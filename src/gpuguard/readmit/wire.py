"""The few deviceplugin v1beta1 messages the bridge sends, in protobuf's wire format.

Four messages, strings and one nested message only, so the encoder is a few lines
instead of a dependency on python3-protobuf and code generated from kubelet's
``api.proto`` (pkg/kubelet/apis/deviceplugin/v1beta1). Field numbers are the proto's.
What kubelet sends the bridge (``Empty``, ``ListAndWatch``'s request) is never read.
"""

from __future__ import annotations

from typing import Iterable

API_VERSION = "v1beta1"
HEALTHY = "Healthy"
REGISTER = "/v1beta1.Registration/Register"
SERVICE = "v1beta1.DevicePlugin"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2: strings and messages)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _text(number: int, value: str) -> bytes:
    return _field(number, value.encode()) if value else b""


def register_request(resource: str, endpoint: str) -> bytes:
    """RegisterRequest{version, endpoint, resource_name, options: {}} (no
    pre-start call, no preferred allocation: the bridge allocates nothing)."""
    return _text(1, API_VERSION) + _text(2, endpoint) + _text(3, resource) + _field(4, b"")


def device_plugin_options() -> bytes:
    """DevicePluginOptions{} (every option false)."""
    return b""


def list_and_watch_response(ids: Iterable[str]) -> bytes:
    """ListAndWatchResponse{devices: [Device{ID, health: Healthy}, ...]}."""
    return b"".join(_field(1, _text(1, i) + _text(2, HEALTHY)) for i in ids)


def decode_strings(data: bytes) -> dict[int, list[bytes]]:
    """Field number -> its length-delimited values (tests read messages back with it;
    varint fields are skipped). ValueError on a truncated or unknown wire type."""
    out: dict[int, list[bytes]] = {}
    i = 0

    def varint() -> int:
        nonlocal i
        shift = value = 0
        while True:
            if i >= len(data) or shift > 63:
                raise ValueError("truncated varint")
            b = data[i]
            i += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value

    while i < len(data):
        key = varint()
        kind = key & 7
        if kind == 0:
            varint()
        elif kind == 2:
            n = varint()
            if i + n > len(data):
                raise ValueError("truncated field")
            out.setdefault(key >> 3, []).append(data[i : i + n])
            i += n
        else:
            raise ValueError(f"wire type {kind}")
    return out
