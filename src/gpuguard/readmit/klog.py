"""kubelet's own log records, told from text that only looks like them (pure).

kubelet logs through klog, as text (the default) or JSON (``--logging-format=json``).
A text record is one line that starts with klog's header, ``Lmmdd hh:mm:ss.uuuuuu
PID file:line] `` (L one of I, W, E, F; PID the process that logged it), then the
quoted message and ``key=value`` pairs. A string value with newlines is written as
``key=<``, then each of its lines behind a tab, then a line `` >``: journald keeps
each of those lines as an entry of its own, and a log file has them as lines, so a
tenant's probe output (logged at ``--v>=1``) can put any text on such a line. A line
is therefore a record only when it starts with the header whose PID is kubelet's own
and it is not inside a multi-line value (after a ``key=<`` line, until its `` >``).
A JSON record is one object per line with ``"ts"`` (Unix milliseconds) and
``"msg"``; its values are escaped, so they never span lines. One kubelet logs in one
format: the first record of its run decides which, and a line of the other format is
then no record.

Of the records, two kinds matter here: ``"Pod admission denied"`` (kubelet 1.26+'s
allocation manager; ``podUID``, ``pod`` as "NS/NAME" or {name, namespace},
``reason``, ``message``; kubelet 1.36 adds ``operation="add"``) and kubelet's first
``"SyncLoop ADD"`` (its first admission).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Optional

from gpuguard.host.echo import cut
from gpuguard.host.statefile import SchemaError, parse_json
from gpuguard.readmit.state import MESSAGE_MAX, POD_UID_MAX

MAX_LINE = 64 * 1024  # a line's first this many characters are read as a record
HEADER = re.compile(
    r"([IWEF])(\d\d)(\d\d) (\d\d):(\d\d):(\d\d(?:\.\d{1,9})?) +(\d{1,10}) "
    r"[^\s:\]]{1,256}:\d{1,9}\] "
)
QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
KEY = re.compile(r" +([A-Za-z_][A-Za-z0-9_.-]{0,127})=")
BARE = re.compile(r"[^\s\"<]\S*")
# Kubernetes' own bounds: a namespace is a DNS label, a pod name a DNS subdomain
NAMESPACE = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")
POD_NAME = re.compile(r"[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?")
POD_UID = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{POD_UID_MAX - 1}}}")
DENIED = "Pod admission denied"
SYNC_ADD = "SyncLoop ADD"
# Seconds after kubelet's start within which a rejection is one "at its start": kubelet
# judges the pods it finds at its start in its first sync of each source, static pods
# 40-80 ms after it, API pods after its node sync, 1.4-1.6 s after it (measured on
# kubelets 1.34.9 and 1.36.2); 5 s leaves room for a loaded node. A later rejection is
# of a pod kubelet judged later (created after the start, or a GPU that came late).
AT_START = 5.0
# kubelet's start is its listener process's start (10 ms ticks): a record this much
# before it is still its own; one earlier is a previous kubelet's (a reused PID)
START_SLACK = 0.5


@dataclass(frozen=True)
class Record:
    """One log record of the form ``form`` ("text" or "json")."""

    form: str
    pid: Optional[int]  # text: the header's PID; JSON carries none
    msg: str
    fields: tuple[tuple[str, str], ...]  # string values, in order
    clock: Optional[tuple[int, int, float]] = None  # text: the header's h, min, s
    ts: Optional[float] = None  # JSON: Unix seconds
    opens_block: bool = False  # text: it ends inside a multi-line value (key=<)

    def get(self, key: str) -> str:
        for k, v in self.fields:
            if k == key:
                return v
        return ""


@dataclass(frozen=True)
class Rejection:
    pod_uid: str
    pod: str  # namespace/name
    reason: str
    message: str
    at: Optional[float] = None  # the record's own time (Unix), when read from a log line


def after_start(at: Optional[float], start: Optional[float]) -> Optional[float]:
    """Seconds from kubelet's start to a rejection (None when either is not known)."""
    return None if at is None or start is None else max(at - start, 0.0)


