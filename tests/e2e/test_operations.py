"""Operating rebound as infrastructure: a driver replaced with its mount kept.

Owns the proof of:
  - `rebound upgrade MOUNTPOINT -- NEW COMMAND LINE`: the old driver stops gracefully, the new
    one is brought to its state, files held open read and write on, and the status names the
    new program; an upgrade under a verifying workload (fuse2fs with its recommended config,
    sshfs) costs the application nothing;
  - the driver's executable held open from the run's start: a restart after the file was
    replaced (as a package upgrade does) runs the program the run started with;
    `rebound upgrade MOUNTPOINT` takes the new file; a new driver that fails before serving
    is undone, and the previous one serves again;
  - the Prometheus metrics (`[metrics]`): a scrape and the text file match `rebound status`;
  - `mount -t rebound.DRIVER` and an fstab line (`/sbin/mount.rebound`, a link to rebound):
    fuse2fs and sshfs mounted, served, recovered after a kill, unmounted with `umount`;
  - systemd's notification protocol: READY, the watchdog fed only while rebound's loop turns,
    STOPPING;
  - rebound's own death (SIGKILL) and reload under workloads: the keeper's successor serves
    on, and no application call fails, not even a large write the kernel was copying to
    rebound at the kill.
"""

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

import chaos
import mounts
import workloads
from chaos import serving, wait_status
from mounts import free_port, mount_status
from test_isolation import running  # noqa: F401 (the fixture)
from test_recovery import (DRIVER_CONFIG, explain, private_run_dir, seed,  # noqa: F401
                           stop_successor, toml, wait_serving)

pytestmark = [pytest.mark.rebound]


def upgrade(mnt, *argv):
    """`rebound upgrade MNT [-- ARGV]`: (returncode, stdout + stderr)."""
    args = ["upgrade", str(mnt)] + (["--", *map(str, argv)] if argv else [])
    rc, out, err, _ = mounts.run_rebound(args, timeout=180)
    return rc, out + err


def exe(pid):
    return os.readlink(f"/proc/{pid}/exe")


def install_copy(src, dst):
    """Puts a copy of src at dst the way a package manager does: a new file renamed over the
    old one (whose inode lives on in whatever holds it open)."""
    tmp = dst.with_name(dst.name + ".new")
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def while_checked(m, seed, times, act):
    """act(i) `times` times, spread over the model workload (one file rewritten at random
    and every byte read back checked against its model) on m: (act's answers, the
    workload's result)."""
    s = workloads.scale()
    outcome = {}
    worker = threading.Thread(target=lambda: outcome.update(
        result=workloads.model(m.mnt, seed, s.model_seconds, s.model_size)))
    worker.start()
    answers = []
    try:
        for i in range(times):
            mounts.wait_for(lambda: not worker.is_alive(), s.model_seconds / (times + 1))
            answers.append(act(i))
    finally:
        worker.join(s.model_seconds + 120)
    return answers, outcome["result"]


def passthrough(program, work):
    src = work / "src"
    src.mkdir(exist_ok=True)
    return lambda mnt: [str(program), "-o", f"source={src}", str(mnt)]


def test_an_upgrade_takes_a_new_command_line_and_keeps_open_files(running, workdir):
    bin_dir = workdir / "bin"
    bin_dir.mkdir()
    old, new = bin_dir / "passthrough-old", bin_dir / "passthrough-new"
    install_copy(mounts.fixture_bin("passthrough_ll"), old)
    install_copy(mounts.fixture_bin("passthrough_ll"), new)
    argv = passthrough(old, workdir)
    r = running(argv)
    before = wait_status(r.mnt, serving, chaos.RECOVER_TIMEOUT)
    assert before is not None, r.stderr()
    assert exe(before["driver_pid"]) == str(old)
    data = os.urandom(300_000)
    (r.mnt / "held").write_bytes(data)
    fd = os.open(r.mnt / "held", os.O_RDWR)
    cwd = os.open(r.mnt, os.O_RDONLY)
    try:
        rc, out = upgrade(r.mnt, new, *argv(r.mnt)[1:])
        assert rc == 0 and f"upgraded the driver of {r.mnt}" in out, f"{out}\n{r.stderr()}"
        after = mount_status(r.mnt)
        assert after["upgrades"] == 1 and after["restarts"] == 1, after
        assert after["failures_by_cause"] == {"upgrade": 1}, after
        assert after["driver"][0] == str(new), after
        assert exe(after["driver_pid"]) == str(new), after
        assert os.pread(fd, 4096, 100_000) == data[100_000:104_096]
        assert os.pwrite(fd, b"after the upgrade", 0) == 17
        assert os.listdir(cwd) == ["held"]
    finally:
        os.close(fd)
        os.close(cwd)
    assert workloads.read_uncached(r.mnt / "held") == b"after the upgrade" + data[17:]
    # A command line for another mount point is refused, and nothing changes.
    rc, out = upgrade(r.mnt, new, "-o", f"source={workdir / 'src'}", workdir / "elsewhere")
    assert rc == 1 and "does not name the mount point" in out, out
    assert mount_status(r.mnt)["restarts"] == 1


