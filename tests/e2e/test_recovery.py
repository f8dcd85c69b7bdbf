"""Recovery: rebound restarts a driver that crashes or hangs, and applications see no error.

Owns: the proof, on real drivers (fuse2fs, passthrough_ll, sshfs, go-fuse):
  - every workload of workloads.py runs to the end without a single application error or
    wrong answer while chaos.py kills (SIGKILL, SIGSEGV, SIGABRT) or hangs (SIGSTOP) the
    driver again and again; every injected failure shows in `rebound status`; afterwards
    rebound stops cleanly, the backing store holds what the application last saw, and
    fuse2fs's image passes e2fsck -fn;
  - `rebound restart MOUNTPOINT` with a file held open;
  - the restart budget: "fail-requests" (EIO, the mount stays) and "unmount" (rebound exits 1);
  - an object that cannot be recovered (a file unlinked while open) fails with EIO, alone;
  - a hang: a request waiting on a stopped driver completes once its deadline fires, and an
    idle stopped driver is found by the liveness probe.

Select with `-k recovery` (or `-m recovery`). REBOUND_SOAK=1 runs the long versions (the
whole tree, two minutes of chaos per workload); REBOUND_CHAOS_SEED fixes the chaos seed
(by default each test derives its own from its name, and prints it when it fails).
"""

import concurrent.futures
import contextlib
import errno
import json
import os
import re
import resource
import signal
import subprocess
import sys
import zlib

import pytest

import chaos
import mounts
import workloads
from chaos import recovered_from, serving, signal_descendant, wait_status
from mounts import MiB, STOP_TIMEOUT, is_fuse_mounted, is_mounted, mount_status, wait_for

pytestmark = [pytest.mark.recovery, pytest.mark.rebound,
              pytest.mark.usefixtures("many_open_files")]

DRIVERS = ["fuse2fs", "passthrough_ll", "sshfs", "gofuse"]
# Drivers over a backing directory, which a test can change behind the mount's back.
DIR_DRIVERS = [d for d in DRIVERS if mounts.DRIVERS[d][1] == "dir"]
# Drivers that really remove a file unlinked while open (libfuse's high-level API, under
# fuse2fs and sshfs, renames it to .fuse_hidden* instead, which keeps it recoverable).
UNLINKING_DRIVERS = ["passthrough_ll", "gofuse"]
# Drivers fast mode serves (no redo log: its changes are not seen before the kernel's).
FAST_DRIVERS = ["passthrough_ll", "passthrough_ll-clone_fd", "gofuse"]
# Every workload on the first, the model on the others (the default suite's time).
FAST_CASES = ([(FAST_DRIVERS[0], w) for w in workloads.WORKLOADS]
              + [(d, "model") for d in FAST_DRIVERS[1:]])

SOAK = workloads.soak()
IMAGE_SIZE = (1024 if SOAK else 256) * MiB   # fuse2fs's image: the tree must fit
WATCHDOG = 1800.0 if SOAK else mounts.WATCHDOG
HANG_WORDS = re.compile(r"hang|hung|time[sd]? ?out|deadline|unanswered|not answer|probe", re.I)
CHILD_TIMEOUT = 30  # seconds a file operation in a child process may take, hangs included


def toml(**keys):
    """A rebound config file setting keys."""
    return "".join(f"{key} = {json.dumps(value)}\n" for key, value in keys.items())


# Fails fast (deadlines of 1.5-3 s) and restarts at once, as often as it takes.
CHAOS_CONFIG = toml(request_timeout_ms=3000, probe_timeout_ms=1500, restart_budget=10000,
                    restart_backoff_ms=0)
# fuse2fs loses what it has not flushed when killed: rebound keeps a redo log, clones the image
# at each checkpoint and rolls it back before each restart (the README's recommended config;
# the image lives on a file system with reflinks, see `reflink=`).
# sshfs acknowledges writes before its server has them (see the test of that below): the redo
# log gives a restarted sshfs what the killed one had not sent.
DRIVER_CONFIG = {
    "fuse2fs": toml(redo_log=True, image="@IMAGE@", checkpoint_interval_ms=200,
                    checkpoint_changes=64),
    "sshfs": toml(redo_log=True),
}


# fuse2fs with its image anywhere (no reflinks): e2fsck repairs it before each restart, and the
# replay runs over an image that may hold changes newer than the last checkpoint.
FUSE2FS_E2FSCK_CONFIG = toml(redo_log=True, pre_restart=["e2fsck", "-fy", "@IMAGE@"])


def chaos_config(driver, mode=None):
    """CHAOS_CONFIG with the driver's own keys, and `mode` if given."""
    return CHAOS_CONFIG + DRIVER_CONFIG.get(driver, "") + (toml(mode=mode) if mode else "")


