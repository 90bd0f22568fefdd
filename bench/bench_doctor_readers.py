#!/usr/bin/env python3
"""How long doctor's readers take on hostile configuration files at the 1 MiB read
bound: the `[a<spaces>b` TOML line (quadratic in the former regex reader: over 10 s at
64 KiB), deep YAML/TOML nesting (refused), and a long YAML scalar. Prints figures,
asserts nothing.

  .venv/bin/python bench/bench_doctor_readers.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from gpuguard.doctor.textconf import Unreadable, toml_scalars, yaml_top_scalars  # noqa: E402

MIB = 1024 * 1024
CASES: list[tuple[str, Callable[[str], object], str]] = [
    ("toml [a<64Ki spaces>b", toml_scalars, "[a" + " " * 65536 + "b\n"),
    ("toml [a<1MiB spaces>b", toml_scalars, "[a" + " " * (MIB - 8) + "b\n"),
    ("toml nested arrays 1MiB", toml_scalars, "a = " + "[" * (MIB // 2 - 4)),
    ("yaml [[[ 1MiB", yaml_top_scalars, "[" * (MIB - 1)),
    ("yaml '- ' x 512Ki", yaml_top_scalars, "- " * (MIB // 2 - 1)),
    ("yaml key: <1MiB scalar>", yaml_top_scalars, "cgroupDriver: " + "s" * (MIB - 32) + "\n"),
]


def main() -> None:
    for name, parse, text in CASES:
        t = time.perf_counter()
        try:
            parse(text)
            result = "parsed"
        except Unreadable as e:
            result = f"refused ({str(e)[:50]})"
        print(f"{name:28} {len(text):>8} bytes  {time.perf_counter() - t:7.3f} s  {result}")


if __name__ == "__main__":
    main()
