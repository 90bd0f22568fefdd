"""gpuguard.conf parsing, drop-in precedence, error messages, render round trip, doc sync."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard import config as cfgmod
from gpuguard.config import (
    KEYS,
    REFERENCE_BEGIN,
    REFERENCE_END,
    Config,
    load_config,
    parse_config,
    render_reference,
    render_shipped,
)
from gpuguard.config.types import MAX_TIMESPAN_USEC, format_timespan, parse_timespan
from gpuguard.errors import ConfigError
from gpuguard.host.paths import CONFIG_DROPIN_DIR, CONFIG_FILE, Root

REPO = Path(__file__).resolve().parents[2]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def value(cfg: Config, section: str, key: str) -> Any:
    return cfg.value(section, key)


# ------------------------------------------------------------------------ value parsing

VALID = [
    # booleans, every spelling
    *[("Daemon", "DryRun", text, True) for text in ("yes", "true", "1", "on", "YES", "On")],
    *[("Daemon", "DryRun", text, False) for text in ("no", "false", "0", "off", "No", "OFF")],
    # time spans (systemd.time(7))
    ("Daemon", "AuditInterval", "5min", 300.0),
    ("Daemon", "AuditInterval", "300s", 300.0),
    ("Daemon", "AuditInterval", "300", 300.0),
    ("Daemon", "AuditInterval", "1h", 3600.0),
    ("Daemon", "AuditInterval", "1h 30min", 5400.0),
    ("Daemon", "AuditInterval", "5 min", 300.0),
    ("Daemon", "AuditInterval", "1.5h", 5400.0),
    ("Daemon", "AuditInterval", "1d", 86400.0),
    ("Daemon", "AuditInterval", "2 minutes", 120.0),
    ("Daemon", "AuditInterval", "1w", 604800.0),
    ("Daemon", "QuietPeriod", "150ms", 0.15),
    ("Daemon", "QuietPeriod", "1s 500ms", 1.5),
    ("Daemon", "QuietPeriod", "1s500ms", 1.5),
    ("Daemon", "QuietPeriod", "0", 0.0),
    ("Daemon", "QuietPeriod", "100us", 0.0001),
    ("Daemon", "QuietPeriod", "100\u00b5s", 0.0001),
    ("Daemon", "QuietPeriod", "1.5s", 1.5),
    ("Daemon", "QuietPeriod", ".5s", 0.5),
    ("Inventory", "File", "/etc/gpuguard/inventory.json", "/etc/gpuguard/inventory.json"),
    ("Inventory", "File", "", None),
    # choices
    ("Daemon", "LogLevel", "debug", "debug"),
    ("Kubelet", "Policy", "delete", "delete"),
    ("Kubelet", "Policy", "report", "report"),
    ("Devices", "V2Remedy", "restart-container", "restart-container"),
    # integers
    ("Kubelet", "BackupKeep", "1", 1),
    ("Kubelet", "BackupKeep", "+7", 7),
    ("Systemd", "MaxInFlight", "4096", 4096),
    ("DevicePlugin", "MaxRestartsPerHour", "0", 0),
    # lists, including an empty one
    ("Kubelet", "Resources", "nvidia.com/gpu", ("nvidia.com/gpu",)),
    ("Kubelet", "Resources", "  a.io/x   b.io/y-*  ", ("a.io/x", "b.io/y-*")),
    ("Kubelet", "Resources", "", ()),
    ("Systemd", "RuntimeUnits", "containerd.service", ("containerd.service",)),
    ("Systemd", "RuntimeUnits", "", ()),
    (
        "Systemd",
        "KubeletUnits",
        "kubelet.service k3s-agent.service",
        ("kubelet.service", "k3s-agent.service"),
    ),
    # unit names, paths, endpoints
    (
        "Kubelet",
        "Unit",
        "snap.microk8s.daemon-kubelite.service",
        "snap.microk8s.daemon-kubelite.service",
    ),
    ("Kubelet", "CheckpointPath", "/var/snap/kubelet/cp", "/var/snap/kubelet/cp"),
    ("Runtime", "Crictl", "/usr/local/bin/crictl", "/usr/local/bin/crictl"),
    ("Runtime", "CriEndpoint", "unix:///run/crio/crio.sock", "unix:///run/crio/crio.sock"),
    ("Inventory", "File", "/etc/gpuguard/inventory.json", "/etc/gpuguard/inventory.json"),
    ("Inventory", "File", "", None),
    # an empty scalar restores the default (systemd's `Key=`)
    ("Daemon", "AuditInterval", "", 300.0),
    ("Kubelet", "Policy", "", "rewrite"),
    ("Kubelet", "RestartKubelet", "", True),
    ("Kubelet", "RestartPolicy", "for-pods-no-agent", "for-pods-no-agent"),
    ("Kubelet", "RestartPolicy", "", "for-pods"),
]


@pytest.mark.parametrize(("section", "key", "text", "expected"), VALID)
def test_valid_values(section: str, key: str, text: str, expected: Any) -> None:
    cfg = parse_config(f"[{section}]\n{key}={text}\n", source="t.conf")
    assert value(cfg, section, key) == expected
    assert cfg.origin(section, key) == "t.conf:2"


# Every error names file:line; (file text, line, fragment of the message). Unknown
# sections and keys are errors in strict mode (`config --check --strict`), warnings else.
ERRORS = [
    (
        "[Daemon]\nAuditIntervall=5min\n",
        2,
        "unknown key 'AuditIntervall' in [Daemon]; did you mean 'AuditInterval'?",
    ),
    (
        "[Daemon]\nauditinterval=5min\n",
        2,
        "did you mean 'AuditInterval'? (keys are case-sensitive)",
    ),
    ("[Daemon]\nPolicy=report\n", 2, "key 'Policy' belongs in [Kubelet], not [Daemon]"),
    (
        "[Daemon]\nFrobnicate=1\n",
        2,
        "unknown key 'Frobnicate' in [Daemon]; [Daemon] has AuditInterval,",
    ),
    ("# c\n[Deamon]\n", 2, "unknown section [Deamon]; did you mean [Daemon]?"),
    ("[daemon]\n", 1, "did you mean [Daemon]?"),
    ("[Nothing]\n", 1, "sections are [Daemon], [Kubelet]"),
    ("[Daemon\n", 1, "section header '[Daemon' is not closed"),
    (
        "QuietPeriod=1s\n",
        1,
        "key 'QuietPeriod' appears before any [Section] header; put it under [Daemon]",
    ),
    ("[Daemon]\nDryRun\n", 2, "cannot parse 'DryRun'; expected Key=value"),
    ("[Daemon]\n=yes\n", 2, "missing key name before '='"),
    (
        "[Daemon]\nDryRun=no\n\n[Kubelet]\n[Daemon]\nDryRun=yes\n",
        6,
        "duplicate key 'DryRun' in [Daemon], first set on line 2",
    ),
    (
        "[Daemon]\nDryRun=maybe\n",
        2,
        "invalid value 'maybe' for DryRun in [Daemon]: not a boolean; use yes or no",
    ),
    (
        "[Daemon]\nQuietPeriod=fast\n",
        2,
        "for QuietPeriod in [Daemon]: not a time span; use a number with a unit",
    ),
    ("[Daemon]\nQuietPeriod=5mni\n", 2, "unknown time unit 'mni'; did you mean 5min?"),
    ("[Daemon]\nQuietPeriod=2 500ms\n", 2, "'2' has no unit"),
    ("[Daemon]\nQuietPeriod=-1s\n", 2, "not a time span"),
    ("[Daemon]\nAuditInterval=10ms\n", 2, "for AuditInterval in [Daemon]: must be at least 1s"),
    ("[Daemon]\nHookTimeout=0\n", 2, "must be at least 1ms"),
    ("[Daemon]\nLogLevel=verbose\n", 2, "not one of debug, info, warning, error; use one of"),
    (
        "[Kubelet]\nPolicy=rewite\n",
        2,
        "not one of rewrite, delete, report; did you mean 'rewrite'?",
    ),
    ("[Kubelet]\nPolicy=Report\n", 2, "did you mean 'report'?"),
    ("[Kubelet]\nBackupKeep=many\n", 2, "not an integer; use a whole number 1..10000"),
    ("[Kubelet]\nBackupKeep=1_000\n", 2, "not an integer"),
    ("[Kubelet]\nBackupKeep=0\n", 2, "out of range; use a number 1..10000"),
    ("[Systemd]\nMaxInFlight=99999\n", 2, "out of range"),
    ("[Kubelet]\nUnit=kubelet\n", 2, "not a service unit name; did you mean 'kubelet.service'?"),
    ("[Kubelet]\nUnit=kubelet.service # the unit\n", 2, "not a service unit name"),
    ("[Systemd]\nRuntimeUnits=containerd.service crio\n", 2, "did you mean 'crio.service'?"),
    ("[Kubelet]\nResources=gpu\n", 2, "'gpu' is not an extended resource name or glob"),
    ("[Kubelet]\nCheckpointPath=var/lib/x\n", 2, "not an absolute path"),
    ("[Inventory]\nFile=inv.json\n", 2, "not an absolute path"),
    ("[Runtime]\nCriEndpoint=/run/containerd/containerd.sock\n", 2, "not a CRI endpoint"),
    ("[Daemon]\nQuietPeriod=5s\n", 2, "MaxDelay=2s is shorter than QuietPeriod=5s in [Daemon]"),
    (
        "[Daemon]\nReloadQuietPeriod=3s\nMaxDelay=1s\n",
        3,
        "MaxDelay=1s is shorter than ReloadQuietPeriod=3s",
    ),
]


@pytest.mark.parametrize(("text", "line", "fragment"), ERRORS)
def test_errors_name_file_and_line(tmp_path: Path, text: str, line: int, fragment: str) -> None:
    path = write(tmp_path / "gpuguard.conf", text)
    with pytest.raises(ConfigError) as info:
        load_config(Root(tmp_path), path=path, strict=True)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: "), message
    assert fragment in message, message
    assert "\n" not in message
    assert info.value.exit_code == 2


def test_every_unknown_key_error_points_at_docs() -> None:
    with pytest.raises(ConfigError, match=re.escape(cfgmod.SEE_ALSO)):
        parse_config("[Daemon]\nAuditIntervall=5min\n", strict=True)


def test_not_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "gpuguard.conf"
    path.write_bytes(b"[Daemon]\n# caf\xe9\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}:2: not valid UTF-8")):
        load_config(Root(tmp_path), path=path)


def test_explicit_config_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file; check the --config path"):
        load_config(Root(tmp_path), path=tmp_path / "nope.conf")


def test_main_file_that_is_a_directory(tmp_path: Path) -> None:
    Root(tmp_path).path(CONFIG_FILE).mkdir(parents=True)
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(Root(tmp_path))


def test_bad_value_in_a_file_is_an_error_even_if_a_dropin_overrides_it(tmp_path: Path) -> None:
    root = Root(tmp_path)
    write(root.path(CONFIG_FILE), "[Daemon]\nDryRun=maybe\n")
    write(root.path(CONFIG_DROPIN_DIR) / "50-x.conf", "[Daemon]\nDryRun=yes\n")
    with pytest.raises(ConfigError, match=":2: invalid value 'maybe'"):
        load_config(root)


# ------------------------------------------------------------------------------- syntax


def test_missing_main_file_means_defaults(tmp_path: Path) -> None:
    cfg = load_config(Root(tmp_path))
    assert cfg == Config()
    assert all(cfg.origin(s.section, s.key) == "default" for s in KEYS)


def test_comments_blank_lines_bom_and_whitespace() -> None:
    text = "\ufeff# comment\n; also a comment\n\n  [Daemon]  \n  DryRun =  yes  \n#DryRun=no\n"
    cfg = parse_config(text, source="f")
    assert cfg.daemon.dry_run is True
    assert cfg.origin("Daemon", "DryRun") == "f:5"


def test_hash_inside_a_value_is_not_a_comment() -> None:
    cfg = parse_config("[Runtime]\nCriEndpoint=unix:///run/x#y.sock\n")
    assert cfg.runtime.cri_endpoint == "unix:///run/x#y.sock"


def test_repeated_section_in_one_file_is_allowed() -> None:
    cfg = parse_config("[Daemon]\nDryRun=yes\n[Kubelet]\nPolicy=report\n[Daemon]\nLogLevel=debug\n")
    assert (cfg.daemon.dry_run, cfg.kubelet.policy, cfg.daemon.log_level) == (
        True,
        "report",
        "debug",
    )


def test_backslash_continues_a_line_and_skips_comments_inside() -> None:
    text = "[Kubelet]\nResources=a.io/x \\\n# skipped\n  b.io/y \\\n  c.io/z\nPolicy=report\n"
    cfg = parse_config(text, source="f")
    assert cfg.kubelet.resources == ("a.io/x", "b.io/y", "c.io/z")
    assert cfg.origin("Kubelet", "Resources") == "f:2"
    assert cfg.origin("Kubelet", "Policy") == "f:6"


def test_keys_are_case_sensitive_and_sections_too() -> None:
    with pytest.raises(ConfigError):
        parse_config("[Daemon]\ndryrun=yes\n", strict=True)
    with pytest.raises(ConfigError):
        parse_config("[DAEMON]\n", strict=True)
    assert not parse_config("[Daemon]\ndryrun=yes\n").daemon.dry_run


# ------------------------------------------------------------------ rollback safety


def test_unknown_keys_and_sections_warn_with_file_line_and_a_guess(tmp_path: Path) -> None:
    """A file written for another gpuguard version: warned about, never fatal."""
    write(tmp_path / "etc/gpuguard/gpuguard.conf", "[Daemon]\nDryRun=yes\n")
    dropin = write(
        tmp_path / "etc/gpuguard/gpuguard.conf.d/50-new.conf",
        "[Daemon]\nAuditIntervall=5min\nModeX=observe\n[Alerts]\nRule=x\nOther=y\n"
        "[Kubelet]\nPolicy=report\n",
    )
    cfg = load_config(Root(tmp_path))
    assert cfg.daemon.dry_run and cfg.kubelet.policy == "report"
    unknown = [w for w in cfg.warnings if "ignored" in w]
    assert len(unknown) == 3, cfg.warnings  # the section once, not each of its keys
    assert unknown[0].startswith(f"{dropin}:2: unknown key 'AuditIntervall' in [Daemon]; ")
    assert "did you mean 'AuditInterval'?" in unknown[0]
    assert unknown[1].startswith(f"{dropin}:3: unknown key 'ModeX'")
    assert unknown[2].startswith(f"{dropin}:4: unknown section [Alerts]; ")
    with pytest.raises(ConfigError, match=re.escape(f"{dropin}:2: unknown key 'AuditIntervall'")):
        load_config(Root(tmp_path), strict=True)


def test_a_broken_dropin_falls_back_and_names_the_file(tmp_path: Path) -> None:
    write(tmp_path / "etc/gpuguard/gpuguard.conf", "[Daemon]\nDryRun=yes\n")
    good = tmp_path / "etc/gpuguard/gpuguard.conf.d/10-good.conf"
    write(good, "[Kubelet]\nPolicy=report\n")
    bad = write(tmp_path / "etc/gpuguard/gpuguard.conf.d/50-bad.conf", "[Daemon]\nDryRun=maybe\n")
    with pytest.raises(ConfigError):
        load_config(Root(tmp_path))
    cfg, note = cfgmod.load_config_or_fallback(Root(tmp_path))
    assert cfg.daemon.dry_run and cfg.kubelet.policy == "report"
    assert note.startswith(f"{bad}:2: invalid value 'maybe'") and "\n" not in note
    assert note.endswith(f"this command ignores {bad} and reads the rest")
    # A rule across keys: the file that set the key named is left out.
    bad.write_text("[Daemon]\nQuietPeriod=5s\n")
    cfg, note = cfgmod.load_config_or_fallback(Root(tmp_path))
    assert "MaxDelay=2s is shorter than QuietPeriod=5s" in note
    assert cfg.daemon.dry_run and note.endswith(f"ignores {bad} and reads the rest")
    good.unlink()
    bad.unlink()
    assert cfgmod.load_config_or_fallback(Root(tmp_path))[1] == ""


def test_a_dropin_directory_that_is_a_file_or_leaves_the_root_is_an_error(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    conf_d = write(root / "etc/gpuguard/gpuguard.conf.d", "[Daemon]\nMode=observe\n")
    with pytest.raises(ConfigError, match=re.escape(f"{conf_d}: is a file, not a directory")):
        load_config(Root(root))
    conf_d.unlink()
    outside = tmp_path / "elsewhere"
    write(outside / "50-x.conf", "[Daemon]\nDryRun=yes\n")
    conf_d.symlink_to(outside)
    with pytest.raises(ConfigError, match=r"symbolic link to .*, outside the root"):
        load_config(Root(root))
    conf_d.unlink()
    inside = root / "srv/conf.d"
    write(inside / "50-x.conf", "[Daemon]\nDryRun=yes\n")
    conf_d.symlink_to(inside)
    assert load_config(Root(root)).daemon.dry_run


def test_the_package_defaults_are_read_where_etc_has_no_file(tmp_path: Path) -> None:
    write(tmp_path / "usr/lib/gpuguard/gpuguard.conf", "[Daemon]\nDryRun=yes\n")
    assert load_config(Root(tmp_path)).daemon.dry_run
    assert cfgmod.config_files(Root(tmp_path))[0] == tmp_path / "usr/lib/gpuguard/gpuguard.conf"
    # /etc's file replaces the package's (systemd's rule), drop-ins apply to either.
    write(tmp_path / "etc/gpuguard/gpuguard.conf", "[Kubelet]\nPolicy=report\n")
    cfg = load_config(Root(tmp_path))
    assert not cfg.daemon.dry_run and cfg.kubelet.policy == "report"


# --------------------------------------------------------------------------- precedence


def test_dropins_apply_in_lexical_order_and_last_wins(tmp_path: Path) -> None:
    root = Root(tmp_path)
    main = write(root.path(CONFIG_FILE), "[Daemon]\nQuietPeriod=100ms\nDryRun=yes\n")
    d = root.path(CONFIG_DROPIN_DIR)
    a = write(d / "10-a.conf", "[Daemon]\nQuietPeriod=200ms\nLogLevel=debug\n")
    b = write(d / "9-b.conf", "[Daemon]\nLogLevel=warning\n")  # "10-" < "9-": b is last
    write(d / "20-ignored.conf.disabled", "[Daemon]\nDryRun=no\n")
    write(d / ".50-hidden.conf", "[Daemon]\nDryRun=no\n")
    (d / "30-dir.conf").mkdir()
    cfg = load_config(root)
    assert cfg.daemon.quiet_period == 0.2
    assert cfg.daemon.log_level == "warning"
    assert cfg.daemon.dry_run is True
    assert cfg.origin("Daemon", "QuietPeriod") == f"{a}:2"
    assert cfg.origin("Daemon", "LogLevel") == f"{b}:2"
    assert cfg.origin("Daemon", "DryRun") == f"{main}:3"
    assert cfg.origin("Daemon", "MaxDelay") == "default"


def test_dropins_apply_without_a_main_file(tmp_path: Path) -> None:
    root = Root(tmp_path)
    write(root.path(CONFIG_DROPIN_DIR) / "50-x.conf", "[Kubelet]\nPolicy=report\n")
    assert load_config(root).kubelet.policy == "report"


def test_same_key_in_two_files_is_not_a_duplicate(tmp_path: Path) -> None:
    root = Root(tmp_path)
    write(root.path(CONFIG_FILE), "[Kubelet]\nPolicy=delete\n")
    write(root.path(CONFIG_DROPIN_DIR) / "50-x.conf", "[Kubelet]\nPolicy=report\n")
    assert load_config(root).kubelet.policy == "report"


def test_empty_value_in_a_dropin_resets_to_default_or_empties_a_list(tmp_path: Path) -> None:
    root = Root(tmp_path)
    write(
        root.path(CONFIG_FILE),
        "[Daemon]\nQuietPeriod=1s\nHookTimeout=30s\n[Kubelet]\nResources=a.io/b\n",
    )
    write(
        root.path(CONFIG_DROPIN_DIR) / "50-x.conf",
        "[Daemon]\nQuietPeriod=\nHookTimeout=\n[Kubelet]\nResources=\n",
    )
    cfg = load_config(root)
    assert cfg.daemon.quiet_period == 0.15
    assert cfg.daemon.hook_timeout == 10.0
    assert cfg.kubelet.resources == ()


def test_explicit_path_reads_its_own_dropins_not_roots(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    write(root.path(CONFIG_FILE), "[Kubelet]\nPolicy=delete\n")
    path = write(tmp_path / "elsewhere" / "my.conf", "[Daemon]\nDryRun=yes\n")
    write(tmp_path / "elsewhere" / "my.conf.d" / "10-x.conf", "[Daemon]\nLogLevel=debug\n")
    cfg = load_config(root, path=path)
    assert cfg.daemon.dry_run is True
    assert cfg.daemon.log_level == "debug"
    assert cfg.kubelet.policy == "rewrite"


# ----------------------------------------------------------------- render and round trip


def _every_key_changed() -> Config:
    text = """
