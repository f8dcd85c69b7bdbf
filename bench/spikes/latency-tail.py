#!/usr/bin/env python3
"""Latency medians and p99s of a driver mounted directly and under several rebound builds in
fast mode, one fresh mount per target per round (rotated order), each running bench/run.py's
latency workload with all its samples on that one mount. Prints each round's stat median, stat
p99 and 4 KiB read p99 per target, then per target the medians over the rounds of all four
figures. Halt polling as bench/run.py sets it. Run as root after tests/setup.sh.

Usage: bench/spikes/latency-tail.py passthrough_ll 8 NAME=REBOUND_BINARY..."""
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))
import mounts  # noqa: E402
import run  # noqa: E402


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    driver, rounds = sys.argv[1], int(sys.argv[2])
    builds = {"direct": None}
    for arg in sys.argv[3:]:
        name, _, binary = arg.partition("=")
        builds[name] = Path(binary)
    run.MOUNTS_PER_REP["latency"] = 1  # every sample on the one mount
    q = {"lat_samples": 20000}
    work = mounts.new_workdir("latency-tail")
    results = {name: [] for name in builds}
    names = list(builds)
    try:
        mounts.Mount(driver, "direct", work).prepare(1 << 30)
        with run.halt_polling(run.KERNEL_HALT_POLL_NS):
            for r in range(rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    binary = builds[name]
                    m = mounts.Mount(driver, "direct" if binary is None else "rebound", work,
                                     config=None if binary is None else 'mode = "fast"\n',
                                     rebound=binary)
                    m.start()
                    try:
                        if binary is not None:
                            run.wait_for(lambda: mounts.rebound_ready(m.mnt), 10, "ready")
                        run.settle(m.mnt)
                        results[name].append(run.w_latency(m.mnt, q))
                    finally:
                        m.stop()
                print(f"round {r}:", {n: tuple(round(v[-1][k], 1) for k in (
                    "stat_med_us", "stat_p99_us", "read4k_p99_us")) for n, v in results.items()},
                      flush=True)
    finally:
        mounts.remove_workdir(work)
    for name, rows in results.items():
        print(name, " ".join(f"{k}={statistics.median(x[k] for x in rows):.1f}" for k in rows[0]
                             if k != run.HIST))


if __name__ == "__main__":
    main()