def test_a_restart_runs_the_program_it_started_with_until_an_upgrade(running, workdir):
    program = workdir / "bin" / "passthrough"
    program.parent.mkdir()
    install_copy(mounts.fixture_bin("passthrough_ll"), program)
    r = running(passthrough(program, workdir), config=toml(restart_backoff_ms=0))
    status = wait_status(r.mnt, serving, chaos.RECOVER_TIMEOUT)
    assert status is not None, r.stderr()
    (r.mnt / "f").write_bytes(b"kept")

    # A package upgrade leaves a program that cannot serve at the path: the restart after a
    # crash still runs the one the run started with.
    broken = workdir / "broken.sh"
    broken.write_text("#!/bin/sh\necho 'not a driver' >&2\nexit 3\n")
    broken.chmod(0o755)
    install_copy(broken, program)
    assert chaos.signal_descendant(status["driver_pid"], status["rebound_pid"], 9)
    status = wait_status(r.mnt, chaos.recovered_from(status["driver_pid"], 0),
                         chaos.RECOVER_TIMEOUT)
    assert status is not None, r.stderr()
    assert exe(status["driver_pid"]).endswith(" (deleted)"), status  # the replaced file's
    assert (r.mnt / "f").read_bytes() == b"kept"

    # `rebound upgrade` takes the file at the path: this one fails before it serves, so the
    # upgrade is undone and the previous program serves again.
    rc, out = upgrade(r.mnt)
    assert rc == 1 and "the previous driver serves again" in out and "failed before it served" \
        in out, f"{out}\n{r.stderr()}"
    status = wait_status(r.mnt, serving, chaos.RECOVER_TIMEOUT)
    assert status["upgrades"] == 0 and status["failures_by_cause"].get("during_restore"), status
    assert exe(status["driver_pid"]).endswith(" (deleted)"), status  # the replaced file's
    assert (r.mnt / "f").read_bytes() == b"kept"

    # A working program at the path: the upgrade takes it.
    install_copy(mounts.fixture_bin("passthrough_ll"), program)
    rc, out = upgrade(r.mnt)
    assert rc == 0, f"{out}\n{r.stderr()}"
    status = mount_status(r.mnt)
    assert status["upgrades"] == 1 and exe(status["driver_pid"]) == str(program), status
    assert (r.mnt / "f").read_bytes() == b"kept"


@pytest.mark.recovery
@pytest.mark.parametrize("driver", ["fuse2fs", "sshfs"])
def test_upgrades_under_a_verifying_workload_cost_no_error(mount, driver):
    """Three upgrades (the same command line, run anew) while a workload checks every byte
    of a file it rewrites at random against its model."""
    with mount(driver, "rebound", config=DRIVER_CONFIG[driver],
               reflink=driver == "fuse2fs") as m:
        wait_serving(m)
        answers, result = while_checked(m, 7, 3, lambda _: upgrade(m.mnt))
        for rc, out in answers:
            assert rc == 0, explain(m, out)
        assert result.ok, explain(m, result.summary())
        status = mount_status(m.mnt)
        assert status["upgrades"] == 3 and status["failures_by_cause"] == {"upgrade": 3}, status
        assert status["lost_objects"] == 0, status


# --- metrics ----------------------------------------------------------------------------------

def scrape(port):
    """GET /metrics: {(name, frozenset of labels): value} of every sample."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        assert answer.status == 200
        return parse_metrics(answer.read().decode())


def parse_metrics(text):
    assert text.endswith("# EOF\n"), text[-200:]
    samples = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        name, _, labels = series.partition("{")
        pairs = re.findall(r'(\w+)="([^"]*)"', labels)
        samples[(name, frozenset(pairs))] = float(value)
    return samples


def total(samples, name, **labels):
    """The sum of `name` over the series whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


