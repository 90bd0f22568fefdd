"""Fake GPU nodes with generated containers, devices.list, cgroup.procs and /proc/devices
texts, through `gpuguard check` and `gpuguard status`.

For every node: no traceback, a documented exit code; `check --dry-run` changes no
byte (nor node, nor link) of the root; the real run does exactly what the dry-run
planned (same actions, same targets); a container whose files are bad costs that
container only; no pre-existing file but a cgroup control file is modified.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from conftest import REPO, require_root
from fakenode import (
    PROC_DEVICES,
    RUNC_LIST,
    FakeContainer,
    Run,
    assert_clean,
    build_node,
    checkpoint_for,
    gpu_uuid,
    run_cli,
    tree,
)
from fuzz.budget import budget

_rule = st.one_of(
    st.sampled_from(
        [
            "c 195:0 rw",
            "c 195:* rwm",
            "c 195:255 rw",
            "c 511:0 rw",
            "c 511:1 rw",
            "b 8:0 r",
            "a *:* rwm",
            "c 195:" + "9" * 5000 + " rw",
            "c \u0661\u0669\u0665:0 rw",
            "bogus",
            "c 195:0",
            "",
        ]
    ),
    st.text(max_size=12),
)
devices_lists = st.one_of(
    st.just(RUNC_LIST),
    st.just(RUNC_LIST + "c 195:0 rw\nc 195:255 rw\nc 511:0 rw\nc 511:1 rw\n"),
    st.lists(_rule, max_size=6).map(lambda rules: "".join(r + "\n" for r in rules)),
)
_procs = st.one_of(
    st.none(),  # its own PID
    st.sampled_from(["", "\n", "not-a-pid\n", "\u00b2\n", "9" * 5000 + "\n", "0\n", "-3\n"]),
    st.text(max_size=10),
)
_visible = st.one_of(
    st.none(),  # the UUIDs of its GPUs
    st.sampled_from(["all", "none", "void", "", "0", "1", gpu_uuid(0), gpu_uuid(7), "x" * 5000]),
)
proc_devices = st.one_of(
    st.just(PROC_DEVICES),
    st.sampled_from(
        [
            PROC_DEVICES.replace("195 nvidia", "\u0661\u0669\u0665 nvidia"),
            PROC_DEVICES.replace("195 nvidia", "9" * 5000 + " nvidia"),
            PROC_DEVICES.replace("\n", "\f"),
            PROC_DEVICES + "195 nvidia\n",
            "Block devices:\n195 nvidia\n",
        ]
    ),
    st.text(max_size=40).map(lambda t: "Character devices:\n" + t),
    st.text(max_size=40).map(lambda t: PROC_DEVICES + t),
)


@st.composite
def containers(draw: Any, *, clean: bool = False) -> list[FakeContainer]:
    out = []
    for n in range(1, draw(st.integers(1, 4)) + 1):
        gpus = tuple(sorted(draw(st.sets(st.integers(0, 2), max_size=2))))
        out.append(
            FakeContainer(
                pod=draw(st.integers(1, 3)),
                number=n,
                gpus=gpus,
                visible=None if clean else draw(_visible),
                devices_list=draw(devices_lists),
                cgroup_procs=None if clean else draw(_procs),
            )
        )
    return out


def _actions(run: Run) -> list[tuple[str, str, str, str]]:
    """What a run did or would do, from its --json report: (step, kind, target, fields),
    the fields naming the very devices, numbers and units."""
    if not run.out.startswith("{"):
        return []
    doc = run.json()
    acts = doc.get("actions", []) + doc.get("devices", {}).get("outcomes", [])
    return sorted(
        (a["reconciler"], a["kind"], a["target"], json.dumps(a["fields"], sort_keys=True))
        for a in acts
    )


def _node_properties(cs: list[FakeContainer], proc: str, with_checkpoint: bool) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        ckpt = checkpoint_for(cs) if with_checkpoint else None
        inv = build_node(root, cs, n_gpus=3, proc_devices=proc, checkpoint=ckpt)
        before = tree(root)
        argv = ["check", "--root", d, "--inventory", str(inv), "--json"]
        dry = run_cli(*argv, "--dry-run")
        assert_clean(dry, argv)
        assert tree(root) == before, "--dry-run changed the root"
        status = run_cli("status", "--root", d, "--inventory", str(inv), "--json")
        assert_clean(status, ["status"])
        real = run_cli(*argv)
        assert_clean(real, argv)
        assert _actions(real) == _actions(dry), "the real run did not do what its dry-run planned"
        after = tree(root)
        changed = {p for p in before if after.get(p) != before[p]}
        # Only cgroup control files are written in place (the kernel keeps no bytes there
        # to back up); the checkpoint is valid here, so it is never rewritten.
        assert all(p.endswith("/devices.allow") for p in changed), sorted(changed)
        unread = (
            [
                f
                for f in real.json().get("devices", {}).get("findings", [])
                if f["kind"] == "container-unreadable"
            ]
            if real.out.startswith("{")
            else []
        )
        for f in unread:  # a container we could not read is granted nothing
            cid = f["fields"]["CONTAINER_ID"]
            c = next(c for c in cs if c.container_id == cid)
            allow = root / c.cgroup.lstrip("/") / "devices.allow"
            assert allow.read_text() == "", f["summary"]


@pytest.fixture(autouse=True)
def _root_for_mknod() -> None:
    require_root()  # fake GPU nodes are real character nodes (mknod), in temp dirs only


@budget(40)
@given(containers(), proc_devices, st.booleans())
@example(
    [FakeContainer(1, 1, (0,)), FakeContainer(2, 2, (1,), devices_list="c 195:0 rwm\nbogus\n")],
    PROC_DEVICES,
    True,
)
@example(
    [FakeContainer(1, 1, (0,)), FakeContainer(2, 2, (1,), cgroup_procs="\u00b2\n")],
    PROC_DEVICES,
    False,
)
def test_generated_nodes(cs: list[FakeContainer], proc: str, with_checkpoint: bool) -> None:
    _node_properties(cs, proc, with_checkpoint)


# Issue 10's dry-run parity defect, as the fuzz suite found it: a pod's checkpoint entry
# names its GPU plus a stale ID; its container's /dev also holds a GPU that its
# NVIDIA_VISIBLE_DEVICES and the checkpoint both contradict. The dry-run declines to
# grant it; the real run repairs the checkpoint (dropping the entry) and must still
# decline: the run decides from one snapshot, and the dropped entry is kept as evidence.
@budget(10)
@given(st.sampled_from([(0, 1), (0, 2), (1, 2)]), st.booleans())
def test_stale_checkpoint_entry_and_contradicted_gpu_parity(
    gpus: tuple[int, int], other_container: bool
) -> None:
    from gpuguard.checkpoint import Checkpoint, PodDevicesEntry, marshal

    given_gpu, extra = gpus
    c = FakeContainer(1, 1, (given_gpu, extra), visible=gpu_uuid(given_gpu))
    cs = [c] + ([FakeContainer(2, 2, (2 if extra != 2 else 0,))] if other_container else [])
    entry = PodDevicesEntry(
        c.pod_uid,
        "c1",
        "nvidia.com/gpu",
        (("0", (gpu_uuid(given_gpu), "GPU-00000000-dead-4000-8000-00000000beef")),),
        b"",
    )
    ckpt = marshal(
        Checkpoint("v2", (entry,), (("nvidia.com/gpu", (gpu_uuid(given_gpu),)),), 0, None)
    )
    with tempfile.TemporaryDirectory() as d:
        inv = build_node(Path(d), cs, n_gpus=3, checkpoint=ckpt)
        argv = ["check", "--root", d, "--inventory", str(inv), "--json"]
        dry = run_cli(*argv, "--dry-run")
        real = run_cli(*argv)
        assert_clean(real, argv)
        assert [a for a in _actions(real) if a[0] != "checkpoint"] == [
            a for a in _actions(dry) if a[0] != "checkpoint"
        ]


def test_a_few_nodes_as_subprocesses() -> None:
    """The installed entry point: exit code and stderr of the real process."""
    cs = [
        FakeContainer(1, 1, (0,)),
        FakeContainer(2, 2, (1,), devices_list="c 195:" + "9" * 5000 + " rw\n"),
        FakeContainer(3, 3, (2,), cgroup_procs="\u00b2\n"),
    ]
    for proc in (PROC_DEVICES, PROC_DEVICES.replace("195 nvidia", "9" * 5000 + " nvidia")):
        with tempfile.TemporaryDirectory() as d:
            inv = build_node(Path(d), cs, n_gpus=3, proc_devices=proc)
            for args in (["check", "--dry-run"], ["status"], ["check"]):
                out = subprocess.run(
                    [sys.executable, "-m", "gpuguard", *args, "--root", d, "--inventory", str(inv)],
                    env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"},
                    capture_output=True,
                    text=True,
                    timeout=120,
                    check=False,
                )
                assert_clean(Run(out.returncode, out.stdout, out.stderr), args)
