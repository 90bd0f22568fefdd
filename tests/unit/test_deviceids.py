from __future__ import annotations

import pytest

from gpuguard.host.inventory import Gpu, Inventory, MigDevice
from gpuguard.steps.checkpoint.deviceids import Matcher, classify

G0 = "GPU-0650a168-e770-3ea8-8ac3-8a1d419763e0"
G1 = "GPU-77a702db-e37f-3a74-d46d-c5713f66058c"
M0 = "MIG-1f3a9c2e-5b7d-5e21-9a3b-2c4d6e8f0a1b"
GONE = "GPU-9b341c59-f96b-ba85-c137-78c3652fea65"

INV = Inventory(
    gpus=(
        Gpu(G0, 0, 0, "00000000:00:07.0", mig=(MigDevice(M0, gi=1, ci=0),)),
        Gpu(G1, 1, 1, "00000000:00:08.0"),
    ),
    source="test",
)


@pytest.mark.parametrize(
    ("raw", "form", "key", "replica"),
    [
        (G0, "gpu-uuid", G0, None),
        (f"{G0}::3", "gpu-uuid", G0, 3),
        (M0, "mig-uuid", M0, None),
        (f"{M0}::0", "mig-uuid", M0, 0),
        (f"MIG-{G0}/1/0", "mig-legacy", G0, None),
        (f"MIG-{G0}/7/2::5", "mig-legacy", G0, 5),
        ("0", "index", "0", None),
        ("12::1", "index", "12", 1),
        ("0:1", "mig-index", "0", None),
        ("tegra", "unknown", "tegra", None),
        ("GPU-", "unknown", "GPU-", None),
        ("gpu-0650a168", "unknown", "gpu-0650a168", None),
        ("", "unknown", "", None),
        ("MIG-GPU-x/1", "unknown", "MIG-GPU-x/1", None),
        ("::3", "unknown", "::3", None),
    ],
)
def test_classify(raw: str, form: str, key: str, replica: int | None) -> None:
    d = classify(raw)
    assert (d.form, d.key, d.replica) == (form, key, replica)


@pytest.mark.parametrize(
    ("raw", "exists"),
    [
        (G0, True),
        (G1, True),
        (GONE, False),
        (f"{G1}::7", True),
        (f"{GONE}::0", False),
        (M0, True),
        ("MIG-00000000-0000-0000-0000-000000000000", False),
        (f"MIG-{G0}/1/0", True),
        (f"MIG-{G0}/2/0", False),
        (f"MIG-{G1}/1/0", False),
        ("0", True),
        ("1", True),
        ("2", False),
        ("0:0", True),
        ("0:1", False),
        ("1:0", False),
    ],
)
def test_matcher(raw: str, exists: bool) -> None:
    assert Matcher(INV).exists(classify(raw)) is exists


def test_matcher_refuses_unknown_form() -> None:
    with pytest.raises(ValueError):
        Matcher(INV).exists(classify("tegra"))
