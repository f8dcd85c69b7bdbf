"""Lifecycle of `rebound run`, and I/O through it under load.

Owns: how rebound starts, serves and stops daemonizing (fuse2fs, passthrough_ll, sshfs) and
foreground (passthrough_ll -f, gofuse) drivers: SIGTERM and SIGINT, `umount` by the user, a
driver failing before it mounts, a command that never mounts, a bad config file; and the
large-I/O and multi-threaded tests (run in both modes, so a failure can be pinned on rebound).
"""

import concurrent.futures
import ctypes
import hashlib
import json
import os
import random
import signal
import subprocess
import time

import pytest

import fsops
import mounts
from mounts import MiB, STOP_TIMEOUT, is_mounted, wait_for

SERVING = ["fuse2fs", "passthrough_ll", "passthrough_ll-f", "sshfs", "gofuse"]
IO_DRIVERS = ["fuse2fs", "passthrough_ll", "sshfs", "gofuse"]


def exercise(mnt):
    """Proves the mount serves: a file written and read back, a directory listed."""
    path = mnt / "hello.txt"
    path.write_bytes(b"served through the mount\n")
    assert path.read_bytes() == b"served through the mount\n"
    assert "hello.txt" in os.listdir(mnt)


def serving_pids(m):
    """The processes that serve m (rebound itself excluded); there must be some."""
    pids = [p for p in m.driver_pids if p != m.proc.pid or m.mode == "direct"]
    assert pids, f"no driver process found for {m.describe()}"
    return pids


# --- stopping ---------------------------------------------------------------------------------

# A driver must stop by itself, well before rebound's default stop_timeout_ms (60000) would
# SIGKILL it; directly mounted, each of them takes milliseconds.
STOP_GRACE = 4.0


def wait_stopped(m, pids, since, how):
    """Waits until the mount and every process serving it are gone; rebound must exit 0."""
    if m.mode == "rebound":
        try:
            rc = m.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rebound still running {STOP_TIMEOUT} s after {how}:\n{m.output()}")
        assert rc == 0, f"rebound exited with {rc} after {how}:\n{m.output()}"
        m.returncode = rc
    gone = wait_for(lambda: not is_mounted(m.mnt) and not any(mounts.alive(p) for p in pids),
                    STOP_TIMEOUT)
    elapsed = time.monotonic() - since
    assert gone, f"after {how}: mounted={is_mounted(m.mnt)}, left: {m.leftover_processes()}"
    assert elapsed < STOP_GRACE, \
        f"{m.describe()} took {elapsed:.1f} s to stop after {how}:\n{m.output()}"
    if m.mode == "direct" and not m.daemonizes:
        rc = m.proc.wait(timeout=STOP_TIMEOUT)
        # libfuse 3 drivers exit 1 after a signal (the session loop returns the signal number
        # and passthrough_ll maps any non-zero to 1); after an unmount every driver exits 0.
        if how == "umount":
            assert rc == 0, f"the driver exited with {rc} after {how}"
    m.stopped = True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("mode", mounts.MODES)
@pytest.mark.parametrize("driver", SERVING)
def test_signal_unmounts_and_stops(mount, driver, mode, sig):
    """The signal goes to rebound, or (direct) to the driver process, which must unmount and
    exit on its own: the baseline rebound is held to."""
    with mount(driver, mode) as m:
        exercise(m.mnt)
        pids = serving_pids(m)
        if mode == "rebound":
            target = m.proc.pid
        else:
            named = sorted(mounts.procs_mentioning(m.mnt))  # the driver, not sshfs's ssh
            assert len(named) == 1, named
            target = named[0]
        since = time.monotonic()
        os.kill(target, sig)
        wait_stopped(m, pids, since, sig.name)
    # mount_driver's exit checks again: no process naming the mount, e2fsck clean (fuse2fs).


@pytest.mark.parametrize("mode", mounts.MODES)
@pytest.mark.parametrize("driver", SERVING)
def test_user_umount_stops_driver(mount, driver, mode):
    with mount(driver, mode) as m:
        exercise(m.mnt)
        pids = serving_pids(m)
        since = time.monotonic()
        subprocess.run(["umount", str(m.mnt)], check=True, capture_output=True, timeout=30)
        wait_stopped(m, pids, since, "umount")


