"""Application workloads that a mount must serve without a single error, even while its driver
is killed and restarted underneath (see chaos.py and test_recovery.py).

Owns: three workloads, each a function taking a directory (a plain one, a direct mount or a
rebound mount: they must pass on all three) that runs until done and returns a `Result`:

  tree       unpacks a tarball of real content (/usr/include, /usr/share/doc), verifies every
             file's sha256 against the tarball's, renames half of the files and deletes the
             other half, and verifies the whole tree again;
  held-open  keeps files and directories open for its whole duration: a bash whose cwd is on
             the mount running relative ls/cat/echo >>; a process appending numbered lines
             through one descriptor; a process holding a POSIX lock and a flock while another
             keeps trying to take them; a directory of a thousand entries or more listed slowly
             through one open directory stream;
  model      one file under a seeded random mix of pwrite, pread, ftruncate, mmap reads and
             writes and fsync, every read checked against an in-memory model.

Every OSError an application sees is recorded in the Result (operation, path, errno, when),
never swallowed; so is every wrong answer (a "mismatch"), and every helper process that dies
or hangs. A test asserts `result.ok`. Sizes and durations come from `Scale` (REBOUND_SOAK=1
selects the long versions).

The processes that must be separate (lock holder and prober, the appender, the model, which
mmaps and could die of SIGBUS) run this file as a script: `python3 workloads.py ROLE ARGS...`.
They talk JSON lines on stdout and stop when their stdin is closed. This file uses only the
standard library, so that they start fast.
"""

import collections
import dataclasses
import errno
import fcntl
import hashlib
import json
import mmap
import os
import random
import signal
import stat
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

MiB = 1 << 20
GRACE = 60.0  # seconds a workload's helpers may overrun its duration before they count as hung
TREE_SOURCES = ("/usr/include", "/usr/share/doc")
WORKLOADS = ("tree", "held-open", "model")


# --- sizes ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Scale:
    tree_files: int      # regular files in the tarball (None: all of TREE_SOURCES)
    tree_bytes: int      # their total size (None: no limit)
    held_seconds: float  # how long held-open keeps everything open
    held_entries: int    # entries of the directory it lists slowly
    model_seconds: float
    model_size: int      # the model file's largest size


# The default suite's: 6 s under each fault schedule (4-6 failures of the chaos tests' kinds,
# 6-20 of the kill tests') keeps it under 20 minutes on 2 cores; REBOUND_SOAK=1 runs 120 s.
DEFAULT = Scale(tree_files=3000, tree_bytes=40 * MiB, held_seconds=6, held_entries=1000,
                model_seconds=6, model_size=2 * MiB)
SOAK = Scale(tree_files=None, tree_bytes=None, held_seconds=120, held_entries=10000,
             model_seconds=120, model_size=8 * MiB)


def soak():
    return os.environ.get("REBOUND_SOAK", "") not in ("", "0")


def scale():
    """DEFAULT, or SOAK when REBOUND_SOAK=1."""
    return SOAK if soak() else DEFAULT


# --- results ----------------------------------------------------------------------------------

@dataclasses.dataclass
class AppError:
    """An error an application got: the operation, its path, the errno (None when it is not
    an OSError, e.g. a helper process that died) and when, in seconds from the start."""
    op: str
    path: str
    errno: int
    message: str
    at: float

    def __str__(self):
        name = errno.errorcode.get(self.errno, str(self.errno)) if self.errno else "-"
        return f"{self.at:7.2f}s {self.op} {self.path}: {name} {self.message}"