@pytest.fixture(scope="module", autouse=True)
def no_core_dumps():
    """Drivers killed with SIGSEGV or SIGABRT dump no core (the limit is inherited)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
    yield
    resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))


@pytest.fixture(scope="module", autouse=True)
def private_run_dir():
    """The control sockets of this module's rebound runs in a directory of their own (unless
    REBOUND_RUN_DIR is set), so that `rebound status` sees no other run on the machine."""
    if os.environ.get("REBOUND_RUN_DIR"):
        yield os.environ["REBOUND_RUN_DIR"]
        return
    path = mounts.new_workdir("run")
    os.environ["REBOUND_RUN_DIR"] = str(path)
    try:
        yield str(path)
    finally:
        del os.environ["REBOUND_RUN_DIR"]
        mounts.remove_workdir(path)


@pytest.fixture
def seed(request):
    """REBOUND_CHAOS_SEED, or a seed of the test's own (stable across runs)."""
    fixed = os.environ.get("REBOUND_CHAOS_SEED")
    return int(fixed) if fixed else zlib.crc32(request.node.nodeid.encode())


def tail(text, lines=60):
    return "\n".join(text.splitlines()[-lines:])


def strip_ansi(line):
    """line without its terminal colour codes."""
    return re.sub(r"\x1b\[[0-9;]*m", "", line)


def explain(m, *parts):
    """A failure message: what the test saw, the mount's status, rebound's warnings and the
    end of its log."""
    try:
        status = mount_status(m.mnt)
    except (subprocess.SubprocessError, OSError, ValueError) as e:
        status = f"<rebound status failed: {e}>"
    output = m.output()
    warnings = [line for line in output.splitlines()
                if " WARN " in strip_ansi(line) or " ERROR " in strip_ansi(line)]
    # Errors rebound gave applications first: a long run's other warnings can bury them.
    eio = [line for line in warnings if "EIO" in line]
    return "\n".join([*map(str, parts), f"status: {status}",
                      f"--- {m.describe()}: EIO given ---", *eio[:10],
                      f"--- {m.describe()}: warnings and errors ---", *warnings[-20:],
                      f"--- {m.describe()}: output (end) ---", tail(output),
                      # Again last: CI keeps only the start and the end of a long log.
                      "--- what the test saw (again) ---", *map(str, parts)])


def stop_successor(m, pid):
    """After the fixture's rebound died and successors took the mount over: stops the last,
    `pid`, as an operator would (SIGTERM), and marks the mount stopped."""
    os.kill(pid, signal.SIGTERM)
    assert mounts.wait_for(lambda: not mounts.alive(pid), mounts.STOP_TIMEOUT), \
        explain(m, f"rebound {pid} did not stop")
    m.proc.wait(timeout=10)
    m.stopped, m.returncode = True, None


def wait_serving(m, cond=serving, timeout=chaos.RECOVER_TIMEOUT):
    """The mount's status once cond holds (by default: serving); fails the test after timeout,
    or at once if rebound exits."""
    def ready():
        if m.proc.poll() is not None:
            pytest.fail(explain(m, f"rebound exited with {m.proc.returncode}"))
        status = mount_status(m.mnt)
        return status if status is not None and cond(status) else None

    status = wait_for(ready, timeout)
    assert status is not None, explain(m, f"the mount was not serving within {timeout} s")
    return status


def kill_driver(m, status, sig=signal.SIGKILL):
    """Sends sig to the serving driver of status; returns the condition "recovered"."""
    pid = status["driver_pid"]
    assert signal_descendant(pid, status["rebound_pid"], sig), \
        explain(m, f"driver_pid {pid} is not a live process under rebound")
    return recovered_from(pid, status.get("restarts", 0))


