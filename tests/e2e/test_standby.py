"""Standby successors: a driver started ahead of a failure, waiting for its INIT, takes over.

Owns: the proof that for each driver that can have one (passthrough_ll, sshfs, go-fuse) a
standby is kept ready while the driver serves, takes over when the serving driver is killed
(an open file keeps reading; in fast mode, writers see no error and none is left waiting,
even when the driver dies as it reads its first large writes;
requests parked on files the successor must look up first wait for no timeout),
and is replaced once it has; that a standby dying unused is
replaced and is not a driver failure; that a user's umount after a restart ends the run, with
a standby or without (no copy of the mount is left in a driver's namespace to keep the
connection); that fuse2fs, which reads its image at start, gets one held before exec, with the
reason in rebound's log, and with its image checkpointed (`image`), an initialised one on a
spare of the checkpoint, brought forward by each checkpoint, whose spare becomes the image.
Must not: measure how fast a takeover is (bench/recovery.py does).
"""

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

import chaos
import mounts
from chaos import serving
from mounts import mount_status
import workloads
from test_recovery import DRIVER_CONFIG, explain, toml, wait_serving

pytestmark = [pytest.mark.recovery, pytest.mark.rebound,
              pytest.mark.usefixtures("many_open_files")]

STANDBY_DRIVERS = ["passthrough_ll", "sshfs", "gofuse"]


def standby_ready(status):
    return serving(status) and bool(status.get("standby_pid"))


def each_goes_on(m, counts, who, status):
    """Waits until every worker past a take-over does more work: each of `counts` (the work
    each has done, which they keep counting) grows. Else fails, naming `who` and `status`."""
    seen = list(counts)
    assert mounts.wait_for(lambda: all(n > s for n, s in zip(counts, seen)),
                           chaos.RECOVER_TIMEOUT), \
        explain(m, f"{who} waits since the take-over", status)


@pytest.mark.parametrize("driver", STANDBY_DRIVERS)
def test_a_standby_takes_over_from_a_killed_driver(mount, driver):
    data = os.urandom(256 * 1024)
    with mount(driver, "rebound", config=toml(restart_backoff_ms=0)) as m:
        path = m.mnt / "held"
        path.write_bytes(data)
        before = wait_serving(m, standby_ready)
        assert before["standby_pid"] != before["driver_pid"], explain(m, before)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.kill(before["driver_pid"], signal.SIGKILL)
            after = wait_serving(m, lambda s: serving(s) and s["restarts"] == 1)
            assert after["standby_takeovers"] == 1, explain(m, "no takeover", after)
            assert after["failures"] == 1, explain(m, after)
            # Uncached, so that the read reaches the driver that took over.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            assert os.pread(fd, len(data), 0) == data, explain(m, "the held file differs")
        finally:
            os.close(fd)
        # The next failure has a successor ready too: another process than the one used.
        again = wait_serving(m, lambda s: standby_ready(s)
                             and s["standby_pid"] != before["standby_pid"])
        assert again["driver_pid"] != again["standby_pid"], explain(m, again)


def test_a_standby_takes_over_a_fast_mode_queue_under_writers_and_none_waits(mount):
    """The default mode's first failure, many times: passthrough_ll serving the kernel's queue
    itself is SIGKILLed under two writers of 200 KB blocks, and the standby takes over as the
    proxy starts reading the queue. Every write succeeds and none waits forever. (A request
    parked by a queue reader just after the recovery took the parked ones was never sent:
    about 1 round in 45 hung before that was fixed, so these 20 rounds catch it about one run
    in three; 200 rounds passed with the fix.)"""
    rng = random.Random(20261128)
    for round_ in range(20):
        with mount("passthrough_ll", "rebound", config=toml(restart_backoff_ms=0)) as m:
            before = wait_serving(m, standby_ready)
            assert before["data_path"] == "fast", explain(m, before)
            stop, errors, writes = threading.Event(), [], [0, 0]

            def writer(w):
                fd = os.open(m.mnt / f"w{w}", os.O_RDWR | os.O_CREAT, 0o644)
                block = os.urandom(200_000)
                try:
                    while not stop.is_set():
                        try:
                            os.pwrite(fd, block, rng.randrange(1 << 20))
                            writes[w] += 1
                        except OSError as e:
                            errors.append(f"writer {w}: {e}")
                finally:
                    os.close(fd)

            writers = [threading.Thread(target=writer, args=(w,), daemon=True)
                       for w in range(2)]
            for t in writers:
                t.start()
            try:
                time.sleep(rng.uniform(0.05, 0.3))  # a random moment of the writes
                os.kill(before["driver_pid"], signal.SIGKILL)
                after = wait_serving(m, lambda s: serving(s) and s["restarts"] == 1)
                each_goes_on(m, writes, f"round {round_}: a writer", after)
            finally:
                stop.set()
                for t in writers:
                    t.join(chaos.RECOVER_TIMEOUT)
            assert not any(t.is_alive() for t in writers), explain(m, f"round {round_}: stuck")
            assert not errors, explain(m, f"round {round_}: {errors[:5]}")
            assert after["standby_takeovers"] == 1, explain(m, after)


