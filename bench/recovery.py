#!/usr/bin/env python3
"""Recovery latency: how long a mount pauses when rebound restarts its killed driver.

Owns: mounting each driver under rebound with a restart-friendly config, a light steady
workload on a tree of small files the kernel holds, killing the driver (SIGKILL) a number of
times, collecting rebound's own recovery latencies (`rebound status --json`, `recovery_ms`:
from failure detection to the first request the new driver served), the reference point (a
plain unmount + remount of the same driver mounted directly, timed the same way), and writing
JSON lines, a Markdown table and a CDF plot.

    bench/recovery.py [--drivers fuse2fs,passthrough_ll,sshfs,gofuse]
                      [--kills 30 | --kills passthrough_ll=1000,fuse2fs=200,...]
                      [--remounts 100] [--settle 0.2] [--files 3000] [--out bench/results]
                      [--fresh 20]   (also: fresh mounts killed once each, see below)
    bench/recovery.py --report bench/results/recovery-*.jsonl   (table and plot again)

The workload (one thread): over and over, on a random file of the tree, stat it, read it
after dropping its cached pages and compare with what was last written, and rewrite it with
new content; a short sleep between operations keeps it light. Every error it sees and every
content mismatch counts as a failure; after the kills it reads every file back once more.
Between kills the script waits until the mount is served again and its recovery latency has
been recorded, then lets the workload run for a moment.

The recovery out of fast mode happens once per mount, at its first failure (the mount is
guarded from then on), so `--fresh N` also mounts each driver N more times and kills each
once: those latencies are reported apart, with the data path each kill found.

Mounting, the drivers' command lines and the private sshd come from tests/e2e/mounts.py; the
polling helper, the rebound binary and its status from bench/run.py.
"""

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests" / "e2e"))
import mounts  # noqa: E402  (tests/e2e/mounts.py)
from mounts import mount_status  # noqa: E402
from run import (REPO, load, machine_meta, plot_with_matplotlib,  # noqa: E402  (bench/run.py)
                 wait_for)

DRIVERS = ("fuse2fs", "passthrough_ll", "sshfs", "gofuse")
# Also measurable (not by default): the packaged drivers of tests/e2e/test_drivers.py.
MORE_DRIVERS = ("bindfs", "mergerfs", "unionfs", "fuse-overlayfs", "gocryptfs", "securefs",
                "ntfs-3g", "encfs", "rclone", "fuser")
LABELS = {"gofuse": "go-fuse loopback"}
FILE_SIZE = 1024


def config(driver, m):
    """Restart at once, as often as needed; fuse2fs, which loses acknowledged work when
    killed, gets its recommended config (as the README says): the redo log, and image
    checkpoints on a file system that can clone the image."""
    text = ("restart_budget = 1000000\nrestart_window_ms = 60000\n"
            "restart_backoff_ms = 0\nrestart_backoff_max_ms = 0\n")
    if driver == "fuse2fs":
        text += (f'redo_log = true\nimage = "{m.img}"\ncheckpoint_interval_ms = 200\n'
                 'checkpoint_changes = 64\n')
    if driver == "rclone":  # see tests/e2e/test_drivers.py's DRIVER_CONFIG
        text += 'standby = "off"\n'
    return text


def content(i, gen):
    head = f"file {i} generation {gen}\n".encode()
    return head + bytes((i + gen + k) % 251 for k in range(FILE_SIZE - len(head)))


