"""Each state file's writer against its reader: what the writer writes, the reader
reads back; what the reader would refuse, the writer refuses to write (and says why),
leaving the file as it was. Every StateFile in gpuguard must have its pair here."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from pathlib import Path
from typing import Any

import pytest

import gpuguard
import statusdoc
from gpuguard.actuate.statefile import UnreadableStateError, write_state
from gpuguard.checkpoint import dropped, history
from gpuguard.checkpoint.history import Generation, GpuIdentity, History, MigIdentity
from gpuguard.host.statefile import StateFile, load
from gpuguard.readmit import observe as readmit_observe
from gpuguard.readmit import state as readmit_state
from gpuguard.reporting import metrics_file
from gpuguard.reporting.metrics_file import MetricsValues, Series
from gpuguard.reporting.status import SPEC as STATUS_SPEC
from gpuguard.steps.checkpoint import kubelet_hook as kh
from gpuguard.steps.checkpoint import memo
from gpuguard.steps.device_plugin import state as plugin_state

SHA = "ab" * 32
U = "GPU-77a702db-e37f-3a74-d46d-c5713f66058c"


def gpu(uuid: str = U, bus: str = "0000:04:00.0", index: int = 0, minor: int = 0) -> GpuIdentity:
    return GpuIdentity(uuid, bus, index, minor, 0)


def hist(*gpus: GpuIdentity) -> History:
    return History((Generation(gpus, 1.0, "boot", "nvml"),))


def _huge_history(per_gpu: int = 64) -> History:
    migs = tuple(MigIdentity(f"MIG-{g:04x}{m:04x}-aaaa-bbbb-cccc-dddddddddddd", m, 0)
                 for g in range(1) for m in range(per_gpu))  # fmt: skip
    gens = tuple(
        Generation(tuple(
            GpuIdentity(f"GPU-{n:04x}{i:04x}-aaaa-bbbb-cccc-dddddddddddd", f"0000:{i:02x}:00.0",
                        i, i, 0, tuple(dataclasses.replace(m, uuid=f"{m.uuid}{n}{i}")
                                       for m in migs))
            for i in range(256)), float(n), "b", "nvml")
        for n in range(4)
    )  # fmt: skip
    return History(gens)


RESULT = kh.HookResult("ab" * 16, kh.REPAIRED, "detail", SHA, SHA, 1.0, 0)
# name -> (spec, a value its reader reads back, values its reader refuses)
PAIRS: dict[str, tuple[StateFile[Any], Any, list[Any]]] = {
    "history": (
        history.SPEC,
        hist(gpu(), gpu("GPU-9b341c59-f96b-ba85-c137-78c3652fea65", "0000:82:00.0", 1, 1)),
        [
            # two bus ids equal once normalised
            hist(gpu(), gpu("GPU-9b341c59-f96b-ba85-c137-78c3652fea65", "0000:04:00.0 ", 1, 1)),
            hist(gpu(bus="")),  # an empty bus id
            hist(gpu(uuid="GPU-" + "a" * 125)),  # a UUID of 129 characters
            _huge_history(),  # more than 1 MiB
        ],
    ),
    "hook-request": (
        kh.REQUEST_SPEC,
        kh.HookRequest("ab" * 16, 1.0),
        [kh.HookRequest("not hex", 1.0)],
    ),
    "hook-result": (
        kh.RESULT_SPEC,
        RESULT,
        [dataclasses.replace(RESULT, before_sha256="zz", exit_code=300)],
    ),
    "memo": (
        memo.SPEC,
        memo.MemoKey("0.1", "/ckpt", SHA, SHA, ("nvidia.com/gpu",)),
        [memo.MemoKey("0.1", "/ckpt", "not a sha", "inv", ())],
    ),
    "dropped": (
        dropped.SPEC,
        (dropped.DroppedEntry("pod", "c", "nvidia.com/gpu", (U,), "2026-01-01T00:00:00Z"),),
        [(dropped.DroppedEntry("p" * 300, "c", "nvidia.com/gpu", (U,), "t"),)],
    ),
    "plugin-state": (
        plugin_state.SPEC,
        {"plugin": plugin_state.PluginState(failures=1)},
        [{"plugin": plugin_state.PluginState(failures=-1)}],
    ),
    "kubelet-version": (
        readmit_observe.CACHE,
        readmit_observe.KubeletVersion(
            "/usr/bin/kubelet", "2049:131:58720256:1", "1.34.9", "v1.34.9"
        ),
        [readmit_observe.KubeletVersion("/usr/bin/kubelet", "i" * 300, "1.34", "v1.34.9")],
    ),
    "readmit-state": (
        readmit_state.SPEC,
        readmit_state.ReadmitState(
            "131:1764342378123456789",
            1764342378.12,
            "offered",
            "2 of 2 GPU pods have no running process",
            (readmit_state.Registration("nvidia.com/gpu", 1764342378.14, (U,), 1764342378.15),),
            ("nvidia-gpu.sock",),
            1764342378.19,
            (readmit_state.RejectedPod("u1", "default/a", "UnexpectedAdmissionError", "m", 1.0),),
            1764342503.0,
        ),
        [readmit_state.ReadmitState("k", 1.0, "skip", "d" * 500)],
    ),
    "metrics": (
        metrics_file.SPEC,
        MetricsValues({"gpuguard_gpus": (Series((), 1.0),)}),
        [MetricsValues({"gpuguard_gpus": (Series((), float("nan")),)})],
    ),
    "status": (
        STATUS_SPEC,
        statusdoc.model({}),
        [dataclasses.replace(statusdoc.model({}), pid=-5)],
    ),
}


def test_every_state_file_has_its_pair_here() -> None:
    found = set()
    for info in pkgutil.walk_packages(gpuguard.__path__, "gpuguard."):
        if info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional dependency (dbus, prometheus) is missing
            continue
        found |= {id(v) for v in vars(module).values() if isinstance(v, StateFile)}
    assert found == {id(spec) for spec, _ok, _bad in PAIRS.values()}


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_the_writer_writes_only_what_its_reader_reads(name: str, tmp_path: Path) -> None:
    spec, ok, bad = PAIRS[name]
    path = tmp_path / "state" / "file.json"
    write_state(path, spec, ok)
    assert load(path, spec).value == ok
    before = path.read_bytes()
    for value in bad:
        with pytest.raises(UnreadableStateError, match="not written"):
            write_state(path, spec, value)
        assert path.read_bytes() == before  # the last good file stays
        assert spec.refuses(value)[1]


def test_history_says_why_it_cannot_be_written() -> None:
    _spec, ok, bad = PAIRS["history"]
    assert history.unwritable(ok) == ""
    whys = [history.unwritable(h) for h in bad]
    assert "bus id is listed twice" in whys[0] and "empty" in whys[1]
    assert "129 characters" in whys[2] and "bytes" in whys[3]


def test_the_oldest_generations_give_way_to_fit_the_bound() -> None:
    huge = _huge_history(16)  # about 400 KB a generation
    assert history.unwritable(huge)
    newer = huge.generations[-1]
    out = history.advance(History(huge.generations[:-1]), newer)
    assert out is not None and out.generations[-1] == newer
    assert 1 <= len(out.generations) < 4 and history.unwritable(out) == ""
