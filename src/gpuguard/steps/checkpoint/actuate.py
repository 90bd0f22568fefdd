"""Applies checkpoint actions: check the file is unchanged, back it up, record the pod
entries it drops, replace or delete.

The caller guarantees kubelet is stopped (kubelet rewrites the file from memory). The
dropped entries are recorded before the file changes (checkpoint/dropped.py): they are
evidence the container_access step still needs for the pods' running containers, and a
repair that cannot keep them is not made.
"""

from __future__ import annotations

import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from gpuguard.actuate.files import (
    UnsafeDirError,
    atomic_replace,
    backup,
    fsync_dir,
    remove_stale_temps,
)
from gpuguard.actuate.statefile import write_state
from gpuguard.checkpoint import dropped
from gpuguard.checkpoint.reader import DEFAULT_MAX_BYTES as CHECKPOINT_MAX
from gpuguard.errors import BadInputError
from gpuguard.host import safeio
from gpuguard.journal.log import EventLog
from gpuguard.model import Action, Outcome
from gpuguard.steps.checkpoint.reconcile import DeleteCheckpoint, RewriteCheckpoint, sha256


@dataclass(frozen=True)
class CheckpointActuator:
    backup_dir: Path
    backup_keep: int
    log: EventLog
    dry_run: bool = False
    # where the dropped pod entries are recorded (paths.DROPPED_ENTRIES_FILE under the
    # root); None only in tests of the file mechanics
    dropped_file: Optional[Path] = None

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
        try:
            recorded = self._record_dropped(action)
        except (BadInputError, OSError) as e:
            return self._failed(
                action,
                f"{path}: not modified: the pod entries it would drop cannot be recorded: {e}",
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
                **({"DROPPED_RECORDED": recorded} if recorded else {}),
                **action.fields(),
            },
        )
        return Outcome(action, "done", detail)

    def _record_dropped(self, action: Union[RewriteCheckpoint, DeleteCheckpoint]) -> str:
        """Add the entries `action` drops to the record file; its path, or "" if none."""
        if self.dropped_file is None or not action.dropped:
            return ""
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        old = dropped.read(self.dropped_file)
        records = dropped.merge(old, dropped.dropped_from(action.dropped, when))
        write_state(self.dropped_file, dropped.SPEC, records)
        return str(self.dropped_file)

    def _failed(self, action: Action, why: str) -> Outcome:
        self.log.event(
            "error",
            why,
            level="error",
            fields={"GPUGUARD_RECONCILER": action.reconciler, "GPUGUARD_ACTION": action.kind},
        )
        return Outcome(action, "failed", why)
