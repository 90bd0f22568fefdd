"""The configuration's schema: one frozen dataclass per section, each key's name, value
type, default and doc in its field metadata; `KEYS` and the per-section table derive
from it (the parser, `gpuguard config`, the man page and the shipped file read them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Tuple

from gpuguard.config.keyspec import DEFAULT_ORIGIN as DEFAULT_ORIGIN
from gpuguard.config.keyspec import SEE_ALSO as SEE_ALSO
from gpuguard.config.keyspec import KeySpec as KeySpec
from gpuguard.config.keyspec import _KeyMeta
from gpuguard.config.sections_devices import DevicePluginConfig as DevicePluginConfig
from gpuguard.config.sections_devices import DevicesConfig as DevicesConfig
from gpuguard.config.sections_devices import RuntimeConfig as RuntimeConfig
from gpuguard.config.sections_inputs import InventoryConfig as InventoryConfig
from gpuguard.config.sections_inputs import MetricsConfig as MetricsConfig
from gpuguard.config.sections_node import DaemonConfig as DaemonConfig
from gpuguard.config.sections_node import KubeletConfig as KubeletConfig
from gpuguard.config.sections_node import SystemdConfig as SystemdConfig


def _empty_origins() -> Mapping[Tuple[str, str], str]:
    return MappingProxyType({})


@dataclass(frozen=True)
class Config:
    """The effective configuration. `Config()` is all defaults.

    `origins` maps (section, key) to "file:line" for keys set in a file; it is left out
    of comparisons so a config equals its rendered-and-reloaded self.
    """

    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    kubelet: KubeletConfig = field(default_factory=KubeletConfig)
    systemd: SystemdConfig = field(default_factory=SystemdConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    device_plugin: DevicePluginConfig = field(default_factory=DevicePluginConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    inventory: InventoryConfig = field(default_factory=InventoryConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    origins: Mapping[Tuple[str, str], str] = field(
        default_factory=_empty_origins, compare=False, repr=False
    )
    # "file:line: what to change" for each deprecated assignment read (MOVED_KEYS).
    warnings: Tuple[str, ...] = field(default=(), compare=False, repr=False)

    def origin(self, section: str, key: str) -> str:
        """Where a key's value came from: "default" or "file:line"."""
        return self.origins.get((section, key), DEFAULT_ORIGIN)

    def value(self, section: str, key: str) -> Any:
        spec = _BY_SECTION[section][key]
        return getattr(getattr(self, _SECTION_ATTR[section]), spec.attr)

    def render(self) -> str:
        """The effective configuration in gpuguard.conf syntax, each key's origin above it."""
        out = [
            "# gpuguard's effective configuration. The comment above each key says",
            "# where its value came from: the default, or the file and line that set it.",
        ]
        for section, specs in _BY_SECTION.items():
            out += ["", f"[{section}]"]
            for spec in specs.values():
                out.append(f"# {self.origin(section, spec.key)}")
                out.append(f"{spec.key}={spec.type.format(self.value(section, spec.key))}")
        return "\n".join(out) + "\n"


# Config's attribute and class for each section, in file order.
_SECTIONS: Dict[str, Tuple[str, type]] = {
    cls.SECTION: (attr, cls)
    for attr, cls in (
        ("daemon", DaemonConfig),
        ("kubelet", KubeletConfig),
        ("systemd", SystemdConfig),
        ("devices", DevicesConfig),
        ("device_plugin", DevicePluginConfig),
        ("runtime", RuntimeConfig),
        ("inventory", InventoryConfig),
        ("metrics", MetricsConfig),
    )
}
_SECTION_ATTR = {section: attr for section, (attr, _) in _SECTIONS.items()}


def _build_table() -> Tuple[KeySpec, ...]:
    specs: List[KeySpec] = []
    for section, (_, cls) in _SECTIONS.items():
        for f in dataclasses.fields(cls):
            meta: _KeyMeta = f.metadata["gpuguard"]
            spec = KeySpec(
                section, meta.key, f.name, meta.type, meta.default_text, f.default, meta.doc
            )
            specs.append(spec)
    return tuple(specs)


KEYS = _build_table()
_BY_SECTION: Dict[str, Dict[str, KeySpec]] = {}
for _spec in KEYS:
    _BY_SECTION.setdefault(_spec.section, {})[_spec.key] = _spec
del _spec


# Keys that moved to another section: still read where they were, with a warning.
MOVED_KEYS: Mapping[Tuple[str, str], str] = MappingProxyType(
    {("DevicePlugin", "Crictl"): "Runtime", ("DevicePlugin", "CriEndpoint"): "Runtime"}
)
