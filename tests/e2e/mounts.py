"""Mounting the test drivers, directly or under rebound, and always cleaning up after them.

Owns: where rebound and the fixture drivers are, the command line of each driver, waiting for
a mount (a bounded poll of /proc/self/mountinfo), stopping a mount and checking that nothing is
left (no mount, no driver process, a clean ext4 image for fuse2fs), and the forced cleanup that
runs whatever happened. Every mount lives in its own directory /tmp/rebound-e2e-XXXX/, whose
path names its mount point and so identifies its processes by their command lines.
"""

import concurrent.futures
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD_BIN = REPO / "tests" / ".build" / "bin"
FIXTURES = REPO / "tests" / "fixtures"
TMP_PREFIX = "rebound-e2e-"
OWNER = "owner.pid"

MOUNT_TIMEOUT = 20.0  # seconds for a driver to mount
STOP_TIMEOUT = 30.0   # seconds for rebound or a driver to exit once asked to
WATCHDOG = 180.0      # seconds a mount may be used before its FUSE connection is aborted
FUSECTL = "/sys/fs/fuse/connections"
MiB = 1 << 20

MODES = ("direct", "rebound")


def rebound_bin():
    """REBOUND_BIN, relative to the repository root unless absolute."""
    path = Path(os.environ.get("REBOUND_BIN", "target/release/rebound"))
    return path if path.is_absolute() else REPO / path


STATUS_TIMEOUT = 10.0  # seconds `rebound status` may take to answer


def all_status():
    """`rebound status --json`: one object per mount served (those with a control socket in
    REBOUND_RUN_DIR, or the default run directory)."""
    out = subprocess.run([str(rebound_bin()), "status", "--json"], capture_output=True,
                         text=True, timeout=STATUS_TIMEOUT, check=True)
    return json.loads(out.stdout)


def mount_status(mnt):
    """The status object of the mount at mnt, or None when no rebound serves it."""
    return next((s for s in all_status() if s.get("mountpoint") == str(mnt)), None)


def rebound_ready(mnt):
    """Whether `rebound status` calls the mount at mnt ready (see `MountStatus::ready`); False
    while it cannot answer."""
    with contextlib.suppress(subprocess.SubprocessError, ValueError):
        return bool((mount_status(mnt) or {}).get("ready"))
    return False


# Where the drivers of the suite are run from: the checkout until install_programs() copies
# them under /tmp for the session.
PROGRAMS = {"bin": BUILD_BIN, "scripts": FIXTURES}


def fixture_bin(name):
    """A built fixture driver (tests/setup.sh builds them into tests/.build/bin)."""
    return PROGRAMS["bin"] / name


def fixture_script(name):
    """A fixture driver script of tests/fixtures (rogue_driver.py, hostile_driver.py)."""
    return PROGRAMS["scripts"] / name


def install_programs():
    """Copies the built fixture drivers and the fixture scripts to a fresh /tmp workdir, laid
    out as in the checkout, and runs every driver of the session from there: a checkout under
    /tmp is common (CI, a user's scratch clone), and the sandbox hides the rest of /tmp from a
    driver, so each test checks that a driver still sees its own program there (its
    executable, a script's sibling modules, an LD_PRELOAD library). Returns the workdir."""
    d = new_workdir("programs")
    shutil.copytree(BUILD_BIN, d / "tests" / ".build" / "bin", symlinks=True)
    shutil.copytree(FIXTURES, d / "tests" / "fixtures",
                    ignore=shutil.ignore_patterns("gofuse-loopback", "*.c", "__pycache__"))
    PROGRAMS.update(bin=d / "tests" / ".build" / "bin", scripts=d / "tests" / "fixtures")
    return d


# --- polling, mounts, processes -------------------------------------------------------------