@pytest.mark.rebound
@pytest.mark.parametrize("data_path", ["fast", "guarded"])
def test_a_driver_stuck_after_the_user_umount_is_killed(mount, data_path):
    """A driver that never finishes its teardown after the user's umount (libfuse's loop can
    deadlock joining a worker cancelled holding the driver's lock; here it is stopped): rebound
    sees the mount gone (in fast mode, where none of its threads reads the queue, too), waits
    while the driver neither runs, reads, writes nor waits on a disk for half of
    stop_timeout_ms (here 2 s of 4), kills it and exits 0, before stop_timeout_ms."""
    config = f'mode = "{data_path}"\nstandby = "off"\nstop_timeout_ms = 4000\n'
    with mount("passthrough_ll", "rebound", config=config) as m:
        exercise(m.mnt)
        pids = serving_pids(m)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        since = time.monotonic()
        # umount2(2) itself: umount(8) would first stat the mount point, a request the
        # stopped driver leaves unanswered (found as a hang, which is not this test's).
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.umount2(os.fsencode(m.mnt), 0) == 0, os.strerror(ctypes.get_errno())
        try:
            rc = m.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rebound still runs {STOP_TIMEOUT} s after the umount:\n{m.output()}")
        elapsed = time.monotonic() - since
        m.returncode, m.stopped = rc, True
        assert rc == 0, f"rebound exited with {rc}:\n{m.output()}"
        assert "stuck in its teardown; killing it" in m.output(), m.output()
        assert 2 <= elapsed < 4, f"{elapsed:.1f} s:\n{m.output()}"
        assert wait_for(lambda: not any(mounts.alive(p) for p in pids), STOP_TIMEOUT)


# --- failing to mount -------------------------------------------------------------------------

def failing_driver(case, work):
    """A driver command line that fails before mounting, and its mount point."""
    mnt = work / "mnt"
    mnt.mkdir()
    src = work / "src"
    src.mkdir()
    if case == "fuse2fs-missing-image":
        return ["fuse2fs", str(work / "missing.img"), str(mnt), "-o", "fakeroot"], mnt
    if case == "passthrough_ll-missing-mountpoint":
        mnt = work / "no-such-dir"
        return [str(mounts.fixture_bin("passthrough_ll")), "-o", f"source={src}", str(mnt)], mnt
    if case == "gofuse-missing-source":
        return [str(mounts.fixture_bin("gofuse-loopback")), str(work / "no-such-src"),
                str(mnt)], mnt
    if case == "sshfs-connection-refused":
        port = mounts.free_port()  # nothing listens there
        return ["sshfs", "-p", str(port), "-o",
                "StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,BatchMode=yes",
                f"root@127.0.0.1:{src}", str(mnt)], mnt
    raise ValueError(case)


def lines(text):
    return [line.strip() for line in text.splitlines() if line.strip()]


@pytest.mark.rebound
@pytest.mark.parametrize("case", ["fuse2fs-missing-image", "passthrough_ll-missing-mountpoint",
                                  "gofuse-missing-source", "sshfs-connection-refused"])
@pytest.mark.parametrize("data_path", ["guarded", "fast"])
def test_driver_failing_before_mount(rebound_bin, workdir, case, data_path):
    argv, mnt = failing_driver(case, workdir)
    config = workdir / "rebound.toml"
    config.write_text(f'mode = "{data_path}"\n')
    # The driver on its own, to learn what it says and how it exits.
    direct = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                            stdin=subprocess.DEVNULL)
    assert direct.returncode != 0, f"{case}: the driver did not fail on its own"
    assert lines(direct.stdout + direct.stderr), f"{case}: the driver said nothing"
    assert not is_mounted(mnt)

    rc, out, err, _ = mounts.run_rebound(["run", "--config", str(config), "--"] + argv,
                                         timeout=60)
    assert rc != 0, f"rebound exited 0 for a failing driver:\n{err}"
    assert rc == direct.returncode, \
        f"rebound exited {rc}, the driver on its own {direct.returncode}:\n{err}"
    # What the driver printed reaches the same stream through rebound. (fuse2fs prints its
    # "No such file or directory" on stdout, libfuse and go-fuse on stderr.)
    for stream, said, through in (("stderr", direct.stderr, err), ("stdout", direct.stdout, out)):
        for line in lines(said):
            assert line in through, \
                f"driver's {stream} line {line!r} missing from rebound's {stream}:\n{through}"
    assert not is_mounted(mnt), f"{mnt} left mounted"
    assert not mounts.procs_mentioning(workdir), mounts.procs_mentioning(workdir)


