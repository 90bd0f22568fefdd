"""NVML's library is loaded only where root alone controls it (host/nvmllib.py,
host/pathtrust.py): every directory from the root down to the file, those its links
lead through and those above a driver root; and it is loaded through a descriptor
of the very file checked, so a rename between the check and the load changes nothing."""

from __future__ import annotations

import os
import shutil
import threading
import types
from pathlib import Path

import pytest

import fakenvml
from conftest import require_tool
from gpuguard.errors import NoDriverError
from gpuguard.host import nvmllib
from gpuguard.host.inventory import load_inventory
from gpuguard.host.nvmllib import CONFIGURED, NvmlLookup, find_library, search
from gpuguard.host.paths import Root


@pytest.fixture(autouse=True)
def _root_and_gcc() -> None:
    require_tool("gcc")
    if os.geteuid() != 0:
        pytest.skip("root-owned libraries and chown need root")


def conf_dir(root: Path, directory: str) -> Path:
    """A library in `directory`, named by the root's /etc/ld.so.conf."""
    lib = fakenvml.build(root / directory.lstrip("/"))
    (root / "etc").mkdir(exist_ok=True)
    (root / "etc/ld.so.conf").write_text(f"{directory}\n")
    return lib


@pytest.mark.parametrize(("mode", "said"), [(0o777, "others"), (0o1777, "sticky is not enough")])
def test_a_library_in_a_directory_others_may_write_is_refused(
    tmp_path: Path, mode: int, said: str
) -> None:
    lib = conf_dir(tmp_path, "/opt/nvidia/lib")
    assert find_library(NvmlLookup(Root(tmp_path))) is not None
    lib.parent.chmod(mode)  # the file is still root's 0644: its directory is not
    found, refused = search(NvmlLookup(Root(tmp_path)))
    assert found is None
    assert refused and "/opt/nvidia/lib" in refused[0] and said in refused[0], refused
    with pytest.raises(NoDriverError, match=r"refused: .*writable by"):
        load_inventory(None, NvmlLookup(Root(tmp_path)))


def test_a_directory_above_it_owned_by_a_user_is_refused(tmp_path: Path) -> None:
    lib = conf_dir(tmp_path, "/opt/nvidia/lib")
    os.chown(lib.parent.parent, 1000, 1000)  # /opt/nvidia: a user renames lib/ away
    found, refused = search(NvmlLookup(Root(tmp_path)))
    assert found is None and "/opt/nvidia: a directory owned by uid 1000" in refused[0]


def test_a_user_writable_parent_of_the_driver_root_is_refused(tmp_path: Path) -> None:
    fakenvml.build(tmp_path / "srv/driver/usr/lib64")
    lookup = NvmlLookup(Root(tmp_path), "/srv/driver")
    found = find_library(lookup)
    assert found is not None and found.layout == CONFIGURED
    (tmp_path / "srv").chmod(0o777)
    found, refused = search(lookup)
    assert found is None and refused == ("driver root /srv/driver: /srv: a directory "
                                         "writable by others",)  # fmt: skip


def test_each_hop_of_a_link_is_checked(tmp_path: Path) -> None:
    user = fakenvml.build(tmp_path / "home/user/lib", "libnvidia-ml.so.580")
    os.chown(user.parent.parent, 1000, 1000)  # the user's own directory, file still root's
    (tmp_path / "usr/lib64").mkdir(parents=True)
    os.symlink("/home/user/lib/libnvidia-ml.so.580", tmp_path / "usr/lib64" / fakenvml.LIBRARY)
    found, refused = search(NvmlLookup(Root(tmp_path)))
    assert found is None
    assert refused == ("/usr/lib64/libnvidia-ml.so.1: /home/user: a directory owned by uid 1000",)
    os.chown(user.parent.parent, 0, 0)  # root's again: the link is followed
    found = find_library(NvmlLookup(Root(tmp_path)))
    assert found is not None and found.real == str(user)


def fake_pynvml() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        nvmlLib=None, libLoadLock=threading.Lock(), _nvmlGetFunctionPointer_cache={}
    )


def test_it_is_loaded_through_a_descriptor_of_the_file_checked(tmp_path: Path) -> None:
    conf_dir(tmp_path, "/usr/lib64")
    lib = find_library(NvmlLookup(Root(tmp_path)))
    assert lib is not None
    py = fake_pynvml()
    nvmllib.load_into(py, lib)
    name = py.nvmlLib._name
    assert name.startswith("/proc/self/fd/"), name
    assert os.readlink(name) == lib.real  # still open: the number names this file only


def test_a_file_renamed_in_after_the_check_is_not_loaded(tmp_path: Path) -> None:
    conf_dir(tmp_path, "/usr/lib64")
    lib = find_library(NvmlLookup(Root(tmp_path)))
    assert lib is not None
    other = tmp_path / "usr/lib64/.other"
    shutil.copyfile(lib.real, other)  # root's and 0644 as well: only its identity differs
    os.replace(other, lib.real)
    py = fake_pynvml()
    with pytest.raises(OSError, match="replaced since it was checked"):
        nvmllib.load_into(py, lib)
    assert py.nvmlLib is None