def side_by_side(*sides):
    """Runs each of `sides` (functions of no arguments, each using a mount of its own) in a
    thread of its own and returns their results in order: a comparison's direct and rebound
    runs at once, each mount serving only its own side. Most of a run waits on its mount's
    round trips, so two take little more than the time of one (the suite's time, not a
    measurement). The umask is fsops' (022) throughout: each run sets it and puts back what
    it found, which must be the same for both."""
    old = os.umask(0o022)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(sides)) as pool:
            futures = [pool.submit(side) for side in sides]
            return [f.result() for f in futures]
    finally:
        os.umask(old)


def wait_for(cond, timeout, interval=0.05):
    """Polls cond() until it returns something truthy (returned) or timeout passes (None)."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)


def _unescape(field_):
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_)


def mount_fstype(path):
    """The file system type mounted at path (the topmost mount), or None."""
    fstype = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            if _unescape(pre.split()[4]) == str(path):
                fstype = post.split()[0]
    return fstype


def fuse_connection(path):
    """The directory of path's FUSE connection in fusectl, or None."""
    dev = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if _unescape(fields[4]) == str(path):
                dev = fields[2]
    if dev is None:
        return None
    major, minor = (int(x) for x in dev.split(":"))
    conn = Path(FUSECTL) / str((major << 20) | minor)  # the kernel's dev_t encoding
    return conn if conn.is_dir() else None


def abort_connection(conn):
    """Aborts a FUSE connection: every request waiting on the driver fails with ENOTCONN."""
    with contextlib.suppress(OSError):
        (Path(conn) / "abort").write_text("1")


def is_fuse_mounted(path):
    fstype = mount_fstype(path)
    return fstype is not None and fstype.startswith("fuse")


def is_mounted(path):
    return mount_fstype(path) is not None


def _proc_stat(pid):
    """(state, ppid) of a process, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[1])


def comm(pid):
    """The command name of pid, or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def cgroups(pid):
    """The cgroups of pid (its /proc/PID/cgroup), or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return ""


def alive(pid):
    """True while pid exists and is not a zombie."""
    st = _proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def procs_mentioning(needle):
    """{pid: cmdline} of the live processes (not this one) whose command line contains needle."""
    needle_b = os.fsencode(str(needle))
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if needle_b in cmdline and alive(int(entry)):
            found[int(entry)] = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
    return found


def children(pid):
    """Live direct children of pid."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _proc_stat(int(entry))
            if st is not None and st[1] == pid and st[0] not in ("Z", "X"):
                kids.append(int(entry))
    return kids


def descendants(pid):
    out, todo = [], [pid]
    while todo:
        for kid in children(todo.pop()):
            out.append(kid)
            todo.append(kid)
    return out


