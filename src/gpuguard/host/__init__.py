"""Access to the host: the root prefix every path goes through, the one bounded reader,
numbers read from files, external commands, the systemd D-Bus client, sd_notify and the
GPU inventory (NVML or a file)."""
