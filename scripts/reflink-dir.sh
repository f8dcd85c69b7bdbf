#!/usr/bin/env bash
# Makes DIR a directory whose files can be cloned (reflinks), for a driver's image that rebound
# checkpoints with `image = ...` (see the README's *Image checkpoints*):
#   scripts/reflink-dir.sh DIR SIZE_MIB    DIR itself if its file system clones files already
#                                          (XFS, btrfs); otherwise an XFS file system of SIZE_MIB
#                                          in DIR.xfs, loop-mounted on DIR
#   scripts/reflink-dir.sh --remove DIR    unmounts and deletes what the first form made
# Idempotent; needs root and xfsprogs (scripts/deps.sh installs it).
set -euo pipefail

if [ "${1:-}" = --remove ]; then
  dir=$2
  if mountpoint -q "$dir" 2>/dev/null; then umount "$dir" 2>/dev/null || umount -l "$dir"; fi
  rm -f "$dir.xfs"
  exit 0
fi
dir=$1 size_mib=$2
mkdir -p "$dir"
probe="$dir/.reflink-probe.$$"
: >"$probe"
if cp --reflink=always "$probe" "$probe.clone" 2>/dev/null; then
  rm -f "$probe" "$probe.clone"
  exit 0
fi
rm -f "$probe" "$probe.clone"
if mountpoint -q "$dir"; then
  echo "reflink-dir: $dir is a mount point whose file system cannot clone files" >&2
  exit 1
fi
truncate -s "${size_mib}M" "$dir.xfs"
mkfs.xfs -q -f -m reflink=1 "$dir.xfs"
mount -o loop "$dir.xfs" "$dir"
