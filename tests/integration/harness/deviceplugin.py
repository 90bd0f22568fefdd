"""A device plugin double that speaks kubelet's real deviceplugin v1beta1 gRPC API.

The API's code is generated at test time from the ``api.proto`` of the very kubelet
tree the tests build (scripts/build-kubelet caches it beside the binary), with its
gogoproto lines dropped (:func:`generate`; grpcio-tools is a test dependency only).

Run as ``python deviceplugin.py --api DIR --inventory FILE [options]``, as a host
service or in a (privileged) static pod. Like NVIDIA's k8s-device-plugin it:

* serves ``nvidia-gpu.sock`` in the device-plugins directory and registers
  ``nvidia.com/gpu`` with kubelet (``Registration.Register`` on ``kubelet.sock``);
* advertises one device per GPU of gpuguard's inventory file (ID: its UUID);
* answers ``Allocate`` with ``NVIDIA_VISIBLE_DEVICES`` set to the UUIDs (its default
  ``DEVICE_LIST_STRATEGY=envvar``) and, with ``--device-specs`` (its
  ``passDeviceSpecs``), the device specs of ``apiDeviceSpecs`` (seed 004): the control
  nodes that ``stat()`` finds in ITS OWN /dev, then each GPU's node;
* watches ``kubelet.sock`` and, when kubelet makes a new one (a kubelet restart deletes
  every plugin socket), serves its socket again and registers again. With
  ``--no-reregister`` it does not: an old or forked plugin (F4).

It prints one JSON line per event (serving, registered, allocate) on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

CONTROL_NODES = (
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-modeset",
)
SOCKET = "nvidia-gpu.sock"
RESOURCE = "nvidia.com/gpu"


def generate(proto: Path, out: Path) -> Path:
    """api_pb2.py and api_pb2_grpc.py in ``out`` from kubelet's ``api.proto``."""
    out.mkdir(parents=True, exist_ok=True)
    text = proto.read_text()
    gogo = r'^import "github.com/gogo/protobuf/gogoproto/gogo.proto";\n'
    text = re.sub(gogo, "", text, flags=re.M)
    text = re.sub(r"^option \(gogoproto\.[^;]*;\n", "", text, flags=re.M)
    if "gogoproto" in text:
        raise AssertionError(f"{proto}: gogoproto left after stripping its lines")
    (out / "api.proto").write_text(text)
    res = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{out}", f"--python_out={out}",
         f"--grpc_python_out={out}", str(out / "api.proto")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if res.returncode != 0:
        raise AssertionError(f"grpc_tools.protoc failed: {res.stderr}")
    return out


def say(**event: Any) -> None:
    print(json.dumps({"t": round(time.time(), 3), **event}), flush=True)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--api", required=True, help="directory of the generated api_pb2*.py")
    ap.add_argument("--inventory", required=True)
    ap.add_argument("--dir", default="/var/lib/kubelet/device-plugins")
    ap.add_argument("--device-specs", action="store_true")
    ap.add_argument("--no-reregister", action="store_true")
    args = ap.parse_args(argv)
    sys.path.insert(0, args.api)
    import api_pb2  # type: ignore[import-not-found]
    import api_pb2_grpc  # type: ignore[import-not-found]
    import grpc

    # as PID 1 of a pod a signal without a handler is ignored: stop on SIGTERM, as
    # NVIDIA's plugin does, so that the runtime's stop (kubelet's, gpuguard's) works
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    gpus: List[Dict[str, Any]] = json.loads(Path(args.inventory).read_text())["gpus"]
    by_id = {str(g["uuid"]): g for g in gpus}

    class Plugin(api_pb2_grpc.DevicePluginServicer):  # type: ignore[misc]
        def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
            return api_pb2.DevicePluginOptions()

        def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:
            devs = [api_pb2.Device(ID=u, health="Healthy") for u in by_id]
            yield api_pb2.ListAndWatchResponse(devices=devs)
            while context.is_active():
                time.sleep(0.5)

        def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
            return api_pb2.PreferredAllocationResponse()

        def Allocate(self, request: Any, context: Any) -> Any:
            responses = []
            for req in request.container_requests:
                ids = list(req.devicesIDs)
                unknown = [i for i in ids if i not in by_id]
                if unknown:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown device: {unknown}")
                specs = []
                if args.device_specs:
                    paths = [p for p in CONTROL_NODES if os.path.exists(p)]
                    paths += [f"/dev/nvidia{by_id[i]['minor']}" for i in ids]
                    specs = [
                        api_pb2.DeviceSpec(container_path=p, host_path=p, permissions="rw")
                        for p in paths
                    ]
                envs = {"NVIDIA_VISIBLE_DEVICES": ",".join(ids)}
                responses.append(api_pb2.ContainerAllocateResponse(envs=envs, devices=specs))
                say(event="allocate", ids=ids, specs=[s.host_path for s in specs])
            return api_pb2.AllocateResponse(container_responses=responses)

        def PreStartContainer(self, request: Any, context: Any) -> Any:
            return api_pb2.PreStartContainerResponse()

    kubelet_sock = os.path.join(args.dir, "kubelet.sock")
    own = os.path.join(args.dir, SOCKET)

    def serve() -> Any:
        if os.path.exists(own):
            os.unlink(own)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        api_pb2_grpc.add_DevicePluginServicer_to_server(Plugin(), server)
        server.add_insecure_port(f"unix://{own}")
        server.start()
        say(event="serving", socket=own, devices=list(by_id))
        return server

    def register() -> None:
        with grpc.insecure_channel(f"unix://{kubelet_sock}") as ch:
            stub = api_pb2_grpc.RegistrationStub(ch)
            stub.Register(
                api_pb2.RegisterRequest(version="v1beta1", endpoint=SOCKET, resource_name=RESOURCE),
                timeout=10,
            )
        say(event="registered", resource=RESOURCE)

    def kubelet_identity() -> Optional[int]:
        try:
            return os.stat(kubelet_sock).st_ino
        except OSError:
            return None

    server: Any = None
    registered_with: Optional[int] = None  # kubelet.sock's inode when registered
    while True:
        ident = kubelet_identity()
        fresh = registered_with is None or not args.no_reregister
        if ident is not None and ident != registered_with and fresh:
            # kubelet removes every plugin socket when it starts: serve ours again
            if server is None or registered_with is not None or not os.path.exists(own):
                if server is not None:
                    server.stop(0)
                server = serve()
            try:
                register()
                registered_with = ident
            except grpc.RpcError as e:  # kubelet not serving yet: try again
                say(event="register-failed", error=str(e.code()))
        time.sleep(0.2)


if __name__ == "__main__":
    main()
