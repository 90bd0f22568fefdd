from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuguard.errors import BadInputError, NoDriverError
from gpuguard.host.inventory import load_inventory_file, load_nvml_inventory

GOOD = {
    "gpus": [
        {
            "uuid": "GPU-0650a168-e770-3ea8-8ac3-8a1d419763e0",
            "index": 0,
            "minor": 0,
            "pci_bus_id": "00000000:00:07.0",
            "mig": [{"uuid": "MIG-1f3a9c2e-5b7d-5e21-9a3b-2c4d6e8f0a1b", "gi": 1, "ci": 0}],
        }
    ]
}


def test_good_inventory(tmp_path: Path) -> None:
    p = tmp_path / "inv.json"
    p.write_text(json.dumps(GOOD))
    inv = load_inventory_file(p)
    assert inv.gpus[0].mig[0].gi == 1
    assert inv.source == str(p)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("not json", "not valid JSON"),
        ("[]", 'object with a "gpus" list'),
        ('{"gpus": [{"index": 0}]}', "missing 'uuid'"),
        (
            '{"gpus": [{"uuid": "GPU-a", "index": true, "minor": 0, "pci_bus_id": "x"}]}',
            "'index' must be a int",
        ),
        (
            '{"gpus": [{"uuid": "GPU-a", "index": 0, "minor": 0, "pci_bus_id": "x", "mig": [1]}]}',
            "mig[0]: must be an object",
        ),
        (
            '{"gpus": [{"uuid": "GPU-a", "index": 0, "minor": 0, "pci_bus_id": "x"},'
            ' {"uuid": "GPU-a", "index": 1, "minor": 1, "pci_bus_id": "y"}]}',
            "listed twice",
        ),
    ],
)
def test_bad_inventory(tmp_path: Path, content: str, needle: str) -> None:
    p = tmp_path / "inv.json"
    p.write_text(content)
    with pytest.raises(BadInputError) as e:
        load_inventory_file(p)
    assert str(p) in str(e.value) and needle in str(e.value)


def test_missing_inventory(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match="cannot read inventory"):
        load_inventory_file(tmp_path / "nope.json")


def test_no_driver_is_a_clean_error() -> None:
    # This machine has no NVIDIA driver: NVML must say so in one line.
    try:
        load_nvml_inventory()
    except NoDriverError as e:
        assert "\n" not in e.message and e.exit_code == 4
    else:  # pragma: no cover - only on a GPU host
        pytest.skip("a real NVIDIA driver is present")
