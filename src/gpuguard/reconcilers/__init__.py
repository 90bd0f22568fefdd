"""Reconcilers: pure functions from a host snapshot to findings and actions.

Nothing here touches the OS; tests are tables.
"""
