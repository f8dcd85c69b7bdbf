"""A scripted sequence of file operations against a mounted directory.

Owns: the operations the differential tests replay on a direct and on a rebound mount, and the
normalisation of their results. `run(root)` works in `root/fsops` and returns a list of
`(step, outcome)` pairs, where outcome is the name of the errno the step failed with, or starts
with "ok" when every check in the step held, followed by details that must match between two
mounts of the same driver (sizes, modes, link counts, digests of data); a failed data check
reads "MISMATCH ...". Things that legitimately differ between two mounts (inode numbers,
current times, absolute paths, lock owners' pids) never appear in an outcome; error codes and
data always do. RENAME_NOREPLACE, which os.rename cannot ask for, goes through glibc's
renameat2 (ctypes), so FUSE_RENAME2 is covered too.

One timing effect is normalised: libfuse's high-level API (it shows with fuse2fs) renames a
file unlinked while it thinks the file is open to `.fuse_hidden*`, and since the kernel sends
RELEASE asynchronously after close(2), whether a just-closed file is hidden or removed depends
on which request a driver thread handles first (and a race inside libfuse can leave such a file
behind for good). Listings leave those names out, and rmdir waits (bounded) for them to go,
then removes orphans.
"""

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import mmap
import os
import signal
import stat
import subprocess
import sys
import time

MiB = 1 << 20
SMALL = b"hello, rebound\n"
READDIR_ENTRIES = 3000
# The owner root gives a file in step_other_users: no one who runs fsops.
OTHER_USER = 65533
CHILD_TIMEOUT = 30  # seconds a lock-probing child process may take

# Runs in a second process, so that POSIX and flock locks held by the test process conflict.
# argv: PATH OP; prints "ok", the errno name, or (for getlk) the lock type it sees.
LOCK_PROBE = r"""
import errno, fcntl, os, struct, sys
path, op = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_RDWR)
try:
    if op == "lockf_ex":
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    elif op == "lockf_sh":
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    elif op == "lockf_ex_range_100_200":
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 100, 100)
    elif op == "flock_ex":
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    elif op == "getlk":
        # struct flock on x86-64 and arm64: short type, short whence, off_t start, off_t len,
        # pid_t pid, padded to 32 bytes. The pid is not printed: it differs between runs.
        fmt = "=hh4xqqi4x"
        got = fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack(fmt, fcntl.F_WRLCK, 0, 0, 0, 0))
        l_type, _, start, length, _ = struct.unpack(fmt, got)
        names = {fcntl.F_RDLCK: "F_RDLCK", fcntl.F_WRLCK: "F_WRLCK", fcntl.F_UNLCK: "F_UNLCK"}
        print(names.get(l_type, l_type), start, length)
        sys.exit(0)
    else:
        raise SystemExit("unknown op " + op)
    print("ok")
except OSError as e:
    print(errno.errorcode.get(e.errno, str(e.errno)))
"""


def pattern(n, seed):
    """n deterministic pseudo-random bytes; a different seed gives unrelated bytes."""
    return hashlib.shake_256(seed.encode()).digest(n)


def digest(data):
    return hashlib.sha256(data).hexdigest()[:16]


def errname(e):
    return errno.errorcode.get(e.errno, f"errno{e.errno}")


def mode_str(st):
    return oct(st.st_mode)


_libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
RENAME_NOREPLACE = 1


def renameat2(src, dst, flags):
    if _libc.renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), src)


def in_child(fn):
    """fn()'s outcome, from a forked child: a fault on a mapping (SIGBUS, when a page's read
    fails) ends the child, and is the outcome, rather than ending the test run."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            outcome = fn()
        except OSError as e:
            outcome = errname(e)
        except BaseException as e:  # noqa: BLE001 (reported, in the child)
            outcome = f"raised {type(e).__name__}"
        os.write(w, outcome.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        said = f.read().decode()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return signal.Signals(os.WTERMSIG(status)).name
    return said


def write_file(path, data, chunk=100_000, mode=0o644):
    """Writes data in chunks that are not page aligned, then closes."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        for off in range(0, len(data), chunk):
            view = memoryview(data)[off:off + chunk]
            while view:
                view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def read_file(path, chunk=65_537):
    out = bytearray()
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            got = os.read(fd, chunk)
            if not got:
                return bytes(out)
            out += got
    finally:
        os.close(fd)


