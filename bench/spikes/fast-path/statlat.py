"""Median and p99 latency of n stat(2) calls on a path (after 2,000 to warm up)."""
import os, sys, time, statistics
p = sys.argv[1]
n = int(sys.argv[2])
for _ in range(2000): os.stat(p)
lat = []
for _ in range(n):
    t = time.perf_counter_ns(); os.stat(p); lat.append(time.perf_counter_ns() - t)
lat.sort()
print(f"median {lat[len(lat)//2]/1000:.1f} us p99 {lat[int(len(lat)*0.99)]/1000:.1f} us")
