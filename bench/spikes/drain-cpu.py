#!/usr/bin/env python3
"""rebound's own CPU per request in fast mode, for several rebound binaries side by side:
mounts DRIVER under each binary in turn (fresh mount, rotated order, ROUNDS rounds), runs
bench/run.py's WORKLOAD three times, and prints rebound's CPU time (the run time of every one
of its threads, from /proc/PID/task/*/schedstat) divided by the requests its status counts
(in fast mode, those the observer saw end). Measures what rebound does beside the path (the
observer's drain, the tracker, its journal), apart from the workload's own noise. Run as root
after tests/setup.sh.

Usage: bench/spikes/drain-cpu.py passthrough_ll untar_checksum 4 OLD/rebound target/release/rebound"""
import glob
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))
import mounts  # noqa: E402
import run  # noqa: E402


def cpu_ns(pid):
    return sum(int(Path(f).read_text().split()[0])
               for f in glob.glob(f"/proc/{pid}/task/*/schedstat"))


def main():
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    driver, workload, rounds, binaries = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    q = run.inputs(mounts.new_workdir("drain-cpu-in"), False)
    q.update(o_direct=False, invalidate=1)
    work = mounts.new_workdir("drain-cpu")
    mounts.Mount(driver, "direct", work).prepare(1 << 30)
    results = {b: [] for b in binaries}
    for r in range(rounds):
        for b in binaries[r % len(binaries):] + binaries[:r % len(binaries)]:
            m = mounts.Mount(driver, "rebound", work, config='mode = "fast"\n', rebound=b)
            m.start()
            try:
                mounts.wait_for(lambda: mounts.rebound_ready(m.mnt), 10)
                run.settle(m.mnt)
                before = cpu_ns(m.proc.pid), mounts.mount_status(m.mnt)["requests"]
                for _ in range(3):
                    run.WORKLOADS[workload](m.mnt, q)
                # Five of the observer's 20 ms drain periods, for its last batch. (Not a poll
                # of `rebound status`: each answer costs rebound CPU, which would be counted.)
                time.sleep(0.1)
                after = cpu_ns(m.proc.pid), mounts.mount_status(m.mnt)["requests"]
            finally:
                m.stop()
            results[b].append((after[0] - before[0]) / 1000 / (after[1] - before[1]))
        print(f"round {r}:", {b: round(v[-1], 2) for b, v in results.items()}, flush=True)
    for b, values in results.items():
        print(f"{b}: median {statistics.median(values):.2f} us/request",
              [round(x, 2) for x in values])
    mounts.remove_workdir(work)


if __name__ == "__main__":
    main()