class Result:
    """What a workload saw. Thread-safe: held-open records from several threads at once.
    `on_record`, if set, is called with ("error", dict) or ("mismatch", text) as they come
    (the helper processes forward them to their parent that way)."""

    def __init__(self, workload, on_record=None):
        self.workload = workload
        self.errors = []
        self.mismatches = []
        self.notes = {}  # what was done: counts, phase timings
        self.seconds = 0.0
        self.recheck = None  # recheck(root) -> [mismatch]: the final state, read from elsewhere
        self._start = time.monotonic()
        self._lock = threading.Lock()
        self._on_record = on_record

    def elapsed(self):
        return time.monotonic() - self._start

    def error(self, op, path, exc):
        """Records an OSError (or any exception: then errno is None) an application got."""
        err = AppError(op, str(path), getattr(exc, "errno", None),
                       getattr(exc, "strerror", None) or str(exc), round(self.elapsed(), 3))
        with self._lock:
            self.errors.append(err)
        if self._on_record:
            self._on_record("error", dataclasses.asdict(err))

    def add_error(self, err):
        with self._lock:
            self.errors.append(err)

    def mismatch(self, text):
        text = f"{self.elapsed():7.2f}s {text}"
        with self._lock:
            self.mismatches.append(text)
        if self._on_record:
            self._on_record("mismatch", text)

    def do(self, op, path, fn, *args, **kwargs):
        """fn(*args, **kwargs); an OSError is recorded and FAILED returned instead."""
        try:
            return fn(*args, **kwargs)
        except OSError as e:
            self.error(op, path, e)
            return FAILED

    @property
    def ok(self):
        return not self.errors and not self.mismatches

    def summary(self, limit=15):
        lines = [f"{self.workload}: {len(self.errors)} application errors, "
                 f"{len(self.mismatches)} mismatches in {self.seconds:.1f} s; {self.notes}"]
        by_errno = collections.Counter(
            errno.errorcode.get(e.errno, str(e.errno)) if e.errno else "-" for e in self.errors)
        if by_errno:
            lines.append(f"errors by errno: {dict(by_errno)}")
        lines += [f"  error: {e}" for e in self.errors[:limit]]
        lines += [f"  mismatch: {m}" for m in self.mismatches[:limit]]
        if len(self.errors) > limit or len(self.mismatches) > limit:
            lines.append("  ...")
        return "\n".join(lines)

    def __str__(self):
        return self.summary()


FAILED = object()  # what Result.do returns when the call failed


# --- small file helpers -----------------------------------------------------------------------

def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_uncached(path):
    """The whole file, with its clean pages dropped from the page cache first, so that the
    data comes from the driver and not from what the kernel kept of our own writes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        chunks = []
        while chunk := os.read(fd, MiB):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def is_hidden(name):
    """libfuse's high-level API renames a file unlinked while open to .fuse_hidden*."""
    return name.startswith(".fuse_hidden")


def mkdir(res, path, mode=0o755):
    return res.do("mkdir", path, os.mkdir, path, mode)


# --- tree -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Entry:
    """One entry of the tree: a dir, a file (with the sha256 of its content) or a symlink."""
    name: str  # relative path
    kind: str  # "dir", "file" or "symlink"
    digest: str = ""
    target: str = ""
    size: int = 0


@dataclasses.dataclass
class Tarball:
    path: Path
    entries: list  # of Entry, in archive order

    @property
    def files(self):
        return sum(e.kind == "file" for e in self.entries)

    @property
    def bytes(self):
        return sum(e.size for e in self.entries)

    def __str__(self):
        return (f"{self.path}: {len(self.entries)} entries, {self.files} files, "
                f"{self.bytes / MiB:.1f} MiB")


def build_tarball(path, max_files=None, max_bytes=None, sources=TREE_SOURCES):
    """Writes a tar of the real content under sources (as include/..., doc/...) to path, up to
    max_files regular files or max_bytes of them, whichever comes first (None: no limit).
    Only directories, regular files and symlinks; owner permissions are added to every mode
    so that the tree can be verified and taken apart again. Symlinks whose target is absolute
    or climbs with ".." are left out: sshfs refuses to read them back (its contain_symlinks
    option, on by default, answers EPERM). Returns the Tarball."""
    entries = []
    files = total = 0

    def full():
        return (max_files is not None and files >= max_files) or \
               (max_bytes is not None and total >= max_bytes)

    with tarfile.open(path, "w") as tar:
        def add(entry, st, data=None):
            info = tarfile.TarInfo(entry.name)
            info.mtime = int(st.st_mtime)
            info.uname = info.gname = "root"
            if entry.kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, (st.st_mode & 0o7777) | 0o700
            elif entry.kind == "symlink":
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, entry.target, 0o777
            else:
                info.mode, info.size = (st.st_mode & 0o7777) | 0o600, len(data)
            tar.addfile(info, None if data is None else _BytesReader(data))
            entries.append(entry)

        for source in sources:
            if not os.path.isdir(source) or full():
                continue
            top = os.path.basename(source.rstrip("/"))
            for dirpath, dirnames, filenames in os.walk(source):
                dirnames.sort()
                rel = os.path.normpath(os.path.join(top, os.path.relpath(dirpath, source)))
                add(Entry(rel, "dir"), os.lstat(dirpath))
                for name in sorted(dirnames + filenames):
                    if full():
                        break
                    full_path = os.path.join(dirpath, name)
                    st = os.lstat(full_path)
                    entry_name = os.path.join(rel, name)
                    if stat.S_ISLNK(st.st_mode):
                        target = os.readlink(full_path)
                        if contained(target):
                            add(Entry(entry_name, "symlink", target=target), st)
                    elif stat.S_ISREG(st.st_mode):
                        try:
                            with open(full_path, "rb") as f:
                                data = f.read()
                        except OSError:
                            continue  # unreadable here; not part of the tree
                        add(Entry(entry_name, "file", digest=sha256(data), size=len(data)),
                            st, data)
                        files += 1
                        total += len(data)
                if full():
                    break
    return Tarball(Path(path), entries)


