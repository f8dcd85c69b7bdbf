#!/usr/bin/env python3
"""Fast mode beside the control over several full benchmark runs: for every row of every run
(rebound-fast/direct and direct-again/direct, as bench/run.py's tables give them), whether
fast mode measured under the control, the geometric means of both over all rows, the mean of
fast/control by repetition (each run rotates the target order by repetition, so a cost of the
order shows here), and by row across the runs, the rows fast mode is most under the control
first. Reads bench/run.py's JSON lines (through its own `summarize`); runs nothing.

Usage: bench/spikes/fast-vs-control.py bench/results/RUN.jsonl..."""
import math
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import run  # noqa: E402  (bench/run.py)

FAST, CONTROL = run.rebound_target("fast"), run.CONTROL


def geomean(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs))


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    fast, control, by_rep = [], [], defaultdict(list)
    by_row = defaultdict(lambda: ([], []))
    for path in sys.argv[1:]:
        for s in run.summarize(run.load([path])[1]):
            f, c = s["ratio"].get(FAST), s["ratio"].get(CONTROL)
            if not f or not c:
                continue
            fast.append(f)
            control.append(c)
            row = by_row[(s["driver"], s["workload"], s["metric"])]
            row[0].append(f)
            row[1].append(c)
            # Both paired with the same direct measurement, repetition by repetition.
            for rep, (pf, pc) in enumerate(zip(s["paired"][FAST], s["paired"][CONTROL])):
                by_rep[rep].append(pf / pc)
    under = sum(f < c for f, c in zip(fast, control))
    n = len(fast)
    print(f"rows: {n}; fast under the control on {under} "
          f"(a coin toss: {n / 2:.1f} ± {math.sqrt(n) / 2:.1f})")
    print(f"geometric mean over the rows: fast {geomean(fast):.3f}, "
          f"control {geomean(control):.3f}")
    for rep in sorted(by_rep):
        print(f"repetition {rep}: fast/control geometric mean {geomean(by_rep[rep]):.3f} "
              f"over {len(by_rep[rep])} rows")
    print("by row, geometric means over the runs:")
    rows = sorted(by_row.items(), key=lambda kv: geomean(kv[1][0]) / geomean(kv[1][1]))
    for (driver, workload, metric), (f, c) in rows:
        print(f"  {driver:15} {workload:19} {metric:14} fast {geomean(f):.3f} "
              f"control {geomean(c):.3f} (fast per run: {' '.join(f'{x:.2f}' for x in f)})")


if __name__ == "__main__":
    main()
