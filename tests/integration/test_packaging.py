"""Builds the .deb and .rpm from this checkout and checks what they contain.

Needs (Debian 12, scripts/bootstrap --full): debhelper dh-python
pybuild-plugin-pyproject python3-all python3-setuptools python3-pip rpm lintian,
and PyPI (or GPUGUARD_WHEELHOUSE) for the pinned nvidia-ml-py wheel.
"""

from __future__ import annotations

import gzip
import re
import subprocess
from pathlib import Path
from typing import Dict, List

import pytest

from conftest import require_tool
from integration.pkgroot import REPO, build_seconds, built_packages, debian_env, source_version

#: The install layout shared by both packages (packaging/README.md).
LAYOUT = [
    "/usr/bin/gpuguard",
    "/usr/lib/systemd/system/gpuguard.service",
    "/usr/lib/systemd/system/gpuguard-trigger.service",
    "/usr/lib/systemd/system/kubelet.service.d/10-gpuguard.conf",
    # kubelet inside k3s and RKE2: the same hook for their units
    "/usr/lib/systemd/system/k3s.service.d/10-gpuguard.conf",
    "/usr/lib/systemd/system/k3s-agent.service.d/10-gpuguard.conf",
    "/usr/lib/systemd/system/rke2-agent.service.d/10-gpuguard.conf",
    "/usr/lib/systemd/system/rke2-server.service.d/10-gpuguard.conf",
    "/usr/libexec/gpuguard/kubelet-pre-start",
    "/usr/libexec/gpuguard/npd-condition",
    "/usr/share/gpuguard/node-problem-detector/gpuguard-monitor.json",
    "/usr/share/gpuguard/prometheus/gpuguard.rules.yml",
    # needrestart never restarts the re-admission bridge (a link: no conffile)
    "/usr/share/gpuguard/needrestart/gpuguard.conf",
    "/etc/needrestart/conf.d/gpuguard.conf",
    "/usr/lib/systemd/system/gpuguard-metrics.socket",
    "/usr/lib/systemd/system/gpuguard-metrics.service",
    "/usr/lib/udev/rules.d/71-gpuguard.rules",
    "/usr/lib/systemd/catalog/gpuguard.catalog",
    "/usr/lib/gpuguard/vendor/pynvml.py",
    "/usr/share/doc/gpuguard/LICENSE.nvidia-ml-py",
    "/usr/share/doc/gpuguard/hardening.md",
    "/usr/share/doc/gpuguard/README.md",
    # what the README links to, beside it (packaging/README.md)
    "/usr/share/doc/gpuguard/docs/operations.md",
    "/usr/share/doc/gpuguard/docs/failures.md",
    "/usr/share/doc/gpuguard/docs/support-matrix.md",
    "/usr/share/doc/gpuguard/packaging/README.md",
    "/usr/lib/gpuguard/gpuguard.conf",
    "/etc/gpuguard/gpuguard.conf.d",
    "/etc/gpuguard/hooks.d",
    "/var/lib/gpuguard",
]

#: A command line (not a comment or message) that acts on kubelet.service.
NO_KUBELET_RESTART = re.compile(r"^[^#\n]*(systemctl|deb-systemd-invoke)\b[^\n]*\bkubelet", re.M)


def sh(*argv: str) -> str:
    res = subprocess.run(argv, capture_output=True, text=True, env=debian_env(), timeout=120)
    assert res.returncode == 0, f"{argv}: {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res.stdout


@pytest.fixture(scope="module")
def pkgs() -> Dict[str, Path]:
    require_tool("dpkg-buildpackage", "dh_python3", "rpmbuild", "/usr/bin/python3")
    return built_packages()


@pytest.fixture(scope="module")
def deb_files(pkgs: Dict[str, Path]) -> Dict[str, str]:
    """path -> `dpkg-deb -c` line (mode owner size date time path)."""
    out = {}
    for line in sh("dpkg-deb", "-c", str(pkgs["deb"])).splitlines():
        path = line.split(None, 5)[5].split(" -> ")[0]
        out[path[1:].rstrip("/") or "/"] = line
    return out


@pytest.fixture(scope="module")
def rpm_files(pkgs: Dict[str, Path]) -> Dict[str, str]:
    out = {}
    for line in sh("rpm", "-qlpv", str(pkgs["rpm"])).splitlines():
        out[line.split(" -> ")[0].split()[-1]] = line  # a link: its own path
    return out


