#!/bin/sh
# Runs as PID 1 of the fresh pid/mount/uts/ipc/cgroup namespaces created by
# sysns.py, BEFORE systemd: builds the private filesystem view, then execs
# systemd. Everything here happens in a private mount namespace
# (propagation private), so no mount is visible on, or left behind on, the host.
# Usage: sysns-init.sh STATE_DIR   (STATE_DIR prepared by sysns.py)
set -eu
S=$1
# The state dir lives under the host /tmp, which gets a fresh tmpfs below:
# keep a handle on it as a separate (rw) mount first.
mount --bind "$S" "$S"

# 1. Read-only root: from here on, anything not explicitly mounted writable
#    fails with EROFS instead of writing the host disk.
mount -o remount,bind,ro /

# 2. Private /run; stage the state dir and bind sources under /run/host while
#    their host paths are still reachable.
mount -t tmpfs -o mode=755,nosuid,nodev tmpfs /run
mkdir -p /run/host/state /run/host/binds
mount --move "$S" /run/host/state
S=/run/host/state
n=0
while IFS='	' read -r src dst mode; do
    n=$((n + 1))
    if [ -d "$src" ]; then mkdir /run/host/binds/$n; else : > /run/host/binds/$n; fi
    mount --bind "$src" /run/host/binds/$n
    # explicit either way: a bind of a path on the (now read-only) root is ro
    mount -o "remount,bind,$mode" /run/host/binds/$n
done < "$S/binds.tsv"

# 3. Writable copies of /etc and /var: overlays whose upper layers live in the
#    state dir; the host's /etc and /var are only ever read.
for d in etc var; do
    mkdir -p "$S/$d.upper" "$S/$d.work"
    mount -t overlay overlay -o "lowerdir=/$d,upperdir=$S/$d.upper,workdir=$S/$d.work" "/$d"
done
# Empty unit dir (host enablement symlinks must not apply) filled by the harness.
mount --bind "$S/units" /etc/systemd/system
mount -t tmpfs -o mode=755 tmpfs /var/log/journal 2>/dev/null || true
cp "$S/machine-id" /etc/machine-id

# 4. Fresh tmpfs for the temporary dirs.
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /tmp
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /var/tmp

# 5. Private /dev with only harmless nodes (no console, no kmsg, no disks).
mount -t tmpfs -o mode=755,nosuid tmpfs /dev
mknod -m 666 /dev/null c 1 3
mknod -m 666 /dev/zero c 1 5
mknod -m 666 /dev/full c 1 7
mknod -m 666 /dev/random c 1 8
mknod -m 666 /dev/urandom c 1 9
mknod -m 666 /dev/tty c 5 0
mkdir /dev/pts /dev/shm /dev/char
mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts /dev/pts
ln -s pts/ptmx /dev/ptmx
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm
ln -s /proc/self/fd /dev/fd
ln -s /proc/self/fd/0 /dev/stdin
ln -s /proc/self/fd/1 /dev/stdout
ln -s /proc/self/fd/2 /dev/stderr
ln -s ../null /dev/char/1:3
ln -s ../zero /dev/char/1:5
ln -s ../full /dev/char/1:7
ln -s ../random /dev/char/1:8
ln -s ../urandom /dev/char/1:9
ln -s ../tty /dev/char/5:0

# 6. Kernel knobs read-only.
mount --bind /proc/sys /proc/sys
mount -o remount,bind,ro /proc/sys
if [ -e /proc/sysrq-trigger ]; then
    mount --bind /proc/sysrq-trigger /proc/sysrq-trigger
    mount -o remount,bind,ro /proc/sysrq-trigger
fi
mount -o remount,bind,ro /sys

# 7. cgroups: we are in a new cgroup namespace whose root is the per-instance
#    cgroup; mounting the hierarchies afresh roots each at that cgroup, so
#    systemd cannot see (let alone move) anything outside its instance.
#    Layout v2 (unified): what a unified host shows is cgroup2 alone at
#    /sys/fs/cgroup, so every inherited v1 mount and the tmpfs under them are
#    unmounted first (a shadowed mount would still be listed in mountinfo and
#    mislead code that reads it); systemd then sees cgroup2fs and runs unified.
if [ "$(cat "$S/layout")" = v2 ]; then
    awk '$5 ~ "^/sys/fs/cgroup/" { print $5 }' /proc/self/mountinfo | sort -r |
        while read -r m; do umount "$m"; done
    umount /sys/fs/cgroup
    # nsdelegate is honoured only from the initial cgroup namespace; older
    # kernels refuse it elsewhere, where the mount works without it.
    mount -t cgroup2 -o nsdelegate,nosuid,nodev,noexec cgroup2 /sys/fs/cgroup 2>/dev/null ||
        mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 /sys/fs/cgroup
    if grep -q ' /sys/fs/cgroup/' /proc/self/mountinfo; then
        echo "sysns-init: v1 cgroup mounts still visible" >&2
        exit 1
    fi
else
    mount -t tmpfs -o mode=755,nosuid,nodev,noexec tmpfs /sys/fs/cgroup
    while IFS='	' read -r name fstype opts; do
        mkdir "/sys/fs/cgroup/$name"
        mount -t "$fstype" -o "$opts,nosuid,nodev,noexec" cgroup "/sys/fs/cgroup/$name"
    done < "$S/cgroups.tsv"
fi

# 8. Binds requested by the test, now that the tree is final.
n=0
while IFS='	' read -r src dst mode; do
    n=$((n + 1))
    if [ -d "/run/host/binds/$n" ]; then mkdir -p "$dst"; else mkdir -p "$(dirname "$dst")"; [ -e "$dst" ] || : > "$dst"; fi
    mount --bind "/run/host/binds/$n" "$dst"
    if [ "$mode" = ro ]; then mount -o remount,bind,ro "$dst"; fi
done < "$S/binds.tsv"

# 9. Runtime config: masks, volatile journal, manager environment.
mkdir -p /run/systemd/system /run/systemd/journald.conf.d /run/systemd/system.conf.d
while read -r unit; do
    ln -s /dev/null "/run/systemd/system/$unit"
done < "$S/masks.txt"
cp "$S/journald.conf" /run/systemd/journald.conf.d/harness.conf
cp "$S/system.conf" /run/systemd/system.conf.d/harness.conf
cp "$S/hostname" /etc/hostname
hostname "$(cat "$S/hostname")"

exec env -i container=gpuguard-test PATH=/usr/sbin:/usr/bin:/sbin:/bin \
    /lib/systemd/systemd --system --unit=basic.target --show-status=no --log-target=journal