class Workload(threading.Thread):
    """stat / read-and-compare / rewrite of random files in a loop, until stopped."""

    def __init__(self, root, n):
        super().__init__(daemon=True)
        self.root, self.n = root, n
        self.gen = [0] * n
        self.stop = threading.Event()
        self.ops = 0
        self.errors = []  # (when it ended, seconds it took, what went wrong)
        self.slow = []  # (start, seconds) of operations longer than 2 ms

    def path(self, i):
        return self.root / f"d{i % 50:02d}" / f"f{i:05d}"

    def populate(self):
        for d in range(min(50, self.n)):
            (self.root / f"d{d:02d}").mkdir(parents=True, exist_ok=True)
        for i in range(self.n):
            self.path(i).write_bytes(content(i, 0))
        for i in range(self.n):  # the kernel now holds a node for each
            os.stat(self.path(i))

    def read_check(self, i):
        fd = os.open(self.path(i), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            data = os.read(fd, 2 * FILE_SIZE)
        finally:
            os.close(fd)
        if data != content(i, self.gen[i]):
            return (f"read {self.path(i).name}: content mismatch "
                    f"(expected generation {self.gen[i]}, got {data[:30]!r})")
        return None

    def op(self, kind, i):
        """One operation; what went wrong, or None."""
        step = ("stat", "read", "rewrite: open(O_TRUNC)")[kind]
        try:
            if kind == 0:
                os.stat(self.path(i))
            elif kind == 1:
                return self.read_check(i)
            else:
                fd = os.open(self.path(i), os.O_WRONLY | os.O_TRUNC)
                try:
                    step = "rewrite: write"
                    os.write(fd, content(i, self.gen[i] + 1))
                    step = "rewrite: close"
                finally:
                    os.close(fd)
                self.gen[i] += 1
        except OSError as e:
            return f"{step} {self.path(i).name}: {e.strerror}"
        return None

    def run(self):
        rng = random.Random(1)
        while not self.stop.is_set():
            i = rng.randrange(self.n)
            start = time.monotonic()
            error = self.op(self.ops % 3, i)
            took = time.monotonic() - start
            if error:
                self.errors.append((start + took, took, error))
            if took > 0.002:
                self.slow.append((start, took))
            self.ops += 1
            time.sleep(0.001)

    def verify_all(self):
        for i in range(self.n):
            start = time.monotonic()
            try:
                error = self.read_check(i)
            except OSError as e:
                error = f"read {self.path(i).name}: {e}"
            if error:
                self.errors.append((time.monotonic(), time.monotonic() - start,
                                    "final check: " + error))


class Latencies:
    """Recovery latencies as they appear in the status's `recovery_ms` (the last 100 only),
    and the phases of each (`recovery_phases_ms`, in the same order)."""

    def __init__(self):
        self.prev, self.all, self.phases = [], [], []

    def gather(self, st):
        if st is None:
            return
        cur = st["recovery_ms"]
        for new in range(len(cur) + 1):
            dropped = len(self.prev) + new - len(cur)
            if dropped >= 0 and cur[:len(cur) - new] == self.prev[dropped:]:
                break
        self.all.extend(cur[len(cur) - new:])
        phases = st.get("recovery_phases_ms") or []
        if len(phases) == len(cur):
            self.phases.extend(phases[len(cur) - new:])
        self.prev = cur


def percentile(xs, p):
    """Nearest-rank percentile of a non-empty list."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, -(-len(xs) * p // 100) - 1))]


def measure(driver, args, sshd):
    """Mounts driver under rebound, kills it args.kills[driver] times; returns the result
    row."""
    kills = args.kills[driver]
    m = mounts.Mount(driver, "rebound", mounts.new_workdir(f"recovery-{driver}"), sshd=sshd,
                     watchdog=3600.0, reflink=driver == "fuse2fs")
    m.config = config(driver, m)
    row = {"driver": driver, "kills": 0, "missed_kills": 0}
    try:
        m.prepare(256 * mounts.MiB)
        m.start()
        load = Workload(m.mnt / "tree", args.files)
        load.populate()
        lat = Latencies()
        nodes, kill_times, paths = [], [], []
        load.start()

        def serving_again():
            """Waits until the driver serves again after every kill so far, and then (briefly)
            until the latency of the last recovery is recorded: the workload's next request
            records it."""
            def serving():
                st = mount_status(m.mnt)
                return (st and st["state"] == "serving" and st["restarts"] >= row["kills"]
                        and st["driver_pid"] and mounts.alive(st["driver_pid"]))
            wait_for(serving, 60, f"{driver} serving again after kill {row['kills']}")

            def measured():
                lat.gather(mount_status(m.mnt))
                return len(lat.all) >= row["kills"]
            mounts.wait_for(measured, 5)

        while row["kills"] < kills and row["missed_kills"] < kills:
            serving_again()
            time.sleep(args.settle)
            st = mount_status(m.mnt)
            lat.gather(st)
            nodes.append(st["nodes"])
            paths.append(st.get("data_path", ""))
            kill_times.append(time.monotonic())
            os.kill(st["driver_pid"], signal.SIGKILL)
            seen = mounts.wait_for(
                lambda: (mount_status(m.mnt) or st)["failures"] > st["failures"], 10,
                interval=0.005)
            if seen:
                row["kills"] += 1
            else:
                row["missed_kills"] += 1  # the pid was not the serving driver; try again
                kill_times.pop()
        serving_again()
        time.sleep(args.settle)
        load.stop.set()
        load.join()
        load.verify_all()
        st = mount_status(m.mnt)
        lat.gather(st)
        # What the application saw around each kill: its longest operation that overlaps the
        # time from the kill to the next one (at most 5 s).
        ends = [min(t + 5, nxt) for t, nxt in zip(kill_times, kill_times[1:] + [float("inf")])]
        stalls = [max([took * 1000 for start, took in load.slow
                       if start + took >= t and start <= end] or [0.0])
                  for t, end in zip(kill_times, ends)]
        row.update({
            "restarts": st["restarts"], "failures": st["failures"],
            "lost_objects": st["lost_objects"], "requests": st["requests"],
            "workload_ops": load.ops, "workload_errors": len(load.errors),
            "error_samples": [explain(e, kill_times) for e in load.errors[:10]],
            "nodes_median": sorted(nodes)[len(nodes) // 2] if nodes else None,
            "recovery_ms": lat.all, "recovery_phases_ms": lat.phases, "stall_ms": stalls,
            "standby_takeovers": st.get("standby_takeovers", 0), "data_paths": paths,
            "failures_by_cause": st.get("failures_by_cause", {}),
            "redo_log_max": st.get("redo_log_max"),
            "checkpoints": st.get("checkpoints"), "checkpoint_ms_max": st.get("checkpoint_ms_max"),
        })
        m.stop()
        row["rebound_exit"] = m.returncode
        row["rebound_says"] = log_kinds(m.stderr(), m.work)
        if load.errors or m.returncode:
            # What rebound said beyond the kills and the recoveries, to explain the errors.
            log = [line for line in m.stderr().splitlines()
                   if ("WARN" in line or "ERROR" in line) and not KILLED.search(line)]
            row["rebound_log"] = log[-60:]
        if args.keep_logs:
            Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
            (Path(args.keep_logs) / f"{driver}.log").write_text(m.stderr())
        if mounts.DRIVERS[driver][1] == "image":
            ok, report = mounts.e2fsck(m.img)
            row["e2fsck_clean"] = ok
            if not ok:
                row["e2fsck_report"] = report[-2000:]
    except Exception as e:  # recorded, not fatal: the table shows the gap
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        row["rebound_log"] = m.stderr().splitlines()[-60:]
    finally:
        m.cleanup()
    return row


def fresh_recoveries(driver, args, sshd):
    """args.fresh mounts of driver, each killed once: the first failure's recovery (out of
    fast mode where the mount starts fast). Returns the fields for the driver's row."""
    once = argparse.Namespace(**{**vars(args), "kills": {driver: 1}})
    got = {"fresh_recovery_ms": [], "fresh_stall_ms": [], "fresh_data_paths": [],
           "fresh_workload_errors": 0, "fresh_errors": []}
    for _ in range(args.fresh):
        row = measure(driver, once, sshd)
        if "error" in row:
            got["fresh_errors"].append(row["error"][:300])
            continue
        got["fresh_recovery_ms"] += row["recovery_ms"][:1]
        got["fresh_stall_ms"] += row["stall_ms"][:1]
        got["fresh_data_paths"] += row["data_paths"][:1]
        got["fresh_workload_errors"] += row["workload_errors"]
    return got