def test_version_comes_from_git(pkgs: Dict[str, Path], tmp_path: Path) -> None:
    """The packages carry packaging/version's version, and so does the code in them."""
    v = source_version()
    assert pkgs["deb"].name == f"gpuguard_{v}-1_all.deb"
    assert pkgs["rpm"].name == f"gpuguard-{v}-1.noarch.rpm"
    assert sh("dpkg-deb", "-f", str(pkgs["deb"]), "Version").strip() == f"{v}-1"
    assert sh("rpm", "-qp", "--qf", "%{VERSION}", str(pkgs["rpm"])) == v
    commit = sh("git", "-C", str(REPO), "rev-parse", "HEAD").strip()
    sh("dpkg-deb", "-x", str(pkgs["deb"]), str(tmp_path))
    init = (tmp_path / "usr/lib/python3/dist-packages/gpuguard/__init__.py").read_text()
    assert f'__commit__ = "{commit}"' in init
    assert re.search(r'^__version__ = "\d+\.\d+\.\d+(\.dev\d{14}\+g[0-9a-f]{12}\S*)?"$', init, re.M)
    # A release (a tagged, clean tree) needs its changelog entries; any other build
    # writes its own on top, which the package's changelog shows.
    if "~dev" not in v and "+" not in v:
        top = sh(
            "dpkg-parsechangelog", "-l", str(REPO / "packaging/debian/changelog"), "-S", "Version"
        )
        assert top.strip() == f"{v}-1", "add a packaging/debian/changelog entry for the release"
        spec = (REPO / "packaging/rpm/gpuguard.spec").read_text()
        assert re.search(rf"^\* .* - {re.escape(v)}-1$", spec, re.M), (
            "add a %changelog entry to gpuguard.spec"
        )


def test_deb_layout(deb_files: Dict[str, str]) -> None:
    missing = [p for p in LAYOUT if p not in deb_files]
    assert not missing, missing
    assert "/usr/share/man/man8/gpuguard.8.gz" in deb_files
    assert "/usr/share/man/man5/gpuguard.conf.5.gz" in deb_files
    assert deb_files["/var/lib/gpuguard"].startswith("drwx------ root/root")
    assert deb_files["/usr/libexec/gpuguard/kubelet-pre-start"].startswith("-rwxr-xr-x")
    assert any(p.startswith("/usr/lib/python3/dist-packages/gpuguard/") for p in deb_files)
    # Nothing in the old /lib paths (one layout), no bytecode, no tests.
    bad = [
        p
        for p in deb_files
        if p.startswith(("/lib/", "/usr/local")) or "__pycache__" in p or "/tests/" in p
    ]
    assert not bad, bad
    link = deb_files["/etc/needrestart/conf.d/gpuguard.conf"]
    assert link.startswith("lrwxrwxrwx") and link.endswith(
        "-> /usr/share/gpuguard/needrestart/gpuguard.conf"
    ), link


def test_deb_control(pkgs: Dict[str, Path]) -> None:
    deb = str(pkgs["deb"])
    depends = sh("dpkg-deb", "-f", deb, "Depends")
    for dep in (
        "python3",
        "python3-pyudev",
        "python3-dbus-next",
        "python3-systemd",
        "python3-yaml",
        "procps",
    ):
        assert re.search(rf"(^|, ){re.escape(dep)}\b", depends), (dep, depends)
    assert sh("dpkg-deb", "-f", deb, "Architecture").strip() == "all"
    conffiles = subprocess.run(
        ["dpkg-deb", "-I", deb, "conffiles"], capture_output=True, text=True, env=debian_env()
    ).stdout.split()
    # No conffile: the defaults are in /usr/lib, so no upgrade ever prompts.
    assert conffiles == []
    postinst = sh("dpkg-deb", "-I", deb, "postinst")
    assert "deb-systemd-helper enable 'gpuguard.service'" in postinst
    # an upgrade restarts the daemon only after the new version checked the configuration
    check = postinst.index("/usr/bin/gpuguard config --check")
    assert check < postinst.index("deb-systemd-invoke restart 'gpuguard.service'")
    assert "deb-systemd-invoke $_dh_action 'gpuguard.service'" not in postinst
    assert "udevadm control --reload" in postinst and "[ -S /run/udev/control ]" in postinst
    assert "--subsystem-match=module --sysname-match='nvidia*'" in postinst
    assert "--attr-match=vendor=0x10de" in postinst
    assert "journalctl --update-catalog" in postinst
    assert "kubelet" in postinst and not NO_KUBELET_RESTART.search(postinst)
    # the metrics endpoint is shipped off: enabled again on upgrade only where an
    # operator had enabled it, never started by the package
    enables = re.findall(r"^.*enable 'gpuguard-metrics.*$", postinst, re.M)
    assert enables and all("deb-systemd-helper enable" in e for e in enables)
    assert "was-enabled 'gpuguard-metrics.socket'" in postinst
    # started again only where preinst found it active before debhelper's stop
    starts = re.findall(r"deb-systemd-invoke \S+ 'gpuguard-metrics.*$", postinst, re.M)
    assert starts == ["deb-systemd-invoke start 'gpuguard-metrics.socket' >/dev/null || true"]
    marker = "/run/gpuguard.metrics-socket-was-active"
    preinst = sh("dpkg-deb", "-I", deb, "preinst")
    assert preinst.index(marker) < preinst.index("deb-systemd-invoke stop")
    assert postinst.index(f"[ -e {marker} ]") < postinst.index(
        "deb-systemd-invoke start 'gpuguard-m"
    )
    # every GPU container's present grant made durable before the first daemon-reload
    reload = postinst.index("systemctl --system daemon-reload")
    assert postinst.index("/usr/bin/gpuguard protect") < reload
    assert "python3-prometheus-client" in sh("dpkg-deb", "-f", deb, "Recommends")
    postrm = sh("dpkg-deb", "-I", deb, "postrm")
    # purge keeps what an operator made and the checkpoint backups (test_fleet_ops.py)
    assert "rm -rf /etc/gpuguard" not in postrm and "! -name backups" in postrm
    assert "60-gpuguard-devices.conf" in postrm
    prerm = sh("dpkg-deb", "-I", deb, "prerm")
    assert "deb-systemd-invoke stop 'gpuguard.service'" in prerm
    assert "/usr/bin/gpuguard protect" in prerm  # before postrm's or another postinst's reload
    assert 'rm -f "$f"' not in postrm  # the drop-ins are kept at removal


