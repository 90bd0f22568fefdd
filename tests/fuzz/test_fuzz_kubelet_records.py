"""kubelet's log lines as the re-admission bridge reads them (readmit/klog.py): whatever
a line holds (klog headers, quoted values with escapes, multi-line openings, JSON,
a forged rejection behind any prefix), reading it never raises, a rejection's fields
are always within Kubernetes' bounds and the state file's, and a line that does not
start with kubelet's own header (or a JSON object) is never a rejection; what the
Recorder is then given is written and read back by the state file's own reader."""

from __future__ import annotations

import json
from typing import List

from hypothesis import given
from hypothesis import strategies as st

from fuzz.budget import budget
from gpuguard.readmit.klog import Line, Scan, parse, rejection, scan
from gpuguard.readmit.state import (
    MESSAGE_MAX,
    POD_MAX,
    POD_UID_MAX,
    REASON_MAX,
    SPEC,
    ReadmitState,
    Recorder,
    RejectedPod,
)

PID = 757
HEAD = f"I1128 12:20:35.778873 {PID:7d} allocation_manager.go:702] "
pieces = st.sampled_from(
    [
        HEAD,
        '"Pod admission denied"',
        ' podUID="u-1"',
        ' pod="prod/victim-0"',
        ' reason="UnexpectedAdmissionError"',
        ' message="Allocate failed due to x"',
        ' operation="add"',
        " output=<",
        " >",
        "\t",
        '\\"',
        "\\",
        '"',
        "=",
        " ",
        '{"ts":1,"msg":"Pod admission denied"}',
        "\x00",
        "\u2028",
        "\ud800",
    ]
)
texts = st.lists(st.one_of(pieces, st.text(max_size=30)), max_size=14).map("".join)


@budget(300)
@given(st.lists(texts, max_size=12), st.sampled_from(["", "  ", "kubelet: ", "\t"]))
def test_any_line_reads_without_raising_and_within_bounds(texts_: List[str], prefix: str) -> None:
    recorded: List[ReadmitState] = []
    rec = Recorder(recorded.append)
    rec.kubelet_started("1:2", 1.0, 2.0)
    lines = tuple(Line(prefix + t, 1764332435.8) for t in texts_)
    _state, found = scan(Scan(), lines, PID, frozenset({"u-1"}))
    for r in (*found.rejected, *found.elsewhere):
        assert len(r.pod) <= POD_MAX and len(r.pod_uid) <= POD_UID_MAX
        assert len(r.reason) <= REASON_MAX and len(r.message) <= MESSAGE_MAX
        rec.rejected(RejectedPod(r.pod_uid, r.pod, r.reason, r.message, 3.0))
    if prefix:  # not at the line's start: never a record, so never a rejection
        assert all(parse(prefix + t) is None for t in texts_)
        assert found.rejected == () and found.elsewhere == ()
    if recorded:
        assert SPEC.decode(SPEC.encode(recorded[-1])) == recorded[-1]


@budget(150)
@given(
    st.dictionaries(
        st.sampled_from(["ts", "msg", "podUID", "pod", "reason", "message", "operation"]),
        st.one_of(
            st.text(max_size=400),
            st.integers(),
            st.floats(allow_nan=False, allow_infinity=False),
            st.dictionaries(st.sampled_from(["name", "namespace"]), st.text(max_size=300)),
        ),
    )
)
def test_any_json_record_reads_without_raising_and_within_bounds(doc: dict) -> None:  # type: ignore[type-arg]
    rec = parse(json.dumps(doc))
    if rec is None:
        return
    r = rejection(rec)
    if r is not None:
        assert len(r.pod) <= POD_MAX and len(r.pod_uid) <= POD_UID_MAX
        assert len(r.message) <= MESSAGE_MAX
