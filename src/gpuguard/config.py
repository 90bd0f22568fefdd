"""gpuguard's configuration: /etc/gpuguard/gpuguard.conf plus drop-ins, in systemd's style.

The syntax is systemd's unit-file INI dialect, not Python's: `#` and `;` start comment
lines (there are no inline comments), keys are CamelCase and case-sensitive, a section
may be repeated, a trailing backslash continues a line, and `Key=` with an empty value
resets a key to its default (for a list: empties it). Drop-ins in
/etc/gpuguard/gpuguard.conf.d/*.conf are applied in lexical order; the last assignment
of a key wins.

We parse lines ourselves instead of using configparser: configparser cannot say on
which line a key was set (every error here must be `file:line: what; hint`), treats an
indented line as a continuation, gives `[DEFAULT]` a special meaning, refuses repeated
sections and lower-cases keys. None of that is systemd's behaviour, and a line scanner
is shorter than the workarounds.

The key table lives in the section dataclasses' field metadata (name, type, default
text, doc); `KEYS` is derived from it, and so are `Config.render()`, the shipped
packaging/gpuguard.conf and the key reference in docs/configuration.md (tests assert
that both files match), so the three cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Dict, List, Mapping, Sequence, Tuple

from gpuguard import safeio
from gpuguard.configtypes import (
    AbsPath,
    Bool,
    Choice,
    CriEndpoint,
    Int,
    ResourcePattern,
    ServiceUnit,
    SpaceList,
    TimeSpan,
    ValueType,
    format_timespan,
)
from gpuguard.errors import ConfigError
from gpuguard.numparse import clip, cut
from gpuguard.paths import CONFIG_DROPIN_DIR, CONFIG_FILE, Root

SEE_ALSO = "(see gpuguard.conf(5))"
DEFAULT_ORIGIN = "default"


@dataclass(frozen=True)
class _KeyMeta:
    key: str
    type: ValueType
    default_text: str
    doc: str


@dataclass(frozen=True)
class KeySpec:
    """One configuration key: where it lives, how it parses, its default and meaning."""

    section: str
    key: str
    attr: str  # the attribute of the section dataclass
    type: ValueType
    default_text: str  # the default as it is written in a config file
    default: Any
    doc: str


def _key(key: str, vtype: ValueType, default_text: str, doc: str) -> Any:
    """A section dataclass field whose default is parsed from its text form.

    Parsing the default (at import) proves each default is itself a valid setting and
    makes the text in docs/the shipped file the single source of the value.
    """
    default = vtype.parse(default_text) if default_text or not vtype.empty_resets else None
    meta = {"gpuguard": _KeyMeta(key, vtype, default_text, doc)}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class DaemonConfig:
    SECTION: ClassVar[str] = "Daemon"

    audit_interval: float = _key(
        "AuditInterval",
        TimeSpan(1.0),
        "5min",
        "Run a full audit pass this often even when no event arrived, "
        "to catch changes that no signal reports.",
    )
    quiet_period: float = _key(
        "QuietPeriod",
        TimeSpan(0.0),
        "150ms",
        "Wait this long after the last event before a pass, so a burst of events causes one pass.",
    )
    max_delay: float = _key(
        "MaxDelay",
        TimeSpan(0.0),
        "2s",
        "Run a pass at most this long after the first event of a burst, even if "
        "events keep arriving. Must not be shorter than QuietPeriod.",
    )
    reload_quiet_period: float = _key(
        "ReloadQuietPeriod",
        TimeSpan(0.0),
        "5ms",
        "The shorter quiet period used once systemd reports the end of a "
        "daemon-reload or daemon-reexec (its burst of signals is over, and running "
        "GPU containers may just have lost their devices).",
    )
    dry_run: bool = _key(
        "DryRun",
        Bool(),
        "no",
        "Report what would be changed and change nothing; hooks still run, "
        "with GPUGUARD_DRY_RUN=1.",
    )
    hook_timeout: float = _key(
        "HookTimeout",
        TimeSpan(0.001),
        "10s",
        "Kill an operator hook in /etc/gpuguard/hooks.d, with its whole process "
        "group, when it runs longer than this.",
    )
    log_level: str = _key(
        "LogLevel",
        Choice("debug", "info", "warning", "error"),
        "info",
        "The least severe messages that are logged to the journal.",
    )


@dataclass(frozen=True)
class KubeletConfig:
    SECTION: ClassVar[str] = "Kubelet"

    unit: str = _key(
        "Unit",
        ServiceUnit(),
        "kubelet.service",
        "The kubelet's systemd unit, stopped and started around a checkpoint repair.",
    )
    checkpoint_path: str = _key(
        "CheckpointPath",
        AbsPath(),
        "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint",
        "The kubelet device manager's checkpoint that gpuguard checks and repairs.",
    )
    policy: str = _key(
        "Policy",
        Choice("rewrite", "delete", "report"),
        "rewrite",
        "What to do with stale GPU entries in the checkpoint: rewrite it without "
        "them, delete the whole file (kubelet rebuilds it), or only report them.",
    )
    resources: Tuple[str, ...] = _key(
        "Resources",
        SpaceList(ResourcePattern()),
        "nvidia.com/gpu nvidia.com/gpu.shared nvidia.com/mig-*",
        "Extended resources (glob patterns) whose checkpoint entries gpuguard "
        "manages; entries of other resources are never touched.",
    )
    backup_dir: str = _key(
        "BackupDir",
        AbsPath(),
        "/var/lib/gpuguard/backups",
        "Where a copy of the checkpoint is saved before each change.",
    )
    backup_keep: int = _key(
        "BackupKeep",
        Int(1, 10000),
        "20",
        "How many of the most recent checkpoint backups to keep; older ones are deleted.",
    )
    restart_kubelet: bool = _key(
        "RestartKubelet",
        Bool(),
        "yes",
        "Restart the kubelet around a checkpoint repair so it reloads the file; "
        "no: only a stopped kubelet's checkpoint is repaired.",
    )


@dataclass(frozen=True)
class SystemdConfig:
    SECTION: ClassVar[str] = "Systemd"

    runtime_units: Tuple[str, ...] = _key(
        "RuntimeUnits",
        SpaceList(ServiceUnit()),
        "containerd.service crio.service docker.service",
        "Container runtime units whose (re)starts trigger a pass; units that do "
        "not exist are ignored.",
    )
    kubelet_units: Tuple[str, ...] = _key(
        "KubeletUnits",
        SpaceList(ServiceUnit()),
        "kubelet.service",
        "Kubelet units whose starts and stops trigger a pass.",
    )
    max_in_flight: int = _key(
        "MaxInFlight",
        Int(1, 4096),
        "64",
        "The most D-Bus calls gpuguard has in flight at once, e.g. while it reads "
        "unit properties during a scan.",
    )


@dataclass(frozen=True)
class DevicesConfig:
    SECTION: ClassVar[str] = "Devices"

    create_nodes: bool = _key(
        "CreateNodes",
        Bool(),
        "yes",
        "Create missing /dev/nvidia* device nodes with the driver's major and minor numbers.",
    )
    create_char_links: bool = _key(
        "CreateCharLinks",
        Bool(),
        "yes",
        "Create missing /dev/char/MAJOR:MINOR links to NVIDIA device nodes, through "
        "which systemd resolves device access rules.",
    )
    nvidia_modprobe: str = _key(
        "NvidiaModprobe",
        AbsPath(),
        "/usr/bin/nvidia-modprobe",
        "The driver's helper that loads modules and creates the nodes it owns "
        "(nvidia-uvm, nvidia-caps); skipped when it is not installed.",
    )
    regrant: bool = _key(
        "Regrant",
        Bool(),
        "yes",
        "Grant device access again to running GPU containers that lost it, "
        "e.g. to a systemd daemon-reload.",
    )
    durable_grants: bool = _key(
        "DurableGrants",
        Bool(),
        "yes",
        "Also record re-granted access with systemd (on the container's scope) so "
        "that the next daemon-reload does not revoke it again.",
    )
    v2_remedy: str = _key(
        "V2Remedy",
        Choice("report", "restart-container"),
        "report",
        "On cgroup v2, where access cannot be amended in place: only report affected "
        "containers, or restart them so they get their devices back.",
    )


@dataclass(frozen=True)
class DevicePluginConfig:
    SECTION: ClassVar[str] = "DevicePlugin"

    restart: bool = _key(
        "Restart",
        Bool(),
        "yes",
        "Restart the NVIDIA device plugin when it needs it: its /dev lacks NVIDIA nodes "
        "the host has or holds them with stale numbers (F3), it did not register again "
        "after a kubelet restart (F4), or NVML fails in its context (NvmlProbe=yes). "
        "no: only report these.",
    )
    cool_down: float = _key(
        "CoolDown",
        TimeSpan(0.0),
        "5min",
        "The least time between two restarts of the device plugin, counted from "
        "when it last started.",
    )
    max_restarts_per_hour: int = _key(
        "MaxRestartsPerHour",
        Int(0, 3600),
        "3",
        "Stop restarting the device plugin after this many restarts within an hour "
        "(0: never restart it).",
    )
    registration_grace: float = _key(
        "RegistrationGrace",
        TimeSpan(0.0),
        "2min",
        "How long a freshly started kubelet or device plugin may take to register "
        "before gpuguard acts.",
    )
    nvml_probe: bool = _key(
        "NvmlProbe",
        Bool(),
        "no",
        "Also check that NVML works inside the device plugin's container, which "
        "costs a process per pass.",
    )
    socket_dir: str = _key(
        "SocketDir",
        AbsPath(),
        "/var/lib/kubelet/device-plugins",
        "The directory of kubelet.sock and the device plugins' sockets.",
    )
    crictl: str = _key(
        "Crictl",
        AbsPath(),
        "/usr/bin/crictl",
        "The crictl binary used to find and restart the device plugin's container.",
    )
    cri_endpoint: str = _key(
        "CriEndpoint",
        CriEndpoint(),
        "unix:///run/containerd/containerd.sock",
        "The container runtime's CRI endpoint, passed to crictl.",
    )


@dataclass(frozen=True)
class InventoryConfig:
    SECTION: ClassVar[str] = "Inventory"

    file: str | None = _key(
        "File",
        AbsPath(optional=True),
        "",
        "A JSON GPU inventory to use instead of asking NVML (for simulations and "
        "tests); empty: ask NVML.",
    )


@dataclass(frozen=True)
class MetricsConfig:
    SECTION: ClassVar[str] = "Metrics"

    textfile_directory: str | None = _key(
        "TextfileDirectory",
        AbsPath(optional=True),
        "",
        "Write gpuguard.prom (Prometheus metrics) here after every pass, atomically, for "
        "node_exporter's textfile collector (its default directory is "
        "/var/lib/prometheus/node-exporter, which gpuguard.service may write); empty: off.",
    )


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
    inventory: InventoryConfig = field(default_factory=InventoryConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    origins: Mapping[Tuple[str, str], str] = field(
        default_factory=_empty_origins, compare=False, repr=False
    )

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


# ------------------------------------------------------------------------------ parsing


@dataclass(frozen=True)
class _Assignment:
    section: str
    key: str
    value: str
    source: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"


def _unknown_section(name: str) -> str:
    close = difflib.get_close_matches(name, list(_BY_SECTION), n=1)
    if not close:
        close = [s for s in _BY_SECTION if s.lower() == name.strip().lower()]
    hint = (
        f"did you mean [{close[0]}]?"
        if close
        else "sections are " + ", ".join(f"[{s}]" for s in _BY_SECTION)
    )
    return f"unknown section [{cut(name)}]; {hint} {SEE_ALSO}"


def _unknown_key(section: str, key: str) -> str:
    keys = list(_BY_SECTION[section])
    homes = [s for s, specs in _BY_SECTION.items() if key in specs]
    if homes:
        return f"key {clip(key)} belongs in [{homes[0]}], not [{section}]; move it there {SEE_ALSO}"
    same_case = [k for k in keys if k.lower() == key.lower()]
    close = same_case or difflib.get_close_matches(key, keys, n=1)
    if close:
        hint = f"did you mean '{close[0]}'?"
        if same_case:
            hint += " (keys are case-sensitive)"
    else:
        hint = f"[{section}] has {', '.join(keys)}"
    return f"unknown key {clip(key)} in [{section}]; {hint} {SEE_ALSO}"


def _parse_text(text: str, source: str) -> List[_Assignment]:
    """Split one file into assignments, rejecting what no later file could fix."""
    if text.startswith("\ufeff"):  # editors on other systems add a BOM
        text = text[1:]
    # split("\n"), not splitlines(): a form feed or U+2028 inside a line must not
    # shift the line numbers of every later message.
    lines = text.split("\n")
    out: List[_Assignment] = []
    first_line: Dict[Tuple[str, str], int] = {}
    section: str | None = None
    i = 0
    while i < len(lines):
        lineno = i + 1
        line = lines[i].strip()
        i += 1
        if not line or line[0] in "#;":
            continue
        where = f"{source}:{lineno}"
        if line.startswith("["):
            if not line.endswith("]"):
                raise ConfigError(
                    f"{where}: section header {clip(line)} is not closed; write [Name]"
                )
            name = line[1:-1]
            if name not in _BY_SECTION:
                raise ConfigError(f"{where}: {_unknown_section(name)}")
            section = name
            continue
        if "=" not in line:
            raise ConfigError(
                f"{where}: cannot parse {clip(line)}; expected Key=value, a [Section] header "
                "or a comment starting with # or ;"
            )
        # systemd: a trailing backslash joins the next line (the backslash becomes a
        # space) and comment lines inside such a continuation are skipped.
        while line.endswith("\\"):
            line = line[:-1] + " "
            while i < len(lines) and lines[i].strip()[:1] in ("#", ";"):
                i += 1
            if i >= len(lines):
                break
            line += lines[i].strip()
            i += 1
        key, _, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not key:
            raise ConfigError(f"{where}: missing key name before '='; write Key=value")
        if section is None:
            homes = [s for s, specs in _BY_SECTION.items() if key in specs]
            hint = f"put it under [{homes[0]}]" if homes else "put it under its [Section] header"
            raise ConfigError(
                f"{where}: key {clip(key)} appears before any [Section] header; {hint}"
            )
        if key not in _BY_SECTION[section]:
            raise ConfigError(f"{where}: {_unknown_key(section, key)}")
        if (section, key) in first_line:
            raise ConfigError(
                f"{where}: duplicate key {clip(key)} in [{section}], first set on line "
                f"{first_line[section, key]}; keep one of them (a later drop-in may "
                "override a key)"
            )
        first_line[section, key] = lineno
        out.append(_Assignment(section, key, value, source, lineno))
    return out


def _apply(assignments: Sequence[_Assignment]) -> Config:
    values: Dict[Tuple[str, str], Any] = {}
    origins: Dict[Tuple[str, str], str] = {}
    for a in assignments:
        spec = _BY_SECTION[a.section][a.key]
        if not a.value and spec.type.empty_resets:
            value = spec.default
        else:
            try:
                value = spec.type.parse(a.value)
            except ValueError as e:
                raise ConfigError(
                    f"{a.where}: invalid value {clip(a.value)} for {a.key} in [{a.section}]: {e} "
                    f"{SEE_ALSO}"
                ) from None
        values[a.section, a.key] = value
        origins[a.section, a.key] = a.where
    sections: Dict[str, Any] = {}
    for section, specs in _BY_SECTION.items():
        attr, cls = _SECTIONS[section]
        kwargs = {s.attr: values[section, k] for k, s in specs.items() if (section, k) in values}
        sections[attr] = cls(**kwargs)
    cfg = Config(**sections, origins=MappingProxyType(origins))
    _check(cfg)
    return cfg


def _check(cfg: Config) -> None:
    """Rules that span keys; the error points at whichever key a file set."""
    d = cfg.daemon
    for other, other_value in (
        ("QuietPeriod", d.quiet_period),
        ("ReloadQuietPeriod", d.reload_quiet_period),
    ):
        if d.max_delay < other_value:
            where = cfg.origin("Daemon", "MaxDelay")
            if where == DEFAULT_ORIGIN:
                where = cfg.origin("Daemon", other)
            raise ConfigError(
                f"{where}: MaxDelay={format_timespan(d.max_delay)} is shorter than "
                f"{other}={format_timespan(other_value)} in [Daemon]; raise MaxDelay or "
                f"lower {other} {SEE_ALSO}"
            )


def _read(path: Path) -> str:
    """The file's text; FileNotFoundError passes through for the caller to judge.

    Through the shared safe reader: a FIFO, /dev/zero or a huge file is refused in one
    line instead of hanging or filling memory. Links are followed (configuration
    management often links files into /etc)."""
    try:
        return safeio.read_text(
            path, what="configuration", max_bytes=safeio.CONFIG_MAX, follow=True
        )
    except safeio.UnsafeFileError as e:
        if e.errno == errno.ENOENT:
            raise FileNotFoundError(e.errno, e.message) from None
        raise ConfigError(e.message) from None


def _dropins(directory: Path) -> List[Path]:
    try:
        entries = list(directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        raise ConfigError(f"{directory}: cannot list drop-ins: {e.strerror}") from None
    # Hidden files are editors' and package managers' temporaries, not drop-ins.
    confs = [p for p in entries if p.name.endswith(".conf") and not p.name.startswith(".")]
    return sorted((p for p in confs if not p.is_dir()), key=lambda p: p.name)


def parse_config(text: str, *, source: str = "<string>") -> Config:
    """A Config from one file's text (e.g. to validate a file before installing it)."""
    return _apply(_parse_text(text, source))


