#!/usr/bin/env python3
"""Time from `rebound run` to a fast-mode mount that answers: passthrough_ll mounted N times by
each rebound binary given, the binaries rotated each round; prints the median and each time.

    bench/spikes/startup-time.py N REBOUND_BIN...

Each start is timed until the mount point is a FUSE mount in the mount table and a stat of it
returns, then the mount is unmounted and rebound waited for. Needs tests/setup.sh's
passthrough_ll. (2026-11-29: 0.191 s before the observer was loaded ahead of the driver, 0.154
s after, 6 starts each.)
"""
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PASSTHROUGH_LL = Path(__file__).resolve().parents[2] / "tests/.build/bin/passthrough_ll"


def mounted(mnt):
    with open("/proc/self/mounts") as table:
        return any(f[1] == mnt and f[2].startswith("fuse")
                   for f in (line.split() for line in table))


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    rounds, binaries = int(sys.argv[1]), sys.argv[2:]
    times = {b: [] for b in binaries}
    with tempfile.TemporaryDirectory(prefix="rebound-startup-") as work:
        src, mnt, config = f"{work}/src", f"{work}/mnt", f"{work}/fast.toml"
        os.mkdir(src)
        os.mkdir(mnt)
        Path(config).write_text('mode = "fast"\n')
        for r in range(rounds):
            for b in binaries[r % len(binaries):] + binaries[:r % len(binaries)]:
                start = time.monotonic()
                proc = subprocess.Popen([b, "run", "--config", config, "--", str(PASSTHROUGH_LL),
                                         "-o", f"source={src}", mnt],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                deadline = start + 20
                while not mounted(mnt):
                    if time.monotonic() > deadline or proc.poll() is not None:
                        proc.kill()
                        sys.exit(f"{b} did not mount")
                    time.sleep(0.002)
                os.stat(mnt)
                times[b].append(time.monotonic() - start)
                subprocess.run(["fusermount3", "-u", mnt], check=True)
                proc.wait(timeout=30)
    for b, t in times.items():
        print(f"{b}: median {statistics.median(t):.3f} s ({' '.join(f'{x:.3f}' for x in t)})")


if __name__ == "__main__":
    main()
