"""Failure injection into the driver behind a rebound mount, while a workload runs.

Owns: waiting for a mount's status to reach a state, and `Chaos`, a thread that again and
again waits until the mount is serving, picks the current driver_pid (it changes with every
restart, and daemonizing drivers change it on their own) and makes that driver fail: SIGKILL,
SIGSEGV, SIGABRT, or a hang (SIGSTOP, and the driver is left stopped: rebound's deadlines
must notice and kill it). Injections are spaced by seeded random intervals. A signal only
goes to a process that is still a live descendant of the rebound process, through a pidfd
opened before the check, so a recycled pid is never hit.

Must not: decide whether recovery worked; the test compares what Chaos injected with what
`rebound status` counted and what the workload saw.
"""

import collections
import os
import random
import select
import signal
import subprocess
import threading
import time

import mounts
from mounts import mount_status

KINDS = ("SIGKILL", "SIGSEGV", "SIGABRT", "hang")
RECOVER_TIMEOUT = 30.0   # seconds a mount may take to be serving again after a failure


def wait_status(mnt, cond, timeout):
    """Polls mount_status(mnt) until cond(status) holds; returns that status, or None after
    timeout."""
    def check():
        status = mount_status(mnt)
        return status if status is not None and cond(status) else None

    return mounts.wait_for(check, timeout, interval=0.05)


def serving(status):
    """The driver answered INIT and its serving process is named (rebound waits, briefly, for
    a process of the driver to read the channel before it says ready: a daemonizing driver's
    parent holds the channel until it exits)."""
    return (status.get("state") == "serving" and bool(status.get("ready"))
            and bool(status.get("driver_pid")))


def recovered_from(pid, restarts):
    """A condition: serving again, by a driver other than pid (or after a restart more than
    `restarts`, should a new driver ever get the same pid)."""
    return lambda s: serving(s) and (s["driver_pid"] != pid or s.get("restarts", 0) > restarts)


# How long a process that was sent SIGSEGV may live on before it gets a second one.
SECOND_SEGV_AFTER = 0.5


