"""pytest fixtures of the end-to-end suite.

Owns: the preconditions of a run (root, /dev/fuse, fusectl, built fixtures, the rebound
binary for rebound-mode tests), the session's copy of the fixture drivers under /tmp (every
driver runs from there, as from a checkout under /tmp), the session's private sshd, the `mount` factory every test mounts with,
the host's pipe limit put back at the end, the `direct` / `rebound` markers (from a test's `mode` parameter, so `-m direct` selects the
tests that need no rebound binary), the `recovery` marker, the tree workload's tarball (built
once per session), and a last check that the session left no mount behind.
"""

import os
import resource
import signal
from pathlib import Path

import pytest

import mounts
import workloads


def pytest_configure(config):
    # Started in the background by a shell without job control, the suite inherits SIGINT
    # ignored, and so would every driver it starts (libfuse leaves an ignored SIGINT alone):
    # the tests that stop a driver with SIGINT need the default.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.addinivalue_line(
        "markers", "recovery: drivers killed or hung under rebound, which must restart them "
                   "unnoticed (test_recovery.py; REBOUND_SOAK=1 for the long versions)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        mode = getattr(item, "callspec", None) and item.callspec.params.get("mode")
        if mode:
            item.add_marker(getattr(pytest.mark, mode))


@pytest.fixture(scope="session", autouse=True)
def preconditions():
    if os.geteuid() != 0:
        pytest.exit("the end-to-end suite mounts file systems: run it as root", returncode=1)
    if not os.path.exists("/dev/fuse"):
        pytest.exit("/dev/fuse is missing (modprobe fuse)", returncode=1)
    missing = [name for name in ("passthrough_ll", "passthrough_fh", "gofuse-loopback")
               if not mounts.fixture_bin(name).exists()]
    if missing:
        pytest.exit(f"fixture drivers not built ({', '.join(missing)}): run tests/setup.sh",
                    returncode=1)
    if not os.path.ismount(mounts.FUSECTL):
        pytest.exit(f"fusectl is not mounted on {mounts.FUSECTL}: run tests/setup.sh",
                    returncode=1)
    # What an interrupted earlier run left is removed first, so that it is not blamed on us.
    mounts.reap_stale_workdirs()
    programs = mounts.install_programs()
    # rebound raises the host's pipe limit in fast mode (raise_pipe_max_size); the session
    # leaves the host as it found it.
    pipe_max_size = Path("/proc/sys/fs/pipe-max-size").read_text()
    yield
    Path("/proc/sys/fs/pipe-max-size").write_text(pipe_max_size)
    mounts.remove_workdir(programs)
    # Nothing may outlive the session: no mount and no directory of ours under /tmp.
    left = mounts.workdirs(owner=os.getpid())
    for path in left:
        mounts.remove_workdir(path)
    assert not left, f"left behind by the session: {left}"


@pytest.fixture(scope="session")
def rebound_bin():
    path = mounts.rebound_bin()
    if not os.access(path, os.X_OK):
        pytest.fail(f"rebound binary {path} is missing: `cargo build --release` or set "
                    "REBOUND_BIN (or select `-m direct`)", pytrace=False)
    return path


@pytest.fixture(scope="session")
def sshd():
    server = mounts.start_sshd()
    yield server
    server.stop()


@pytest.fixture
def mount(request):
    """mount(driver, mode, **kw): a context manager mounting driver directly or under rebound
    (see mounts.mount_driver); starts the session's sshd and checks for rebound on demand."""
    def factory(driver, mode, **kw):
        if driver == "sshfs":
            kw.setdefault("sshd", request.getfixturevalue("sshd"))
        if mode == "rebound":
            request.getfixturevalue("rebound_bin")
        return mounts.mount_driver(driver, mode, **kw)
    return factory


@pytest.fixture
def workdir():
    """A fresh /tmp/rebound-e2e-* directory, removed afterwards (unmounting what is in it)."""
    path = mounts.new_workdir("work")
    yield path
    mounts.remove_workdir(path)


@pytest.fixture(scope="session")
def many_open_files():
    """Raises this process's open-file limit as far as it may, for the drivers it starts to
    inherit: passthrough_ll keeps a descriptor for every inode the kernel knows, and the
    workloads make tens of thousands of them. (Raising the hard limit needs CAP_SYS_RESOURCE;
    without it, the soft limit goes up to the hard one.)"""
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = int(Path("/proc/sys/fs/nr_open").read_text())
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (top, top))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (old[1], old[1]))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, old)


@pytest.fixture(scope="session")
def tree_tarball():
    """The tree workload's tarball of real content (workloads.build_tarball), at the size of
    workloads.scale(): built once per session in its own /tmp/rebound-e2e-* directory."""
    s = workloads.scale()
    path = mounts.new_workdir("tarball")
    try:
        yield workloads.build_tarball(path / "tree.tar", s.tree_files, s.tree_bytes)
    finally:
        mounts.remove_workdir(path)
