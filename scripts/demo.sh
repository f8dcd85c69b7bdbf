#!/usr/bin/env bash
# The demo: an unmodified, packaged FUSE driver is killed every second while applications use
# its mount through rebound, and the applications should not notice.
#
# It builds rebound, mounts fuse2fs (an ext4 image) under rebound, starts a killer that every
# second sends the serving driver SIGKILL, SIGSEGV or SIGABRT in turn, and meanwhile runs a
# workload of ordinary tools, in rounds: tar unpacks /usr/include, sha256sum checks every file,
# rm deletes half the files, mv renames every top-level entry, sha256sum checks what is left,
# and rm -r removes the rest (but the last round's). Rounds go on for about 90 s. Then it stops
# the killer, prints how often the driver died, how many errors the applications saw, how long
# recoveries took and what was lost, unmounts, and checks the image with e2fsck -fn.
#
# Exits 0 only when the applications saw no error and the data at rest is right (e2fsck clean
# for fuse2fs; for passthrough_ll, the source directory holds exactly the expected files). A
# step blocked for DEMO_STEP_TIMEOUT seconds (a request nobody answers) gets the FUSE connection
# aborted, so the demo fails instead of hanging.
#
#   scripts/demo.sh                              fuse2fs on a 256 MiB ext4 image
#   DEMO_DRIVER=passthrough_ll scripts/demo.sh   libfuse's passthrough_ll serving a directory
#   DEMO_KILL_INTERVAL=0.5 scripts/demo.sh       kill more often (seconds between kills)
#   DEMO_SECONDS=300 scripts/demo.sh             start new rounds for 300 s instead of 90
#   DEMO_ROUNDS=1 scripts/demo.sh                exactly one round (at most 10 by default)
#   DEMO_KEEP_LOGS=/tmp/logs scripts/demo.sh     keep rebound's log and the killer's record
#                                                (they are kept anyway when the demo fails)
#
# Run as root on a fresh machine: it installs what it needs, and is safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:/usr/local/go/bin:$PATH"

driver=${DEMO_DRIVER:-fuse2fs}
interval=${DEMO_KILL_INTERVAL:-1}
tree=${DEMO_TREE:-/usr/include}
max_rounds=${DEMO_ROUNDS:-10}
budget=${DEMO_SECONDS:-90}
step_timeout=${DEMO_STEP_TIMEOUT:-300}
if [ -n "${DEMO_ROUNDS:-}" ]; then budget=999999; fi
case $driver in
  fuse2fs | passthrough_ll) ;;
  *) echo "demo: DEMO_DRIVER must be fuse2fs or passthrough_ll, not '$driver'" >&2; exit 2 ;;
esac
[ "$(id -u)" = 0 ] || { echo "demo: mounts file systems; run it as root" >&2; exit 2; }

scripts/deps.sh
cargo build --release --quiet
if [ "$driver" = passthrough_ll ]; then tests/setup.sh; fi
rebound="$PWD/target/release/rebound"

work=$(mktemp -d /tmp/rebound-demo.XXXXXX)
mnt="$work/mnt"
# A control-socket directory of our own: `rebound status` then sees only this demo's mount.
export REBOUND_RUN_DIR="$work/run"
rebound_pid=""
killer_pid=""
watchdog_pid=""
conn=""
cleanup() {
  if [ -n "$watchdog_pid" ] && kill -0 "$watchdog_pid" 2>/dev/null; then kill "$watchdog_pid"; wait "$watchdog_pid" || true; fi
  if [ -n "$killer_pid" ] && kill -0 "$killer_pid" 2>/dev/null; then kill "$killer_pid"; wait "$killer_pid" || true; fi
  # Interrupted with requests blocked: abort the connection, or umount and rm could hang.
  if [ -n "$conn" ] && [ -e "$conn/abort" ] && [ "$(cat "$conn/waiting" 2>/dev/null || echo 0)" != 0 ]; then
    echo 1 >"$conn/abort" 2>/dev/null || true
  fi
  if mountpoint -q "$mnt" 2>/dev/null; then umount "$mnt" 2>/dev/null || umount -l "$mnt"; fi
  if [ -n "$rebound_pid" ] && kill -0 "$rebound_pid" 2>/dev/null; then kill "$rebound_pid"; wait "$rebound_pid" || true; fi
  if [ -d "$work/img" ]; then scripts/reflink-dir.sh --remove "$work/img"; fi
  rm -rf "$work"
}
trap cleanup EXIT

