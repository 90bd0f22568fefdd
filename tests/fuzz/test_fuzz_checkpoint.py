"""Mutated and generated kubelet checkpoints through the real CLI.

For every input: `checkpoint inspect` and `check` print no traceback and exit with a
documented code; `check --dry-run` changes no byte of the root; a real `check` changes
the checkpoint only with a backup holding its original bytes, and does exactly the
actions its dry-run planned, remaps and drops included (the root's GPU identity history
knows the GPUs before the replacement, so stale entries are remapped where they can be).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from conftest import CHECKPOINTS
from fakenode import BACKUPS, CHECKPOINT, Run, assert_clean, run_cli, tree, write
from fuzz.budget import budget

FIXTURES = sorted(CHECKPOINTS.glob("*.json"))
STALE = CHECKPOINTS / "numa-blog-04.json"
# The GPUs of the numa-blog fixtures' node after an instance replacement: one UUID new.
INVENTORY = {
    "gpus": [
        {"uuid": u, "index": i, "minor": i, "pci_bus_id": f"00000000:{16 + i:02X}:00.0"}
        for i, u in enumerate(
            [
                "GPU-77a702db-e37f-3a74-d46d-c5713f66058c",
                "GPU-9b341c59-f96b-ba85-c137-78c3652fea65",
                "GPU-5d3e2a10-7c4b-4f0e-9a61-2b8e4c1d7f93",
            ]
        )
    ]
}

# What gpuguard recorded before the replacement: the third GPU had another UUID.
HISTORY = {
    "version": 1,
    "generations": [
        {
            "recorded_at": 1.0,
            "boot_id": "",
            "source": "nvml",
            "gpus": [
                {**g, "pci_bus_id": g["pci_bus_id"][4:], "numa_node": -1, "mig": []}
                for g in INVENTORY["gpus"][:2]
            ]
            + [
                {
                    "uuid": "GPU-c1e9f249-b37b-81c2-a8d9-ba5ca0294841",
                    "index": 2,
                    "minor": 2,
                    "pci_bus_id": "0000:12:00.0",
                    "numa_node": -1,
                    "mig": [],
                }
            ],
        }
    ],
}

HISTORY_PATH = "var/lib/gpuguard/gpu-identity.json"

HOSTILE_NUMBERS = [
    "9" * 5000,  # past Python's int conversion limit
    "18446744073709551616",  # 2**64
    "-1",
    "\u0663\u0663",  # Arabic-Indic digits
    "1e400",
    "0" * 300 + "1",
]
HOSTILE_TOKENS = [
    '"\u00e9\u00e9=="',
    "[" * 3000,
    "{}",
    "null",
    '"\u2028"',
    "\f",
    '"::' + "9" * 5000 + '"',
    '"MIG-GPU-77a702db-e37f-3a74-d46d-c5713f66058c/' + "1" * 5000 + '/0"',
    "\x00",
    '"\\ud800"',
]


@st.composite
def mutated(draw: Any) -> bytes:
    data = bytearray(draw(st.sampled_from(FIXTURES)).read_bytes())
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "number", "token", "truncate"]))
        pos = draw(st.integers(0, len(data)))
        if op == "flip" and data:
            i = min(pos, len(data) - 1)
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 16))]
        elif op == "number":
            digits = [i for i, b in enumerate(data) if 0x30 <= b <= 0x39]
            if digits:
                i = draw(st.sampled_from(digits))
                j = i
                while j < len(data) and 0x30 <= data[j] <= 0x39:
                    j += 1
                data[i:j] = draw(st.sampled_from(HOSTILE_NUMBERS)).encode()
        elif op == "token":
            data[pos:pos] = draw(st.sampled_from(HOSTILE_TOKENS)).encode("utf-8", "surrogatepass")
        else:
            del data[pos:]
    return bytes(data)


_json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.text(max_size=10),
    st.sampled_from(["GPU-77a702db-e37f-3a74-d46d-c5713f66058c", "0", "1:0", "x::3"]),
)
_keys = st.sampled_from(
    [
        "Data",
        "Checksum",
        "PodDeviceEntries",
        "RegisteredDevices",
        "PodUID",
        "ContainerName",
        "ResourceName",
        "DeviceIDs",
        "AllocResp",
        "0",
        "1",
        "-1",
        "nvidia.com/gpu",
        "BootID",
    ]
)
generated = st.recursive(
    _json_leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.dictionaries(_keys | st.text(max_size=4), kids, max_size=5)
    ),
    max_leaves=30,
).map(lambda doc: json.dumps(doc).encode())


def check_root(data: bytes) -> bool:
    """The four properties for one checkpoint, in a fresh root; True if it was repaired."""
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        inv = root / "inventory.json"
        write(inv, json.dumps(INVENTORY))
        path = root / CHECKPOINT.lstrip("/")
        write(path, data)
        write(root / "var/lib/gpuguard/gpu-identity.json", json.dumps(HISTORY))
        inspect = run_cli("checkpoint", "inspect", str(path), "--inventory", str(inv), "--json")
        assert_clean(inspect, ["inspect"])
        assert_clean(run_cli("checkpoint", "canonical", str(path)), ["canonical"])
        before = tree(root)
        argv = ["check", "--root", d, "--inventory", str(inv), "--json"]
        dry = run_cli(*argv, "--dry-run")
        assert_clean(dry, argv)
        assert tree(root) == before, "--dry-run changed the root"
        real = run_cli(*argv)
        assert_clean(real, argv)
        _same_plan(dry, real)
        return _backed_up(root, before, data)


def _backed_up(root: Path, before: dict[str, str], original: bytes) -> bool:
    after = tree(root)
    rel = CHECKPOINT.lstrip("/")
    # the history records the GPUs once the checkpoint matches them (a real run's job)
    changed = {p for p in before if after.get(p) != before[p]} - {HISTORY_PATH}
    assert changed <= {rel}, f"changed besides the checkpoint: {sorted(changed)}"
    if rel in changed:
        backups = root / BACKUPS.lstrip("/")
        held = [p.read_bytes() for p in backups.iterdir()] if backups.is_dir() else []
        assert original in held, "checkpoint changed without a backup of its original bytes"
    return rel in changed


def _plan(run: Run) -> list[tuple[str, str, str]]:
    if not run.out.startswith("{"):
        return []  # a one-line error: nothing was planned
    doc = run.json()
    return [
        (a["kind"], a["target"], json.dumps([a["fields"], a.get("remaps"), a.get("drops")]))
        for a in doc.get("actions", [])
    ]


def _same_plan(dry: Run, real: Run) -> None:
    assert _plan(real) == _plan(dry), "the real run's actions differ from the dry-run's plan"
    if _plan(dry):
        statuses = {o["status"] for o in dry.json()["outcomes"]}
        assert statuses <= {"dry-run"}, statuses


@budget(60)
@given(mutated())
@example(STALE.read_bytes().replace(b'"Checksum":', b'"Checksum":' + b"9" * 5000 + b"0", 1))
@example(STALE.read_bytes().replace(b'"DeviceIDs":{"', b'"DeviceIDs":{"' + b"7" * 5000, 1))
@example(STALE.read_bytes().replace(b'"AllocResp":"', b'"AllocResp":"\xc3\xa9\xc3\xa9', 1))
@example(STALE.read_bytes().replace(b'c5713f66058c"]', b"c5713f66058c::" + b"9" * 5000 + b'"]', 1))
@example(b"[" * 100_000)
def test_mutated_checkpoints(data: bytes) -> None:
    check_root(data)


@budget(40)
@given(generated)
def test_generated_checkpoints(data: bytes) -> None:
    check_root(data)


def test_every_fixture_repairs_with_a_matching_plan() -> None:
    repaired = [p.name for p in FIXTURES if check_root(p.read_bytes())]
    assert "numa-blog-04.json" in repaired  # the properties above saw real repairs


def test_the_remap_is_what_the_dry_run_planned() -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        write(root / "inventory.json", json.dumps(INVENTORY))
        write(root / CHECKPOINT.lstrip("/"), STALE.read_bytes())
        write(root / "var/lib/gpuguard/gpu-identity.json", json.dumps(HISTORY))
        argv = ["check", "--root", d, "--inventory", str(root / "inventory.json"), "--json"]
        dry, real = run_cli(*argv, "--dry-run"), run_cli(*argv)
        _same_plan(dry, real)
        (action,) = real.json()["actions"]
        assert [r["new_device_ids"] for r in action["remaps"]] == [
            ["GPU-5d3e2a10-7c4b-4f0e-9a61-2b8e4c1d7f93", "GPU-9b341c59-f96b-ba85-c137-78c3652fea65"]
        ]
