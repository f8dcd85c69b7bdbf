#!/usr/bin/env python3
"""What the observer's BPF programs cost per run: mounts passthrough_ll under rebound in fast
mode, runs bench/run.py's latency workload (N samples, default 2000: a stat and a 4 KiB read
each) and prints each program's runs and ns per run from /proc/PID/fdinfo of rebound's
program descriptors. Needs `sysctl kernel.bpf_stats_enabled=1` (which itself adds ~30-40 ns
to each run); run as root after tests/setup.sh. Usage: N=5000 bench/spikes/observer-cost.py"""
import os, sys, subprocess, time
from pathlib import Path
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench")); sys.path.insert(0, str(REPO / "tests" / "e2e"))
os.environ.setdefault("REBOUND_BIN", str(REPO / "target/release/rebound"))
import mounts, run
work = mounts.new_workdir("observer-cost")
m = mounts.Mount("passthrough_ll", "rebound", work, config='mode = "fast"\n')
m.prepare(64 << 20); m.start(); run.settle(m.mnt)
def progs():
    out = {}
    for fd in os.listdir(f"/proc/{m.proc.pid}/fdinfo"):
        t = Path(f"/proc/{m.proc.pid}/fdinfo/{fd}").read_text()
        if "prog_type" in t:
            d = dict(l.split(":\t",1) for l in t.strip().splitlines() if ":\t" in l)
            out[int(d["prog_id"])] = (int(d.get("run_time_ns", 0)), int(d.get("run_cnt", 0)))
    # Program ids follow the load order, which is crates/observe's PROGRAMS order.
    return dict(zip(("request_send", "request_end", "forget_read (kfree)"),
                    (out[i] for i in sorted(out))))
b = progs(); t0=time.time()
r = run.w_latency(m.mnt, {"lat_samples": int(os.environ.get("N", 2000))})
a = progs(); dt=time.time()-t0
print({k: round(v, 1) for k, v in r.items()}, f"{dt:.2f} s")
for name in a:
    runs, ns = a[name][1] - b[name][1], a[name][0] - b[name][0]
    print(f"{name:22} {runs:7} runs {ns / max(1, runs):6.0f} ns/run")
print("data path:", (mounts.mount_status(m.mnt) or {}).get("data_path"))
m.stop(); m.cleanup()
