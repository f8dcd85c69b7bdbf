"""Spike: a driver on a clone of the kernel's queue; the holder keeps the clone open across the
driver's death, re-queues the request the driver had taken (FUSE_NOTIFY_RESEND) and answers it."""
import ctypes, fcntl, os, struct, subprocess, sys, threading, time, errno
PT, work = sys.argv[1], sys.argv[2]
src, mnt = f"{work}/src", f"{work}/mnt"
libc = ctypes.CDLL(None, use_errno=True)
K = os.open("/dev/fuse", os.O_RDWR)
opts = f"fd={K},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
if libc.mount(b"spike", mnt.encode(), b"fuse.spike", 0, opts) != 0:
    sys.exit(f"mount: {os.strerror(ctypes.get_errno())}")
C = os.open("/dev/fuse", os.O_RDWR)
fcntl.ioctl(C, 0x8004e500, struct.pack("I", K))
drv = subprocess.Popen([PT, "-f", "-o", f"source={src}", f"/dev/fd/{C}"], pass_fds=[C])
keep = os.dup(C)          # the holder's own reference to the driver's open file
os.close(C)
deadline = time.time() + 5
while time.time() < deadline and not os.path.exists(f"{mnt}/f"):
    time.sleep(0.01)
print("serving: read", len(open(f"{mnt}/f", "rb").read()), "bytes")
# A request the driver takes and cannot answer: flock(2) of a file the holder has locked in
# the source directory (passthrough_ll's flock blocks in the driver's thread).
held = os.open(f"{src}/f", os.O_RDONLY)
fcntl.flock(held, fcntl.LOCK_EX)
result = {}
def opener():
    try:
        fd = os.open(f"{mnt}/f", os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            result["r"] = "ok"
        finally:
            result["fd"] = fd
    except OSError as e:
        result["r"] = errno.errorcode[e.errno]
t = threading.Thread(target=opener); t.start()
time.sleep(0.5)
drv.kill(); drv.wait()
time.sleep(0.3)
print("after the driver's SIGKILL, the application:", result.get("r", "still waiting"))
# Re-queue what the dead driver had read, then read it from the holder's queue.
conn = [l.split()[2] for l in open("/proc/self/mountinfo") if l.split()[4] == mnt][0]
conn = int(conn.split(":")[0]) << 20 | int(conn.split(":")[1])
print("requests waiting:", open(f"/sys/fs/fuse/connections/{conn}/waiting").read().strip())
os.write(K, struct.pack("<IiQ", 16, 7, 0))   # FUSE_NOTIFY_RESEND
msg = os.read(K, 4 << 20)
length, opcode, unique, nodeid = struct.unpack_from("<IIQQ", msg)
print(f"resent request: opcode {opcode} unique {unique:#x} (resend bit {bool(unique >> 63)}) node {nodeid}")
os.write(K, struct.pack("<IiQ", 16, -errno.EAGAIN, unique))
t.join(2)
print("the application then got:", result.get("r"))
# The application's descriptor would be flushed by a driver no longer there: abort first.
with open(f"/sys/fs/fuse/connections/{conn}/abort", "w") as abort:
    abort.write("1")
try:
    os.close(result["fd"])
except OSError:
    pass
subprocess.run(["umount", "-l", mnt])
