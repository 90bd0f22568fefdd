"""actuate/safewrite.py: control files, device nodes and links written only where they
should be."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import pytest

from conftest import require_root
from gpuguard.actuate.safewrite import (
    UnsafeWriteError,
    check_real_dir,
    chmod_node,
    open_control_file,
)
from gpuguard.host.paths import Root


def test_a_control_file_is_written_only_when_regular(tmp_path: Path) -> None:
    good = tmp_path / "devices.allow"
    good.write_text("")
    fd = open_control_file(good)
    os.write(fd, b"c 195:0 rw")
    os.close(fd)
    assert good.read_text() == "c 195:0 rw"
    outside = tmp_path / "outside"
    outside.write_text("")
    (tmp_path / "link").symlink_to(outside)
    with pytest.raises(UnsafeWriteError, match="symbolic link"):
        open_control_file(tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UnsafeWriteError, match="not a regular file"):
        open_control_file(tmp_path / "fifo")  # never waits for a reader
    with pytest.raises(FileNotFoundError):
        open_control_file(tmp_path / "gone")
    assert outside.read_text() == ""


def test_a_directory_reached_through_a_link_is_refused(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    (tmp_path / "root/dev").mkdir(parents=True)
    (tmp_path / "etc").mkdir()
    check_real_dir(root, root.path("/dev/char"))  # not made yet: its parent is judged
    (tmp_path / "root/dev/char").symlink_to(tmp_path / "etc")
    with pytest.raises(UnsafeWriteError, match="symbolic link"):
        check_real_dir(root, root.path("/dev/char"))
    with pytest.raises(UnsafeWriteError, match="symbolic link"):
        check_real_dir(root, root.path("/dev/char/sub"))
    (tmp_path / "root/dev/char").unlink()
    (tmp_path / "root/dev/char").mkdir()
    check_real_dir(root, root.path("/dev/char"))


def test_the_device_nodes_step_makes_no_link_through_a_linked_dev_char(tmp_path: Path) -> None:
    from gpuguard.journal.log import EventLog
    from gpuguard.steps.device_nodes.actuate import DeviceNodeActuator
    from gpuguard.steps.device_nodes.reconcile import CreateCharLink

    (tmp_path / "root/dev").mkdir(parents=True)
    (tmp_path / "etc").mkdir()
    (tmp_path / "root/dev/char").symlink_to(tmp_path / "etc")
    act = DeviceNodeActuator(Root(tmp_path / "root"), EventLog(stream=io.StringIO()))
    a = CreateCharLink("device_nodes", "r", "/dev/char/195:0", "/dev/char/195:0", "../nvidia0")
    out = act.apply(a)
    assert out.status == "failed" and "symbolic link" in out.detail
    assert list((tmp_path / "etc").iterdir()) == []


def test_a_nodes_mode_is_set_on_the_node_never_through_a_link(tmp_path: Path) -> None:
    require_root()  # mknod
    node = tmp_path / "nvidia0"
    os.mknod(node, stat.S_IFCHR | 0o600, os.makedev(195, 0))
    chmod_node(node, 0o666, (195, 0))
    assert node.stat().st_mode & 0o777 == 0o666
    with pytest.raises(UnsafeWriteError, match="not the character device"):
        chmod_node(node, 0o666, (195, 1))
    target = tmp_path / "shadow"
    target.write_text("")
    target.chmod(0o600)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(UnsafeWriteError, match="not the character device"):
        chmod_node(tmp_path / "link", 0o666, (195, 0))
    assert target.stat().st_mode & 0o777 == 0o600
