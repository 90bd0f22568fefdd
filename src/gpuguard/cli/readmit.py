"""`gpuguard readmit`: the re-admission bridge of gpuguard-readmit.service (readmit/)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time
from pathlib import Path

from gpuguard.cli.args import config_from, log_from, root_from
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.readmit import offstate


def stay_off(root: Root, elog: EventLog, cause: str, why: str, version: str) -> None:
    """Journal why the bridge stays off (a warning, with the fix, where the node is
    exposed: readmit/offstate.py) and write its state file for the daemon and doctor."""
    from gpuguard.actuate.statefile import write_state
    from gpuguard.errors import GpuguardError
    from gpuguard.readmit.state import SPEC, STATE_FILE, ReadmitState

    def write(state: ReadmitState) -> None:
        write_state(root.path(STATE_FILE), SPEC, state)

    try:
        offstate.record_off(write, cause, why, version)
    except (OSError, GpuguardError) as e:
        elog.event("error", f"cannot write {STATE_FILE}: {e}"[:300], level="warning")
    if cause == offstate.SWITCH:
        return  # journaled by the caller: gpuguard itself is off
    fix = offstate.FIXES.get(cause, "")
    exposed = fix and offstate.needs_bridge(version) is not False
    elog.event(
        "readmit-off",
        f"the re-admission bridge stays off: {why}"
        + (f"; GPU pods are exposed at kubelet's next start: {fix}" if exposed else ""),
        level="warning" if exposed else "info",
        fields={"CAUSE": cause},
    )


def cmd_readmit(args: argparse.Namespace) -> int:
    from gpuguard.actuate.statefile import write_state
    from gpuguard.errors import GpuguardError
    from gpuguard.host.notify import Notifier
    from gpuguard.host.offswitch import read_off_switch
    from gpuguard.host.statefile import load
    from gpuguard.readmit import Inputs, Readmit
    from gpuguard.readmit.apipods import reader
    from gpuguard.readmit.fates import Fate, Fates, say_fate, say_rejected, with_fate
    from gpuguard.readmit.klog import at_start
    from gpuguard.readmit.node import NodeReader
    from gpuguard.readmit.observe import (
        CACHE,
        CACHE_FILE,
        kubelet_version,
        other_sockets,
        read_cached,
        unit_executable,
    )
    from gpuguard.readmit.rejected import Rejection, RejectionWatch
    from gpuguard.readmit.serve import Bridge
    from gpuguard.readmit.state import SPEC, STATE_FILE, ReadmitState, Recorder, RejectedPod
    from gpuguard.readmit.withdraw import Withdrawal, allocate_refused, read_list

    root = root_from(args)
    notifier = Notifier()
    elog = log_from(args, None, root)
    off = read_off_switch(root)
    if off is not None:
        elog.event("readmit-off", f"gpuguard is off ({off.describe()}): the bridge stays off")
        stay_off(root, elog, offstate.SWITCH, f"gpuguard is off ({off.describe()})", "")
        notifier.ready("off")
        return 0
    cfg = config_from(args, root)
    elog = log_from(args, cfg, root)
    mode = os.environ.get("GPUGUARD_READMIT", "auto")
    found = unit_executable(cfg.systemd.kubelet_units)
    kubelet_unit = found[0] if found else cfg.systemd.kubelet_units[0]
    version = ""  # kubelet's, as told (for the state file)
    if mode != "on":
        cached = read_cached(root)
        kv = kubelet_version(root, found[1], cached) if found else None
        if kv is not None and kv != cached and kv.version:
            with contextlib.suppress(OSError, GpuguardError):  # asked again next time
                write_state(root.path(CACHE_FILE), CACHE, kv)
        needed = kv.needs_bridge if kv is not None else None
        version = kv.version if kv is not None else ""
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
            cause = (
                offstate.ENV_OFF
                if mode == "off"
                else offstate.OLD_KUBELET
                if needed is False
                else offstate.NO_KUBELET
                if found is None and not (cached is not None and cached.needs_bridge)
                else offstate.UNKNOWN_VERSION
            )
            if cause == offstate.NO_KUBELET:
                why = f"no kubelet here: {said} is loaded and none was ever seen"
            stay_off(root, elog, cause, why, version)
            notifier.ready("off")
            return 0

    node_reader = NodeReader(root)  # NVML once at most, in a child (readmit/node.py)

    def read_inputs() -> Inputs:
        c = config_from(args, root)
        sock = root.path(Path(c.kubelet.checkpoint_path).parent / "kubelet.sock")
        node, problem = node_reader.read(
            c.inventory.file or "", c.inventory.driver_root or "", os.path.lexists(sock)
        )
        return Inputs(c, node, problem)

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
    recorder = Recorder(
        write,
        refused=lambda why: elog.event("error", f"not recorded: {why}"[:300], level="warning"),
        me=(me, process_start(root, me) or 0.0),
    )
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

        bridge = Bridge(plugins_dir, streamed, lambda r, i: allocate_refused(elog, r, i))
    except ImportError:  # a Recommends of both packages (docs/checkpoint.md says why)
        why = "it needs python3-grpcio, which is not installed"
        stay_off(root, elog, offstate.NO_GRPCIO, why, version)
        notifier.ready("off")
        return 0

    def started() -> float:
        s = recorder.current()
        return s.kubelet_started if s is not None else 0.0

    def still(uid: str) -> bool:  # a rejection of the kubelet run that goes on
        s = recorder.current()
        return s is not None and any(p.pod_uid == uid for p in s.rejected)

    def fate_said(pod: RejectedPod, f: Fate) -> None:
        if still(pod.pod_uid):
            recorder.fate(pod.pod_uid, f.fate, f.owner, f.replacement, f.replacement_uid)
            say_fate(elog, with_fate(pod, f), started())

    fates = Fates(lambda: api.view(), lambda: api.want(), fate_said, still)

    def named(r: Rejection) -> None:
        pod = RejectedPod(
            r.pod_uid, r.pod, r.reason, r.message, time.time(), r.at, at_start(r.at, started())
        )
        pod = with_fate(pod, fates.add(pod))
        recorder.rejected(pod)
        say_rejected(elog, pod, started())

    prior = load(root.path(STATE_FILE), SPEC)
    if prior.absent:  # the daemon then knows the bridge is on
        write(ReadmitState("", 0.0, "waiting", "waiting for kubelet's start"))

    def unread(why: str) -> None:  # the daemon's verdict on the rejections: unknown
        recorder.problem(why)
        elog.event(
            "readmit-unread",
            f"kubelet's rejections at this start cannot be read: {why}"[:400],
            level="warning",
        )

    def note(level: str, text: str) -> None:
        kind = "readmit-log-reader" if level == "notice" else "debug"
        elog.event(kind, text[:400], level=level)

    watch = RejectionWatch(root, kubelet_unit, named, recorder.admitted, unread, note)
    api = reader(root, lambda: readmit.inputs.cfg)
    withdrawal = Withdrawal(
        plugins_dir,
        elog,
        bridge.withdraw,
        lambda: other_sockets(plugins_dir),
        lambda: read_list(plugins_dir),
    )
    readmit = Readmit(root, elog, read_inputs, bridge, watch, recorder, api, withdrawal)
    # an earlier process's registration in the kubelet run that goes on: its streams ended
    readmit.resume(prior.value)
    notifier.ready("waiting for kubelet")
    readmit.run(lambda: bool(stopping))
    withdrawal.cancel()
    api.stop()
    readmit.stopping()  # said and written before the streams end
    bridge.stop()
    return 0
