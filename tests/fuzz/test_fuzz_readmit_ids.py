"""Checkpointed device IDs of any text through the bridge's parser and judge
(readmit/devids.py, readmit/presence.py): never a traceback, a replica is judged as its
base, and nothing is present in a view that knows no GPU."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from fuzz.budget import budget
from gpuguard.checkpoint.history import Generation, GpuIdentity, MigIdentity
from gpuguard.host.inventory import Gpu, Inventory, MigDevice
from gpuguard.readmit.devids import parse_id
from gpuguard.readmit.presence import NodeDevices, from_inventory, from_pci_history

_ids = st.one_of(
    st.text(max_size=80),
    st.from_regex(r"(GPU-[0-9a-f-]{1,12}|MIG-[0-9a-f-]{1,12}|\d{1,3}|\d:\d|MIG-GPU-a/\d/\d)"
                  r"(::\d{1,3})?", fullmatch=True),
)  # fmt: skip
GEN = Generation(
    (GpuIdentity("GPU-a", "0000:17:00.0", 0, 0, mig=(MigIdentity("MIG-1", 1, 0),)),), 1.0
)
INV = Inventory((Gpu("GPU-a", 0, 0, "0000:17:00.0", (MigDevice("MIG-1", 1, 0),)),), "nvml")
VIEWS = (from_inventory(INV, GEN, "NVML"), from_pci_history((), GEN, ""), NodeDevices(""))


@budget(300)
@given(_ids)
@example("GPU-a::")
@example("::1")
@example("0:0::99999999999")
def test_any_id_is_parsed_and_judged_without_a_traceback(raw: str) -> None:
    d = parse_id(raw)
    assert raw.startswith(d.base)
    for view in VIEWS:
        why = view.judge(raw)
        assert isinstance(why, str)
        if d.replica is not None:
            assert why == view.judge(d.base)
    assert VIEWS[2].judge(raw) != ""  # a view that knows no GPU vouches for nothing
    assert VIEWS[1].judge(raw) != ""  # nor one whose every slot is empty