def load_config(root: Root, *, path: Path | None = None) -> Config:
    """Read the main file and its drop-ins; a missing main file means defaults.

    With `path` (from --config), that file is read as given, not through `root` (it is
    a command-line path on this machine), it must exist, and its drop-ins are read from
    `<path>.d/`, the same layout as the default location.
    """
    if path is None:
        main = root.path(CONFIG_FILE)
        dropin_dir = root.path(CONFIG_DROPIN_DIR)
    else:
        main = Path(path)
        dropin_dir = main.with_name(main.name + ".d")
    assignments: List[_Assignment] = []
    try:
        assignments += _parse_text(_read(main), str(main))
    except FileNotFoundError:
        if path is not None:
            raise ConfigError(f"{main}: no such file; check the --config path") from None
    for dropin in _dropins(dropin_dir):
        try:
            assignments += _parse_text(_read(dropin), str(dropin))
        except FileNotFoundError:
            raise ConfigError(
                f"{dropin}: dangling symlink or removed while reading; fix or remove it"
            ) from None
    return _apply(assignments)


# ------------------------------------------------------- generated files (kept in sync)


def render_shipped() -> str:
    """packaging/gpuguard.conf: every key commented out with its default, systemd style."""
    out = [
        "#  This file is part of gpuguard.",
        "#",
        "# The entries below show the defaults, commented out. To change a setting,",
        "# uncomment it here or, better, create a drop-in such as",
        "# /etc/gpuguard/gpuguard.conf.d/50-local.conf with the section header and",
        "# only the keys you change. Drop-ins are read in lexical order and the last",
        "# assignment of a key wins; an empty value (Key=) restores the default, or",
        "# empties a list. Reload with: systemctl reload gpuguard",
        "#",
        "# Every key and the value syntax: man 5 gpuguard.conf",
    ]
    for section, specs in _BY_SECTION.items():
        out += ["", f"[{section}]"]
        for spec in specs.values():
            out += textwrap.wrap(
                spec.doc, 78, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False
            )
            out.append(f"#{spec.key}={spec.default_text}")
    return "\n".join(out) + "\n"


REFERENCE_BEGIN = "<!-- BEGIN GENERATED KEY REFERENCE: python -m gpuguard.config --reference -->"
REFERENCE_END = "<!-- END GENERATED KEY REFERENCE -->"


def render_reference() -> str:
    """The key reference of docs/configuration.md (between REFERENCE_BEGIN/END)."""
    out = [REFERENCE_BEGIN]
    for section, specs in _BY_SECTION.items():
        out += ["", f"### [{section}]", "", "| Key | Default | Type | Meaning |"]
        out.append("|---|---|---|---|")
        for spec in specs.values():
            default = f"`{spec.default_text}`" if spec.default_text else "(empty)"
            cells = [f"`{spec.key}`", default, spec.type.describe, spec.doc]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    out += ["", REFERENCE_END]
    return "\n".join(out) + "\n"


def _main(argv: Sequence[str]) -> int:
    # A developer's helper to regenerate the two generated files, not a user command.
    if list(argv) == ["--reference"]:
        sys.stdout.write(render_reference())
    elif list(argv) == ["--shipped"]:
        sys.stdout.write(render_shipped())
    else:
        sys.stderr.write("usage: python -m gpuguard.config --reference | --shipped\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
