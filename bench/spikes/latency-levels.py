#!/usr/bin/env python3
"""How a stat's latency moves between mounts and within one: mounts the driver directly
MOUNTS times afresh (as bench/run.py mounts each target) and, on each, runs bench/run.py's
latency loop (stat, drop the page, read 4 KiB) in CHUNKS chunks of 1,000, printing the median
stat of each chunk. A level that holds within a mount and differs between mounts is what
bench/run.py's MOUNTS_PER_REP is for. Halt polling as bench/run.py sets it. Run as root after
tests/setup.sh.

With `fast` after the arguments, the driver is mounted under rebound in fast mode instead.

Usage: bench/spikes/latency-levels.py passthrough_ll 6 10 [fast]"""
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))
import mounts  # noqa: E402
import run  # noqa: E402


def chunk_medians(path, chunks, size=1000):
    fd = os.open(path, os.O_RDONLY)
    try:
        out = []
        for _ in range(chunks):
            xs = []
            for i in range(size):
                t = time.perf_counter_ns()
                os.stat(path)
                xs.append((time.perf_counter_ns() - t) / 1000)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.pread(fd, 4096, (i * 4096) % (1 << 20))
            out.append(statistics.median(xs))
        return out
    finally:
        os.close(fd)


def main():
    if len(sys.argv) not in (4, 5) or sys.argv[4:] not in ([], ["fast"]):
        sys.exit(__doc__)
    driver, n_mounts, chunks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    fast = sys.argv[4:] == ["fast"]
    work = mounts.new_workdir("latency-levels")
    sshd = mounts.start_sshd() if driver == "sshfs" else None
    try:
        mounts.Mount(driver, "direct", work, sshd=sshd).prepare(1 << 30)
        with run.halt_polling(run.KERNEL_HALT_POLL_NS):
            for k in range(n_mounts):
                m = mounts.Mount(driver, "rebound" if fast else "direct", work, sshd=sshd,
                                 config='mode = "fast"\n' if fast else None)
                m.start()
                try:
                    if fast:
                        run.wait_for(lambda: mounts.rebound_ready(m.mnt), 10, "rebound ready")
                    run.settle(m.mnt)
                    f = m.mnt / "lat"
                    f.write_bytes(os.urandom(1 << 20))
                    levels = chunk_medians(f, chunks)
                    f.unlink()
                finally:
                    m.stop()
                print(f"mount {k}: " + " ".join(f"{x:.1f}" for x in levels)
                      + f"  (median {statistics.median(levels):.1f} µs)", flush=True)
    finally:
        if sshd is not None:
            sshd.stop()
        mounts.remove_workdir(work)


if __name__ == "__main__":
    main()