def kill_all(pids, timeout=5.0):
    """SIGTERM, then SIGKILL what is still alive after timeout."""
    pids = [p for p in pids if alive(p)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if wait_for(lambda: not any(alive(p) for p in pids), timeout):
            return


def umount(path):
    """umount, falling back to a lazy unmount. True when path is no longer a mount point."""
    for cmd in (["umount"], ["umount", "-l"]):
        if not is_mounted(path):
            return True
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(cmd + [str(path)], capture_output=True, timeout=STOP_TIMEOUT)
    return not is_mounted(path)


def e2fsck(image):
    """(ok, output) of a read-only forced check of an ext2/3/4 image."""
    res = subprocess.run(["e2fsck", "-fn", str(image)], capture_output=True, text=True,
                         timeout=120)
    return res.returncode == 0, res.stdout + res.stderr


def make_image(image, size, mkfs):
    """A sparse file of `size` bytes at `image`, formatted by the command `mkfs` + [image]."""
    with open(image, "wb") as f:
        f.truncate(size)
    subprocess.run(mkfs + [str(image)], check=True, capture_output=True, timeout=60)


def ntfsfix(image):
    """(ok, output) of ntfs-3g's own read-only check of an NTFS image."""
    res = subprocess.run(["ntfsfix", "-n", str(image)], capture_output=True, text=True,
                         timeout=120)
    return res.returncode == 0, res.stdout + res.stderr


# What a read-only image (squashfuse's, archivemount's) holds: a small tree with the kinds of
# entries the read-only differential test looks at.
SQUASHFS_TREE = {"a.txt": b"alpha\n", "dir/b.bin": bytes(range(256)) * 64,
                 "dir/sub/c.txt": b"gamma\n" * 1000, "empty": b""}


def make_read_only_image(image, tree_dir, kind):
    """SQUASHFS_TREE and a symlink, packed by mksquashfs or tar (kind "squashfs", "tar")."""
    for rel, data in SQUASHFS_TREE.items():
        path = tree_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    os.symlink("a.txt", tree_dir / "link")
    pack = (["mksquashfs", str(tree_dir), str(image), "-quiet", "-noappend"]
            if kind == "squashfs" else ["tar", "-cf", str(image), "-C", str(tree_dir), "."])
    subprocess.run(pack, check=True, capture_output=True, timeout=60)


# --- sshd for sshfs -------------------------------------------------------------------------

@dataclass
class Sshd:
    """A private sshd on 127.0.0.1 that sshfs mounts from, with its own keys and config."""
    dir: Path
    port: int
    client_key: Path
    proc: subprocess.Popen

    def stop(self):
        # Per-connection sshd processes retitle themselves ("sshd: root@notty"), so they are
        # found as the listener's descendants, not by command line.
        kids = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        kill_all(kids + list(procs_mentioning(self.dir)))
        shutil.rmtree(self.dir, ignore_errors=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def start_sshd():
    d = new_workdir("sshd")
    try:
        for key in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)],
                           check=True, capture_output=True, timeout=30)
        shutil.copy(d / "client_key.pub", d / "authorized_keys")
        port = free_port()
        (d / "sshd_config").write_text(
            f"ListenAddress 127.0.0.1\n"
            f"Port {port}\n"
            f"HostKey {d / 'host_key'}\n"
            f"AuthorizedKeysFile {d / 'authorized_keys'}\n"
            f"PidFile {d / 'sshd.pid'}\n"
            "PermitRootLogin prohibit-password\n"
            "PubkeyAuthentication yes\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "UsePAM no\n"
            "StrictModes no\n"
            "Subsystem sftp internal-sftp\n"
            "LogLevel INFO\n")
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        log = open(d / "sshd.log", "wb")
        proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(d / "sshd_config")],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)
        raise
    sshd = Sshd(d, port, d / "client_key", proc)
    if not wait_for(lambda: proc.poll() is not None or _port_open(port), MOUNT_TIMEOUT) \
            or proc.poll() is not None:
        output = (d / "sshd.log").read_text(errors="replace")
        sshd.stop()
        raise RuntimeError(f"sshd did not listen on 127.0.0.1:{port}:\n{output}")
    return sshd


# --- drivers --------------------------------------------------------------------------------

# name: (daemonizes by default, backing store: "dir", "image" (ext4), "ntfs", "squashfs",
# "tar", "cipher" (a directory the driver encrypts into, initialised first) or "own" (a
# directory the driver keeps in a format of its own))
DRIVERS = {
    "fuse2fs": (True, "image"),
    "passthrough_ll": (True, "dir"),
    "passthrough_ll-f": (False, "dir"),
    "passthrough_ll-clone_fd": (True, "dir"),
    "passthrough_fh": (True, "dir"),
    "sshfs": (True, "dir"),
    "gofuse": (False, "dir"),
    # Packaged drivers (Debian 12), unmodified.
    "bindfs": (True, "dir"),
    "fuse-overlayfs": (True, "dir"),   # src is the upper layer, over an empty lower one
    "unionfs": (True, "dir"),          # unionfs-fuse: src read-write over an empty branch
    "mergerfs": (True, "dir"),         # src and a second, empty branch
    "gocryptfs": (True, "cipher"),
    "securefs": (False, "cipher"),
    "ntfs-3g": (True, "ntfs"),
    "squashfuse": (True, "squashfs"),  # read-only
    "archivemount": (True, "tar"),     # read-only (it writes an archive back at unmount only)
    "encfs": (True, "cipher"),
    "rclone": (False, "dir"),          # rclone mount of a local directory
    "fuser": (False, "own"),           # fuser's `simple` example (Rust), its data directory
    "lxcfs": (False, "none"),          # /proc files for containers, on a private mount point
}
PASSWORD = "rebound-e2e"


