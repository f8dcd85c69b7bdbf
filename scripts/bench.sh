#!/usr/bin/env bash
# The benchmark suite (separate from the tests): builds rebound and the fixture drivers, then
# runs bench/run.py, which measures every workload on the kernel's own file system, the driver
# mounted directly and the driver under rebound, interleaved, and writes bench/results/.
# Arguments go to bench/run.py (e.g. --quick, --reps 5, --drivers fuse2fs). Run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:/usr/local/go/bin:$PATH"
scripts/deps.sh bench
cargo build --quiet --release
tests/setup.sh
exec python3 bench/run.py "$@"
