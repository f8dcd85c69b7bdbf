#!/usr/bin/env bash
# The demo: build rebound, make an ext4 image, mount it with the unmodified, packaged fuse2fs
# under rebound, run a short workload through the mount, unmount, and check the image.
# Run as root on a fresh machine: it installs what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:/usr/local/go/bin:$PATH"
scripts/deps.sh
cargo build --release --quiet
rebound="$PWD/target/release/rebound"

work=$(mktemp -d /tmp/rebound-demo.XXXXXX)
mnt="$work/mnt"
rebound_pid=""
cleanup() {
  if mountpoint -q "$mnt" 2>/dev/null; then umount "$mnt" 2>/dev/null || umount -l "$mnt"; fi
  if [ -n "$rebound_pid" ] && kill -0 "$rebound_pid" 2>/dev/null; then kill "$rebound_pid"; wait "$rebound_pid" || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

step() { printf '\n== %s\n' "$*"; }

step "an ext4 image of 256 MiB"
truncate -s 256M "$work/disk.img"
mkfs.ext4 -q -F "$work/disk.img"
mkdir "$mnt"

step "rebound run -- fuse2fs disk.img mnt -o fakeroot"
"$rebound" run -- fuse2fs "$work/disk.img" "$mnt" -o fakeroot &
rebound_pid=$!
for _ in $(seq 100); do
  grep -q " $mnt fuse" /proc/self/mounts && break
  kill -0 "$rebound_pid" 2>/dev/null || { echo "rebound exited before mounting" >&2; exit 1; }
  sleep 0.1
done
grep " $mnt " /proc/self/mounts

step "workload: unpack /usr/include, verify every file's checksum, rename and delete half"
tar -C /usr -cf "$work/tree.tar" include
(cd /usr && find include -type f -print0 | sort -z | xargs -0 sha256sum) > "$work/expected.sha256"
tar -C "$mnt" -xf "$work/tree.tar"
(cd "$mnt" && sha256sum --quiet -c "$work/expected.sha256")
files=$(wc -l < "$work/expected.sha256")
echo "$files files verified through rebound"
find "$mnt/include" -maxdepth 1 -type d -name 'l*' -exec mv {} {}.moved \;
find "$mnt/include" -type f -name '*[02468].h' -delete
du -sh "$mnt/include"

step "unmount: rebound stops the driver and exits"
umount "$mnt"
wait "$rebound_pid"
echo "rebound exited with status $?"
rebound_pid=""

step "e2fsck -fn disk.img"
e2fsck -fn "$work/disk.img"
echo
echo "demo complete: fuse2fs served $files files through rebound; the image is clean."
