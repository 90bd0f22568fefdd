"""gpuguard: keeps GPUs usable on Kubernetes nodes across lifecycle events."""

# The release being prepared; a build stamps its own version and commit here
# (packaging/version: 0.2.0.dev20261128115650+g3e9cbce0a1b2, or 0.2.0 for a tagged
# release). Unstamped, this is a source tree: it sorts before every build.
__version__ = "0.2.0.dev0"
__commit__ = ""


def package_version() -> str:
    """The version as dpkg and rpm spell it (".devN" is "~devN"): what `dpkg -l`,
    `rpm -q`, `gpuguard --version` and gpuguard_build_info show, less the release."""
    head, dev, rest = __version__.partition(".dev")
    return f"{head}~dev{rest}" if dev else __version__


def version_line() -> str:
    """What `gpuguard --version` prints: the version and the commit it was built from."""
    commit = __commit__[:12] if __commit__ else "none: a source tree, not a build"
    return f"gpuguard {package_version()} (commit {commit})"
