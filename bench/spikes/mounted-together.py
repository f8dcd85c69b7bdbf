#!/usr/bin/env python3
"""A direct mount, a fast-mode rebound mount and a second direct mount (the control) of one
driver, all mounted for the whole run, each over its own copy of the data; bench/run.py's
WORKLOAD alternates between them (rotated order), and each round's figures are paired. All
three then pay the observer's BPF programs, which run at every FUSE request and `kfree` of the
host, so what differs is only the driver's side: its process, sandbox and cgroups. (bench/run.py
never measures a direct target while a rebound one is mounted, for that reason.) Halt polling as
bench/run.py sets it. Run as root after tests/setup.sh.

Usage: bench/spikes/mounted-together.py passthrough_ll rand_read_4k_qd16 12"""
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))
import mounts  # noqa: E402
import run  # noqa: E402


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    driver, workload, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    q = run.inputs(mounts.new_workdir("together-in"), False)
    q.update(o_direct=False, invalidate=1)
    works = {name: mounts.new_workdir(f"together-{name}") for name in ("direct", "fast", "again")}
    sshd = mounts.start_sshd() if driver == "sshfs" else None
    mounted = {}
    try:
        for work in works.values():
            mounts.Mount(driver, "direct", work, sshd=sshd).prepare(1 << 30)
            if workload in run.READS and mounts.DRIVERS[driver][1] == "dir":
                run.WORKLOADS[workload](work / "src", dict(q, runtime=1))  # lays the files out
        with run.halt_polling(run.KERNEL_HALT_POLL_NS):
            for name, work in works.items():
                fast = name == "fast"
                m = mounts.Mount(driver, "rebound" if fast else "direct", work, sshd=sshd,
                                 config='mode = "fast"\n' if fast else None)
                m.start()
                mounted[name] = m
                if fast:
                    mounts.wait_for(lambda: mounts.rebound_ready(m.mnt), 10)
                run.settle(m.mnt)
                if workload in run.READS and mounts.DRIVERS[driver][1] != "dir":
                    run.WORKLOADS[workload](m.mnt, dict(q, runtime=1))  # through the driver
            results = {name: [] for name in works}
            names = list(works)
            for r in range(rounds):
                for name in names[r % 3:] + names[:r % 3]:
                    if workload in run.READS:
                        run.warm_backing_store(driver, works[name])
                    metric, value = next(iter(run.WORKLOADS[workload](mounted[name].mnt,
                                                                       q).items()))
                    results[name].append(value)
                print(f"round {r}:", {n: round(v[-1], 1) for n, v in results.items()},
                      flush=True)
        sign = -1 if run.lower_is_better(metric) else 1
        for name in ("fast", "again"):
            ratios = [(v / d) ** sign for v, d in zip(results[name], results["direct"])]
            print(f"{name}/direct, paired by round: median {statistics.median(ratios):.3f} "
                  f"({min(ratios):.3f}–{max(ratios):.3f})")
    finally:
        for m in mounted.values():
            m.stop()
        if sshd is not None:
            sshd.stop()
        for work in works.values():
            mounts.remove_workdir(work)


if __name__ == "__main__":
    main()