def contained(target):
    """A symlink target that stays below its directory: relative, without ".."."""
    return not target.startswith("/") and ".." not in target.split("/")


class _BytesReader:
    """The file object tarfile.addfile reads a member's data from."""

    def __init__(self, data):
        self._view = memoryview(data)

    def read(self, n=-1):
        n = len(self._view) if n is None or n < 0 else n
        out, self._view = self._view[:n], self._view[n:]
        return bytes(out)


def tree(root, tarball):
    """Unpacks tarball into root/tree (every member through mkdir/open/write/symlink, as tar
    does), verifies every entry, renames half of the files and symlinks (half of those into
    another directory) and deletes the other half, then verifies the whole tree again."""
    res = Result("tree")
    base = Path(root) / "tree"
    phase_start = time.monotonic()
    if mkdir(res, base) is FAILED:
        return _done(res)

    # Unpack.
    written = 0
    with tarfile.open(tarball.path, "r:") as tar:
        for member in tar:
            path = base / member.name
            if member.isdir():
                mkdir(res, path, member.mode)
            elif member.issym():
                res.do("symlink", path, os.symlink, member.linkname, path)
            elif member.isfile():
                data = tar.extractfile(member).read()
                fd = res.do("open(O_CREAT)", path, os.open, path,
                            os.O_WRONLY | os.O_CREAT | os.O_EXCL, member.mode)
                if fd is FAILED:
                    continue
                res.do("write", path, write_all, fd, data)
                res.do("close", path, os.close, fd)
                written += len(data)
    res.notes["unpack_s"] = round(time.monotonic() - phase_start, 1)
    res.notes["files"] = tarball.files
    res.notes["MiB"] = round(written / MiB, 1)

    expected = {e.name: e for e in tarball.entries}
    phase_start = time.monotonic()
    verify_tree(res, base, expected, "verify-1")
    res.notes["verify_s"] = round(time.monotonic() - phase_start, 1)

    # Take half of it apart.
    phase_start = time.monotonic()
    moved = "moved"
    mkdir(res, base / moved)
    expected[moved] = Entry(moved, "dir")
    leaves = sorted(name for name, e in expected.items() if e.kind != "dir")
    for i, name in enumerate(leaves):
        entry = expected.pop(name)
        if i % 2:
            res.do("unlink", base / name, os.unlink, base / name)
            continue
        if i % 4 == 0:
            new = name + ".renamed"
        else:
            new = f"{moved}/{i:06d}-{os.path.basename(name)}"
        res.do("rename", f"{base / name} -> {new}", os.rename, base / name, base / new)
        expected[new] = dataclasses.replace(entry, name=new)
    res.notes["mutate_s"] = round(time.monotonic() - phase_start, 1)
    verify_tree(res, base, expected, "verify-2")
    res.notes["entries_left"] = len(expected)

    def recheck(other_root):
        again = Result("tree (recheck)")
        verify_tree(again, Path(other_root) / "tree", expected, "recheck")
        return [str(e) for e in again.errors] + again.mismatches

    res.recheck = recheck
    return _done(res)


