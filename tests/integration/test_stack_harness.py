"""The stack harness cannot lie about the stack: a namespace booted with another cgroup
layout, another systemd or another runtime than the test asked for fails the test.

(The package tests' harness once booted a root asked for as v2 on v1 without saying so:
boot-root.sh mounted the v1 hierarchies whatever the layout.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from integration.harness.sysns import NamespaceError
from integration.pkgroot import PackageRoot, debian_root, require_pkgroot_tools
from integration.stacks.node import Node, StackError, make_ctrs, prepare_host_dir

pytestmark = pytest.mark.root


class BootsV1(PackageRoot):
    """Asks for v2 but tells boot-root.sh v1: the old bug, on purpose."""

    def _prepare_state(self) -> None:
        super()._prepare_state()
        (self.state / "layout").write_text("v1\n")


@pytest.mark.parametrize("layout", ["v1", "v2"])
def test_the_layout_asked_for_is_booted(tmp_path: Path, layout: str) -> None:
    require_pkgroot_tools()
    lower, _ = debian_root("bookworm")
    ns = PackageRoot(tmp_path / "ns", lower, suite="bookworm", layout=layout)
    ns.start()
    try:
        fstype = ns.run(["stat", "-fc", "%T", "/sys/fs/cgroup"], check=True).stdout.strip()
        assert fstype == {"v1": "tmpfs", "v2": "cgroup2fs"}[layout]
        assert ns.systemd_version == 252
    finally:
        ns.stop()


def test_another_layout_fails(tmp_path: Path) -> None:
    require_pkgroot_tools()
    lower, _ = debian_root("bookworm")
    ns = BootsV1(tmp_path / "ns", lower, suite="bookworm", layout="v2")
    with pytest.raises(NamespaceError, match="asked for cgroup v2, booted /sys/fs/cgroup is tmpfs"):
        ns.start()
    assert not ns.cgroup_dirs(), "stopped and cleaned up"


def test_another_systemd_fails(tmp_path: Path) -> None:
    require_pkgroot_tools()
    lower, _ = debian_root("bookworm")  # systemd 252, said to be sid's
    ns = PackageRoot(tmp_path / "ns", lower, suite="sid", layout="v2")
    with pytest.raises(NamespaceError, match="sid root runs systemd 252"):
        ns.start()


def test_another_runtime_fails(tmp_path: Path) -> None:
    require_pkgroot_tools()
    lower, _ = debian_root("trixie")
    ns = PackageRoot(
        tmp_path / "ns", lower, suite="trixie", layout="v2", binds=prepare_host_dir(tmp_path)
    )
    ns.start()
    try:
        node = Node(ns, tmp_path)
        node.prepare()
        node.start_containerd()
        c = make_ctrs("runc", 1, "harness")[0]
        node.run(c)  # made by runc, checked
        with pytest.raises(StackError, match="asked for crun, made by runc"):
            node.check_runtime(dataclasses.replace(c, runtime="crun"))
        node.remove_all()
    finally:
        ns.stop()
