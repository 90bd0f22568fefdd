"""The daemon's metrics files: after each pass the values (metrics_state.py) written as
metrics.json, and, with `[Metrics] TextfileDirectory=`, rendered for node_exporter.

Rendering needs prometheus_client (metrics.py), imported at its first use only: the
daemon that writes no textfile never loads it (metrics_state.py says why)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.reporting.metrics_file import SPEC, STATE_FILE
from gpuguard.reporting.metrics_state import (
    MISSING_LIBRARY,
    TEXTFILE_NAME,
    MetricsState,
    Render,
    unimportable,
)
from gpuguard.reporting.status import PassRecord, Status


def load_renderer() -> Render:
    """metrics.render (ImportError without prometheus_client)."""
    from gpuguard.reporting.metrics import render

    return render


class MetricsOutput:
    """The daemon's side: count each pass, write the files, report an error once."""

    def __init__(self, state: MetricsState, renderer: Callable[[], Render] = load_renderer):
        self.state = state
        self.load_renderer = renderer
        self.render: Optional[Render] = None
        self.missing = MISSING_LIBRARY  # why there is no renderer
        self.errors: frozenset[str] = frozenset()
        self.broken = False

    def after_pass(
        self,
        last_pass: PassRecord,
        status: Status,
        root: Root,
        textfile_dir: Optional[str],
        log: EventLog,
    ) -> None:
        """publish(), with its errors logged once; a bug here disables the metrics and is
        logged, and never stops the daemon's repairs."""
        if self.broken:
            return
        try:
            errors = self.publish(last_pass, status, root, textfile_dir)
        except Exception as e:
            self.broken = True
            log.event(
                "metrics-failed",
                f"metrics disabled: {type(e).__name__}: {e}",
                level="error",
                exc=e,
            )
            return
        for error in errors:
            log.warning(error)

    def publish(
        self,
        last_pass: PassRecord,
        status: Status,
        root: Root,
        textfile_dir: Optional[str],
    ) -> list[str]:
        """Update and write; the errors not reported by the previous call."""
        from gpuguard.actuate.statefile import write_state
        from gpuguard.errors import GpuguardError

        self.state.observe_pass(last_pass, status)
        doc = self.state.to_values()
        errors = []
        path = root.path(STATE_FILE)
        try:
            write_state(path, SPEC, doc)
        except OSError as e:
            errors.append(f"cannot write metrics to {path}: {e.strerror}")
        except GpuguardError as e:  # a runtime directory that is a link or not root's
            errors.append(f"cannot write metrics: {e.message}")
        if textfile_dir:
            textfile = root.path(textfile_dir) / TEXTFILE_NAME
            render = self._renderer()
            if render is None:
                errors.append(f"cannot write metrics to {textfile}: {self.missing}")
            else:
                errors += export(render(doc), [textfile])
        new, self.errors = sorted(frozenset(errors) - self.errors), frozenset(errors)
        return new

    def _renderer(self) -> Optional[Render]:
        """The renderer, imported at its first use; None while the library is missing."""
        if self.render is None:
            try:
                self.render = self.load_renderer()
            except ImportError as e:
                why = unimportable(e)
                if why is None:
                    raise
                self.missing = why
        return self.render


def make_output() -> MetricsOutput:
    """The daemon's metrics and their files."""
    return MetricsOutput(MetricsState())


def export(data: bytes, paths: list[Path]) -> list[str]:
    """Replace each file atomically; the errors, one line each (the caller logs them).

    Into directories that must already exist (node_exporter's textfile directory belongs
    to its package and often to its user): never created here, never made root-only."""
    from gpuguard.actuate.files import atomic_replace

    errors = []
    for p in paths:
        try:
            atomic_replace(p, data, mode=0o644, uid=None, gid=None)
        except OSError as e:
            errors.append(f"cannot write metrics to {p}: {e.strerror}")
    return errors
