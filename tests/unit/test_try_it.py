"""scripts/try-it, a newcomer's first look, shows what the README leads with: the pod
remapped to the GPU now in its GPU's slot, from the history gpuguard recorded at its
first look, never the drop a node without a history gets."""

from __future__ import annotations

import subprocess

from conftest import REPO


def test_try_it_shows_the_remap() -> None:
    out = subprocess.run(
        [str(REPO / "scripts/try-it")], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "remap: pod 94283d1b-ce5a-4797-bff8-0cf0c7143b2b" in out
    assert '"kind": "checkpoint-entry-remapped"' in out
    assert "no GPU identity history" not in out and "checkpoint-entry-dropped" not in out
    assert "GPU-5d3e2a10-7c4b-4f0e-9a61-2b8e4c1d7f93, GPU-9b341c59" in out.split("### after\n")[-1]
