"""`gpuguard readmit`: the re-admission bridge of gpuguard-readmit.service (readmit/)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time
from pathlib import Path

from gpuguard.cli.args import _config, _log, _root


def cmd_readmit(args: argparse.Namespace) -> int:
    from gpuguard.actuate.statefile import write_state
    from gpuguard.errors import GpuguardError
    from gpuguard.host.inventory import load_inventory
    from gpuguard.host.notify import Notifier
    from gpuguard.host.offswitch import read_off_switch
    from gpuguard.host.statefile import load
    from gpuguard.readmit import Inputs, Readmit
    from gpuguard.readmit.observe import (
        CACHE,
        CACHE_FILE,
        kubelet_version,
        present_ids,
        read_cached,
        unit_executable,
    )
    from gpuguard.readmit.rejected import Rejection, RejectionWatch
    from gpuguard.readmit.serve import Bridge
    from gpuguard.readmit.state import SPEC, STATE_FILE, ReadmitState, Recorder, RejectedPod

    root = _root(args)
    notifier = Notifier()
    elog = _log(args, None, root)
    off = read_off_switch(root)
    if off is not None:
        elog.event("readmit-off", f"gpuguard is off ({off.describe()}): the bridge stays off")
        notifier.ready("off")
        return 0
    cfg = _config(args, root)
    elog = _log(args, cfg, root)
    mode = os.environ.get("GPUGUARD_READMIT", "auto")
    found = unit_executable(cfg.systemd.kubelet_units)
    kubelet_unit = found[0] if found else cfg.systemd.kubelet_units[0]
    if mode != "on":
        cached = read_cached(root)
        kv = kubelet_version(root, found[1], cached) if found else None
        if kv is not None and kv != cached and kv.version:
            with contextlib.suppress(OSError, GpuguardError):  # asked again next time
                write_state(root.path(CACHE_FILE), CACHE, kv)
        needed = kv.needs_bridge if kv is not None else None
        if mode == "off" or not needed:
            said = (
                kv.text if kv is not None else f"no unit of {' '.join(cfg.systemd.kubelet_units)}"
            )
            why = (
                "GPUGUARD_READMIT=off"
                if mode == "off"
                else f"kubelet {kv.version} re-admits its pods without a device plugin"
                if needed is False and kv is not None
                else f"kubelet's version unknown ({said}); GPUGUARD_READMIT=on turns it on"
            )
            elog.event("readmit-off", f"the re-admission bridge stays off: {why}")
            notifier.ready("off")
            return 0

    def read_inputs() -> Inputs:
        c = _config(args, root)
        path = Path(c.inventory.file) if c.inventory.file else None
        try:
            return Inputs(c, present_ids(load_inventory(path)), "")
        except GpuguardError as e:
            return Inputs(c, frozenset(), e.message)

    plugins_dir = root.path(Path(cfg.kubelet.checkpoint_path).parent)
    told: list[str] = []

    def write(state: ReadmitState) -> None:
        try:
            write_state(root.path(STATE_FILE), SPEC, state)
        except (OSError, GpuguardError) as e:  # said once: the daemon then sees nothing
            if not told:
                told.append(str(e))
                elog.event("error", f"cannot write {STATE_FILE}: {e}"[:300], level="warning")

    from gpuguard.devices.processes import process_start

    me = os.getpid()
    recorder = Recorder(write, (me, process_start(root, me) or 0.0))
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    try:

        def streamed(resource: str, n: int) -> None:
            recorder.healthy(resource, time.time())
            elog.event(
                "readmit-stream",
                f"kubelet asked for {resource}'s devices: {n} reported healthy",
                level="debug",
            )

        bridge = Bridge(plugins_dir, streamed)
    except ImportError:  # a Recommends of the package, not a Depends
        elog.event(
            "readmit-off",
            "the re-admission bridge stays off: it needs python3-grpcio, which is not "
            "installed; install it, then restart gpuguard-readmit.service",
            level="warning",
        )
        notifier.ready("off")
        return 0

    def named(r: Rejection) -> None:
        recorder.rejected(RejectedPod(r.pod_uid, r.pod, r.reason, r.message, time.time()))
        elog.event(
            "readmit-rejected",
            f"kubelet rejected GPU pod {r.pod} at its start: {r.message}",
            level="warning",
            fields={"POD": r.pod, "POD_UID": r.pod_uid, "REASON": r.reason},
        )

    prior = load(root.path(STATE_FILE), SPEC)
    if prior.absent:  # the daemon then knows the bridge is on
        write(ReadmitState("", 0.0, "waiting", "waiting for kubelet's start"))
    watch = RejectionWatch(kubelet_unit, named, recorder.admitted)
    readmit = Readmit(root, elog, read_inputs, bridge, watch, recorder)
    # an earlier process's registration in the kubelet run that goes on: its streams ended
    readmit.resume(prior.value)
    notifier.ready("waiting for kubelet")
    readmit.run(lambda: bool(stopping))
    readmit.stopping()  # said and written before the streams end
    bridge.stop()
    return 0
