#!/usr/bin/env bash
# The test suite: installs what it needs, then runs style checks, unit and property tests, and
# the end-to-end suites on real FUSE mounts (fuse2fs, passthrough_ll, sshfs against a local
# sshd, a go-fuse driver, a rogue driver). Run as root. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:/usr/local/go/bin:$PATH"
scripts/deps.sh

echo "== style"
cargo fmt --all -- --check
cargo clippy --quiet --all-targets -- -D warnings

echo "== unit and property tests"
cargo test --quiet --workspace

echo "== end-to-end tests"
cargo build --quiet --release
tests/setup.sh
REBOUND_BIN="$PWD/target/release/rebound" python3 -m pytest -q -p no:cacheprovider --durations=25 tests/e2e "$@"