[Daemon]
AuditInterval=1h 2min 3s 4ms 5us
QuietPeriod=300ms
MaxDelay=5s
ReloadQuietPeriod=1ms
PrivateSocket=
Mode=observe
DryRun=yes
HookTimeout=2.5s
LogLevel=debug
[Kubelet]
Unit=kubelet-custom.service
CheckpointPath=/srv/kubelet/checkpoint with space
LogFile=/var/lib/rancher/rke2/agent/logs/kubelet.log
Policy=report
Resources=
BackupDir=/srv/backups
BackupKeep=3
RestartKubelet=no
Kubeconfig=/var/lib/rancher/k3s/agent/kubelet.kubeconfig
NodeName=gpu-node-7
RestartPolicy=never
[Systemd]
RuntimeUnits=containerd.service
KubeletUnits=
MaxInFlight=8
[Devices]
CreateNodes=no
CreateCharLinks=no
NvidiaModprobe=/opt/nvidia/bin/nvidia-modprobe
Regrant=no
DurableGrants=no
WatchInterval=1s
V2Remedy=restart-container
[DevicePlugin]
Restart=no
CoolDown=0
MaxRestartsPerHour=0
RegistrationGrace=1d
NvmlProbe=yes
SocketDir=/srv/device-plugins
[Runtime]
Crictl=/opt/bin/crictl
CriEndpoint=tcp://127.0.0.1:1234
[Inventory]
File=/etc/gpuguard/inventory.json
AllowKubeletRestart=yes
DriverRoot=/run/nvidia/custom-driver
DriverStartGrace=20min
[Metrics]
TextfileDirectory=/var/lib/node_exporter/textfile_collector
"""
    return parse_config(text, source="all.conf")


def test_every_key_changed_really_changes_every_key() -> None:
    cfg, default = _every_key_changed(), Config()
    for spec in KEYS:
        assert cfg.value(spec.section, spec.key) != default.value(spec.section, spec.key), spec.key
        assert cfg.origin(spec.section, spec.key).startswith("all.conf:")


@pytest.mark.parametrize("cfg", [Config(), _every_key_changed()], ids=["defaults", "all-changed"])
def test_render_round_trip(tmp_path: Path, cfg: Config) -> None:
    path = write(tmp_path / "effective.conf", cfg.render())
    again = load_config(Root(tmp_path), path=path)
    assert again == cfg
    assert again.render().count(f"# {path}:") == len(KEYS)


def test_render_says_where_each_value_came_from(tmp_path: Path) -> None:
    root = Root(tmp_path)
    main = write(root.path(CONFIG_FILE), "[Daemon]\n\nDryRun=yes\n")
    lines = load_config(root).render().splitlines()
    i = lines.index("DryRun=yes")
    assert lines[i - 1] == f"# {main}:3"
    j = lines.index("LogLevel=info")
    assert lines[j - 1] == "# default"
    for spec in KEYS:
        assert sum(1 for line in lines if line.startswith(f"{spec.key}=")) == 1


@given(st.integers(min_value=0, max_value=MAX_TIMESPAN_USEC))
def test_timespan_format_parse_are_inverse(usec: int) -> None:
    seconds = usec / 1_000_000
    assert parse_timespan(format_timespan(seconds)) == seconds


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (300, "5min"),
        (0.15, "150ms"),
        (2.5, "2s 500ms"),
        (0, "0"),
        (5400, "1h 30min"),
        (86400, "1d"),
    ],
)
def test_format_timespan_like_systemd(seconds: float, text: str) -> None:
    assert format_timespan(seconds) == text


# ------------------------------------------------------------------ table and doc sync


def test_table_covers_every_field_and_defaults_parse_to_field_defaults() -> None:
    attrs = {(s.section, s.attr) for s in KEYS}
    for section_field in dataclasses.fields(Config):
        if section_field.name in ("origins", "warnings"):
            continue
        cls = type(getattr(Config(), section_field.name))
        for f in dataclasses.fields(cls):
            assert (cls.SECTION, f.name) in attrs  # type: ignore[attr-defined]
    assert len({(s.section, s.key) for s in KEYS}) == len(KEYS)
    for spec in KEYS:
        parsed = spec.type.parse(spec.default_text) if spec.default_text else spec.default
        assert parsed == spec.default == Config().value(spec.section, spec.key)
        assert spec.doc and "\n" not in spec.doc


def test_expected_defaults() -> None:
    """The defaults the design settled on; a change here is a user-visible change."""
    d = Config()
    assert (d.daemon.audit_interval, d.daemon.quiet_period, d.daemon.max_delay) == (300, 0.15, 2)
    assert (d.daemon.reload_quiet_period, d.daemon.hook_timeout) == (0.005, 10)
    assert (d.daemon.dry_run, d.daemon.log_level, d.inventory.file) == (False, "info", None)
    assert d.kubelet.resources == ("nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-*")
    assert (d.kubelet.policy, d.kubelet.backup_keep, d.kubelet.restart_kubelet) == (
        "rewrite",
        20,
        True,
    )
    assert d.systemd.runtime_units == ("containerd.service", "crio.service", "docker.service")
    assert d.systemd.max_in_flight == 64
    assert d.devices.v2_remedy == "inplace"
    assert (d.device_plugin.cool_down, d.device_plugin.max_restarts_per_hour) == (300, 3)
    assert (d.device_plugin.registration_grace, d.device_plugin.nvml_probe) == (120, False)
    assert d.inventory.file is None


def test_shipped_file_matches_table() -> None:
    shipped = (REPO / "packaging" / "gpuguard.conf").read_text()
    assert shipped == render_shipped(), (
        "packaging/gpuguard.conf is out of date; regenerate it with "
        "`.venv/bin/python -m gpuguard.config --shipped > packaging/gpuguard.conf`"
    )


def test_shipped_file_parses_to_defaults_commented_and_uncommented() -> None:
    shipped = render_shipped()
    assert parse_config(shipped) == Config()
    uncommented = re.sub(r"^#(?=[A-Z]\w*=)", "", shipped, flags=re.M)
    cfg = parse_config(uncommented, source="u")
    assert cfg == Config()
    assert all(cfg.origin(s.section, s.key).startswith("u:") for s in KEYS)


def test_docs_match_table() -> None:
    doc = (REPO / "docs" / "configuration.md").read_text()
    start, end = doc.index(REFERENCE_BEGIN), doc.index(REFERENCE_END) + len(REFERENCE_END)
    assert doc[start:end] + "\n" == render_reference(), (
        "docs/configuration.md's key reference is out of date; replace it with the output of "
        "`.venv/bin/python -m gpuguard.config --reference`"
    )
    for spec in KEYS:
        assert f"| `{spec.key}` |" in doc


def test_runtime_keys_in_their_old_section_still_work_with_a_warning(tmp_path: Path) -> None:
    """Crictl= and CriEndpoint= moved from [DevicePlugin] to [Runtime] (two steps use
    them); an old file keeps working and says where the keys belong now."""
    old = "[DevicePlugin]\nRestart=no\nCrictl=/opt/bin/crictl\nCriEndpoint=unix:///run/c.sock\n"
    cfg = parse_config(old, source="old.conf")
    assert (cfg.runtime.crictl, cfg.runtime.cri_endpoint) == (
        "/opt/bin/crictl",
        "unix:///run/c.sock",
    )
    assert cfg.device_plugin.restart is False
    assert cfg.origin("Runtime", "Crictl") == "old.conf:3"
    assert cfg.warnings == (
        "old.conf:3: Crictl= in [DevicePlugin] is deprecated, it belongs in [Runtime] (read "
        "this time); move it there (see gpuguard.conf(5))",
        "old.conf:4: CriEndpoint= in [DevicePlugin] is deprecated, it belongs in [Runtime] "
        "(read this time); move it there (see gpuguard.conf(5))",
    )
    assert "[Runtime]\n# old.conf:3\nCrictl=/opt/bin/crictl\n" in cfg.render()
    assert parse_config("[Runtime]\nCrictl=/opt/bin/crictl\n").warnings == ()


def test_a_moved_key_in_both_sections_of_one_file_is_a_duplicate() -> None:
    with pytest.raises(ConfigError, match=r"f:4: duplicate key 'Crictl' in \[Runtime\]"):
        parse_config("[DevicePlugin]\nCrictl=/a\n[Runtime]\nCrictl=/b\n", source="f")


def test_a_drop_in_in_the_new_section_overrides_the_old_one(tmp_path: Path) -> None:
    root = Root(tmp_path)
    main = root.path(CONFIG_FILE)
    main.parent.mkdir(parents=True)
    main.write_text("[DevicePlugin]\nCrictl=/old/crictl\n")
    dropins = root.path(CONFIG_DROPIN_DIR)
    dropins.mkdir()
    (dropins / "50-runtime.conf").write_text("[Runtime]\nCrictl=/new/crictl\n")
    cfg = load_config(root)
    assert cfg.runtime.crictl == "/new/crictl"
    assert (
        len(cfg.warnings) == 1 and "gpuguard.conf:2: Crictl= in [DevicePlugin]" in cfg.warnings[0]
    )


def test_the_cli_warns_of_a_deprecated_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuguard import cli

    conf = tmp_path / "gpuguard.conf"
    conf.write_text("[DevicePlugin]\nCriEndpoint=unix:///run/c.sock\n")
    assert cli.main(["config", "--root", str(tmp_path), "--config", str(conf)]) == 0
    out, err = capsys.readouterr()
    assert f"# {conf}:2\nCriEndpoint=unix:///run/c.sock" in out.split("[Runtime]")[1]
    assert err == (
        f"gpuguard: warning: {conf}:2: CriEndpoint= in [DevicePlugin] is deprecated, it "
        "belongs in [Runtime] (read this time); move it there (see gpuguard.conf(5))\n"
    )