PIPE_MAX_SIZE = Path("/proc/sys/fs/pipe-max-size")


@pytest.fixture
def host_pipe_limit():
    """The host's fs.pipe-max-size set back to its default (1 MiB) for the test, and to what it
    was after."""
    before = PIPE_MAX_SIZE.read_text()
    PIPE_MAX_SIZE.write_text(str(1 << 20))
    yield
    PIPE_MAX_SIZE.write_text(before)


def test_a_driver_killed_as_it_reads_its_first_large_writes_fails_none(mount, host_pipe_limit):
    """Fast mode's first failure just as writing starts, 25 times: passthrough_ll, mounted
    anew each time (none of its threads' buffers touched yet), is SIGKILLed, SIGSEGVed or
    SIGABRTed 0-10 ms after three writers of 4 MiB files start, and every write succeeds. (A driver that reads requests
    with read(2) and dies while the kernel copies one into a page of its memory not yet
    touched makes the kernel end that request with EIO (fuse_dev_do_read), an error no
    takeover can undo: 7 and 8 of 100 rounds of bench/spikes/fast-takeover-writes.py failed so.
    rebound raises fs.pipe-max-size so that libfuse 3 splices its reads into pages of the
    kernel's own: 0 of 200 there. Without the raise, this test failed 3 runs of 3 (at rounds
    1, 4 and 5); with it, 75 rounds passed.)"""
    rng = random.Random(20261129)
    block = os.urandom(4 << 20)
    for round_ in range(25):
        with mount("passthrough_ll", "rebound", config=toml(restart_backoff_ms=0)) as m:
            before = wait_serving(m)
            assert before["data_path"] == "fast", explain(m, before)
            if round_ == 0:
                assert int(PIPE_MAX_SIZE.read_text()) >= 2 << 20, explain(m, "not raised")
                assert "raised fs.pipe-max-size from 1048576" in m.output(), explain(m)
            errors, done = [], []

            def writer(w):
                try:
                    (m.mnt / f"w{w}").write_bytes(block)
                    done.append(w)
                except OSError as e:
                    errors.append(f"writer {w}: {e}")

            writers = [threading.Thread(target=writer, args=(w,), daemon=True)
                       for w in range(3)]
            for t in writers:
                t.start()
            time.sleep(rng.uniform(0, 0.01))
            os.kill(before["driver_pid"],
                    rng.choice([signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT]))
            for t in writers:
                t.join(chaos.RECOVER_TIMEOUT)
            assert not any(t.is_alive() for t in writers), explain(m, f"round {round_}: stuck")
            assert not errors, explain(m, f"round {round_}: {errors}")
            assert sorted(done) == [0, 1, 2], explain(m, f"round {round_}: {done}")


@pytest.mark.parametrize("data_path", ["guarded", "fast"])
def test_requests_parked_on_many_files_during_a_takeover_wait_for_no_timeout(mount, data_path):
    """Four readers open and read files at random among 200 the kernel holds while the driver
    is SIGKILLed, 5 times: the successor knows none of them, so many requests parked during
    its restore need a lookup first (of the directory, or of a file the kernel holds). Every read succeeds, and none waits anywhere near the
    request timeout. (The take-over sent the parked requests under the link's lock; the
    proxy's reader, holding the reply to one of them, waited for that lock, and the lookup's
    reply behind it waited until the lookup timed out.)"""
    timeout_s = 30
    config = toml(restart_backoff_ms=0, mode=data_path, request_timeout_ms=timeout_s * 1000)
    with mount("passthrough_ll", "rebound", config=config) as m:
        d = m.mnt / "d"
        d.mkdir()
        for i in range(200):
            (d / f"f{i}").write_bytes(b"%d" % i)
        stop, errors, slowest, reads = threading.Event(), [], [0.0], [0] * 4

        def reader(r):
            rng = random.Random(r)
            while not stop.is_set():
                i = rng.randrange(200)
                start = time.monotonic()
                try:
                    if (d / f"f{i}").read_bytes() != b"%d" % i:
                        errors.append(f"f{i} reads wrong")
                    reads[r] += 1
                except OSError as e:
                    errors.append(f"f{i}: {e}")
                slowest[0] = max(slowest[0], time.monotonic() - start)

        readers = [threading.Thread(target=reader, args=(r,), daemon=True) for r in range(4)]
        for t in readers:
            t.start()
        try:
            for round_ in range(1, 6):
                before = wait_serving(m, standby_ready)
                os.kill(before["driver_pid"], signal.SIGKILL)
                after = wait_serving(m, lambda s: serving(s) and s["restarts"] == round_)
                each_goes_on(m, reads, f"round {round_}: a reader", after)
        finally:
            stop.set()
            for t in readers:
                t.join(timeout_s + chaos.RECOVER_TIMEOUT)
        assert not any(t.is_alive() for t in readers), explain(m, "a reader is stuck")
        assert not errors, explain(m, errors[:5])
        # A stall waits out the lookup's timeout (the request timeout); a take-over is quick.
        assert slowest[0] < timeout_s / 3, explain(m, f"the slowest read took {slowest[0]:.1f} s")