def signal_descendant(pid, ancestor, sig):
    """Sends sig to pid if it is a live descendant of ancestor. The pidfd is opened first, so
    the check and the signal are about the same process. Returns False if it is not.

    A Rust program survives a SIGSEGV sent by kill(2): its standard library catches the first
    one (to tell a stack overflow), finds no fault, restores the default action and returns.
    A driver still alive after SECOND_SEGV_AFTER seconds gets a second one, which a fault
    would have raised again."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        if not mounts.alive(pid) or pid not in mounts.descendants(ancestor):
            return False
        signal.pidfd_send_signal(pidfd, sig)
        if sig == signal.SIGSEGV:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)  # readable once the process has ended
            if not poller.poll(SECOND_SEGV_AFTER * 1000):
                signal.pidfd_send_signal(pidfd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(pidfd)


class Chaos:
    """A thread that injects driver failures into the rebound mount at mnt until stopped.

        with Chaos(m.mnt, seed=7) as chaos:
            result = workloads.tree(m.mnt, tarball)
        # stopped, and the mount serving again (else chaos.problems says why)
        assert chaos.final["failures"] >= chaos.injected

    The first injection comes within `first_within` seconds, so that even a short workload
    sees one; the others `min_interval`..`max_interval` seconds after the previous recovery.
    When the mount does not serve again within `recover_timeout` (or rebound is gone), Chaos
    gives up: it records the problem and calls on_stuck(), with which a test can abort the
    FUSE connection so that a workload blocked on a hung driver fails now, not at the watchdog.
    """

    def __init__(self, mnt, *, seed, kinds=KINDS, min_interval=0.1, max_interval=2.0,
                 first_within=0.5, recover_timeout=RECOVER_TIMEOUT, on_stuck=None):
        self.mnt = mnt
        self.seed = seed
        self.kinds = tuple(kinds)
        self.min_interval, self.max_interval = min_interval, max_interval
        self.first_within = max(first_within, min_interval)
        self.recover_timeout = recover_timeout
        self.on_stuck = on_stuck
        self.injections = []  # (seconds from start, kind, pid, comm)
        self.problems = []    # what went wrong on the way (the mount not recovering, ...)
        self.final = None     # the status once stopped and serving again
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)
        self._start = None
        self._last = None  # (pid, restarts) of the last injection
        self._rebound_pid = None
        self._gave_up = False

    @property
    def injected(self):
        return len(self.injections)

    def start(self):
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _recovered(self):
        if self._last is None:
            return serving
        return recovered_from(*self._last)

    def _wait_recovered(self, when):
        """The status once the mount serves again (after the last injection, if any); None,
        the problem recorded and on_stuck() called, if it does not within recover_timeout or
        rebound exits."""
        cond = self._recovered()
        deadline = time.monotonic() + self.recover_timeout
        while True:
            status = mount_status(self.mnt)
            if status is not None:
                self._rebound_pid = status.get("rebound_pid", self._rebound_pid)
            if self._rebound_pid is not None and not mounts.alive(self._rebound_pid):
                self._give_up(f"rebound (pid {self._rebound_pid}) exited {when}")
                return None
            if status is not None and cond(status):
                return status
            if time.monotonic() >= deadline:
                self._give_up(f"not serving within {self.recover_timeout:.0f} s {when}")
                return None
            time.sleep(0.05)

    def _give_up(self, text):
        self._gave_up = True
        self._problem(text)
        if self.on_stuck is not None:
            self.on_stuck()

    def _run(self):
        try:
            self._inject_until_stopped()
        except Exception as e:  # noqa: BLE001 - reported, and the test fails on it
            self._problem(f"the chaos thread failed: {e!r}")

    def _inject_until_stopped(self):
        delay = self._rng.uniform(self.min_interval, self.first_within)
        while not self._stop.wait(delay):
            status = self._wait_recovered("before the next injection")
            if status is None:
                return
            if self._stop.is_set():
                return
            kind = self._rng.choice(self.kinds)
            pid = status["driver_pid"]
            name = mounts.comm(pid)
            sig = signal.SIGSTOP if kind == "hang" else signal.Signals[kind]
            if signal_descendant(pid, status["rebound_pid"], sig):
                self.injections.append((round(time.monotonic() - self._start, 2), kind, pid,
                                        name))
                self._last = (pid, status.get("restarts", 0))
            # else: that driver is already gone (e.g. restarting); try again after a pause.
            delay = self._rng.uniform(self.min_interval, self.max_interval)

    def _problem(self, text):
        last = self.injections[-1] if self.injections else None
        self.problems.append(f"{text} (last injection: {last}; status: {self._safe_status()})")

    def _safe_status(self):
        try:
            return mount_status(self.mnt)
        except (subprocess.SubprocessError, OSError, ValueError) as e:
            return f"<rebound status failed: {e}>"

    def stop(self):
        """Stops injecting, waits for the mount to serve again (bounded) and returns the
        number of injected failures."""
        self._stop.set()
        self._thread.join(timeout=self.recover_timeout + mounts.STATUS_TIMEOUT + 5)
        if self._thread.is_alive():
            self._problem("the chaos thread did not stop")
        if self.final is None and not self._gave_up:
            probe = self._touch_if_hung()
            self.final = self._wait_recovered("after the last injection")
            if probe is not None:
                probe.join(timeout=mounts.STATUS_TIMEOUT)
        return self.injected

    def _touch_if_hung(self):
        """When the last injection stopped the driver as the workload ended, no request may
        be waiting on it, and a deadline only fires on a waiting request: an idle, stopped
        driver is found out by the next application that uses the mount. Plays that
        application: looks up a name that does not exist (never cached), in a thread, since
        it waits for the deadline. Returns the thread, or None when the last injection was
        not a hang."""
        if not self.injections or self.injections[-1][1] != "hang":
            return None

        def look_up():
            try:
                os.stat(os.path.join(self.mnt, f".chaos-probe-{os.getpid()}-{self.injected}"))
            except FileNotFoundError:
                pass
            except OSError as e:
                self._problem(f"the look-up after the last hang failed: {e!r}")

        probe = threading.Thread(target=look_up, name="chaos-probe", daemon=True)
        probe.start()
        return probe

    def describe(self):
        kinds = collections.Counter(kind for _, kind, _, _ in self.injections)
        return (f"chaos seed={self.seed}: {self.injected} failures injected {dict(kinds)}: "
                f"{self.injections}; final status: {self.final}; problems: {self.problems}")
