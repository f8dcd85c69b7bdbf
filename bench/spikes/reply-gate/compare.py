#!/usr/bin/env python3
"""passthrough_ll mounted directly, through gate.c (every reply held at the driver's write until
its header is checked, the data never leaving the driver) and directly again (the control),
side by side, the gate's wake-ups synchronous (Linux 6.6's SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP,
`gated`) and not (`gated-async`), and with UNCHECKED=1 a gate that lets every reply through
unread (`gated-unchecked`, the notification's own cost), and with POLL=1 a gate waiting in
poll(2), where the synchronous wake-up applies (`gated-poll`): each round mounts every target afresh in a rotated order and runs bench/run.py's
WORKLOADs once on each. At the end, per target and workload: the median of the per-round
ratios to direct (> 1 is faster), with their min–max. Halt polling as bench/run.py sets it.
Run as root after tests/setup.sh.

Usage: bench/spikes/reply-gate/compare.py ROUNDS WORKLOAD..."""
import os
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
        mounts.wait_for(lambda: os.path.ismount(mnt), 10)
        run.settle(mnt)
        return run.WORKLOADS[workload](mnt, q)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=10)
            if "0 refused" not in err:
                sys.exit(f"gate: {err.strip()}")


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
                    figures = measure(name, w, work, q, gate)
                    results[(name, w)].append(figures)
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
