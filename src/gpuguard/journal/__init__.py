"""The journal: structured entries with a MESSAGE_ID per kind, the message catalog that
explains each, and lasting conditions journaled when they appear, change and clear.

Modules (docs/architecture.md has the map of the packages):

- logging: journald's native protocol on the root's socket, text or JSON on stderr; the
  module loggers of `devices/`, `steps/` ... go through the same log, their debug lines
  with `LogLevel=debug` (`log.py`); every kind with its MESSAGE_ID and catalog text
  (`catalog.py`, the checkpoint's kinds in `catalog_checkpoint.py`, those of operating
  gpuguard, the off switch and observe-only, in `catalog_ops.py`); lasting states (no
  inventory, a container without uvm, a finding left as it is) journaled when they
  appear, change and clear, reminded at most hourly, not every pass; a finding repaired
  in the pass that found it is an event, journaled each time (`conditions.py`)
"""