@pytest.mark.parametrize("data_path", ["guarded", "fast"])
def test_a_scrape_of_the_metrics_matches_the_status(running, workdir, data_path):
    port = free_port()
    textfile = workdir / "rebound.prom"
    config = toml(restart_backoff_ms=0, mode=data_path) + \
        f'[metrics]\nlisten = "127.0.0.1:{port}"\ntextfile = "{textfile}"\n' \
        "textfile_interval_ms = 200\n"
    r = running(passthrough(mounts.fixture_bin("passthrough_ll"), workdir), config=config)
    status = wait_status(r.mnt, serving, chaos.RECOVER_TIMEOUT)
    assert status is not None, r.stderr()
    for i in range(1, 21):  # 20 files, each written once
        (r.mnt / f"f{i}").write_bytes(b"x" * i)
    held = open(r.mnt / "f3", "rb")
    try:
        assert chaos.signal_descendant(status["driver_pid"], status["rebound_pid"], 9)
        status = wait_status(r.mnt, chaos.recovered_from(status["driver_pid"], 0),
                             chaos.RECOVER_TIMEOUT)
        assert status is not None, r.stderr()
        assert held.read() == b"xxx"
        # The recovery's latency is measured at the first request the new driver serves.
        assert len(os.listdir(r.mnt)) == 20
        assert wait_status(r.mnt, lambda s: s["recovery_ms"], 10), r.stderr()
    finally:
        held.close()
    # Once the mount is quiet (the kernel's own requests after a close, a lookup the restored
    # driver is asked for, are done, and the driver's idle worker threads have exited), two
    # statuses around a scrape agree: it saw the same.
    keys = ("requests", "restarts", "nodes", "open_handles", "failures_by_cause",
            "driver_tasks", "driver_memory_bytes")

    def quiet_scrape():
        before, samples, after = mount_status(r.mnt), scrape(port), mount_status(r.mnt)
        same = all(before[k] == after[k] for k in keys)
        return (samples, after) if same else None

    scraped = mounts.wait_for(quiet_scrape, 10, interval=0.2)
    assert scraped is not None, "the mount never went quiet"
    samples, after = scraped
    mp = str(r.mnt)
    assert total(samples, "rebound_requests_total", mountpoint=mp) == after["requests"] > 20
    # Each WRITE (all made before the kill) was answered once, and timed (in fast mode, by
    # the observer, which counts without timing).
    timed = 20 if data_path == "guarded" else 0
    assert total(samples, "rebound_requests_total", opcode="write") == 20
    assert total(samples, "rebound_request_duration_seconds_count", opcode="write") == timed
    assert total(samples, "rebound_restarts_total", mountpoint=mp) == after["restarts"] == 1
    for cause, count in after["failures_by_cause"].items():
        assert total(samples, "rebound_driver_failures_total", cause=cause) == count, cause
    assert total(samples, "rebound_recovery_duration_seconds_count") == \
        len(after["recovery_ms"]) == 1
    assert abs(total(samples, "rebound_recovery_duration_seconds_sum") * 1000
               - after["recovery_ms"][0]) < 0.01
    assert total(samples, "rebound_nodes") == after["nodes"]
    assert total(samples, "rebound_open_handles") == after["open_handles"]
    assert total(samples, "rebound_serving") == 1
    assert total(samples, "rebound_driver_tasks") == after["driver_tasks"] > 0
    assert total(samples, "rebound_driver_memory_bytes") == after["driver_memory_bytes"] > 0
    # The text file says the same, within its interval.
    assert mounts.wait_for(lambda: textfile.exists() and total(
        parse_metrics(textfile.read_text()), "rebound_restarts_total") == 1, 10)


# --- mount(8) and fstab -----------------------------------------------------------------------

@pytest.fixture
def mount_helper():
    """/sbin/mount.rebound, a link to the rebound under test, for this test."""
    helper = Path("/sbin/mount.rebound")
    aside = helper.with_name("mount.rebound.before-test")
    installed = helper.is_symlink() or helper.exists()
    if installed:  # an installed rebound's: put back afterwards
        os.replace(helper, aside)
    helper.symlink_to(mounts.rebound_bin())
    try:
        yield helper
    finally:
        helper.unlink()
        if installed:
            os.replace(aside, helper)


def mounted_run(mnt):
    """The status of the rebound run serving mnt, once it serves."""
    status = wait_status(mnt, serving, chaos.RECOVER_TIMEOUT)
    assert status is not None, f"no rebound run serves {mnt}"
    return status


def unmount_and_wait(mnt, rebound_pid, log):
    subprocess.run(["umount", str(mnt)], check=True, timeout=60)
    if not mounts.wait_for(lambda: not mounts.alive(rebound_pid), mounts.STOP_TIMEOUT):
        tail = log.read_text(errors="replace")[-6000:] if log.exists() else "(no log)"
        pytest.fail(f"rebound run {rebound_pid} did not end after the unmount; its log:\n{tail}")


