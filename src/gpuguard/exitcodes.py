"""Process exit codes, documented in docs/exit-codes.md and gpuguard(8)."""

OK = 0  # healthy, or every finding repaired
FINDINGS = 1  # problems found and left as they are (dry-run, policy, or a repair declined)
USAGE = 2  # bad command line or configuration
BAD_INPUT = 3  # an input file (checkpoint, inventory) is unreadable or corrupt; nothing modified
NO_DRIVER = 4  # no NVIDIA driver / libnvidia-ml, and no --inventory to stand in for it
KUBELET = 5  # kubelet not stopped/restarted/started around a repair, or the repair unverified
INTERNAL = 70  # a bug: EX_SOFTWARE