def remount_reference(driver, args, sshd):
    """The reference point: the driver mounted directly, unmounted with `umount` and mounted
    again with its own command line, args.remounts times. Each cycle is timed from the `umount`
    to the first request the new mount served (a stat of a file in it), including the wait for
    the old driver to exit (fuse2fs writes its image then); polls every millisecond. Returns
    the fields of the result row: remount_ms, or remount_error."""
    if args.remounts <= 0:
        return {}
    m = mounts.Mount(driver, "direct", mounts.new_workdir(f"remount-{driver}"), sshd=sshd)
    times = []
    try:
        m.prepare(256 * mounts.MiB)
        m.start()
        probe = m.mnt / "probe"
        probe.write_bytes(b"probe")
        argv = m.argv()
        serving = list(mounts.procs_mentioning(m.mnt))
        for _ in range(args.remounts):
            start = time.monotonic()
            subprocess.run(["umount", str(m.mnt)], check=True, capture_output=True, timeout=60)
            if not mounts.wait_for(lambda: not any(mounts.alive(p) for p in serving), 60,
                                   interval=0.001):
                raise RuntimeError(f"{driver} still running 60 s after its unmount")
            with open(m.work / "stderr", "ab") as log:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                        start_new_session=True)
            if not mounts.wait_for(lambda: mounts.is_fuse_mounted(m.mnt)
                                   or proc.poll() not in (None, 0), 60, interval=0.001) \
                    or not mounts.is_fuse_mounted(m.mnt):
                raise RuntimeError(f"{driver} did not mount again: {m.stderr()[-500:]}")
            os.stat(probe)
            times.append((time.monotonic() - start) * 1000)
            serving = list(mounts.procs_mentioning(m.mnt))  # not timed
            if proc.poll() is None and proc.pid not in serving:
                proc.wait(timeout=30)  # a daemonizing driver's parent
        return {"remount_ms": times}
    except Exception as e:  # recorded, not fatal: the table shows the gap
        return {"remount_ms": times, "remount_error": f"{type(e).__name__}: {e}"[:1000]}
    finally:
        m.cleanup()