def test_an_fstab_line_mounts_fuse2fs_under_rebound(mount_helper, workdir):
    img, mnt, log = workdir / "disk.img", workdir / "mnt", workdir / "rebound.log"
    mnt.mkdir()
    mounts.make_image(img, 64 * mounts.MiB, ["mkfs.ext4", "-q", "-F"])
    config = workdir / "disk.toml"
    config.write_text(toml(redo_log=True, pre_restart=["e2fsck", "-fy", str(img)]))
    fstab = workdir / "fstab"
    fstab.write_text(f"# fuse2fs under rebound\n{img} {mnt} rebound.fuse2fs "
                     f"fakeroot,config={config},log={log},nofail 0 0\n")
    done = subprocess.run(["mount", "--fstab", str(fstab), str(mnt)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    status = mounted_run(mnt)
    try:
        driver = status["driver"]
        assert driver[:4] == ["fuse2fs", str(img), str(mnt), "-o"], status
        # Only the driver's own option reaches it (and rw, if mount(8) adds it).
        assert set(driver[4].split(",")) - {"rw"} == {"fakeroot"}, status
        (mnt / "kept").write_bytes(b"through fstab")
        assert chaos.signal_descendant(status["driver_pid"], status["rebound_pid"], 9)
        assert wait_status(mnt, chaos.recovered_from(status["driver_pid"], 0),
                           chaos.RECOVER_TIMEOUT), log.read_text()
        assert (mnt / "kept").read_bytes() == b"through fstab"
    finally:
        unmount_and_wait(mnt, status["rebound_pid"], log)
    assert "started driver `fuse2fs`" in log.read_text()
    ok, report = mounts.e2fsck(img)
    assert ok, report


def test_mount_t_rebound_mounts_sshfs_and_reports_a_bad_driver(mount_helper, workdir, sshd):
    src, mnt = workdir / "src", workdir / "mnt"
    src.mkdir()
    mnt.mkdir()
    (src / "remote").write_text("over ssh")
    options = (f"port={sshd.port},IdentityFile={sshd.client_key},StrictHostKeyChecking=no,"
               f"UserKnownHostsFile=/dev/null,BatchMode=yes,log={workdir / 'sshfs.log'}")
    done = subprocess.run(["mount", "-t", "rebound.sshfs", f"root@127.0.0.1:{src}", str(mnt),
                           "-o", options], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    status = mounted_run(mnt)
    try:
        assert (mnt / "remote").read_text() == "over ssh"
    finally:
        unmount_and_wait(mnt, status["rebound_pid"], workdir / "sshfs.log")
    # A driver that cannot mount (no server on its port): mount(8) fails, with its words.
    closed = options.replace(f"port={sshd.port}", f"port={free_port()}")
    done = subprocess.run(["mount", "-t", "rebound.sshfs", f"root@127.0.0.1:{src}", str(mnt),
                           "-o", closed], capture_output=True, text=True, timeout=120)
    assert done.returncode == 32 and "before the mount served" in done.stderr, done.stderr
    assert "Connection refused" in done.stderr or "connection" in done.stderr.lower(), \
        done.stderr
    assert not mounts.is_mounted(mnt)


# --- the service manager ----------------------------------------------------------------------

def test_rebound_tells_its_service_manager_ready_and_feeds_its_watchdog(workdir):
    """As systemd's Type=notify with WatchdogSec would see it: READY=1 once the mount serves,
    WATCHDOG=1 at half the interval while rebound's loop turns and none while it is stopped,
    STOPPING=1 at SIGTERM; the driver does not inherit the socket."""
    sock_path = workdir / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(0.2)
    env = dict(os.environ, NOTIFY_SOCKET=str(sock_path), WATCHDOG_USEC="400000")
    mnt = workdir / "mnt"
    mnt.mkdir()
    argv = passthrough(mounts.fixture_bin("passthrough_ll"), workdir)(mnt)
    # As systemd sets it: WATCHDOG_PID is rebound's own pid (the shell's, which execs it).
    proc = subprocess.Popen(["sh", "-c", 'WATCHDOG_PID=$$ exec "$0" "$@"',
                             str(mounts.rebound_bin()), "run", "--", *argv], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=open(workdir / "stderr", "wb"), start_new_session=True)
    messages = []

    def receive(seconds):
        deadline = time.monotonic() + seconds
        got = []
        while time.monotonic() < deadline:
            try:
                got.append(sock.recv(4096).decode().strip())
            except socket.timeout:
                pass
        messages.extend(got)
        return got

    try:
        ready = mounts.wait_for(lambda: any("READY=1" in m for m in receive(0.3)), 30)
        assert ready, f"no READY=1 in {messages}\n{(workdir / 'stderr').read_text()}"
        assert mounts.is_fuse_mounted(mnt) and os.listdir(mnt) == []
        status = mount_status(mnt)
        assert "NOTIFY_SOCKET" not in open(f"/proc/{status['driver_pid']}/environ").read()
        pings = [m for m in receive(1.5) if m == "WATCHDOG=1"]
        assert len(pings) >= 4, messages
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            stopped = receive(1.0)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert "WATCHDOG=1" not in stopped, stopped
        assert "WATCHDOG=1" in receive(1.0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=mounts.STOP_TIMEOUT) == 0, (workdir / "stderr").read_text()
        assert "STOPPING=1" in receive(0.5) + messages
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        mounts.umount(mnt)
        sock.close()


def journal_fields(datagram):
    """The fields of one entry in journald's native protocol: `NAME=value` lines, or `NAME`, a
    64-bit little-endian length and that many bytes."""
    fields, at = {}, 0
    while at < len(datagram):
        end = datagram.index(b"\n", at)
        line = datagram[at:end]
        if b"=" in line:
            name, _, value = line.partition(b"=")
            at = end + 1
        else:
            name, size = line, int.from_bytes(datagram[end + 1:end + 9], "little")
            value = datagram[end + 9:end + 9 + size]
            at = end + 9 + size + 1
        fields[name.decode()] = value.decode(errors="replace")
    return fields


def test_under_systemd_the_log_goes_to_the_journal_with_the_mount_s_fields(workdir):
    """With stderr the journal's stream (JOURNAL_STREAM names it, as systemd sets it), each
    entry goes to journald's socket with REBOUND_MOUNTPOINT and REBOUND_DRIVER. The journal is
    a socket of the test's own, bound over journald's path in a mount namespace of rebound's
    own (so the host's journald, if any, is not touched; the mount stays in that namespace)."""
    sockets = workdir / "journal"
    sockets.mkdir()
    journal = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    journal.bind(str(sockets / "socket"))
    journal.settimeout(0.2)
    read_end, write_end = os.pipe()
    st = os.fstat(write_end)
    env = dict(os.environ, JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")
    program = mounts.fixture_bin("passthrough_ll")
    mnt = workdir / "mnt"
    mnt.mkdir()
    argv = passthrough(program, workdir)(mnt)
    script = ('mount -t tmpfs tmpfs /run && mkdir -p /run/systemd/journal && '
              'mount --bind "$0" /run/systemd/journal && exec "$@"')
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                             script, str(sockets), str(mounts.rebound_bin()), "run", "--",
                             *argv], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=write_end,
                            start_new_session=True)
    os.close(write_end)
    entries = []
    try:
        def started():
            try:
                entries.append(journal.recv(65536))
            except socket.timeout:
                pass
            return any(b"started driver" in e for e in entries)
        assert mounts.wait_for(started, 30), (entries, os.read(read_end, 65536))
        entry = journal_fields(next(e for e in entries if b"started driver" in e))
        assert entry.get("REBOUND_MOUNTPOINT") == str(mnt), entry
        assert entry.get("REBOUND_DRIVER") == str(program), entry
        assert entry.get("SYSLOG_IDENTIFIER") == "rebound", entry
        assert entry.get("MESSAGE", "").startswith("started driver"), entry
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=mounts.STOP_TIMEOUT)
        journal.close()
        os.close(read_end)


# --- rebound itself replaced ------------------------------------------------------------------

@pytest.mark.recovery
@pytest.mark.parametrize("driver,data_path",
                         [(d, "guarded") for d in ("passthrough_ll", "fuse2fs", "sshfs")]
                         + [("passthrough_ll", "fast")])
def test_rebound_reloads_itself_under_a_verifying_workload(mount, driver, data_path, workdir):
    """`rebound reload` five times while a workload checks every byte against its model: the
    same process (pid) serves on, each time from the binary then installed (the file is
    replaced before the third), the mount never goes away, and the application sees no
    error. In fast mode the first reload stops a driver that serves the kernel's queue."""
    installed = workdir / "rebound"
    shutil.copy2(mounts.rebound_bin(), installed)
    config = f'mode = "{data_path}"\n' + DRIVER_CONFIG.get(driver, "")
    with mount(driver, "rebound", config=config,
               reflink=driver == "fuse2fs", rebound=installed) as m:
        first = wait_serving(m)

        def reload(i):
            if i == 2:
                install_copy(mounts.rebound_bin(), installed)
            rc, out, err, _ = mounts.run_rebound(["reload", str(m.mnt)], timeout=180)
            return rc, out + err, mounts.is_fuse_mounted(m.mnt)

        answers, result = while_checked(m, 11, 5, reload)
        for rc, out, mounted in answers:
            assert rc == 0 and "reloaded rebound" in out and mounted, explain(m, out)
        assert result.ok, explain(m, result.summary())
        status = mount_status(m.mnt)
        assert status["reloads"] == 5 and status["rebound_pid"] == first["rebound_pid"], status
        assert status["failures_by_cause"] == {"reload": 5}, status
        assert status["lost_objects"] == 0, status
        # Running the file installed now, not the one it started from.
        assert exe(status["rebound_pid"]) == str(installed), status


@pytest.mark.recovery
@pytest.mark.parametrize("driver,data_path",
                         [(d, "guarded") for d in ("passthrough_ll", "fuse2fs", "sshfs")]
                         + [("passthrough_ll", "fast")])
def test_rebound_survives_its_own_death_under_a_verifying_workload(mount, driver, data_path,
                                                                   workdir):
    """rebound itself SIGKILLed 12 times and reloaded 3 times, each reload onto a binary newly
    installed in its place, while a workload checks every byte against its model: after each
    death the keeper's successor takes the mount over, the mount never goes away, the
    application sees no error and no object is lost. In fast mode the first death finds the
    driver on the kernel's queue: the keeper takes its descriptors, and the successor what
    the pinned observer saw last."""
    installed = workdir / "rebound"
    shutil.copy2(mounts.rebound_bin(), installed)
    config = f'mode = "{data_path}"\n' + DRIVER_CONFIG.get(driver, "")
    with mount(driver, "rebound", config=config,
               reflink=driver == "fuse2fs", rebound=installed) as m:
        wait_serving(m)

        def kill_or_reload(i):
            before = mount_status(m.mnt)
            assert before is not None, explain(m, f"no status before action {i}")
            if i % 5 == 4:
                install_copy(mounts.rebound_bin(), installed)
                rc, out, err, _ = mounts.run_rebound(["reload", str(m.mnt)], timeout=180)
                done = rc == 0 and "reloaded rebound" in out + err
                moved_on = lambda s: s["reloads"] > before["reloads"]  # noqa: E731
            else:
                os.kill(before["rebound_pid"], signal.SIGKILL)
                done = True
                moved_on = lambda s: s["rebound_pid"] != before["rebound_pid"]  # noqa: E731
            after = wait_status(m.mnt, lambda s: serving(s) and moved_on(s),
                                chaos.RECOVER_TIMEOUT)
            return i, done, after is not None, mounts.is_fuse_mounted(m.mnt)

        answers, result = while_checked(m, 13, 15, kill_or_reload)
        for i, done, served_again, mounted in answers:
            assert done and served_again and mounted, explain(m, f"action {i}: {answers}")
        assert result.ok, explain(m, result.summary())
        status = mount_status(m.mnt)
        assert status["rebound_deaths"] == 12 and status["reloads"] == 3, status
        assert status["failures_by_cause"] == {"reload": 3}, status
        assert status["lost_objects"] == 0, status
        assert exe(status["rebound_pid"]) == str(installed), status
        # The fixture's rebound died at the first kill: the last successor is stopped as an
        # operator would stop it, and must unmount and exit.
        stop_successor(m, status["rebound_pid"])
        assert f"unmounted {m.mnt}" in m.output(), explain(m, "no unmount")


@pytest.mark.recovery
def test_rebound_killed_while_the_kernel_copies_large_writes_to_it_fails_none(mount):
    """rebound SIGKILLed 120 times under two writers of 1 MiB blocks (guarded): the kernel
    copies each WRITE into rebound's read buffer after taking it off its queue, and a copy
    that needs a page fault with a SIGKILL pending fails the request with EIO. rebound's read
    buffers are resident and left out of its forks: no write fails, and each block reads back
    as last written. (Before they were, 18 writes failed in these 120 kills.)"""
    kills, block, blocks = 120, 1 << 20, 8
    with mount("passthrough_ll", "rebound", config='mode = "guarded"\n') as m:
        wait_serving(m)
        stop = threading.Event()
        errors, last = [], {}

        def writer(w):
            path = m.mnt / f"blocks-{w}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            n = 0
            try:
                while not stop.is_set():
                    i, n = n, n + 1
                    tag = f"{w}:{i};".encode()
                    data = (tag * (block // len(tag) + 1))[:block]
                    try:
                        written = os.pwrite(fd, data, (i % blocks) * block)
                    except OSError as e:
                        errors.append(f"writer {w}, write {i}: {e}")
                        continue
                    if written != block:
                        errors.append(f"writer {w}, write {i}: {written} bytes written")
                    last[(w, i % blocks)] = data
            finally:
                os.close(fd)

        writers = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(2)]
        for t in writers:
            t.start()
        try:
            for k in range(kills):
                before = mount_status(m.mnt)
                assert before is not None, explain(m, f"no status before kill {k}")
                os.kill(before["rebound_pid"], signal.SIGKILL)
                after = wait_status(m.mnt, lambda s: serving(s) and
                                    s["rebound_pid"] != before["rebound_pid"],
                                    chaos.RECOVER_TIMEOUT)
                assert after is not None, explain(m, f"no successor after kill {k}")
        finally:
            stop.set()
            for t in writers:
                t.join(chaos.RECOVER_TIMEOUT)
        assert not any(t.is_alive() for t in writers), explain(m, "a writer is stuck")
        assert not errors, explain(m, f"{len(errors)} failed writes: {errors[:5]}")
        assert len(last) == 2 * blocks, sorted(last)
        for (w, b), data in sorted(last.items()):
            with open(m.mnt / f"blocks-{w}", "rb") as f:
                f.seek(b * block)
                assert f.read(block) == data, f"writer {w}, block {b}"
        status = mount_status(m.mnt)
        assert status["rebound_deaths"] == kills and status["lost_objects"] == 0, status
        stop_successor(m, status["rebound_pid"])


@pytest.mark.recovery
def test_rebound_killed_again_and_again_under_a_tree_workload_costs_no_error(mount, tree_tarball,
                                                                            seed):
    """rebound SIGKILLed every 50 ms, each successor as soon as it serves, while a tree is
    unpacked, checked and changed (creates, renames, unlinks, each in flight at some death):
    the application sees no error, and the tree reads back as the model says. In the default
    mode: the first death finds the driver on the kernel's queue, the later ones the proxy."""
    with mount("passthrough_ll", "rebound") as m:
        wait_serving(m)
        outcome = {}
        worker = threading.Thread(target=lambda: outcome.update(result=workloads.run(
            "tree", m.mnt, tarball=tree_tarball, seed=seed)), daemon=True)
        worker.start()
        kills = 0
        while not mounts.wait_for(lambda: not worker.is_alive(), 0.05):
            before = mount_status(m.mnt)
            assert before is not None, explain(m, f"no status after {kills} kills")
            os.kill(before["rebound_pid"], signal.SIGKILL)
            kills += 1
            after = wait_status(m.mnt, lambda s: serving(s) and
                                s["rebound_pid"] != before["rebound_pid"],
                                chaos.RECOVER_TIMEOUT)
            assert after is not None, explain(m, f"no successor after kill {kills}")
        worker.join()
        result = outcome["result"]
        assert result.ok, explain(m, result.summary())
        assert kills >= 20, f"only {kills} kills before the workload ended"
        status = mount_status(m.mnt)
        assert status["rebound_deaths"] == kills and status["lost_objects"] == 0, status
        stop_successor(m, status["rebound_pid"])


@pytest.mark.recovery
def test_in_fast_mode_rebound_s_death_is_survived_once_the_proxy_serves(mount):
    """In fast mode the first driver serves the kernel's queue; after its first failure the
    proxy does, and from then on rebound's own death is survived as in guarded mode: a file
    open across both deaths reads and writes on."""
    with mount("passthrough_ll", "rebound", config='mode = "fast"\n') as m:
        first = wait_serving(m)
        assert first["data_path"] == "fast", first
        path = m.mnt / "kept"
        with open(path, "w+b", buffering=0) as f:
            f.write(b"before;")
            assert chaos.signal_descendant(first["driver_pid"], first["rebound_pid"],
                                           signal.SIGKILL)
            guarded = wait_status(m.mnt, lambda s: serving(s) and s["data_path"] == "guarded"
                                  and s["driver_pid"] != first["driver_pid"],
                                  chaos.RECOVER_TIMEOUT)
            assert guarded is not None, explain(m, "no take-over")
            f.write(b"between;")
            os.kill(guarded["rebound_pid"], signal.SIGKILL)
            after = wait_status(m.mnt, lambda s: serving(s) and
                                s["rebound_pid"] != guarded["rebound_pid"],
                                chaos.RECOVER_TIMEOUT)
            assert after is not None and after["rebound_deaths"] == 1, explain(m, "no successor")
            f.write(b"after")
            f.seek(0)
            assert f.read() == b"before;between;after"
        assert path.read_bytes() == b"before;between;after"
        stop_successor(m, after["rebound_pid"])


def test_a_run_killed_with_its_keeper_leaves_no_observer_attached(mount):
    """In fast mode a run with a keeper pins its observer, for a successor to drain should
    rebound die. Killed together with its keeper, nothing ever will: the next run in fast mode
    removes those pins, and with them the programs that ran at every FUSE request of the
    host."""
    pins_root = Path("/sys/fs/bpf/rebound")
    with mount("passthrough_ll", "rebound", config='mode = "fast"\n') as first:
        status = wait_serving(first)
        pins = pins_root / str(status["rebound_pid"])
        marks = [p.name for p in pins.iterdir() if p.name.startswith("keeper-")] \
            if pins.is_dir() else []
        if not marks:
            pytest.skip(f"no observer pinned with its keeper in {pins} (no BPF file system?)")
        keeper = int(marks[0].removeprefix("keeper-"))
        assert b"keep" in Path(f"/proc/{keeper}/cmdline").read_bytes(), marks
        for pid in (keeper, status["rebound_pid"]):
            os.kill(pid, signal.SIGKILL)
            assert mounts.wait_for(lambda: not mounts.alive(pid), 10), pid
        assert pins.is_dir(), "the pins went before a run could find them stale"
        with mount("passthrough_ll", "rebound", config='mode = "fast"\n') as second:
            assert wait_serving(second)["data_path"] == "fast"
            assert not pins.exists(), explain(second, f"{pins} stayed")
        # The dead run's slot of the host's shared kfree program is freed by the second, so
        # the second's stop detaches the program.
        assert not (pins_root / "forgets-1").exists(), "the shared forget program stayed pinned"
        # The first driver serves on, alone: it goes as after any unmount, its standby with it.
        mounts.umount(first.mnt)
        mounts.kill_all(list(first.leftover_processes()))
        first.stopped, first.returncode = True, None


def attached_bpf_links():
    """The tracepoint of each BPF link of the host (whoever holds it: a process, or a pin)."""
    libc = ctypes.CDLL(None, use_errno=True)
    sys_bpf, link_get_fd_by_id, link_get_next_id = 321, 30, 31
    found, at = [], 0
    while True:
        attr = (ctypes.c_uint32 * 4)(at, 0, 0, 0)
        if libc.syscall(sys_bpf, link_get_next_id, attr, ctypes.sizeof(attr)) != 0:
            return found
        at = attr[1]
        fd = libc.syscall(sys_bpf, link_get_fd_by_id, (ctypes.c_uint32 * 4)(at, 0, 0, 0), 16)
        if fd < 0:  # gone since
            continue
        try:
            info = Path(f"/proc/self/fdinfo/{fd}").read_text()
            found += re.findall(r"^tp_name:\s*(\S+)", info, re.M)
        finally:
            os.close(fd)


def test_fast_mode_runs_share_one_kfree_program_and_each_sees_its_forgets(mount):
    """A driver's forgets are seen only at kfree, where a program runs at every kfree of the
    host: fast-mode runs share one (pinned in /sys/fs/bpf/rebound/forgets-1), each seeing the
    forgets of its own driver, and the last run to stop detaches it."""
    shared = Path("/sys/fs/bpf/rebound/forgets-1")
    fast = 'mode = "fast"\n'
    with mount("passthrough_ll", "rebound", config=fast) as a:
        assert wait_serving(a)["data_path"] == "fast"
        if not any(line.split()[1:3] == ["/sys/fs/bpf", "bpf"]
                   for line in Path("/proc/mounts").read_text().splitlines()):
            pytest.skip("no BPF file system on /sys/fs/bpf: nothing can be shared")
        assert (shared / "link").exists(), explain(a, f"no shared forget program in {shared}")
        one = attached_bpf_links().count("kfree")
        with mount("passthrough_ll", "rebound", config=fast) as b:
            assert wait_serving(b)["data_path"] == "fast"
            assert attached_bpf_links().count("kfree") == one, \
                explain(b, "a second run attached a kfree program of its own")
            for m in (a, b):
                for i in range(40):
                    (m.mnt / f"f{i}").write_text("x")
                assert mounts.wait_for(lambda: mount_status(m.mnt)["nodes"] >= 40, 5), \
                    explain(m, "the files' nodes are not tracked")
                # An unlinked file's inode is evicted at once, and its lookup forgotten.
                for i in range(40):
                    (m.mnt / f"f{i}").unlink()
                assert mounts.wait_for(lambda: mount_status(m.mnt)["nodes"] < 5, 5), \
                    explain(m, "the driver's forgets did not reach the tracker")
    assert not shared.exists(), "the last run to stop left the shared forget program pinned"
    assert attached_bpf_links().count("kfree") == one - 1, "the shared program stayed attached"
