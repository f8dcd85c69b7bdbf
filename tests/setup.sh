#!/usr/bin/env bash
# Prepares the machine for the end-to-end suite (tests/e2e): installs the drivers and tools it
# mounts with, and builds the fixture drivers into tests/.build/bin/:
#   passthrough_ll, passthrough_fh   libfuse 3's examples, from libfuse3-dev's docs
#   gofuse-loopback                  tests/fixtures/gofuse-loopback (go-fuse, via fusermount3)
# Idempotent: apt-get runs only for missing packages, and builds are skipped when their output
# is newer than every source. Run as root.
set -euo pipefail

tests="$(cd "$(dirname "$0")" && pwd)"
bin="$tests/.build/bin"
export PATH="/usr/local/go/bin:$HOME/go/bin:$PATH"

# --- packages ------------------------------------------------------------------------------
packages=(fuse3 libfuse3-dev fuse2fs sshfs openssh-server openssh-client e2fsprogs attr fio
          gcc pkg-config)
command -v go >/dev/null 2>&1 || packages+=(golang-go)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ! python3 -c 'import pytest' 2>/dev/null; then
  # Debian's package serves /usr/bin/python3; another python3 on PATH gets pytest from PyPI below.
  missing+=(python3-pytest)
fi
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! python3 -c 'import pytest' 2>/dev/null; then
  echo "setup: installing pytest for $(command -v python3)" >&2
  python3 -m pip install --quiet pytest
fi
[ -e /dev/fuse ] || { echo "setup: /dev/fuse is missing (modprobe fuse)" >&2; exit 1; }

# --- builds --------------------------------------------------------------------------------
mkdir -p "$bin"

# up_to_date OUT SRC...: true when OUT exists and is newer than every SRC.
up_to_date() {
  local out=$1 src
  shift
  [ -e "$out" ] || return 1
  for src in "$@"; do
    [ "$out" -nt "$src" ] || return 1
  done
}

examples=/usr/share/doc/libfuse3-dev/examples
# What libfuse's own build defines on glibc Linux; without them passthrough_fh has no utimens
# and no xattrs. (HAVE_LIBULOCKMGR stays off: Debian does not ship libulockmgr.)
declare -A defines=(
  [passthrough_ll]="-DHAVE_FALLOCATE -DHAVE_COPY_FILE_RANGE"
  [passthrough_fh]="-DHAVE_SETXATTR -DHAVE_UTIMENSAT -DHAVE_POSIX_FALLOCATE -DHAVE_FSTATAT -DHAVE_COPY_FILE_RANGE"
)
for prog in passthrough_ll passthrough_fh; do
  src="$examples/$prog.c"
  [ -e "$src" ] || src="$src.gz"   # some releases ship the examples compressed
  if ! up_to_date "$bin/$prog" "$src" "$examples/passthrough_helpers.h" "$tests/setup.sh"; then
    echo "setup: building $prog" >&2
    tmp=$(mktemp -d)
    if [[ $src == *.gz ]]; then
      gunzip -c "$src" >"$tmp/$prog.c"
    else
      cp "$src" "$tmp/$prog.c"
    fi
    cp "$examples/passthrough_helpers.h" "$tmp/"
    # shellcheck disable=SC2046,SC2086  # several words on purpose
    gcc -Wall -O2 ${defines[$prog]} -o "$bin/$prog.new" "$tmp/$prog.c" \
      $(pkg-config fuse3 --cflags --libs) -lpthread
    mv "$bin/$prog.new" "$bin/$prog"
    rm -rf "$tmp"
  fi
done

gofuse="$tests/fixtures/gofuse-loopback"
if ! up_to_date "$bin/gofuse-loopback" "$gofuse/main.go" "$gofuse/go.mod" "$gofuse/go.sum"; then
  echo "setup: building gofuse-loopback" >&2
  (cd "$gofuse" && go build -buildvcs=false -o "$bin/gofuse-loopback.new" .)
  mv "$bin/gofuse-loopback.new" "$bin/gofuse-loopback"
fi
