#!/usr/bin/env python3
"""How a stat's latency moves between mounts and within one, and the floor it returns to: for
ROUNDS rounds, mounts the driver afresh once per target (directly, and under rebound once per
NAME=CONFIG variant, rotated order) and runs bench/run.py's latency loop (stat, drop the page,
read 4 KiB) on each in CHUNKS chunks of 1,000, printing the median stat of each chunk.

A mount starts slow and reaches its floor after some thousand rounds; after it, episodes of a
slower level come and go. So per mount, its floor: the lower quartile of its chunk medians
after the first WARM_CHUNKS; per target at the end, the median of its mounts' floors and their
ratio to direct's (> 1 is faster), paired by round. Floors differing by a few tenths of a µs
show in a few rounds, where medians over whole measurements need dozens.

CONFIG is the text of rebound's config file (`\\n` for newlines), e.g. fast='mode = "fast"';
CONFIG@BINARY mounts with another rebound build.
Halt polling as bench/run.py sets it. Run as root after tests/setup.sh.

Usage: bench/spikes/latency-levels.py passthrough_ll 6 20 [NAME=CONFIG...]"""
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

WARM_CHUNKS = 5


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


def floor(levels):
    after = sorted(levels[WARM_CHUNKS:]) or sorted(levels)
    return after[len(after) // 4]


def measure(driver, work, sshd, config, binary, chunks):
    m = mounts.Mount(driver, "direct" if config is None else "rebound", work, sshd=sshd,
                     config=config, rebound=binary)
    m.start()
    try:
        if config is not None:
            run.wait_for(lambda: mounts.rebound_ready(m.mnt), 10, "rebound status: ready")
        run.settle(m.mnt)
        f = m.mnt / "lat"
        f.write_bytes(os.urandom(1 << 20))
        levels = chunk_medians(f, chunks)
        f.unlink()
        return levels
    finally:
        m.stop()


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    driver, rounds, chunks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    targets = {"direct": (None, None)}
    for arg in sys.argv[4:]:
        name, _, spec = arg.partition("=")
        config, _, binary = spec.partition("@")
        targets[name] = (config.replace("\\n", "\n") + "\n", Path(binary) if binary else None)
    names = list(targets)
    floors = {name: [] for name in names}
    work = mounts.new_workdir("latency-levels")
    sshd = mounts.start_sshd() if driver == "sshfs" else None
    try:
        mounts.Mount(driver, "direct", work, sshd=sshd).prepare(1 << 30)
        with run.halt_polling(run.KERNEL_HALT_POLL_NS):
            for r in range(rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    levels = measure(driver, work, sshd, *targets[name], chunks)
                    floors[name].append(floor(levels))
                    print(f"round {r} {name}: " + " ".join(f"{x:.1f}" for x in levels)
                          + f"  (floor {floors[name][-1]:.2f} µs)", flush=True)
    finally:
        if sshd is not None:
            sshd.stop()
        mounts.remove_workdir(work)
    for name in names:
        ratios = [d / x for x, d in zip(floors[name], floors["direct"])]
        print(f"{name}: floor median {statistics.median(floors[name]):.2f} µs, /direct paired "
              f"median {statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f})")


if __name__ == "__main__":
    main()
