"""Issue 9.2 and 9.3, as an operator sees them on a real systemd with the repo's units.

- A broken /etc/gpuguard/gpuguard.conf stops gpuguard.service (failed, no restart
  loop), and its status and journal name the file and line.
- A person's `gpuguard check` on a terminal (not under a unit) leaves its changes in
  the node's journal with their MESSAGE_ID, and human-readable text on the terminal.
"""

from __future__ import annotations

import json
import time

import pytest

from gpuguard.journal.catalog import message_id
from integration.gpuguard_ns import CHECKPOINT, FIXTURE, GPUGUARD, gpuguard_units, setup_node
from integration.harness import systemd_ns as systemd_ns

pytestmark = pytest.mark.root


def test_a_config_error_fails_the_unit_instead_of_a_restart_loop(systemd_ns) -> None:  # type: ignore[no-untyped-def]
    ns = systemd_ns(units=gpuguard_units())
    setup_node(ns, stale=False, config="[Kubelet]\nPolicy=sometimes\n")  # line 4
    r = ns.systemctl("start", "gpuguard.service", check=False)
    assert r.returncode != 0
    time.sleep(3)  # RestartSec=2s: a restart would have happened by now
    show = dict(
        line.split("=", 1)
        for line in ns.systemctl(
            "show",
            "-p",
            "ActiveState,NRestarts,ExecMainStatus,Result,StatusText",
            "gpuguard.service",
        ).stdout.splitlines()
    )
    assert show["ActiveState"] == "failed", show
    assert show["NRestarts"] == "0" and show["ExecMainStatus"] == "2", show
    assert "gpuguard.service" in ns.systemctl("--failed", "--plain").stdout
    invalid = message_id("config-invalid")
    entries = [e for e in ns.journal("gpuguard.service") if e.get("MESSAGE_ID") == invalid]
    assert len(entries) == 1, entries
    assert entries[0]["MESSAGE"].startswith("/etc/gpuguard/gpuguard.conf:4: "), entries[0]
    assert entries[0]["PRIORITY"] == "3"
    status = ns.systemctl("status", "gpuguard.service", check=False).stdout
    assert "/etc/gpuguard/gpuguard.conf:4: " in status, status


def test_a_check_from_a_terminal_is_in_the_journal(systemd_ns) -> None:  # type: ignore[no-untyped-def]
    ns = systemd_ns(units=gpuguard_units())
    setup_node(ns, stale=True)
    cmd = f"{GPUGUARD} check --only checkpoint --inventory /etc/gpuguard/inventory.json"
    # script(1) gives the command a real terminal (a pty) for stdout and stderr.
    p = ns.run(["script", "-qec", cmd, "/dev/null"], check=True)

    assert "result:     repaired" in p.stdout
    assert "gpuguard: notice: rewrite /var/lib/kubelet" in p.stdout
    assert "[checkpoint-repaired]" in p.stdout
    assert not [line for line in p.stdout.splitlines() if line.lstrip().startswith("{")]
    assert ns.path(CHECKPOINT).read_bytes() != FIXTURE.read_bytes()
    journal = ns.journal()
    (repaired,) = [e for e in journal if e.get("MESSAGE_ID") == message_id("checkpoint-repaired")]
    assert repaired["SYSLOG_IDENTIFIER"] == "gpuguard" and repaired["PRIORITY"] == "5"
    assert repaired["GPUGUARD_KIND"] == "checkpoint-repaired"
    assert repaired["BACKUP"].startswith("/var/lib/gpuguard/backups/")
    assert "_SYSTEMD_UNIT" not in repaired or repaired["_SYSTEMD_UNIT"] != "gpuguard.service"
    stale = [e for e in journal if e.get("MESSAGE_ID") == message_id("checkpoint-stale-entry")]
    assert stale and all(e["GPUGUARD_RECONCILER"] == "checkpoint" for e in stale)
    # JSON lines on the terminal only when asked.
    setup_node(ns, stale=True)
    p = ns.run(
        ["script", "-qec", cmd, "/dev/null"], check=True, env={"GPUGUARD_LOG_FORMAT": "json"}
    )
    records = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert "checkpoint-repaired" in [r["kind"] for r in records]
