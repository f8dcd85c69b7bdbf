"""Differential tests: a driver must behave the same under rebound as when mounted directly.

Owns: replaying fsops on each driver (a fresh backing directory or image per mount) and
comparing (1) a direct mount with a plain local directory, up to each driver's documented
deviations, which checks that the script and the fixtures test what they claim, and (2) the
rebound mount with the direct mount, which must match exactly, in both of rebound's modes
(guarded, and fast: the driver on the kernel's queue with rebound beside it), against one
direct run per driver.
"""

import difflib
import mmap
import os

import pytest

import fsops
import mounts

DRIVERS = ["fuse2fs", "passthrough_ll", "passthrough_ll-clone_fd", "passthrough_fh", "sshfs",
           "gofuse"]

XATTR_UNSUPPORTED = {step: "ENOTSUP" for step in (
    "xattr_set_get", "xattr_create_existing", "xattr_list", "xattr_remove",
    "xattr_get_missing")}


def _tree_keeping_nr1(local):
    """final_tree when nr1 stayed where it was (its RENAME_NOREPLACE failed)."""
    rows = local.split()[1:]
    return " ".join(["ok"] + sorted(r.replace("nr3:", "nr1:", 1) for r in rows))


# The kernel turns a driver's ENOSYS for RENAME2 (libfuse 2, or a libfuse 3 driver without
# flags support) into EINVAL. A noreplace rename onto an existing name never reaches the
# driver: the kernel's own lookup answers EEXIST.
NO_RENAME2 = {"rename_noreplace_free": "EINVAL", "final_tree": _tree_keeping_nr1}

# How each driver, mounted directly, differs from a local ext4 directory: step -> outcome, or
# a function of the local outcome. Anything else that differs is a bug in the driver build,
# the fixture or fsops.
DEVIATIONS = {
    # fuse2fs 1.47.0 ignores XATTR_CREATE and replaces the value.
    "fuse2fs": {**NO_RENAME2, "xattr_create_existing": "ok"},
    "passthrough_ll": NO_RENAME2,
    "passthrough_ll-clone_fd": NO_RENAME2,
    "passthrough_fh": NO_RENAME2,
    # SFTP has no link count and no inode numbers, nor xattrs.
    "sshfs": {**NO_RENAME2, **XATTR_UNSUPPORTED,
              "hardlink": lambda local: local.replace("nlink=2,2 same_ino=True",
                                                      "nlink=1,1 same_ino=False")},
    # go-fuse implements RENAME2 flags: like a local file system.
    "gofuse": {},
}


def expected_direct(driver, local_results):
    out = []
    for step, outcome in local_results:
        dev = DEVIATIONS[driver].get(step, outcome)
        out.append((step, dev(outcome) if callable(dev) else dev))
    return out


def diff(expected, actual, from_name, to_name):
    return "\n".join(difflib.unified_diff(fsops.format_results(expected),
                                          fsops.format_results(actual),
                                          from_name, to_name, lineterm="", n=1))


@pytest.fixture(scope="module")
def local_results():
    work = mounts.new_workdir("local")
    try:
        return fsops.run(str(work))
    finally:
        mounts.remove_workdir(work)


@pytest.mark.direct
def test_local_reference_is_all_ok(local_results):
    """The reference itself: on a local directory every step gives its POSIX answer."""
    outcomes = dict(local_results)
    assert all(not o.startswith("MISMATCH") for o in outcomes.values()), local_results
    assert outcomes["unlink_missing"] == "ENOENT"
    assert outcomes["rmdir_nonempty"] == "ENOTEMPTY"
    assert outcomes["open_excl_existing"] == "EEXIST"
    assert outcomes["posix_lock"] in ("ok second=EAGAIN getlk=[F_WRLCK 0 0] after_unlock=ok",
                                      "ok second=EACCES getlk=[F_WRLCK 0 0] after_unlock=ok")
    assert outcomes["flock"] == "ok second=EAGAIN after_unlock=ok"
    assert outcomes["readdir_3000"] == "ok n=3000 regular=3000"
    assert outcomes["xattr_set_get"] == "ok value=b'value-1'", "/tmp has no user xattrs"


@pytest.mark.parametrize("mode", ["direct"])
@pytest.mark.parametrize("driver", DRIVERS)
def test_direct_matches_local(mount, driver, mode, local_results, direct_results):
    """A direct mount gives the local answers (as root) except for the driver's known
    deviations. (The same run is what rebound's mounts are compared with, below.)"""
    expected = expected_direct(driver, local_results)
    actual, _ = direct_of(mount, driver, direct_results)
    assert actual == expected, "\n" + diff(expected, actual, "local+deviations",
                                           f"{driver} direct")


def run_as_root_and_user(mount, driver, mode, entries=fsops.READDIR_ENTRIES, **kw):
    """fsops on a fresh mount (letting other users in) as root, then as an unprivileged
    user in a directory of its own: both results."""
    return as_root_and_user(mount(driver, mode, allow_other=True, **kw), entries)


