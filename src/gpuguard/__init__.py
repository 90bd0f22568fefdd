"""gpuguard: keeps GPUs usable on Kubernetes nodes across lifecycle events."""

__version__ = "0.1.0"
