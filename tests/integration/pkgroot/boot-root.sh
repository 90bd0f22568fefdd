#!/bin/sh
# PID 1 of the fresh pid/mount/uts/ipc/cgroup namespaces made by PackageRoot
# (pkgroot/__init__.py, a harness.sysns.SystemdNamespace): builds a private,
# writable copy of a debootstrapped Debian root, pivots into it and execs its
# systemd. Same safety measures as harness/sysns-init.sh (read that first),
# applied to the new root instead of the host's: everything below happens in a
# private mount namespace, and the host root is detached before systemd starts,
# so nothing inside can reach the host's /etc, /run, /dev or dpkg database.
# Usage: boot-root.sh STATE_DIR LOWER_ROOT
set -eu
S=$1
LOWER=$2
mount --bind "$S" "$S"
N=$S/root
mkdir -p "$S/upper" "$S/work" "$N"
# Copy-on-write root: the cached debootstrap tree stays untouched (read-only
# lower layer); every change lands in $S/upper, removed with the test's tmp dir.
mount -t overlay overlay -o "lowerdir=$LOWER,upperdir=$S/upper,workdir=$S/work" "$N"

mount -t proc -o nosuid,nodev,noexec proc "$N/proc"
mount --bind "$N/proc/sys" "$N/proc/sys"
mount -o remount,bind,ro "$N/proc/sys"
if [ -e "$N/proc/sysrq-trigger" ]; then
    mount --bind "$N/proc/sysrq-trigger" "$N/proc/sysrq-trigger"
    mount -o remount,bind,ro "$N/proc/sysrq-trigger"
fi
mount --bind /sys "$N/sys"
mount -o remount,bind,ro "$N/sys"

mount -t tmpfs -o mode=755,nosuid,nodev tmpfs "$N/run"
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$N/tmp"
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$N/var/tmp"
mkdir -p "$N/var/log/journal"
mount -t tmpfs -o mode=755 tmpfs "$N/var/log/journal"

mount -t tmpfs -o mode=755,nosuid tmpfs "$N/dev"
D=$N/dev
mknod -m 666 "$D/null" c 1 3
mknod -m 666 "$D/zero" c 1 5
mknod -m 666 "$D/full" c 1 7
mknod -m 666 "$D/random" c 1 8
mknod -m 666 "$D/urandom" c 1 9
mknod -m 666 "$D/tty" c 5 0
mkdir "$D/pts" "$D/shm" "$D/char"
mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts "$D/pts"
ln -s pts/ptmx "$D/ptmx"
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$D/shm"
ln -s /proc/self/fd "$D/fd"
ln -s /proc/self/fd/0 "$D/stdin"
ln -s /proc/self/fd/1 "$D/stdout"
ln -s /proc/self/fd/2 "$D/stderr"

# cgroups: the per-instance cgroup is our cgroup namespace's root. The layout the
# test asked for (sysns-init.sh step 7): v2 is cgroup2 alone at /sys/fs/cgroup (the
# bind of /sys above is not recursive, so no v1 mount of the host shows through);
# v1 is the hybrid tree, every hierarchy mounted afresh. PackageRoot checks what
# systemd then saw (stat -fc %T /sys/fs/cgroup) and fails on a mismatch.
if [ "$(cat "$S/layout")" = v2 ]; then
    mount -t cgroup2 -o nsdelegate,nosuid,nodev,noexec cgroup2 "$N/sys/fs/cgroup" 2>/dev/null ||
        mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 "$N/sys/fs/cgroup"
else
    mount -t tmpfs -o mode=755,nosuid,nodev,noexec tmpfs "$N/sys/fs/cgroup"
    while IFS='	' read -r name fstype opts; do
        mkdir "$N/sys/fs/cgroup/$name"
        mount -t "$fstype" -o "$opts,nosuid,nodev,noexec" cgroup "$N/sys/fs/cgroup/$name"
    done < "$S/cgroups.tsv"
fi

# Binds requested by the test (e.g. the .deb files at /run/host/debs).
while IFS='	' read -r src dst mode; do
    if [ -d "$src" ]; then mkdir -p "$N$dst"; else mkdir -p "$(dirname "$N$dst")"; [ -e "$N$dst" ] || : > "$N$dst"; fi
    mount --bind "$src" "$N$dst"
    [ "$mode" = ro ] && mount -o remount,bind,ro "$N$dst"
done < "$S/binds.tsv"

# Masks, volatile journal, manager settings (as sysns-init.sh).
mkdir -p "$N/run/systemd/system" "$N/run/systemd/journald.conf.d" "$N/run/systemd/system.conf.d"
while read -r unit; do
    ln -s /dev/null "$N/run/systemd/system/$unit"
done < "$S/masks.txt"
cp "$S/journald.conf" "$N/run/systemd/journald.conf.d/harness.conf"
cp "$S/system.conf" "$N/run/systemd/system.conf.d/harness.conf"
cp "$S/machine-id" "$N/etc/machine-id"
cp "$S/hostname" "$N/etc/hostname"
hostname "$(cat "$S/hostname")"

# Detach the host root: from here on only the copy exists in this namespace
# (/proc/PID/root and nsenter see the copy too).
cd "$N"
pivot_root . .
umount -l .
cd /
exec /usr/bin/env -i container=gpuguard-pkgtest PATH=/usr/sbin:/usr/bin:/sbin:/bin \
    /lib/systemd/systemd --system --unit=basic.target --show-status=no --log-target=journal