def in_child(m, op, path, timeout=CHILD_TIMEOUT):
    """(errno, result) of `op` ("stat": the size, "read": the data's length) on path in m, run
    in a child process so that a hang fails the test instead of blocking it; errno 0 on
    success. A caller whose request the driver side has already read cannot even be killed
    until it is answered, so on timeout the mount's FUSE connection is aborted first."""
    call = {"stat": "os.stat(p).st_size", "read": "len(open(p, 'rb').read())"}[op]
    code = (f"import os, sys\np = sys.argv[1]\n"
            f"try:\n print(0, {call})\nexcept OSError as e:\n print(e.errno, -1)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        why = explain(m, f"{op} {path} still waiting after {timeout} s")
        conn = mounts.fuse_connection(m.mnt)
        if conn is not None:
            mounts.abort_connection(conn)
        proc.kill()
        proc.communicate()
        pytest.fail(why)
    assert proc.returncode == 0, f"{op} {path}: the child failed:\n{err}"
    code, value = out.split()
    return int(code), int(value)


def errname(code):
    return errno.errorcode.get(code, str(code)) if code else "success"


# --- workloads under chaos ---------------------------------------------------------------------

@pytest.mark.parametrize("workload", workloads.WORKLOADS)
@pytest.mark.parametrize("driver", DRIVERS)
def test_workload_survives_driver_failures(mount, tree_tarball, seed, driver, workload):
    """Guarded from the start: every failure is a guarded driver's (fast mode's first one,
    the take-over, is the next test's)."""
    survives_failures(mount, tree_tarball, seed, driver, workload,
                      chaos_config(driver, "guarded"))


@pytest.mark.parametrize("driver,workload", FAST_CASES)
def test_workload_survives_driver_failures_in_fast_mode(mount, tree_tarball, seed, driver,
                                                        workload):
    """The same chaos with the first driver on the kernel's queue (mode = "fast"): its
    failure hands the queue to the proxy, with the requests it had read, and every later
    driver is guarded."""
    def went_fast(m, first):
        log = m.output()
        assert first["data_path"] == "fast", explain(m, "fast mode not used")
        assert "took the kernel's queue over" in log, explain(m, "the proxy never took over")
        assert mount_status(m.mnt)["data_path"] == "guarded", explain(m, "not guarded after")

    survives_failures(mount, tree_tarball, seed, driver, workload,
                      chaos_config(driver, "fast"), also=went_fast)


def survives_failures(mount, tree_tarball, seed, driver, workload, config, also=None):
    """Runs `workload` on `driver` under rebound with `config` while chaos.py fails the driver
    again and again; asserts that the application saw nothing, and what `also(mount, status)`
    does (`status`: the mount's once it first served)."""
    if workload == "tree" and (why := mounts.descriptor_shortfall(driver,
                                                                  len(tree_tarball.entries))):
        pytest.skip(why)
    result = None

    def backing_store_holds_the_result(m):
        # After a clean stop (mount_driver has checked rebound's exit status, that nothing is
        # left, and for fuse2fs that e2fsck -fn finds the image clean).
        if m.src.exists() and result is not None and result.recheck is not None:
            problems = result.recheck(m.src)
            assert not problems, "the backing directory differs from what the application " \
                                 "last saw:\n" + "\n".join(problems[:20])

    with mount(driver, "rebound", config=config, image_size=IMAGE_SIZE,
               watchdog=WATCHDOG, after_stop=backing_store_holds_the_result,
               reflink=driver == "fuse2fs") as m:
        first = wait_serving(m)

        def abort():  # the mount is lost: what waits on it fails now, not at the watchdog
            conn = mounts.fuse_connection(m.mnt)
            if conn is not None:
                mounts.abort_connection(conn)

        with chaos.Chaos(m.mnt, seed=seed, on_stuck=abort) as injector:
            result = workloads.run(workload, m.mnt, tarball=tree_tarball, seed=seed)
        status = injector.final
        why = explain(m, result.summary(), injector.describe())
        assert not injector.problems, why
        assert result.ok, why
        assert injector.injected >= 1, "the workload ended before the first injection\n" + why
        assert status["failures"] >= injector.injected, \
            "rebound status counts fewer failures than were injected\n" + why
        assert status["restarts"] >= 1, why
        assert status["last_failure"], why
        if also is not None:
            also(m, first)


def storm_passed(m, result, injector, least=3):
    """Asserts what every storm must show: the workload saw no error, the injector had no
    problem and made at least `least` failures, and rebound counted exactly those. Returns the
    final status and the explanation for further assertions."""
    status = injector.final
    why = explain(m, result.summary(), injector.describe())
    assert not injector.problems, why
    assert result.ok, why
    assert injector.injected >= least, f"fewer than {least} failures injected\n" + why
    assert status["failures"] == injector.injected, "failures not injected\n" + why
    return status, why


def test_fuse2fs_keeps_every_change_through_a_kill_storm_without_e2fsck(mount, tree_tarball,
                                                                        seed):
    """fuse2fs with its recommended config (redo log, image checkpoints on XFS), under kills
    0.2-0.8 s apart while a tree is unpacked and checked: no application error, every failure
    is one the storm caused (libfuse aborts on ids rebound got wrong were not), no restart
    runs e2fsck (each rolls the image back instead), the redo log stays bounded, and after a
    clean stop e2fsck -fn finds the image clean (mount_driver checks)."""
    kinds = ("SIGKILL", "SIGSEGV", "SIGABRT")
    with mount("fuse2fs", "rebound", config=chaos_config("fuse2fs"), image_size=IMAGE_SIZE,
               watchdog=WATCHDOG, reflink=True) as m:
        wait_serving(m)
        with chaos.Chaos(m.mnt, seed=seed, kinds=kinds, min_interval=0.2,
                         max_interval=0.8) as injector:
            result = workloads.run("tree", m.mnt, tarball=tree_tarball, seed=seed)
        status, why = storm_passed(m, result, injector)
        assert status["failures_by_cause"].get("during_restore", 0) == 0, why
        phases = status["recovery_phases_ms"]
        assert phases and all("rollback" in p and "pre_restart" not in p for p in phases), why
        assert status["checkpoints"] >= 1, why
        assert status["redo_log_max"] < 20000, why


# --- forced restart ---------------------------------------------------------------------------

@pytest.mark.parametrize("driver", DRIVERS)
def test_forced_restart_keeps_an_open_file(mount, driver):
    data = os.urandom(2 * MiB)
    with mount(driver, "rebound", config=toml(restart_backoff_ms=0)) as m:
        path = m.mnt / "held"
        path.write_bytes(data)
        before = wait_serving(m)
        assert before["restarts"] == 0, explain(m, "restarts before any restart")
        fd = os.open(path, os.O_RDWR)
        try:
            assert os.read(fd, MiB) == data[:MiB]
            rc, out, err, seconds = mounts.run_rebound(["restart", str(m.mnt)], timeout=60)
            assert rc == 0, explain(m, f"rebound restart exited {rc}:\n{out}{err}")
            after = mount_status(m.mnt)
            assert after is not None and after["state"] == "serving", explain(m, after)
            assert after["restarts"] == 1, explain(m, "restarts after one forced restart")
            assert after["driver_pid"] != before["driver_pid"], \
                explain(m, "the driver process did not change")
            # What the kernel cached of the file goes, so reads reach the new driver.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            rest = b""
            while chunk := os.read(fd, MiB):
                rest += chunk
            assert rest == data[MiB:], "the rest of the file, read after the restart, differs"
            assert os.pread(fd, 4096, 0) == data[:4096]
            assert os.pwrite(fd, b"written after the restart", 0) == 25
        finally:
            os.close(fd)
        assert workloads.read_uncached(path) == b"written after the restart" + data[25:]


@pytest.mark.parametrize("data_path", ["guarded", "fast"])
def test_a_forced_restart_lets_fuse2fs_flush_its_image_first(mount, data_path):
    """`rebound restart` of a working fuse2fs with neither a redo log nor a pre_restart
    check: its loop is ended (guarded, its channel closes; fast, one SIGTERM) and it gets
    restart_grace_ms to exit by itself (libfuse then flushes the image's metadata), so the
    image stays consistent (the mount's stop runs `e2fsck -fn`) and the new driver, which
    allocates more, has every file and directory."""
    files = {}

    def write(first, count):
        for i in range(first, first + count):
            rel = f"d{i // 20}/f{i}"
            files[rel] = os.urandom(1000 + i)
            (m.mnt / rel).parent.mkdir(exist_ok=True)
            (m.mnt / rel).write_bytes(files[rel])

    with mount("fuse2fs", "rebound", config=toml(restart_backoff_ms=0, mode=data_path)) as m:
        write(0, 200)
        # Changes with no file opened after them (fuse2fs flushes its bitmaps at a close).
        for i in range(50):
            (m.mnt / f"dir{i}").mkdir()
            (m.mnt / f"link{i}").symlink_to(f"d0/f{i}")
        wait_serving(m)
        rc, out, err, _ = mounts.run_rebound(["restart", str(m.mnt)], timeout=60)
        assert rc == 0, explain(m, f"rebound restart exited {rc}:\n{out}{err}")
        assert mount_status(m.mnt)["restarts"] == 1, explain(m, "restarts")
        write(200, 200)
        for rel, data in files.items():
            assert workloads.read_uncached(m.mnt / rel) == data, rel
        for i in range(50):
            assert (m.mnt / f"dir{i}").is_dir() and os.readlink(m.mnt / f"link{i}") == f"d0/f{i}"


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_listing_waiting_on_a_stopped_driver_goes_on_after_a_restart(mount, driver):
    """A READDIR in flight when the driver is replaced is sent again on the reopened directory
    handle, and the listing sees every entry exactly once."""
    listing_across_a_restart(mount, driver, in_flight=True)


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_listing_half_read_at_a_crash_goes_on_after_it(mount, driver):
    """A listing half read when the driver is killed goes on, after the recovery, from where
    it was, on the reopened handle (the new driver is made to list from the start first, as
    libfuse's high-level API and sshfs need), and sees every entry exactly once."""
    listing_across_a_restart(mount, driver, in_flight=False)


def listing_across_a_restart(mount, driver, in_flight):
    names = {f"entry-{i:05d}" for i in range(1500)}
    with mount(driver, "rebound", config=toml(restart_backoff_ms=0)) as m:
        many = m.mnt / "many"
        many.mkdir()
        for name in names:
            (many / name).touch()
        status = wait_serving(m)
        conn = mounts.fuse_connection(m.mnt)
        listing = subprocess.Popen(
            [sys.executable, "-c", "import os, sys\n"
             "it = os.scandir(sys.argv[1])\nfirst = next(it).name\n"
             "print(first, flush=True)\nsys.stdin.readline()\n"
             "print(' '.join([first] + [e.name for e in it]))\n", str(many)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            listing.stdout.readline()  # the first chunk is read; the next one will wait
            if in_flight:
                os.kill(status["driver_pid"], signal.SIGSTOP)
                listing.stdin.write("go\n")
                listing.stdin.flush()
                waiting = conn / "waiting"
                assert wait_for(lambda: int(waiting.read_text()) > 0, 10), \
                    explain(m, "the listing sent no request to the stopped driver")
                rc, out, err, _ = mounts.run_rebound(["restart", str(m.mnt)], timeout=60)
                assert rc == 0, explain(m, f"rebound restart exited {rc}:\n{out}{err}")
            else:
                os.kill(status["driver_pid"], signal.SIGKILL)
                wait_serving(m, lambda s: serving(s) and s["restarts"] == 1)
                listing.stdin.write("go\n")
                listing.stdin.flush()
            out, _ = listing.communicate(timeout=CHILD_TIMEOUT)
        finally:
            listing.kill()
            listing.wait()
        seen = out.split()
        assert listing.returncode == 0 and sorted(seen) == sorted(names), explain(
            m, f"listing exited {listing.returncode}; {len(seen)} names, "
            f"{len(set(seen))} distinct, {len(names - set(seen))} missing")
        after = mount_status(m.mnt)
        assert after["failures"] == 1, explain(m, "the listing's request made the driver fail")


EXCHANGE = ("import ctypes, sys\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "rc = libc.renameat2(-100, sys.argv[1].encode(), -100, sys.argv[2].encode(), 2)\n"
            "sys.exit(ctypes.get_errno() if rc else 0)\n")  # AT_FDCWD, RENAME_EXCHANGE


@pytest.mark.parametrize("done_before", [False, True], ids=["not-done", "done"])
def test_an_exchange_waiting_on_a_stopped_driver_happens_once(mount, done_before):
    """A RENAME_EXCHANGE in flight when the driver is replaced is done exactly once: sent
    again if the files are where they were, answered if the failed driver had swapped them
    (here, done behind its back in the backing directory), which a resend would undo."""
    # go-fuse's loopback does exchanges (passthrough_ll refuses them) and reports the backing
    # files' inode numbers. Guarded: beside the path the stopped driver, continued for its
    # graceful stop, does the exchange it holds itself, so none can be done behind its back.
    with mount("gofuse", "rebound", config=toml(restart_backoff_ms=0, mode="guarded")) as m:
        (m.mnt / "a").write_text("A")
        (m.mnt / "b").write_text("B")
        status = wait_serving(m)
        conn = mounts.fuse_connection(m.mnt)
        os.kill(status["driver_pid"], signal.SIGSTOP)
        swap = subprocess.Popen([sys.executable, "-c", EXCHANGE, str(m.mnt / "a"),
                                 str(m.mnt / "b")])
        try:
            waiting = conn / "waiting"
            assert wait_for(lambda: int(waiting.read_text()) > 0, 10), \
                explain(m, "the exchange sent no request to the stopped driver")
            if done_before:
                rc = subprocess.run([sys.executable, "-c", EXCHANGE, str(m.src / "a"),
                                     str(m.src / "b")]).returncode
                assert rc == 0, f"exchange in the backing directory: errno {rc}"
            rc, out, err, _ = mounts.run_rebound(["restart", str(m.mnt)], timeout=60)
            assert rc == 0, explain(m, f"rebound restart exited {rc}:\n{out}{err}")
            assert swap.wait(timeout=CHILD_TIMEOUT) == 0, explain(m, "the exchange failed")
        finally:
            swap.kill()
            swap.wait()
        assert ((m.src / "a").read_text(), (m.src / "b").read_text()) == ("B", "A"), \
            explain(m, "the backing files are not swapped exactly once")
        assert ((m.mnt / "a").read_text(), (m.mnt / "b").read_text()) == ("B", "A")


def test_a_rename_cut_in_half_by_a_failure_is_completed(mount):
    """A driver dies half-way through a rename over an existing file: the target name already
    links the moved file, the old name still does (as fuse2fs leaves it when killed between
    the two steps, once e2fsck has counted both links). Sent again, the rename would do
    nothing (POSIX: two names of one file) and the old name would stay; rebound removes it.
    The half_rename.so shim makes passthrough_ll die so, once."""
    marker = mounts.new_workdir("marker") / "died"
    shim = {"LD_PRELOAD": mounts.fixture_bin("half_rename.so"), "REBOUND_HALF_RENAME": marker}
    config = toml(restart_backoff_ms=0) + '[sandbox]\nprofile = "off"\n'  # the marker's dir
    try:
        with mount("passthrough_ll", "rebound", config=config, driver_env=shim) as m:
            (m.mnt / "a").write_text("A")
            (m.mnt / "b").write_text("B")
            os.rename(m.mnt / "a", m.mnt / "b")
            assert marker.exists(), explain(m, "the driver did not die in the rename")
            # The supervisor hears of the recovery just after the rename's answer went out.
            status = wait_serving(m, lambda s: serving(s) and s["restarts"] >= 1)
            assert status["restarts"] == 1, explain(m, status)
            assert sorted(os.listdir(m.src)) == ["b"], \
                explain(m, f"the backing directory holds {sorted(os.listdir(m.src))}")
            assert (m.src / "b").read_text() == "A"
            assert sorted(os.listdir(m.mnt)) == ["b"] and (m.mnt / "b").read_text() == "A"
    finally:
        mounts.remove_workdir(marker.parent)


def test_a_replay_over_newer_changes_leaves_rotated_files_alone(mount):
    """fuse2fs's image may hold changes newer than the redo log's last checkpoint (it flushes
    at every rename), and replaying the log by name over it must not mistake a newer file for
    an older one of the same name. Here, a rotation (log.1 -> log.2, log -> log.1, a new log)
    of files a checkpoint has made durable, then a kill before the next checkpoint: replayed
    by name alone, the first rename would move the old log over log.2, and "first" would be
    lost."""
    config = CHAOS_CONFIG + FUSE2FS_E2FSCK_CONFIG + toml(checkpoint_interval_ms=300)
    with mount("fuse2fs", "rebound", config=config) as m:
        for attempt in range(5):
            d = m.mnt / f"attempt-{attempt}"
            d.mkdir()
            (d / "log.1").write_bytes(b"first\n")
            (d / "log").write_bytes(b"second\n")
            assert wait_serving(m, lambda s: serving(s) and s["redo_log_entries"] == 0), \
                explain(m, "no checkpoint covered the files")
            os.rename(d / "log.1", d / "log.2")
            os.rename(d / "log", d / "log.1")
            (d / "log").write_bytes(b"third\n")
            before = len(re.findall(r"logged changes replayed", m.output()))
            status = wait_serving(m, kill_driver(m, wait_serving(m)))
            replayed = re.findall(r"recovered .*?: (\d+) logged changes replayed", m.output())
            if len(replayed) > before and int(replayed[-1]) > 0:
                break
            # A checkpoint came between the rotation and the kill: nothing was replayed.
        else:
            pytest.fail(explain(m, "every kill came after a checkpoint"))
        contents = {name: workloads.read_uncached(d / name) for name in ("log", "log.1", "log.2")}
        assert contents == {"log": b"third\n", "log.1": b"second\n", "log.2": b"first\n"}, \
            explain(m, contents, status)


# --- restart budget ----------------------------------------------------------------------------

@contextlib.contextmanager
def rebound_mount(driver, config):
    """A rebound mount for tests in which rebound is meant to end badly: no checks of a clean
    stop, only the cleanup (no process, no mount, no directory left)."""
    m = mounts.Mount(driver, "rebound", mounts.new_workdir(driver), config=config)
    try:
        m.prepare(64 * MiB)
        m.start()
        yield m
    finally:
        m.cleanup()


def exhaust_budget(m, budget):
    """Kills the driver budget + 1 times in a row, each time as soon as it serves again."""
    status = wait_serving(m)
    for _ in range(budget):
        status = wait_serving(m, kill_driver(m, status))
    kill_driver(m, status)


def budget_config(policy):
    return toml(restart_budget=2, restart_window_ms=60000, restart_backoff_ms=0,
                on_budget_exhausted=policy)


def test_budget_spent_fail_requests_keeps_the_mount_and_answers_eio(rebound_bin):
    with rebound_mount("passthrough_ll", budget_config("fail-requests")) as m:
        (m.mnt / "f").write_text("data")
        exhaust_budget(m, 2)
        status = wait_status(m.mnt, lambda s: s["state"] == "failed", chaos.RECOVER_TIMEOUT)
        assert status is not None, explain(m, "state never became 'failed'")
        assert status["restarts"] == 2 and status["failures"] == 3, explain(m, status)
        # A name never looked up, so the kernel has to ask: rebound answers, with EIO.
        assert errname(in_child(m, "stat", m.mnt / "never-seen")[0]) == "EIO", explain(m)
        assert errname(in_child(m, "read", m.mnt / "f")[0]) == "EIO", explain(m)
        assert is_fuse_mounted(m.mnt), "the mount went away"
        assert m.proc.poll() is None, explain(m, f"rebound exited {m.proc.returncode}")
        assert mount_status(m.mnt)["state"] == "failed"
        # And it can still be stopped: SIGTERM unmounts.
        m.proc.send_signal(signal.SIGTERM)
        m.proc.wait(timeout=STOP_TIMEOUT)
        assert not is_mounted(m.mnt), explain(m, "still mounted after SIGTERM")


def test_budget_spent_unmount_exits_1_and_unmounts(rebound_bin):
    with rebound_mount("passthrough_ll", budget_config("unmount")) as m:
        (m.mnt / "f").write_text("data")
        exhaust_budget(m, 2)
        try:
            rc = m.proc.wait(timeout=chaos.RECOVER_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(explain(m, "rebound still running after its budget was spent"))
        assert rc == 1, explain(m, f"rebound exited {rc}")
        assert not is_mounted(m.mnt), "still mounted after rebound exited"
        assert wait_for(lambda: not m.leftover_processes(), 5.0), \
            explain(m, f"processes left behind: {m.leftover_processes()}")


# --- what cannot be recovered ------------------------------------------------------------------

@pytest.mark.parametrize("driver", UNLINKING_DRIVERS)
def test_a_file_unlinked_while_open_is_lost_alone(mount, driver):
    doomed_data, kept_data = os.urandom(64 * 1024), os.urandom(64 * 1024)
    with mount(driver, "rebound", config=toml(restart_backoff_ms=0)) as m:
        doomed, kept = m.mnt / "doomed", m.mnt / "kept"
        doomed.write_bytes(doomed_data)
        kept.write_bytes(kept_data)
        doomed_fd = os.open(doomed, os.O_RDONLY)
        kept_fd = os.open(kept, os.O_RDONLY)
        try:
            os.unlink(doomed)
            assert os.read(doomed_fd, 10) == doomed_data[:10]  # fine before the failure
            wait_serving(m, kill_driver(m, wait_serving(m)))
            for fd in (doomed_fd, kept_fd):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # reads go to the driver
            with pytest.raises(OSError) as lost:
                os.pread(doomed_fd, 4096, 4096)
            assert lost.value.errno == errno.EIO, explain(m, f"read: {lost.value!r}")
            assert os.pread(kept_fd, 4096, 4096) == kept_data[4096:8192]
            (m.mnt / "new").write_bytes(b"new file")
            assert workloads.read_uncached(m.mnt / "new") == b"new file"
            status = mount_status(m.mnt)
            assert status["lost_objects"] >= 1, explain(m, status)
        finally:
            os.close(kept_fd)
            try:
                os.close(doomed_fd)
            except OSError as e:  # the FLUSH of a lost handle may fail too, only with EIO
                assert e.errno == errno.EIO, f"close of the lost file: {e!r}"


@pytest.mark.parametrize("redo_log", [True, False], ids=["redo-log", "no-redo-log"])
def test_a_write_sshfs_acknowledged_but_never_sent_survives_a_kill(mount, redo_log):
    """sshfs acknowledges a write once it has queued it for its ssh client, and waits for the
    server's answer only at close or fsync. With the ssh client stopped, a write is
    acknowledged but never reaches the server; then the driver is killed (rebound kills the
    ssh client with it). With redo_log the new driver is given the write again; without it
    the write is lost, which shows that the test makes sshfs lose acknowledged work."""
    original, patch, at = os.urandom(64 * 1024), os.urandom(4096), 8192
    with mount("sshfs", "rebound", config=toml(restart_backoff_ms=0, redo_log=redo_log)) as m:
        (m.mnt / "f").write_bytes(original)
        status = wait_serving(m)
        # The serving driver's, not its standby's (which runs in a cgroup of its own).
        ssh = [p for p in mounts.descendants(status["rebound_pid"]) if mounts.comm(p) == "ssh"
               and mounts.cgroups(p) == mounts.cgroups(status["driver_pid"])]
        assert len(ssh) == 1, explain(m, f"sshfs's ssh client not found: {ssh}")
        fd = os.open(m.mnt / "f", os.O_WRONLY)  # opened while the server still answers
        os.kill(ssh[0], signal.SIGSTOP)
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                write = pool.submit(os.pwrite, fd, patch, at)
                try:
                    assert write.result(timeout=CHILD_TIMEOUT) == len(patch)
                except concurrent.futures.TimeoutError:
                    pytest.fail(explain(m, "sshfs did not acknowledge a write before sending "
                                           "it: the scenario this test needs is gone"))
                finally:
                    if not write.done():
                        mounts.abort_connection(mounts.fuse_connection(m.mnt))
            wait_serving(m, kill_driver(m, status))
            assert not mounts.alive(ssh[0]), "rebound left the failed driver's ssh client"
        finally:
            if mounts.alive(ssh[0]):
                os.kill(ssh[0], signal.SIGCONT)
            os.close(fd)  # its FLUSH goes to the new driver
        expected = original[:at] + patch + original[at + len(patch):]
        on_server = (m.src / "f").read_bytes()
        if redo_log:
            assert on_server == expected, explain(m, "the acknowledged write is not on the server")
            assert workloads.read_uncached(m.mnt / "f") == expected
        else:
            assert on_server == original, \
                explain(m, "without the redo log the write reached the server anyway")


@pytest.mark.parametrize("data_path", ["fast", "guarded"])
def test_sshfs_that_unmounts_when_its_ssh_client_dies_is_restarted(mount, data_path):
    """sshfs unmounts its file system and exits 1 when its ssh client dies (its server or the
    network gone). rebound restarts it, and the mount stays. Before, the run stopped and the
    mount was lost (15 of 430 fault-injection trials in fast mode): the daemonized driver's
    exit status was taken from its parent, which had exited 0, and in fast mode the driver's
    unmount ended the kernel's connection at once."""
    with mount("sshfs", "rebound", config=toml(mode=data_path, restart_backoff_ms=0)) as m:
        (m.mnt / "f").write_bytes(b"kept\n")
        status = wait_serving(m)
        # The serving driver's, not its standby's (which runs in a cgroup of its own).
        ssh = [p for p in mounts.descendants(status["rebound_pid"]) if mounts.comm(p) == "ssh"
               and mounts.cgroups(p) == mounts.cgroups(status["driver_pid"])]
        assert len(ssh) == 1, explain(m, f"sshfs's ssh client not found: {ssh}")
        os.kill(ssh[0], signal.SIGKILL)
        after = wait_serving(m, recovered_from(status["driver_pid"], status.get("restarts", 0)))
        assert "asked to unmount" in (after["last_failure"] or ""), explain(m, after)
        assert (m.mnt / "f").read_bytes() == b"kept\n", explain(m)


# --- hangs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("driver", DIR_DRIVERS)
def test_a_request_to_a_hung_driver_completes_after_its_deadline(mount, driver):
    """The driver is stopped (SIGSTOP) and never continued. A stat of a name the kernel has
    never seen must reach it, wait, and succeed once rebound's request deadline has fired
    and a new driver answers. The probe is set far out, so the request's deadline is what
    fires."""
    config = toml(request_timeout_ms=1500, probe_timeout_ms=600000, restart_backoff_ms=0)
    with mount(driver, "rebound", config=config) as m:
        (m.mnt / "before").write_text("before")
        status = wait_serving(m)
        hung = status["driver_pid"]
        recovered = kill_driver(m, status, signal.SIGSTOP)
        (m.src / "late").write_bytes(b"x" * 1234)  # behind the mount's back
        err, size = in_child(m, "stat", m.mnt / "late")
        assert (errname(err), size) == ("success", 1234), explain(m, f"stat: {errname(err)}")
        after = wait_serving(m, recovered)
        assert after["failures"] >= 1 and after["restarts"] >= 1, explain(m, after)
        assert HANG_WORDS.search(after["last_failure"] or ""), \
            explain(m, f"last_failure does not name a hang: {after['last_failure']!r}")
        assert wait_for(lambda: not mounts.alive(hung), 10), "rebound left the hung driver"
        assert (m.mnt / "before").read_text() == "before"


@pytest.mark.parametrize("driver", DIR_DRIVERS)
def test_a_driver_that_hangs_on_a_lookup_of_rebound_is_found(mount, driver):
    """After a restart, the first open of a file the kernel knows makes rebound look it up
    in the new driver (which was not asked for it yet). That driver is stopped first: the
    lookup rebound waits for counts as a waiting request, so the probe finds the hang (it
    once waited for the lookup's 60 s, with the kernel's request not yet sent and so no
    probe), and the read succeeds from the driver after it."""
    config = toml(request_timeout_ms=600000, probe_timeout_ms=1000, restart_backoff_ms=0)
    with mount(driver, "rebound", config=config) as m:
        (m.mnt / "d").mkdir()
        (m.mnt / "d" / "f").write_bytes(b"y" * 2345)
        status = wait_serving(m)
        first = wait_serving(m, kill_driver(m, status))
        recovered = kill_driver(m, first, signal.SIGSTOP)
        err, size = in_child(m, "read", m.mnt / "d" / "f", timeout=20)
        assert (errname(err), size) == ("success", 2345), explain(m, f"read: {errname(err)}")
        after = wait_serving(m, recovered, timeout=20)
        assert after["failures"] == 2, explain(m, after)
        assert "probe" in (after["last_failure"] or ""), explain(m, after["last_failure"])


@pytest.mark.parametrize("driver,data_path", [(d, "guarded") for d in DRIVERS]
                         + [("passthrough_ll", "fast")])
def test_a_hung_driver_is_found_by_the_liveness_probe(mount, driver, data_path):
    """The driver is stopped while a request waits, with the request deadline set far out:
    rebound's liveness probe (sent while requests wait: guarded, a request of its own to the
    driver; fast, a statfs of the mount) is what finds the hang, and the request then
    succeeds from the new driver."""
    config = toml(request_timeout_ms=600000, probe_timeout_ms=1000, restart_backoff_ms=0,
                  mode=data_path)
    with mount(driver, "rebound", config=config) as m:
        (m.mnt / "f").write_text("still here")
        status = wait_serving(m)
        assert status["data_path"] == data_path, status
        hung = status["driver_pid"]
        recovered = kill_driver(m, status, signal.SIGSTOP)
        # A name the kernel has never seen, so the stat must reach the driver: made behind
        # the mount's back where there is a backing directory, absent in an image.
        expected = "ENOENT"
        if m.src.exists():
            (m.src / "late").write_bytes(b"x" * 4321)
            expected = "success"
        err, _ = in_child(m, "stat", m.mnt / "late", timeout=20)
        assert errname(err) == expected, explain(m, f"stat: {errname(err)}")
        after = wait_serving(m, recovered, timeout=20)
        assert after["failures"] == 1 and after["restarts"] == 1, explain(m, after)
        assert "probe" in (after["last_failure"] or ""), \
            explain(m, f"last_failure does not name the probe: {after['last_failure']!r}")
        assert wait_for(lambda: not mounts.alive(hung), 10), "rebound left the hung driver"
        assert workloads.read_uncached(m.mnt / "f") == b"still here"

def test_files_a_killed_driver_hid_are_deleted_after_each_restart(mount):
    """libfuse's high-level API hides a file unlinked while open (`.fuse_hidden*`) and deletes
    it at its last release; a driver killed in between leaves it. After each restart the
    directories where names were removed since the last one are cleaned: here the same
    directory twice, each time with a file the driver just hid."""
    with mount("fuse2fs", "rebound", config=toml(restart_backoff_ms=0)) as m:
        d = m.mnt / "d"
        d.mkdir()
        for round_ in range(2):
            status = wait_serving(m, lambda s, r=round_: serving(s) and s["restarts"] == r)
            victim = d / f"open{round_}"
            victim.write_text("x")
            with open(victim) as held:
                victim.unlink()
                hidden = [n for n in os.listdir(d) if workloads.is_hidden(n)]
                assert hidden, explain(m, "the driver did not hide the open file")
                os.kill(status["driver_pid"], signal.SIGKILL)
                wait_serving(m, lambda s, r=round_: serving(s) and s["restarts"] == r + 1)
                left = [n for n in os.listdir(d) if workloads.is_hidden(n)]
                assert not left, explain(m, f"after restart {round_ + 1}: {left}")
                del held