def image_path(driver, work, reflink=False):
    """Where a driver's image lives in its work directory."""
    name = {"ntfs": "ntfs.img", "squashfs": "tree.sqfs", "tar": "tree.tar"}.get(
        DRIVERS[driver][1], "disk.img")
    return work / ("img" if reflink else "") / name


# How each driver is told to let other users in (allow_other), where the tests need it:
# arguments to add to its command line, and where (an index, or None: at the end).
ALLOW_OTHER = {
    "gofuse": (1, ["-allow-other"]),
    "gocryptfs": (1, ["-allow_other"]),
    "rclone": (2, ["--allow-other"]),  # after `rclone mount`
    **{d: (None, ["-o", "allow_other"]) for d in (
        "fuse2fs", "passthrough_ll", "passthrough_ll-clone_fd", "passthrough_fh", "sshfs",
        "bindfs", "fuse-overlayfs", "unionfs", "mergerfs", "securefs", "ntfs-3g", "encfs")},
}


def driver_argv(driver, src, img, mnt, sshd=None, allow_other=False):
    """The driver's own command line, exactly as a user would type it (with allow_other,
    letting other users in, as ALLOW_OTHER says)."""
    argv = _driver_argv(driver, src, img, mnt, sshd)
    if not allow_other:
        return argv
    at, extra = ALLOW_OTHER[driver]
    at = len(argv) if at is None else at
    return argv[:at] + extra + argv[at:]


def _driver_argv(driver, src, img, mnt, sshd=None):
    ll = [str(fixture_bin("passthrough_ll")), "-o", f"source={src}", "-o", "xattr"]
    if driver == "fuse2fs":
        return ["fuse2fs", str(img), str(mnt), "-o", "fakeroot"]
    if driver == "passthrough_ll":
        return ll + [str(mnt)]
    if driver == "passthrough_ll-f":
        return ll + ["-f", str(mnt)]
    if driver == "passthrough_ll-clone_fd":
        return ll + ["-o", "clone_fd", str(mnt)]
    if driver == "passthrough_fh":
        # passthrough_fh exposes /; libfuse's subdir module narrows it to src.
        return [str(fixture_bin("passthrough_fh")), "-o", f"modules=subdir,subdir={src}",
                str(mnt)]
    if driver == "sshfs":
        assert sshd is not None, "sshfs needs the sshd fixture"
        return ["sshfs", "-p", str(sshd.port), "-o",
                f"IdentityFile={sshd.client_key},StrictHostKeyChecking=no,"
                "UserKnownHostsFile=/dev/null,BatchMode=yes,LogLevel=ERROR",
                f"root@127.0.0.1:{src}", str(mnt)]
    if driver == "gofuse":
        return [str(fixture_bin("gofuse-loopback")), str(src), str(mnt)]
    work = src.parent
    if driver == "bindfs":
        return ["bindfs", str(src), str(mnt)]
    if driver == "fuse-overlayfs":
        return ["fuse-overlayfs", "-o",
                f"lowerdir={work / 'lower'},upperdir={src},workdir={work / 'overlay-work'}",
                str(mnt)]
    if driver == "unionfs":
        return ["unionfs", "-o", "cow", f"{src}=RW:{work / 'lower'}=RO", str(mnt)]
    if driver == "mergerfs":
        return ["mergerfs", f"{src}:{work / 'lower'}", str(mnt)]
    if driver == "gocryptfs":
        return ["gocryptfs", "-q", "-passfile", str(work / "password"), str(src), str(mnt)]
    if driver == "securefs":
        return ["securefs", "mount", "--pass", PASSWORD, str(src), str(mnt)]
    if driver in ("ntfs-3g", "squashfuse"):
        return [driver, str(img), str(mnt)]
    if driver == "archivemount":
        return ["archivemount", "-o", "readonly", str(img), str(mnt)]
    if driver == "encfs":
        return ["encfs", f"--extpass={work / 'password.sh'}", str(src), str(mnt)]
    if driver == "rclone":
        return ["rclone", "mount", "--vfs-cache-mode", "writes", str(src), str(mnt)]
    if driver == "lxcfs":
        return ["lxcfs", "-p", str(work / "lxcfs.pid"), str(mnt)]
    if driver == "fuser":
        return [str(fixture_bin("fuser-simple")), "--data-dir", str(src), "--mount-point",
                str(mnt)]
    raise ValueError(f"unknown driver {driver}")


