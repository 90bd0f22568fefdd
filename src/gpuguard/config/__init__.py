"""gpuguard's configuration: /etc/gpuguard/gpuguard.conf (else the package's defaults in
/usr/lib/gpuguard/gpuguard.conf) plus drop-ins, in systemd's style.

- ``schema``: the sections and their keys (name, value type, default, doc), ``KEYS``;
- ``types``: the value types (parse a value with ``file:line:`` errors, format it back);
- ``parse``: the INI dialect, drop-ins and where each value came from (``load_config``);
- ``reference``: the files generated from the key table (``python -m gpuguard.config``).

Modules (docs/architecture.md has the map of the packages):

- configuration: the key table and `Config` (`schema.py`), the sections' dataclasses
  (`sections_node.py`, `sections_devices.py`, `sections_inputs.py`), what a key is, its
  name, type, default and doc (`keyspec.py`), value types (`types.py`), the INI dialect
  with drop-ins and each value's origin, unknown keys as warnings (errors with `strict`)
  and the fallback without a broken file for the debugging commands (`parse.py`), the
  generated shipped file and key reference (`reference.py`), gpuguard.conf(5) rendered
  from the key table (`manconf.py`)
"""

from __future__ import annotations

from gpuguard.config.parse import (
    FileConfigError,
    config_files,
    load_config,
    load_config_or_fallback,
    parse_config,
)
from gpuguard.config.reference import (
    REFERENCE_BEGIN,
    REFERENCE_END,
    render_reference,
    render_shipped,
)
from gpuguard.config.schema import (
    DEFAULT_ORIGIN,
    KEYS,
    SEE_ALSO,
    Config,
    DaemonConfig,
    DevicePluginConfig,
    DevicesConfig,
    InventoryConfig,
    KeySpec,
    KubeletConfig,
    MetricsConfig,
    RuntimeConfig,
    SystemdConfig,
)
from gpuguard.errors import ConfigError

__all__ = [
    "DEFAULT_ORIGIN",
    "KEYS",
    "REFERENCE_BEGIN",
    "REFERENCE_END",
    "SEE_ALSO",
    "Config",
    "ConfigError",
    "DaemonConfig",
    "DevicePluginConfig",
    "DevicesConfig",
    "FileConfigError",
    "InventoryConfig",
    "KeySpec",
    "KubeletConfig",
    "MetricsConfig",
    "RuntimeConfig",
    "SystemdConfig",
    "config_files",
    "load_config",
    "load_config_or_fallback",
    "parse_config",
    "render_reference",
    "render_shipped",
]