def standby_answered_init(m):
    """Whether rebound's log says a standby answered the kernel's INIT ahead of a failure."""
    return "standby driver answered INIT" in m.output()


@pytest.mark.parametrize("data_path", ["guarded", "fast"])
def test_an_sshfs_standby_has_its_ssh_session_open_before_a_failure(mount, data_path):
    """sshfs opens its SSH session after mount(2) and then daemonizes: its standby's mount is
    answered at once, so that both happen before a failure and the takeover pays for neither
    (the daemon and its ssh are still told from the serving driver's). In fast mode the
    kernel's INIT may be observed after the standby mounted: it is given its INIT then."""
    with mount("sshfs", "rebound", config=toml(restart_backoff_ms=0, mode=data_path)) as m:
        (m.mnt / "f").write_text("x")
        before = wait_serving(m, standby_ready)

        def ssh_sessions():
            return [p for p in mounts.descendants(before["rebound_pid"])
                    if mounts.comm(p) == "ssh"]

        assert mounts.wait_for(lambda: len(ssh_sessions()) == 2, 30), \
            explain(m, f"ssh processes under rebound: {ssh_sessions()}")
        sessions = set(ssh_sessions())
        # Its INIT is answered ahead too, once it reads its channel (after its session).
        assert mounts.wait_for(lambda: standby_answered_init(m), 30), explain(m, before)
        os.kill(before["driver_pid"], signal.SIGKILL)
        after = wait_serving(m, lambda s: serving(s) and s["restarts"] == 1)
        assert after["standby_takeovers"] == 1, explain(m, after)
        assert "its INIT answered) takes over" in m.output(), explain(m, after)
        assert (m.mnt / "f").read_text() == "x"
        # The failed driver's session is gone; the standby's serves on.
        kept = sessions & set(ssh_sessions())
        assert len(kept) == 1, explain(m, f"ssh before {sessions}, after {ssh_sessions()}")


def test_a_standby_dying_unused_is_replaced_and_no_failure(mount):
    with mount("passthrough_ll", "rebound") as m:
        (m.mnt / "f").write_text("x")
        before = wait_serving(m, standby_ready)
        os.kill(before["standby_pid"], signal.SIGKILL)
        after = wait_serving(m, lambda s: standby_ready(s)
                             and s["standby_pid"] != before["standby_pid"])
        assert (after["failures"], after["restarts"], after["standby_takeovers"]) == (0, 0, 0), \
            explain(m, after)
        assert after["driver_pid"] == before["driver_pid"], explain(m, after)
        assert (m.mnt / "f").read_text() == "x"
        assert "the standby driver" in m.output() and "ended before it was needed" in m.output()


def test_fuse2fs_gets_a_standby_held_before_exec(mount):
    """fuse2fs reads its image at start, so its standby must not run before the failure: it
    waits, confined and in its cgroup, before exec, and takes over from there."""
    with mount("fuse2fs", "rebound", config=toml(restart_backoff_ms=0)) as m:
        (m.mnt / "f").write_text("x")
        before = wait_serving(m, standby_ready)
        why = "fuse2fs reads its writable store at start"
        assert f"the standby successor is held before exec: {why}" in m.output(), \
            explain(m, before)
        # Held before exec: still rebound's own program, with no image open.
        held = before["standby_pid"]
        rebound_exe = os.readlink(f"/proc/{before['rebound_pid']}/exe")
        assert os.readlink(f"/proc/{held}/exe") == rebound_exe, \
            explain(m, "the standby ran before the failure")
        os.kill(before["driver_pid"], signal.SIGKILL)
        after = wait_serving(m, lambda s: serving(s) and s["restarts"] == 1)
        assert after["standby_takeovers"] == 1, explain(m, after)
        assert (m.mnt / "f").read_text() == "x"
        (m.mnt / "g").write_text("y")
        assert workloads.read_uncached(m.mnt / "g") == b"y"


def processes_holding(file_id):
    """The pids with the file `(st_dev, st_ino)` open."""
    holders = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    if (st.st_dev, st.st_ino) == file_id:
                        holders.add(int(pid))
    return holders


