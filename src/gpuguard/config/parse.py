"""Reading the configuration: /etc/gpuguard/gpuguard.conf plus drop-ins, in systemd's style.

The package's defaults are /usr/lib/gpuguard/gpuguard.conf, read only when
/etc/gpuguard/gpuguard.conf does not exist (as systemd reads /etc over /usr/lib): /etc
holds only what the operator writes, so no upgrade ever asks about a conffile.

The syntax is systemd's unit-file INI dialect, not Python's: `#` and `;` start comment
lines (there are no inline comments), keys are CamelCase and case-sensitive, a section
may be repeated, a trailing backslash continues a line, and `Key=` with an empty value
resets a key to its default (for a list: empties it). Drop-ins in
/etc/gpuguard/gpuguard.conf.d/*.conf are applied in lexical order; the last assignment
of a key wins.

An unknown section or key is a warning naming it, its file:line and the closest known
name, and is ignored: a node rolled back to an older gpuguard keeps running on a file
written for a newer one. `gpuguard config --check --strict` (CI) makes it an error.

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

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import AbstractSet, Any, Dict, List, Sequence, Tuple

from gpuguard.config.schema import (
    _BY_SECTION,
    _SECTIONS,
    DEFAULT_ORIGIN,
    MOVED_KEYS,
    SEE_ALSO,
    Config,
)
from gpuguard.config.types import closest, format_timespan
from gpuguard.errors import ConfigError
from gpuguard.host import safeio
from gpuguard.host.numparse import clip, cut
from gpuguard.host.paths import CONFIG_DEFAULTS_FILE, CONFIG_DROPIN_DIR, CONFIG_FILE, Root


class FileConfigError(ConfigError):
    """A ConfigError caused by one file (or drop-in directory): `source` names it."""

    def __init__(self, message: str, source: str) -> None:
        super().__init__(message)
        self.source = source


@dataclass(frozen=True)
class _Assignment:
    section: str
    key: str
    value: str
    source: str
    line: int
    moved_from: str = ""  # the section it was written in, for a key that moved (MOVED_KEYS)

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"


def _unknown_section(name: str) -> str:
    close = closest(name, list(_BY_SECTION))
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
    close = same_case or closest(key, keys)
    if close:
        hint = f"did you mean '{close[0]}'?"
        if same_case:
            hint += " (keys are case-sensitive)"
    else:
        hint = f"[{section}] has {', '.join(keys)}"
    return f"unknown key {clip(key)} in [{section}]; {hint} {SEE_ALSO}"


def _parse_text(
    text: str, source: str, warnings: List[str] | None = None, *, strict: bool = False
) -> List[_Assignment]:
    """Split one file into assignments, rejecting what no later file could fix.

    An unknown section or key is appended to `warnings` and ignored (an error when
    `strict`, or when there is no list to append to)."""

    def unknown(where: str, what: str) -> None:
        if strict or warnings is None:
            raise FileConfigError(f"{where}: {what}", source)
        warnings.append(f"{where}: {what}; ignored (a key of another gpuguard version?)")

    if text.startswith("\ufeff"):  # editors on other systems add a BOM
        text = text[1:]
    # split("\n"), not splitlines(): a form feed or U+2028 inside a line must not
    # shift the line numbers of every later message.
    lines = text.split("\n")
    out: List[_Assignment] = []
    first_line: Dict[Tuple[str, str], int] = {}
    section: str | None = None
    skipping = False  # inside an unknown section: its keys are not warned about again
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
            skipping = name not in _BY_SECTION
            if skipping:
                unknown(where, _unknown_section(name))
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
        if skipping:
            continue
        home = MOVED_KEYS.get((section, key), section)
        if key not in _BY_SECTION[home]:
            unknown(where, _unknown_key(section, key))
            continue
        if (home, key) in first_line:
            raise ConfigError(
                f"{where}: duplicate key {clip(key)} in [{home}], first set on line "
                f"{first_line[home, key]}; keep one of them (a later drop-in may "
                "override a key)"
            )
        first_line[home, key] = lineno
        moved_from = section if home != section else ""
        out.append(_Assignment(home, key, value, source, lineno, moved_from))
    return out


VALUE_MAX = 4096  # characters of one value: a list of units or resources fits many times


def _apply(assignments: Sequence[_Assignment], unknown: Sequence[str] = ()) -> Config:
    values: Dict[Tuple[str, str], Any] = {}
    origins: Dict[Tuple[str, str], str] = {}
    for a in assignments:
        spec = _BY_SECTION[a.section][a.key]
        if len(a.value) > VALUE_MAX or not a.value.isprintable():
            why = (
                f"is {len(a.value)} characters long (at most {VALUE_MAX})"
                if len(a.value) > VALUE_MAX
                else "has a character that is not printable (a control character, a "
                "no-break or zero-width space)"
            )
            raise FileConfigError(
                f"{a.where}: the value {clip(a.value)} of {a.key} in [{a.section}] {why}; "
                f"write it on one line of plain text {SEE_ALSO}",
                a.source,
            )
        if not a.value and spec.type.empty_resets:
            value = spec.default
        else:
            try:
                value = spec.type.parse(a.value)
            except ValueError as e:
                raise FileConfigError(
                    f"{a.where}: invalid value {clip(a.value)} for {a.key} in [{a.section}]: {e} "
                    f"{SEE_ALSO}",
                    a.source,
                ) from None
        values[a.section, a.key] = value
        origins[a.section, a.key] = a.where
    sections: Dict[str, Any] = {}
    for section, specs in _BY_SECTION.items():
        attr, cls = _SECTIONS[section]
        kwargs = {s.attr: values[section, k] for k, s in specs.items() if (section, k) in values}
        sections[attr] = cls(**kwargs)
    warnings = tuple(unknown) + tuple(
        f"{a.where}: {a.key}= in [{a.moved_from}] is deprecated, it belongs in [{a.section}] "
        f"(read this time); move it there {SEE_ALSO}"
        for a in assignments
        if a.moved_from
    )
    cfg = Config(**sections, origins=MappingProxyType(origins), warnings=warnings)
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
            raise FileConfigError(
                f"{where}: MaxDelay={format_timespan(d.max_delay)} is shorter than "
                f"{other}={format_timespan(other_value)} in [Daemon]; raise MaxDelay or "
                f"lower {other} {SEE_ALSO}",
                where.rpartition(":")[0],
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


def _dropins(directory: Path, root: Root) -> List[Path]:
    """The drop-ins, in order; a directory that cannot be one is an error, never silence
    (a canary's drop-in written as a file would leave the node in repair mode)."""
    if directory.is_symlink():
        real = Path(os.path.realpath(directory))
        top = Path(os.path.realpath(root.prefix))
        if not root.is_host and real != top and top not in real.parents:
            raise FileConfigError(
                f"{directory}: the drop-in directory is a symbolic link to {clip(str(real))}, "
                f"outside the root {root.prefix}; make it a directory under the root",
                str(directory),
            )
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise FileConfigError(
            f"{directory}: is a file, not a directory, so no drop-in is read; make it a "
            f"directory and put drop-ins in it as NN-name.conf {SEE_ALSO}",
            str(directory),
        ) from None
    except OSError as e:
        raise FileConfigError(
            f"{directory}: cannot list drop-ins: {e.strerror}", str(directory)
        ) from None
    # Hidden files are editors' and package managers' temporaries, not drop-ins.
    confs = [p for p in entries if p.name.endswith(".conf") and not p.name.startswith(".")]
    return sorted((p for p in confs if not p.is_dir()), key=lambda p: p.name)


def parse_config(text: str, *, source: str = "<string>", strict: bool = False) -> Config:
    """A Config from one file's text (e.g. to validate a file before installing it)."""
    unknown: List[str] = []
    return _apply(_parse_text(text, source, unknown, strict=strict), unknown)


def config_files(root: Root, path: Path | None = None) -> Tuple[Path, Path]:
    """The main file and the drop-in directory read: /etc's file, or the package's
    defaults where /etc has none; with `path` (--config), that file and `<path>.d/`."""
    if path is not None:
        main = Path(path)
        return main, main.with_name(main.name + ".d")
    main = root.path(CONFIG_FILE)
    if not os.path.lexists(main) and os.path.exists(root.path(CONFIG_DEFAULTS_FILE)):
        main = root.path(CONFIG_DEFAULTS_FILE)
    return main, root.path(CONFIG_DROPIN_DIR)


def _load(root: Root, path: Path | None, strict: bool, skip: AbstractSet[str]) -> Config:
    main, dropin_dir = config_files(root, path)
    assignments: List[_Assignment] = []
    unknown: List[str] = []
    files: List[Path] = [main] if str(main) not in skip else []
    if str(dropin_dir) not in skip:
        files += _dropins(dropin_dir, root)
    for file in files:
        if str(file) in skip:
            continue
        try:
            text = _read(file)
        except FileNotFoundError:
            if file != main:
                raise FileConfigError(
                    f"{file}: dangling symlink or removed while reading; fix or remove it",
                    str(file),
                ) from None
            if path is not None:
                raise ConfigError(f"{main}: no such file; check the --config path") from None
            continue
        except ConfigError as e:
            raise FileConfigError(e.message, str(file)) from None
        try:
            assignments += _parse_text(text, str(file), unknown, strict=strict)
        except FileConfigError:
            raise
        except ConfigError as e:
            raise FileConfigError(e.message, str(file)) from None
    return _apply(assignments, unknown)


def load_config(root: Root, *, path: Path | None = None, strict: bool = False) -> Config:
    """Read the main file and its drop-ins; a missing main file means defaults.

    With `path` (from --config), that file is read as given, not through `root` (it is
    a command-line path on this machine), it must exist, and its drop-ins are read from
    `<path>.d/`, the same layout as the default location. `strict`: an unknown section
    or key is an error, not a warning.
    """
    return _load(root, path, strict, frozenset())


def load_config_or_fallback(root: Root, *, path: Path | None = None) -> Tuple[Config, str]:
    """The configuration, and "" when it loaded; else the configuration without the
    broken file(s) (or the defaults, where the error names no one file) and one line
    that says which file is broken. For the commands that help debug a node (status,
    doctor, check --dry-run): they must run when the configuration does not."""
    skip: set[str] = set()
    first = ""
    for _ in range(2 + 64):  # the main file, the directory, and at most 64 drop-ins
        try:
            cfg = _load(root, path, False, frozenset(skip))
        except FileConfigError as e:
            first = first or e.message
            if not e.source or e.source in skip:
                break
            skip.add(e.source)
            continue
        except ConfigError as e:
            first = first or e.message
            break
        if not first:
            return cfg, ""
        return cfg, f"{first}; this command ignores {', '.join(sorted(skip))} and reads the rest"
    return _apply([]), f"{first}; this command runs on the defaults"
