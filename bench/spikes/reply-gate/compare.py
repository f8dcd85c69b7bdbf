#!/usr/bin/env python3
"""passthrough_ll mounted directly, through gate.c (each reply held at the driver's write until
its header is checked, the data never leaving the driver) and directly again (the control),
side by side. Gated targets: `gated` (Linux 6.6's synchronous wake-ups,
SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP), `gated-async` (without), with UNCHECKED=1
`gated-unchecked` (every reply let through unread: the notification's own cost), and with
POLL=1 `gated-poll` (the listener waits in poll(2) before each receive). Each round mounts
every target afresh in a rotated order and runs bench/run.py's WORKLOADs once on each, and
prints the gate's counts; a refused reply or a failed gate stops the run. At the end, per
target and workload: the median of the per-round ratios to direct (> 1 is faster), with their
min–max. Halt polling as bench/run.py sets it. Run as root after tests/setup.sh.

Usage: bench/spikes/reply-gate/compare.py ROUNDS WORKLOAD..."""
import os
import re
import signal
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))
import mounts  # noqa: E402
import run  # noqa: E402

LL = str(REPO / "tests/.build/bin/passthrough_ll")


def gate_binary(work):
    out = work / "gate"
    subprocess.run(["gcc", "-O2", "-Wall", "-o", str(out), str(HERE / "gate.c")], check=True)
    return str(out)


def measure(target, workload, work, q, gate):
    """The workload's figures on a fresh mount of `target`, and for a gated one the gate's
    counts (its last line): the measurement fails if the gate refused a reply or failed."""
    mnt = work / f"mnt-{target}"
    mnt.mkdir(exist_ok=True)
    argv = [LL, "-o", f"source={work / 'src'}", "-o", "xattr", str(mnt)]
    proc = None
    if workload in run.READS:
        run.warm_backing_store("passthrough_ll", work)
    if target.startswith("gated"):
        env = dict(os.environ, GATE_SYNC="0" if target == "gated-async" else "1",
                   GATE_CHECK="0" if target == "gated-unchecked" else "1",
                   GATE_POLL="1" if target == "gated-poll" else "0")
        proc = subprocess.Popen([gate, str(mnt)] + argv, stderr=subprocess.PIPE, text=True,
                                env=env)
    else:
        subprocess.run(argv, check=True)
    try:
        if not mounts.wait_for(lambda: os.path.ismount(mnt), 10):
            raise RuntimeError(f"{target}: not mounted after 10 s")
        run.settle(mnt)
        figures = run.WORKLOADS[workload](mnt, q)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        err = ""
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=10)
    if proc is None:
        return figures, ""
    counts = re.search(r"gate: (\d+) replies checked, (\d+) refused, (\d+) spliced", err)
    if proc.returncode != 0 or counts is None or int(counts[2]) != 0:
        raise RuntimeError(f"{target}: the gate failed or refused a reply: {err.strip()}")
    return figures, counts[0]


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    rounds, workloads = int(sys.argv[1]), sys.argv[2:]
    q = run.inputs(mounts.new_workdir("gate-in"), False)
    q.update(o_direct=False, invalidate=1)
    work = mounts.new_workdir("gate")
    (work / "src").mkdir(exist_ok=True)
    gate = gate_binary(work)
    for w in workloads:
        if w in run.READS:
            run.WORKLOADS[w](work / "src", dict(q, runtime=1))
    names = ["direct", "gated", "gated-async", "again"] + (
        ["gated-unchecked"] if os.environ.get("UNCHECKED") else []) + (
        ["gated-poll"] if os.environ.get("POLL") else [])
    results = {(n, w): [] for n in names for w in workloads}
    polling = os.environ.get("HALT_POLL_NS", str(run.KERNEL_HALT_POLL_NS))
    with run.halt_polling(run.halt_poll_ns(polling)):
        for r in range(rounds):
            for w in workloads:
                for name in names[r % len(names):] + names[:r % len(names)]:
                    figures, counts = measure(name, w, work, q, gate)
                    results[(name, w)].append(figures)
                    if counts:
                        print(f"round {r} {w} {name}: {counts}", flush=True)
                print(f"round {r} {w}:", {n: {k: round(v, 2) for k, v in
                                             results[(n, w)][-1].items() if k != "engine"}
                                          for n in names}, flush=True)
    for w in workloads:
        for metric in results[("direct", w)][0]:
            if metric == "engine":
                continue
            sign = -1 if run.lower_is_better(metric) else 1
            base = [f[metric] for f in results[("direct", w)]]
            for name in names[1:]:
                vals = [f[metric] for f in results[(name, w)]]
                ratios = [(v / d) ** sign for v, d in zip(vals, base)]
                print(f"{w} {metric} {name}/direct: median {statistics.median(ratios):.3f} "
                      f"({min(ratios):.3f}–{max(ratios):.3f}); direct median "
                      f"{statistics.median(base):.4g}, {name} {statistics.median(vals):.4g}")
    mounts.remove_workdir(work)


if __name__ == "__main__":
    main()
