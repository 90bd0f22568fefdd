"""The daemon's engine: the loop and its signals, the coalescer, what a pass is made of,
the host snapshot a pass decides from, the one-shot runs, operator hooks.

Modules (docs/architecture.md has the map of the packages):

- `fastpaths.py`: an event's fast paths, found on the steps by protocol (a reload's end,
  a new scope, a scope's device properties set at runtime)
- `daemon.py`: the loop: sources connected, events dispatched (fast paths by protocol,
  then marks), passes through the runner, READY/STATUS/WATCHDOG, SIGHUP/SIGTERM,
  follow-ups, operator hooks
- `report.py`: what the daemon reports after each pass: the status file's model built
  from its state, written through the one state-file writer, then the metrics from the
  same model
- `runner.py`: the one pass runner of the daemon and `gpuguard check`: the marked steps
  in order, each timed and recorded, a crash contained, follow-ups resolved through the
  registry; `gpuguard check`'s run with the daemon's immediate follow-up once
- `coalescer.py`: quiet period, max delay, hold, one pass at a time
- `passguard.py`: never a repair loop: after a pass that acted and found what the pass
  just before found, brought by marks within a second of that pass's end (its own
  change's), the next non-urgent pass waits; the same loss coming back later (a CPU
  manager's reconcile) is repaired each time, doubling from 1 s to 5 min (pure; the
  coalescer applies it, the daemon journals `pass-backoff`)
- `passes.py`: what a pass is made of (work, context, follow-ups, the services a step
  may use); free of D-Bus so one-shot commands start fast
- `snapshot.py`: the host as a pass found it (the checkpoint and the entries gpuguard
  dropped from it, the NVIDIA majors of `/proc/devices`, the kubepods containers), read
  once and shared by the steps
- `oneshot.py`: `gpuguard check`'s steps and its one pass, and `gpuguard status`'s
  container rows and status file
- `inventory_reader.py`: the daemon's GPU inventory, read afresh in a worker thread for
  each pass (`--inventory` over `[Inventory] File=`, re-read on SIGHUP), its
  unavailability journaled on change
- `gcpause.py`: Python's garbage collector kept out of a reload's repair window;
  long-lived objects frozen after start-up
- `hooks.py`: operator hooks: executables in `hooks.d/` run after a pass that found or
  changed something
- `operation.py` with `host/offswitch.py`, `actuate/offswitch.py`, `cli/switch.py`: the
  off switch `/etc/gpuguard/disabled`: read (anything at the path is "off"), written and
  removed (`gpuguard disable`/`enable`), and how the daemon obeys it (checked before
  every pass and fast path: it stops, nothing more is written) and journals observe-only
  mode
"""
