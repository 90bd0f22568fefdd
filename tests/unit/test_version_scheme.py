"""packaging/version: every build a distinct version, in commit order for dpkg, rpm and pip.

A throw-away git repository holds the two files the script reads (the real script and
the real __init__.py's shape); commits are made at chosen committer times, and the
versions they give are compared by dpkg --compare-versions and rpm's own vercmp.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import List

import pytest

from conftest import require_tool

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "packaging" / "version"
INIT = '"""gpuguard."""\n\n__version__ = "0.2.0.dev0"\n__commit__ = ""\n'


def run(*argv: str, cwd: Path, env_extra: dict[str, str] | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "GPUGUARD_VERSION_SUFFIX"}
    env.update(env_extra or {})
    res = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=env, check=True)
    return res.stdout.strip()


def version(tree: Path, *opts: str, suffix: str = "") -> str:
    extra = {"GPUGUARD_VERSION_SUFFIX": suffix} if suffix else {}
    return run("/usr/bin/python3", str(SCRIPT), *opts, str(tree), cwd=tree, env_extra=extra)


def commit(repo: Path, when: str, name: str) -> None:
    (repo / name).write_text(name)
    env = {
        "GIT_COMMITTER_DATE": when,
        "GIT_AUTHOR_DATE": when,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.org",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.org",
    }
    run("git", "add", "-A", cwd=repo)
    run("git", "commit", "-q", "-m", name, cwd=repo, env_extra=env)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    require_tool("git")
    r = tmp_path / "src-tree"
    (r / "src" / "gpuguard").mkdir(parents=True)
    (r / "packaging").mkdir()
    (r / "src" / "gpuguard" / "__init__.py").write_text(INIT)
    shutil.copy(SCRIPT, r / "packaging" / "version")
    shutil.copy(REPO / "packaging" / "version-info", r / "packaging" / "version-info")
    shutil.copy(REPO / ".gitattributes", r / ".gitattributes")
    run("git", "init", "-q", cwd=r)
    commit(r, "2026-11-28T10:00:00Z", "a")
    return r


def dpkg_lt(a: str, b: str) -> bool:
    return subprocess.run(["dpkg", "--compare-versions", a, "lt", b]).returncode == 0


def rpm_cmp(a: str, b: str) -> int:
    out = run("rpm", "--eval", f'%{{lua: print(rpm.vercmp("{a}", "{b}"))}}', cwd=Path("/"))
    return int(out)


def assert_ordered(versions: List[str]) -> None:
    """Strictly increasing for dpkg (with the -1 revision) and rpm (Version, Release 1)."""
    require_tool("dpkg", "rpm")
    for a, b in zip(versions, versions[1:]):
        assert dpkg_lt(f"{a}-1", f"{b}-1"), f"dpkg: {a} !< {b}"
        assert rpm_cmp(a, b) == -1, f"rpm: {a} !< {b}"


def test_each_commit_a_distinct_version_in_commit_order(repo: Path) -> None:
    first = version(repo)
    h1 = run("git", "rev-parse", "HEAD", cwd=repo)
    assert first == f"0.2.0~dev20261128100000+g{h1[:12]}"
    assert version(repo, "--python") == f"0.2.0.dev20261128100000+g{h1[:12]}"
    assert version(repo, "--commit") == h1
    # A later commit whose hash sorts lower still builds a higher version.
    commit(repo, "2026-11-28T10:00:07Z", "b")
    second = version(repo)
    assert second != first and second.startswith("0.2.0~dev20261128100007+g")
    run("git", "tag", "v0.2.0", cwd=repo)
    release = version(repo)
    assert release == "0.2.0" and version(repo, "--python") == "0.2.0"
    # The release before (what the fleet runs) < dev builds < the release.
    assert_ordered(["0.1.0", first, second, release])
    # A later commit goes on from the release being prepared once it is bumped.
    (repo / "src/gpuguard/__init__.py").write_text(INIT.replace("0.2.0.dev0", "0.3.0.dev0"))
    commit(repo, "2026-11-29T00:00:00Z", "c")
    assert_ordered([release, version(repo)])


def test_pip_orders_the_same_way(repo: Path) -> None:
    pv = pytest.importorskip("packaging.version")
    first = version(repo, "--python")
    commit(repo, "2026-11-28T11:00:00Z", "b")
    second = version(repo, "--python")
    assert pv.Version("0.1.0") < pv.Version(first) < pv.Version(second) < pv.Version("0.2.0")


def test_local_changes_and_a_suffix_make_other_versions(repo: Path) -> None:
    clean = version(repo)
    (repo / "a").write_text("edited")
    dirty = version(repo)
    assert dirty == clean + ".dirty"
    assert version(repo, suffix="+test1") == dirty + ".test1"
    assert version(repo, "--python", suffix="+test1").endswith(".dirty.test1")
    assert_ordered([clean, dirty, dirty + ".test1"])
    with pytest.raises(subprocess.CalledProcessError):
        version(repo, suffix="test1")


def test_a_shallow_clone_builds_the_same_version(repo: Path, tmp_path: Path) -> None:
    commit(repo, "2026-11-28T12:00:00Z", "b")
    shallow = tmp_path / "shallow"
    run("git", "clone", "-q", "--depth", "1", f"file://{repo}", str(shallow), cwd=tmp_path)
    assert run("git", "rev-parse", "--is-shallow-repository", cwd=shallow) == "true"
    assert version(shallow) == version(repo)


def test_a_tarball_without_git(repo: Path, tmp_path: Path) -> None:
    """git archive fills in packaging/version-info; a plain copy falls back to a stamp."""
    commit(repo, "2026-11-28T13:00:00Z", "b")
    want = version(repo)
    tar = tmp_path / "src.tar"
    run("git", "archive", "--format=tar", "-o", str(tar), "HEAD", cwd=repo)
    out = tmp_path / "unpacked"
    with tarfile.open(tar) as t:
        t.extractall(out)
    assert not (out / ".git").exists()
    assert version(out) == want
    # A copy a build stamped keeps that build's version and commit.
    stamped = tmp_path / "stamped"
    shutil.copytree(repo, stamped, ignore=shutil.ignore_patterns(".git"))
    version(repo, "--stamp", str(stamped / "src/gpuguard/__init__.py"))
    text = (stamped / "src/gpuguard/__init__.py").read_text()
    assert re.search(r'^__version__ = "0\.2\.0\.dev20261128130000\+g[0-9a-f]{12}"$', text, re.M)
    assert version(stamped) == want
    assert version(stamped, "--commit") == run("git", "rev-parse", "HEAD", cwd=repo)
    # Neither: a development version below every real build, with a warning.
    bare = tmp_path / "bare"
    shutil.copytree(repo, bare, ignore=shutil.ignore_patterns(".git"))
    (bare / "packaging/version-info").write_text("commit=$Format:%H$\n")
    assert version(bare) == "0.2.0~dev0+unknown"
    assert_ordered(["0.1.0", "0.2.0~dev0+unknown", want])
