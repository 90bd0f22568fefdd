"""The GPU pods kubelet rejected at its start, named: kubelet 1.26+ logs each pod it
refuses to admit (``"Pod admission denied" podUID=... pod="NS/NAME"
reason="UnexpectedAdmissionError" message="Allocate failed due to ..."``); for two
minutes after each kubelet start the bridge reads that kubelet's own log records
(readmit/kubeletlog.py: the journal matched on journald's trusted fields, or
``[Kubelet] LogFile=``; readmit/klog.py: a record is a whole line that starts with
klog's header and kubelet's PID, or a JSON record, never a line inside a logged value)
and journals each GPU pod rejected by the device manager once (``readmit-rejected``,
with POD, POD_UID, REASON), whether or not it offered anything: with gpuguard off, in
observe mode, or when a GPU is gone for good, these are the pods lost. The pods the
checkpoint held GPUs for at kubelet's start are its re-admission's rejections; a pod
rejected within AT_START of the start was bound to the node while it was down and is
named as they are (readmit/klog.py); a rejection of another pod (a new pod kubelet
judged later) is journaled at debug level and named nowhere. Records from before
kubelet's start are a previous kubelet's, never this run's. It also finds kubelet's
first admission (its first ``"SyncLoop ADD"`` of this run), for the margin between
the bridge's devices healthy and that moment (readmit/state.py).

What kept it from reading (the journal or the file unreadable, journalctl failing,
no kubelet process in the unit, the checkpoint unreadable) is said: journaled once
per kubelet start (``readmit-unread``) and kept in the state file's ``problem``, so
that the daemon's verdict on the rejections is unknown, never OK.
"""

from __future__ import annotations

import errno
import fnmatch
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from gpuguard.checkpoint.reader import load as load_checkpoint
from gpuguard.config.schema import Config
from gpuguard.errors import GpuguardError
from gpuguard.host.echo import cut
from gpuguard.host.paths import Root
from gpuguard.readmit import kubeletlog
from gpuguard.readmit.klog import (
    Line,
    Rejection,
    Scan,
    after_start,
    klog_unix,
    scan,
    uid_key,
)
from gpuguard.readmit.kubeletlog import (
    Journalctl,
    JournalReader,
    KubeletRun,
    LogFile,
    LogUnreadable,
    Position,
    Source,
    kubelet_run,
    position,
)

__all__ = [
    "EVERY",
    "WATCH_SECONDS",
    "Rejection",
    "RejectionWatch",
    "first_admission",
    "held_pods",
    "klog_unix",
    "rejections",
]

WATCH_SECONDS = 120.0
EVERY = 2.0


def rejections(log: str, pid: int, held: Optional[frozenset[str]] = None) -> list[Rejection]:
    """The device manager's rejections in kubelet's log text, one record per line
    (pure): reason UnexpectedAdmissionError with an ``Allocate failed`` message, from
    the kubelet whose PID is ``pid``; of the pods ``held`` when given."""
    lines = tuple(Line(t, 0.0) for t in log.splitlines())
    _s, found = scan(Scan(), lines, pid, frozenset() if held is None else held)
    return list(found.rejected if held is not None else (*found.rejected, *found.elsewhere))


def first_admission(lines: tuple[Line, ...], pid: int) -> Optional[float]:
    """kubelet's first admission in its lines (pure): its first SyncLoop ADD."""
    _s, found = scan(Scan(), lines, pid, frozenset())
    return found.admitted


def held_pods(root: Root, cfg: Config) -> tuple[Optional[frozenset[str]], str]:
    """The UIDs (uid_key()'d) of the pods the checkpoint holds devices of a managed
    resource for, now; (None, why) when it cannot be read (no checkpoint: none)."""
    try:
        loaded = load_checkpoint(root.path(cfg.kubelet.checkpoint_path))
    except GpuguardError as e:
        if getattr(e, "errno", 0) in (errno.ENOENT, errno.ENOTDIR):
            return frozenset(), ""
        return None, f"kubelet's checkpoint: {cut(e.message, 200)}"
    held = {
        uid_key(e.pod_uid)
        for e in loaded.checkpoint.entries or ()
        if e.all_device_ids()
        and any(fnmatch.fnmatchcase(e.resource_name, p) for p in cfg.kubelet.resources)
    }
    return frozenset(held), ""


