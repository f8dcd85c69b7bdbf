#!/usr/bin/env python3
"""The side-by-side benchmark: each workload on every target in one run, interleaved.

Owns: the targets of one driver's data (the kernel's own file system: the backing directory
bind-mounted or the ext4 image loop-mounted; the driver mounted directly; the driver under
rebound, once per data path: `rebound-fast` and `rebound-guarded`; and the control,
`direct-again`, the driver mounted directly a second time), the workloads, running them on
the targets in rotation, and the results: JSON lines per run, a Markdown table of medians,
spreads and ratios (rebound/direct per mode, direct-again/direct, direct/kernel), with
rebound's CPU time per request, and a PNG chart of the ratios to direct. Also the helpers the
recovery benchmark shares (the rebound binary, its status).

    bench/run.py [--drivers passthrough_ll,fuse2fs,sshfs] [--reps 3] [--quick] [--out DIR]
                 [--modes fast,guarded]   (rebound's data paths: `mode` in its config)
                 [--no-control]           (no `direct-again` target)
                 [--halt-poll-ns N|keep]  (a KVM guest's halt polling for the run; 200000)

BENCH_EXTRA_CONFIG, if set, is appended to the rebound targets' config (an experiment's
settings, e.g. `[sandbox]` `profile = "off"` to measure what the sandbox costs).
    bench/run.py --report bench/results/RUN.jsonl...   (table and chart again, no run)

Every target is mounted afresh for every measurement (cold caches on the FUSE side), and the
order of the targets rotates each repetition so that none is always first (`order_of`: direct
is measured right between the default mode's rebound and the control). Absolute numbers on
a shared 2-core machine mean little; the ratios of targets measured in the same run are what
the table is for, and the min-max of the per-repetition ratios, and the control's ratios, say
how much to trust them.

Mounting and the drivers' command lines (and sshfs's private sshd on 127.0.0.1) come from
tests/e2e/mounts.py.
"""

import argparse
import contextlib
import hashlib
import itertools
import json
import math
import mmap
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "tests" / "e2e"))
import mounts  # noqa: E402  (tests/e2e/mounts.py)

REPO = mounts.REPO
REBOUND = mounts.rebound_bin()
LUA_SRC = REPO / "tests" / ".build" / "lua-src"  # tests/setup.sh unpacks it
DRIVERS = ("passthrough_ll", "fuse2fs", "sshfs")
BASELINES = ("kernel", "direct")
# The driver mounted directly a second time, measured beside direct as rebound is: its ratio to
# direct is what this machine's noise alone gives a target that costs nothing (an A/A control).
CONTROL = "direct-again"
MODES = ("fast", "guarded")  # rebound's data paths; the first is its default (`mode = "auto"`)
GOAL = 0.95  # rebound/direct, issue 5
CHART_TOP = 1.5  # the chart's y range ends here; a larger ratio is written on its bar


HALT_POLL = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
KERNEL_HALT_POLL_NS = 200_000  # cpuidle-haltpoll's own default


@contextlib.contextmanager
def halt_polling(ns):
    """Sets a KVM guest's halt polling (cpuidle-haltpoll: how long an idle vCPU polls before it
    halts into the hypervisor) to ns for the run, and puts the machine's value back after.
    ns None leaves the machine's value. Yields {"machine": its value, "run": the run's}, or None
    where the machine has no haltpoll (then says so).

    With it at 0 (this project's machines boot with `haltpoll.guest_halt_poll_ns=0`), every
    wake-up of an idle vCPU is a trip through the hypervisor: a directly mounted fuse2fs
    answered a stat in a median 23-26 µs, and its control ranged 0.70-1.32 of it over rounds of
    fresh mounts; at the kernel's default of 200 µs, 15 µs and 0.95-1.23
    (bench/results/halt-polling-2026-11-28.md)."""
    if not HALT_POLL.exists():
        print("bench: no guest halt polling here (not a KVM guest with cpuidle-haltpoll)",
              file=sys.stderr)
        yield None
        return
    before = int(HALT_POLL.read_text())
    if ns is None:
        yield {"machine": before, "run": before}
        return
    HALT_POLL.write_text(str(ns))
    try:
        yield {"machine": before, "run": ns}
    finally:
        HALT_POLL.write_text(str(before))


PIPE_MAX_SIZE = Path("/proc/sys/fs/pipe-max-size")
REBOUND_PIPE_MAX_SIZE = 2 << 20  # what rebound raises it to in fast mode (raise_pipe_max_size)


@contextlib.contextmanager
def pipe_limit():
    """Raises fs.pipe-max-size for the run as rebound's first fast-mode mount would, so that
    every target sees the same limit (with it, libfuse 3 drivers, direct ones too, read
    requests by splice), and puts the machine's value back after, as the test suite does.
    Yields {"machine": the value found, "run": the run's}."""
    before = int(PIPE_MAX_SIZE.read_text())
    PIPE_MAX_SIZE.write_text(str(max(before, REBOUND_PIPE_MAX_SIZE)))
    try:
        yield {"machine": before, "run": max(before, REBOUND_PIPE_MAX_SIZE)}
    finally:
        PIPE_MAX_SIZE.write_text(str(before))


def halt_poll_ns(value):
    """--halt-poll-ns: nanoseconds (0 or more), or `keep`."""
    if value == "keep":
        return None
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is neither a number of ns nor `keep`")
    return int(value)


