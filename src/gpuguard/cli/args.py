"""What every command reads from its arguments: the root, the configuration, the log."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # imported where used: each command loads only what it needs
    from gpuguard.config import Config
    from gpuguard.host.nvmllib import NvmlLookup
    from gpuguard.host.paths import Root
    from gpuguard.journal.log import EventLog


def opt(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    """An option's value (argparse's namespace is untyped; callers know its type)."""
    return getattr(args, name, default)


def log_from(
    args: argparse.Namespace, cfg: Optional[Config] = None, root: Optional[Root] = None
) -> EventLog:
    from gpuguard.journal.log import EventLog

    default = cfg.daemon.log_level if cfg is not None else "info"
    log = EventLog.auto(
        level=opt(args, "log_level", default),
        force_json=opt(args, "log_json", False),
        root=root.prefix if root is not None else Path("/"),
    )
    log.route_modules()  # devices/, steps/ ... log through it, debug included
    for warning in cfg.warnings if cfg is not None else ():
        log.warning(warning)  # a deprecated key, still read
    return log


def root_from(args: argparse.Namespace) -> Root:
    from gpuguard.host.paths import Root

    # abspath, not resolve(): /proc/<pid>/root (another mount namespace's root) is a
    # magic link that resolves to "/", which would silently mean this host's files.
    return Root(Path(os.path.abspath(opt(args, "root", "/"))))


def config_from(args: argparse.Namespace, root: Root, *, strict: bool = False) -> Config:
    from gpuguard.config import load_config

    return load_config(root, path=opt(args, "config"), strict=strict)


def config_or_fallback(args: argparse.Namespace, root: Root) -> Config:
    """For the commands that help debug a node (status, doctor, check --dry-run): with a
    broken file, the configuration without it (or the defaults) and one line on stderr
    naming it, instead of refusing to run."""
    import sys

    from gpuguard.config import load_config_or_fallback

    cfg, broken = load_config_or_fallback(root, path=opt(args, "config"))
    if broken:
        print(f"gpuguard: warning: {broken}", file=sys.stderr)
    return cfg


def inventory_path(args: argparse.Namespace, cfg: Config) -> Optional[Path]:
    explicit = opt(args, "inventory")
    if explicit is not None:
        return Path(explicit)
    return Path(cfg.inventory.file) if cfg.inventory.file else None


def nvml_lookup(root: Root, cfg: Config) -> NvmlLookup:
    """Where NVML's library is looked for: the same for every command and the daemon."""
    from gpuguard.host.nvmllib import NvmlLookup

    return NvmlLookup(root, cfg.inventory.driver_root or "")
