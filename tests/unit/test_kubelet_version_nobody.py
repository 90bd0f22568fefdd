"""The bridge asks kubelet's executable its version (readmit/observe.py) without
running it as root: as nobody, no supplementary group, no new privileges, an empty
environment, its output bounded and a timeout; and only a file that root alone
controls (its directories too), with no setuid bit, exec'd through a descriptor of
the very file checked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuguard.host.paths import Root
from gpuguard.readmit import observe
from gpuguard.readmit.observe import kubelet_version

WHO = (
    'echo "Kubernetes v1.34.1 uid=$(/usr/bin/id -u) groups=$(/usr/bin/id -G) '
    "nnp=$(/usr/bin/awk '/^NoNewPrivs/ {print $2}' /proc/self/status) "
    'home=${HOME-unset} cwd=$(pwd)"'
)


@pytest.fixture(autouse=True)
def _root() -> None:
    if os.geteuid() != 0:
        pytest.skip("a root-owned executable needs root")


def kubelet(root: Path, script: str, where: str = "usr/bin") -> str:
    exe = root / where / "kubelet"
    exe.parent.mkdir(parents=True, exist_ok=True)
    exe.write_text(f"#!/bin/sh\n{script}\n")
    exe.chmod(0o755)
    return "/" + where + "/kubelet"


def test_it_runs_as_nobody_without_new_privileges_or_environment(tmp_path: Path) -> None:
    path = kubelet(tmp_path, WHO)
    kv = kubelet_version(Root(tmp_path), path, None)
    assert kv.text == "Kubernetes v1.34.1 uid=65534 groups=65534 nnp=1 home=unset cwd=/"
    assert kv.version == "1.34"


def test_its_output_is_bounded_and_its_time_limited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = kubelet(tmp_path, 'while :; do echo "Kubernetes v1.34.1 and more"; done')
    kv = kubelet_version(Root(tmp_path), path, None)  # read 4 KiB, then killed
    assert (kv.version, kv.text) == ("1.34", "Kubernetes v1.34.1 and more")
    monkeypatch.setattr(observe, "VERSION_TIMEOUT", 0.5)
    path = kubelet(tmp_path, "exec /bin/sleep 60", "opt/bin")
    kv = kubelet_version(Root(tmp_path), path, None)
    assert kv.version == "" and kv.text == "/opt/bin/kubelet --version: no answer in 0.5s"


def test_a_setuid_file_is_not_run(tmp_path: Path) -> None:
    path = kubelet(tmp_path, WHO)
    (tmp_path / path.lstrip("/")).chmod(0o4755)
    kv = kubelet_version(Root(tmp_path), path, None)
    assert kv.version == "" and kv.text == "/usr/bin/kubelet: setuid or setgid: not run"


def test_a_kubelet_in_a_directory_others_may_write_is_not_run(tmp_path: Path) -> None:
    path = kubelet(tmp_path, WHO, "usr/local/bin")
    (tmp_path / "usr/local").chmod(0o777)  # anyone may replace bin/ and what it holds
    kv = kubelet_version(Root(tmp_path), path, None)
    assert kv.version == ""
    assert kv.text == (
        "/usr/local/bin/kubelet: not asked: /usr/local: a directory writable by others"
    )
