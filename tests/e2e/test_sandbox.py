"""Least authority and resource limits: the driver can only break itself.

Owns: the proof that each driver runs its workload under the default sandbox with its filter,
no_new_privs, no capabilities and its own mount namespace and cgroup; that a hostile driver is
denied every forbidden thing it tries, with the host unaffected; that each kind of hoarding
(memory, tasks, descriptors, CPU while idle, a request held) is detected, logged with its cause
and answered by a restart the workload does not notice; that the strict profile shows the
driver only what it needs; and that bad configuration is refused with one line naming the key.
"""

import dataclasses
import errno
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import types
from pathlib import Path

import pytest

import mounts
import workloads
from test_isolation import Running

pytestmark = pytest.mark.usefixtures("many_open_files")

def hostile():
    """The hostile driver script, as the session runs it (mounts.install_programs)."""
    return mounts.fixture_script("hostile_driver.py")
DRIVERS = ["fuse2fs", "passthrough_ll", "sshfs", "gofuse"]


def status_of(mnt):
    found = mounts.mount_status(mnt)
    assert found is not None, f"no rebound run serves {mnt}"
    return found


def proc_status(pid):
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


# What a driver given a directory to serve keeps by default: CAP_CHOWN, CAP_DAC_OVERRIDE,
# CAP_DAC_READ_SEARCH, CAP_FOWNER, CAP_FSETID, CAP_SETGID, CAP_SETUID, CAP_LINUX_IMMUTABLE,
# CAP_MKNOD, CAP_SETFCAP.
FILE_CAPABILITIES = 0xdf | 1 << 9 | 1 << 27 | 1 << 31


def derived_capabilities(driver):
    """The capabilities rebound derives for driver from its command line."""
    serves_a_directory = mounts.DRIVERS[driver][1] in ("dir", "cipher", "own") \
        and driver != "sshfs"
    return FILE_CAPABILITIES if serves_a_directory else 0


def assert_confined(pid, status_text=None, capabilities=0):
    """The process runs under rebound's filter with no_new_privs, only the capabilities
    given, in a mount namespace of its own and in a rebound cgroup."""
    fields = proc_status(pid) if status_text is None else dict(
        (k, v.strip()) for k, _, v in (line.partition(":") for line in status_text.splitlines()))
    assert fields["Seccomp"] == "2", fields  # SECCOMP_MODE_FILTER
    assert fields["NoNewPrivs"] == "1", fields
    for caps in ("CapPrm", "CapEff", "CapBnd"):
        assert int(fields[caps], 16) == capabilities, (caps, fields[caps])
    for caps in ("CapInh", "CapAmb"):
        assert int(fields[caps], 16) & ~capabilities == 0, (caps, fields[caps])
    if status_text is None:
        assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
        cgroups = Path(f"/proc/{pid}/cgroup").read_text()
        assert "/rebound/" in cgroups, cgroups


@pytest.mark.parametrize("driver", DRIVERS)
def test_default_profile_driver_works_confined(mount, driver, sshd, tree_tarball):
    with mount(driver, "rebound", sshd=sshd if driver == "sshfs" else None,
               image_size=256 * mounts.MiB) as m:
        pid = status_of(m.mnt)["driver_pid"]
        assert_confined(pid, capabilities=derived_capabilities(driver))
        scale = workloads.scale()
        short = dataclasses.replace(scale, model_seconds=min(scale.model_seconds, 3.0))
        result = workloads.run("model", m.mnt, scale_=short, tarball=tree_tarball)
        assert result.ok, result.summary()
        # The driver's own view: it cannot write where it was given no right to. (A daemonizing
        # driver's serving process is known once it serves.)
        pid = status_of(m.mnt)["driver_pid"]
        assert_confined(pid, capabilities=derived_capabilities(driver))
        root = Path(f"/proc/{pid}/root")
        probe = subprocess.run(["nsenter", "-t", str(pid), "-m", "sh", "-c",
                                "touch /etc/rebound-sandbox-probe"], capture_output=True,
                               text=True, timeout=10)
        assert probe.returncode != 0 and "Read-only" in probe.stderr, probe
        assert (root / "etc/shadow").read_bytes() == b"", "the host's secrets are hidden"


def wait_for_file(path, timeout=20.0):
    assert mounts.wait_for(path.exists, timeout), f"{path} never appeared"


