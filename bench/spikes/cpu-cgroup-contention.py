#!/usr/bin/env python3
"""A/B: a directly mounted driver's processes in the cgroups they started in against cgroups of
their own, alternating on one mount, on a workload of bench/run.py. CONTROLLERS (cgroup v1
hierarchies under /sys/fs/cgroup, comma-separated; default cpu, as rebound gave every driver
until 2026-11-27; `memory,pids` is what rebound gives every driver now, with its default
limits: 1 GiB and 512 tasks). Run as root after tests/setup.sh.
Usage: [CONTROLLERS=memory,pids] bench/spikes/cpu-cgroup-contention.py [DRIVER] [WORKLOAD]
       [ROUNDS]   (default: sshfs metadata 6)"""
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
LIMITS = {"memory": ("memory.limit_in_bytes", str(1 << 30)), "pids": ("pids.max", "512")}
controllers = os.environ.get("CONTROLLERS", "cpu").split(",")
# Per controller: where the driver started, and a cgroup of its own.
places = {}
for c in controllers:
    here = Path(f"/proc/{os.getpid()}/cgroup").read_text()
    rel = next(line.split(":", 2)[2] for line in here.splitlines()
               if c in line.split(":")[1].split(","))
    start = Path(f"/sys/fs/cgroup/{c}") / rel.strip().lstrip("/")
    places[c] = (start, start / "rebound-spike")
    places[c][1].mkdir(exist_ok=True)
    if c in LIMITS:
        (places[c][1] / LIMITS[c][0]).write_text(LIMITS[c][1])
sshd = mounts.start_sshd() if driver == "sshfs" else None
m = mounts.Mount(driver, "direct", mounts.new_workdir("cpu-cgroup"), sshd=sshd)
q = {"size": "128M", "small_size": "16M", "runtime": 3, "files": 2000, "invalidate": True,
     "o_direct": True, "lat_samples": 2000}
try:
    m.prepare(512 * mounts.MiB)
    m.start()
    serving = [p for p in mounts.procs_mentioning(m.mnt)]
    serving += [d for p in serving for d in mounts.descendants(p)]

    def move(own):
        for start, mine in places.values():
            for pid in serving:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    ((mine if own else start) / "tasks").write_text(tid)

    res = {"where they were": [], "own cgroups": []}
    for i in range(rounds):
        for name in (list(res) if i % 2 else list(res)[::-1]):
            move(name != "where they were")
            out = run.WORKLOADS[workload](m.mnt, q)
            res[name].append(next(v for v in out.values() if not isinstance(v, str)))
    for name, values in res.items():
        print(f"{name:16} median {statistics.median(values):9.1f}",
              [round(v, 1) for v in values])
    paired = sorted(o / w for w, o in zip(res["where they were"], res["own cgroups"]))
    print(f"own/where they were, paired: median {statistics.median(paired):.3f}",
          [round(x, 3) for x in paired], "(> 1: own is higher)")
finally:
    move(False)
    m.stop()
    m.cleanup()
    for _, mine in places.values():
        mine.rmdir()
    if sshd is not None:
        sshd.stop()
