"""Catalog entries of operating gpuguard itself: the off switch and observe-only mode,
as (subject, text); catalog.KINDS holds them with the rest."""

from __future__ import annotations

_OFF = (
    "While /etc/gpuguard/disabled exists gpuguard changes nothing on this node: "
    "gpuguard.service and the driver-load trigger do not start, a running daemon stops "
    "before its next pass, kubelet's pre-start hook and `gpuguard check` only report. "
    "The file survives reboots and package upgrades. `gpuguard enable` (or removing the "
    "file, then `systemctl start gpuguard`) turns gpuguard back on."
)

OPS_KINDS: dict[str, tuple[str, str]] = {
    "gpuguard-disabled": (
        "gpuguard was turned off on this node",
        "`gpuguard disable` set the off switch, or the daemon found it set (by "
        "configuration management, say) and stopped; the message gives the reason. " + _OFF,
    ),
    "gpuguard-enabled": (
        "gpuguard was turned back on on this node",
        "`gpuguard enable` removed the off switch /etc/gpuguard/disabled and started "
        "gpuguard.service (if it is enabled in systemd). Repairs resume with its first pass.",
    ),
    "disabled-skip": (
        "gpuguard is off: this run changed nothing",
        "kubelet's pre-start hook did not check the kubelet checkpoint, or `gpuguard check` "
        "ran as a dry run, because the off switch is set. " + _OFF,
    ),
    "grant-protected": (
        "gpuguard made a GPU container's present grant durable before a daemon-reload",
        "`gpuguard protect` (run by the package's maintainer scripts before each "
        "`systemctl daemon-reload` they cause) wrote the container scope's drop-in "
        "/run/systemd/system/SCOPE.d/60-gpuguard-devices.conf with the nodes the kernel "
        "admitted at that moment, so that systemd's re-apply of the scope's device policy "
        "at the reload keeps them. It grants nothing that was denied and runs in observe "
        "mode too: it keeps the package's own action from taking a device away, it is no "
        "repair of the node. The drop-in goes at the next boot (/run), or once the scope "
        "is gone while gpuguard runs.",
    ),
    "observe-only": (
        "gpuguard runs observe-only: it reports and changes nothing",
        "Mode=observe (or DryRun=yes) in the configuration: findings, the plan of each "
        "repair, metrics and node conditions are reported as in repair mode, and nothing "
        "is changed (no checkpoint rewrite, no kubelet or device plugin restart, no cgroup "
        "write, device program, unit property or drop-in). One write is no repair and "
        "happens in this mode too: before each daemon-reload the package's maintainer "
        "scripts cause, `gpuguard protect` writes each running GPU container's present "
        "grant as its scope's drop-in (grant-protected). Set Mode=repair in a drop-in "
        "of /etc/gpuguard/gpuguard.conf.d/ and run `systemctl reload gpuguard` to repair.",
    ),
}