def test_lintian_has_no_errors(pkgs: Dict[str, Path]) -> None:
    require_tool("lintian")
    res = subprocess.run(
        ["lintian", "--pedantic", "--display-info", str(pkgs["deb"])],
        capture_output=True,
        text=True,
        env=debian_env(),
        timeout=300,
    )
    tags = [
        line for line in (res.stdout + res.stderr).splitlines() if re.match(r"^[EWIPX]: ", line)
    ]
    print("lintian:\n" + "\n".join(tags))
    errors = [t for t in tags if t.startswith("E: ")]
    assert not errors, "\n".join(tags)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_installed_readmes_links_resolve(
    deb_files: Dict[str, str], rpm_files: Dict[str, str]
) -> None:
    """The README installed in /usr/share/doc/gpuguard links docs/*.md and
    packaging/README.md: on a host each link opens the file beside it. bench/ is left
    out: benchmarks run from a checkout, where its README is."""
    readme = (REPO / "README.md").read_text()
    links = {m.split("#")[0] for m in re.findall(r"\]\(([^)\s]+)\)", readme)}
    local = sorted(
        x for x in links if x and not re.match(r"\w+:", x) and not x.startswith("bench/")
    )
    assert "docs/operations.md" in local and "packaging/README.md" in local
    for files in (deb_files, rpm_files):
        missing = [x for x in local if f"/usr/share/doc/gpuguard/{x}" not in files]
        assert not missing, f"the installed README links these, not installed: {missing}"


def test_rpm_layout(rpm_files: Dict[str, str], pkgs: Dict[str, Path]) -> None:
    missing = [p for p in LAYOUT if p not in rpm_files]
    assert not missing, missing
    assert any(p.startswith("/usr/share/man/man8/gpuguard.8") for p in rpm_files)
    assert any(p.startswith("/usr/share/man/man5/gpuguard.conf.5") for p in rpm_files)
    # enabled by its preset, as the NVIDIA Container Toolkit's units are
    preset = "/usr/lib/systemd/system-preset/50-gpuguard.preset"
    assert preset in rpm_files
    assert rpm_files["/var/lib/gpuguard"].startswith("drwx------")
    assert any(re.match(r"/usr/lib/python3\.\d+/site-packages/gpuguard/", p) for p in rpm_files)
    # No %config file: the defaults are in /usr/lib, /etc/gpuguard is the operator's.
    assert [p for p in sh("rpm", "-qcp", str(pkgs["rpm"])).split() if p.startswith("/")] == []
    assert not any(p.startswith("/etc/gpuguard/") and p.endswith(".conf") for p in rpm_files)
    link = rpm_files["/etc/needrestart/conf.d/gpuguard.conf"]
    assert link.startswith("lrwxrwxrwx") and "-> /usr/share/gpuguard/needrestart/" in link, link


