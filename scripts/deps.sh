#!/usr/bin/env bash
# Installs what rebound, its demo and its tests need on a fresh Debian/Ubuntu machine, as root
# (`deps.sh bench`: and what the benchmarks need besides), then has scripts/host.sh mount what
# the kernel side lacks (fusectl, a cgroup tree).
# Idempotent: packages already present are not fetched again, and `apt-get update` runs only
# when something is missing.
set -euo pipefail

packages=(fuse3 libfuse3-dev fuse2fs e2fsprogs xfsprogs sshfs openssh-server openssh-client attr fio
          gcc make pkg-config python3 python3-pytest golang-go
          # clang compiles rebound-observe's BPF program (crates/observe/build.rs).
          clang
          # The packaged drivers tests/e2e/test_drivers.py proves (and what makes their stores).
          bindfs fuse-overlayfs unionfs-fuse mergerfs gocryptfs securefs ntfs-3g squashfuse
          squashfs-tools archivemount encfs rclone lxcfs
          # The conformance suite pjdfstest links libacl.
          libacl1-dev
          # The unit is tested under a systemd of its own, in namespaces (test_systemd.py).
          systemd util-linux)
# `deps.sh bench`: also what the benchmarks plot with.
if [ "${1:-}" = bench ]; then
  packages+=(python3-matplotlib)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# A Go toolchain that is already on PATH (e.g. from go.dev) is as good as Debian's.
if command -v go >/dev/null 2>&1; then
  missing=("${missing[@]/golang-go}")
fi
# python3-pytest is only needed when pytest is not importable already.
if python3 -c 'import pytest' 2>/dev/null; then
  missing=("${missing[@]/python3-pytest}")
fi
read -r -a missing <<<"${missing[*]}"
if ((${#missing[@]})); then
  echo "deps: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# Debian's python3-pytest serves /usr/bin/python3; another python3 on PATH gets it from PyPI.
if ! python3 -c 'import pytest' 2>/dev/null; then
  echo "deps: installing pytest for $(command -v python3)" >&2
  python3 -m pip install --quiet pytest
fi

if ! command -v cargo >/dev/null 2>&1; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
  else
    echo "deps: installing Debian's Rust toolchain" >&2
    apt-get install -y -qq cargo rustc >/dev/null
  fi
fi

# The kernel side: /dev/fuse, fusectl and a cgroup tree, where the system did not provide them.
"$(dirname "$0")/host.sh"
