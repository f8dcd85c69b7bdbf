#!/usr/bin/env python3
"""What fast-mode mounts cost the rest of the host. Each fast-mode run attaches its observer's
BPF programs: on FUSE's two request tracepoints, and on `kfree`, where the forgets a driver
reads are freed (the only place they can be seen on this kernel). The `kfree` one runs at every
`kfree` of the host, whatever the caller. This mounts MOUNTS idle fast-mode mounts of DRIVER,
runs kernel-heavy workloads that touch no FUSE mount, and reports from the kernel's BPF
statistics (`kernel.bpf_stats_enabled`, on for the measurement) how often the programs on each
tracepoint ran and the time spent in them (every program attached on the host is counted). The statistics time each run with two clock reads, so
the time per run includes one of them; the dispatch to a program is not counted. Run as root
after tests/setup.sh.

Usage: bench/spikes/host-tax.py DRIVER MOUNTS REPS"""
import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "e2e"))
import mounts  # noqa: E402

STATS = Path("/proc/sys/kernel/bpf_stats_enabled")


def messaging():
    """perf's scheduler benchmark: processes exchanging messages over sockets (an skb
    allocated and freed per message)."""
    subprocess.run(["perf", "bench", "sched", "messaging", "-g", "4", "-l", "400"],
                   capture_output=True, check=True)


def tmpfs_files():
    """Create, stat and unlink 20,000 small files on tmpfs."""
    d = Path("/dev/shm/host-tax")
    d.mkdir(exist_ok=True)
    for i in range(20000):
        p = d / f"f{i}"
        p.write_bytes(b"x")
        p.stat()
        p.unlink()
    d.rmdir()


WORKLOADS = {"messaging": messaging, "tmpfs_files": tmpfs_files}


LIBC = ctypes.CDLL(None, use_errno=True)
SYS_BPF, PROG_GET_FD_BY_ID, LINK_GET_FD_BY_ID, LINK_GET_NEXT_ID = 321, 13, 30, 31


def fdinfo_of_id(command, object_id):
    """The fdinfo fields of the BPF object `object_id` (a link or a program), or None."""
    fd = LIBC.syscall(SYS_BPF, command, (ctypes.c_uint32 * 4)(object_id, 0, 0, 0), 16)
    if fd < 0:
        return None
    try:
        text = Path(f"/proc/self/fdinfo/{fd}").read_text()
    finally:
        os.close(fd)
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def programs():
    """{program id: (tracepoint, run_time_ns, run_cnt)} of every program attached through a
    link on this host (held by a process or pinned)."""
    found, at = {}, 0
    while True:
        attr = (ctypes.c_uint32 * 4)(at, 0, 0, 0)
        if LIBC.syscall(SYS_BPF, LINK_GET_NEXT_ID, attr, ctypes.sizeof(attr)) != 0:
            return found
        at = attr[1]
        link = fdinfo_of_id(LINK_GET_FD_BY_ID, at)
        if not link or "tp_name" not in link:
            continue
        prog = fdinfo_of_id(PROG_GET_FD_BY_ID, int(link["prog_id"]))
        if prog and "run_cnt" in prog:
            found[link["prog_id"]] = (link["tp_name"], int(prog["run_time_ns"]),
                                      int(prog["run_cnt"]))


def cpus():
    return os.cpu_count() or 1


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    driver, count, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    mounted = []
    old = STATS.read_text()
    try:
        for _ in range(count):
            work = mounts.new_workdir("host-tax")
            m = mounts.Mount(driver, "rebound", work, config='mode = "fast"\n')
            mounted.append((m, work))
            m.prepare(64 << 20)
            m.start()
        STATS.write_text("1")
        print(f"{count} fast-mode mounts of {driver}, idle; {cpus()} CPUs")
        for name, workload in WORKLOADS.items():
            for _ in range(reps):
                before = programs()
                start = time.perf_counter()
                workload()
                seconds = time.perf_counter() - start
                after = programs()
                by_tp = {}
                for prog, (tp, ns, runs) in after.items():
                    if prog in before:
                        _, ns0, runs0 = before[prog]
                        n, r, k = by_tp.get(tp, (0, 0, 0))
                        by_tp[tp] = (n + ns - ns0, r + runs - runs0, k + 1)
                line = ", ".join(
                    f"{tp} x{k}: {runs / seconds:,.0f} runs/s, {ns / max(runs, 1):.0f} ns/run, "
                    f"{ns / 1e9 / seconds / cpus() * 100:.2f}% of the CPUs"
                    for tp, (ns, runs, k) in sorted(by_tp.items()))
                print(f"  {name} ({seconds:.2f} s): {line}")
    finally:
        STATS.write_text(old)
        for m, work in mounted:
            m.stop()
            m.cleanup()
            mounts.remove_workdir(work)


if __name__ == "__main__":
    main()