def check(data, expected):
    """ "ok sha=..." when data is what was expected, else a MISMATCH naming both digests."""
    if data == expected:
        return f"ok sha={digest(data)}"
    return (f"MISMATCH len={len(data)} sha={digest(data)} "
            f"expected len={len(expected)} sha={digest(expected)}")


def is_hidden(name):
    return name.startswith(".fuse_hidden")


def listdir(path):
    """os.listdir without libfuse's .fuse_hidden* files."""
    return [n for n in os.listdir(path) if not is_hidden(n)]


def settle_hidden(path, settle=2.0):
    """Waits (at most settle seconds) for the delayed RELEASEs to remove libfuse's
    .fuse_hidden* files in the directory path. One can also stay for good: libfuse checks "is
    it open?" and marks the node hidden in two steps, and a RELEASE handled by another thread
    in between leaves the renamed file orphaned. Those orphans are unlinked (nothing has them
    open any more)."""
    deadline = time.monotonic() + settle
    while any(is_hidden(n) for n in os.listdir(path)) and time.monotonic() < deadline:
        time.sleep(0.02)
    for name in os.listdir(path):
        if is_hidden(name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(path, name))


def rmdir(path, settle=2.0):
    """os.rmdir that tolerates libfuse's .fuse_hidden* files: on ENOTEMPTY caused only by them,
    settle_hidden, then rmdir once more."""
    try:
        os.rmdir(path)
    except OSError as e:
        if e.errno != errno.ENOTEMPTY or listdir(path):
            raise
        settle_hidden(path, settle)
        os.rmdir(path)


def probe(path, op):
    """Runs LOCK_PROBE in a second process and returns what it printed."""
    res = subprocess.run([sys.executable, "-c", LOCK_PROBE, path, op], capture_output=True,
                         text=True, timeout=CHILD_TIMEOUT)
    if res.returncode != 0:
        return f"probe-failed rc={res.returncode} {res.stderr.strip()[-200:]}"
    return res.stdout.strip()