@pytest.fixture
def victim():
    """A process the hostile driver must not be able to touch."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def host_things(workdir):
    """What the host has that a default-profile driver must not touch although the host's
    tree is visible to it: a file outside /tmp (/tmp is the driver's own), a disk (a loop
    device over a scratch file) and a listening socket in /run."""
    outside_dir = Path(tempfile.mkdtemp(prefix="rebound-hostile-", dir="/var/tmp"))
    outside = outside_dir / "outside.txt"
    outside.write_text("untouched\n")
    backing = workdir / "disk.img"
    backing.write_bytes(b"\0" * (1 << 20))
    disk = subprocess.run(["losetup", "--find", "--show", str(backing)], capture_output=True,
                          text=True, check=True).stdout.strip()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock_path = f"/run/rebound-hostile-{os.getpid()}.sock"
    listener.bind(sock_path)
    listener.listen(1)
    listener.setblocking(False)
    try:
        yield types.SimpleNamespace(outside=outside, disk=disk, listener=listener,
                                    sock_path=sock_path)
    finally:
        listener.close()
        os.unlink(sock_path)
        subprocess.run(["losetup", "-d", disk], check=False)
        outside.unlink()
        outside_dir.rmdir()


def test_forbidden_things_are_denied_and_the_host_is_unaffected(workdir, victim, host_things):
    state = workdir / "state"
    state.mkdir()
    host = host_things
    hostname = socket.gethostname()
    nice_before = os.getpriority(os.PRIO_PROCESS, victim.pid)
    env = dict(os.environ, HOSTILE_VICTIM=str(victim.pid), HOSTILE_OUTSIDE=str(host.outside),
               HOSTILE_DISK=host.disk, HOSTILE_SOCKET=host.sock_path)
    r = Running(workdir, [sys.executable, str(hostile()), "forbidden", str(state),
                          str(workdir / "mnt")], env=env)
    try:
        r.wait_mounted()
        wait_for_file(state / "report.json")
        report = json.loads((state / "report.json").read_text())
        allowed = {"write_own_state", "kill_own_child"}
        hidden = {"write_disk", "connect_host_socket"}  # not there at all in its view
        for what, err in report.items():
            if what in allowed:
                assert err == 0, (what, errno.errorcode.get(err, err))
            elif what in hidden:
                assert err == errno.ENOENT, (what, errno.errorcode.get(err, err), report)
            else:
                assert err in (errno.EPERM, errno.EACCES, errno.EROFS), \
                    (what, errno.errorcode.get(err, err), report)
        assert report["reboot"] == errno.EPERM and report["ptrace"] == errno.EPERM
        assert report["write_outside"] == errno.EROFS
        with open(host.disk, "rb") as disk:
            assert disk.read(1 << 20) == b"\0" * (1 << 20), "the disk was written"
        with pytest.raises(BlockingIOError):
            host.listener.accept()
        # (It is given its state directory: a directory to serve, as far as rebound knows.)
        assert_confined(None, (state / "status").read_text(), FILE_CAPABILITIES)
        # The host: the victim is untraced and alive, nothing was written, nothing mounted.
        assert victim.poll() is None
        assert proc_status(victim.pid)["TracerPid"] == "0"
        assert os.getpriority(os.PRIO_PROCESS, victim.pid) == nice_before
        limits = Path(f"/proc/{victim.pid}/limits").read_text()
        assert "Max open files            64 " not in limits, limits
        assert "is not one of its processes" in r.stderr()
        # Each denial is explained once, with the key that would allow it.
        assert r.stderr().count('`[sandbox] allow_syscalls = ["ptrace"]` allows it') == 1
        assert host.outside.read_text() == "untouched\n"
        assert not Path("/etc/rebound-hostile-test").exists()
        assert socket.gethostname() == hostname
        assert (state / "own").exists()
        # The mount goes on serving, and the driver was not restarted for trying.
        assert (r.mnt / "good").read_bytes() == b"good data\n"
        assert status_of(r.mnt)["restarts"] == 0
        assert "refused: a sandboxed driver mounts only its FUSE file system" in r.stderr()
        assert "hostile_driver: serving" in r.stderr(), "driver stderr is logged"
        # Lines from before the mount is known carry the driver's name; this one, written
        # while serving a request, is logged asynchronously.
        assert mounts.wait_for(
            lambda: f"{r.mnt}: hostile_driver: looked up good" in r.stderr(), 5), \
            "driver stderr is prefixed with the mount point"
    finally:
        r.cleanup()


HOARDING = {
    # kind: (config, what the cause says)
    "memory": ("[limits]\nmemory_mb = 128\n", "memory hoarding"),
    "tasks": ("[limits]\ntasks = 16\n", "task hoarding"),
    "fds": ("[limits]\nopen_files = 256\n", "descriptor leak"),
    "spin": ("[limits]\ncpu_percent = 50\nidle_cpu_percent = 20\nidle_cpu_window_ms = 1000\n",
             "CPU hoarding"),
    "hold": ("request_timeout_ms = 1500\n", "hang: a request unanswered"),
}


# In both data paths (beside it, a request held while others are answered is timed by the
# observer, from the kernel's `fuse_request_send` to its `fuse_request_end`).
@pytest.mark.parametrize("hoard,data_path",
                         [(h, p) for h in sorted(HOARDING) for p in ("guarded", "fast")])
def test_hoarding_is_answered_by_a_restart(workdir, victim, hoard, data_path):
    config, cause = HOARDING[hoard]
    state = workdir / "state"
    state.mkdir()
    r = Running(workdir, [sys.executable, str(hostile()), hoard, str(state), str(workdir / "mnt")],
                config=f'mode = "{data_path}"\nrestart_backoff_ms = 0\n' + config)
    errors = []
    reads = [0]
    stop = threading.Event()

    def workload():
        # Reads go on all along; spinning is only noticed while nothing is asked.
        while not stop.is_set():
            try:
                if hoard == "hold":
                    os.stat(r.mnt / "held")
                data = (r.mnt / "good").read_bytes()
                if data != b"good data\n":
                    errors.append(f"read {data!r}")
                reads[0] += 1
            except OSError as e:
                errors.append(repr(e))
            stop.wait(2.0 if hoard == "spin" else 0.05)

    try:
        r.wait_mounted()
        reader = threading.Thread(target=workload, daemon=True)
        reader.start()

        def restarted():
            s = status_of(r.mnt)
            return s["restarts"] >= 1 and s["state"] == "serving"

        assert mounts.wait_for(restarted, 60.0), f"no restart:\n{r.stderr()}"
        s = status_of(r.mnt)
        assert cause in (s["last_failure"] or ""), (s, r.stderr()[-3000:])
        assert cause in r.stderr()
        # The restarted driver behaves and serves; the workload saw no error.
        time.sleep(0.5)
        before = reads[0]
        assert mounts.wait_for(lambda: reads[0] > before, 10.0), "the workload stalled"
        stop.set()
        reader.join(timeout=30)
        assert not errors, errors[:5]
        assert (r.mnt / "good").read_bytes() == b"good data\n"
        # Outside the driver's cgroup nothing was touched.
        assert victim.poll() is None
        assert r.proc.poll() is None, "rebound itself must live on"
        pid = s["driver_pid"]
        assert "/rebound/" in Path(f"/proc/{pid}/cgroup").read_text()
        assert_confined(pid, capabilities=FILE_CAPABILITIES)
    finally:
        stop.set()
        r.cleanup()


def test_strict_profile_shows_only_what_the_driver_needs(workdir):
    src = workdir / "src"
    src.mkdir()
    (src / "hello").write_text("hello\n")
    secret = Path("/root/rebound-strict-secret")
    r = Running(workdir, [str(mounts.fixture_bin("passthrough_ll")), "-o", f"source={src}",
                          "-f", str(workdir / "mnt")],
                config='[sandbox]\nprofile = "strict"\n')
    try:
        r.wait_mounted()
        assert (r.mnt / "hello").read_text() == "hello\n"
        (r.mnt / "new").write_text("written\n")
        assert (src / "new").read_text() == "written\n"
        pid = status_of(r.mnt)["driver_pid"]
        assert_confined(pid, capabilities=FILE_CAPABILITIES)
        seen = set(os.listdir(f"/proc/{pid}/root"))
        assert "root" not in seen and "home" not in seen and "var" not in seen, seen
        assert {"usr", "etc", "dev", "tmp", "proc"} <= seen, seen
        assert not (Path(f"/proc/{pid}/root") / secret.relative_to("/")).exists()
        assert (Path(f"/proc/{pid}/root") / "etc/shadow").read_bytes() == b""
        assert set(os.listdir(f"/proc/{pid}/root/dev")) >= {"null", "fuse", "urandom"}
        # No network: a namespace of its own.
        assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
        # A restart keeps the sandbox.
        out = subprocess.run([str(mounts.rebound_bin()), "restart", str(r.mnt)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out
        assert (r.mnt / "hello").read_text() == "hello\n"
        assert_confined(status_of(r.mnt)["driver_pid"], capabilities=FILE_CAPABILITIES)
    finally:
        r.cleanup()


def test_learning_mode_writes_what_the_driver_used(workdir):
    """`rebound run --learn FILE`: a driver serving a directory for another user (root sets
    an owner and writes a 0600 file of someone else) gets FILE with the capabilities it used
    and the denied calls it made; FILE as the config of the next run gives it exactly those,
    and the same operations work."""
    src = workdir / "src"
    src.mkdir()
    learned = workdir / "learned.toml"
    argv = [str(mounts.fixture_bin("passthrough_ll")), "-o", f"source={src}", "-f",
            str(workdir / "mnt")]

    def act_for_another_user(mnt, name):
        path = mnt / name
        path.write_text("x")
        os.chown(path, 65533, 65533)
        os.chmod(path, 0o600)
        with open(path, "a") as f:
            f.write("y")
        assert path.read_text() == "xy" and path.stat().st_uid == 65533

    r = Running(workdir, argv, options=["--learn", str(learned)])
    try:
        try:
            r.wait_mounted()
        except (AssertionError, RuntimeError):
            if "capability tracepoint" in r.stderr():
                pytest.skip("no capability:cap_capable tracepoint (Linux 6.14+)")
            raise
        act_for_another_user(r.mnt, "first")
        used = {"CAP_CHOWN", "CAP_DAC_OVERRIDE"}
        assert mounts.wait_for(lambda: all(c in learned.read_text() for c in used), 10), \
            learned.read_text()
    finally:
        r.cleanup()
    text = learned.read_text()
    assert "allow_syscalls = []" in text, text
    r = Running(workdir, argv, config=text)
    try:
        r.wait_mounted()
        act_for_another_user(r.mnt, "second")
        kept = int(proc_status(status_of(r.mnt)["driver_pid"])["CapEff"], 16)
        assert kept & 0b1 and kept & 0b10, hex(kept)  # CAP_CHOWN, CAP_DAC_OVERRIDE
        # Exactly as many as the file lists (passthrough_ll has no built-in profile).
        listed = tomllib.loads(text)["sandbox"]["capabilities"]
        assert bin(kept).count("1") == len(listed), (hex(kept), listed)
    finally:
        r.cleanup()


def test_a_capability_the_sandbox_keeps_from_the_driver_is_named_with_its_key(workdir):
    """With `capabilities = []`, passthrough_ll cannot set a file's owner for root (EPERM, where
    the direct mount can); the log says which capability the kernel refused it and which key
    gives it."""
    src = workdir / "src"
    src.mkdir()
    r = Running(workdir, [str(mounts.fixture_bin("passthrough_ll")), "-o", f"source={src}",
                          "-f", str(workdir / "mnt")],
                config="[sandbox]\ncapabilities = []\n")
    try:
        r.wait_mounted()
        (r.mnt / "f").write_text("x")
        with pytest.raises(PermissionError):
            os.chown(r.mnt / "f", 65533, 65533)
        if not Path("/sys/kernel/tracing/events/capability").exists():
            pytest.skip("no capability:cap_capable tracepoint (Linux 6.14+)")
        key = '`[sandbox] capabilities` with "CAP_CHOWN" gives it'
        assert mounts.wait_for(lambda: key in r.stderr(), 10), r.stderr()
    finally:
        r.cleanup()


def test_a_capability_rebound_lacks_itself_is_left_out_with_a_warning(workdir):
    """A listed capability that rebound does not have (a container's root often lacks
    CAP_SYS_RESOURCE or CAP_LINUX_IMMUTABLE; here rebound runs with CAP_SYS_TIME out of its
    bounding set) cannot be passed on: the driver starts without it, where capset(2) used to
    fail the start with EPERM, and the log names it."""
    src = workdir / "src"
    src.mkdir()
    r = Running(workdir, [str(mounts.fixture_bin("passthrough_ll")), "-o", f"source={src}",
                          "-f", str(workdir / "mnt")],
                config='[sandbox]\ncapabilities = ["CAP_CHOWN", "CAP_SYS_TIME"]\n',
                prefix=("setpriv", "--bounding-set", "-sys_time", "--"))
    try:
        r.wait_mounted()
        kept = int(proc_status(status_of(r.mnt)["driver_pid"])["CapEff"], 16)
        assert kept == 1 << 0, hex(kept)  # CAP_CHOWN only
        assert "does not have CAP_SYS_TIME itself" in r.stderr(), r.stderr()
    finally:
        r.cleanup()


@pytest.mark.parametrize("text, key", [
    ("[sandbox]\nprofil = \"strict\"\n", "profil"),
    ("[sandbox]\nprofile = \"lax\"\n", "sandbox.profile"),
    ("[limits]\nmemory_mb = \"lots\"\n", "limits.memory_mb"),
    ("[limits]\ntasks = 2\n", "limits.tasks"),
    ("[limits]\nidle_cpu_percent = 300\n", "limits.idle_cpu_percent"),
    ("[sandbox]\ncapabilities = [\"CAP_FLY\"]\n", "sandbox.capabilities"),
    ("[sandbox]\nallow_syscalls = [\"read\"]\n", "sandbox.allow_syscalls"),
    ("[sandbox]\nwritable_paths = [\"relative\"]\n", "sandbox.writable_paths"),
])
def test_bad_sandbox_config_is_refused_with_one_line(workdir, text, key):
    cfg = workdir / "rebound.toml"
    cfg.write_text(text)
    code, out, err, _ = mounts.run_rebound(["run", "--config", str(cfg), "--", "true"],
                                           timeout=20)
    assert code == 2, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], lines
