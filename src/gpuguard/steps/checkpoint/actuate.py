"""Applies checkpoint actions: check the file is unchanged, back it up, record the pod
entries it drops, replace or delete, journal each remapped and dropped entry; and
records the GPUs in the identity history once the checkpoint matches them.

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

from gpuguard.actuate.change import Change
from gpuguard.actuate.files import (
    UnsafeDirError,
    atomic_replace,
    backup,
    fsync_dir,
    remove_stale_temps,
)
from gpuguard.actuate.statefile import write_state
from gpuguard.checkpoint import dropped, history
from gpuguard.checkpoint.model import PodDevicesEntry
from gpuguard.checkpoint.reader import DEFAULT_MAX_BYTES as CHECKPOINT_MAX
from gpuguard.errors import BadInputError
from gpuguard.host import safeio
from gpuguard.host.inventory import Inventory
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.model import Action, Outcome
from gpuguard.steps.checkpoint.reconcile import NAME, DeleteCheckpoint, RewriteCheckpoint, sha256
from gpuguard.steps.checkpoint.remap import RemapInputs


@dataclass(frozen=True)
class CheckpointActuator:
    backup_dir: Path
    backup_keep: int
    log: EventLog
    # where the dropped pod entries are recorded (paths.DROPPED_ENTRIES_FILE under the
    # root); None only in tests of the file mechanics
    dropped_file: Optional[Path] = None

    def change(self, action: Action) -> Change[Outcome]:
        """The repair as a change for the executor."""
        if not isinstance(action, (RewriteCheckpoint, DeleteCheckpoint)):
            raise TypeError(f"not a checkpoint action: {action!r}")
        return Change(
            action.kind,
            lambda: self.apply(action),
            lambda: Outcome(action, "dry-run", "would " + action.describe()),
        )

    def apply(self, action: Action) -> Outcome:
        """The making half of `change`."""
        if not isinstance(action, (RewriteCheckpoint, DeleteCheckpoint)):
            raise TypeError(f"not a checkpoint action: {action!r}")
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
        self._journal_entries(action)
        return Outcome(action, "done", detail)

    def _journal_entries(self, action: Union[RewriteCheckpoint, DeleteCheckpoint]) -> None:
        """One entry per pod entry remapped or dropped: pod, container, old and new IDs."""
        path = {"CHECKPOINT": str(action.path), "GPUGUARD_RECONCILER": action.reconciler}
        for r in getattr(action, "remaps", ()):
            old, new = ",".join(r.old_ids()), ",".join(r.new_ids())
            self.log.event(
                "checkpoint-entry-remapped",
                f"pod {r.old.pod_uid} container {r.old.container_name}: {r.old.resource_name} "
                f"{old} -> {new} ({r.how})",
                level="notice",
                fields={**_entry(r.old), "OLD_DEVICE_IDS": old, "NEW_DEVICE_IDS": new, **path},
            )
        drops = getattr(action, "drops", ()) or [
            _Drop(e, "Policy=delete" if isinstance(action, DeleteCheckpoint) else action.reason)
            for e in action.dropped
        ]
        for d in drops:
            old = ",".join(d.entry.all_device_ids())
            self.log.event(
                "checkpoint-entry-dropped",
                f"pod {d.entry.pod_uid} container {d.entry.container_name}: "
                f"{d.entry.resource_name} {old} dropped: {d.why}",
                level="notice",
                fields={**_entry(d.entry), "OLD_DEVICE_IDS": old, "DROP_REASON": d.why, **path},
            )

    def _record_dropped(self, action: Union[RewriteCheckpoint, DeleteCheckpoint]) -> str:
        """Add the entries `action` drops or remaps to the record file (the evidence their
        pods' containers keep being judged by); its path, or "" if none."""
        remaps = getattr(action, "remaps", ())
        if self.dropped_file is None or not (action.dropped or remaps):
            return ""
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        old = dropped.read(self.dropped_file)
        drops = getattr(action, "drops", ())
        if drops or remaps:  # as evidence in today's numbering (remap.py), own IDs kept
            new = tuple(
                dropped.DroppedEntry(
                    d.entry.pod_uid, d.entry.container_name, d.entry.resource_name,
                    d.evidence, when, original_ids=d.entry.all_device_ids(),
                )
                for d in drops
            ) + tuple(
                dropped.DroppedEntry(
                    r.old.pod_uid, r.old.container_name, r.old.resource_name, r.evidence,
                    when, original_ids=r.old_ids(), remapped_to=r.new_ids(),
                )
                for r in remaps
            )  # fmt: skip
        else:
            new = dropped.dropped_from(action.dropped, when)
        records = dropped.merge(old, new)
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


@dataclass(frozen=True)
class _Drop:
    entry: PodDevicesEntry
    why: str


def _entry(e: PodDevicesEntry) -> dict[str, str]:
    return {"POD_UID": e.pod_uid, "CONTAINER_NAME": e.container_name, "RESOURCE": e.resource_name}


def record_history(
    root: Root, inventory: Inventory, inputs: RemapInputs, log: EventLog, path: str
) -> bool:
    """Make the inventory's GPUs the history's newest generation (nothing is written when
    they already are). A history that cannot be written is journaled, never fatal: the
    next check then finds the older generation and tries again."""
    from gpuguard.steps.checkpoint.observe import boot_id

    gen = history.generation_of(
        inventory.gpus, inputs.numa, when=time.time(), boot_id=boot_id(root),
        source=inventory.source,
    )  # fmt: skip
    new = history.advance(inputs.history, gen)
    if new is None:
        return False
    target = Path(path)
    try:
        write_state(target, history.SPEC, new)
    except (OSError, BadInputError) as e:
        why = e.message if isinstance(e, BadInputError) else e.strerror
        log.event(
            "warning",
            f"{target}: cannot record the GPUs ({why}); a later check tries again",
            level="warning",
            fields={"GPUGUARD_RECONCILER": NAME, "HISTORY": str(target)},
        )
        return False
    log.event(
        "gpu-history-recorded",
        f"{target}: recorded {len(gen.gpus)} GPU(s) as the newest of "
        f"{len(new.generations)} generation(s), the checkpoint matching them",
        level="info",
        fields={"GPUGUARD_RECONCILER": NAME, "HISTORY": str(target), "GPUS": str(len(gen.gpus))},
    )
    return True
