#!/usr/bin/env python3
"""A/B: a directly mounted driver's processes in the cpu cgroup they started in against a cpu
cgroup of their own (as rebound gave every driver until 2026-11-27), alternating, on a workload
of bench/run.py that keeps both CPUs busy. cgroup v1's cpu hierarchy at /sys/fs/cgroup/cpu; run
as root after tests/setup.sh.
Usage: bench/spikes/cpu-cgroup-contention.py [DRIVER] [WORKLOAD] [ROUNDS]
(default: sshfs metadata 6)"""
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))
import mounts  # noqa: E402
import run  # noqa: E402

driver = sys.argv[1] if len(sys.argv) > 1 else "sshfs"
workload = sys.argv[2] if len(sys.argv) > 2 else "metadata"
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 6
root = Path("/sys/fs/cgroup/cpu")
own = root / "rebound-spike"
own.mkdir(exist_ok=True)
sshd = mounts.start_sshd() if driver == "sshfs" else None
m = mounts.Mount(driver, "direct", mounts.new_workdir("cpu-cgroup"), sshd=sshd)
q = {"size": "128M", "small_size": "16M", "runtime": 3, "files": 2000, "invalidate": True,
     "o_direct": True, "lat_samples": 2000}
try:
    m.prepare(512 * mounts.MiB)
    m.start()
    serving = [p for p in mounts.procs_mentioning(m.mnt)]
    serving += [d for p in serving for d in mounts.descendants(p)]

    def move(to):
        for pid in serving:
            for tid in os.listdir(f"/proc/{pid}/task"):
                (to / "tasks").write_text(tid)

    res = {"where they were": [], "own cpu cgroup": []}
    for i in range(rounds):
        for name in (list(res) if i % 2 else list(res)[::-1]):
            move(root if name == "where they were" else own)
            out = run.WORKLOADS[workload](m.mnt, q)
            res[name].append(next(v for v in out.values() if not isinstance(v, str)))
    for name, values in res.items():
        print(f"{name:16} median {statistics.median(values):9.1f}",
              [round(v, 1) for v in values])
    paired = sorted(o / w for w, o in zip(res["where they were"], res["own cpu cgroup"]))
    print(f"own/where they were, paired: median {statistics.median(paired):.3f}",
          [round(x, 3) for x in paired], "(> 1: own is higher)")
finally:
    move(root)
    m.stop()
    m.cleanup()
    own.rmdir()
    if sshd is not None:
        sshd.stop()
