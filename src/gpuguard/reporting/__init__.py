"""What the daemon reports from its state: the ledger of step results, the `gpuguard
status` summary, node-problem-detector conditions and the Prometheus metrics.

Modules (docs/architecture.md has the map of the packages):

- each step's latest result and the last hour's changes, for the status file
  (`ledger.py`); node conditions for node-problem-detector and the `gpuguard status`
  summary, both read from the status file: ok, problem or unknown, a layer a step could
  not read unknown, never ok (`npd.py`, `summary.py`); the metrics' values, kept by the
  daemon without a client library, whose import costs it ~4 MB and `ssl`
  (`metrics_state.py`), written after each pass as JSON and, with `[Metrics]
  TextfileDirectory=`, rendered for node_exporter (`metrics_output.py`); their rendering
  with prometheus_client where they are read (`metrics.py`); `gpuguard metrics` and the
  HTTP server of gpuguard-metrics.socket (`metrics_http.py`)
- `status.py`, `status_figures.py`: the status file as a typed, versioned model
  (`Status`, each step's `StepResult` with what it could not see, the daemon's verdict
  per condition, its mode and the off switch it saw; the reload signal's and fast paths'
  figures in `status_figures.py`): written by the daemon, read by `status`, `npd`, the
  metrics and `doctor` through `read_status`
- `container_row.py`, `summary.py`: `gpuguard status`'s rows and node summary as frozen
  dataclasses (`ContainerRow`, `NodeSummary`), JSON only in their `to_json()`; the fast
  paths hand the daemon a typed `FastPaths` (`status_figures.py`), never a dict

The status file, /run/gpuguard/status.json: the daemon's last passes and each step's
latest result with what it could not see, its verdict per node condition (`node`,
`conditions`: ok, problem or unknown), its mode (`mode`: repair or observe) and the off
switch once it saw it (`off_switch`: path, reason, since; it then stops), versioned
(`version`, read through `reporting/status.py`) (read by `gpuguard status`, `npd`,
`doctor`), and the fast paths' last figures (`fast_paths`: the last reload's re-grant,
with the loop thread's CPU time and run-queue wait over its writes, new scopes handled,
with where their grants' time went, the call to systemd apart; `reload_signal`: whether
the private socket is connected, the reloads acted on, the Reloading starts and ends
each path delivered, and which path delivered the last one first).
"""
