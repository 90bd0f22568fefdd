"""Device plugin health (failure modes F3 and F4).

- :mod:`.discover` reads the host: plugin sockets, the process serving each, its
  view of /dev, the host's NVIDIA nodes, GPU containers' /dev, kubelet's start.
- :mod:`.health` is the pure reconciler: observation in, findings and
  :class:`~gpuguard.plugins.health.RestartPlugin` actions out.
- :mod:`.restart` restarts a plugin through its container runtime or systemd and
  verifies the new plugin.
- :mod:`.step` is the daemon step: rate limits, persisted restart budget, journal.
"""
