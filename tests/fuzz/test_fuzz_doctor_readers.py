"""Doctor's readers of other programs' files, and the trust rule for processes named
kubelet, under generated input.

Surfaces and inputs:
- kubelet's configuration (YAML/JSON), k3s's config.yaml: generated YAML-ish text
  (brackets, indentation, anchors, tags, `---`, control characters, long runs) and
  mutations of valid files; the reader returns text keys or refuses (Unreadable), and
  never says a cgroupDriver it did not read;
- containerd's TOML: generated tables, keys and long lines; parsed or refused;
- kubelet's --config/--config-dir as a running process gives them: generated paths;
  doctor ends with a verdict, reads nothing outside the root, never exit 70;
- /proc/PID of a process named kubelet: generated exe targets, owners and modes, units;
  the trust rule accepts only a trusted install path in one of the candidate units.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hypothesis import example, given
from hypothesis import strategies as st

from fuzz.budget import budget
from gpuguard.devices import kubelettrust
from gpuguard.doctor.kubelet import parse_config
from gpuguard.doctor.model import UNKNOWN
from gpuguard.doctor.textconf import Unreadable, toml_scalars, toml_tables, yaml_top_scalars
from gpuguard.host.paths import Root
from unit.test_doctor import check
from unit.test_doctor_kubelet import bare_node, doctor, process

_YAML_BITS = st.sampled_from(
    [
        "cgroupDriver", '"cgroupDriver"', "'cgroupDriver'", ": ", ":", "systemd", "cgroupfs",
        "\n", "  ", "- ", "---\n", "...\n", "{", "}", "[", "]", ", ", "&a ", "*a", "!!str ",
        "? ", "#", "|\n", ">-\n", '"', "'", "\t", "\x1b", "\u202e", "%YAML 1.1\n", "\\",
    ]
)  # fmt: skip
_yaml_text = st.lists(_YAML_BITS, max_size=60).map("".join)
_TOML_BITS = st.sampled_from(
    [
        "[", "]", "[[", "]]", "a", '"b.c"', "'d'", ".", " = ", "=", '"v"', "1", "true", "\n",
        " ", "#", "{", "}", ",", "'''", '"""', "\\", "\x00", "plugins", "containerd",
    ]
)  # fmt: skip
_toml_text = st.lists(_TOML_BITS, max_size=60).map("".join)


@budget(300)
@given(st.one_of(_yaml_text, st.text(max_size=200)))
@example("[" * 5000)
@example("- " * 5000 + "x")
@example("cgroupDriver: " + " " * 65536 + "x")
def test_kubelet_yaml_is_parsed_or_refused(text: str) -> None:
    try:
        values = yaml_top_scalars(text)
    except Unreadable as e:
        assert "\n" not in str(e)
        return
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in values.items())
    if "cgroupDriver" in values and values["cgroupDriver"] == "systemd":
        assert "systemd" in text


@budget(300)
@given(st.one_of(_toml_text, st.text(max_size=200)))
@example("[a" + " " * 65536 + "b")
@example("a = " + "[" * 5000)
def test_toml_is_parsed_or_refused(text: str) -> None:
    try:
        values, tables = toml_scalars(text), toml_tables(text)
    except Unreadable as e:
        assert "\n" not in str(e)
        return
    assert all(isinstance(v, str) for v in values.values())
    assert all(isinstance(t, str) for t in tables)


_value = st.one_of(st.text(max_size=20), st.integers(-(2**53), 2**53), st.booleans(), st.none())
_config = st.dictionaries(st.text(min_size=1, max_size=12), _value, max_size=8)


@budget(200)
@given(
    extra=_config,
    driver=st.sampled_from(["systemd", "cgroupfs"]),
    style=st.sampled_from(["block", "flow", "json", "canonical", "explicit", "json-after"]),
)
def test_any_spelling_of_a_valid_config_reads_the_same(
    extra: dict[str, object], driver: str, style: str
) -> None:
    """A configuration written by a YAML or JSON emitter in any style reads back the
    cgroupDriver it holds (kubelet reads every one of these the same way)."""
    import json as js

    import yaml

    doc = {**extra, "cgroupDriver": driver}
    if style in ("json", "json-after"):
        text = ("---\n" if style == "json-after" else "") + js.dumps(doc)
    else:
        text = yaml.safe_dump(
            doc,
            default_flow_style=style == "flow",
            canonical=style == "canonical",
            explicit_start=style == "explicit",
            allow_unicode=True,
        )
    assert parse_config(text)["cgroupDriver"] == driver