step() { printf '\n== %s\n' "$*"; }

mkdir "$mnt" "$REBOUND_RUN_DIR"
# A large restart budget and no back-off: the killer strikes every second, and every kill must
# be recovered from at once. Hangs are detected after 10 s instead of a minute.
cat >"$work/rebound.toml" <<EOF
restart_budget = 1000000
restart_window_ms = 60000
restart_backoff_ms = 0
restart_backoff_max_ms = 0
request_timeout_ms = 10000
probe_timeout_ms = 5000
on_budget_exhausted = "fail-requests"
EOF
if [ "$driver" = fuse2fs ]; then
  # Room for the tree twice (a round's tree and, briefly, the previous round's remains).
  tree_mib=$(( $(du -sm "$tree" | cut -f1) ))
  image_mib=$(( tree_mib * 3 < 256 ? 256 : tree_mib * 3 ))
  step "an ext4 image of $image_mib MiB, on a file system that can clone it"
  # The image and rebound's checkpoint of it share their blocks (reflinks: XFS or btrfs); on
  # any other file system, scripts/reflink-dir.sh makes a loop-mounted XFS for it.
  scripts/reflink-dir.sh "$work/img" $(( image_mib * 2 + 300 ))
  image="$work/img/disk.img"
  truncate -s "${image_mib}M" "$image"
  mkfs.ext4 -q -F "$image"
  # fuse2fs keeps bitmaps and other metadata in memory until it flushes: a killed fuse2fs
  # loses work it acknowledged and leaves its image inconsistent. rebound keeps a redo log of
  # what the driver acknowledged since its last checkpoint; each checkpoint also clones the
  # image, and before each restart the clone goes back over the image (consistent, no e2fsck),
  # and the log is replayed in the new driver.
  cat >>"$work/rebound.toml" <<EOF
redo_log = true
image = "$image"
checkpoint_interval_ms = 200
checkpoint_changes = 64
EOF
  driver_argv=(fuse2fs "$image" "$mnt" -o fakeroot)
else
  mkdir "$work/src"
  driver_argv=("$PWD/tests/.build/bin/passthrough_ll" -o "source=$work/src" "$mnt")
fi
sed 's/^/    /' "$work/rebound.toml"

step "rebound run --config rebound.toml -- ${driver_argv[*]/#$work\//}"
# The driver inherits this: SIGSEGV and SIGABRT must not write core files.
ulimit -c 0
"$rebound" run --config "$work/rebound.toml" -- "${driver_argv[@]}" 2>"$work/rebound.log" &
rebound_pid=$!
for _ in $(seq 100); do
  grep -q " $mnt fuse" /proc/self/mounts && break
  kill -0 "$rebound_pid" 2>/dev/null || { echo "rebound exited before mounting:" >&2; cat "$work/rebound.log" >&2; exit 1; }
  sleep 0.1
done
grep " $mnt " /proc/self/mounts
# The mount's FUSE connection (fusectl names it by the kernel's dev_t: major << 20 | minor).
dev=$(awk -v m="$mnt" '$5 == m { print $3 }' /proc/self/mountinfo | tail -n 1)
conn="/sys/fs/fuse/connections/$(( (${dev%%:*} << 20) | ${dev##*:} ))"

# The killer: every INTERVAL seconds, if the mount is being served, send its driver the next
# of SIGKILL, SIGSEGV, SIGABRT, and wait until rebound has noticed. It gathers the recovery
# latencies from `rebound status --json` as they appear (status keeps the last 100) and, when
# told to stop, writes what it did to a JSON file.
cat >"$work/killer.py" <<'EOF'
import json, os, signal, subprocess, sys, threading, time
rebound, mnt, interval, out = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
SIGNALS = [signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT]

