"""The shipped unit, contrib/systemd/rebound@.service, under a real systemd.

systemd runs as PID 1 of namespaces of its own (pid, mount, network, uts, ipc), booted into a
target that wants only the unit under test: the host's /etc/systemd/system, /run, /tmp and
/usr/local/bin are hidden behind tmpfs in its mount namespace (its boot-time clean-up of /tmp
must not reach the host's), /sys is read-only there (no udev), and the rebound under test is
installed as /usr/local/bin/rebound, as `make install` puts it. Every command runs in those
namespaces through nsenter.

Owns the proof that: the unit becomes active only once rebound says READY (the mount serves),
its status line and the journal's fields per mount come through, a killed driver is recovered
without the unit noticing, `systemctl reload` replaces rebound with its mount kept, a rebound
whose loop stops is found by the watchdog and restarted on a clean mount point, and
`systemctl stop` unmounts.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

import mounts

pytestmark = [pytest.mark.rebound]

SYSTEMD = Path("/lib/systemd/systemd")
# The unit's own watchdog interval, shortened for the test by a drop-in.
WATCHDOG_S = 2
# Where the mount lives: under /var/tmp, not /tmp (hidden in the container).
WORK = Path("/var/tmp/rebound-e2e-systemd")

BOOT = """
set -e
mount -t proc proc /proc
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
mount --bind /sys /sys && mount -o remount,bind,ro /sys
mount -t tmpfs tmpfs /etc/systemd/system
mkdir -p /etc/rebound && mount -t tmpfs tmpfs /etc/rebound
mount -t tmpfs tmpfs /usr/local/bin
cp "$REBOUND" /usr/local/bin/rebound
cp "$UNIT" /etc/systemd/system/
mkdir /etc/systemd/system/rebound@.service.d
printf '[Service]\\nWatchdogSec=%s\\n' "$WATCHDOG" > /etc/systemd/system/rebound@.service.d/test.conf
mkdir -p "$(dirname "/etc/rebound/$CONF")"
printf 'DRIVER="%s"\\n' "$DRIVER" > "/etc/rebound/$CONF.env"
printf 'restart_backoff_ms = 0\\n' > "/etc/rebound/$CONF.toml"
printf '[Unit]\\nWants=rebound@%s.service\\n' "$INSTANCE" > /etc/systemd/system/rebound-test.target
export container=rebound-test
exec "$SYSTEMD" --system --unit=rebound-test.target
"""


class Container:
    def __init__(self, rebound, driver, mnt):
        self.mnt = mnt
        self.instance = subprocess.run(["systemd-escape", "-p", str(mnt)], check=True,
                                       capture_output=True, text=True).stdout.strip()
        self.unit = f"rebound@{self.instance}.service"
        env = dict(os.environ, REBOUND=str(rebound), SYSTEMD=str(SYSTEMD),
                   UNIT=str(rebound.parent / "rebound@.service"),
                   DRIVER=" ".join(driver), INSTANCE=self.instance, WATCHDOG=str(WATCHDOG_S),
                   CONF=str(mnt).lstrip("/"))
        self.log = open(WORK / "container.log", "wb")
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount", "--propagation", "private", "--uts",
             "--net", "--ipc", "sh", "-c", BOOT], env=env, stdin=subprocess.DEVNULL,
            stdout=self.log, stderr=self.log, start_new_session=True)
        self.pid1 = mounts.wait_for(lambda: next(iter(mounts.children(self.proc.pid)), None),
                                    10)
        assert self.pid1, (WORK / "container.log").read_text()

    def run(self, *argv, check=True):
        # (As a unit's processes would: with the container's environment, not the test's.)
        done = subprocess.run(["nsenter", "-t", str(self.pid1), "-m", "-p", "env", "-i",
                               "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                               *argv],
                              capture_output=True, text=True, timeout=60)
        if check:
            assert done.returncode == 0, f"{argv}: {done.stdout}{done.stderr}"
        return done.stdout

    def show(self, prop):
        """A property of the unit ("" while systemd does not answer yet)."""
        return self.run("systemctl", "show", "-p", prop, "--value", self.unit,
                        check=False).strip()

    def wait(self, cond, timeout, what):
        assert mounts.wait_for(cond, timeout, interval=0.2), \
            f"{what}:\n{self.run('journalctl', '--no-pager', '-n', '40', check=False)}"

    def read(self, rel):
        return self.run("cat", str(self.mnt / rel), check=False)

    def stop(self):
        # The namespace's PID 1 (systemd, in a session of its own): with it, all of the
        # namespace goes. Then unshare and its shell.
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid1, signal.SIGKILL)
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()


@pytest.fixture
def container():
    if not SYSTEMD.exists():
        pytest.fail(f"{SYSTEMD} is missing: scripts/deps.sh installs systemd")
    shutil.rmtree(WORK, ignore_errors=True)
    (WORK / "src").mkdir(parents=True)
    (WORK / "mnt").mkdir()
    (WORK / "src" / "greeting").write_text("hello")
    # The programs and the unit from outside /tmp, which the container hides.
    (WORK / "bin").mkdir()
    for program in (mounts.rebound_bin(), mounts.fixture_bin("passthrough_ll"),
                    mounts.REPO / "contrib/systemd/rebound@.service"):
        shutil.copy2(program, WORK / "bin")
    driver = [str(WORK / "bin" / "passthrough_ll"), "-o", f"source={WORK / 'src'}",
              str(WORK / "mnt")]
    c = Container(WORK / "bin" / "rebound", driver, WORK / "mnt")
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(WORK, ignore_errors=True)


def test_the_unit_under_systemd(container):
    c = container
    c.wait(lambda: c.show("ActiveState") == "active", 60, "the unit never became active")
    # Active means READY came: the mount serves at once.
    assert c.read("greeting") == "hello"
    assert c.show("StatusText") == f"serving {c.mnt} (0 restarts)"
    journal = c.run("journalctl", "-u", c.unit, "-o", "verbose", "--no-pager")
    assert f"REBOUND_MOUNTPOINT={c.mnt}" in journal, journal[-2000:]
    assert "REBOUND_DRIVER=" in journal

    # A killed driver: recovered by rebound, unseen by systemd.
    [status] = json.loads(c.run("/usr/local/bin/rebound", "status", "--json"))
    c.run("kill", "-9", str(status["driver_pid"]))
    c.wait(lambda: "1 restarts" in c.show("StatusText"), 30, "no recovery in the status line")
    assert c.read("greeting") == "hello"
    assert (c.show("ActiveState"), c.show("NRestarts")) == ("active", "0")

    # `systemctl reload`: rebound hands the mount over to its successor, same main pid.
    main = c.show("MainPID")
    c.run("systemctl", "reload", c.unit)
    [status] = json.loads(c.run("/usr/local/bin/rebound", "status", "--json"))
    assert status["reloads"] == 1 and status["state"] == "serving", status
    assert (c.show("MainPID"), c.show("ActiveState")) == (main, "active")
    assert c.read("greeting") == "hello"

    # A rebound whose loop stops: the watchdog finds it, and systemd starts another, which
    # mounts on a clean mount point (the unit's ExecStartPre unmounts the dead mount).
    c.run("kill", "-STOP", main)
    c.wait(lambda: c.show("NRestarts") == "1" and c.show("ActiveState") == "active"
           and c.show("MainPID") != main, 10 * WATCHDOG_S, "the watchdog did not fire")
    assert "Failed with result 'watchdog'" in c.run("journalctl", "-u", c.unit, "--no-pager")
    assert c.read("greeting") == "hello"
    mountinfo = c.run("cat", "/proc/self/mountinfo")
    assert sum(f" {c.mnt} " in line for line in mountinfo.splitlines()) == 1, mountinfo

    c.run("systemctl", "stop", c.unit)
    assert f" {c.mnt} " not in c.run("cat", "/proc/self/mountinfo")
    assert c.show("ActiveState") == "inactive"
