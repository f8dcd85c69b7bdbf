#!/usr/bin/env python3
"""The driver's own CPU per request, side by side: mounts a driver directly and under rebound
in each of the given variants, interleaved for ROUNDS rounds, runs 4 s of 4 KiB random reads
at queue depth 16 (fio, libaio, O_DIRECT) and prints, per target, the throughput and the
driver process's CPU time (`perf stat -e task-clock`) per request. A driver that is the
bottleneck of a workload (fuse2fs serves one request at a time) slows down by exactly what is
added to its own path: seccomp at its system calls, the observer's programs in its write(2).

Variants are NAME=CONFIG (the text of rebound's config file, `\\n` for newlines) or
NAME=CONFIG@BINARY (another rebound build). Run as root after tests/setup.sh.

Usage: bench/spikes/driver-cpu.py fuse2fs 3 'fast=mode = "fast"' \\
           'sandbox-off=mode = "fast"\\n[sandbox]\\nprofile = "off"'"""
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "e2e"))
os.environ.setdefault("REBOUND_BIN", str(REPO / "target/release/rebound"))
import mounts  # noqa: E402


def measure(driver, work, config, binary):
    kind = "direct" if config is None else "rebound"
    m = mounts.Mount(driver, kind, work, config=config, rebound=binary)
    m.start()
    try:
        if kind == "rebound":
            mounts.wait_for(lambda: mounts.rebound_ready(m.mnt), 10)
            pid = mounts.mount_status(m.mnt)["driver_pid"]
        else:
            pid = m.driver_pids[0]  # (fuse2fs, passthrough_ll: one process)
        if not (m.mnt / "readfile").exists():
            subprocess.run(["fio", "--name=w", f"--filename={m.mnt}/readfile", "--rw=write",
                            "--bs=1M", "--size=128M"], capture_output=True, check=True)
        time.sleep(1.5)
        perf = subprocess.Popen(["perf", "stat", "-x,", "-e", "task-clock", "-p", str(pid)],
                                stderr=subprocess.PIPE, text=True)
        out = subprocess.run(
            ["fio", "--name=r", f"--filename={m.mnt}/readfile", "--rw=randread", "--bs=4k",
             "--size=128M", "--runtime=4", "--time_based", "--ioengine=libaio",
             "--iodepth=16", "--direct=1", "--output-format=json"],
            capture_output=True, text=True, check=True).stdout
        perf.send_signal(2)
        err = perf.communicate()[1]
        read = json.loads(out[out.index("{"):])["jobs"][0]["read"]
        cpu_ms = next(float(line.split(",")[0]) for line in err.splitlines()
                      if line.split(",")[2:3] == ["task-clock"])
        return read["bw"] / 1024, cpu_ms * 1e3 / read["total_ios"]
    finally:
        m.stop()  # (not cleanup(): it removes the work directory all targets share)


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    driver, rounds = sys.argv[1], int(sys.argv[2])
    targets = {"direct": (None, None)}
    for arg in sys.argv[3:] or ['rebound=mode = "fast"']:
        name, _, spec = arg.partition("=")
        config, _, binary = spec.partition("@")
        targets[name] = (config.replace("\\n", "\n") + "\n", binary or None)
    work = mounts.new_workdir("driver-cpu")
    mounts.Mount(driver, "direct", work).prepare(512 << 20)
    results = {name: [] for name in targets}
    names = list(targets)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            results[name].append(measure(driver, work, *targets[name]))
        print(f"round {r}:", {n: f"{v[-1][0]:.0f} MiB/s, {v[-1][1]:.2f} us" for n, v in
                              results.items()}, flush=True)
    base = statistics.median(bw for bw, _ in results["direct"])
    for name, values in results.items():
        bw = statistics.median(v[0] for v in values)
        cpu = statistics.median(v[1] for v in values)
        print(f"{name}: {bw:.0f} MiB/s ({bw / base:.3f} of direct), "
              f"driver CPU {cpu:.2f} us/request")
    mounts.remove_workdir(work)


if __name__ == "__main__":
    main()
