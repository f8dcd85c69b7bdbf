#!/usr/bin/env python3
"""Fast mode beside the control over several full benchmark runs: for every row of every run
(ratio of medians to direct, as bench/run.py's tables), whether rebound-fast measured under
direct-again, the geometric means of both over all rows, and the mean of fast/control by
repetition position (each run rotates the target order by repetition, so a cost of the order
shows here). Reads bench/run.py's JSON lines; runs nothing.

Usage: bench/spikes/fast-vs-control.py bench/results/RUN.jsonl..."""
import json
import math
import statistics
import sys
from collections import defaultdict


def lower_is_better(metric):
    return metric == "s" or metric.endswith("_us")


def load(path):
    """{(driver, workload, metric, target): {rep: value}}"""
    rows = defaultdict(dict)
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "meta" in r or "error" in r:
                continue
            for k, v in r.items():
                if k in ("MiB/s", "ops/s", "s") or k.endswith("_us"):
                    rows[(r["driver"], r["workload"], k, r["target"])][r["rep"]] = v
    return rows


def ratio(a, b, metric):
    return b / a if lower_is_better(metric) else a / b


def geomean(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs))


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    fast, control, by_rep = [], [], defaultdict(list)
    for path in sys.argv[1:]:
        rows = load(path)
        for key in sorted({k[:3] for k in rows if k[3] == "rebound-fast"}):
            metric = key[2]
            med = {t: statistics.median(rows[key + (t,)].values())
                   for t in ("direct", "rebound-fast", "direct-again")}
            fast.append(ratio(med["rebound-fast"], med["direct"], metric))
            control.append(ratio(med["direct-again"], med["direct"], metric))
            for rep, v in rows[key + ("rebound-fast",)].items():
                c = rows[key + ("direct-again",)].get(rep)
                if c:
                    by_rep[rep].append(ratio(v, c, metric))
    under = sum(f < c for f, c in zip(fast, control))
    n = len(fast)
    print(f"rows: {n}; fast under the control on {under} "
          f"(a coin toss: {n / 2:.1f} ± {math.sqrt(n) / 2:.1f})")
    print(f"geometric mean over the rows: fast {geomean(fast):.3f}, "
          f"control {geomean(control):.3f}")
    for rep in sorted(by_rep):
        print(f"repetition {rep}: fast/control geometric mean {geomean(by_rep[rep]):.3f} "
              f"over {len(by_rep[rep])} rows")


if __name__ == "__main__":
    main()
