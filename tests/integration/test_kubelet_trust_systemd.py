"""A local unprivileged user cannot make gpuguard act on a unit: on a real systemd (a
private namespace), a process named `kubelet` that `nobody` runs in sshd.service is
reported (kubelet-process-untrusted) and chooses nothing. `gpuguard check` with a stale
checkpoint, [Kubelet] Unit= empty, runs the F1 repair's jobs on kubelet.service only;
sshd.service keeps running, with the same main process. On the code before the trust
rule, the lowest-pid process named kubelet (the user's) chose sshd.service: "stop
sshd.service, start sshd.service"."""

from __future__ import annotations

import json

import pytest

from gpuguard import exitcodes
from integration.gpuguard_ns import CHECKPOINT, FIXTURE, gpuguard_units, setup_node, wait_for
from integration.harness import systemd_ns as systemd_ns
from integration.test_check_systemd import gpuguard_check, start_kubelet

pytestmark = pytest.mark.root

HOSTILE = "/tmp/hostile/kubelet"  # a copy of sleep: its process is named kubelet
SSHD = f"[Service]\nUser=nobody\nExecStart={HOSTILE} infinity\n"


def test_a_users_kubelet_in_sshd_service_chooses_no_unit(systemd_ns) -> None:  # type: ignore[no-untyped-def]
    u = gpuguard_units()
    del u["kubelet.service.d/10-gpuguard.conf"]  # the repair is stop, repair, start
    del u["kubelet.service.d/50-checkout.conf"]
    ns = systemd_ns(units={**u, "sshd.service": SSHD})
    setup_node(ns, stale=True)
    ns.run(["mkdir", "-p", "/tmp/hostile"], check=True)
    ns.run(["cp", "/bin/sleep", HOSTILE], check=True)
    ns.run(["chmod", "0755", "/tmp/hostile", HOSTILE], check=True)
    ns.systemctl("start", "sshd.service")  # first: the lowest pid of the two
    ns.wait_active("sshd.service")
    sshd_pid = ns.unit_property("sshd.service", "MainPID")
    wait_for(
        lambda: ns.path(f"/proc/{sshd_pid}/comm").read_text().strip() == "kubelet",
        what="the user's process named kubelet",
    )
    start_kubelet(ns)

    code, out, log = gpuguard_check(ns, "--dry-run")
    assert code == exitcodes.FINDINGS, out
    # sshd.service appears only in the finding that ignores the user's process
    named = [line for line in out.splitlines() if "sshd.service" in line]
    assert named and all(f"(pid {sshd_pid}) in sshd.service ignored" in n for n in named), out
    assert "kubelet.service: stop it, repair, start it" in out or "for kubelet.service" in out
    assert ns.path(CHECKPOINT).read_bytes() == FIXTURE.read_bytes()

    code, out, log = gpuguard_check(ns)
    assert code == exitcodes.OK, out + json.dumps(log)
    jobs = [(r["kind"], r.get("UNIT")) for r in log if r["kind"].startswith("kubelet-st")]
    assert jobs == [("kubelet-stop", "kubelet.service"), ("kubelet-start", "kubelet.service")]
    (untrusted,) = [r for r in log if r["kind"] == "kubelet-process-untrusted"]
    assert untrusted["PID"] == str(sshd_pid) and untrusted["UNIT"] == "sshd.service"
    assert ns.unit_property("sshd.service", "ActiveState") == "active"
    assert ns.unit_property("sshd.service", "MainPID") == sshd_pid
