"""Spike: stat and 4 KiB read latency of passthrough_ll on a clone of a queue whose first
descriptor (and a reference to the driver's) a holder keeps, vs the same driver mounted
directly; interleaved repetitions."""
import ctypes, fcntl, os, struct, subprocess, sys, time
PT, work = sys.argv[1], sys.argv[2]
src, mnt = f"{work}/src", f"{work}/mnt"
libc = ctypes.CDLL(None, use_errno=True)
def wait_file():
    deadline = time.time() + 5
    while time.time() < deadline and not os.path.exists(f"{mnt}/f"):
        time.sleep(0.01)
def held():
    K = os.open("/dev/fuse", os.O_RDWR)
    opts = f"fd={K},rootmode=40000,user_id=0,group_id=0".encode()
    assert libc.mount(b"spike", mnt.encode(), b"fuse.spike", 0, opts) == 0
    C = os.open("/dev/fuse", os.O_RDWR)
    fcntl.ioctl(C, 0x8004e500, struct.pack("I", K))
    drv = subprocess.Popen([PT, "-f", "-o", f"source={src},timeout=0", f"/dev/fd/{C}"], pass_fds=[C],
                           stderr=subprocess.DEVNULL)
    keep = os.dup(C); os.close(C)
    return drv, [K, keep]
def direct():
    drv = subprocess.Popen([PT, "-f", "-o", f"source={src},timeout=0", mnt], stderr=subprocess.DEVNULL)
    return drv, []
def lat(op, n=20000):
    out = []
    for _ in range(n):
        t = time.perf_counter_ns(); op(); out.append(time.perf_counter_ns() - t)
    out.sort(); return out[n // 2] / 1000
for rep in range(3):
    for name, how in (("direct", direct), ("holder+clone", held)):
        drv, fds = how(); wait_file()
        fd = os.open(f"{mnt}/f", os.O_RDONLY)
        s = lat(lambda: os.stat(f"{mnt}/f"))
        r = lat(lambda: os.pread(fd, 4096, 0))
        os.close(fd)
        print(f"rep {rep} {name:13s} stat median {s:6.1f} us   pread median {r:6.1f} us")
        subprocess.run(["umount", mnt]); drv.wait()
        for f in fds: os.close(f)
