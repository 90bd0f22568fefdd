"""Applies checkpoint actions: check the file is unchanged, back it up, replace or delete.

The caller guarantees kubelet is stopped (kubelet rewrites the file from memory).
"""

from __future__ import annotations

import stat
from dataclasses import dataclass
from pathlib import Path

from gpuguard import safeio
from gpuguard.actuate.files import (
    UnsafeDirError,
    atomic_replace,
    backup,
    fsync_dir,
    remove_stale_temps,
)
from gpuguard.checkpoint.reader import DEFAULT_MAX_BYTES as CHECKPOINT_MAX
from gpuguard.log import EventLog
from gpuguard.model import Action, Outcome
from gpuguard.reconcilers.checkpoint import DeleteCheckpoint, RewriteCheckpoint, sha256


@dataclass(frozen=True)
class CheckpointActuator:
    backup_dir: Path
    backup_keep: int
    log: EventLog
    dry_run: bool = False

    def apply(self, action: Action) -> Outcome:
        if not isinstance(action, (RewriteCheckpoint, DeleteCheckpoint)):
            raise TypeError(f"not a checkpoint action: {action!r}")
        if self.dry_run:
            return Outcome(action, "dry-run", "would " + action.describe())
        path = action.path
        remove_stale_temps(path.parent, path.name)
        try:
            current, st = safeio.read_bytes(path, what="checkpoint", max_bytes=CHECKPOINT_MAX)
        except safeio.UnsafeFileError as e:
            return self._failed(action, f"{e.message}; not modified")
        if sha256(current) != action.expected_sha256:
            # Someone (kubelet?) wrote it since we analysed it: never overwrite that.
            return self._failed(action, f"{path}: changed since it was analysed; not modified")
        try:
            saved = backup(current, path, self.backup_dir, keep=self.backup_keep)
        except UnsafeDirError as e:  # no backup, no change
            return self._failed(action, f"{e.message}; {path} not modified")
        except OSError as e:
            return self._failed(
                action, f"{self.backup_dir}: backup failed ({e.strerror}); {path} not modified"
            )
        if isinstance(action, RewriteCheckpoint):
            atomic_replace(
                path, action.content, mode=stat.S_IMODE(st.st_mode), uid=st.st_uid, gid=st.st_gid
            )
        else:
            path.unlink()
            fsync_dir(path.parent)
        detail = f"backup {saved}"
        self.log.event(
            action.kind,
            f"{action.describe()}; previous file saved as {saved}",
            level="notice",
            fields={
                "GPUGUARD_RECONCILER": action.reconciler,
                "GPUGUARD_ACTION": action.kind,
                "BACKUP": str(saved),
                **action.fields(),
            },
        )
        return Outcome(action, "done", detail)

    def _failed(self, action: Action, why: str) -> Outcome:
        self.log.event(
            "error",
            why,
            level="error",
            fields={"GPUGUARD_RECONCILER": action.reconciler, "GPUGUARD_ACTION": action.kind},
        )
        return Outcome(action, "failed", why)