def wait_for(cond, timeout, what):
    """Polls cond() until it is true; raises after timeout seconds."""
    if not mounts.wait_for(cond, timeout):
        raise RuntimeError(f"timed out waiting for {what}")


SETTLE_QUIET = 0.3  # seconds in which a mount's processes use at most a clock tick: settled
SETTLE_MAX = 10.0


def settle(mnt):
    """Waits until the processes serving the mount at mnt (those naming it, and theirs: the
    driver, rebound, a standby driver and its ssh) have used at most one clock tick of CPU in
    SETTLE_QUIET seconds, or SETTLE_MAX passed. Every target is measured settled: a rebound
    mount starts its standby driver and its keeper once it serves, which a long-lived mount
    does once, not at each workload."""
    def ticks():
        pids = set(mounts.procs_mentioning(mnt))
        pids.update(*(mounts.descendants(p) for p in list(pids)))
        total = 0
        for pid in pids:
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
        return total

    deadline = time.monotonic() + SETTLE_MAX
    before = ticks()
    while time.monotonic() < deadline:
        time.sleep(SETTLE_QUIET)
        now = ticks()
        if now - before <= 1:
            return
        before = now


def rebound_target(mode):
    return f"rebound-{mode}"


def targets_of(modes, control=True):
    return (list(BASELINES) + [rebound_target(m) for m in modes]
            + ([CONTROL] if control else []))


def order_of(names, rep):
    """The order of the targets in repetition rep. direct is measured right between the first
    rebound target (the default mode) and the control, each side first in turn: the ratios the
    goal is about then span seconds, not the minute of a repetition in which this machine's
    speed drifts, and the control is as far from direct as rebound is. That block and the
    other targets rotate, so that none is always first."""
    block = [names[2], "direct"] + ([CONTROL] if CONTROL in names else [])
    if rep % 2:
        block.reverse()
    others = [n for n in names if n not in block]
    items = others[:1] + [block] + others[1:]
    k = rep % len(items)
    rotated = items[k:] + items[:k]
    return [t for item in rotated for t in (item if isinstance(item, list) else [item])]


def compared_targets(results):
    """The targets whose ratio to direct is reported: rebound's, then the control's."""
    present = {r["target"] for r in results}
    return rebound_targets(results) + ([CONTROL] if CONTROL in present else [])


