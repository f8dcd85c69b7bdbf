#!/usr/bin/env python3
"""Kill storm: a driver under rebound killed every 0.2-0.8 s, whatever it is doing (serving,
or being restored after the last kill), while a file-level workload checks every byte.

Owns: the storm (SIGKILL, SIGSEGV, SIGABRT at seeded random intervals, sent to the driver
rebound names in its status), the workload, sampling the redo log's size, and writing JSON
lines and a Markdown report. Recovery must keep making progress whenever kills are further
apart than one recovery, and the redo log must stay bounded.

    bench/storm.py [--driver fuse2fs] [--seconds 300] [--seed 1] [--out bench/results]

The workload (one thread): over and over, pick one of 300 names in one directory and
write it anew (open with O_TRUNC, one write of 100 B, 5 KB or 70 KB); every 7th time unlink
it, every 11th read it back. Any failed call, and any read that does not return what was
last written (also in a final read of every file), is an error. fuse2fs runs with its
recommended config (redo_log, image checkpoints on a file system with reflinks); after a
clean stop, e2fsck -fn must find the image clean.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests" / "e2e"))
import chaos  # noqa: E402  (tests/e2e/chaos.py)
import mounts  # noqa: E402  (tests/e2e/mounts.py)
from recovery import config, percentile  # noqa: E402  (bench/recovery.py)
from mounts import mount_status  # noqa: E402
from run import REPO, machine_meta, wait_for  # noqa: E402

SIGNALS = (signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT)
NAMES = 300
SIZES = (100, 5000, 70000)


class Workload(threading.Thread):
    """Rewrites, unlinks and reads back files in one directory until stopped."""

    def __init__(self, root, seed):
        super().__init__(daemon=True)
        self.root, self.rng = root, random.Random(seed)
        self.expect = {}
        self.stop = threading.Event()
        self.ops = 0
        self.errors = []

    def run(self):
        i = 0
        while not self.stop.is_set():
            i += 1
            path = self.root / f"w{self.rng.randrange(NAMES)}"
            data = self.rng.randbytes(self.rng.choice(SIZES))
            try:
                path.write_bytes(data)
                self.expect[path] = data
                if i % 7 == 0:
                    path.unlink()
                    del self.expect[path]
                elif i % 11 == 0 and path.read_bytes() != data:
                    self.errors.append(f"{path.name}: read back differs")
                self.ops += 1
            except OSError as e:
                self.errors.append(f"{path.name}: {e}")

    def verify_all(self):
        for path, data in self.expect.items():
            try:
                if path.read_bytes() != data:
                    self.errors.append(f"{path.name}: differs at the end")
            except OSError as e:
                self.errors.append(f"{path.name} at the end: {e}")


def storm(driver, seconds, seed):
    """Runs the storm; returns the result row."""
    rng = random.Random(seed)
    m = mounts.Mount(driver, "rebound", mounts.new_workdir(f"storm-{driver}"),
                     watchdog=seconds + 600, reflink=driver == "fuse2fs")
    m.config = config(driver, m)
    row = {"driver": driver, "seconds": seconds, "seed": seed, "kills": 0, "missed": 0}
    try:
        m.prepare(256 * mounts.MiB)
        m.start()
        wait_for(lambda: (mount_status(m.mnt) or {}).get("state") == "serving", 30,
                 "the first mount")
        rebound_pid = mount_status(m.mnt)["rebound_pid"]
        (m.mnt / "storm").mkdir()
        load = Workload(m.mnt / "storm", seed)
        load.start()
        redo_seen = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(rng.uniform(0.2, 0.8))
            st = mount_status(m.mnt) or {}
            redo_seen.append(st.get("redo_log_entries", 0))
            pid = st.get("driver_pid")
            sig = rng.choice(SIGNALS)
            if pid and chaos.signal_descendant(pid, rebound_pid, sig):
                row["kills"] += 1
            else:
                row["missed"] += 1
        load.stop.set()
        load.join()
        wait_for(lambda: (mount_status(m.mnt) or {}).get("state") == "serving", 60,
                 "serving after the storm")
        load.verify_all()
        st = mount_status(m.mnt)
        lat = st.get("recovery_ms") or []
        row.update({
            "workload_ops": load.ops, "workload_errors": len(load.errors),
            "error_samples": load.errors[:10], "files_at_end": len(load.expect),
            "restarts": st["restarts"], "failures": st["failures"],
            "failures_by_cause": st.get("failures_by_cause", {}),
            "redo_log_max": st.get("redo_log_max"), "redo_log_sampled_max": max(redo_seen or [0]),
            "checkpoints": st.get("checkpoints"), "checkpoint_ms_max": st.get("checkpoint_ms_max"),
            "recovery_ms_last100": lat, "lost_objects": st["lost_objects"],
        })
        m.stop()
        row["rebound_exit"] = m.returncode
        if mounts.DRIVERS[driver][1] == "image":
            ok, report = mounts.e2fsck(m.img)
            row["e2fsck_clean"] = ok
            if not ok:
                row["e2fsck_report"] = report[-2000:]
    except Exception as e:  # noqa: BLE001 - recorded in the row, and the run fails
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        row["rebound_log"] = m.stderr().splitlines()[-60:]
    finally:
        m.cleanup()
    return row


def report(row, meta, command):
    lat = row.get("recovery_ms_last100") or [0.0]
    causes = ", ".join(f"{n} {c}" for c, n in sorted(row.get("failures_by_cause", {}).items()))
    ok = (not row.get("error") and row.get("workload_errors") == 0
          and row.get("e2fsck_clean", True) and row.get("rebound_exit") == 0)
    return "\n".join([
        f"# Kill storm: {row['driver']}, {row['seconds']} s",
        "",
        f"Run: {meta['date']} (commit {meta['commit']}). Machine: {meta['cpu_model']}, "
        f"{meta['cpus']} CPUs, kernel {meta['kernel']}.",
        "",
        f"Command: `{command}`",
        "",
        "| kills | failures (by cause) | restarts | workload ops | workload errors | "
        "redo log max | checkpoints (longest ms) | recovery median / p99 ms (last 100) | "
        "e2fsck -fn | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| {row['kills']} | {row.get('failures')} ({causes}) | {row.get('restarts')} | "
        f"{row.get('workload_ops')} | **{row.get('workload_errors')}** | "
        f"{row.get('redo_log_max')} | {row.get('checkpoints')} "
        f"({row.get('checkpoint_ms_max')}) | {percentile(lat, 50):.1f} / "
        f"{percentile(lat, 99):.1f} | "
        f"{'clean' if row.get('e2fsck_clean') else row.get('e2fsck_clean')} | "
        f"{'PASS' if ok else 'FAIL'} |",
        "",
        *(f"- {e}" for e in row.get("error_samples", [])),
        *([f"- error: {row['error']}"] if row.get("error") else []),
        "",
    ]), ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--driver", default="fuse2fs", choices=sorted(mounts.DRIVERS))
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args()
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit,
            **machine_meta()}
    row = storm(args.driver, args.seconds, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = meta["date"].replace(":", "")
    (out / f"storm-{args.driver}-{stamp}.jsonl").write_text(
        json.dumps({"meta": meta, **row}) + "\n")
    command = "bench/storm.py " + " ".join(sys.argv[1:])
    text, ok = report(row, meta, command.strip())
    (out / f"storm-{args.driver}-latest.md").write_text(text)
    print(text)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