def status():
    try:
        res = subprocess.run([rebound, "status", "--json"], capture_output=True, text=True,
                             timeout=10)
        return next((m for m in json.loads(res.stdout) if m["mountpoint"] == mnt), None)
    except (subprocess.SubprocessError, ValueError):
        return None

prev, latencies = [], []
def gather(st):
    """Appends the latencies in st that were not in the previous list (a sliding window)."""
    global prev
    cur = st["recovery_ms"]
    for new in range(len(cur) + 1):
        dropped = len(prev) + new - len(cur)
        if dropped >= 0 and cur[:len(cur) - new] == prev[dropped:]:
            break
    latencies.extend(cur[len(cur) - new:])
    prev = cur

sent, effective, missed, by_signal, last, max_redo = 0, 0, 0, {}, None, 0
while not stop.wait(interval):
    st = status()
    if st is None:
        continue
    gather(st)
    last = st
    max_redo = max(max_redo, st.get("redo_log_entries", 0))
    if st["state"] != "serving" or not st["driver_pid"]:
        continue
    sig = SIGNALS[sent % len(SIGNALS)]
    try:
        os.kill(st["driver_pid"], sig)
    except ProcessLookupError:
        continue
    sent += 1
    # A kill counts when rebound sees the driver fail (a daemonizing driver's parent may
    # still hold the pid a moment after the daemon took over).
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        now = status()
        if now is not None and now["failures"] > st["failures"]:
            effective += 1
            by_signal[sig.name] = by_signal.get(sig.name, 0) + 1
            break
        time.sleep(0.01)
    else:
        missed += 1

# Make sure the last recovery has served a request, so its latency is recorded.
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    st = status()
    if st is not None and st["state"] == "serving":
        try:
            os.listdir(mnt)
        except OSError as e:
            print(f"killer: listing {mnt}: {e}", file=sys.stderr)
        time.sleep(0.2)
        break
    time.sleep(0.1)
st = status() or last
if st is not None:
    gather(st)
json.dump({"sent": sent, "effective": effective, "missed": missed, "by_signal": by_signal,
           "latencies": latencies, "status": st, "max_redo_log_entries": max_redo},
          open(out, "w"))
EOF

