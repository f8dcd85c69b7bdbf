#!/usr/bin/env bash
# Prepares the machine for the end-to-end suite (tests/e2e): installs the drivers and tools it
# mounts with, and builds the fixture drivers into tests/.build/bin/:
#   passthrough_ll, passthrough_fh   libfuse 3's examples, from libfuse3-dev's docs
#   gofuse-loopback                  tests/fixtures/gofuse-loopback (go-fuse, via fusermount3)
#   half_rename.so                   tests/fixtures/half_rename.c (a driver dying mid-rename)
#   fuser-simple                     the `simple` example of the fuser crate (Rust), built from
#                                    its crates.io package
#   pjdfstest                        the POSIX file system conformance suite (its Rust rewrite,
#                                    from its crates.io package)
# and unpacks the C code base the benchmark compiles (bench/run.py, workload `compile`):
#   tests/.build/lua-src/            the Lua 5.1-5.4 sources of the `lua-src` crate, fetched with
#                                    cargo from crates.io (Debian ships no C code base that builds
#                                    without autotools)
# Idempotent: apt-get runs only for missing packages, builds are skipped when their output is
# newer than every source, and the crates built are kept in ~/.cache/rebound/fixtures. Run as
# root.
set -euo pipefail

tests="$(cd "$(dirname "$0")" && pwd)"
bin="$tests/.build/bin"
export PATH="/usr/local/go/bin:$HOME/go/bin:$PATH"

# --- packages ------------------------------------------------------------------------------
"$tests/../scripts/deps.sh"

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

# crate_archive CRATE VERSION: fetches CRATE=VERSION from crates.io into cargo's download cache
# (through a throw-away manifest) and prints where its archive is.
crate_archive() {
  local fetch="$tests/.build/$1-fetch"
  mkdir -p "$fetch/src"
  printf '[package]\nname = "%s-fetch"\nversion = "0.0.0"\nedition = "2021"\n\n[dependencies]\n%s = "=%s"\n\n[workspace]\n' \
    "$1" "$1" "$2" >"$fetch/Cargo.toml"
  : >"$fetch/src/lib.rs"
  cargo fetch --quiet --manifest-path "$fetch/Cargo.toml"
  rm -rf "$fetch"
  ls "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/"$1-$2.crate" | head -n 1
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

shim="$tests/fixtures/half_rename.c"
if ! up_to_date "$bin/half_rename.so" "$shim"; then
  echo "setup: building half_rename.so" >&2
  gcc -Wall -O2 -shared -fPIC -o "$bin/half_rename.so.new" "$shim" -ldl
  mv "$bin/half_rename.so.new" "$bin/half_rename.so"
fi

gofuse="$tests/fixtures/gofuse-loopback"
if ! up_to_date "$bin/gofuse-loopback" "$gofuse/main.go" "$gofuse/go.mod" "$gofuse/go.sum"; then
  echo "setup: building gofuse-loopback" >&2
  (cd "$gofuse" && go build -buildvcs=false -o "$bin/gofuse-loopback.new" .)
  mv "$bin/gofuse-loopback.new" "$bin/gofuse-loopback"
fi

# Built crates are kept per user, by crate, version and build setting, as cargo keeps what it
# downloads: a fresh checkout (CI's) copies them instead of building them again (80 of the
# 95 s this script took on one).
crate_cache="${XDG_CACHE_HOME:-$HOME/.cache}/rebound/fixtures"

# build_crate CRATE VERSION OUT ARTIFACT [CARGO ARGS...]: builds a crate from its crates.io
# archive, unmodified, with its own locked dependencies, and copies target/release/ARTIFACT to
# $bin/OUT.
build_crate() {
  local crate=$1 version=$2 out=$3 artifact=$4 archive src
  local cached key
  # What the build depends on beyond the crate: compiler, machine, cargo's arguments, and the
  # libfuse fuser links.
  key="$(rustc -V) $(uname -m) $* ${RUSTFLAGS:-} $(pkg-config --modversion fuse3 2>/dev/null || true)"
  cached="$crate_cache/$(printf '%s' "$key" | sha256sum | cut -c1-16)/$crate-$version-$out"
  shift 4
  if [ -x "$cached" ]; then
    cp "$cached" "$bin/$out"
    return
  fi
  echo "setup: building $out ($crate-$version)" >&2
  archive=$(crate_archive "$crate" "$version")
  src="$tests/.build/$crate-$version"
  rm -rf "$src"
  tar xzf "$archive" -C "$tests/.build"
  # A pinned toolchain is not needed (any stable builds it); it is no member of our workspace.
  rm -f "$src/rust-toolchain"
  printf '\n[workspace]\n' >>"$src/Cargo.toml"
  # (Its own code's warnings under a newer compiler are not ours to read.)
  (cd "$src" && RUSTFLAGS="--cap-lints=allow" cargo build --quiet --release --locked "$@")
  cp "$src/target/release/$artifact" "$bin/$out"
  rm -rf "$src"
  mkdir -p "$(dirname "$cached")"
  cp "$bin/$out" "$cached.new"
  mv "$cached.new" "$cached"
}

# A Rust driver: fuser's `simple` example (its examples ship in its archive).
if [ ! -x "$bin/fuser-simple" ]; then
  build_crate fuser 0.15.1 fuser-simple examples/simple --example simple
fi

# The POSIX conformance suite tests/e2e/test_conformance.py runs on direct and rebound mounts.
if [ ! -x "$bin/pjdfstest" ]; then
  build_crate pjdfstest 0.2.2 pjdfstest pjdfstest
fi

# The C code base of the benchmark's compile workload: the sources only (no Makefile; bench/run.py
# writes its own), from the crate's archive in cargo's download cache.
lua_crate=lua-src-547.0.0
if [ ! -d "$tests/.build/lua-src" ]; then
  echo "setup: fetching $lua_crate (C sources for the compile benchmark)" >&2
  archive=$(crate_archive lua-src "${lua_crate#lua-src-}")
  tmp=$(mktemp -d)
  tar xzf "$archive" -C "$tmp"
  mv "$tmp/$lua_crate" "$tests/.build/lua-src.new"
  rm -rf "$tmp"
  mv "$tests/.build/lua-src.new" "$tests/.build/lua-src"
fi
