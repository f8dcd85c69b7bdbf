#!/usr/bin/env python3
"""The side-by-side benchmark: each workload on three targets in one run, interleaved.

Owns: mounting the targets (the kernel's own file system, the driver mounted directly, the
driver under rebound), running the workloads on them in rotation, and writing the results as
JSON plus a Markdown table of medians and ratios (rebound/direct, direct/kernel).

    bench/run.py [--drivers passthrough_ll,fuse2fs] [--reps 3] [--quick] [--out bench/results]

Absolute numbers on a shared 2-core machine mean little; the ratios of targets measured in
the same run, interleaved repetition by repetition, are what the table is for.
"""

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REBOUND = REPO / "target" / "release" / "rebound"
PASSTHROUGH_LL = REPO / "tests" / ".build" / "bin" / "passthrough_ll"
TARGETS = ("kernel", "direct", "rebound")


def wait_for(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def is_mounted(path):
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


class Target:
    """One of the three ways to reach the same data; `start` mounts it, `stop` unmounts."""

    def __init__(self, driver, kind, work):
        self.driver, self.kind, self.work = driver, kind, work
        self.mnt = work / f"mnt-{kind}"
        self.mnt.mkdir(exist_ok=True)
        self.proc = None

    def driver_argv(self):
        if self.driver == "passthrough_ll":
            return [str(PASSTHROUGH_LL), "-f", "-o", f"source={self.work / 'backing'}",
                    str(self.mnt)]
        return ["fuse2fs", "-f", str(self.work / "disk.img"), str(self.mnt), "-o", "fakeroot"]

    def start(self):
        if self.driver == "fuse2fs":
            # fuse2fs 1.47 leaks blocks under random writes even mounted directly (e2fsck:
            # "block bitmap differences"), and the kernel refuses an image with errors; repair
            # between targets, outside the timed part.
            subprocess.run(["e2fsck", "-fy", str(self.work / "disk.img")], capture_output=True)
        if self.kind == "kernel":
            if self.driver == "passthrough_ll":
                subprocess.run(["mount", "--bind", str(self.work / "backing"), str(self.mnt)],
                               check=True)
            else:
                subprocess.run(["mount", "-o", "loop", str(self.work / "disk.img"),
                                str(self.mnt)], check=True)
            return
        argv = self.driver_argv()
        if self.kind == "rebound":
            argv = [str(REBOUND), "run", "--"] + argv
        log = open(self.work / f"{self.kind}.log", "wb")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                     start_new_session=True)

        def mounted():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.driver} ({self.kind}) exited before mounting:\n"
                                   + (self.work / f"{self.kind}.log").read_text(errors="replace"))
            return is_mounted(self.mnt)
        wait_for(mounted, 20, f"{self.driver} {self.kind} mount")

    def stop(self):
        subprocess.run(["umount", str(self.mnt)], check=False, capture_output=True)
        if self.proc is not None:
            try:
                # fuse2fs flushes its image after the unmount; give it the time it needs.
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait()
            self.proc = None
        wait_for(lambda: not is_mounted(self.mnt), 20, f"{self.mnt} unmounted")
        if self.kind == "kernel" and self.driver == "fuse2fs":
            # The loop device lets go of the image asynchronously; fuse2fs refuses an image
            # that is still attached.
            img = str(self.work / "disk.img")
            wait_for(lambda: not subprocess.run(["losetup", "-j", img], capture_output=True,
                                                text=True).stdout.strip(), 20, "loop detach")

    def rebound_cpu_seconds(self):
        """CPU time rebound itself has used (for the rebound target)."""
        if self.kind != "rebound" or self.proc is None:
            return None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- workloads: each returns {metric: value}; higher is better unless the name says _us ---

def fio(mnt, name, rw, bs, size, runtime, jobs=1, extra=()):
    out = subprocess.run(
        ["fio", "--name", name, "--directory", str(mnt), "--rw", rw, "--bs", bs,
         "--size", size, "--runtime", str(runtime), "--time_based", "--numjobs", str(jobs),
         "--group_reporting", "--ioengine", "psync", "--output-format", "json", "--unlink=1",
         "--end_fsync=1" if "write" in rw else "--invalidate=1", *extra],
        check=True, capture_output=True, text=True).stdout
    job = json.loads(out)["jobs"][0]
    side = job["write"] if "write" in rw else job["read"]
    return side["bw_bytes"] / (1 << 20)


def w_seq_read(mnt, q):
    return {"MiB/s": fio(mnt, "seqread", "read", "1M", q["size"], q["runtime"])}


