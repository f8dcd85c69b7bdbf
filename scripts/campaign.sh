#!/usr/bin/env bash
# The fault-injection campaign (issue 4): builds rebound and the fixture drivers, then runs
# bench/campaign.py once per driver (each under the e2e lock, so other test runs can go in
# between) and renders one report over all of them: bench/results/campaign-latest.md with
# its charts, the raw results in bench/results/campaign-<driver>-<seed>.jsonl.
# Environment: DRIVERS (default "fuse2fs passthrough_ll sshfs"), PER_TYPE (trials per code
# fault type, default 50), PER_TYPE_OTHER (kill, hang, leak, corrupt; default 10), FAULTS
# (per code-fault trial, default 5, as in Nooks), SEED (default 1). Run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:/usr/local/go/bin:$PATH"
drivers=${DRIVERS:-fuse2fs passthrough_ll sshfs}
per_type=${PER_TYPE:-50}
per_other=${PER_TYPE_OTHER:-10}
faults=${FAULTS:-5}
seed=${SEED:-1}
out=bench/results
cargo build --quiet --release
# The campaign runs the binary of this commit even if target/ is rebuilt meanwhile.
snapshot=$(mktemp -d /tmp/rebound-campaign-bin.XXXXXX)
trap 'rm -rf "$snapshot"' EXIT
cp target/release/rebound "$snapshot/rebound"
export REBOUND_BIN="$snapshot/rebound"
REBOUND_COMMIT=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates || echo "+changes")
export REBOUND_COMMIT
flock /tmp/rebound-e2e.lock tests/setup.sh
files=()
for d in $drivers; do
  f="$out/campaign-$d-$seed.jsonl"
  flock /tmp/rebound-e2e.lock python3 bench/campaign.py --drivers "$d" --per-type "$per_type" \
    --per-type-other "$per_other" --faults "$faults" --seed "$seed" --out "$out" \
    --jsonl "$f" --no-report
  files+=("$f")
done
python3 bench/campaign.py --out "$out" --report "${files[@]}" \
  --command "DRIVERS=\"$drivers\" PER_TYPE=$per_type PER_TYPE_OTHER=$per_other FAULTS=$faults SEED=$seed scripts/campaign.sh"
