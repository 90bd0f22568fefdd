"""Plugin discovery against a fake root: /proc tables, fd links, per-netns unix tables."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gpuguard.devices import nodes
from gpuguard.devices.plugins import discover_plugins, parse_unix_table
from gpuguard.devices.processes import container_init_pid, process_start
from gpuguard.host.paths import Root
from gpuguard.steps.device_plugin.observe import kubelet_started

BTIME = 1_700_000_000
CID = "c" * 64
POD_NS = "net:[4026532999]"
HOST_NS = "net:[4026531840]"
DP = "/var/lib/kubelet/device-plugins"

UNIX_HEADER = "Num       RefCount Protocol Flags    Type St Inode Path\n"


def unix_line(inode: int, path: str, listening: bool = True) -> str:
    flags = "00010000" if listening else "00000000"
    return f"0000000000000000: 00000002 00000000 {flags} 0001 01 {inode} {path}\n"


def fake_proc(
    root: Path,
    pid: int,
    *,
    start_ticks: int,
    cgroup: str,
    netns: str,
    fds: dict[str, str],
    comm: str = "plugin",
    nspid: str = "",
    pidns: str = "pid:[1]",
) -> Path:
    d = root / "proc" / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "ns").mkdir()
    rest = ["S"] + ["0"] * 18 + [str(start_ticks)] + ["0"] * 10
    (d / "stat").write_text(f"{pid} ({comm}) {' '.join(rest)}\n")
    (d / "comm").write_text(comm + "\n")
    (d / "cgroup").write_text(f"11:devices:{cgroup}\n0::{cgroup}\n")
    (d / "status").write_text(f"Name:\t{comm}\nNSpid:\t{pid}{nspid}\n")
    os.symlink(netns, d / "ns" / "net")
    os.symlink(pidns, d / "ns" / "pid")
    for fd, target in fds.items():
        os.symlink(target, d / "fd" / fd)
    return d


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A root with a plugin in a pod (own netns, own mount ns) and a kubelet socket."""
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/stat").write_text(f"cpu 1 2 3\nbtime {BTIME}\n")
    sockdir = tmp_path / DP.lstrip("/")
    sockdir.mkdir(parents=True)
    for name in ("kubelet.sock", "nvidia-gpu.sock", "nvidia-mig-1g.10gb.sock", "other.sock"):
        os.mknod(sockdir / name, stat.S_IFSOCK | 0o600)
    # the plugin's own root: its device-plugins dir is the host's (a hostPath mount)
    prootfs = tmp_path / "prootfs"
    (prootfs / "var/lib/kubelet").mkdir(parents=True)
    os.symlink(sockdir, prootfs / "var/lib/kubelet/device-plugins")
    (prootfs / "dev").mkdir()
    for n in ("nvidia0", "nvidiactl", "null"):
        (prootfs / "dev" / n).write_text("")
    cg = f"/kubepods/besteffort/pod1234/{CID}"
    d = fake_proc(
        tmp_path,
        4242,
        start_ticks=500,
        cgroup=cg,
        netns=POD_NS,
        fds={"0": "/dev/null", "3": "socket:[777]", "4": "socket:[778]"},
        nspid="\t1",
        pidns="pid:[99]",
    )
    os.symlink(prootfs, d / "root")
    (d / "net").mkdir()
    (d / "net/unix").write_text(
        UNIX_HEADER
        + unix_line(777, f"{DP}/nvidia-gpu.sock")
        + unix_line(778, f"{DP}/kubelet.sock", listening=False)
    )
    # a host process in another netns, listening on nothing of ours
    h = fake_proc(
        tmp_path, 1, start_ticks=1, cgroup="/init.scope", netns=HOST_NS, fds={"3": "socket:[5]"}
    )
    os.symlink("/", h / "root")
    (h / "net").mkdir()
    (h / "net/unix").write_text(UNIX_HEADER + unix_line(5, "/run/systemd/notify"))

    real_stat = nodes._stat

    def fake_stat(p: Path, follow_symlinks: bool) -> os.stat_result:
        st = real_stat(p, follow_symlinks)
        if p.name.startswith("nvidia"):  # plain files standing in for char nodes
            return _St(st, 195, 255 if p.name == "nvidiactl" else 0)  # type: ignore[return-value]
        return st

    monkeypatch.setattr(nodes, "_stat", fake_stat)
    return tmp_path