def verify_tree(res, base, expected, phase):
    """Checks that base holds exactly the entries of expected: the same names (a walk of the
    whole tree), the same kinds, every file's sha256 and every symlink's target."""
    seen = set()

    def walk_error(e):
        res.error(f"{phase}: walk", e.filename, e)

    for dirpath, dirnames, filenames in os.walk(base, onerror=walk_error):
        rel_dir = os.path.relpath(dirpath, base)
        for name in dirnames + filenames:
            if not is_hidden(name):
                seen.add(os.path.normpath(os.path.join(rel_dir, name)))
    for what, names in (("missing", set(expected) - seen), ("unexpected", seen - set(expected))):
        if names:
            res.mismatch(f"{phase}: {len(names)} {what} entries, e.g. {sorted(names)[:5]}")

    for name, entry in expected.items():
        path = base / name
        if entry.kind == "file":
            data = res.do(f"{phase}: read", path, read_uncached, path)
            if data is not FAILED and sha256(data) != entry.digest:
                res.mismatch(f"{phase}: {name}: {len(data)} bytes, sha256 differs from the "
                             f"tarball's ({entry.size} bytes)")
        elif entry.kind == "symlink":
            target = res.do(f"{phase}: readlink", path, os.readlink, path)
            if target is not FAILED and target != entry.target:
                res.mismatch(f"{phase}: {name} -> {target!r}, expected {entry.target!r}")
        else:
            st = res.do(f"{phase}: lstat", path, os.lstat, path)
            if st is not FAILED and not stat.S_ISDIR(st.st_mode):
                res.mismatch(f"{phase}: {name} is not a directory ({oct(st.st_mode)})")


def _done(res):
    res.seconds = round(res.elapsed(), 2)
    return res


# --- helper processes -------------------------------------------------------------------------

