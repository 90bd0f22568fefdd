"""The installer image (deploy/build-image, buildah FROM scratch) built in a test's own
directory: buildah's storage there (--root/--runroot, vfs), never the host's
/var/lib/containers, and saved as an archive a node's containerd imports (no
registry anywhere)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Dict, List, Mapping

from integration.pkgroot import DEBIAN_PATH, source_version

REPO = Path(__file__).resolve().parents[2]


def host_var_lib_read_only(argv: List[str]) -> List[str]:
    """``argv`` in a private mount namespace whose /var/lib is read-only.

    buildah's image library keeps a blob-info cache at /var/lib/containers/cache for
    root whatever --root says, and falls back to memory when it cannot create it: the
    read-only view keeps the host's /var/lib as it was without a path of its own."""
    script = 'mount --bind /var/lib /var/lib && mount -o remount,bind,ro /var/lib && exec "$@"'
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *argv]


class Buildah:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.args = [
            "--root",
            str(tmp / "storage"),
            "--runroot",
            str(tmp / "runroot"),
            "--storage-driver",
            "vfs",
        ]
        (tmp / "tmp").mkdir(parents=True)

    def env(self) -> Dict[str, str]:
        return {"PATH": DEBIAN_PATH, "TMPDIR": str(self.tmp / "tmp"), "LC_ALL": "C.UTF-8"}

    def __call__(self, *argv: str) -> str:
        res = subprocess.run(
            host_var_lib_read_only(["buildah", *self.args, *argv]),
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, f"buildah {argv}: {res.returncode}\n{res.stderr}"
        return res.stdout.strip()


def image_tag(suffix: str = "") -> str:
    """deploy/build-image's default tag for this checkout's packages (+ ``suffix``)."""
    version = f"{source_version(suffix)}-1"
    return f"localhost/gpuguard-installer:{version}".replace("+", "_").replace("~", "_")


def build_image(buildah: Buildah, packages: Mapping[str, Path], suffix: str = "") -> str:
    """deploy/build-image run on ``packages`` (built_packages(suffix)); its tag."""
    dist = buildah.tmp / f"dist{suffix}"
    dist.mkdir()
    for pkg in packages.values():
        (dist / pkg.name).write_bytes(pkg.read_bytes())
    env = {**buildah.env(), "DIST": str(dist), "BUILDAH_ARGS": " ".join(buildah.args)}
    res = subprocess.run(
        host_var_lib_read_only([str(REPO / "deploy" / "build-image")]),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, f"{res.returncode}\n{res.stdout}\n{res.stderr}"
    return image_tag(suffix)


def save_image(buildah: Buildah, tag: str, dest: Path) -> None:
    """The image as a docker-archive naming ``tag`` (``ctr images import`` keeps it)."""
    buildah("push", "--quiet", tag, f"docker-archive:{dest}:{tag}")
