"""The re-admission bridge's readers of what others send it: kubelet's kubeconfig, the
API server's answer, kubelet's podresources List and AllocateRequest. Whatever they
hold, each gives typed rows or its one error (BadInputError, KubeApiError, ValueError),
never another exception, and never a row field past its bound."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzz.budget import budget
from gpuguard.errors import BadInputError
from gpuguard.host.kubeapi import KubeApiError, parse_kubeconfig, parse_pods
from gpuguard.readmit.wire import allocate_request_ids
from gpuguard.readmit.withdraw import decode_list

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=300)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=20), inner, max_size=5)
    ),
    max_leaves=30,
)
KEYS = ["metadata", "uid", "name", "namespace", "status", "phase", "annotations",
        "ownerReferences", "deletionTimestamp", "creationTimestamp", "kind", "items"]  # fmt: skip
pod_like = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(KEYS), inner, max_size=6)
    ),
    max_leaves=40,
)


@budget(300)
@given(st.one_of(json_values, pod_like.map(lambda v: {"kind": "PodList", "items": [v, v]})))
def test_any_answer_gives_rows_or_its_error(answer: Any) -> None:
    try:
        rows = parse_pods(answer)
    except KubeApiError:
        return
    for r in rows:
        assert r.uid and len(r.uid) <= 64 and len(r.name) <= 253 and len(r.phase) <= 32
        assert all(isinstance(o.kind, str) for o in r.owners) and len(r.owners) <= 16


@budget(300)
@given(
    st.one_of(
        st.text(max_size=400),
        json_values.map(json.dumps),  # JSON is YAML
        st.fixed_dictionaries(
            {
                "current-context": st.sampled_from(["c", "", "x"]),
                "contexts": json_values,
                "clusters": json_values,
                "users": json_values,
            }
        ).map(json.dumps),
    )
)
def test_any_kubeconfig_gives_a_config_or_one_line(text: str) -> None:
    try:
        cfg = parse_kubeconfig(text, "/etc/kubernetes/kubelet.conf")
    except BadInputError as e:
        assert "\n" not in e.message and e.message.startswith("/etc/kubernetes/kubelet.conf:")
        return
    assert cfg.server.startswith("https://")


@budget(500)
@given(st.binary(max_size=300))
def test_any_bytes_from_kubelet_decode_or_raise_value_error(data: bytes) -> None:
    for decode in (decode_list, allocate_request_ids):
        with contextlib.suppress(ValueError):
            decode(data)


def test_the_strategies_reach_a_row() -> None:
    pod = {"metadata": {"uid": "u"}, "status": {"phase": "Running"}}
    assert parse_pods({"kind": "PodList", "items": [pod]})[0].uid == "u"
    with pytest.raises(KubeApiError):
        parse_pods({"kind": "Status"})
