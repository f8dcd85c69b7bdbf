#!/usr/bin/env python3
"""The fast path observer's own cost: kernel BPF statistics (kernel.bpf_stats_enabled) of its
programs while fio reads 4 KiB at random from fuse2fs in fast mode. Run as root from the
repository: python3 bench/spikes/observer-cost/bpfcost.py (needs bpftool, fio, a built rebound).
"""
import os, sys, time, subprocess, json
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "e2e"))
import mounts  # noqa: E402
os.environ["REBOUND_RUN_DIR"] = str(mounts.new_workdir("exp-run"))
work = Path(mounts.new_workdir("exp"))
mounts.Mount("fuse2fs", "direct", work).prepare(2 << 30)
m = mounts.Mount("fuse2fs", "rebound", work, config='mode = "fast"\n'); m.start()
time.sleep(1)
def progs():
    out = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True).stdout
    return {p["name"]: (p.get("run_cnt", 0), p.get("run_time_ns", 0)) for p in json.loads(out) if p.get("name") in ("request_end", "forget_read")}
subprocess.run(["sysctl", "-qw", "kernel.bpf_stats_enabled=1"])
before = progs(); t0 = time.time()
out = subprocess.run(["fio", "--name=readfile", "--directory", str(work / "mnt"), "--rw=randread", "--bs=4k",
    "--size=64M", "--runtime=5", "--time_based", "--ioengine=psync", "--output-format=json"], capture_output=True, text=True).stdout
after = progs(); secs = time.time() - t0
subprocess.run(["sysctl", "-qw", "kernel.bpf_stats_enabled=0"])
job = json.loads(out[out.index("{"):])["jobs"][0]["read"]
reqs = job["total_ios"]
print("reads", reqs, "in", round(secs, 1), "s")
for k in after:
    cnt = after[k][0] - before.get(k, (0, 0))[0]; ns = after[k][1] - before.get(k, (0, 0))[1]
    print(k, "runs", cnt, "ns total", ns, "per run %.0f ns" % (ns / max(cnt, 1)), "per read %.0f ns" % (ns / max(reqs, 1)), "runs per read %.1f" % (cnt / max(reqs, 1)))
m.stop(); mounts.remove_workdir(work)