class Target:
    """One of the ways to reach the same data (`kernel`, `direct`, `rebound-MODE`); `start`
    mounts it, `stop` unmounts. All use the same directory, so the paths the workloads see are
    the same too."""

    def __init__(self, driver, name, work, sshd, extra_config=""):
        self.driver, self.name, self.work, self.sshd = driver, name, work, sshd
        # As mounts.Mount says: kernel, direct or rebound.
        self.kind = ("rebound" if name.startswith("rebound-")
                     else "direct" if name == CONTROL else name)
        self.config = (f'mode = "{name.removeprefix("rebound-")}"\n' + extra_config
                       if self.kind == "rebound" else None)
        self.mnt = work / "mnt"
        self.mount = None  # a mounts.Mount for the direct and rebound targets

    def start(self):
        image = mounts.DRIVERS[self.driver][1] == "image"
        if image:
            # fuse2fs 1.47 leaks blocks under random writes even mounted directly (e2fsck:
            # "block bitmap differences"), and the kernel refuses an image with errors; repair
            # between targets, outside the timed part.
            subprocess.run(["e2fsck", "-fy", str(self.work / "disk.img")], capture_output=True)
        if self.kind == "kernel":
            how = (["-o", "loop", str(self.work / "disk.img")] if image
                   else ["--bind", str(self.work / "src")])
            subprocess.run(["mount", *how, str(self.mnt)], check=True)
            return
        self.mount = mounts.Mount(self.driver, self.kind, self.work, sshd=self.sshd,
                                  config=self.config,
                                  watchdog=300.0)  # a hung workload fails, not the run
        try:
            self.mount.start()
            if self.kind == "rebound":
                # The mount is usable as soon as the driver's mount(2) returns; rebound's
                # status names it a moment later (its counters are read from there).
                wait_for(lambda: mounts.rebound_ready(self.mnt), 10, "rebound status: ready")
            settle(self.mnt)
        except BaseException:
            self.abandon()
            raise

    def abandon(self):
        """Whatever state the mount is in: no mount and no process of it left."""
        m, self.mount = self.mount, None
        conn = mounts.fuse_connection(self.mnt)
        if conn is not None:
            mounts.abort_connection(conn)
        mounts.umount(self.mnt)
        if m is not None:
            running = [m.proc.pid] if m.proc is not None and m.proc.poll() is None else []
            mounts.kill_all(running + list(m.leftover_processes()))

    def stop(self):
        """Unmounts; an error (rebound exiting with a failure) is raised after cleaning up."""
        if self.kind == "kernel":
            subprocess.run(["umount", str(self.mnt)], check=True)
            if self.driver == "fuse2fs":
                # The loop device lets go of the image asynchronously; fuse2fs refuses an image
                # that is still attached.
                img = str(self.work / "disk.img")
                wait_for(lambda: not subprocess.run(["losetup", "-j", img], capture_output=True,
                                                    text=True).stdout.strip(), 20, "loop detach")
            return
        m = self.mount
        try:
            rc = m.stop()
        finally:
            self.abandon()  # what stop() left, if anything
        if rc not in (0, None):
            raise RuntimeError(f"{m.describe()} exited with {rc}: {m.stderr()[-500:]}")

    def counters(self):
        """(CPU seconds rebound has used, requests it has forwarded) for the rebound target."""
        if self.kind != "rebound":
            return None
        fields = Path(f"/proc/{self.mount.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        st = mounts.mount_status(self.mnt)
        return cpu, (st or {}).get("requests")


# --- workloads: each returns {metric: value}; higher is better unless the name says _us or is
# "s"; a value that is a string is a note on how it was measured (the fio engine) ---

def warm_backing_store(driver, work):
    """Reads the backing store in `work` (the image, or the files of the directory) into the
    host's page cache, so that every target starts a read workload from the same state."""
    if mounts.DRIVERS[driver][1] == "image":
        paths = [work / "disk.img"]
    else:
        paths = [p for p in (work / "src").rglob("*") if p.is_file()]
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(1 << 20):
                pass


def fio(mnt, name, rw, bs, size, runtime, jobs=1, engine="psync", iodepth=1, direct=False,
        invalidate=True):
    """MiB/s of one fio job (or group of jobs). A write job writes its files anew and removes
    them; a read job's files stay in the backing store, laid out by the first target that
    reads them, so that the others (which share the backing store) do not lay them out again.
    A FUSE target's own page cache of them is empty (a fresh mount; --invalidate besides); the
    backing store's is warm (warm_backing_store), which for the kernel target is its
    own, so it reads from the page cache."""
    writes = "write" in rw
    out = subprocess.run(
        ["fio", "--name", name, "--directory", str(mnt), "--rw", rw, "--bs", bs,
         "--size", size, "--runtime", str(runtime), "--time_based", "--numjobs", str(jobs),
         "--group_reporting", "--ioengine", engine, "--iodepth", str(iodepth),
         f"--direct={int(direct)}", "--output-format", "json", f"--unlink={int(writes)}",
         "--end_fsync=1" if writes else f"--invalidate={int(invalidate)}"],
        check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["write"] if "write" in rw else job["read"]
    return side["bw_bytes"] / (1 << 20)


def supports_o_direct(mnt):
    """Whether files on mnt can be written with O_DIRECT (an aligned 4 KiB write)."""
    probe = Path(mnt) / ".o_direct_probe"
    buf = mmap.mmap(-1, 4096)  # page-aligned
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def fio_qd16(mnt, q, name, rw):
    """Queue depth 16: libaio with O_DIRECT where the driver mounted directly takes O_DIRECT,
    else 16 psync jobs (16 requests in flight either way); the same on all three targets."""
    if q["o_direct"]:
        return {"MiB/s": fio(mnt, name, rw, "4k", q["size"], q["runtime"], engine="libaio",
                             iodepth=16, direct=True, invalidate=q["invalidate"]),
                "engine": "libaio, iodepth 16, O_DIRECT"}
    return {"MiB/s": fio(mnt, name, rw, "4k", q["small_size"], q["runtime"], jobs=16,
                         invalidate=q["invalidate"]),
            "engine": "psync, 16 jobs, buffered"}


def w_seq_read(mnt, q):
    return {"MiB/s": fio(mnt, "readfile", "read", "1M", q["size"], q["runtime"],
                         invalidate=q["invalidate"])}


def w_seq_write(mnt, q):
    return {"MiB/s": fio(mnt, "seqwrite", "write", "1M", q["size"], q["runtime"])}


def w_rand_read_4k(mnt, q):
    return {"MiB/s": fio(mnt, "readfile", "randread", "4k", q["size"], q["runtime"],
                         invalidate=q["invalidate"])}


def w_rand_write_4k(mnt, q):
    return {"MiB/s": fio(mnt, "randwrite", "randwrite", "4k", q["size"], q["runtime"])}


def w_rand_read_4k_qd16(mnt, q):
    return fio_qd16(mnt, q, "readfile", "randread")


def w_rand_write_4k_qd16(mnt, q):
    return fio_qd16(mnt, q, "randwrite16", "randwrite")


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
    with tarfile.open(q["tree_tar"]) as tar:
        tar.extractall(dest)
    digest = hashlib.sha256()
    for path in sorted(dest.rglob("*")):
        if path.is_file() and not path.is_symlink():
            digest.update(path.read_bytes())
    elapsed = time.perf_counter() - start
    shutil.rmtree(dest)
    return {"s": elapsed}


# The compile: every Lua version's library, one object per .c file, `make -j<cpus>`.
LUA_MAKEFILE = """\
CFLAGS = -O0 -w -DLUA_USE_POSIX
VERSIONS = $(wildcard lua-5.*)
all: $(VERSIONS:%=%/liblua.a)
define lib
$(1)/liblua.a: $(patsubst %.c,%.o,$(wildcard $(1)/*.c))
\tar rcs $$@ $$^
endef
$(foreach v,$(VERSIONS),$(eval $(call lib,$(v))))
"""


def w_compile(mnt, q):
    """Nooks' compile-local: unpack a C code base on the mount (not timed), build it there
    (timed: seconds, lower is better). gcc's temporary files stay in /tmp; sources, headers,
    objects and archives are on the mount."""
    dest = Path(mnt) / "build"
    with tarfile.open(q["c_tar"]) as tar:
        tar.extractall(dest)
    start = time.perf_counter()
    subprocess.run(["make", "-s", f"-j{os.cpu_count()}", "-C", str(dest)] + q["make_args"],
                   check=True, capture_output=True)
    elapsed = time.perf_counter() - start
    shutil.rmtree(dest)
    return {"s": elapsed}


def w_latency(mnt, q):
    """Latency of a single stat and of a single 4 KiB read whose page was dropped from the
    cache first (median, p99). The stat is answered by the driver when the attribute cache has
    expired, which FUSE defaults keep short. 20,000 samples of each per repetition, spread over
    MOUNTS_PER_REP mounts: the p99 of 2,000 (their 20 slowest) differed up to 3.8x between
    repetitions of one target (runs of 2026-11-28); with 20,000 on one mount it still did, up
    to 4x: that spread is the host's. The first LATENCY_WARM_UP rounds are not counted."""
    f = Path(mnt) / "lat"
    f.write_bytes(os.urandom(1 << 20))
    stats, reads = [], []
    fd = os.open(f, os.O_RDONLY)
    samples = q["lat_samples"] // MOUNTS_PER_REP["latency"]
    for i in range(-LATENCY_WARM_UP, samples):
        if i == 0:
            stats.clear()
            reads.clear()
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
            "read4k_med_us": statistics.median(reads), "read4k_p99_us": p99(reads),
            HIST: {"stat": histogram(stats), "read4k": histogram(reads)}}


# A row's latency samples, kept as a histogram (HIST: {"stat": ..., "read4k": ...}) so that a
# target's quantiles are taken over the samples of all its mounts together: the p99 of one
# mount (its 50 slowest of 5,000) moved by a third between runs, for the control as much.
HIST = "hist"
HIST_STEP = 1.02  # bucket k holds [HIST_STEP**k, HIST_STEP**(k+1)) µs: quantiles within 1%


def histogram(xs):
    counts = {}
    for x in xs:
        k = math.floor(math.log(max(x, 0.01), HIST_STEP))
        counts[k] = counts.get(k, 0) + 1
    return {str(k): n for k, n in sorted(counts.items())}


def pooled_quantile(hists, q):
    """The q-quantile of the samples of all of hists together (geometric middle of its
    bucket)."""
    total = {}
    for h in hists:
        for k, n in h.items():
            total[int(k)] = total.get(int(k), 0) + n
    rank = max(1, math.ceil(q * sum(total.values())))
    seen = 0
    for k in sorted(total):
        seen += total[k]
        if seen >= rank:
            return HIST_STEP ** (k + 0.5)
    raise ValueError("empty histogram")


def pooled(rows, metric):
    """A latency metric (`stat_p99_us`, ...) over all rows' samples together, or None when a
    row has no histogram of it (runs before commit 9a65046)."""
    parts = metric.split("_")
    quantile = {"med": 0.5, "p99": 0.99}.get(parts[1]) if len(parts) == 3 else None
    hists = [r.get(HIST, {}).get(parts[0]) for r in rows]
    if quantile is None or not rows or None in hists:
        return None
    return pooled_quantile(hists, quantile)


WORKLOADS = {
    "seq_read_1M": w_seq_read,
    "seq_write_1M": w_seq_write,
    "rand_read_4k": w_rand_read_4k,
    "rand_write_4k": w_rand_write_4k,
    "rand_read_4k_qd16": w_rand_read_4k_qd16,
    "rand_write_4k_qd16": w_rand_write_4k_qd16,
    "metadata": w_metadata,
    "untar_checksum": w_untar_checksum,
    "compile": w_compile,
    "latency": w_latency,
}
# Workloads measured on more fresh mounts per repetition, each with a share of the samples.
# A stat's latency is set by where the mount's kernel objects and the driver's threads land:
# a directly mounted passthrough_ll answered in a median 11-12 µs on some mounts and 15-17 µs
# on others, and three mounts side by side moved between the two together (2026-11-29,
# bench/results/latency-mounts-2026-11-29.md). Three mounts per target cannot tell a 5% cost
# from that; twelve, with the same 20,000 samples in all, come closer.
MOUNTS_PER_REP = {"latency": 4}
# Rounds of the latency loop run before it counts: on a fresh mount, a stat is slower for its
# first 3,000-5,000 rounds (passthrough_ll directly: 12-18 µs, then 11.2 µs;
# bench/spikes/latency-levels.py), on every target alike. Users see the steady state.
LATENCY_WARM_UP = 5000
READS = ("seq_read_1M", "rand_read_4k", "rand_read_4k_qd16")  # read files fio laid out before
ROW_KEYS = ("driver", "workload", "target", "rep", "loadavg", "wall_s", "rebound_cpu_s",
            "rebound_requests", "error", "mount", "hist")


def lower_is_better(metric):
    return metric == "s" or metric.endswith("_us")


def inputs(work_root, quick):
    """Sizes, and the tarballs the untar and compile workloads unpack (built once per run)."""
    q = {"size": "256M", "small_size": "16M", "runtime": 3, "files": 5000, "lat_samples": 20000,
         "image": 2 << 30, "make_args": []}
    if quick:
        q.update(size="64M", small_size="4M", runtime=2, files=1000, lat_samples=2000,
                 make_args=["VERSIONS=lua-5.4.7"])
    q["tree_tar"] = str(work_root / "tree.tar")
    with tarfile.open(q["tree_tar"], "w") as tar:
        tar.add("/usr/include/linux", arcname="linux")
    q["c_tar"] = str(work_root / "lua.tar")
    if LUA_SRC.is_dir():
        (work_root / "Makefile").write_text(LUA_MAKEFILE)
        with tarfile.open(q["c_tar"], "w") as tar:
            tar.add(work_root / "Makefile", arcname="Makefile")
            for version in sorted(LUA_SRC.glob("lua-5.*")):
                tar.add(version, arcname=version.name)
    return q


def run(args, meta, sink):
    work_root = mounts.new_workdir("bench")
    # Our own control-socket directory: `rebound status` lists only this run's mounts.
    os.environ["REBOUND_RUN_DIR"] = str(mounts.new_workdir("bench-run"))
    q = inputs(work_root, args.quick)
    meta["sizes"] = {k: v for k, v in q.items() if not k.endswith("_tar")}
    sink.write(json.dumps({"meta": meta}) + "\n")
    results = []
    sshd = mounts.start_sshd() if "sshfs" in args.drivers else None
    try:
        for driver in args.drivers:
            work = work_root / driver
            work.mkdir()
            mounts.Mount(driver, "direct", work).prepare(q["image"])  # mnt/, src/ or the image
            extra = os.environ.get("BENCH_EXTRA_CONFIG", "")
            names = targets_of(args.modes, args.control)
            targets = {n: Target(driver, n, work, sshd, extra) for n in names}
            targets["direct"].start()
            try:
                q["o_direct"] = supports_o_direct(targets["direct"].mnt)
            finally:
                targets["direct"].stop()
            for name in args.workloads:
                if name == "compile" and not LUA_SRC.is_dir():
                    print(f"bench: no {LUA_SRC} (tests/setup.sh): compile skipped",
                          file=sys.stderr)
                    continue
                mounts_per_rep = MOUNTS_PER_REP.get(name, 1)
                for rep, mount in itertools.product(range(args.reps), range(mounts_per_rep)):
                    for target in order_of(names, rep * mounts_per_rep + mount):
                        row = measure(targets[target], name, rep, q)
                        if mounts_per_rep > 1:
                            row["mount"] = mount
                        results.append(row)
                        line = json.dumps(row)
                        print(line, flush=True)
                        sink.write(line + "\n")
                        sink.flush()
    finally:
        if sshd is not None:
            sshd.stop()
        for path in (work_root, Path(os.environ["REBOUND_RUN_DIR"])):
            mounts.remove_workdir(path)
    return results


def measure(t, name, rep, q):
    """One workload on one target, mounted for it alone."""
    row = {"driver": t.driver, "workload": name, "target": t.name, "rep": rep,
           "loadavg": os.getloadavg()[0]}
    begun = time.monotonic()
    if name in READS:
        warm_backing_store(t.driver, t.work)
    q = dict(q, invalidate=t.kind != "kernel")
    try:
        t.start()
        try:
            before = t.counters()
            row.update(WORKLOADS[name](t.mnt, q))
            if before is not None:
                after = t.counters()
                row["rebound_cpu_s"] = after[0] - before[0]
                if None not in (before[1], after[1]):
                    row["rebound_requests"] = after[1] - before[1]
        finally:
            t.stop()
    except (subprocess.CalledProcessError, OSError, RuntimeError) as e:
        # Recorded, not fatal: the table shows the gap.
        detail = getattr(e, "stderr", None)
        row["error"] = (f"{type(e).__name__}: {e}" + (f": {detail[-300:]}" if detail else ""))[:600]
    row["wall_s"] = time.monotonic() - begun  # with mounting and unmounting
    return row


# --- the report --------------------------------------------------------------------------

def fmt(x):
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"


def spread(xs, form=fmt):
    return f"{form(min(xs))}–{form(max(xs))}" if len(xs) > 1 else ""


def rebound_targets(results):
    """The rebound targets of the results, the default mode's first."""
    present = {r["target"] for r in results}
    known = [rebound_target(m) for m in MODES]
    return sorted((t for t in present if t.startswith("rebound-")),
                  key=lambda t: (known.index(t) if t in known else len(known), t))


def summarize(results):
    """Per (driver, workload, metric): medians and spreads per target, and per rebound target
    its ratio to direct (of the medians, and per repetition) and its CPU per request, in the
    order of DRIVERS and WORKLOADS."""
    ok = [r for r in results if "error" not in r]
    rebounds = rebound_targets(ok)
    compared = compared_targets(ok)
    targets = list(BASELINES) + compared

    def order(names, known):
        return known.index(names) if names in known else len(known)
    keys = sorted({(r["driver"], r["workload"]) for r in ok},
                  key=lambda k: (order(k[0], DRIVERS), order(k[1], list(WORKLOADS)), k))
    out = []
    for driver, workload in keys:
        rows = [r for r in ok if r["driver"] == driver and r["workload"] == workload]
        by = {t: [r for r in rows if r["target"] == t] for t in targets}
        if not all(by.values()):
            continue
        metrics = [k for k in rows[0] if k not in ROW_KEYS and not isinstance(rows[0][k], str)]
        notes = sorted({f"{r['target']}: {r[k]}" for r in rows for k in r
                        if k not in ROW_KEYS and isinstance(r[k], str)})
        cpu, requests = {}, {}
        for t in rebounds:
            counted = [r for r in by[t] if r.get("rebound_requests")]
            cpu[t] = (statistics.median(r["rebound_cpu_s"] / r["rebound_requests"] * 1e6
                                        for r in counted) if counted else None)
            requests[t] = (statistics.median(r["rebound_requests"] for r in counted)
                           if counted else None)
        for metric in metrics:
            vals = {t: [r[metric] for r in by[t]] for t in targets}
            med = {t: statistics.median(v) for t, v in vals.items()}
            # A workload on several mounts per repetition: the repetition's figure is that of
            # its mounts' samples together where the rows keep them (latency), and the
            # target's, that of all its mounts'.
            pools = {t: pooled(by[t], metric) for t in targets}
            if None not in pools.values():
                med = pools

            def figure(rows):
                together = pooled(rows, metric)
                return together if together is not None else statistics.median(
                    r[metric] for r in rows)

            def by_rep(t):
                reps = {}
                for r in by[t]:
                    reps.setdefault(r["rep"], []).append(r)
                return {k: figure(rs) for k, rs in reps.items()}

            def ratio(a, b):  # "how much of b's performance a reaches": > 1 is faster
                return b / a if lower_is_better(metric) else a / b
            direct = by_rep("direct")
            out.append({"driver": driver, "workload": workload, "metric": metric,
                        "n": min(len(v) for v in vals.values()), "median": med, "values": vals,
                        "ratio": {t: ratio(med[t], med["direct"]) for t in compared},
                        "paired": {t: [ratio(x, direct[k]) for k, x in by_rep(t).items()
                                       if k in direct] for t in compared},
                        "direct/kernel": ratio(med["direct"], med["kernel"]),
                        "cpu_us_per_request": cpu, "requests": requests, "notes": notes})
    return out


def ratio_cell(s, t):
    rd = s["ratio"][t]
    return (f"**{rd:.2f}**" + (" ✗" if rd < GOAL else "")
            + (f" ({spread(s['paired'][t], lambda x: f'{x:.2f}')})" if s["n"] > 1 else ""))


def table(results):
    ok = [r for r in results if "error" not in r]
    rebounds, compared = rebound_targets(ok), compared_targets(ok)
    targets = list(BASELINES) + compared
    lines = ["| driver | workload | metric | n | " + " | ".join(targets) + " | "
             + " | ".join(f"**{t}/direct** (per-rep min–max)" for t in compared)
             + " | direct/kernel | "
             + " | ".join(f"{t} CPU µs/request (requests)" for t in rebounds) + " |",
             "|---|---|---|---|" + "---|" * (len(targets) + len(compared) + 1 + len(rebounds))]
    notes = []
    for s in summarize(results):
        cells = [f"{fmt(s['median'][t])} ({spread(s['values'][t])})" if s["n"] > 1
                 else fmt(s["median"][t]) for t in targets]
        cpu = [f"{s['cpu_us_per_request'][t]:.1f} ({s['requests'][t]:.0f})"
               if s["cpu_us_per_request"][t] is not None else "–" for t in rebounds]
        lines.append(f"| {s['driver']} | {s['workload']} | {s['metric']} | {s['n']} | "
                     + " | ".join(cells + [ratio_cell(s, t) for t in compared]
                                  + [f"{s['direct/kernel']:.2f}"] + cpu) + " |")
        if s["notes"] and s["metric"] == "MiB/s":
            how = sorted({n.split(": ", 1)[1] for n in s["notes"]})
            notes.append(f"- {s['driver']} {s['workload']}: "
                         + (f"{how[0]} (all targets)" if len(how) == 1
                            else "; ".join(s["notes"])))
    for r in results:
        if "error" in r:
            notes.append(f"- **failed**: {r['driver']} {r['workload']} on {r['target']} "
                         f"(rep {r['rep']}): `{r['error']}`")
    return "\n".join(lines + ([""] + notes if notes else []))


def ratio_table(results, target):
    """Markdown: `target`/direct per workload metric (rows) and driver (columns), with the
    per-repetition min–max; the summary the README quotes."""
    summary = [s for s in summarize(results) if target in s["ratio"]]
    drivers = list(dict.fromkeys(s["driver"] for s in summary))
    rows = list(dict.fromkeys((s["workload"], s["metric"]) for s in summary))
    cell = {(s["driver"], s["workload"], s["metric"]): s for s in summary}
    lines = ["| workload | metric | " + " | ".join(drivers) + " |",
             "|---|---|" + "---|" * len(drivers)]
    for workload, metric in rows:
        cells = [ratio_cell(cell[(d, workload, metric)], target)
                 if (d, workload, metric) in cell else "–" for d in drivers]
        lines.append(f"| {workload} | {metric} | " + " | ".join(cells) + " |")
    below = sum(s["ratio"][target] < GOAL for s in summary)
    # The geometric mean weighs a row at 0.9 and one at 1/0.9 alike: set beside the control's,
    # it shows a cost spread over every row that the noise of single rows hides. (A ratio of
    # 0, a target that measured nothing, leaves it out, and the line says so.)
    ratios = [s["ratio"][target] for s in summary if s["ratio"][target] > 0]
    mean = (f"geometric mean of the rows {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}"
            if ratios else "no geometric mean")
    if ratios and len(ratios) < len(summary):
        mean += f" (over the {len(ratios)} rows with a ratio above 0)"
    return ("\n".join(lines) + f"\n\n{len(summary) - below} of {len(summary)} rows ≥ {GOAL}; "
            f"{mean}.")


def chart(results, path):
    """Bars of rebound/direct per workload metric and driver, one panel per mode (ratio of
    medians; whiskers: the per-repetition min–max), with the goal line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    summary = summarize(results)
    rebounds = compared_targets([r for r in results if "error" not in r])

    def label(s):
        return s["workload"] + ("" if s["metric"] in ("MiB/s", "ops/s", "s") else f" {s['metric']}")
    labels = list(dict.fromkeys(label(s) for s in summary))
    drivers = list(dict.fromkeys(s["driver"] for s in summary))
    width = 0.8 / max(1, len(drivers))
    fig, axes = plt.subplots(len(rebounds), 1, squeeze=False, sharex=True,
                             figsize=(max(8, 0.7 * len(labels) + 2), 3.2 * len(rebounds) + 1.8))
    for ax, target in zip(axes[:, 0], rebounds):
        for k, driver in enumerate(drivers):
            xs, ys, lo, hi = [], [], [], []
            for s in summary:
                if s["driver"] != driver:
                    continue
                y = s["ratio"][target]
                xs.append(labels.index(label(s)) + (k - (len(drivers) - 1) / 2) * width)
                ys.append(y)
                lo.append(max(0.0, y - min(s["paired"][target] or [y])))
                hi.append(max(0.0, max(s["paired"][target] or [y]) - y))
            ax.bar(xs, [min(y, CHART_TOP) for y in ys], width, label=driver,
                   yerr=[[v if y <= CHART_TOP else 0 for y, v in zip(ys, lo)],
                         [v if y + v <= CHART_TOP else 0 for y, v in zip(ys, hi)]],
                   capsize=2, error_kw={"elinewidth": 0.8})
            for x, y in zip(xs, ys):
                if y > CHART_TOP:  # off the scale: the bar is cut, its value written on it
                    ax.text(x, CHART_TOP * 0.98, f"{y:.1f}", ha="center", va="top",
                            fontsize=7, rotation=90, color="white")
        ax.axhline(GOAL, color="red", linestyle="--", linewidth=1, label=f"goal {GOAL}")
        ax.axhline(1.0, color="grey", linewidth=0.6)
        ax.set_ylim(0, CHART_TOP)
        ax.set_ylabel(f"{target} / direct")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0, 0].set_title("rebound vs. the same driver mounted directly, same run "
                         "(higher is better)")
    last = axes[-1, 0]
    last.set_xticks(range(len(labels)))
    last.set_xticklabels(labels, rotation=40, ha="right", fontsize=8)
    last.legend(fontsize=8, ncol=len(drivers) + 1, loc="upper center",
                bbox_to_anchor=(0.5, -0.45), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load(paths):
    metas, rows = [], []
    for path in paths:
        mode = "guarded"
        for line in Path(path).read_text().splitlines():
            obj = json.loads(line)
            if "meta" in obj:
                metas.append(obj["meta"])
                mode = obj["meta"].get("mode", mode)
            else:
                if obj.get("target") == "rebound":  # a run of one mode (before 2026-11-27)
                    obj["target"] = rebound_target(mode)
                rows.append(obj)
    return metas, rows


CONTROL_NOTE = (" (the control: the driver mounted directly a second time, measured beside "
                "direct as rebound-fast is; what the noise of this run alone makes of a target "
                "that costs nothing)")


def render(metas, results, command, png=None):
    runs = ", ".join(f"{m['started']} (commit {m['commit']}, "
                     f"modes {', '.join(m.get('modes') or [m.get('mode', 'guarded')])}, "
                     f"`{m['command']}`)" for m in metas)
    m = metas[0]
    machine = m.get("cpu_model", m["machine"])
    loads = [r["loadavg"] for r in results if "loadavg" in r]
    compared = compared_targets([r for r in results if "error" not in r])
    text = (
        f"# Benchmark\n\nRuns: {runs}. Machine: {machine}, {m['cpus']} CPUs"
        + (f", {m['mem_gib']} GiB" if "mem_gib" in m else "")
        + f", kernel {m['kernel']}"
        + (f"; guest halt polling {polling['run'] / 1000:g} µs for the run (the machine's: "
           f"{polling['machine'] / 1000:g} µs)" if (polling := m.get("guest_halt_poll_ns"))
           else "")
        + (f"; fs.pipe-max-size {pipes['run']} for the run (the machine's: {pipes['machine']})"
           if (pipes := m.get("pipe_max_size")) else "")
        + (f"; shared with other work (1-min load average at the measurements: median "
           f"{statistics.median(loads):.1f}, max {max(loads):.1f})" if loads else "")
        + ".\n\n"
        f"Rendered by: `{command}`\n\n"
        f"{m['reps']} repetitions per target, interleaved (the target order rotates each "
        "repetition" + ("; direct is measured right between the default mode and the control"
                        if CONTROL in compared else "")
        + "); each measurement on a fresh mount"
        + "".join(f"; {w} on {k} mounts per repetition, each with 1/{k} of the samples (n "
                  "counts the mounts; where the rows keep their samples, a target's figure is "
                  "the quantile of all its mounts' samples together, a repetition's of its "
                  f"{k} mounts')" for w, k in MOUNTS_PER_REP.items()
                  if any(r.get("workload") == w and ("mount" in r or r["rep"] >= m["reps"])
                         for r in results))
        + ". rebound-fast and rebound-guarded are "
        "rebound in its two data paths (`mode` in its config; fast is the default). Cells: "
        "median (min–max). rebound/direct is the ratio of the medians, > 1 is faster (for seconds and µs, the "
        "inverse), with the min–max of the ratios of the same repetition in parentheses; ✗ "
        f"marks a ratio under the goal of {GOAL}. CPU µs/request: rebound's user+system time "
        "during the workload divided by the requests it forwarded (median over repetitions; "
        "the median request count in parentheses; in fast mode, the requests the observer saw "
        "end). Sync fio jobs use psync and the page cache; "
        "*qd16* jobs use the engine named below the table.\n\n"
        + "".join(f"{t}/direct at a glance{CONTROL_NOTE if t == CONTROL else ''}:\n\n"
                  f"{ratio_table(results, t)}\n\n" for t in compared)
        + f"All numbers:\n\n{table(results)}\n")
    if png:
        text += f"\n![rebound/direct per workload and driver]({png})\n"
    return text


def plot_with_matplotlib(plot, script, jsonl, png):
    """plot(rows of the jsonl files, png) with this python's matplotlib, or else with Debian's
    (python3-matplotlib serves /usr/bin/python3, which may not be the python3 on PATH) by
    running `/usr/bin/python3 SCRIPT --plot PNG JSONL...`. True when the chart was written."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        system = "/usr/bin/python3"
        if (os.path.realpath(sys.executable) == os.path.realpath(system)
                or not os.path.exists(system)
                or subprocess.run([system, "-c", "import matplotlib"],
                                  capture_output=True).returncode != 0):
            print(f"{Path(script).name}: no matplotlib (scripts/deps.sh bench); no chart",
                  file=sys.stderr)
            return False
        return subprocess.run([system, str(script), "--plot", str(png),
                               *map(str, jsonl)]).returncode == 0
    plot(load(jsonl)[1], png)
    return True


def report(metas, results, out, command, jsonl):
    """Writes latest.md and latest.png (the chart, given matplotlib) into out; returns the
    Markdown."""
    png = out / "latest.png"
    plotted = plot_with_matplotlib(chart, __file__, jsonl, png)
    md = render(metas, results, command, png.name if plotted else None)
    (out / "latest.md").write_text(md)
    return md


def machine_meta():
    model = next((line.split(":", 1)[1].strip()
                  for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.machine())
    mem = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal"))
    fio_version = subprocess.run(["fio", "--version"], capture_output=True,
                                 text=True).stdout.strip()
    return {"machine": platform.machine(), "cpu_model": model, "cpus": os.cpu_count(),
            "mem_gib": round(mem / (1 << 20)), "kernel": platform.release(), "fio": fio_version}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drivers", default=",".join(DRIVERS))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES),
                   help="rebound's data paths to measure, each a target (its config's `mode`)")
    p.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    p.add_argument("--no-control", dest="control", action="store_false",
                   help=f"no `{CONTROL}` target (the driver mounted directly a second time, "
                        "whose ratio to direct shows the run's noise)")
    p.add_argument("--halt-poll-ns", default=str(KERNEL_HALT_POLL_NS),
                   type=halt_poll_ns,
                   help="a KVM guest's halt polling during the run, restored after (default: "
                        "the kernel's own default, 200 µs); `keep` leaves the machine's")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    p.add_argument("--report", nargs="+", metavar="JSONL",
                   help="only render the table and chart of earlier runs' result files "
                        "(into --out's latest.md and latest.png)")
    p.add_argument("--plot", nargs="+", metavar=("PNG", "JSONL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.plot:
        chart(load(args.plot[1:])[1], args.plot[0])
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report:
        metas, rows = load(args.report)
        print(report(metas, rows, out, "bench/run.py --report " + " ".join(args.report),
                     args.report))
        return
    args.drivers = args.drivers.split(",")
    args.workloads = args.workloads.split(",")
    args.modes = args.modes.split(",")
    unknown = ([d for d in args.drivers if d not in DRIVERS]
               + [w for w in args.workloads if w not in WORKLOADS]
               + [m for m in args.modes if m not in MODES])
    if unknown:
        sys.exit(f"bench: unknown driver(s), workload(s) or mode(s): {', '.join(unknown)}")
    if os.geteuid() != 0:
        sys.exit("bench: mounts file systems; run it as root")
    if not os.access(REBOUND, os.X_OK):
        sys.exit(f"bench: no rebound binary at {REBOUND} (cargo build --release, or REBOUND_BIN)")
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    meta = {"started": started, "commit": commit, **machine_meta(), "reps": args.reps,
            "control": args.control,
            "quick": args.quick, "rebound": str(REBOUND), "modes": args.modes,
            "command": "bench/run.py " + " ".join(sys.argv[1:])}
    path = out / f"{started.replace(':', '')}.jsonl"
    # A killed run (SIGTERM) unwinds too, so the machine gets its halt polling and pipe limit
    # back.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with halt_polling(args.halt_poll_ns) as polling, pipe_limit() as pipes, \
            open(path, "w") as sink:
        meta["guest_halt_poll_ns"] = polling
        meta["pipe_max_size"] = pipes
        results = run(args, meta, sink)
    print(report([meta], results, out, meta["command"], [path]))
    print(f"results: {path} and the report beside it in {out}")


if __name__ == "__main__":
    main()