def at_start(at: Optional[float], start: Optional[float]) -> bool:
    """Whether a rejection at ``at`` is one kubelet made at its ``start`` (AT_START)."""
    after = after_start(at, start)
    return after is not None and after <= AT_START


def _unquote(body: str) -> str:
    """A Go-quoted string's body, its quote and backslash escapes undone; the others
    (\\n, \\t, \\u...) kept as written, so a value stays one line."""
    return body.replace('\\"', '"').replace("\\\\", "\\")


def parse_text(line: str) -> Optional[Record]:
    """``line`` as a klog text record: None unless it starts with klog's header."""
    m = HEADER.match(line)
    if m is None:
        return None
    rest = line[m.end() :]
    q = QUOTED.match(rest)
    if q is None:  # an unstructured record (klog.Infof): its text is the message
        return Record("text", int(m[7]), rest, (), (int(m[4]), int(m[5]), float(m[6])))
    msg = _unquote(q[1])
    fields = []
    pos = q.end()
    opens = False
    while pos < len(rest):
        k = KEY.match(rest, pos)
        if k is None:
            break
        pos = k.end()
        if rest.startswith('"', pos):
            v = QUOTED.match(rest, pos)
            if v is None:
                break
            fields.append((k[1], _unquote(v[1])))
            pos = v.end()
        elif rest.startswith("<", pos) and rest[pos + 1 :].strip() == "":
            opens = True  # a multi-line value: its lines follow
            break
        else:
            b = BARE.match(rest, pos)
            if b is None:
                break
            fields.append((k[1], b[0]))
            pos = b.end()
    if not opens and rest.endswith("=<"):
        opens = True  # behind a value this parser could not follow
    clock = (int(m[4]), int(m[5]), float(m[6]))
    return Record("text", int(m[7]), msg, tuple(fields), clock, opens_block=opens)


def _json_value(v: Any) -> Optional[str]:
    if isinstance(v, str):
        return v
    if isinstance(v, dict):  # klog.KObj: {"name": ..., "namespace": ...}
        name, ns = v.get("name"), v.get("namespace")
        if isinstance(name, str) and isinstance(ns, str):
            return f"{ns}/{name}" if ns else name
    return None


def parse_json_record(line: str) -> Optional[Record]:
    """``line`` as a klog JSON record: one object with "ts" (milliseconds) and "msg"."""
    if not line.startswith("{"):
        return None
    try:
        doc = parse_json(line.encode("utf-8", "surrogatepass"))
    except (SchemaError, UnicodeEncodeError):
        return None
    if not isinstance(doc, dict):
        return None
    ts, msg = doc.get("ts"), doc.get("msg")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not isinstance(msg, str):
        return None
    fields = tuple((k, s) for k, v in doc.items() if (s := _json_value(v)) is not None)
    return Record("json", None, msg, fields, ts=float(ts) / 1000.0)


def parse(line: str) -> Optional[Record]:
    """One line (one journal entry's MESSAGE, one line of a log file) as a record, or
    None. Only its first line and first MAX_LINE characters are read."""
    line = line[:MAX_LINE].split("\n", 1)[0]
    if line.startswith("{"):
        return parse_json_record(line)
    return parse_text(line)


def rejection(rec: Record) -> Optional[Rejection]:
    """The device manager's rejection in ``rec`` (reason UnexpectedAdmissionError, an
    ``Allocate failed`` message), its fields checked against Kubernetes' own bounds
    (a pod name no Kubernetes object can have is no rejection) and its message cut
    to what the state file keeps; None for any other record."""
    if rec.msg != DENIED:
        return None
    uid, pod, reason, message = (rec.get(k) for k in ("podUID", "pod", "reason", "message"))
    if reason != "UnexpectedAdmissionError" or "Allocate failed" not in message:
        return None
    ns, _, name = pod.partition("/")
    if not (NAMESPACE.fullmatch(ns) and POD_NAME.fullmatch(name) and POD_UID.fullmatch(uid)):
        return None
    return Rejection(uid, pod, reason, cut(message, MESSAGE_MAX))


