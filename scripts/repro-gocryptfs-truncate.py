#!/usr/bin/env python3
"""Reproduces why gocryptfs loses data when it is killed during a truncate (the reason its
kill test is skipped in tests/e2e/test_drivers.py), under rebound, deterministically.

gocryptfs shrinks a file to a size inside a 4 KiB block in two steps: it truncates the
ciphertext file to the start of that block, then writes the block's remaining part back. The
driver is killed between the two (strace injects SIGKILL at that pwrite64). rebound sends the
truncate again to the new driver, which finds the file ending at the block boundary and grows
it: the block's remaining part reads as zeros. A direct mount loses the same data, and its
mount besides.

Run as root from a checkout after tests/setup.sh (needs strace and a built rebound):
    REBOUND_BIN=target/release/rebound scripts/repro-gocryptfs-truncate.py
It prints where the data first differs and whether the rest of the block is zeros.
"""

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "e2e"))
import mounts  # noqa: E402
from test_recovery import mount_status, toml, wait_serving  # noqa: E402

BLOCK = 4096


def all_traced(pid):
    """Whether every thread of pid has a tracer."""
    tasks = Path(f"/proc/{pid}/task")
    return all("TracerPid:\t0\n" not in (tasks / t / "status").read_text()
               for t in os.listdir(tasks))


def main():
    config = toml(restart_backoff_ms=0)
    with mounts.mount_driver("gocryptfs", "rebound", config=config) as m:
        data = os.urandom(3 * BLOCK + 1000)
        path = m.mnt / "f"
        path.write_bytes(data)
        pid = wait_serving(m)["driver_pid"]
        tracer = subprocess.Popen(["strace", "-f", "-qq", "-o", "/dev/null", "-p", str(pid),
                                   "-e", "trace=pwrite64",
                                   "-e", "inject=pwrite64:signal=SIGKILL"])
        if not mounts.wait_for(lambda: all_traced(pid), 10):
            sys.exit("strace did not attach to every thread of the driver")
        new_size = 2 * BLOCK + 500
        fd = os.open(path, os.O_RDWR)
        os.ftruncate(fd, new_size)  # the driver dies inside; rebound sends it again
        os.close(fd)
        tracer.wait(timeout=10)
        got = path.read_bytes()
        first = next((i for i, (a, b) in enumerate(zip(got, data[:new_size])) if a != b), None)
        print(f"size {len(got)} (expected {new_size}); restarts "
              f"{mount_status(m.mnt)['restarts']}")
        if first is None:
            print("the data is intact")
        else:
            zeros = set(got[first:new_size]) == {0}
            print(f"first difference at {first} (block {first // BLOCK}); "
                  f"zeros from there to the end: {zeros}")


if __name__ == "__main__":
    main()