# How rebound reports a driver that was killed.
KILLED = re.compile(r"failed: driver (closed its channel|process gone)")


def log_kinds(log, work):
    """rebound's errors and warnings, counted by kind (numbers and paths left out)."""
    kinds = {}
    for line in re.sub(r"\x1b\[[0-9;]*m", "", log).splitlines():
        m = re.match(r"\S+\s+(ERROR|WARN)\s+(.*)", line)
        if m:
            text = re.sub(r"\d+(\.\d+)?", "N", m.group(2).replace(str(work), "WORK"))
            kind = f"{m.group(1)} {text}"
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def explain(error, kill_times):
    """An error of the workload, with when it happened relative to the kills."""
    end, took, what = error
    before = [k for k, t in enumerate(kill_times) if t <= end - took]
    when = (f"started {end - took - kill_times[before[-1]]:.2f} s after kill {before[-1] + 1}"
            if before else "started before the first kill")
    return f"{what} (took {took * 1000:.0f} ms, {when})"


def fmt(x):
    return "-" if x is None else f"{x:.1f}"


def table(rows):
    lines = ["| driver | kills | failures | restarts | workload errors | median ms | p90 ms | "
             "p99 ms | max ms | app stall median / max ms | nodes held | lost objects | "
             "plain remount: n, median / p99 ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in rows:
        name = LABELS.get(r["driver"], r["driver"])
        if "error" in r:
            notes.append(f"- **{name} failed**: {r['error']}")
            continue
        lat, stall = r["recovery_ms"], r["stall_ms"]
        q = (lambda p: percentile(lat, p)) if lat else (lambda p: None)
        lines.append(
            f"| {name} | {r['kills']} | {r['failures']} | {r['restarts']} | "
            f"**{r['workload_errors']}** | "
            f"**{fmt(q(50))}** | {fmt(q(90))} | {fmt(q(99))} | {fmt(max(lat) if lat else None)}"
            f" | {fmt(percentile(stall, 50) if stall else None)} / "
            f"{fmt(max(stall) if stall else None)} | {r['nodes_median']} | "
            f"{r['lost_objects']} | {remount_cell(r)} |")
        if r.get("remount_error"):
            notes.append(f"- {name}: the plain remounts stopped: `{r['remount_error']}`")
        if len(lat) != r["kills"]:
            notes.append(f"- {name}: {len(lat)} latencies recorded for {r['kills']} kills.")
        if r["workload_errors"]:
            notes.append(f"- {name}: the workload saw {r['workload_errors']} errors, e.g. "
                         + "; ".join(f"`{e}`" for e in r["error_samples"][:3]))
        unusual = {k: n for k, n in r.get("rebound_says", {}).items()
                   if not KILLED.search(k)}
        if unusual:
            notes.append(f"- {name}: rebound also said: " + "; ".join(
                f"`{k}` ({n}x)" for k, n in sorted(unusual.items(), key=lambda x: -x[1])))
        if r["failures"] > r["kills"]:
            notes.append(f"- {name}: {r['failures'] - r['kills']} driver failures were not "
                         "the benchmark's kills.")
        if r.get("e2fsck_clean") is False:
            notes.append(f"- {name}: e2fsck -fn of the image after the run is NOT clean.")
        if r.get("rebound_exit") not in (0, None):
            notes.append(f"- {name}: rebound exited with status {r['rebound_exit']}.")
        if r.get("missed_kills"):
            notes.append(f"- {name}: {r['missed_kills']} SIGKILLs hit a pid that was not "
                         "serving (not counted).")
    return "\n".join(lines + ([""] + notes if notes else []))


def fresh_table(rows):
    """The recoveries of fresh mounts killed once (`--fresh`)."""
    rows = [r for r in rows if r.get("fresh_recovery_ms") or r.get("fresh_errors")]
    if not rows:
        return ""
    lines = ["| driver | mounts killed | data path at the kill | workload errors | median ms | "
             "p90 ms | max ms | app stall median / max ms |", "|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in rows:
        name = LABELS.get(r["driver"], r["driver"])
        lat, stall = r["fresh_recovery_ms"], r["fresh_stall_ms"]
        paths = ", ".join(f"{p or '?'} {r['fresh_data_paths'].count(p)}"
                          for p in sorted(set(r["fresh_data_paths"])))
        lines.append(
            f"| {name} | {len(lat)} | {paths} | **{r['fresh_workload_errors']}** | "
            f"**{fmt(percentile(lat, 50) if lat else None)}** | "
            f"{fmt(percentile(lat, 90) if lat else None)} | {fmt(max(lat) if lat else None)} | "
            f"{fmt(percentile(stall, 50) if stall else None)} / "
            f"{fmt(max(stall) if stall else None)} |")
        for e in r["fresh_errors"][:3]:
            notes.append(f"- {name}: a fresh mount failed: `{e}`")
    return "\n".join(lines + ([""] + notes if notes else []))


PHASES = ("reap", "backoff", "rollback", "pre_restart", "spawn", "init", "replay", "restore",
          "first_request")


def phase_table(rows):
    """Median and p99 of each recovery phase per driver (ms), and how many recoveries a
    standby successor served."""
    lines = ["| driver | standby takeovers | " + " | ".join(PHASES) + " |",
             "|---|---|" + "---|" * len(PHASES)]
    for r in rows:
        phases = r.get("recovery_phases_ms") or []
        if "error" in r or not phases:
            continue
        cells = []
        for phase in PHASES:
            xs = [p[phase] for p in phases if phase in p]
            cells.append(f"{fmt(percentile(xs, 50))} / {fmt(percentile(xs, 99))}" if xs
                         else "–")
        lines.append(f"| {LABELS.get(r['driver'], r['driver'])} | "
                     f"{r.get('standby_takeovers', 0)} of {len(phases)} | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def remount_cell(r):
    times = r.get("remount_ms")
    if not times:
        return "–"
    return f"{len(times)}, {fmt(percentile(times, 50))} / {fmt(percentile(times, 99))}"


def render(metas, rows, command, png=None):
    m = metas[0]
    runs = ", ".join(f"{x['started']} (commit {x['commit']})" for x in metas)
    text = (
        f"# Recovery latency\n\nRuns: {runs}. Machine: {m.get('cpu_model', m['machine'])}, "
        f"{m['cpus']} CPUs, kernel {m['kernel']}; {m['files']} files of {FILE_SIZE} bytes in "
        "the tree the workload uses"
        + (f"; {m['settle_s']} s of undisturbed workload between a recovery and the next kill"
           if "settle_s" in m else "") + ".\n\n"
        f"Command: `{command}`\n\n"
        "Latency is rebound's own `recovery_ms`: from detecting the failure to the first "
        "request the restarted driver served (for fuse2fs this includes rolling its image back "
        "to the last checkpoint and replaying the redo log over it). Percentiles are nearest-rank. *App stall* is the longest "
        "workload operation from each kill to the next (5 s at most), as the application timed "
        "it. *Plain remount* is the reference point: the same driver mounted directly, "
        "`umount`ed and started again with its own command line, from the `umount` to the "
        "first request the new mount served (a `stat`), including the wait for the old "
        "driver to exit; everything the kernel held through the mount is lost that way. *Nodes "
        "held* is the median number of nodes the kernel held at the kills. *Workload errors* "
        "counts every failed operation and every read that did not return what was last "
        "written, including a final read of every file; it must be 0.\n\n"
        f"{table(rows)}\n")
    phases = phase_table(rows)
    if phases:
        text += ("\nWhere the time goes, median / p99 ms per phase (`recovery_phases_ms`): "
                 "*reap* until the failed driver's processes are gone, *spawn* until the new "
                 "driver's `mount(2)` (near nothing when a standby successor takes over), "
                 "*init* the INIT replayed, *replay* the redo log, *restore* handles reopened "
                 "and requests settled, *first_request* until the first request served.\n\n"
                 f"{phases}\n")
    fresh = fresh_table(rows)
    if fresh:
        text += ("\nThe first failure of a mount, on fresh mounts killed once each (`--fresh`): "
                 "in fast mode (the default, unless a redo log is kept) this recovery also "
                 "takes the kernel's queue over from the dead driver and resends the requests "
                 "it had read; the mount is guarded from then on, so the kills above, after the "
                 "first, recover a guarded mount.\n\n"
                 f"{fresh}\n")
    if png:
        text += f"\n![CDF of recovery latency per driver]({png})\n"
    return text


def latency_cdf(ax, series, title):
    """Draws on ax one CDF of recovery latency per (label, latencies in ms) of series."""
    for label, lat in series:
        lat = sorted(lat)
        if not lat:
            continue
        ax.step(lat, [(k + 1) / len(lat) for k in range(len(lat))], where="post",
                label=f"{label} (n={len(lat)}, median {percentile(lat, 50):.1f} ms)")
    ax.set_xscale("log")
    ax.set_xlabel("recovery latency, failure detected to first request served (ms)")
    ax.set_ylabel("fraction of recoveries")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.8))
    latency_cdf(ax, [(LABELS.get(r["driver"], r["driver"]), r.get("recovery_ms") or [])
                     for r in rows], "rebound: recovery latency after SIGKILL of the driver")
    # Below the axes: inside, it would hide the curves at one end or the other.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drivers", default=",".join(DRIVERS))
    p.add_argument("--kills", default="30",
                   help="kills per driver: a number for every driver, or DRIVER=N,...")
    p.add_argument("--files", type=int, default=3000, help="files in the workload's tree")
    p.add_argument("--remounts", type=int, default=100,
                   help="plain unmount + remount cycles of the driver mounted directly (the "
                        "reference point; 0: none)")
    p.add_argument("--fresh", type=int, default=0,
                   help="fresh mounts per driver, each killed once (the recovery out of fast "
                        "mode, which happens at a mount's first failure)")
    p.add_argument("--settle", type=float, default=0.2,
                   help="seconds of undisturbed workload between a recovery and the next kill")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    p.add_argument("--keep-logs", metavar="DIR", help="copy rebound's log of each driver to DIR")
    p.add_argument("--report", nargs="+", metavar="JSONL",
                   help="only render the table (and plot) of earlier runs' result files")
    p.add_argument("--plot", nargs="+", metavar=("PNG", "JSONL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.plot:
        plot(load(args.plot[1:])[1], args.plot[0])
        return
    out = Path(args.out)
    if args.report:
        metas, rows = load(args.report)
        out.mkdir(parents=True, exist_ok=True)
        write_report(metas, rows, "bench/recovery.py --report " + " ".join(args.report), out,
                     args.report)
        return
    args.drivers = args.drivers.split(",")
    unknown = [d for d in args.drivers if d not in DRIVERS + MORE_DRIVERS]
    if unknown:
        sys.exit(f"recovery: unknown driver(s) {', '.join(unknown)}; known: {', '.join(DRIVERS + MORE_DRIVERS)}")
    try:
        if "=" in args.kills:
            pairs = dict(kv.split("=", 1) for kv in args.kills.split(","))
            args.kills = {d: int(pairs[d]) for d in args.drivers}
        else:
            args.kills = dict.fromkeys(args.drivers, int(args.kills))
    except (KeyError, ValueError) as e:
        sys.exit(f"recovery: --kills: a number, or DRIVER=N for each driver run ({e})")
    if os.geteuid() != 0:
        sys.exit("recovery: mounts file systems; run it as root")
    # Our own control-socket directory: `rebound status` lists only this run's mounts.
    run_dir = mounts.new_workdir("recovery-run")
    os.environ["REBOUND_RUN_DIR"] = str(run_dir)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    meta = {"started": started, "commit": commit, **machine_meta(), "kills": args.kills,
            "files": args.files, "remounts": args.remounts, "settle_s": args.settle,
            "fresh": args.fresh,
            "rebound": str(mounts.rebound_bin()),
            "command": " ".join(["bench/recovery.py"] + sys.argv[1:])}
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"recovery-{started.replace(':', '')}.jsonl"
    rows = []
    sshd = mounts.start_sshd() if "sshfs" in args.drivers else None
    try:
        with open(path, "w") as sink:
            sink.write(json.dumps({"meta": meta}) + "\n")
            for driver in args.drivers:
                print(f"recovery: {driver}: {args.kills[driver]} kills ...", file=sys.stderr, flush=True)
                row = measure(driver, args, sshd)
                print(f"recovery: {driver}: {args.remounts} plain remounts ...", file=sys.stderr,
                      flush=True)
                row.update(remount_reference(driver, args, sshd))
                if args.fresh:
                    print(f"recovery: {driver}: {args.fresh} fresh mounts, one kill each ...",
                          file=sys.stderr, flush=True)
                    row.update(fresh_recoveries(driver, args, sshd))
                rows.append(row)
                sink.write(json.dumps(row) + "\n")
                sink.flush()
                summary = {k: v for k, v in row.items()
                           if k not in ("recovery_ms", "stall_ms", "remount_ms")}
                print(json.dumps(summary), flush=True)
    finally:
        if sshd is not None:
            sshd.stop()
        mounts.remove_workdir(run_dir)
    write_report([meta], rows, meta["command"], out, [path])
    print(f"results: {path}, {out / 'recovery-latest.md'}, {out / 'recovery-latest.png'}")


def write_report(metas, rows, command, out, jsonl):
    """recovery-latest.md and recovery-latest.png (given matplotlib) into out; prints the
    Markdown."""
    png = out / "recovery-latest.png"
    plotted = plot_with_matplotlib(plot, __file__, jsonl, png)
    md = render(metas, rows, command, png.name if plotted else None)
    (out / "recovery-latest.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
