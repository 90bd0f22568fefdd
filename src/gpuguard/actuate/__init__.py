"""Actuators: the only code that writes. Each checks before it writes and honours dry-run."""
