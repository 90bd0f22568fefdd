"""A failed gRPC call of the bridge, said in one line: grpcio's RpcError carries its
status (``e.code()``, a grpc.StatusCode) and the server's message (``e.details()``);
its ``str()`` is a multi-line dump whose first line ("<_InactiveRpcError of RPC that
terminated with:") says nothing. Any other exception: its first line."""

from __future__ import annotations

from gpuguard.host.echo import cut


def describe(e: BaseException) -> tuple[str, dict[str, str]]:
    """(the reason, the journal fields GRPC_CODE and GRPC_DETAILS when it has them)."""
    code = getattr(e, "code", None)
    details = getattr(e, "details", None)
    if callable(code) and callable(details):
        try:
            status, said = code(), details()
        except Exception:  # an RpcError without a status (grpcio's own bug): its text
            status, said = None, None
        if status is not None:
            name = str(getattr(status, "name", status))
            value = getattr(status, "value", None)
            number = value[0] if isinstance(value, tuple) and value else ""
            text = cut(str(said or ""), 200)
            why = (
                f"gRPC {name}"
                + (f" ({number})" if number != "" else "")
                + f": {text or 'no details'}"
            )
            return why, {"GRPC_CODE": name, "GRPC_DETAILS": text}
    lines = str(e).splitlines()
    return cut(lines[0] if lines else type(e).__name__, 200), {}