def descriptor_shortfall(driver, inodes):
    """Why driver cannot serve `inodes` inodes at once within the open-file limit it inherits
    from this process, or None. passthrough_ll keeps an O_PATH descriptor for every inode the
    kernel knows of; the other drivers need none per inode."""
    if not driver.startswith("passthrough_ll"):
        return None
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit >= inodes + 1000:
        return None
    return (f"{driver} keeps a descriptor per inode: {inodes} inodes do not fit in its "
            f"open-file limit of {limit} (raising the hard limit needs CAP_SYS_RESOURCE)")


def new_workdir(tag="mount"):
    """A fresh /tmp/rebound-e2e-TAG-XXXX directory, marked with the pid of this process so that
    another test session can tell an abandoned one (see stale_workdirs) from one in use."""
    path = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{tag}-", dir="/tmp"))
    # Other users may pass through (not list) it to a mount inside: mkdtemp makes it 0700,
    # and the tests' unprivileged user would then see EACCES at every step of any driver.
    path.chmod(0o711)
    (path / OWNER).write_text(str(os.getpid()))
    return path


def workdirs(owner=None):
    """Our directories under /tmp: all, or those of one owner pid."""
    found = []
    for path in sorted(Path("/tmp").glob(TMP_PREFIX + "*")):
        try:
            pid = int((path / OWNER).read_text())
        except (OSError, ValueError):
            pid = None
        if owner is None or pid == owner:
            found.append((path, pid))
    return [p for p, _ in found] if owner is not None else found


def stale_workdirs(grace=60.0):
    """Directories whose owning process is gone (an interrupted run). One without an owner
    file is only stale after grace seconds: it may be being created right now."""
    now = time.time()
    stale = []
    for path, pid in workdirs():
        if pid is None:
            with contextlib.suppress(OSError):
                if now - path.stat().st_mtime > grace:
                    stale.append(path)
        elif not alive(pid):
            stale.append(path)
    return stale


def reap_stale_workdirs():
    """Unmounts, stops and removes what interrupted runs left (their sshd, their drivers)."""
    for path in stale_workdirs():
        with open("/proc/self/mountinfo") as f:
            inside = [p for p in (_unescape(line.split()[4]) for line in f)
                      if p.startswith(str(path) + "/")]
        for mnt in inside:
            conn = fuse_connection(mnt)
            if conn is not None:
                abort_connection(conn)
        kill_all(list(procs_mentioning(path)))
        remove_workdir(path)


def remove_workdir(work):
    """Removes work unless something is still mounted inside it (then it is left, loudly)."""
    with open("/proc/self/mountinfo") as f:
        busy = [p for p in (_unescape(line.split()[4]) for line in f)
                if p == str(work) or p.startswith(str(work) + "/")]
    for path in busy:
        umount(path)
    if any(is_mounted(p) for p in busy):
        raise RuntimeError(f"still mounted, not removing {work}: {busy}")
    shutil.rmtree(work, ignore_errors=True)