class _St:
    def __init__(self, st: os.stat_result, major: int, minor: int) -> None:
        self.st_mode = stat.S_IFCHR | 0o666
        self.st_rdev = os.makedev(major, minor)
        self.st_ctime = st.st_ctime


def test_parse_unix_table_keeps_path_bound_entries() -> None:
    text = UNIX_HEADER + unix_line(1, "/a.sock") + "0000: 00000002 0 0 0001 01 2\n"
    assert parse_unix_table(text) == [(0x10000, 1, "/a.sock")]


def test_plugin_in_a_pod_netns_is_found_with_its_view(host: Path) -> None:
    plugins = discover_plugins(Root(host), DP)
    by = {p.name: p for p in plugins}
    assert set(by) == {"nvidia-gpu.sock", "nvidia-mig-1g.10gb.sock"}  # not kubelet/other
    gpu = by["nvidia-gpu.sock"]
    assert gpu.resource == "nvidia.com/gpu"
    assert gpu.process is not None
    p = gpu.process
    assert (p.pid, p.kind, p.container_id, p.pod_uid) == (4242, "container", CID, "1234")
    assert p.start == pytest.approx(BTIME + 500 / os.sysconf("SC_CLK_TCK"))
    assert gpu.dev is not None
    assert [(n.path, n.major, n.minor) for n in gpu.dev] == [
        ("/dev/nvidia0", 195, 0),
        ("/dev/nvidiactl", 195, 255),
    ]
    mig = by["nvidia-mig-1g.10gb.sock"]
    assert mig.process is None and mig.dev is None


def test_a_listener_with_the_same_name_elsewhere_is_not_ours(host: Path) -> None:
    # point the plugin's view of the dir somewhere else: same name, another file
    proot = host / "prootfs/var/lib/kubelet/device-plugins"
    proot.unlink()
    proot.mkdir()
    os.mknod(proot / "nvidia-gpu.sock", stat.S_IFSOCK | 0o600)
    (gpu,) = [p for p in discover_plugins(Root(host), DP) if p.name == "nvidia-gpu.sock"]
    assert gpu.process is None


def test_process_start_and_init(host: Path) -> None:
    assert process_start(Root(host), 4242) == pytest.approx(BTIME + 500 / os.sysconf("SC_CLK_TCK"))
    assert process_start(Root(host), 999) is None
    assert container_init_pid(Root(host), 4242) == 4242


def test_kubelet_start_from_its_socket(host: Path) -> None:
    sock = host / DP.lstrip("/") / "kubelet.sock"
    assert kubelet_started(Root(host), DP) == pytest.approx(sock.stat().st_ctime)
    assert kubelet_started(Root(host), DP, unit_started=4e9) == 4e9
    sock.unlink()
    assert kubelet_started(Root(host), DP) is None  # no socket, no process: not running


def test_a_step_of_the_wall_clock_does_not_make_a_plugin_another_process(host: Path) -> None:
    """/proc/stat's btime is the wall clock minus the time since boot: a clock step
    moves it, and with it every process's wall-clock start. The plugin the step
    remembers (its socket gone: F4 restarts it) and the one a restart is verified
    against stay the same process, told by their start since boot."""
    from gpuguard.devices.processes import process_info, still_running

    before = process_info(Root(host), 4242)
    assert before is not None
    (host / "proc/stat").write_text(f"cpu 1 2 3\nbtime {BTIME + 3600}\n")  # NTP's step
    assert still_running(Root(host), before)
    rest = ["S"] + ["0"] * 18 + ["501"] + ["0"] * 10  # the pid used again, later
    (host / "proc/4242/stat").write_text(f"4242 (plugin) {' '.join(rest)}\n")
    assert not still_running(Root(host), before)
