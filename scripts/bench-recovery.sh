#!/usr/bin/env bash
# The recovery latency benchmark: builds rebound and the fixture drivers, then runs
# bench/recovery.py, which kills each driver (fuse2fs, passthrough_ll, sshfs, go-fuse loopback)
# under rebound many times while a light workload runs, and writes bench/results/recovery-*
# (JSON lines, a Markdown table, a CDF plot). Arguments go to bench/recovery.py (e.g.
# --kills 100, --drivers fuse2fs). Run as root; idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:/usr/local/go/bin:$PATH"
scripts/deps.sh bench
cargo build --quiet --release
tests/setup.sh
exec python3 bench/recovery.py "$@"
