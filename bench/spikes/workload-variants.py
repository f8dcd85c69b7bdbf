#!/usr/bin/env python3
"""One bench workload on a driver mounted directly and under rebound in several variants,
side by side: each round mounts every target afresh (rotated order), runs bench/run.py's
WORKLOAD once on each, and prints its figure. At the end, per variant: the median of the
per-round ratios to direct (> 1 is faster), with their min–max. Pairing by round takes the
machine's slow drifts out of the comparison, so a variant's own cost shows with fewer rounds.

Variants are NAME=CONFIG (the text of rebound's config file, `\\n` for newlines) or
NAME=CONFIG@BINARY (another rebound build); `again=` is the driver mounted directly a second
time (the control). A KVM guest's halt polling is set as bench/run.py sets it (HALT_POLL_NS=N,
or keep). A read workload's files are laid out once first (in the backing directory, or
through a direct mount of an image). Run as root after tests/setup.sh.

Usage: bench/spikes/workload-variants.py passthrough_ll metadata 6 'fast=mode = "fast"' \\
           'sandbox-off=mode = "fast"\\n[sandbox]\\nprofile = "off"' again="""
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))
os.environ.setdefault("REBOUND_BIN", str(REPO / "target/release/rebound"))
import mounts  # noqa: E402
import run  # noqa: E402


def measure(driver, workload, work, q, sshd, config, binary):
    kind = "direct" if config is None else "rebound"
    m = mounts.Mount(driver, kind, work, config=config, rebound=binary, sshd=sshd)
    if workload in run.READS:
        run.warm_backing_store(driver, work)
    if mounts.DRIVERS[driver][1] == "image":
        # As bench/run.py does: fuse2fs leaks blocks under random writes, and e2fsck repairs.
        subprocess.run(["e2fsck", "-fy", str(m.img)], capture_output=True)
    m.start()
    try:
        if kind == "rebound":
            mounts.wait_for(lambda: mounts.rebound_ready(m.mnt), 10)
        run.settle(m.mnt)
        # The workload's first figure (latency's is the median stat).
        return next(iter(run.WORKLOADS[workload](m.mnt, q).items()))
    finally:
        m.stop()  # (not cleanup(): it removes the work directory all targets share)


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    driver, workload, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    targets = {"direct": (None, None)}
    for arg in sys.argv[4:]:
        name, _, spec = arg.partition("=")
        config, _, binary = spec.partition("@")
        targets[name] = (None, None) if not config else (
            config.replace("\\n", "\n") + "\n", binary or None)
    q = run.inputs(mounts.new_workdir("variants-in"), False)
    q.update(invalidate=1)
    work = mounts.new_workdir("variants")
    sshd = mounts.start_sshd() if driver == "sshfs" else None
    mounts.Mount(driver, "direct", work, sshd=sshd).prepare(1 << 30)
    # As bench/run.py: the queue-depth-16 jobs use libaio with O_DIRECT where the driver,
    # mounted directly, takes O_DIRECT writes. fio lays a read workload's files out once for all
    # targets: in the backing directory, or through a direct mount of an image.
    m = mounts.Mount(driver, "direct", work, sshd=sshd)
    m.start()
    try:
        q["o_direct"] = run.supports_o_direct(m.mnt)
        if workload in run.READS:
            run.WORKLOADS[workload](
                (work / "src") if mounts.DRIVERS[driver][1] == "dir" else m.mnt,
                dict(q, runtime=1))
    finally:
        m.stop()
    results = {name: [] for name in targets}
    names, metric = list(targets), None
    polling = os.environ.get("HALT_POLL_NS", str(run.KERNEL_HALT_POLL_NS))
    try:
        with run.halt_polling(run.halt_poll_ns(polling)):
            for r in range(rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    try:
                        metric, value = measure(driver, workload, work, q, sshd, *targets[name])
                    except Exception as e:
                        sys.exit(f"round {r}, {name}: {e}")
                    results[name].append(value)
                print(f"round {r}:", {n: round(v[-1], 3) for n, v in results.items()},
                      flush=True)
    finally:
        if sshd is not None:
            sshd.stop()
    sign = -1 if run.lower_is_better(metric) else 1
    for name, values in results.items():
        ratios = [(v / d) ** sign for v, d in zip(values, results["direct"])]
        print(f"{name}: {metric} median {statistics.median(values):.4g}, /direct median "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f})")
    mounts.remove_workdir(work)


if __name__ == "__main__":
    main()