def w_seq_write(mnt, q):
    return {"MiB/s": fio(mnt, "seqwrite", "write", "1M", q["size"], q["runtime"])}


def w_rand_read_4k(mnt, q):
    return {"MiB/s": fio(mnt, "randread", "randread", "4k", q["size"], q["runtime"])}


def w_rand_write_4k(mnt, q):
    return {"MiB/s": fio(mnt, "randwrite", "randwrite", "4k", q["size"], q["runtime"])}


def w_rand_read_4k_16jobs(mnt, q):
    return {"MiB/s": fio(mnt, "randread16", "randread", "4k", q["small_size"], q["runtime"],
                         jobs=16)}


def w_metadata(mnt, q):
    """Create, stat, rename and unlink many small files: operations per second."""
    d = Path(mnt) / "meta"
    d.mkdir()
    n = q["files"]
    start = time.perf_counter()
    for i in range(n):
        with open(d / f"f{i}", "wb") as f:
            f.write(b"x" * 100)
    for i in range(n):
        os.stat(d / f"f{i}")
    for i in range(n):
        os.rename(d / f"f{i}", d / f"g{i}")
    for i in range(n):
        os.unlink(d / f"g{i}")
    elapsed = time.perf_counter() - start
    d.rmdir()
    return {"ops/s": 4 * n / elapsed}


def w_untar_checksum(mnt, q):
    """Unpack a tree of real files and checksum every one: seconds (lower is better)."""
    dest = Path(mnt) / "tree"
    start = time.perf_counter()
    with tarfile.open(q["tarball"]) as tar:
        tar.extractall(dest)
    digest = hashlib.sha256()
    for path in sorted(dest.rglob("*")):
        if path.is_file() and not path.is_symlink():
            digest.update(path.read_bytes())
    elapsed = time.perf_counter() - start
    shutil.rmtree(dest)
    return {"s": elapsed}


def w_latency(mnt, q):
    """Latency of a single stat and of a single 4 KiB read (uncached: O_DIRECT is not used,
    so the read path is the page cache after the first; stat goes to the driver when the
    attribute cache has expired, which FUSE defaults keep short)."""
    f = Path(mnt) / "lat"
    f.write_bytes(os.urandom(1 << 20))
    stats, reads = [], []
    fd = os.open(f, os.O_RDONLY)
    for i in range(q["lat_samples"]):
        t = time.perf_counter_ns()
        os.stat(f)
        stats.append((time.perf_counter_ns() - t) / 1000)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t = time.perf_counter_ns()
        os.pread(fd, 4096, (i * 4096) % (1 << 20))
        reads.append((time.perf_counter_ns() - t) / 1000)
    os.close(fd)
    f.unlink()

    def p99(xs):
        return sorted(xs)[int(len(xs) * 0.99) - 1]
    return {"stat_med_us": statistics.median(stats), "stat_p99_us": p99(stats),
            "read4k_med_us": statistics.median(reads), "read4k_p99_us": p99(reads)}


WORKLOADS = {
    "seq_read_1M": w_seq_read,
    "seq_write_1M": w_seq_write,
    "rand_read_4k": w_rand_read_4k,
    "rand_write_4k": w_rand_write_4k,
    "rand_read_4k_16jobs": w_rand_read_4k_16jobs,
    "metadata": w_metadata,
    "untar_checksum": w_untar_checksum,
    "latency": w_latency,
}


def lower_is_better(metric):
    return metric == "s" or metric.endswith("_us")


def prepare(driver, work, q):
    if driver == "passthrough_ll":
        (work / "backing").mkdir()
    else:
        subprocess.run(["truncate", "-s", q["image"], str(work / "disk.img")], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(work / "disk.img")], check=True)


