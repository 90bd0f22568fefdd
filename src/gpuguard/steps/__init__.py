"""Daemon steps: observe (in a worker thread), reconcile (pure), actuate, log.

Each step is an object built in main() and called once per pass whose work names it;
state that must outlive a pass (caches, rate limits) lives in the step object.
"""
