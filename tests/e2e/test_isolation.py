"""rebound as an isolation layer: what a misbehaving or dying driver can and cannot do.

Owns: the rogue driver scenarios (every malformed reply is refused before the kernel sees it
and counts as a driver failure; a request that keeps getting bad replies fails alone with EIO,
and the mount goes on serving), second opinions (an error no working driver gives is asked
again of a restarted driver) and the death of a driver while it serves (restarted; or, with
no restarts allowed, rebound leaves no mount and no process behind).
"""

import contextlib
import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import mounts

# Replies are checked, and second opinions asked, only where they cross rebound.
GUARDED = 'mode = "guarded"\n'


def rogue():
    """The rogue driver script, as the session runs it (mounts.install_programs)."""
    return mounts.fixture_script("rogue_driver.py")
BAD_NAMES = ("bad-size", "bad-error", "bad-type", "wrong-unique")


def errno_of(action, path, timeout=10):
    """errno of `action` ("stat" or "read") on path, 0 on success. Runs in a child so that a
    hang fails the test instead of blocking it."""
    call = {"stat": "os.stat(p)", "read": "open(p, 'rb').read()"}[action]
    code = (f"import os,sys\np = sys.argv[1]\n"
            f"try:\n {call}; print(0)\nexcept OSError as e:\n print(e.errno)\n")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                         text=True, timeout=timeout, check=True)
    return int(out.stdout)


