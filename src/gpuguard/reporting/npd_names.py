"""`gpuguard npd`'s command line: the condition names and the defaults, apart from the
conditions themselves (npd.py), so that building the parser, which every command does,
loads neither the conditions nor the status file's model. tests/unit/test_npd.py checks
that the names are npd.CONDITIONS' own, in order."""

from __future__ import annotations

NAMES = ("device-access", "checkpoint", "device-plugin", "gpu-count", "gpu-pods")
DEFAULT_MAX_LENGTH = 80  # NPD's default max_output_length
DEFAULT_MAX_AGE = 7200.0  # two default audit intervals