def as_root_and_user(context, entries=fsops.READDIR_ENTRIES):
    """The same, in the mount `context` makes (made by the `mount` fixture in the test's own
    thread: `mounts.side_by_side` may run this in another)."""
    with context as m:
        as_root = fsops.run(str(m.mnt), entries)
        as_user = fsops.run_as_user(str(m.mnt), entries)
    return as_root, as_user


# fsops steps whose outcome a driver's own direct mount does not keep steady, with what was
# measured; they are left out of the comparison for that driver.
UNSTEADY_STEPS = {
    # Its direct mount reported inconsistent statvfs figures (free inodes above inodes, or
    # free blocks above blocks: `sane=False`) once in three all-drivers runs (2026-11-25, at
    # fe9573c), while the rebound mount's were consistent; the other two runs agreed.
    "ntfs-3g": {"statvfs"},
}


def assert_same(driver, direct, rebound):
    """direct and rebound, each (as root, as a user), are the same (but for the steps the
    driver's own direct mount does not keep steady)."""
    unsteady = UNSTEADY_STEPS.get(driver, set())

    def steady(results):
        return [(step, outcome) for step, outcome in results if step not in unsteady]

    for who, d, r in zip(("root", f"uid {fsops.UNPRIVILEGED}"), direct, rebound):
        d, r = steady(d), steady(r)
        if r != d:  # (not an assert: pytest's own diff of the lists would bury this one)
            pytest.fail(f"as {who}:\n" + diff(d, r, f"{driver} direct", f"{driver} rebound"))


@pytest.fixture(scope="module")
def direct_results():
    """Each driver's direct results, run once for the comparison with the local directory
    and for both of rebound's modes (see `direct_of`)."""
    return {}


def direct_of(mount, driver, direct_results):
    """The driver's direct results (as root, as a user), from one fresh direct mount."""
    if driver not in direct_results:
        direct_results[driver] = run_as_root_and_user(mount, driver, "direct")
    return direct_results[driver]


@pytest.mark.rebound
@pytest.mark.parametrize("data_path", ["guarded", "fast"])
@pytest.mark.parametrize("driver", DRIVERS)
def test_rebound_matches_direct(mount, driver, data_path, direct_results):
    """The same script on a fresh direct mount and a fresh rebound mount in each mode, as
    root and as an unprivileged user (the default sandbox must not change what another user
    sees): identical results. (Guarded: every message crosses the proxy; fast: the driver
    serves the kernel's queue, rebound observes beside it.)"""
    direct = direct_of(mount, driver, direct_results)
    config = f'mode = "{data_path}"\n'
    under = run_as_root_and_user(mount, driver, "rebound", config=config)
    assert_same(driver, direct, under)


@pytest.mark.rebound
@pytest.mark.parametrize("data_path", ["guarded", "fast"])
def test_o_direct_writes_and_reads_pass_before_and_after_a_restart(mount, data_path):
    """passthrough_ll opens its backing file with the caller's flags. Through rebound's channel
    (guarded, and fast once the proxy took over) libfuse receives a write's data right after
    its headers, not page-aligned, and every O_DIRECT write failed with EINVAL (the
    benchmark's qd16 writes, 2026-11-28). Aligned O_DIRECT writes and reads must succeed, on a
    handle opened before a driver restart and on one opened after it; a read-only handle keeps
    O_DIRECT in the driver."""
    from test_recovery import explain, kill_driver, toml, wait_serving
    block = 4096
    config = toml(mode=data_path, restart_backoff_ms=0)
    with mount("passthrough_ll", "rebound", config=config) as m:
        path = m.mnt / "direct"
        buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT wants

        def write_and_check(fd, index):
            buf[:] = bytes([index + 1]) * block
            assert os.pwrite(fd, buf, index * block) == block, explain(m)
            buf[:] = bytes(block)
            assert os.preadv(fd, [buf], index * block) == block, explain(m)
            assert buf[:] == bytes([index + 1]) * block, explain(m, f"block {index}")

        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            write_and_check(fd, 0)
            wait_serving(m, kill_driver(m, wait_serving(m)))
            write_and_check(fd, 1)
            again = os.open(path, os.O_RDWR | os.O_DIRECT)
            read_only = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                write_and_check(again, 2)
                assert os.preadv(read_only, [buf], 2 * block) == block, explain(m)
                # The driver's own descriptors on the backing file: the handles that write
                # lost O_DIRECT on the way to it (its data is not page-aligned in its buffer),
                # the read-only one kept it.
                driver = wait_serving(m)["driver_pid"]
                flags = backing_flags(driver, m.src / "direct")
                assert sorted(f & os.O_DIRECT != 0 for f in flags) == [False, False, True], \
                    explain(m, f"the driver's flags on the backing file: {flags}")
            finally:
                os.close(read_only)
                os.close(again)
        finally:
            os.close(fd)
        assert path.read_bytes() == b"".join(bytes([i + 1]) * block for i in range(3))


def backing_flags(pid, backing):
    """The open flags of each descriptor process `pid` holds open on file `backing` (not its
    O_PATH ones: passthrough_ll holds one per node it knows)."""
    flags = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != str(backing):
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as info:
                flags += [f for line in info if line.startswith("flags:")
                          if not (f := int(line.split()[1], 8)) & os.O_PATH]
        except FileNotFoundError:
            pass  # closed meanwhile
    return flags
