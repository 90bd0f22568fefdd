"""Doctor reads kubelet's YAML/JSON and containerd's TOML as their owners do (real
parsers, bounded), says "unknown" for a key that is not set, and turns kubelet's
unusable --config/--config-dir into a one-line finding, never a read outside the root
nor exit 70."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuguard import cli
from gpuguard.devices import kubelettrust
from gpuguard.devices.kubeletproc import MAX_K3S_ENTRIES
from gpuguard.doctor.model import OK, UNKNOWN
from gpuguard.doctor.textconf import Unreadable, toml_scalars, toml_tables, yaml_top_scalars
from gpuguard.host import structconf
from unit.doctor_support import write
from unit.test_doctor import check
from unit.test_doctor_kubelet import bare_node, doctor, process

SYSTEMD_SPELLINGS = [
    '"cgroupDriver": "systemd"\n',  # quoted key
    "{cgroupDriver: systemd, cpuManagerPolicy: none}\n",  # flow mapping
    '---\n{"kind": "KubeletConfiguration", "cgroupDriver": "systemd"}\n',  # JSON after ---
    "%YAML 1.1\n---\ncgroupDriver: !!str systemd\n",
    "? cgroupDriver\n: systemd\n",  # explicit key
    "cgroupDriver: >-\n  systemd\n",  # folded scalar
    "kind: KubeletConfiguration\ncgroupDriver:    'systemd'   # set by kubeadm\n",
]


@pytest.fixture(autouse=True)
def tests_uid_is_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kubelettrust, "ROOT_UID", os.getuid())


@pytest.mark.parametrize("text", SYSTEMD_SPELLINGS)
def test_every_spelling_of_systemd_is_read_as_systemd(text: str) -> None:
    assert yaml_top_scalars(text)["cgroupDriver"] == "systemd"


@pytest.mark.parametrize("text", SYSTEMD_SPELLINGS[:3])
def test_doctor_never_says_cgroupfs_for_a_systemd_config(tmp_path: Path, text: str) -> None:
    root = bare_node(tmp_path)
    write(root, "/var/lib/kubelet/config.yaml", text)
    _verdict, evidence, _ = check(doctor(root), "kubelet-cgroup-driver")
    assert "cgroupDriver=systemd" in evidence and "cgroupfs alone" not in evidence


@pytest.mark.parametrize(
    "text",
    [
        "kind: KubeletConfiguration\n",  # not set
        "kind: KubeletConfiguration\n  cgroupDriver: systemd\n",  # invalid: kubelet refuses
        "[" * 100_000,  # nested past the bound (libyaml's composer would crash on it)
        "- " * 100_000 + "x\n",
        "cgroupDriver: [systemd]\n",  # not a scalar
        "a: &x [1]\nb: *x\n" + "---\n" * 100,  # past the document bound
    ],
)
def test_what_cannot_be_seen_is_unknown_never_ok(tmp_path: Path, text: str) -> None:
    root = bare_node(tmp_path)
    write(root, "/var/lib/kubelet/config.yaml", text)
    verdict, _evidence, _ = check(doctor(root), "kubelet-cgroup-driver")
    assert verdict == UNKNOWN


def test_the_long_toml_line_is_refused() -> None:
    """`[a<64 Ki spaces>b`: quadratic in the former regex (10 s), refused by the TOML
    parser in one pass now (bench/doctor_readers.py prints the time, up to 1 MiB)."""
    line = "[a" + " " * 65536 + "b\n"
    with pytest.raises(Unreadable, match="not valid TOML"):
        toml_scalars(line)
    with pytest.raises(Unreadable):
        toml_tables(line * 16)  # about 1 MiB of it: still one pass


def test_containerd_toml_as_containerd_reads_it() -> None:
    text = (
        "version = 2\n"
        '[plugins."io.containerd.grpc.v1.cri".containerd]\n'
        '  default_runtime_name = "nvidia"\n'
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n'
        '  runtime_type = "io.containerd.runc.v2"\n'
        "[plugins.'io.containerd.grpc.v1.cri'.containerd.runtimes.runc.options]\n"
        "  SystemdCgroup = true\n"
    )
    values = toml_scalars(text)
    key = "plugins.io.containerd.grpc.v1.cri.containerd.default_runtime_name"
    assert values[key] == "nvidia"
    assert (
        values["plugins.io.containerd.grpc.v1.cri.containerd.runtimes.runc.options.SystemdCgroup"]
        == "true"
    )
    assert "plugins.io.containerd.grpc.v1.cri.containerd.runtimes.nvidia" in toml_tables(text)
    with pytest.raises(Unreadable):  # a duplicate table: containerd refuses to start
        toml_scalars("[a]\nx = 1\n[a]\ny = 2\n")


def test_deep_toml_is_refused_not_a_crash() -> None:
    with pytest.raises(Unreadable):
        toml_scalars("a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert isinstance(
        structconf.toml_document("x" * (structconf.MAX_BYTES + 1)), structconf.Refusal
    )


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["kubelet", "--config=kubelet.yaml"], "is relative"),
        (["kubelet", "--config-dir=conf.d"], "is relative"),
        (["kubelet", "--v=2", "--config"], "is relative"),  # a trailing --config
        (["kubelet", "--config=/a/../../../../etc/shadow"], "has '..'"),
        (["kubelet", "--config-dir=/a/../.."], "has '..'"),
    ],
)
def test_unusable_config_paths_are_a_finding(
    tmp_path: Path, argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = bare_node(tmp_path)
    process(root, 900, "kubelet", argv, "kubelet.service")
    verdict, evidence, _ = check(doctor(root), "kubelet-cgroup-driver")
    assert verdict == UNKNOWN and said in evidence and "\n" not in evidence
    code = cli.main(["doctor", "--root", str(root)])
    assert code != 70
    assert "Traceback" not in capsys.readouterr().err


def test_k3s_drop_ins_are_bounded(tmp_path: Path) -> None:
    root = bare_node(tmp_path)
    d = root / "etc/rancher/k3s/config.yaml.d"
    d.mkdir(parents=True)
    for n in range(MAX_K3S_ENTRIES + 1):
        (d / f"{n:05}.yaml").write_text("kubelet-arg: [cgroup-driver=systemd]\n")
    process(root, 903, "k3s-agent", ["/usr/local/bin/k3s", "agent"], "k3s-agent.service")
    verdict, evidence, _ = check(doctor(root), "kubelet-cgroup-driver")
    assert verdict == UNKNOWN and f"more than {MAX_K3S_ENTRIES} entries" in evidence
    for n in range(2, MAX_K3S_ENTRIES + 1):
        (d / f"{n:05}.yaml").unlink()
    verdict, evidence, _ = check(doctor(root), "kubelet-cgroup-driver")
    assert "cgroupDriver=systemd" in evidence and verdict != UNKNOWN


def test_a_valid_cgroupfs_config_is_ok(tmp_path: Path) -> None:
    root = bare_node(tmp_path)
    write(root, "/var/lib/kubelet/config.yaml", '{"cgroupDriver": "cgroupfs"}\n')
    assert check(doctor(root), "kubelet-cgroup-driver")[0] == OK


def test_json_that_yaml_1_1_refuses_is_read_as_json() -> None:
    """A surrogate pair escape is valid JSON that PyYAML (YAML 1.1) refuses; kubelet
    reads JSON, with or without a `---` before it."""
    from gpuguard.doctor.kubelet import parse_config

    text = '{"x\\ud800\\udc00": null, "cgroupDriver": "systemd"}'
    for spelled in (text, "---\n" + text):
        assert parse_config(spelled)["cgroupDriver"] == "systemd"
