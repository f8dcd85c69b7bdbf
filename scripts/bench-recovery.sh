#!/usr/bin/env bash
# The recovery latency benchmark: builds rebound and the fixture drivers, then runs
# bench/recovery.py, which kills each driver (fuse2fs, passthrough_ll, sshfs, go-fuse loopback)
# under rebound many times while a light workload runs, and writes bench/results/recovery-*
# (JSON lines, a Markdown table, a CDF plot). Arguments go to bench/recovery.py (e.g.
# --kills 100, --drivers fuse2fs). Run as root; idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:/usr/local/go/bin:$PATH"
scripts/deps.sh
# For the plot. Debian's package serves /usr/bin/python3; bench/recovery.py plots with that
# when the python3 on PATH has no matplotlib.
if ! dpkg-query -W -f='${Status}' python3-matplotlib 2>/dev/null | grep -q "install ok installed"; then
  echo "bench-recovery: installing python3-matplotlib" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq python3-matplotlib >/dev/null 2>&1 || {
    apt-get update -qq && apt-get install -y -qq python3-matplotlib >/dev/null
  } || echo "bench-recovery: python3-matplotlib could not be installed; no plot" >&2
fi
cargo build --quiet --release
tests/setup.sh
exec python3 bench/recovery.py "$@"