def test_fuse2fs_with_an_image_gets_an_initialised_standby_on_a_spare(mount):
    """With `image`, fuse2fs's standby runs before the failure on a spare of the image's last
    checkpoint, shown to it at the image's path (the image itself, which the serving driver
    writes, it never opens); each checkpoint brings it forward; at the failure the spare
    becomes the image, and nothing written before the kill is lost."""
    options = toml(restart_backoff_ms=0) + DRIVER_CONFIG["fuse2fs"]
    with mount("fuse2fs", "rebound", config=options, reflink=True) as m:
        (m.mnt / "f").write_text("x")
        before = wait_serving(m, standby_ready)
        spare = m.img.parent / f".{m.img.name}.rebound-spare"
        spare_id = (spare.stat().st_dev, spare.stat().st_ino)
        image_id = (m.img.stat().st_dev, m.img.stat().st_ino)
        on_spare = mounts.wait_for(lambda: processes_holding(spare_id), 10)
        assert on_spare and before["driver_pid"] not in on_spare, explain(m, on_spare)
        assert not processes_holding(image_id) & on_spare, \
            explain(m, "the standby opened the serving driver's image")
        # Several checkpoints' worth of changes (64 each), made while the standby waits.
        for i in range(300):
            (m.mnt / f"n{i}").write_text(f"file {i}")
        # On a loaded machine the standby can fall behind the writes, and one far enough
        # behind rightly does not take over (a roll-back is quicker): it is let catch up.
        wait_serving(m, lambda s: standby_ready(s) and s["standby_lacks"] == 0)
        os.kill(before["driver_pid"], signal.SIGKILL)
        after = wait_serving(m, lambda s: serving(s) and s["restarts"] == 1)
        assert after["standby_takeovers"] == 1, explain(m, after)
        assert "the standby's spare is the image now" in m.output(), explain(m, after)
        assert (m.img.stat().st_dev, m.img.stat().st_ino) == spare_id, \
            explain(m, "the image is not the spare the standby wrote")
        for i in range(300):
            assert workloads.read_uncached(m.mnt / f"n{i}") == f"file {i}".encode(), \
                explain(m, f"n{i}")
        assert (m.mnt / "f").read_text() == "x"


@pytest.mark.parametrize("standby", ["auto", "off"])
@pytest.mark.parametrize("driver", STANDBY_DRIVERS)
def test_a_user_umount_after_a_restart_ends_the_run(mount, driver, standby):
    with mount(driver, "rebound", config=toml(restart_backoff_ms=0, standby=standby)) as m:
        (m.mnt / "f").write_text("x")
        ready = standby_ready if standby == "auto" else serving
        wait_serving(m, ready)
        rc, out, err, _ = mounts.run_rebound(["restart", str(m.mnt)], timeout=60)
        assert rc == 0, explain(m, f"rebound restart exited {rc}:\n{out}{err}")
        wait_serving(m, lambda s: ready(s) and s["restarts"] == 1)
        assert (m.mnt / "f").read_text() == "x"
        subprocess.run(["umount", str(m.mnt)], check=True, capture_output=True, timeout=30)
        try:
            m.returncode = m.proc.wait(timeout=mounts.STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(explain(m, "rebound still runs after the user's umount"))
        m.stopped = True
        assert m.returncode == 0, explain(m, f"rebound exited {m.returncode}")


def test_a_standby_whose_helper_looked_at_a_hung_mount_takes_over(mount):
    """go-fuse's standby mounts through fusermount3, which looks at the mount point first: a
    request to the mount. With the serving driver stopped (a hang), that request waits for a
    driver; when the hang is found and the standby takes over, it must be answered for the
    standby (as the shadow answers a restarting driver), or the standby waits for itself."""
    with mount("gofuse", "rebound", config=toml(restart_backoff_ms=0, probe_timeout_ms=1000,
                                                mount_timeout_ms=60000)) as m:
        (m.mnt / "f").write_text("x")
        before = wait_serving(m, standby_ready)
        os.kill(before["driver_pid"], signal.SIGSTOP)
        # The next standby starts a second later, and its fusermount3 meets the hung mount.
        os.kill(before["standby_pid"], signal.SIGKILL)
        # A request that waits on the stopped driver, so that the liveness probe runs.
        reader = subprocess.Popen(["stat", str(m.mnt / "f")], stdout=subprocess.DEVNULL)
        try:
            after = wait_serving(m, lambda s: serving(s) and s["restarts"] == 1, timeout=20)
            assert after["failures_by_cause"].get("hang") == 1, explain(m, after)
            assert reader.wait(timeout=20) == 0, explain(m, "the waiting stat failed")
        finally:
            reader.kill()
            reader.wait()
            with contextlib.suppress(ProcessLookupError):  # rebound killed it, normally
                os.kill(before["driver_pid"], signal.SIGCONT)
        assert (m.mnt / "f").read_text() == "x"
