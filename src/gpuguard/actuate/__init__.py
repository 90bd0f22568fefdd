"""Actuators: the only code that writes. Each checks before it writes; a change that a
dry-run describes is offered as a `Change` (`change.py`) the engine's executor runs.

Modules (docs/architecture.md has the map of the packages):

- atomic file writes and backups (`files.py`); a GPU container scope's grant as its
  runtime drop-in, written before the D-Bus call and removed once the scope is gone
  (`dropins.py`); stopping a container through the runtime, crictl then ctr, with a stop
  timeout (`containers.py`: the container access step's restart-container remedy and the
  device plugin restarts); systemd unit jobs, RestartUnit/StopUnit/StartUnit awaited to
  their result, a bus error a result too, none under dry-run nor when the unit is
  already stopped (started), one journal entry per job with its reason (`units.py`:
  kubelet around a checkpoint repair and a device plugin that runs as a host service);
  replacing a cgroup v2 device program with bpf(2), in one atomic `BPF_F_REPLACE` attach
  where the kernel has it (`bpf.py`: V2Remedy=inplace), and the v2 bridge's attach and
  detach on a scope (`bpfbridge.py`)
- `safewrite.py`: writes only to what they should: control files opened no-follow and
  non-blocking and used only when regular, device nodes and `/dev/char` links never made
  through a linked directory
- `statefile.py` (the writer) with `host/statefile.py` (the loader): gpuguard's own
  state files: one `StateFile` per file (path, version, a parser into frozen dataclasses
  through typed field getters, a renderer), one loader (`load`: the value, or absent, or
  one line why; bounded numbers, no runaway nesting, lone surrogates replaced) and one
  writer (`write_state`, atomic, in a checked directory); the status file
  (`reporting/status.py`), metrics.json (`reporting/metrics_file.py`), the hook's
  request and result and its memo, the dropped-entries record and the device plugin's
  budgets each have one
- `offswitch.py` (written and removed) with `host/offswitch.py` (read), `cli/switch.py`,
  `engine/operation.py`: the off switch `/etc/gpuguard/disabled`: read (anything at the
  path is "off"), written and removed (`gpuguard disable`/`enable`), and how the daemon
  obeys it (checked before every pass and fast path: it stops, nothing more is written)
  and journals observe-only mode
"""
