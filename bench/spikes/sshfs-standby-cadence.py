#!/usr/bin/env python3
"""sshfs under rebound (guarded after its first failure), killed five times with gaps of 1, 1,
0.3, 0.3 and 2 s: each recovery's latency and its spawn phase, and rebound's log of its
standbys (when each was ready and answered INIT). Shows whether a kill found a standby ready.
Run as root after tests/setup.sh: bench/spikes/sshfs-standby-cadence.py"""
import os
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "e2e"))
sys.path.insert(0, str(REPO / "bench"))
import mounts  # noqa: E402
from mounts import mount_status  # noqa: E402

sshd = mounts.start_sshd()
m = mounts.Mount("sshfs", "rebound", mounts.new_workdir("sk"), sshd=sshd, config="restart_backoff_ms = 0\nrestart_backoff_max_ms = 0\n")
try:
    m.prepare(64 * mounts.MiB); m.start()
    for gap in (1.0, 1.0, 0.3, 0.3, 2.0):
        time.sleep(gap)
        st = mount_status(m.mnt); os.kill(st["driver_pid"], signal.SIGKILL)
        mounts.wait_for(lambda: (mount_status(m.mnt) or {}).get("restarts", 0) > st["restarts"], 10)
        os.listdir(m.mnt)
    time.sleep(0.5)
    st = mount_status(m.mnt); print([round(x,1) for x in st["recovery_ms"]], [round(p.get("spawn",0),1) for p in st["recovery_phases_ms"]])
    for l in m.stderr().splitlines():
        if "standby" in l or "serving again" in l: print(l[30:200])
finally:
    m.cleanup(); sshd.stop()