@pytest.mark.rebound
@pytest.mark.parametrize("data_path", ["guarded", "fast"])
def test_the_status_names_a_mount_from_the_moment_it_is_mounted(rebound_bin, workdir,
                                                                 data_path):
    """A script waits for the mount and then asks rebound about it: from the moment the mount
    is in the mount table, `rebound status` names it (in fast mode the driver serves the
    kernel from the moment its mount(2) returns, before rebound's proxy is up)."""
    src, mnt = workdir / "src", workdir / "mnt"
    src.mkdir()
    mnt.mkdir()
    config = workdir / "rebound.toml"
    config.write_text(f'mode = "{data_path}"\n')
    proc = subprocess.Popen([str(rebound_bin), "run", "--config", str(config), "--",
                             str(mounts.fixture_bin("passthrough_ll")), "-o", f"source={src}",
                             str(mnt)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert wait_for(lambda: mounts.is_fuse_mounted(mnt), mounts.MOUNT_TIMEOUT,
                        interval=0.001), "no mount"
        out = subprocess.run([str(rebound_bin), "status", "--json"], capture_output=True,
                             text=True, timeout=10, check=True)
        named = [s["mountpoint"] for s in json.loads(out.stdout)]
        assert str(mnt) in named, named
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=STOP_TIMEOUT)
    assert proc.returncode == 0


@pytest.mark.rebound
def test_fast_mode_where_bpf_is_denied_serves_guarded_from_the_first_driver(mount, rebound_bin,
                                                                            workdir):
    """Where rebound cannot load its observer (bpf(2) fails with EPERM, as in a container under
    Docker's default seccomp profile), fast mode is refused before the first driver starts:
    the mount is served guarded, and that driver gets guarded mode's filter, which shows
    rebound its splices into the channel. go-fuse splices file data into its replies; started
    with fast mode's filter, its first large read reached rebound cut into pieces and it was
    restarted as a misbehaving driver."""
    wrapper = workdir / "rebound-without-bpf"
    wrapper.write_text(f'#!/bin/sh\nexec python3 {mounts.fixture_script("without_bpf.py")} '
                       f'{rebound_bin} "$@"\n')
    wrapper.chmod(0o755)
    with mount("gofuse", "rebound", config='mode = "fast"\n', rebound=wrapper) as m:
        data = random.randbytes(8 * MiB)
        (m.src / "big").write_bytes(data)
        assert hashlib.sha256((m.mnt / "big").read_bytes()).digest() == \
            hashlib.sha256(data).digest()
        status = mounts.mount_status(m.mnt)
        assert status["data_path"] == "guarded", status
        assert status["failures"] == 0, f"{status}\n{m.output()}"
        assert 'mode = "fast" is not available here, serving guarded' in m.output()


@pytest.mark.rebound
@pytest.mark.parametrize("given", ["through a symbolic link", "with a space in its name"])
def test_a_mount_point_the_mount_table_names_otherwise_is_served_fast(rebound_bin, workdir,
                                                                      given):
    """go-fuse passes fusermount3 its mount point as given. The mount table names it with its
    links resolved, and with a space escaped (`\\040`). rebound finds the mount there: before,
    through a link, fast mode could not observe it and the mount was served guarded; and it
    keeps a standby for it: before, it took the mount for gone (in both cases) and dropped
    its standby and the driver's copy of the mount."""
    src = workdir / "src"
    src.mkdir()
    if given == "through a symbolic link":
        mnt, target = workdir / "mnt", workdir / "link"
        target.symlink_to(mnt)
    else:
        mnt = target = workdir / "m nt"
    mnt.mkdir()
    (src / "f").write_bytes(b"through rebound\n")
    config = workdir / "rebound.toml"
    config.write_text('mode = "fast"\n')
    log = workdir / "rebound.log"
    with open(log, "wb") as err:  # (a file: a pipe nobody reads could fill and stop rebound)
        proc = subprocess.Popen([str(rebound_bin), "run", "--config", str(config), "--",
                                 str(mounts.fixture_bin("gofuse-loopback")), str(src),
                                 str(target)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        assert wait_for(lambda: (mounts.mount_status(target) or {}).get("standby_pid"),
                        mounts.MOUNT_TIMEOUT), "no standby"
        status = mounts.mount_status(target)
        assert status["data_path"] == "fast", status
        assert status["failures"] == 0, status
        assert (mnt / "f").read_bytes() == b"through rebound\n"
        # The mount table is looked at every 250 ms: a standby dropped for a mount taken for
        # gone would show within a few looks.
        changed = wait_for(lambda: (mounts.mount_status(target) or {}).get("standby_pid")
                           != status["standby_pid"] or "was unmounted" in log.read_text(), 1.5)
        assert not changed, log.read_text(errors="replace")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=STOP_TIMEOUT)
    assert proc.returncode == 0, log.read_text(errors="replace")


@pytest.mark.rebound
def test_command_that_exits_without_mounting(rebound_bin):
    rc, _, err, _ = mounts.run_rebound(["run", "--", "true"], timeout=30)
    assert rc == 1, f"rebound exited {rc} for `true`:\n{err}"
    assert "mount" in err.lower(), f"no word about the missing mount:\n{err}"


@pytest.mark.rebound
def test_command_that_never_mounts_times_out(rebound_bin, workdir):
    config = workdir / "rebound.toml"
    config.write_text("mount_timeout_ms = 2000\n")
    start = time.monotonic()
    proc = subprocess.Popen([str(rebound_bin), "run", "--config", str(config), "--",
                             "sleep", "1000"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        # The sleep, wherever rebound puts it in its process tree.
        sleepers = wait_for(lambda: [p for p in mounts.descendants(proc.pid)
                                     if mounts.comm(p) == "sleep"], 5.0)
        assert sleepers, "rebound did not start `sleep 1000`"
        try:
            _, err = proc.communicate(timeout=max(0.1, 10 - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            pytest.fail("rebound still waiting 10 s after starting `sleep 1000` with "
                        "mount_timeout_ms = 2000")
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            mounts.kill_all([proc.pid] + mounts.descendants(proc.pid))
            proc.communicate()
    assert proc.returncode == 1, f"rebound exited {proc.returncode}:\n{err}"
    assert "mount" in err.lower(), f"no word about the missing mount:\n{err}"
    assert elapsed >= 1.9, f"gave up after {elapsed:.1f} s, before mount_timeout_ms=2000"
    assert wait_for(lambda: not any(mounts.alive(p) for p in sleepers), 5.0), \
        f"`sleep 1000` outlived rebound: {sleepers}"


@pytest.mark.rebound
@pytest.mark.parametrize("text,key", [
    ("no_such_key = 1\n", "no_such_key"),
    ('mount_timeout_ms = "soon"\n', "mount_timeout_ms"),
], ids=["unknown-key", "wrong-type"])
def test_bad_config_is_refused(rebound_bin, workdir, text, key):
    config = workdir / "rebound.toml"
    config.write_text(text)
    marker = workdir / "driver-ran"
    rc, _, err, _ = mounts.run_rebound(["run", "--config", str(config), "--", "touch",
                                        str(marker)], timeout=30)
    assert rc == 2, f"rebound exited {rc} for a bad config:\n{err}"
    assert len(lines(err)) == 1, f"expected a one-line message, got:\n{err}"
    assert key in err, f"the message does not name {key}:\n{err}"
    assert not marker.exists(), "the driver ran despite the bad config"


# --- I/O under load ---------------------------------------------------------------------------

def sha256_of(path, block=MiB):
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


@pytest.mark.parametrize("mode", mounts.MODES)
@pytest.mark.parametrize("driver", IO_DRIVERS)
def test_large_io(mount, driver, mode):
    """64 MiB in 1 MiB blocks: written, synced, dropped from the page cache, read back, and
    found in the backing store (for fuse2fs: in the image, after the unmount)."""
    blocks = [hashlib.shake_256(f"block-{i}".encode()).digest(MiB) for i in range(64)]
    expected = hashlib.sha256(b"".join(blocks)).hexdigest()

    def image_holds_data(m):
        dump = m.work / "big.dump"
        subprocess.run(["debugfs", "-R", f"dump /big {dump}", str(m.img)], check=True,
                       capture_output=True, timeout=120)
        assert sha256_of(dump) == expected, "data in the ext4 image differs"

    after_stop = image_holds_data if driver == "fuse2fs" else None
    with mount(driver, mode, image_size=160 * MiB, after_stop=after_stop) as m:
        path = m.mnt / "big"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for block in blocks:
                assert os.write(fd, block) == MiB
            os.fsync(fd)
        finally:
            os.close(fd)
        assert os.stat(path).st_size == 64 * MiB
        fd = os.open(path, os.O_RDONLY)
        try:
            # Clean pages leave the cache, so the read below goes through the driver.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        assert sha256_of(path) == expected, "data read back through the mount differs"
        if m.src.exists():
            assert sha256_of(m.src / "big") == expected, "data in the backing directory differs"


THREADS = 8


def worker(root, n):
    """One thread's share of the concurrency test, in its own directory: files of assorted
    sizes written in pieces, re-read, overwritten in place through a second descriptor,
    renamed, some unlinked. Returns {name: content} of what it left."""
    rng = random.Random(n)
    d = root / f"t{n}"
    d.mkdir()
    left = {}
    for i in range(24):
        size = rng.choice([0, 1, 4095, 4097, 65536, 200_003, 1 * MiB + 17])
        data = hashlib.shake_256(f"{n}-{i}".encode()).digest(size) if size else b""
        path = d / f"f{i}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            pos = 0
            while pos < size:  # pieces of random length, not page aligned
                step = rng.randint(1, 300_000)
                pos += os.pwrite(fd, data[pos:pos + step], pos)
            if size:
                # Overwrite a slice through a second descriptor, then read all back.
                off = rng.randrange(size)
                patch = bytes(rng.getrandbits(8) for _ in range(min(64, size - off)))
                fd2 = os.open(path, os.O_WRONLY)
                try:
                    os.pwrite(fd2, patch, off)
                finally:
                    os.close(fd2)
                data = data[:off] + patch + data[off + len(patch):]
            got = os.pread(fd, size + 1, 0)
        finally:
            os.close(fd)
        if got != data:
            raise AssertionError(f"thread {n} file {i}: read {len(got)} bytes, differs")
        if i % 3 == 0:
            os.unlink(path)
        elif i % 3 == 1:
            os.rename(path, d / f"r{i}")
            left[f"r{i}"] = data
        else:
            left[f"f{i}"] = data
    return left


@pytest.mark.parametrize("mode", mounts.MODES)
@pytest.mark.parametrize("driver", IO_DRIVERS)
def test_concurrent_threads(mount, driver, mode):
    """8 threads at once, each on its own files; then every survivor is checked again."""
    with mount(driver, mode, image_size=160 * MiB) as m:
        with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
            futures = [pool.submit(worker, m.mnt, n) for n in range(THREADS)]
            results = [f.result(timeout=120) for f in futures]
        for n, left in enumerate(results):
            d = m.mnt / f"t{n}"
            assert sorted(fsops.listdir(d)) == sorted(left), f"thread {n}: wrong directory listing"
            for name, data in left.items():
                assert (d / name).read_bytes() == data, f"thread {n}: {name} differs"
