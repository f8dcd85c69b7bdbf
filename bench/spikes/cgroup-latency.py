#!/usr/bin/env python3
"""A/B: the `stat` latency of a directly mounted passthrough_ll (bench/run.py's latency
workload), its threads in the root cpu cgroup against a cpu cgroup of their own (as rebound
gives every driver), alternating. cgroup v1's cpu hierarchy at /sys/fs/cgroup/cpu; run as root
after tests/setup.sh. Usage: bench/spikes/cgroup-latency.py [ROUNDS]"""
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))
import run  # noqa: E402

w = Path("/tmp/cgroup-latency"); subprocess.run(["umount", "-l", str(w / "mnt")], capture_output=True)
subprocess.run(["rm", "-rf", str(w)]); (w / "src").mkdir(parents=True); (w / "mnt").mkdir()
p = subprocess.Popen([str(REPO / "tests/.build/bin/passthrough_ll"), "-f", "-o", f"source={w/'src'}", str(w / "mnt")])
run.wait_for(lambda: run.mounts.is_fuse_mounted(w / "mnt"), 10, "the mount")
cg = Path("/sys/fs/cgroup/cpu/abtest"); cg.mkdir(exist_ok=True)
def move(to):
    for t in os.listdir(f"/proc/{p.pid}/task"):
        (to / "tasks").write_text(t)
res = {"root": [], "own": []}
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 8):
    for name, to in (("root", Path("/sys/fs/cgroup/cpu")), ("own", cg))[:: 1 if i % 2 else -1]:
        move(to)
        r = run.w_latency(w / "mnt", {"lat_samples": 2000})
        res[name].append(r["stat_med_us"])
for k, v in res.items():
    print(k, "median of medians %.1f" % statistics.median(v), [round(x, 1) for x in v])
move(Path("/sys/fs/cgroup/cpu")); cg.rmdir()
subprocess.run(["umount", str(w / "mnt")]); p.wait()