def test_rpm_requires_and_scripts(pkgs: Dict[str, Path]) -> None:
    rpm = str(pkgs["rpm"])
    requires: List[str] = sh("rpm", "-qp", "--requires", rpm).splitlines()
    for dep in (
        "python3-pyudev",
        "python3-systemd",
        "python3-dbus-next",
        "python3-pyyaml",
        "systemd",
        "/usr/bin/kill",
    ):
        assert dep in requires, (dep, requires)
    # nvidia-ml-py is bundled: no requirement on it may leak out of the wheel metadata.
    assert not [r for r in requires if "nvidia" in r or "dbus-next)" in r], requires
    provides = sh("rpm", "-qp", "--provides", rpm)
    assert "bundled(python3dist(nvidia-ml-py))" in provides
    scripts = sh("rpm", "-qp", "--scripts", rpm)
    # %systemd_post: enabled by the preset (a site preset can disable it), not by hand
    assert "preset gpuguard.service" in scripts
    assert "enable --now" not in scripts and "systemctl enable" not in scripts
    assert "systemctl is-enabled --quiet gpuguard.service" in scripts  # then started
    assert "disable --now gpuguard.service" in scripts  # %systemd_preun
    assert "try-restart gpuguard.service" in scripts or "mark-restart-system-units" in scripts
    posttrans = scripts[scripts.index("posttrans scriptlet") :]
    assert posttrans.index("gpuguard config --check") < posttrans.index("try-restart")
    assert "60-gpuguard-devices.conf" in scripts
    post = scripts[scripts.index("postinstall scriptlet") :]
    assert post.index("/gpuguard protect") < post.index("systemctl daemon-reload")
    preun = scripts[scripts.index("preuninstall scriptlet") :]
    assert preun.index("/gpuguard protect") < preun.index("disable --now")
    assert "--sysname-match='nvidia*'" in scripts and "vendor=0x10de" in scripts
    assert "journalctl --update-catalog" in scripts
    assert not NO_KUBELET_RESTART.search(scripts)


def test_sizes(pkgs: Dict[str, Path]) -> None:
    for kind, path in pkgs.items():
        print(
            f"{kind}: {path.name} {path.stat().st_size} bytes, built in {build_seconds[kind]:.1f} s"
        )
    installed = sh("dpkg-deb", "-f", str(pkgs["deb"]), "Installed-Size").strip()
    print(f"deb Installed-Size: {installed} KiB")
    assert pkgs["deb"].stat().st_size < 1024 * 1024
    assert pkgs["rpm"].stat().st_size < 1024 * 1024


def test_every_path_a_shipped_file_names_is_installed(
    pkgs: Dict[str, Path], deb_files: Dict[str, str], rpm_files: Dict[str, str], tmp_path: Path
) -> None:
    """The unit, udev rule, kubelet drop-in, hook, configuration, catalog and man pages
    point only at files the packages install (uncompressed where named so), man pages
    included, and never at the source tree's docs/."""
    sh("dpkg-deb", "-x", str(pkgs["deb"]), str(tmp_path))
    shipped = [
        "/usr/lib/systemd/system/gpuguard.service",
        "/usr/lib/systemd/system/gpuguard-trigger.service",
        "/usr/lib/systemd/system/kubelet.service.d/10-gpuguard.conf",
        "/usr/lib/udev/rules.d/71-gpuguard.rules",
        "/usr/libexec/gpuguard/kubelet-pre-start",
        "/usr/lib/gpuguard/gpuguard.conf",
        "/usr/lib/systemd/catalog/gpuguard.catalog",
        "/usr/share/man/man8/gpuguard.8.gz",
        "/usr/share/man/man5/gpuguard.conf.5.gz",
    ]
    named: Dict[str, List[str]] = {}
    for f in shipped:
        raw = (tmp_path / f.lstrip("/")).read_bytes()
        text = (gzip.decompress(raw) if f.endswith(".gz") else raw).decode()
        text = text.replace("\\-", "-").replace("\\&", "")  # roff escapes
        assert not re.search(r"(?<![\w/])docs/", text), f"{f} points at the source tree"
        assert "README" not in text, f"{f} points at a README"
        for path in re.findall(r"file://(/\S+)", text):
            named.setdefault(path, []).append(f)
        for path in re.findall(r"(/usr/share/doc/gpuguard/[\w.-]+)", text):
            named.setdefault(path, []).append(f)
        for name, sec in re.findall(r"\b(gpuguard[\w.-]*)\(([1-8])\)", text):
            named.setdefault(f"/usr/share/man/man{sec}/{name}.{sec}.gz", []).append(f)
    assert "/usr/share/man/man5/gpuguard.conf.5.gz" in named
    assert "/usr/share/doc/gpuguard/hardening.md" in named
    for files in (deb_files, rpm_files):
        missing = {
            p: by
            for p, by in named.items()
            if p not in files
            and p.replace(".gz", "") not in files
            and not any(q.startswith(p.replace(".gz", "") + ".") for q in files)
        }
        assert not missing, f"named but not installed: {missing}"