class Child:
    """A helper process: `python3 workloads.py ROLE ARGS...`. Its errors and mismatches go
    into res as they arrive; events (e.g. "held") can be waited for; close() stops it (EOF on
    its stdin) and records it as an application error if it dies, hangs or says nothing."""

    def __init__(self, res, role, *args):
        self.res = res
        self.role = role
        self.done = None  # its final {"done": {...}} notes
        self._events = []
        self._cond = threading.Condition()
        self._stderr = []
        self.proc = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", os.path.abspath(__file__), role]
            + [str(a) for a in args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._readers = [threading.Thread(target=self._read_stdout, daemon=True),
                         threading.Thread(target=self._read_stderr, daemon=True)]
        for t in self._readers:
            t.start()

    def _read_stdout(self):
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                self.res.add_error(AppError(f"{self.role}: stray output", "", None,
                                            line.strip()[:200], round(self.res.elapsed(), 3)))
                continue
            if "error" in msg:
                e = msg["error"]
                self.res.add_error(AppError(f"{self.role}: {e['op']}", e["path"], e["errno"],
                                            e["message"], round(self.res.elapsed(), 3)))
            elif "mismatch" in msg:
                with self.res._lock:
                    self.res.mismatches.append(f"{self.role}: {msg['mismatch']}")
            elif "done" in msg:
                self.done = msg["done"]
            with self._cond:
                if "event" in msg:
                    self._events.append(msg["event"])
                self._cond.notify_all()

    def _read_stderr(self):
        for line in self.proc.stderr:
            self._stderr.append(line)
            del self._stderr[:-40]

    def wait_event(self, name, timeout):
        """True once the helper said `name`; False after timeout or once it has exited."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while name not in self._events:
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._readers[0].is_alive()):
                    return False
                self._cond.wait(min(left, 0.2))
            return True

    def close_stdin(self):
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def close(self, timeout):
        """Stops the helper and waits (bounded) for it and its report."""
        self.close_stdin()
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self._fail(f"still running {timeout:.0f} s after being told to stop (killed)")
            return
        for t in self._readers:
            t.join(timeout=10)
        if rc != 0:
            how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with {rc}"
            self._fail(how)
        elif self.done is None:
            self._fail("exited without a report")

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _fail(self, how):
        tail = "".join(self._stderr).strip()[-1500:]
        self.res.add_error(AppError(f"{self.role} process", "", None,
                                    f"{how}; stderr: {tail}", round(self.res.elapsed(), 3)))


def _child_main(argv):
    """Entry point of a helper process: ROLE ARGS..."""
    role, args = argv[0], argv[1:]

    def emit(kind, payload):
        sys.stdout.write(json.dumps({kind: payload}) + "\n")
        sys.stdout.flush()

    res = Result(role, on_record=emit)
    stop = threading.Event()

    def watch_stdin():
        sys.stdin.read()  # EOF: the parent wants us to stop
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    notes = ROLES[role](res, stop, emit, *args)
    emit("done", notes or {})


# --- held-open --------------------------------------------------------------------------------

LOCK_BUSY = (errno.EAGAIN, errno.EACCES)  # F_SETLK and flock(LOCK_NB) on a held lock


def _role_append(res, stop, emit, path, interval):
    """Appends "%08d\\n" lines through one descriptor opened once, until stopped."""
    fd = res.do("open(O_APPEND)", path, os.open, path,
                os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    if fd is FAILED:
        return {"written": []}
    written = []  # numbers whose write succeeded, in order
    n = 0
    while not stop.is_set():
        n += 1
        line = f"{n:08d}\n".encode()
        got = res.do(f"write line {n}", path, os.write, fd, line)
        if got is not FAILED:
            if got == len(line):
                written.append(n)
            else:
                res.mismatch(f"short write of line {n}: {got} of {len(line)} bytes")
        stop.wait(float(interval))
    res.do("close", path, os.close, fd)
    return {"written": written}


def _lock_pair(res, posix_path, flock_path, flags):
    """Opens both lock files and tries an exclusive POSIX lock (fcntl F_SETLK, through lockf)
    on one and a flock on the other. Returns (fds, {kind: None | OSError})."""
    fds, outcome = {}, {}
    for kind, path in (("posix", posix_path), ("flock", flock_path)):
        fd = res.do("open", path, os.open, path, os.O_RDWR | os.O_CREAT, 0o644)
        if fd is FAILED:
            continue
        fds[kind] = fd
        try:
            if kind == "posix":
                fcntl.lockf(fd, fcntl.LOCK_EX | flags)
            else:
                fcntl.flock(fd, fcntl.LOCK_EX | flags)
            outcome[kind] = None
        except OSError as e:
            outcome[kind] = e
    return fds, outcome


def _unlock(res, fds, kind, path):
    unlock = fcntl.lockf if kind == "posix" else fcntl.flock
    res.do(f"unlock {kind}", path, unlock, fds[kind], fcntl.LOCK_UN)


def _role_hold(res, stop, emit, posix_path, flock_path):
    """Takes both locks, says "held", holds them until stopped, releases them, says
    "released". Exits at once if it could not take both."""
    fds, outcome = _lock_pair(res, posix_path, flock_path, fcntl.LOCK_NB)
    for kind, err in outcome.items():
        if err is not None:
            res.error(f"take {kind} lock", posix_path if kind == "posix" else flock_path, err)
    if len(outcome) == 2 and not any(outcome.values()):
        emit("event", "held")
        stop.wait()
    for kind, path in (("posix", posix_path), ("flock", flock_path)):
        if outcome.get(kind, "x") is None:
            _unlock(res, fds, kind, path)
    for kind, fd in fds.items():
        res.do("close", kind, os.close, fd)
    emit("event", "released")
    return {}


def _role_probe(res, stop, emit, posix_path, flock_path, interval):
    """While another process holds both locks: tries to take them, non-blocking, again and
    again, until stopped. Each attempt must find them busy; one that succeeds is a mismatch
    (the lock was lost) and is undone at once."""
    fds = {}
    for kind, path in (("posix", posix_path), ("flock", flock_path)):
        fd = res.do("open", path, os.open, path, os.O_RDWR)
        if fd is not FAILED:
            fds[kind] = fd
    attempts = busy = 0
    while not stop.is_set() and fds:
        attempts += 1
        for kind, fd in fds.items():
            path = posix_path if kind == "posix" else flock_path
            take = fcntl.lockf if kind == "posix" else fcntl.flock
            try:
                take(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in LOCK_BUSY:
                    busy += 1
                else:
                    res.error(f"try {kind} lock", path, e)
                continue
            res.mismatch(f"took the {kind} lock on {path} while another process holds it "
                         f"(attempt {attempts})")
            _unlock(res, fds, kind, path)
        stop.wait(float(interval))
    for kind, fd in fds.items():
        res.do("close", kind, os.close, fd)
    if attempts == 0:
        res.mismatch("made no attempt")
    return {"attempts": attempts, "busy": busy}


def _role_acquire(res, stop, emit, posix_path, flock_path):
    """Once the holder has released them: both locks must be free."""
    fds, outcome = _lock_pair(res, posix_path, flock_path, fcntl.LOCK_NB)
    for kind, err in outcome.items():
        if err is not None:
            res.mismatch(f"could not take the released {kind} lock: "
                         f"{errno.errorcode.get(err.errno, err.errno)}")
    for kind, fd in fds.items():
        res.do("close", kind, os.close, fd)
    return {"taken": sorted(k for k, e in outcome.items() if e is None)}


BASH_STEP = r"""
set +e
step() {
  echo "line $1" >> log.txt || echo "ERR echo>> $1 rc=$?"
  ls > /dev/null || echo "ERR ls $1 rc=$?"
  ls .. > /dev/null || echo "ERR ls.. $1 rc=$?"
  content=$(cat log.txt) || echo "ERR cat $1 rc=$?"
  n=$(printf '%s\n' "$content" | grep -c .)
  last=$(printf '%s\n' "$content" | tail -n 1)
  [ "$n" = "$1" ] || echo "MISMATCH after step $1 log.txt has $n lines"
  [ "$last" = "line $1" ] || echo "MISMATCH after step $1 last line is '$last'"
  echo "done $1"
}
echo ready
"""


def _drive_bash(res, shell_dir, deadline, interval, notes):
    """A bash whose cwd is shell_dir runs `step N` (relative echo >>, ls, cat) until the
    deadline; its complaints (stderr is merged into stdout) are application errors."""
    strerrors = {os.strerror(n): n for n in errno.errorcode}
    proc = subprocess.Popen(["bash", "--noprofile", "--norc"], cwd=shell_dir,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    notes["bash_pid"] = proc.pid
    steps = 0

    def send(text):
        try:
            proc.stdin.write(text)
            proc.stdin.flush()
            return True
        except OSError as e:
            res.error("bash: write to its stdin", shell_dir, e)
            return False

    def read_until(marker):
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line == marker:
                return True
            if line.startswith("MISMATCH"):
                res.mismatch(f"bash: {line}")
            else:  # "ERR ..." or what a command printed on stderr
                code = next((n for text, n in strerrors.items() if line.endswith(text)), None)
                res.add_error(AppError("bash", str(shell_dir), code, line,
                                       round(res.elapsed(), 3)))
        res.add_error(AppError("bash", str(shell_dir), None,
                               f"exited before {marker!r}", round(res.elapsed(), 3)))
        return False

    try:
        if send(BASH_STEP) and read_until("ready"):
            while time.monotonic() < deadline:
                steps += 1
                if not send(f"step {steps}\n") or not read_until(f"done {steps}"):
                    break
                time.sleep(interval)
            send("exit 0\n")
        rc = proc.wait(timeout=GRACE)
        if rc != 0:
            res.add_error(AppError("bash", str(shell_dir), None, f"exited with {rc}",
                                   round(res.elapsed(), 3)))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    notes["bash_steps"] = steps
    return steps


def _list_slowly(res, directory, expected, seconds, notes):
    """Reads directory through one open directory stream, pausing between entries so the
    listing takes about `seconds`; every expected entry must show up exactly once."""
    pause = seconds / max(len(expected), 1)
    names = []
    try:
        with os.scandir(directory) as it:
            for entry in it:
                names.append(entry.name)
                time.sleep(pause)
    except OSError as e:
        res.error(f"readdir (after {len(names)} entries)", directory, e)
    counts = collections.Counter(names)
    twice = sorted(n for n, c in counts.items() if c > 1)
    missing = sorted(set(expected) - set(counts))
    extra = sorted(set(counts) - set(expected))
    for what, found in (("seen more than once", twice), ("missing", missing),
                        ("unexpected", extra)):
        if found:
            res.mismatch(f"slow listing of {directory}: {len(found)} entries {what}, "
                         f"e.g. {found[:5]}")
    notes["listed"] = len(names)


def _check_lines(res, path, expected, what):
    """path must hold exactly the lines `expected`, in order."""
    data = res.do(f"read {what}", path, read_uncached, path)
    if data is FAILED:
        return
    lines = data.decode(errors="replace").splitlines()
    if lines == expected:
        return
    counts = collections.Counter(lines)
    dups = sorted(line for line, c in counts.items() if c > 1)
    missing = [line for line in expected if line not in counts]
    first = next((i for i, (a, b) in enumerate(zip(lines, expected)) if a != b),
                 min(len(lines), len(expected)))
    res.mismatch(f"{what} {path}: {len(lines)} lines, expected {len(expected)}; "
                 f"{len(dups)} duplicated (e.g. {dups[:3]}), {len(missing)} missing "
                 f"(e.g. {missing[:3]}); first difference at line {first + 1}")


def held_open(root, seconds, entries):
    """For `seconds`: a bash in root/held/shell, an appender, a lock holder and a prober, and
    a slow listing of root/held/many (`entries` entries), all at once. Then: the lock holder
    releases and the locks must be free; both logs must hold every line exactly once."""
    res = Result("held-open")
    base = Path(root) / "held"
    shell_dir, many = base / "shell", base / "many"
    for d in (base, shell_dir, many):
        if mkdir(res, d) is FAILED:
            return _done(res)
    names = [f"entry-{i:06d}" for i in range(entries)]
    for name in names:
        fd = res.do("create", many / name, os.open, many / name,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        if fd is not FAILED:
            res.do("close", many / name, os.close, fd)
    res.notes["setup_s"] = round(res.elapsed(), 1)

    log, posix_lock, flock_lock = base / "append.log", base / "posix.lock", base / "flock.lock"
    deadline = time.monotonic() + seconds
    children, threads = [], []
    try:
        holder = Child(res, "hold", posix_lock, flock_lock)
        children.append(holder)
        if not holder.wait_event("held", GRACE):
            res.mismatch("the lock holder never held its locks")
            return _done(res)
        prober = Child(res, "probe", posix_lock, flock_lock, 0.02)
        appender = Child(res, "append", log, 0.005)
        children += [prober, appender]
        threads = [
            threading.Thread(target=_drive_bash, args=(res, shell_dir, deadline, 0.01, res.notes),
                             name="bash", daemon=True),
            threading.Thread(target=_list_slowly, args=(res, many, names, seconds * 0.9,
                                                        res.notes), name="lister", daemon=True),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(deadline - time.monotonic(), 0) + GRACE)
            if t.is_alive():
                res.add_error(AppError("held-open thread", "", None,
                                       f"{t.name} still running {GRACE:.0f} s past the end",
                                       round(res.elapsed(), 3)))
        appender.close(GRACE)
        prober.close(GRACE)
        holder.close_stdin()  # release
        if not holder.wait_event("released", GRACE):
            res.mismatch("the lock holder did not release its locks")
        holder.close(GRACE)
        acquirer = Child(res, "acquire", posix_lock, flock_lock)
        children.append(acquirer)
        acquirer.close(GRACE)
        if acquirer.done is not None and len(acquirer.done.get("taken", [])) != 2:
            res.mismatch(f"after the release only {acquirer.done.get('taken')} were taken")
    finally:
        for c in children:
            c.kill()
        # A thread still blocked on the mount ends when the test tears the mount down.

    written = (appender.done or {}).get("written", [])
    res.notes.update(appended=len(written), lock_attempts=(prober.done or {}).get("attempts"))
    if not written:
        res.mismatch("the appender wrote nothing")
    if not res.notes.get("lock_attempts"):
        res.mismatch("the lock prober made no attempt")
    if not res.notes.get("bash_steps"):
        res.mismatch("bash ran no step")
    append_lines = [f"{n:08d}" for n in written]
    bash_lines = [f"line {n}" for n in range(1, res.notes.get("bash_steps", 0) + 1)]
    _check_lines(res, log, append_lines, "append log")
    _check_lines(res, shell_dir / "log.txt", bash_lines, "bash log")

    def recheck(other_root):
        again = Result("held-open (recheck)")
        held = Path(other_root) / "held"
        _check_lines(again, held / "append.log", append_lines, "append log")
        _check_lines(again, held / "shell" / "log.txt", bash_lines, "bash log")
        return [str(e) for e in again.errors] + again.mismatches

    res.recheck = recheck
    return _done(res)


# --- model ------------------------------------------------------------------------------------

def _role_model(res, stop, emit, path, seed, seconds, max_size):
    """The model workload proper, in its own process: a stray SIGBUS from an mmap access to a
    page the driver failed to deliver kills the helper, not the test."""
    rng = random.Random(int(seed))
    seconds, max_size = float(seconds), int(max_size)
    fd = res.do("open(O_CREAT)", path, os.open, path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    if fd is FAILED:
        return {}
    model = bytearray()
    ops = collections.Counter()
    deadline = time.monotonic() + seconds
    kinds, weights = zip(("pwrite", 30), ("pread", 30), ("ftruncate", 4), ("mmap", 16),
                         ("fsync+drop", 4), ("fstat", 6))

    def resize(size):
        if size < len(model):
            del model[size:]
        else:
            model.extend(bytes(size - len(model)))

    def check(what, got, off, n):
        want = bytes(model[off:off + n])
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                      min(len(got), len(want)))
            res.mismatch(f"op {sum(ops.values())} {what} off={off} n={n}: got {len(got)} "
                         f"bytes, expected {len(want)} (file {len(model)}); first difference "
                         f"at +{at}")
            return False
        return True

    failed = False
    while time.monotonic() < deadline and not failed:
        kind = rng.choices(kinds, weights)[0]
        ops[kind] += 1
        n = rng.choice((1, 17, 512, 4096, 4097, 65536, 200_000))
        n = rng.randint(1, min(n, max_size // 2))
        if kind == "pwrite":
            off = rng.randrange(max_size - n)
            data = rng.randbytes(n)
            got = res.do(f"pwrite off={off} n={n}", path, os.pwrite, fd, data, off)
            if got is FAILED:
                failed = True  # the model no longer knows what the file holds
                break
            if off > len(model):
                resize(off)
            model[off:off + got] = data[:got]
            if got != n:
                res.mismatch(f"short pwrite off={off}: {got} of {n}")
        elif kind == "pread":
            off = rng.randrange(len(model) + 4096)
            got = res.do(f"pread off={off} n={n}", path, os.pread, fd, n, off)
            failed = got is FAILED or not check("pread", got, off, n)
        elif kind == "ftruncate":
            size = rng.choice((rng.randrange(len(model) + 1), rng.randrange(max_size)))
            failed = res.do(f"ftruncate {size}", path, os.ftruncate, fd, size) is FAILED
            if not failed:
                resize(size)
        elif kind == "mmap" and model:
            size = len(model)
            mm = res.do(f"mmap {size}", path, mmap.mmap, fd, size)
            if mm is FAILED:
                failed = True
                break
            try:
                off = rng.randrange(size)
                data = rng.randbytes(min(n, size - off))
                mm[off:off + len(data)] = data
                model[off:off + len(data)] = data
                roff = rng.randrange(size)
                rn = min(rng.randint(1, 65536), size - roff)
                failed = not check("mmap read", bytes(mm[roff:roff + rn]), roff, rn)
                if rng.random() < 0.5:
                    failed |= res.do("msync", path, mm.flush) is FAILED
            finally:
                mm.close()
        elif kind == "fsync+drop":
            failed = res.do("fsync", path, os.fsync, fd) is FAILED or res.do(
                "posix_fadvise(DONTNEED)", path, os.posix_fadvise, fd, 0, 0,
                os.POSIX_FADV_DONTNEED) is FAILED
        elif kind == "fstat":
            st = res.do("fstat", path, os.fstat, fd)
            failed = st is FAILED
            if not failed and st.st_size != len(model):
                res.mismatch(f"fstat size {st.st_size}, expected {len(model)}")
                failed = True
    res.do("fsync", path, os.fsync, fd)
    res.do("close", path, os.close, fd)
    if not failed:
        # Everything once more, through a new descriptor and from the driver.
        data = res.do("final read", path, read_uncached, path)
        if data is not FAILED:
            check("final read", data, 0, max(len(data), len(model)))
    return {"ops": sum(ops.values()), "by_op": dict(ops), "size": len(model),
            "sha256": sha256(model)}


def model(root, seed, seconds, max_size):
    """One file, root/model/data, under a seeded random mix of operations for `seconds`
    (see _role_model), checked against an in-memory model; at the end read back whole."""
    res = Result("model")
    base = Path(root) / "model"
    if mkdir(res, base) is FAILED:
        return _done(res)
    child = Child(res, "model", base / "data", seed, seconds, max_size)
    try:
        child.close(seconds + GRACE)
    finally:
        child.kill()
    final = child.done or {}
    res.notes.update(seed=seed, ops=final.get("ops"), size=final.get("size"),
                     by_op=final.get("by_op"))
    if child.done is not None and final.get("ops", 0) < 100:
        res.mismatch(f"only {final.get('ops')} operations in {seconds} s")

    def recheck(other_root):
        path = Path(other_root) / "model" / "data"
        try:
            data = path.read_bytes()
        except OSError as e:
            return [f"recheck: {path}: {e}"]
        if sha256(data) != final.get("sha256"):
            return [f"recheck: {path} has {len(data)} bytes, sha256 differs from the model's "
                    f"({final.get('size')} bytes)"]
        return []

    res.recheck = recheck
    return _done(res)


# --- dispatch ---------------------------------------------------------------------------------

def run(name, root, *, scale_=None, tarball=None, seed=1):
    """Runs workload `name` ("tree", "held-open", "model") in root at scale_ (default:
    scale()); tree needs the session's tarball."""
    s = scale_ or scale()
    if name == "tree":
        assert tarball is not None, "the tree workload needs a tarball"
        return tree(root, tarball)
    if name == "held-open":
        return held_open(root, s.held_seconds, s.held_entries)
    if name == "model":
        return model(root, seed, s.model_seconds, s.model_size)
    raise ValueError(f"unknown workload {name}")


ROLES = {
    "append": _role_append,
    "hold": _role_hold,
    "probe": _role_probe,
    "acquire": _role_acquire,
    "model": _role_model,
}

if __name__ == "__main__":
    _child_main(sys.argv[1:])