_path = st.one_of(
    st.sampled_from(["", "k.yaml", "/a/../..", "/../../etc/shadow", "/", "//x", "/proc/self"]),
    st.text(st.sampled_from("/.ab-\x00\n"), max_size=20),
)


@budget(25)
@given(config=_path, config_dir=_path, trailing=st.booleans())
@example(config="../k.yaml", config_dir="", trailing=False)
@example(config="", config_dir="", trailing=True)
def test_kubelets_config_paths_never_escape_nor_crash(
    config: str, config_dir: str, trailing: bool
) -> None:
    old = kubelettrust.ROOT_UID
    kubelettrust.ROOT_UID = os.getuid()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = bare_node(Path(tmp) / "node")
            secret = Path(tmp) / "outside.yaml"  # beside the root: never read
            secret.write_text("cgroupDriver: systemd\n")
            argv = ["/usr/bin/kubelet"]
            argv += [f"--config={config}"] if config else []
            argv += [f"--config-dir={config_dir}"] if config_dir else []
            argv += ["--config"] if trailing else []
            process(root, 900, "kubelet", [a.replace("\x00", "") for a in argv], "kubelet.service")
            verdict, evidence, _ = check(doctor(root), "kubelet-cgroup-driver")
            assert "\n" not in evidence
            assert verdict == UNKNOWN or "cgroupDriver=" in evidence
    finally:
        kubelettrust.ROOT_UID = old


_exe = st.one_of(
    st.sampled_from(
        [
            "/usr/bin/kubelet", "/usr/local/bin/k3s", "/var/lib/rancher/rke2/data/x/bin/kubelet",
            "/home/u/kubelet", "/tmp/kubelet", "kubelet", "/usr/bin/../../tmp/kubelet",
            "/usr/bin/kubelet (deleted)", "/usr/bin/kubelet\n",
        ]
    ),
    st.text(st.sampled_from("/abkuelt."), max_size=30),
)  # fmt: skip


@budget(100)
@given(
    exe=_exe,
    unit=st.sampled_from(["kubelet.service", "sshd.service", "user@1000.service", ""]),
    mode=st.sampled_from([0o755, 0o775, 0o777, 0o700, 0o4755]),
    dir_mode=st.sampled_from([0o755, 0o777, 0o1777]),
)
def test_only_a_trusted_kubelet_is_trusted(exe: str, unit: str, mode: int, dir_mode: int) -> None:
    old = kubelettrust.ROOT_UID
    kubelettrust.ROOT_UID = os.getuid()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            d = root / "proc/77"
            d.mkdir(parents=True)
            (d / "comm").write_text("kubelet\n")
            (d / "cmdline").write_bytes(b"kubelet\0")
            (d / "cgroup").write_text(f"0::/system.slice/{unit}\n" if unit else "0::/\n")
            if "\x00" not in exe and exe:
                (d / "exe").symlink_to(exe)
                clean = exe.removesuffix(" (deleted)")
                if clean.startswith("/") and ".." not in clean.split("/") and clean != "/":
                    target = root / clean.lstrip("/")
                    if not target.exists() and not target.parent.is_file():
                        target.parent.mkdir(parents=True, exist_ok=True)
                        target.parent.chmod(dir_mode)
                        target.write_bytes(b"")
                        target.chmod(mode)
            found = kubelettrust.kubelets(Root(root), ("kubelet.service",))
            trusted = bool(found.trusted)
            clean = exe.removesuffix(" (deleted)")
            expected = (
                unit == "kubelet.service"
                and kubelettrust.exe_path_trusted(clean)
                and os.path.normpath(clean) == clean
                and not mode & 0o022
                and not dir_mode & 0o022
            )
            assert trusted == expected, (exe, unit, oct(mode), oct(dir_mode), found)
    finally:
        kubelettrust.ROOT_UID = old
