#!/usr/bin/env python3
"""A/B: a directly mounted driver's processes in the cgroups they started in against cgroups of
their own, alternating on one mount, on a workload of bench/run.py. CONTROLLERS (cgroup v1
hierarchies under /sys/fs/cgroup, comma-separated; default cpu, as rebound gave every driver
until 2026-11-27; `memory,pids` with rebound's default limits, 1 GiB and 512 tasks, approximates
what it gives every driver now: rebound's cgroups are at the hierarchy's root, it joins cpuacct
too and sets memsw and swappiness, and tasks moved in keep the charges they had). Run as root
after tests/setup.sh.
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
q = {"size": "128M", "small_size": "16M", "runtime": 3, "files": 2000, "invalidate": True,
     "o_direct": True, "lat_samples": 2000}


def hierarchy(controller):
    """The cgroup v1 directory of this process in the hierarchy that has `controller`."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            return Path("/sys/fs/cgroup", controller, path.lstrip("/"))
    sys.exit(f"no cgroup v1 hierarchy with the {controller} controller")


# Per controller: where the driver started, and a cgroup of its own.
places = {c.strip(): (hierarchy(c.strip()), hierarchy(c.strip()) / "rebound-spike")
          for c in os.environ.get("CONTROLLERS", "cpu").split(",")}
serving = []


def move(own):
    """Every task of the driver into its own cgroups, or back where it started."""
    for start, mine in places.values():
        tids = ([t for pid in serving for t in os.listdir(f"/proc/{pid}/task")] if own
                else (mine / "tasks").read_text().split() if mine.exists() else [])
        for tid in tids:
            try:
                ((mine if own else start) / "tasks").write_text(tid)
            except ProcessLookupError:
                pass  # a thread that ended meanwhile


sshd = mounts.start_sshd() if driver == "sshfs" else None
m = mounts.Mount(driver, "direct", mounts.new_workdir("cpu-cgroup"), sshd=sshd)
try:
    for c, (_, mine) in places.items():
        mine.mkdir(exist_ok=True)
        if c in LIMITS:
            (mine / LIMITS[c][0]).write_text(LIMITS[c][1])
    m.prepare(512 * mounts.MiB)
    m.start()
    serving = [p for p in mounts.procs_mentioning(m.mnt)]
    serving += [d for p in serving for d in mounts.descendants(p)]
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
        try:
            mine.rmdir()
        except OSError as e:
            print(f"{mine} left: {e}", file=sys.stderr)
    if sshd is not None:
        sshd.stop()
