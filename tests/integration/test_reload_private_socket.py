"""The end of a daemon-reload read from systemd's private socket (issue 13): on a real
systemd, the daemon from its unit (its sandbox included) connects to
/run/systemd/private, receives every Reloading there as well as on the bus, acts on
each reload once and re-grants the GPU containers it wiped; with PrivateSocket= empty
it takes them from the bus alone. Which path wins a given reload is a race between two
sockets (the private copy usually, the bus's when the daemon is busy as systemd sends):
the test asserts what each path delivered, from the status file, not the winner. Each
reload's repair time is in the metrics (gpuguard_reload_repair_seconds)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict

import pytest

from integration.gpu_scopes import boot_node, containers, has, start, write_config
from integration.gpuguard_ns import GPUGUARD, events, start_gpuguard, status, wait_for
from integration.harness import systemd_ns as systemd_ns

pytestmark = pytest.mark.root

NOT_DURABLE = "[Devices]\nDurableGrants=no\n"  # every reload wipes the containers' grants


def _signal(ns) -> Dict[str, Any]:  # type: ignore[no-untyped-def]
    return dict(status(ns).get("reload_signal", {}))


def test_reloads_are_taken_from_the_private_socket_then_from_the_bus(
    systemd_ns, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    ctrs = containers(2)
    ns = boot_node(systemd_ns, tmp_path, ctrs, layout="v1", config=NOT_DURABLE)
    start_gpuguard(ns)
    for c in ctrs:
        start(ns, c)
    wait_for(lambda: _signal(ns).get("private_socket") is True, what="the private socket")
    (entry,) = [e for e in events(ns, "dbus-connected") if e.get("VIA") == "private-socket"]
    assert "/run/systemd/private" in entry["MESSAGE"]

    def known() -> bool:  # by a pass: what the reload fast path re-grants at once
        access = status(ns).get("steps", {}).get("container_access", {})
        return bool(access.get("gauges", {}).get("gpu_containers") == len(ctrs))

    def reload_restores(reloads: int, private: bool) -> None:
        wait_for(known, what="both containers judged by a pass")
        before = len(events(ns, "cgroup-v1-allow"))
        ns.systemctl("daemon-reload")
        wait_for(lambda: all(has(c, ns, (195, c.gpus[0])) for c in ctrs), what="every GPU back")
        # gpuguard's writes, not luck (journaled once every write is read back)
        wait_for(lambda: len(events(ns, "cgroup-v1-allow")) > before, what="the re-grants")
        for c in ctrs:
            assert not has(c, ns, (195, 1 - c.gpus[0]))
        # A pass writes the status file: SIGHUP asks for one once both copies are read.
        on_private = {"starts": reloads, "ends": reloads} if private else {"starts": 0, "ends": 0}
        expected = {"bus": {"starts": reloads, "ends": reloads}, "private-socket": on_private}

        def delivered() -> bool:
            assert ns.systemctl("reload", "gpuguard.service").returncode == 0
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                if _signal(ns).get("received") == expected:
                    return True
                time.sleep(0.05)
            return False

        wait_for(delivered, what=f"{expected} in the status file")
        assert _signal(ns)["reloads"] == reloads  # each acted on once
        # both re-granted on the signal, each reload's repair timed in the metrics
        repair = status(ns)["fast_paths"]["reload"]
        assert repair["containers"] == len(ctrs) and repair["restored"] >= repair["signal"]
        assert repair["cpu_ms"] >= 0 and repair["cpu_wait_ms"] >= 0  # the kernel's accounting
        text = ns.run([str(GPUGUARD), "status"], check=True).stdout
        assert "last reload: 2 of 2 known GPU container(s) re-granted on the signal" in text
        (hist,) = json.loads(ns.path("/run/gpuguard/metrics.json").read_text())["families"][
            "gpuguard_reload_repair_seconds"
        ]
        assert sum(hist["counts"]) == reloads and 0 < hist["sum"] < 5 * reloads
        assert _signal(ns)["last_via"] in (("private-socket", "bus") if private else ("bus",))

    reload_restores(1, private=True)
    reload_restores(2, private=True)
    # The bus alone, as before the private socket was used.
    write_config(ns, NOT_DURABLE + "[Daemon]\nPrivateSocket=\n")
    ns.systemctl("restart", "gpuguard.service")
    wait_for(lambda: _signal(ns).get("private_socket") is False, what="the restarted daemon")
    reload_restores(1, private=False)
