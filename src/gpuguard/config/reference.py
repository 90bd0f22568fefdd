"""The files generated from the key table (tests keep them in sync): the shipped
packaging/gpuguard.conf and the key reference of docs/configuration.md."""

from __future__ import annotations

import sys
import textwrap
from typing import Sequence

from gpuguard.config.schema import _BY_SECTION

# ------------------------------------------------------- generated files (kept in sync)


def render_shipped() -> str:
    """packaging/gpuguard.conf: every key commented out with its default, systemd style."""
    out = [
        "#  This file is part of gpuguard: /usr/lib/gpuguard/gpuguard.conf, the",
        "#  package's defaults, replaced by every upgrade. Do not edit it.",
        "#",
        "# The entries below show the defaults, commented out. To change a setting,",
        "# create a drop-in such as /etc/gpuguard/gpuguard.conf.d/50-local.conf with",
        "# the section header and only the keys you change (or copy this file to",
        "# /etc/gpuguard/gpuguard.conf, which is then read instead of this one; no",
        "# upgrade touches /etc/gpuguard). Drop-ins are read in lexical order and the last",
        "# assignment of a key wins; an empty value (Key=) restores the default, or",
        "# empties a list. Reload with: systemctl reload gpuguard",
        "#",
        "# Every key and the value syntax: man 5 gpuguard.conf",
    ]
    for section, specs in _BY_SECTION.items():
        out += ["", f"[{section}]"]
        for spec in specs.values():
            out += textwrap.wrap(
                spec.doc, 78, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False
            )
            out.append(f"#{spec.key}={spec.default_text}")
    return "\n".join(out) + "\n"


REFERENCE_BEGIN = "<!-- BEGIN GENERATED KEY REFERENCE: python -m gpuguard.config --reference -->"
REFERENCE_END = "<!-- END GENERATED KEY REFERENCE -->"


def render_reference() -> str:
    """The key reference of docs/configuration.md (between REFERENCE_BEGIN/END)."""
    out = [REFERENCE_BEGIN]
    for section, specs in _BY_SECTION.items():
        out += ["", f"### [{section}]", "", "| Key | Default | Type | Meaning |"]
        out.append("|---|---|---|---|")
        for spec in specs.values():
            default = f"`{spec.default_text}`" if spec.default_text else "(empty)"
            cells = [f"`{spec.key}`", default, spec.type.describe, spec.doc]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    out += ["", REFERENCE_END]
    return "\n".join(out) + "\n"


def _main(argv: Sequence[str]) -> int:
    # A developer's helper to regenerate the two generated files, not a user command.
    if list(argv) == ["--reference"]:
        sys.stdout.write(render_reference())
    elif list(argv) == ["--shipped"]:
        sys.stdout.write(render_shipped())
    else:
        sys.stderr.write("usage: python -m gpuguard.config --reference | --shipped\n")
        return 2
    return 0