# --- the workload: each tool's errors are counted, none is hidden -------------------------
# The watchdog: a step still running at its deadline is blocked on a request nobody answers;
# aborting the FUSE connection fails that request (and every later one) with ENOTCONN.
watchdog() {
  while sleep 1; do
    if [ -s "$work/deadline" ] && [ "$EPOCHSECONDS" -gt "$(cat "$work/deadline")" ]; then
      echo "   !! a step is blocked for more than $step_timeout s: aborting the FUSE connection" >&2
      touch "$work/aborted"
      echo 1 >"$conn/abort"
      return
    fi
  done
}
# begin: a step starts; it has step_timeout seconds. False when the demo cannot go on: the
# mount is gone (the workload would write into the directory under it) or was aborted.
begin() {
  echo $((EPOCHSECONDS + step_timeout)) >"$work/deadline"
  if [ -e "$work/aborted" ]; then return 1; fi
  if ! grep -q " $mnt fuse" /proc/self/mounts; then
    echo "   !! $mnt is not mounted any more"
    errors["mount gone"]=1
    return 1
  fi
}
declare -A errors=()
failed_output="$work/failures.txt"
: >"$failed_output"
# record NAME COUNT STATUS LOG: COUNT errors of step NAME (at least 1 if it exited non-zero),
# shown with the first lines of LOG.
record() {
  local name=$1 count=$2 status=$3 log=$4
  if [ "$status" -ne 0 ] && [ "$count" -eq 0 ]; then count=1; fi
  errors[$name]=$((${errors[$name]:-0} + count))
  if [ "$count" -gt 0 ]; then
    echo "   !! $name: $count error(s), exit status $status:"
    head -5 "$log" | sed 's/^/      /'
    { echo "--- $name (exit $status)"; cat "$log"; } >>"$failed_output"
  else
    echo "   $name: ok"
  fi
}
# Drops the page cache of every file under $1, so that checksums read through the driver.
evict() {
  local st=0
  begin || return 1
  python3 - "$1" <<'EOF' 2>"$work/evict.err" || st=$?
import os, sys
errors = 0
for root, dirs, files in os.walk(sys.argv[1], onerror=lambda e: print(e, file=sys.stderr)):
    for name in files:
        path = os.path.join(root, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        except OSError as e:
            if not os.path.islink(path):
                print(e, file=sys.stderr)
EOF
  record "evict (python open)" "$(wc -l <"$work/evict.err")" "$st" "$work/evict.err"
}
# verify DIR LIST: sha256sum -c of LIST in DIR.
verify() {
  local st=0
  begin || return 1
  (cd "$1" && sha256sum --quiet -c "$2") >"$work/sum.out" 2>"$work/sum.err" || st=$?
  cat "$work/sum.err" >>"$work/sum.out"
  record "sha256sum -c ($(wc -l <"$2") files)" "$(grep -c 'FAILED' "$work/sum.out" || true)" "$st" "$work/sum.out"
}

step "the tree to copy: $tree"
tar -C "$(dirname "$tree")" -cf "$work/tree.tar" "$(basename "$tree")"
top=$(basename "$tree")
(cd "$(dirname "$tree")" && find "$top" -type f -print0 | sort -z | xargs -0 sha256sum) >"$work/expected.sha256"
files=$(wc -l <"$work/expected.sha256")
echo "$files files, $(du -sh "$tree" | cut -f1)"
# Afterwards: every second file deleted, every top-level entry renamed to NAME.moved.
awk 'NR % 2 == 0' "$work/expected.sha256" | sed -E "s#^([0-9a-f]+  $top/[^/]+)#\1.moved#" >"$work/after.sha256"
awk 'NR % 2 == 1' "$work/expected.sha256" | sed -E 's/^[0-9a-f]+  //' | tr '\n' '\0' >"$work/delete.list"
sed -E 's/^[0-9a-f]+  //' "$work/after.sha256" | sort >"$work/wanted.txt"

step "killer: every ${interval} s, SIGKILL / SIGSEGV / SIGABRT the serving driver"
python3 "$work/killer.py" "$rebound" "$mnt" "$interval" "$work/killer.json" &
killer_pid=$!
started=$EPOCHREALTIME
started_s=$EPOCHSECONDS

# One round, in directory $mnt/N: unpack, verify, delete every second file, rename every
# top-level entry, verify again, check nothing deleted is left. False if the demo cannot go on.
workload_round() {
  local dir="$mnt/$1" st entry entries=0 mv_failed=0
  begin || return 1
  st=0
  mkdir "$dir" 2>"$work/mkdir.err" || st=$?
  if [ "$st" != 0 ]; then record "mkdir" 1 "$st" "$work/mkdir.err"; fi
  st=0
  tar -C "$dir" -xf "$work/tree.tar" 2>"$work/tar.err" || st=$?
  record "tar -x ($files files)" "$(grep -vc 'Exiting with failure status' "$work/tar.err" || true)" "$st" "$work/tar.err"
  evict "$dir/$top" || return 1
  verify "$dir" "$work/expected.sha256" || return 1

  begin || return 1
  st=0
  (cd "$dir" && xargs -0 rm -- <"$work/delete.list") 2>"$work/rm.err" || st=$?
  record "rm ($(tr -cd '\0' <"$work/delete.list" | wc -c) files)" "$(grep -c '^rm:' "$work/rm.err" || true)" "$st" "$work/rm.err"

  begin || return 1
  : >"$work/mv.err"
  for entry in "$dir/$top"/*; do
    entries=$((entries + 1))
    mv -- "$entry" "$entry.moved" 2>>"$work/mv.err" || mv_failed=$((mv_failed + 1))
  done
  record "mv ($entries top-level entries)" "$mv_failed" 0 "$work/mv.err"

  evict "$dir/$top" || return 1
  verify "$dir" "$work/after.sha256" || return 1
  # Nothing that was deleted or renamed away may still be there.
  begin || return 1
  (cd "$dir" && find "$top" -type f | sort) >"$work/present.txt" 2>"$work/find.err" || true
  comm -23 "$work/present.txt" "$work/wanted.txt" >"$work/extra.txt"
  cat "$work/find.err" >>"$work/extra.txt"
  record "find (no deleted or renamed-away file left)" "$(wc -l <"$work/extra.txt")" 0 "$work/extra.txt"
}

watchdog &
watchdog_pid=$!
round=0
while :; do
  round=$((round + 1))
  step "workload round $round, while the driver is being killed"
  workload_round "$round" || break
  # Another round if time is left; the tree of the last round stays for the final checks.
  if [ "$round" -ge "$max_rounds" ] || [ $((EPOCHSECONDS - started_s)) -ge "$budget" ]; then
    break
  fi
  begin || break
  st=0
  rm -r -- "${mnt:?}/$round" 2>"$work/rm.err" || st=$?
  record "rm -r (the rest)" "$(grep -c '^rm:' "$work/rm.err" || true)" "$st" "$work/rm.err"
done
rm -f "$work/deadline"
kill "$watchdog_pid" 2>/dev/null || true
wait "$watchdog_pid" 2>/dev/null || true
watchdog_pid=""
hung=0
if [ -e "$work/aborted" ]; then
  hung=1
  errors["blocked step (connection aborted)"]=1
fi
elapsed=$(python3 -c "print($EPOCHREALTIME - $started)")

step "stop the killer"
kill "$killer_pid"
wait "$killer_pid" || { echo "the killer failed" >&2; exit 1; }
killer_pid=""

step "unmount: rebound stops the driver and exits"
if grep -q " $mnt " /proc/self/mounts; then
  umount "$mnt" || umount -l "$mnt"
else
  echo "$mnt is not mounted any more"
fi
rebound_status=0
wait "$rebound_pid" || rebound_status=$?
rebound_pid=""
echo "rebound exited with status $rebound_status"

if [ "$driver" = fuse2fs ]; then
  step "e2fsck -fn disk.img"
  at_rest=0
  e2fsck -fn "$image" >"$work/fsck.out" 2>&1 || at_rest=$?
  tail -n 25 "$work/fsck.out"
  at_rest_what="e2fsck -fn of the image"
else
  step "the source directory, without the driver: exactly the expected files"
  at_rest=0
  (cd "$work/src/$round" && sha256sum --quiet -c "$work/after.sha256") >"$work/at-rest.out" 2>&1 || at_rest=1
  (cd "$work/src/$round" && find "$top" -type f | sort) 2>&1 | cmp -s - "$work/wanted.txt" || { echo "the source directory holds other files than expected" >>"$work/at-rest.out"; at_rest=1; }
  if [ "$at_rest" != 0 ]; then head -n 20 "$work/at-rest.out"; else echo "all $(wc -l <"$work/after.sha256") files as expected"; fi
  at_rest_what="checksums and file list of the source directory"
fi

# --- the summary ---------------------------------------------------------------------------
total_errors=0
for k in "${!errors[@]}"; do total_errors=$((total_errors + errors[$k])); done
python3 - "$work/killer.json" "$driver" "$interval" "$elapsed" "$total_errors" "$round" <<'EOF'
import json, sys
k = json.load(open(sys.argv[1]))
driver, interval, elapsed, errors = sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
rounds = sys.argv[6]
st = k["status"] or {}
lat = sorted(k["latencies"])
def rank(p):
    return lat[min(len(lat) - 1, max(0, -(-len(lat) * p // 100) - 1))]
sigs = ", ".join(f"{n} {c}" for n, c in sorted(k["by_signal"].items()))
print(f"\n== summary: {driver} under rebound, killed every {interval} s for {elapsed:.0f} s "
      f"({rounds} workload rounds)")
print(f"  driver killed           {k['effective']} times ({sigs or 'none'})"
      + (f"; {k['missed']} signals hit no serving driver" if k["missed"] else ""))
extra = st.get("failures", 0) - k["effective"]
print(f"  rebound saw             {st.get('failures', '?')} failures, "
      f"restarted the driver {st.get('restarts', '?')} times"
      + (f" ({extra} failures were not the killer's)" if extra > 0 else ""))
causes = st.get("failures_by_cause") or {}
if causes:
    print("  failures by cause       " + ", ".join(f"{n} {c}" for c, n in sorted(causes.items()))
          + "  (crash: killed or died; during_restore: a new driver that failed before serving)")
phases = st.get("recovery_phases_ms") or []
if phases:
    names = [p for p in ("reap", "backoff", "rollback", "pre_restart", "spawn", "init", "replay", "restore",
                         "first_request") if any(p in x for x in phases)]
    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2]
    print("  recovery phases, median " + ", ".join(
        f"{p} {median([x[p] for x in phases if p in x]):.1f}" for p in names)
          + f" ms (last {len(phases)})")
print(f"  errors in applications  {errors}")
if lat:
    print(f"  recovery latency        {len(lat)} recoveries: median {rank(50):.1f} ms, "
          f"p99 {rank(99):.1f} ms, max {lat[-1]:.1f} ms")
else:
    print("  recovery latency        no recovery measured")
if st.get("redo_log_entries") is not None and k.get("max_redo_log_entries"):
    print(f"  redo log                at most {k['max_redo_log_entries']} changes waiting for a "
          "checkpoint (seen at each kill)")
print(f"  objects lost            {st.get('lost_objects', '?')} "
      f"(nodes or open files rebound could not restore)")
print(f"  requests served         {st.get('requests', '?')}")
EOF
for k in "${!errors[@]}"; do
  if [ "${errors[$k]}" -gt 0 ]; then echo "    $k: ${errors[$k]}"; fi
done
echo "  $at_rest_what: $([ "$at_rest" = 0 ] && echo clean || echo "NOT CLEAN (status $at_rest)")"
echo "  rebound's errors and warnings, counted (numbers shown as N):"
sed 's/\x1b\[[0-9;]*m//g' "$work/rebound.log" | grep -E '^[^ ]+ +(ERROR|WARN) ' \
  | sed -E 's/^[^ ]+ +(ERROR|WARN) +/\1 /; s#'"$work"'/?##g; s/[0-9]+(\.[0-9]+)?/N/g' \
  | sort | uniq -c | sort -rn | head -n 12 | sed 's/^/    /' || true
echo "  rebound exit status     $rebound_status"

kills=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["effective"])' "$work/killer.json")
echo
verdict=0
if [ "$hung" = 1 ]; then
  echo "FAIL: an application was blocked for more than $step_timeout s on a request nobody answered; the FUSE connection was aborted"
  verdict=1
fi
if [ "$total_errors" -gt 0 ]; then
  echo "FAIL: applications saw $total_errors error(s) while $driver was being killed (details above)"
  verdict=1
fi
if [ "$at_rest" != 0 ]; then
  echo "FAIL: $at_rest_what is not clean"
  verdict=1
fi
if [ "$rebound_status" != 0 ]; then
  echo "FAIL: rebound exited with status $rebound_status"
  tail -n 20 "$work/rebound.log"
  verdict=1
fi
if [ "$kills" -eq 0 ]; then
  echo "FAIL: the killer never killed the driver; the demo showed nothing"
  verdict=1
fi
keep_logs() {
  mkdir -p "$1"
  for f in failures.txt rebound.log rebound.toml killer.json fsck.out at-rest.out; do
    if [ -e "$work/$f" ]; then cp "$work/$f" "$1/"; fi
  done
  echo "logs (every failed operation, rebound's log, the killer's record): $1"
}
if [ "$verdict" = 0 ]; then
  echo "PASS: $driver was killed $kills times; the applications saw no error, and the data is intact."
  if [ -n "${DEMO_KEEP_LOGS:-}" ]; then keep_logs "$DEMO_KEEP_LOGS"; fi
else
  # The work directory goes away; what explains the failure stays.
  keep_logs "${DEMO_KEEP_LOGS:-$(mktemp -d /tmp/rebound-demo-failed.XXXXXX)}"
fi
exit "$verdict"
