#!/usr/bin/env bash
# The kill storm: builds rebound, then runs bench/storm.py, which kills a driver under rebound
# every 0.2-0.8 s (5 minutes by default; fuse2fs with its recommended config) while a workload
# checks every byte, and writes bench/results/storm-* (JSON lines and a Markdown report).
# Arguments go to bench/storm.py (e.g. --seconds 60, --driver passthrough_ll). Run as root;
# idempotent. Exits non-zero unless the workload saw no error and the image is clean.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:/usr/local/go/bin:$PATH"
scripts/deps.sh
cargo build --quiet --release
tests/setup.sh
exec python3 bench/storm.py "$@"