@dataclass
class Mount:
    """One driver mounted at work/mnt, directly or under rebound."""
    driver: str
    mode: str
    work: Path
    sshd: Sshd = None
    config: str = None  # text of a rebound config file, passed with --config
    driver_env: dict = None  # more environment for the driver (through env(1))
    # The image lives on a file system that can clone it (scripts/reflink-dir.sh), for
    # rebound's `image` checkpoints.
    reflink: bool = False
    allow_other: bool = False  # other users may use the mount (see ALLOW_OTHER)
    rebound: Path = None  # the rebound binary that serves it (default: rebound_bin())
    proc: subprocess.Popen = None  # rebound, or a foreground driver, or a daemonizing one's parent
    driver_pids: list = field(default_factory=list)
    returncode: int = None  # of rebound or of a foreground driver, once stopped
    stopped: bool = False  # set by stop(), or by a test that stopped the mount itself
    watchdog: float = WATCHDOG
    watchdog_fired: bool = False
    _timer: threading.Timer = None

    @property
    def mnt(self):
        return self.work / "mnt"

    @property
    def src(self):
        return self.work / "src"

    @property
    def img(self):
        return image_path(self.driver, self.work, self.reflink)

    @property
    def daemonizes(self):
        return DRIVERS[self.driver][0]

    def argv(self):
        driver = driver_argv(self.driver, self.src, self.img, self.mnt, self.sshd,
                             self.allow_other)
        if self.driver_env:
            driver = ["env", *(f"{k}={v}" for k, v in self.driver_env.items())] + driver
        if self.mode == "direct":
            return driver
        cmd = [str(self.rebound or rebound_bin()), "run"]
        if self.config is not None:
            cfg = self.work / "rebound.toml"
            # IMAGE in a config stands for this mount's image file (fuse2fs' pre_restart).
            cfg.write_text(self.config.replace("@IMAGE@", str(self.img)))
            cmd += ["--config", str(cfg)]
        return cmd + ["--"] + driver

    def output(self):
        """What the process we started (rebound or the driver) wrote to stdout and stderr,
        and for sshfs the end of the sshd log."""
        text = "".join(
            (self.work / name).read_text(errors="replace")
            for name in ("stdout", "stderr") if (self.work / name).exists())
        if self.sshd is not None:
            log = (self.sshd.dir / "sshd.log").read_text(errors="replace").splitlines()
            text += "\n--- sshd.log (end) ---\n" + "\n".join(log[-15:])
        return text

    def stderr(self):
        path = self.work / "stderr"
        return path.read_text(errors="replace") if path.exists() else ""

    def prepare(self, image_size):
        self.mnt.mkdir()
        store = DRIVERS[self.driver][1]
        if self.reflink:
            subprocess.run([REPO / "scripts" / "reflink-dir.sh", self.img.parent,
                            str(image_size * 2 // MiB + 300)], check=True)
        if store == "image":
            make_image(self.img, image_size, ["mkfs.ext4", "-q", "-F"])
        elif store == "ntfs":
            make_image(self.img, image_size, ["mkntfs", "-q", "-F", "-f"])
        elif store in ("squashfs", "tar"):
            make_read_only_image(self.img, self.work / "tree", store)
        else:
            self.src.mkdir()
            for extra in ("lower", "overlay-work"):
                (self.work / extra).mkdir()
        if self.driver == "gocryptfs":
            (self.work / "password").write_text(PASSWORD)
            subprocess.run(["gocryptfs", "-q", "-init", "-passfile", str(self.work / "password"),
                            str(self.src)], check=True, capture_output=True, timeout=60)
        if self.driver == "securefs":
            subprocess.run(["securefs", "create", "--pass", PASSWORD, str(self.src)],
                           check=True, capture_output=True, timeout=60)
        if self.driver == "encfs":
            # It asks for the password through a program, at each start (each restart too).
            script = self.work / "password.sh"
            script.write_text(f"#!/bin/sh\necho {PASSWORD}\n")
            script.chmod(0o700)
            scratch = self.work / "encfs-init"
            scratch.mkdir()
            subprocess.run(["encfs", "--standard", f"--extpass={script}", str(self.src),
                            str(scratch)], check=True, capture_output=True, timeout=60)
            subprocess.run(["fusermount", "-u", str(scratch)], check=True, timeout=60)

    def start(self):
        """Starts the driver (under rebound in rebound mode) and waits for the mount."""
        with open(self.work / "stdout", "wb") as out, open(self.work / "stderr", "wb") as err:
            self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=err, start_new_session=True)
        expect_exit = self.mode == "direct" and self.daemonizes

        def ready():
            if is_fuse_mounted(self.mnt):
                return True
            rc = self.proc.poll()
            if rc is not None and (rc != 0 or not expect_exit):
                raise RuntimeError(
                    f"{self.describe()} exited with {rc} before mounting:\n{self.output()}")
            return False

        if not wait_for(ready, MOUNT_TIMEOUT):
            raise RuntimeError(f"{self.describe()} did not mount within {MOUNT_TIMEOUT} s:\n"
                               f"{self.output()}")
        if expect_exit:
            # The parent exits once its daemon child has mounted.
            self.proc.wait(timeout=STOP_TIMEOUT)
        if self.mode == "rebound":
            # What `mount -t rebound.DRIVER` waits for, as the direct mount waits for the
            # parent of a daemonizing driver (gocryptfs deadlocks on a request that comes
            # before its own first look at the mount).
            wait_for(lambda: self.proc.poll() is not None or rebound_ready(self.mnt),
                     MOUNT_TIMEOUT, interval=0.02)
        self._arm_watchdog()
        # The processes serving the mount: every process that names the mount point (the
        # driver; rebound too in rebound mode) and what they started (sshfs's ssh).
        named = set(procs_mentioning(self.mnt))
        self.driver_pids = sorted(named.union(*(descendants(p) for p in named)))

    def _arm_watchdog(self):
        """A hung driver (or proxy) must fail the test, not hang the suite: after `watchdog`
        seconds the mount's FUSE connection is aborted, so blocked calls return ENOTCONN."""
        conn = fuse_connection(self.mnt)
        if conn is None:
            return

        def fire():
            self.watchdog_fired = True
            abort_connection(conn)

        self._timer = threading.Timer(self.watchdog, fire)
        self._timer.daemon = True
        self._timer.start()

    def _disarm_watchdog(self):
        if self._timer is not None:
            self._timer.cancel()

    def describe(self):
        return f"{self.driver} ({self.mode}) on {self.mnt}"

    def leftover_processes(self):
        """Live processes that still serve or name this mount."""
        left = {p: "" for p in self.driver_pids if alive(p)}
        left.update(procs_mentioning(self.mnt))
        for pid in left:
            with contextlib.suppress(OSError):
                left[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        return left

    def stop(self):
        """The normal way down: SIGTERM to rebound, `umount` for a direct mount. Returns the
        exit status of rebound or of a foreground driver (None for a daemonized one)."""
        self._disarm_watchdog()
        if self.stopped:
            return self.returncode
        self.stopped = True
        if self.mode == "rebound":
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            self.returncode = self.proc.wait(timeout=STOP_TIMEOUT)
        else:
            if is_mounted(self.mnt):
                subprocess.run(["umount", str(self.mnt)], check=True, capture_output=True,
                               timeout=STOP_TIMEOUT)
            if not self.daemonizes:
                self.returncode = self.proc.wait(timeout=STOP_TIMEOUT)
            # A daemon finishes its work (fuse2fs writes the image) after the unmount.
            wait_for(lambda: not any(alive(p) for p in self.driver_pids), STOP_TIMEOUT)
        return self.returncode

    def assert_stopped_cleanly(self):
        """After stop(): exit status 0, no mount, no process, a clean image."""
        assert not self.watchdog_fired, \
            f"{self.describe()} hung: its FUSE connection was aborted after {self.watchdog} s"
        assert self.returncode in (0, None), \
            f"{self.describe()} exited with {self.returncode}:\n{self.output()}"
        assert not is_mounted(self.mnt), f"{self.mnt} is still mounted after stopping"
        left = wait_for(lambda: not self.leftover_processes(), 5.0)
        assert left, f"processes left behind: {self.leftover_processes()}"
        if DRIVERS[self.driver][1] == "image":
            ok, report = e2fsck(self.img)
            # With what rebound logged: whether it had to kill the driver on its way out.
            assert ok, (f"e2fsck -fn {self.img} after {self.describe()}:\n{report}\n"
                        f"--- output ---\n{self.output()[-4000:]}")
        if DRIVERS[self.driver][1] == "ntfs":
            ok, report = ntfsfix(self.img)
            assert ok, (f"ntfsfix -n {self.img} after {self.describe()}:\n{report}\n"
                        f"--- output ---\n{self.output()[-4000:]}")

    def cleanup(self):
        """Whatever state things are in: no process, no mount, no directory left. A mount still
        there at this point is being thrown away, so its connection is aborted first: that
        unblocks anything stuck on it, including umount."""
        self._disarm_watchdog()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                conn = fuse_connection(self.mnt)
                if conn is not None:
                    abort_connection(conn)
                self.proc.kill()
                self.proc.wait(timeout=10)
        # A driver whose injected faults turn its exit into a jump back to its start forks
        # and mounts again when stopped (the campaign met one): such processes are killed
        # outright, a few rounds at most.
        for _ in range(5):
            conn = fuse_connection(self.mnt)
            if conn is not None:
                abort_connection(conn)
            umount(self.mnt)
            left = list(self.leftover_processes())
            if not left and not is_mounted(self.mnt):
                break
            kill_all(left, timeout=0.0 if is_mounted(self.mnt) else 5.0)
        keep = os.environ.get("REBOUND_E2E_KEEP_LOGS")
        if keep:  # for debugging: what rebound or the driver wrote outlives the mount
            for name in ("stdout", "stderr"):
                if (self.work / name).exists():
                    Path(keep).mkdir(parents=True, exist_ok=True)
                    shutil.copy(self.work / name, Path(keep) / f"{self.work.name}.{name}")
        if self.reflink:
            subprocess.run([REPO / "scripts" / "reflink-dir.sh", "--remove", self.img.parent],
                           check=False)
        remove_workdir(self.work)


@contextlib.contextmanager
def mount_driver(driver, mode, *, sshd=None, image_size=64 * MiB, config=None,
                 after_stop=None, watchdog=WATCHDOG, driver_env=None, reflink=False,
                 allow_other=False, rebound=None):
    """Mounts driver in mode ("direct" or "rebound") in a fresh /tmp directory and yields the
    Mount. On a normal exit it stops the mount, asserts a clean stop and calls after_stop(m)
    (to inspect the backing store); in every case it then cleans up."""
    assert mode in MODES, mode
    m = Mount(driver, mode, new_workdir(driver), sshd=sshd, config=config, watchdog=watchdog,
              driver_env=driver_env, reflink=reflink, allow_other=allow_other, rebound=rebound)
    try:
        m.prepare(image_size)
        m.start()
        yield m
        m.stop()
        m.assert_stopped_cleanly()
        if after_stop is not None:
            after_stop(m)
    finally:
        m.cleanup()


def run_rebound(args, timeout, cwd=None):
    """Runs `rebound ARGS...` to completion; returns (returncode, stdout, stderr, seconds).
    Raises subprocess.TimeoutExpired (after killing it) when it takes longer than timeout."""
    start = time.monotonic()
    proc = subprocess.Popen([str(rebound_bin())] + list(args), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all([proc.pid] + descendants(proc.pid))
        proc.communicate()
        raise
    return proc.returncode, out, err, time.monotonic() - start
