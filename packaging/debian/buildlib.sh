# Shared by packaging/build-deb and packaging/build-rpm (sourced, POSIX sh).
# Not installed and removed from the debian/ copy.

gpuguard_version() {
    # packaging/version: the release in src/gpuguard/__init__.py, then the commit's
    # time and hash (or the tag), plus GPUGUARD_VERSION_SUFFIX (docs: packaging/README.md).
    /usr/bin/python3 "$REPO/packaging/version" "$REPO" || exit 2
}

# gpuguard_commit: the full hash of the commit built (empty without git or archive info).
gpuguard_commit() {
    /usr/bin/python3 "$REPO/packaging/version" --commit "$REPO" 2>/dev/null
}

# copy_tree DEST: the checkout's files (tracked and untracked-but-not-ignored),
# never build outputs, venvs or caches.
copy_tree() {
    mkdir -p "$1"
    if git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1; then
        (cd "$REPO" && git ls-files -z --cached --others --exclude-standard |
            xargs -0 sh -c 'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' sh |
            tar --null -T - -cf -) | tar -xf - -C "$1"
    else
        tar -C "$REPO" --exclude=./build --exclude=./dist --exclude=./.venv \
            --exclude=.git --exclude='__pycache__' --exclude='*.egg-info' -cf - . | tar -xf - -C "$1"
    fi
    rm -rf "$1"/src/*.egg-info
}

# set_version TREE: stamp the copy's __version__ and __commit__ with this build's
# (packaging/version --stamp), so the copy, which has no .git, and everything built
# from it (`gpuguard --version`, gpuguard_build_info, pip's metadata) carry them.
set_version() {
    /usr/bin/python3 "$REPO/packaging/version" --stamp "$1/src/gpuguard/__init__.py" "$REPO" || exit 2
}

# fetch_vendor DESTDIR REQUIREMENTS: download the pinned wheels (pip checks the
# sha256 in REQUIREMENTS) and unpack the modules gpuguard ships privately.
fetch_vendor() {
    dest=$1 req=$2
    wheels=$(dirname "$dest")/wheels
    mkdir -p "$dest"
    download_wheels "$wheels" "$req"
    /usr/bin/python3 - "$wheels" "$dest" <<'PY'
import pathlib, re, sys, zipfile
wheels, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for whl in sorted(wheels.glob("*.whl")):
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        if whl.name.startswith("nvidia_ml_py-"):
            src = z.read("pynvml.py").decode()
            (dest / "pynvml.py").write_text(src)
            # The BSD licence is the file's leading comment block.
            m = re.match(r"(#####\n(?:#.*\n)*?#####\n)", src)
            if not m:
                sys.exit(f"{whl.name}: no licence header in pynvml.py")
            lic = "\n".join(l[2:] if l.startswith("# ") else l.lstrip("#")
                            for l in m.group(1).splitlines() if l.strip("#"))
            (dest / "LICENSE.nvidia-ml-py").write_text(
                f"pynvml.py from {whl.name} (https://pypi.org/project/nvidia-ml-py/)\n\n{lic}\n")
        elif whl.name.startswith("dbus_next-"):
            for n in names:
                if n.startswith("dbus_next/") and not n.endswith("/"):
                    out = dest / n
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(z.read(n))
            lic = [n for n in names if n.endswith(".dist-info/LICENSE")]
            (dest / "LICENSE.dbus-next").write_bytes(z.read(lic[0]))
        else:
            sys.exit(f"unexpected wheel {whl.name}")
PY
}

# download_wheels DESTDIR REQUIREMENTS: the pinned wheels only (sha256 checked by pip).
download_wheels() {
    mkdir -p "$1"
    if [ -n "${GPUGUARD_WHEELHOUSE:-}" ]; then
        set -- "$1" "$2" --no-index --find-links "$GPUGUARD_WHEELHOUSE"
    fi
    d=$1 r=$2; shift 2
    /usr/bin/python3 -m pip download --quiet --disable-pip-version-check --no-deps \
        --only-binary=:all: --require-hashes -r "$r" -d "$d" "$@" >&2
}

# ensure_catalog TREE: docs/gpuguard.catalog if the tree has it, else generated
# with `gpuguard catalog` from the tree's own sources (the catalog's source of truth).
ensure_catalog() {
    [ -f "$1/docs/gpuguard.catalog" ] && return 0
    if (cd "$1" && PYTHONPATH=src /usr/bin/python3 -m gpuguard catalog > docs/gpuguard.catalog.tmp 2>/dev/null) &&
        grep -q '^-- [0-9a-f]\{32\}' "$1/docs/gpuguard.catalog.tmp"; then
        mv "$1/docs/gpuguard.catalog.tmp" "$1/docs/gpuguard.catalog"
    else
        rm -f "$1/docs/gpuguard.catalog.tmp"
        echo "WARNING: no docs/gpuguard.catalog and \`gpuguard catalog\` failed: no journal catalog in this build" >&2
    fi
}