@dataclass(frozen=True)
class Watching:
    """One kubelet start's watch: its generation, and its log file's position then."""

    generation: int
    cfg: Config
    file_at: Optional[Position]
    started: Optional[float] = None  # kubelet's start (Unix time; None: not told)


class RejectionWatch:
    """Reads kubelet's log after one kubelet start; a newer start supersedes it.
    ``admitted`` gets kubelet's first admission (Unix time) once found; ``problem``
    what kept it from reading; ``note(level, text)`` the rest worth journaling."""

    def __init__(
        self,
        root: Root,
        unit: str,
        say: Callable[[Rejection], None],
        admitted: Callable[[float], None] = lambda _at: None,
        problem: Callable[[str], None] = lambda _why: None,
        note: Callable[[str, str], None] = lambda _level, _text: None,
        runs: Callable[[Root, str, bool], KubeletRun] = kubelet_run,
        every: float = EVERY,
    ) -> None:
        self.root = root
        self.unit = unit
        self.say = say
        self.admitted = admitted
        self.problem = problem
        self.note = note
        self.runs = runs
        self.every = every
        self.generation = 0
        self.told_fallback = False

    def start(self, cfg: Config, started: Optional[float] = None) -> None:
        w = self.begin(cfg, started)
        threading.Thread(target=self.follow, args=(w,), daemon=True).start()

    def begin(self, cfg: Config, started: Optional[float] = None) -> Watching:
        """At kubelet's start (kubelet.sock just made, kubelet's process started at
        ``started``): a log file's position now."""
        self.generation += 1
        f = cfg.kubelet.log_file
        at = position(self.root.path(f)) if f else None
        return Watching(self.generation, cfg, at, started)

    def open(self, w: Watching, run: KubeletRun) -> Source:
        if w.file_at is not None and w.cfg.kubelet.log_file:
            path = self.root.path(w.cfg.kubelet.log_file)
            return LogFile(path, w.file_at, check_owner=self.root.is_host)
        if kubeletlog.have_reader():
            return JournalReader(run)
        if not self.told_fallback:
            self.told_fallback = True
            self.note(
                "notice",
                "python3-systemd is not installed: kubelet's journal is read through "
                "journalctl -o json (install python3-systemd to read it in-process)",
            )
        return Journalctl(run)

    def follow(self, w: Watching, rounds: Optional[int] = None) -> None:
        """Read until WATCH_SECONDS after the start, a newer start, or ``rounds``
        reads (tests)."""
        said: set[str] = set()

        def tell(why: str) -> None:
            if why not in said and w.generation == self.generation:
                said.add(why)
                self.problem(why)

        # now: kubelet drops a rejected pod's entries at its next allocation
        held, why = held_pods(self.root, w.cfg)
        if held is None:
            tell(f"{why}: no rejection is named at this start")
        deadline = time.monotonic() + WATCH_SECONDS
        time.sleep(self.every)  # the bridge's registration first: nothing to read yet
        run = self.runs(self.root, self.unit, w.file_at is not None)
        if run.pid == 0:
            tell(f"kubelet's records cannot be told from others: {run.why}")
            return
        try:
            source = self.open(w, run)
        except LogUnreadable as e:
            tell(e.message)
            return
        state = Scan()
        done = 0
        try:
            while w.generation == self.generation and time.monotonic() < deadline:
                if rounds is not None and done >= rounds:
                    return
                if done:
                    time.sleep(self.every)
                done += 1
                try:
                    lines = source.read()
                except LogUnreadable as e:
                    tell(e.message)
                    continue
                if w.generation != self.generation:
                    return
                state, found = scan(state, lines, run.pid, held or frozenset(), w.started)
                if found.admitted is not None:
                    self.admitted(found.admitted)
                for r in found.rejected:
                    self.say(r)
                for r in found.elsewhere:
                    after = after_start(r.at, w.started)
                    when = f" {after:.0f} s after kubelet's start" if after is not None else ""
                    self.note(
                        "debug",
                        f"kubelet rejected pod {r.pod} ({r.pod_uid}){when}, which held no GPU "
                        f"in its checkpoint at kubelet's start: not a re-admission: {r.message}",
                    )
        finally:
            source.close()
