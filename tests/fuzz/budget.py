"""The fuzz suite's budget: small and fixed in CI, as large as asked for in a bench run.

GPUGUARD_FUZZ_EXAMPLES=N runs every fuzz test with N examples instead of its CI
default (bench/README.md: `GPUGUARD_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest
tests/fuzz`). No example database: a CI run never replays another run's examples, and
a failure prints the example to reproduce it with @example.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

EXAMPLES_ENV = "GPUGUARD_FUZZ_EXAMPLES"


def budget(ci_examples: int) -> settings:
    text = os.environ.get(EXAMPLES_ENV, "")
    n = int(text) if text.isascii() and text.isdigit() and int(text) > 0 else ci_examples
    return settings(
        max_examples=n,
        deadline=None,  # a run does real file I/O; timing belongs to bench/
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