def run(args, sink):
    q = {"size": "256M", "small_size": "16M", "runtime": 5, "files": 5000, "lat_samples": 2000,
         "image": "2G"}
    if args.quick:
        q.update(size="64M", small_size="4M", runtime=2, files=1000, lat_samples=300)
    work_root = Path(tempfile.mkdtemp(prefix="rebound-bench-", dir="/tmp"))
    q["tarball"] = str(work_root / "tree.tar")
    with tarfile.open(q["tarball"], "w") as tar:
        tar.add("/usr/include/linux", arcname="linux")
    results = []
    try:
        for driver in args.drivers:
            work = work_root / driver
            work.mkdir()
            prepare(driver, work, q)
            targets = {kind: Target(driver, kind, work) for kind in TARGETS}
            for name in args.workloads:
                for rep in range(args.reps):
                    # Rotate the order so no target always runs first (or last).
                    order = TARGETS[rep % 3:] + TARGETS[:rep % 3]
                    for kind in order:
                        t = targets[kind]
                        row = {"driver": driver, "workload": name, "target": kind, "rep": rep}
                        t.start()
                        try:
                            cpu0 = t.rebound_cpu_seconds()
                            row.update(WORKLOADS[name](t.mnt, q))
                            if cpu0 is not None:
                                row["rebound_cpu_s"] = t.rebound_cpu_seconds() - cpu0
                        except (subprocess.CalledProcessError, OSError) as e:
                            # Recorded, not fatal: the table shows the gap.
                            row["error"] = str(e)[:300]
                        finally:
                            t.stop()
                        results.append(row)
                        line = json.dumps(row)
                        print(line, flush=True)
                        sink.write(line + "\n")
                        sink.flush()
    finally:
        for m in work_root.rglob("mnt-*"):
            subprocess.run(["umount", "-l", str(m)], capture_output=True)
        shutil.rmtree(work_root, ignore_errors=True)
    return q, results


def table(results):
    """Markdown: per driver and workload metric, the median of each target and the ratios."""
    lines = ["| driver | workload | metric | kernel | direct | rebound | rebound/direct | "
             "direct/kernel |", "|---|---|---|---|---|---|---|---|"]
    failed = [r for r in results if "error" in r]
    results = [r for r in results if "error" not in r]
    keys = sorted({(r["driver"], r["workload"]) for r in results},
                  key=lambda k: (k[0], list(WORKLOADS).index(k[1])))
    for driver, workload in keys:
        rows = [r for r in results if r["driver"] == driver and r["workload"] == workload]
        metrics = [m for m in rows[0] if m not in ("driver", "workload", "target", "rep",
                                                   "rebound_cpu_s")]
        for metric in metrics:
            if any(not [r for r in rows if r["target"] == t] for t in TARGETS):
                continue
            med = {t: statistics.median(r[metric] for r in rows if r["target"] == t)
                   for t in TARGETS}
            # Ratios read as "how much of the other's performance": >1 is faster.
            if lower_is_better(metric):
                rd, dk = med["direct"] / med["rebound"], med["kernel"] / med["direct"]
            else:
                rd, dk = med["rebound"] / med["direct"], med["direct"] / med["kernel"]
            lines.append(f"| {driver} | {workload} | {metric} | {med['kernel']:.1f} | "
                         f"{med['direct']:.1f} | {med['rebound']:.1f} | **{rd:.2f}** | "
                         f"{dk:.2f} |")
    for r in failed:
        lines.append(f"\nFailed: {r['driver']} {r['workload']} on {r['target']} "
                     f"(rep {r['rep']}): {r['error']}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drivers", default="passthrough_ll,fuse2fs")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    p.add_argument("--report", nargs="+", metavar="JSONL",
                   help="only render the table of earlier runs' result files")
    args = p.parse_args()
    if args.report:
        rows, metas = [], []
        for path in args.report:
            for line in Path(path).read_text().splitlines():
                obj = json.loads(line)
                (metas if "meta" in obj else rows).append(obj.get("meta", obj))
        print(render(metas, rows, f"bench/run.py --report {' '.join(args.report)}"))
        return
    args.drivers = args.drivers.split(",")
    args.workloads = args.workloads.split(",")
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        sys.exit(f"bench: unknown workload(s) {', '.join(unknown)}")
    if os.geteuid() != 0:
        sys.exit("bench: mounts file systems; run it as root")
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    meta = {"started": started, "commit": commit, "machine": platform.machine(),
            "kernel": platform.release(), "cpus": os.cpu_count(), "reps": args.reps,
            "quick": args.quick, "command": "bench/run.py " + " ".join(sys.argv[1:])}
    path = out / f"{started.replace(':', '')}.jsonl"
    with open(path, "w") as sink:
        sink.write(json.dumps({"meta": meta}) + "\n")
        _, results = run(args, sink)
    md = render([meta], results, meta["command"])
    (out / "latest.md").write_text(md)
    print(md)


def render(metas, results, command):
    runs = ", ".join(f"{m['started']} (commit {m['commit']})" for m in metas)
    m = metas[0]
    return (f"# Benchmark\n\nRuns: {runs}; kernel {m['kernel']}, {m['cpus']} CPUs, "
            f"{m['reps']} interleaved repetitions per target, medians.\n\n"
            f"Command: `{command}`\n\n{table(results)}\n")


if __name__ == "__main__":
    main()