class Running:
    """`rebound run [OPTIONS] -- DRIVER...` in the background (run by `prefix`, a command such as
    `setpriv ...`, if given), stderr to a file, always cleaned up."""

    def __init__(self, work, driver_argv, config=None, env=None, cwd=None, options=(),
                 prefix=()):
        self.work = work
        self.mnt = work / "mnt"
        self.mnt.mkdir(exist_ok=True)
        self.err_path = work / "rebound.stderr"
        options = list(options)
        if config is not None:
            (work / "rebound.toml").write_text(config)
            options = ["--config", str(work / "rebound.toml")]
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen([*prefix, str(mounts.rebound_bin()), "run"] + options
                                         + ["--"] + driver_argv,
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=err, start_new_session=True, env=env,
                                         cwd=cwd)

    def wait_mounted(self):
        def ready():
            if mounts.is_fuse_mounted(self.mnt):
                return True
            if self.proc.poll() is not None:
                raise RuntimeError(f"rebound exited {self.proc.returncode}:\n{self.stderr()}")
            return False
        assert mounts.wait_for(ready, mounts.MOUNT_TIMEOUT), f"no mount:\n{self.stderr()}"

    def stderr(self):
        return self.err_path.read_text(errors="replace")

    def cleanup(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        mounts.umount(self.mnt)
        mounts.kill_all(list(mounts.procs_mentioning(self.mnt)))


@pytest.fixture
def running(workdir, rebound_bin):
    started = []

    def start(driver_argv, config=None):
        r = Running(workdir, driver_argv(workdir / "mnt"), config)
        started.append(r)
        r.wait_mounted()
        return r

    yield start
    for r in started:
        r.cleanup()


def test_malformed_replies_are_refused_and_the_mount_goes_on(running):
    r = running(lambda mnt: [sys.executable, str(rogue()), str(mnt)],
                config=GUARDED + 'restart_budget = 50\nrestart_backoff_ms = 0\n')
    assert sorted(os.listdir(r.mnt)) == sorted(BAD_NAMES + ("good", "long-read", "flaky",
                                                             "broken", "alias"))
    for name in BAD_NAMES:
        # Directly mounted, "bad-error" leaves the caller waiting forever. Behind rebound a
        # bad reply never reaches the kernel: the driver is restarted and asked again, and a
        # request that gets bad replies again fails alone, with EIO.
        assert errno_of("stat", r.mnt / name) == errno.EIO, name
    assert errno_of("read", r.mnt / "long-read") == errno.EIO
    assert (r.mnt / "good").read_bytes() == b"good data\n"

    log = r.stderr()
    for why in ("body of 121 bytes where 128 are required", "error value 5 out of range",
                "impossible attribute: file type", "which is not in flight",
                "exceeds the 4096 allowed"):
        assert why in log, f"no refusal for {why!r} in:\n{log}"
    # The last refusal's recovery may still be announcing itself: "serving" comes once the new
    # driver's reading process is known (at most 500 ms after it serves).
    def serving():
        status = mounts.mount_status(r.mnt)
        return status if status and status["state"] == "serving" else None

    status = mounts.wait_for(serving, 10)
    assert status, mounts.mount_status(r.mnt)
    # Each kind of bad reply cost at least one restart before its request was given up.
    kinds = len(BAD_NAMES) + 1
    assert status["restarts"] >= kinds and status["failures"] >= kinds, status
    assert "misbehaved" in (status["last_failure"] or ""), status

    r.proc.send_signal(signal.SIGTERM)
    assert r.proc.wait(timeout=mounts.STOP_TIMEOUT) == 0, r.stderr()
    assert not mounts.is_mounted(r.mnt)


def mount_status(r):
    status = mounts.mount_status(r.mnt)
    assert status is not None, "no status for the mount"
    return status


def settled_status(r, restarts):
    """The mount's status once it serves again after `restarts` restarts (bounded wait)."""
    status = mounts.wait_for(
        lambda: (s if (s := mount_status(r))["state"] == "serving" and s["restarts"] >= restarts
                 else None), 10)
    assert status is not None, f"not serving after {restarts} restarts: {mount_status(r)}"
    return status


def test_an_error_no_working_driver_gives_is_asked_again_of_a_restarted_driver(running,
                                                                                 workdir):
    state = workdir / "state"
    state.mkdir()
    r = running(lambda mnt: [sys.executable, str(rogue()), str(mnt), str(state)],
                config=GUARDED + "restart_backoff_ms = 0\n")
    # EFAULT from a LOOKUP is the driver failing: a restarted driver is asked, and its answer
    # is what the application gets.
    assert errno_of("stat", r.mnt / "flaky") == 0
    assert (state / "flaky-failed").exists(), "the first driver did not answer EFAULT"
    status = settled_status(r, 1)
    assert (status["second_opinions"], status["second_opinions_confirmed"]) == (1, 0), status
    assert "EFAULT" in r.stderr() or "Bad address" in r.stderr(), r.stderr()
    # An error the restarted driver gives too is real: forwarded.
    assert errno_of("stat", r.mnt / "broken") == errno.EIO
    status = settled_status(r, 2)
    assert (status["second_opinions"], status["second_opinions_confirmed"]) == (2, 1), status
    # And for a while (second_opinion_cooldown_ms), such errors go through without a restart.
    assert errno_of("stat", r.mnt / "broken") == errno.EIO
    status = mount_status(r)
    assert (status["restarts"], status["second_opinions"]) == (2, 2), status
    # Normal errors never cost a restart.
    assert errno_of("stat", r.mnt / "no-such-name") == errno.ENOENT
    assert mount_status(r)["restarts"] == 2


def test_an_impossible_entry_is_asked_again_of_a_restarted_driver(running, workdir):
    state = workdir / "state"
    state.mkdir()
    r = running(lambda mnt: [sys.executable, str(rogue()), str(mnt), str(state)],
                config=GUARDED + "restart_backoff_ms = 0\n")
    good = os.stat(r.mnt / "good")
    # The first driver says "alias" is the node the kernel holds as "good", which has one
    # link: impossible. The restarted driver's answer is what the application sees.
    alias = os.stat(r.mnt / "alias")
    assert (state / "alias-failed").exists(), "the first driver did not answer wrongly"
    assert alias.st_ino != good.st_ino
    status = settled_status(r, 1)
    assert (status["second_opinions"], status["second_opinions_confirmed"]) == (1, 0), status
    assert "which the kernel holds as" in r.stderr(), r.stderr()
    assert (r.mnt / "alias").read_bytes() == b"good data\n"


def test_with_second_opinions_off_a_drivers_error_goes_through(running, workdir):
    state = workdir / "state"
    state.mkdir()
    r = running(lambda mnt: [sys.executable, str(rogue()), str(mnt), str(state)],
                config=GUARDED + "second_opinion = false\n")
    assert errno_of("stat", r.mnt / "flaky") == errno.EFAULT
    status = mount_status(r)
    assert (status["restarts"], status["second_opinions"]) == (0, 0), status


def driver_daemons(r):
    """The daemon is the process (other than rebound) whose command line names the mount."""
    daemons = mounts.wait_for(
        lambda: [p for p in mounts.procs_mentioning(r.mnt) if p != r.proc.pid], 5)
    assert daemons, "no driver daemon found"
    return daemons


@pytest.mark.parametrize("data_path", ["guarded", "fast"])
def test_a_killed_driver_is_restarted_and_the_mount_serves_on(running, workdir, data_path):
    src = workdir / "src"
    src.mkdir()
    (src / "f").write_text("x")
    ll = str(mounts.fixture_bin("passthrough_ll"))
    r = running(lambda mnt: [ll, "-o", f"source={src}", str(mnt)],
                config=f'mode = "{data_path}"\n')
    with open(r.mnt / "f") as held:
        killed = driver_daemons(r)
        for pid in killed:
            # The standby among them may end first: rebound stops it when it sees the failure.
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # A signal is delivered in its own time: until they are gone, they may still serve.
        assert mounts.wait_for(lambda: not any(map(mounts.alive, killed)), 10), killed
        assert (r.mnt / "f").read_text() == "x"
        assert held.read() == "x", "a handle opened before the crash still reads"

    # The supervisor hears of the recovery (and its latency) just after the first request
    # the new driver served, which may be just after the reads above returned.
    status = mounts.wait_for(
        lambda: (s := mount_status(r))["restarts"] == 1 and len(s["recovery_ms"]) == 1 and s, 5)
    assert status, mount_status(r)
    assert status["failures"] == 1, status
    assert "driver" in status["last_failure"], status


@pytest.mark.parametrize("data_path", ["guarded", "fast"])
def test_with_no_restarts_allowed_a_killed_driver_leaves_nothing_behind(running, workdir,
                                                                        data_path):
    src = workdir / "src"
    src.mkdir()
    (src / "f").write_text("x")
    ll = str(mounts.fixture_bin("passthrough_ll"))
    r = running(lambda mnt: [ll, "-o", f"source={src}", str(mnt)],
                config=f'restart_budget = 0\non_budget_exhausted = "unmount"\n'
                       f'mode = "{data_path}"\n')
    assert (r.mnt / "f").read_text() == "x"
    for pid in driver_daemons(r):
        os.kill(pid, signal.SIGKILL)
    assert r.proc.wait(timeout=mounts.STOP_TIMEOUT) == 1, r.stderr()
    assert "closed its channel" in r.stderr() or "process gone" in r.stderr(), r.stderr()
    assert not mounts.is_mounted(r.mnt)
    assert mounts.wait_for(lambda: not mounts.procs_mentioning(r.mnt), 5), "driver processes left"


def driver_waiting_on_its_own_mount(running, data_path):
    """A rogue driver, started unconfined so that it sees its mount (the sandbox only shows a
    driver the mounts its helper made, like go-fuse's fusermount3), that holds "good" on its
    own mount open and waits on a lookup of its own; and the pid of that process."""
    r = running(lambda mnt: [sys.executable, str(rogue()), "--wait-on-own-mount", str(mnt)],
                config=f'mode = "{data_path}"\n[sandbox]\nprofile = "off"\n')
    good = str(r.mnt / "good")

    def waiting(pid):
        with contextlib.suppress(OSError):
            holds = any(os.readlink(f"/proc/{pid}/fd/{fd}") == good
                        for fd in os.listdir(f"/proc/{pid}/fd"))
            waits = any(Path(f"/proc/{pid}/task/{tid}/wchan").read_text() == "request_wait_answer"
                        for tid in os.listdir(f"/proc/{pid}/task"))
            return holds and waits
        return False

    def seen(pid):
        """What `waiting` looks at, for the failure message."""
        with contextlib.suppress(OSError):
            fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            wchans = [Path(f"/proc/{pid}/task/{tid}/wchan").read_text()
                      for tid in os.listdir(f"/proc/{pid}/task")]
            return f"pid {pid}: mount files {[f for f in fds if f.startswith(str(r.mnt))]}, " \
                   f"waits {sorted(set(wchans))}"
        return f"pid {pid}: gone"

    pid = mounts.wait_for(lambda: next(filter(waiting, mounts.descendants(r.proc.pid)), None),
                          10)
    assert pid, f"the driver did not open {good} and wait on its own lookup " \
                f"({[seen(p) for p in mounts.descendants(r.proc.pid)]}):\n{r.stderr()}"
    return r, pid


# A process that waits on a FUSE request can only die once the request is answered, if it has
# been read: so a dying driver waiting on its own mount (a lookup; or the FLUSH the kernel sends
# as it closes the files the process held open there) waits for an answer no dying driver will
# give. rebound must give it, or the driver never finishes dying.

@pytest.mark.parametrize("data_path", ["guarded", "fast"])
def test_a_driver_dying_while_it_waits_on_its_own_mount_lets_rebound_stop(running, data_path):
    r, _ = driver_waiting_on_its_own_mount(running, data_path)
    r.proc.send_signal(signal.SIGTERM)  # the driver dies of the SIGTERM rebound passes on
    try:
        code = r.proc.wait(timeout=10)  # rebound's own stop_timeout_ms is 60 s
    except subprocess.TimeoutExpired:
        pytest.fail(f"rebound did not stop within 10 s of SIGTERM:\n{r.stderr()}")
    assert code == 0, r.stderr()
    assert not mounts.is_mounted(r.mnt)


@pytest.mark.parametrize("data_path", ["guarded", "fast"])
def test_a_driver_killed_while_it_waits_on_its_own_mount_is_restarted(running, data_path):
    r, pid = driver_waiting_on_its_own_mount(running, data_path)
    os.kill(pid, signal.SIGKILL)

    def restarted():
        status = mounts.mount_status(r.mnt)
        return status and status["restarts"] >= 1 and status["state"] == "serving"

    assert mounts.wait_for(restarted, 10), \
        f"not serving again within 10 s of the kill:\n{r.stderr()}"
    assert not mounts.alive(pid)
    assert (r.mnt / "good").read_bytes() == b"good data\n"


def test_a_driver_that_closes_its_channel_and_then_unmounts_ends_the_run(workdir, rebound_bin):
    """libfuse ends a driver by closing its channel and then unmounting. A closed channel
    alone looks like a crash; the unmount that follows says the driver ended on purpose, and
    rebound must end with it (exit status 0, no restart), not restart it again and again."""
    mnt = workdir / "mnt"
    mnt.mkdir()
    rc, _, err, _ = mounts.run_rebound(
        ["run", "--", sys.executable, str(rogue()), "--close-then-unmount", str(mnt)], timeout=30)
    assert rc == 0, err
    assert "restarting" not in err and "the driver unmounted its file system" in err, err
    assert not mounts.is_mounted(mnt)


def test_a_driver_that_unmounts_after_its_channel_closed_is_not_taken_for_a_crash(workdir,
                                                                                  rebound_bin):
    """Fast mode: a driver that closes its channel, sees a process of its own end (sshfs's ssh
    client) and then unmounts. The process's end made rebound look for the channel's holder,
    find none, and restart the driver as crashed (sshfs, 1 run in 15); its unmount must end
    the run instead, with its exit status."""
    mnt = workdir / "mnt"
    mnt.mkdir()
    config = workdir / "fast.toml"
    config.write_text('mode = "fast"\n')
    rc, _, err, _ = mounts.run_rebound(
        ["run", "--config", str(config), "--", sys.executable, str(rogue()),
         "--close-fork-then-unmount", str(mnt)], timeout=30)
    assert rc == 0, err
    assert "fast mode" in err, err
    assert "restarting" not in err and "the driver unmounted its file system" in err, err
    assert not mounts.is_mounted(mnt)


def test_status_reports_the_mount_and_what_the_kernel_holds(running, workdir):
    src = workdir / "src"
    src.mkdir()
    ll = str(mounts.fixture_bin("passthrough_ll"))
    r = running(lambda mnt: [ll, "-o", f"source={src}", str(mnt)])
    for i in range(10):
        (r.mnt / f"f{i}").write_text(str(i))
    with open(r.mnt / "f0") as held:
        # In fast mode the tracker is fed in batches (every 20 ms): a status read between two
        # may count a CREATE's handle whose RELEASE is in the next batch, before the later
        # files' nodes. So both are waited for.
        status = mounts.wait_for(
            lambda: (s := mounts.mount_status(r.mnt)) and s["open_handles"] >= 1
            and s["nodes"] >= 10 and s, 5)
        assert status, mounts.all_status()
        assert status["state"] == "serving"
        assert status["rebound_pid"] == r.proc.pid
        assert status["restarts"] == 0 and status["recovery_ms"] == []
        assert status["nodes"] >= 10, status
        cmdline = Path(f"/proc/{status['driver_pid']}/cmdline").read_bytes()
        assert b"passthrough_ll" in cmdline, "driver_pid is the serving driver process"
        assert held.read() == "0"
    table = subprocess.run([str(mounts.rebound_bin()), "status"], capture_output=True,
                           text=True, timeout=10, check=True).stdout
    assert str(r.mnt) in table and "serving" in table, table

    r.proc.send_signal(signal.SIGTERM)
    assert r.proc.wait(timeout=mounts.STOP_TIMEOUT) == 0
    assert mounts.mount_status(r.mnt) is None