def klog_unix(received: float, hours: int, minutes: int, seconds: float) -> float:
    """The Unix time of a klog line's clock time (kubelet's local time, no date), from
    when it was received (UTC, a little later): the time zone is a whole number of
    quarter hours, the delay far less than 7 minutes."""
    day = received - received % 86400
    t = day + (hours * 60 + minutes) * 60 + seconds
    return t - round((t - received) / 900) * 900


def record_time(rec: Record, received: float) -> float:
    if rec.ts is not None:
        return rec.ts
    if rec.clock is not None:
        return klog_unix(received, *rec.clock)
    return received


def uid_key(uid: str) -> str:
    """A pod UID as the checkpoint and the cgroup tree may spell it, made one."""
    return uid.replace("_", "-").lower()


@dataclass(frozen=True)
class Line:
    """One line of kubelet's log: a journal entry's MESSAGE or a line of its file."""

    text: str
    received: float  # Unix time it was logged (journald's) or read (a file)


@dataclass(frozen=True)
class Scan:
    """What one kubelet run's lines said so far (scan() makes the next one)."""

    form: str = ""  # "text" or "json" once its first record was read
    in_block: bool = False  # inside a multi-line value: its lines are no records
    admitted: Optional[float] = None  # its first SyncLoop ADD (Unix time)
    named: frozenset[str] = frozenset()  # pod UIDs already named


@dataclass(frozen=True)
class Found:
    rejected: tuple[Rejection, ...]  # of pods the checkpoint held, or AT_START: named
    elsewhere: tuple[Rejection, ...]  # of other pods kubelet judged later
    admitted: Optional[float]  # the first admission, when found in these lines


def scan(
    state: Scan,
    lines: tuple[Line, ...],
    pid: Optional[int],
    held: frozenset[str],
    start: Optional[float] = None,
) -> tuple[Scan, Found]:
    """Judge ``lines`` (in order, all from the kubelet run whose PID is ``pid``: a
    text record with another PID in its header is no record of it; None: a source
    that has told the PID already) for the pods ``held`` (the UIDs, uid_key()'d, the
    checkpoint held GPUs for at kubelet's start). ``start``: kubelet's start (Unix
    time; None: not known): a record from before it is a previous kubelet's (whose PID
    this one reuses), never this run's first admission nor its rejection; a pod not
    held but rejected AT_START is one bound to the node while it was down, judged
    with the re-admissions, and named as they are."""
    form, in_block, admitted, named = state.form, state.in_block, state.admitted, set(state.named)
    rejected: list[Rejection] = []
    elsewhere: list[Rejection] = []
    found_admitted: Optional[float] = None
    for line in lines:
        text = line.text
        if in_block:
            if text.startswith(" >"):  # the multi-line value ends; more keys may follow
                in_block = text.rstrip().endswith("=<")
            continue
        rec = parse(text)
        if rec is None:
            continue
        if rec.form == "text" and pid is not None and rec.pid != pid:
            continue
        if not form:
            form = rec.form
        elif rec.form != form:
            continue
        in_block = rec.opens_block
        if rec.msg != SYNC_ADD and rec.msg != DENIED:
            continue
        t = record_time(rec, line.received)
        if start is not None and t < start - START_SLACK:
            continue  # a previous kubelet's record
        if rec.msg == SYNC_ADD:
            if admitted is None:
                admitted = found_admitted = t
            continue
        r = rejection(rec)
        if r is None or uid_key(r.pod_uid) in named:
            continue
        r = replace(r, at=t)
        named.add(uid_key(r.pod_uid))
        ours = uid_key(r.pod_uid) in held or at_start(t, start)
        (rejected if ours else elsewhere).append(r)
    new = replace(state, form=form, in_block=in_block, admitted=admitted, named=frozenset(named))
    return new, Found(tuple(rejected), tuple(elsewhere), found_admitted)
