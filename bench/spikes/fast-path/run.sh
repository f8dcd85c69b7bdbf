#!/usr/bin/env bash
# Reproduces the fast-path spike of bench/results/fast-path-spike-2026-11-25.md: BPF
# observation of a FUSE mount (what it sees, what it costs) and a driver on a clone of the
# kernel's queue whose requests outlive it. As root; needs clang, libbpf-dev, bpftool and the
# tests' passthrough_ll (tests/setup.sh builds it).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
pt=${PASSTHROUGH_LL:-$here/../../../tests/.build/bin/passthrough_ll}
work=$(mktemp -d /var/tmp/rebound-spike.XXXXXX)
trap 'umount -l "$work/mnt" 2>/dev/null || true' EXIT
mkdir -p "$work/src" "$work/mnt"
head -c 8192 /dev/urandom >"$work/src/f"
cd "$work"
bpftool btf dump file /sys/kernel/btf/vmlinux format c >vmlinux.h
read -r lo hi < <(sort /proc/kallsyms | awk '$3 == "fuse_dev_do_read" {lo = $1; next} lo && !hi {hi = $1; print lo, hi}')
clang -O2 -g -target bpf -D__TARGET_ARCH_x86 -I. -c "$here/observe.bpf.c" -o observe.bpf.o
clang -O2 -g -target bpf -D__TARGET_ARCH_x86 -I. -DFUSE_DEV_DO_READ_LO="0x${lo}ULL" \
  -DFUSE_DEV_DO_READ_HI="0x${hi}ULL" -c "$here/forget.bpf.c" -o forget.bpf.o
gcc -O2 "$here/load.c" -o load -lbpf

echo "== stat latency of passthrough_ll, unobserved vs observed (4 pairs)"
"$pt" -o source="$work/src",timeout=0 "$work/mnt"
for _ in 1 2 3 4; do
  echo -n "unobserved: "; python3 "$here/statlat.py" "$work/mnt/f" 20000
  ./load observe.bpf.o 4 2>events.txt >/dev/null & sleep 0.5
  echo -n "observed:   "; python3 "$here/statlat.py" "$work/mnt/f" 20000
  wait; grep events events.txt
done
echo "== what the observer sees of a lookup, and the forgets at a cache drop"
PRINT=1 ./load observe.bpf.o 2 >seen.txt 2>/dev/null & sleep 0.5
mkdir -p "$work/mnt/d"; stat "$work/mnt/d/absent" 2>/dev/null || true; wait
grep "op 1 " seen.txt | tail -3
for i in 1 2 3; do echo x >"$work/mnt/g$i"; done
PRINT=1 ./load forget.bpf.o 2 >forgets.txt 2>/dev/null & sleep 0.5
ls "$work/mnt" >/dev/null; rm "$work/mnt"/g*; echo 2 >/proc/sys/vm/drop_caches; wait
echo "forgets seen: $(grep -c "op 2 " forgets.txt)"
umount "$work/mnt"

echo "== a driver on a clone of the queue: killed with a request taken, then RESEND"
python3 "$here/queue.py" "$pt" "$work"
echo "== the same driver mounted directly vs on a held clone"
python3 "$here/speed.py" "$pt" "$work"
