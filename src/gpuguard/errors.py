"""Errors a user can meet: one sentence with the path and the next step, and an exit code."""

from __future__ import annotations

from gpuguard import exitcodes


class GpuguardError(Exception):
    """An error gpuguard reports as one line (never a traceback) and exits with `exit_code`."""

    exit_code: int = exitcodes.INTERNAL

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if exit_code is not None:
            self.exit_code = exit_code

    def __str__(self) -> str:
        return self.message


class BadInputError(GpuguardError):
    """An input file is unreadable or corrupt; nothing was modified."""

    exit_code = exitcodes.BAD_INPUT


class NoDriverError(GpuguardError):
    """NVML is unavailable: no driver, no libnvidia-ml, or no GPU."""

    exit_code = exitcodes.NO_DRIVER


class ConfigError(GpuguardError):
    """The command line or a configuration file is wrong."""

    exit_code = exitcodes.USAGE


class KubeletError(GpuguardError):
    """Kubelet could not be stopped, restarted or started around a repair."""

    exit_code = exitcodes.KUBELET
