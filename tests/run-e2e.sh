#!/usr/bin/env bash
# Runs the end-to-end suite: tests/setup.sh (packages and fixture drivers), then pytest on
# tests/e2e with any arguments passed through, e.g.
#   tests/run-e2e.sh -m direct          # only the drivers mounted directly (no rebound needed)
#   tests/run-e2e.sh -k sshfs -x        # one driver, stop at the first failure
#   tests/run-e2e.sh --all-drivers      # the packaged drivers' long kill storms (test_drivers.py)
# The rebound binary is $REBOUND_BIN, by default target/release/rebound (build it first).
set -euo pipefail
cd "$(dirname "$0")/.."
tests/setup.sh
if [ "${1:-}" = --all-drivers ]; then
  shift
  export REBOUND_ALL_DRIVERS=1
  exec python3 -m pytest -q -s tests/e2e/test_drivers.py "$@"
fi
exec python3 -m pytest -q tests/e2e "$@"
