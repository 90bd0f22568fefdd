"""The bridge's own end while kubelet runs: what it costs, said when it happens.

kubelet 1.26+ keeps the stream of each endpoint the bridge registered after the real
plugin replaced it (serve.py); when the bridge's process ends while that kubelet runs
(a stop, a restart, a crash, the OOM killer) the streams end and kubelet disconnects
the plugin that replaced them: the node advertises no device of those resources until
the plugin registers again. The bridge says so (``readmit-streams-ended``) and writes
the time in its state file, at its SIGTERM before its servers stop, or, after a SIGKILL
or a crash, at the start of the next process, which finds a registration of this
kubelet run made by a process that is gone. The daemon's device plugin step, woken by
the unit's process ending, reads that time (steps/device_plugin/bridge_end.py) and
restarts at once the plugin kubelet dropped (allocatable.py).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Optional

from gpuguard.devices.kubeletstart import KubeletStart
from gpuguard.journal.log import EventLog
from gpuguard.readmit.state import ReadmitState

K_STREAMS_ENDED = "readmit-streams-ended"


def kubelet_listens(plugins_dir: Path) -> bool:
    """Whether a kubelet serves kubelet.sock now (a connect succeeds): a socket left by
    a kubelet that stopped refuses it, and then no stream of the bridge's is kept. Through
    the directory's descriptor: its path may be past AF_UNIX's 108 bytes."""
    try:
        fd = os.open(plugins_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            s.connect(f"/proc/self/fd/{fd}/kubelet.sock")
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def same_run(recorded: str, recorded_at: float, now: Optional[KubeletStart]) -> bool:
    """Whether the kubelet run a state names (its kubelet.sock key and start) is ``now``.
    A run first told by its socket's inode (kubelet between its bind and its listen at
    the bridge's first look) keeps that key, where a later process, finding kubelet
    listening, reads its listener: the same run when the socket is that inode and its
    listener started before the run was recorded (devices/kubeletstart.same_run)."""
    if now is None or not recorded:
        return False
    if recorded == now.key:
        return True
    began = now.boot_s
    return (
        recorded == f"inode:{now.dev}:{now.ino}"
        and began is not None
        and now.offset + began <= recorded_at + 1.0  # the wall clock's rounding
    )


def registered_in(state: Optional[ReadmitState], now: Optional[KubeletStart]) -> tuple[str, ...]:
    """The resources registered in the kubelet run ``now`` whose streams have not been
    said to end: () when none."""
    if state is None or state.streams_ended is not None:
        return ()
    if not same_run(state.kubelet_sock, state.kubelet_started, now):
        return ()
    return tuple(r.resource for r in state.registrations)


def say_ended(elog: EventLog, resources: tuple[str, ...], how: str) -> None:
    """``how``: "stop" (this process, at its SIGTERM) or "gone" (an earlier one)."""
    who = (
        "the re-admission bridge is stopping"
        if how == "stop"
        else "an earlier re-admission bridge process ended (killed or crashed)"
    )
    names = ", ".join(resources)[:200]
    elog.event(
        K_STREAMS_ENDED,
        f"{who} while kubelet runs: its streams for {names} end, so kubelet drops the "
        "device plugin that replaced them and marks their devices unhealthy until the "
        "plugin registers again; gpuguard's daemon restarts that plugin now",
        level="warning",
        fields={"RESOURCES": ",".join(resources)[:1000], "HOW": how},
    )