def lock_when_free(fd, op, *args, wait=5.0):
    """fcntl.lockf(fd, op, *args), retried (at most wait seconds) while another's lock is in
    the way. An exited probe's lock can outlive it: FUSE sends its RELEASE in the background,
    and a driver that keeps locks per open file (go-fuse's loopback: OFD locks on its own
    descriptor) holds them until it has handled that RELEASE."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return fcntl.lockf(fd, op, *args)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


class FsOps:
    """The steps, in order. Each returns its outcome or raises OSError (recorded by name)."""

    def __init__(self, root, entries=READDIR_ENTRIES):
        self.d = os.path.join(root, "fsops")
        self.entries = entries

    def p(self, *names):
        return os.path.join(self.d, *names)

    # --- create, write, read --------------------------------------------------------------
    def step_setup(self):
        os.mkdir(self.d, 0o755)
        return "ok"

    def step_write_small(self):
        write_file(self.p("small"), SMALL)
        return "ok"

    def step_read_small(self):
        return check(read_file(self.p("small")), SMALL)

    def step_stat_small(self):
        st = os.stat(self.p("small"))
        return f"ok size={st.st_size} mode={mode_str(st)} nlink={st.st_nlink}"

    def step_write_large(self):
        write_file(self.p("large"), pattern(3 * MiB, "large"))
        return f"ok size={os.stat(self.p('large')).st_size}"

    def step_read_large(self):
        return check(read_file(self.p("large")), pattern(3 * MiB, "large"))

    def step_pwrite_offsets(self):
        path = self.p("sparse")
        expected = bytearray(100_010)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for off, data in ((0, b"A" * 10), (100_000, b"B" * 10), (4090, b"C" * 12),
                              (5, b"D" * 3)):
                if os.pwrite(fd, data, off) != len(data):
                    return f"short pwrite at {off}"
                expected[off:off + len(data)] = data
            mid = os.pread(fd, 16, 4088)
        finally:
            os.close(fd)
        res = check(read_file(path), bytes(expected))
        return f"{res} pread={mid.hex()}"

    def step_truncate_up(self):
        path = self.p("sparse")
        before = read_file(path)
        os.truncate(path, 200_000)
        data = read_file(path)
        return f"{check(data, before + bytes(200_000 - len(before)))} size={os.stat(path).st_size}"

    def step_truncate_down(self):
        path = self.p("sparse")
        before = read_file(path)
        os.truncate(path, 4093)
        return f"{check(read_file(path), before[:4093])} size={os.stat(path).st_size}"

    def step_ftruncate_zero(self):
        fd = os.open(self.p("sparse"), os.O_RDWR)
        try:
            os.ftruncate(fd, 0)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        return f"ok size={size} read={len(read_file(self.p('sparse')))}"

    # --- rename ---------------------------------------------------------------------------
    def step_rename(self):
        write_file(self.p("r1"), b"r1")
        os.rename(self.p("r1"), self.p("r2"))
        return f"{check(read_file(self.p('r2')), b'r1')} old={os.path.lexists(self.p('r1'))}"

    def step_rename_over_existing(self):
        write_file(self.p("x"), b"xx")
        write_file(self.p("y"), b"yyyy")
        os.rename(self.p("x"), self.p("y"))
        return f"{check(read_file(self.p('y')), b'xx')} old={os.path.lexists(self.p('x'))}"

    def step_rename_noreplace_existing(self):
        write_file(self.p("nr1"), b"nr1")
        write_file(self.p("nr2"), b"nr2")
        renameat2(self.p("nr1"), self.p("nr2"), RENAME_NOREPLACE)
        return "ok (replaced despite RENAME_NOREPLACE)"

    def step_rename_noreplace_free(self):
        renameat2(self.p("nr1"), self.p("nr3"), RENAME_NOREPLACE)
        return check(read_file(self.p("nr3")), b"nr1")

    def step_rename_missing(self):
        os.rename(self.p("no-such-file"), self.p("whatever"))
        return "ok"

    def step_rename_dir(self):
        os.mkdir(self.p("d1"))
        write_file(self.p("d1", "inner"), b"inner")
        os.rename(self.p("d1"), self.p("d2"))
        listed = sorted(listdir(self.p("d2")))
        return f"{check(read_file(self.p('d2', 'inner')), b'inner')} list={listed}"

    # --- links ----------------------------------------------------------------------------
    def step_hardlink(self):
        os.link(self.p("small"), self.p("small.link"))
        a, b = os.stat(self.p("small")), os.stat(self.p("small.link"))
        return (f"{check(read_file(self.p('small.link')), SMALL)} nlink={a.st_nlink},{b.st_nlink} "
                f"same_ino={a.st_ino == b.st_ino}")

    def step_hardlink_unlink(self):
        # small.link was just read and closed: libfuse may hide it instead of removing it (a
        # second link to small) until its RELEASE comes (fuse2fs: nlink=2 in 1 of 5 runs).
        os.unlink(self.p("small.link"))
        settle_hidden(self.d)
        return f"ok nlink={os.stat(self.p('small')).st_nlink}"

    def step_hardlink_existing(self):
        os.link(self.p("small"), self.p("large"))
        return "ok"

    def step_symlink(self):
        os.symlink("small", self.p("sym"))
        lst = os.lstat(self.p("sym"))
        return (f"{check(read_file(self.p('sym')), SMALL)} readlink={os.readlink(self.p('sym'))} "
                f"islnk={stat.S_ISLNK(lst.st_mode)} lsize={lst.st_size}")

    def step_symlink_dangling(self):
        os.symlink("no-such-target", self.p("dangling"))
        os.stat(self.p("dangling"))
        return "ok"

    def step_symlink_existing(self):
        os.symlink("small", self.p("sym"))
        return "ok"

    # --- directories ----------------------------------------------------------------------
    def step_mkdir(self):
        os.mkdir(self.p("dir"), 0o750)
        st = os.stat(self.p("dir"))
        return f"ok mode={mode_str(st)} isdir={stat.S_ISDIR(st.st_mode)}"

    def step_mkdir_existing(self):
        os.mkdir(self.p("dir"))
        return "ok"

    def step_rmdir_nonempty(self):
        write_file(self.p("dir", "f"), b"f")
        os.rmdir(self.p("dir"))
        return "ok"

    def step_rmdir_file(self):
        os.rmdir(self.p("dir", "f"))
        return "ok"

    def step_rmdir_empty(self):
        os.unlink(self.p("dir", "f"))
        rmdir(self.p("dir"))
        return f"ok exists={os.path.lexists(self.p('dir'))}"

    def step_unlink(self):
        write_file(self.p("gone"), b"gone")
        os.unlink(self.p("gone"))
        return f"ok exists={os.path.lexists(self.p('gone'))}"

    def step_unlink_missing(self):
        os.unlink(self.p("gone"))
        return "ok"

    def step_unlink_dir(self):
        os.mkdir(self.p("undir"))
        try:
            os.unlink(self.p("undir"))
        finally:
            rmdir(self.p("undir"))
        return "ok"

    # --- attributes -----------------------------------------------------------------------
    def step_chmod(self):
        os.chmod(self.p("small"), 0o640)
        return f"ok mode={mode_str(os.stat(self.p('small')))}"

    def step_utime(self):
        os.utime(self.p("small"), (1_000_000_000, 1_234_567_890))
        st = os.stat(self.p("small"))
        return f"ok atime={int(st.st_atime)} mtime={int(st.st_mtime)}"

    def step_other_users(self):
        """What root may do to a file of another user (set its owner, its mode and its
        set-id bit, write it whatever its mode: CAP_CHOWN, CAP_FOWNER, CAP_FSETID,
        CAP_DAC_OVERRIDE in the driver that does it for root), and what another user may not:
        each attempt's outcome."""
        path = self.p("others")
        with open(path, "wb") as f:
            f.write(b"x")
        outcomes = []

        def attempt(name, fn):
            try:
                value = fn()
                outcomes.append(f"{name}={'ok' if value is None else value}")
            except OSError as e:
                outcomes.append(f"{name}={errname(e)}")

        def owner():
            st = os.stat(path)
            return f"{st.st_uid}:{st.st_gid}"

        attempt("chown", lambda: os.chown(path, OTHER_USER, OTHER_USER))
        attempt("owner", owner)
        attempt("chmod", lambda: os.chmod(path, 0o600))
        attempt("write", lambda: open(path, "ab").close())
        attempt("setuid", lambda: os.chmod(path, 0o6755))
        attempt("mode", lambda: oct(os.stat(path).st_mode & 0o7777))
        attempt("chown_back", lambda: os.chown(path, os.geteuid(), os.getegid()))
        attempt("owner_back", owner)
        return " ".join(outcomes)

    def step_xattr_set_get(self):
        os.setxattr(self.p("small"), "user.rebound", b"value-1")
        return f"ok value={os.getxattr(self.p('small'), 'user.rebound')!r}"

    def step_xattr_create_existing(self):
        os.setxattr(self.p("small"), "user.rebound", b"v", os.XATTR_CREATE)
        return "ok"

    def step_xattr_list(self):
        os.setxattr(self.p("small"), "user.second", b"")
        names = sorted(n for n in os.listxattr(self.p("small")) if n.startswith("user."))
        return f"ok names={names}"

    def step_xattr_remove(self):
        os.removexattr(self.p("small"), "user.rebound")
        names = sorted(n for n in os.listxattr(self.p("small")) if n.startswith("user."))
        return f"ok names={names}"

    def step_xattr_get_missing(self):
        os.getxattr(self.p("small"), "user.rebound")
        return "ok"

    # --- readdir --------------------------------------------------------------------------
    def step_readdir_3000(self):
        os.mkdir(self.p("many"))
        names = [f"entry-{i:05d}" for i in range(self.entries)]
        for name in names:
            os.close(os.open(self.p("many", name), os.O_WRONLY | os.O_CREAT, 0o644))
        listed = sorted(listdir(self.p("many")))
        if listed != names:
            missing, extra = set(names) - set(listed), set(listed) - set(names)
            return f"MISMATCH n={len(listed)} missing={len(missing)} extra={sorted(extra)[:5]}"
        with os.scandir(self.p("many")) as it:
            regular = sum(1 for e in it
                          if e.is_file(follow_symlinks=False) and not is_hidden(e.name))
        return f"ok n={len(listed)} regular={regular}"

    def step_readdir_after_unlink(self):
        for i in range(0, self.entries, 3):
            os.unlink(self.p("many", f"entry-{i:05d}"))
        expected = [f"entry-{i:05d}" for i in range(self.entries) if i % 3]
        listed = sorted(listdir(self.p("many")))
        return f"ok n={len(listed)}" if listed == expected else f"MISMATCH n={len(listed)}"

    # --- locks ----------------------------------------------------------------------------
    def step_posix_lock(self):
        path = self.p("lockfile")
        write_file(path, b"x" * 300)
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = probe(path, "lockf_ex")
            seen = probe(path, "getlk")
            fcntl.lockf(fd, fcntl.LOCK_UN)
            after = probe(path, "lockf_ex")
        finally:
            os.close(fd)
        return f"ok second={held} getlk=[{seen}] after_unlock={after}"

    def step_posix_lock_ranges(self):
        path = self.p("lockfile")
        fd = os.open(path, os.O_RDWR)
        try:
            lock_when_free(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 100, 0)  # bytes 0..99
            disjoint = probe(path, "lockf_ex_range_100_200")
            whole = probe(path, "lockf_ex")
            fcntl.lockf(fd, fcntl.LOCK_UN, 100, 0)
            lock_when_free(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            shared = probe(path, "lockf_sh")
            fcntl.lockf(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        return f"ok disjoint={disjoint} overlapping={whole} shared={shared}"

    def step_flock(self):
        path = self.p("lockfile")
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = probe(path, "flock_ex")
            fcntl.flock(fd, fcntl.LOCK_UN)
            after = probe(path, "flock_ex")
        finally:
            os.close(fd)
        return f"ok second={held} after_unlock={after}"

    # --- whole file system and sync -------------------------------------------------------
    def step_statvfs(self):
        sv = os.statvfs(self.d)
        sane = (sv.f_bsize > 0 and sv.f_frsize > 0 and sv.f_blocks > 0
                and sv.f_bfree <= sv.f_blocks and sv.f_bavail <= sv.f_bfree
                and sv.f_ffree <= sv.f_files)
        return f"ok sane={sane} namemax={sv.f_namemax}"

    def step_fsync(self):
        fd = os.open(self.p("synced"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"durable")
            os.fsync(fd)
            os.write(fd, b"!")
            os.fdatasync(fd)
        finally:
            os.close(fd)
        return check(read_file(self.p("synced")), b"durable!")

    def step_o_append(self):
        path = self.p("appended")
        write_file(path, b"one\n")
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, b"two\n")
            os.lseek(fd, 0, os.SEEK_SET)  # O_APPEND writes ignore the file offset
            os.write(fd, b"three\n")
        finally:
            os.close(fd)
        return check(read_file(path), b"one\ntwo\nthree\n")

    def step_open_missing(self):
        os.close(os.open(self.p("no-such-file"), os.O_RDONLY))
        return "ok"

    def step_open_excl_existing(self):
        os.close(os.open(self.p("small"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        return "ok"

    def step_open_dir_for_write(self):
        os.close(os.open(self.d, os.O_WRONLY))
        return "ok"

    def step_open_through_file(self):
        os.close(os.open(self.p("small", "child"), os.O_RDONLY))
        return "ok"

    # --- mmap -----------------------------------------------------------------------------
    def step_mmap_write(self):
        return in_child(self._mmap_write)

    def _mmap_write(self):
        path = self.p("mapped")
        size = 3 * mmap.PAGESIZE + 100
        write_file(path, bytes(size))
        expected = bytearray(size)
        fd = os.open(path, os.O_RDWR)
        try:
            with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
                for off, data in ((0, b"start"), (mmap.PAGESIZE - 2, b"span"),
                                  (size - 4, b"tail")):
                    m[off:off + len(data)] = data
                    expected[off:off + len(data)] = data
                m.flush()
        finally:
            os.close(fd)
        return check(read_file(path), bytes(expected))

    def step_mmap_read(self):
        return in_child(self._mmap_read)

    def _mmap_read(self):
        fd = os.open(self.p("large"), os.O_RDONLY)
        try:
            with mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ) as m:
                data = bytes(m)
        finally:
            os.close(fd)
        return check(data, pattern(3 * MiB, "large"))

    # --- the tree at the end --------------------------------------------------------------
    def step_final_tree(self):
        """Every entry under fsops/ with its type, size and mode; many/ only counted."""
        rows = []
        for dirpath, dirnames, filenames in os.walk(self.d):
            rel = os.path.relpath(dirpath, self.d)
            filenames = [n for n in filenames if not is_hidden(n)]
            if rel == "many":
                rows.append(f"many/:{len(filenames)}-files")
                dirnames[:] = []
                continue
            for name in sorted(dirnames + filenames):
                st = os.lstat(os.path.join(dirpath, name))
                size = st.st_size if not stat.S_ISDIR(st.st_mode) else "-"
                rows.append(f"{os.path.normpath(os.path.join(rel, name))}:{mode_str(st)}:{size}")
        return "ok " + " ".join(sorted(rows))

    def steps(self):
        return [(name[len("step_"):], getattr(self, name)) for name in STEP_ORDER]


# Definition order is execution order.
STEP_ORDER = [n for n in FsOps.__dict__ if n.startswith("step_")]


def run(root, entries=READDIR_ENTRIES):
    """Runs every step in root/fsops (which must not exist) and returns [(step, outcome)];
    the large directory has `entries` entries."""
    old_umask = os.umask(0o022)
    results = []
    try:
        for name, fn in FsOps(root, entries).steps():
            try:
                outcome = fn()
            except OSError as e:
                outcome = errname(e)
            results.append((name, outcome))
    finally:
        os.umask(old_umask)
    return results


def format_results(results):
    return [f"{name}: {outcome}" for name, outcome in results]


# Who runs fsops besides root: the overflow user, as an application of another user would.
UNPRIVILEGED = 65534


def run_as_user(root, entries=READDIR_ENTRIES, uid=UNPRIVILEGED):
    """fsops as uid (and its gid) in root/users (made world-writable by root): a
    semantic difference only another user sees (a driver that lacks the capabilities to act
    for it) must not hide. The script runs from its source in a child process, so that it
    needs no file of the checkout that uid may not read."""
    users = os.path.join(root, "users")
    os.mkdir(users)
    os.chmod(users, 0o777)
    source = open(__file__).read()
    code = f"{source}\nprint(json.dumps(run({users!r}, {entries})))"
    # The system's interpreter: another one may live where uid cannot reach (pyenv's in /root).
    python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    res = subprocess.run([python, "-c", code], capture_output=True, text=True,
                         user=uid, group=uid, extra_groups=[], cwd="/", timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"fsops as uid {uid} failed:\n{res.stderr[-2000:]}")
    results = [tuple(step) for step in json.loads(res.stdout)]
    # A user who cannot reach its directory fails every step alike on any mount, and so would
    # hide every difference.
    if results[0] != ("setup", "ok"):
        raise RuntimeError(f"fsops as uid {uid} could not start in {users}: {results[0]}")
    return results
