"""POSIX conformance under rebound: pjdfstest (the POSIX file system suite, its Rust rewrite from
crates.io) on a direct mount and on a rebound mount with the default config, each mounted with
allow_other and run as root, the suite switching to two other users where a test needs them:
the same tests pass, fail and are skipped. The default sandbox must not change what a file
system does; a driver kept from a capability it needs (CAP_CHOWN, CAP_FOWNER, ...) fails
dozens of these tests (the last test here shows it). Every writable driver that lets other
users in takes part (fuser's example decides that by itself; the read-only ones have nothing
for the suite to do).

Owns: running pjdfstest and comparing its outcomes. Must not: judge a driver's own
conformance (its failures on the direct mount are the driver's, and are only compared).
"""

import subprocess

import pytest

import mounts
from test_differential import DRIVERS as CORE_DRIVERS
from test_drivers import DRIVER_CONFIG, REFLINK, WRITABLE

# Every writable driver that lets other users in (the suite acts as several users).
DRIVERS = [d for d in CORE_DRIVERS + WRITABLE if d in mounts.ALLOW_OTHER]

# The suite's two unprivileged users (with their groups), both in every Debian base system.
CONFIG = """\
[features]
posix_fallocate = {}

[settings]
naptime = 0.001
allow_remount = false

[dummy_auth]
entries = [["nobody", "nogroup"], ["daemon", "daemon"]]
"""

# Tests whose outcome a driver itself does not repeat, with what showed it: compared by
# neither side.
UNSTEADY = {
    # Run alone 12 times on a direct mount: 4 FAILED, 8 ok (2026-11-25).
    "rclone": {"rename::preserve_metadata_dir"},
}


def pjdfstest(m):
    """Runs the whole suite in m.mnt; returns {test: "ok" | "FAILED" | "skipped"}."""
    config = m.work / "pjdfstest.toml"
    config.write_text(CONFIG)
    # It exits non-zero when a test fails (the direct mounts fail some): its outcomes count.
    res = subprocess.run([str(mounts.fixture_bin("pjdfstest")), "-c", str(config),
                          "-p", str(m.mnt)], capture_output=True, text=True, timeout=600,
                         env={"RUST_BACKTRACE": "0", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    outcomes = {}
    for line in res.stdout.splitlines():
        words = line.split()
        if len(words) == 2 and "::" in words[0] and words[1] in ("ok", "FAILED", "skipped"):
            outcomes[words[0]] = words[1]
    assert outcomes, f"pjdfstest printed no outcome (exit {res.returncode}):\n" \
                     f"{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
    return outcomes


def summary(outcomes):
    counts = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts


@pytest.mark.rebound
@pytest.mark.parametrize("driver", DRIVERS)
def test_posix_conformance_is_the_same_under_rebound(mount, driver):
    with mount(driver, "direct", allow_other=True) as m:
        direct = pjdfstest(m)
    with mount(driver, "rebound", allow_other=True, config=DRIVER_CONFIG.get(driver, ""),
               reflink=driver in REFLINK) as m:
        rebound = pjdfstest(m)
    print(f"{driver}: direct {summary(direct)}, rebound {summary(rebound)}")
    # The suite really ran on the direct mount: every test has its outcome, and some pass
    # (rclone, with neither modes nor owners nor special files, passes fewest: 53).
    assert len(direct) >= 390 and summary(direct).get("ok", 0) >= 40, summary(direct)
    differing = sorted(t for t in direct.keys() | rebound.keys()
                       if direct.get(t) != rebound.get(t) and t not in UNSTEADY.get(driver, ()))
    assert not differing, "\n".join(f"{t}: direct {direct.get(t)}, rebound {rebound.get(t)}"
                                    for t in differing)


@pytest.mark.rebound
def test_the_suite_sees_a_driver_kept_from_its_capabilities(mount):
    """The comparison has teeth: passthrough_ll under rebound with `capabilities = []` (it
    then cannot act for other users: chown, setgid bits, a device node) fails tests that pass
    on its direct mount."""
    with mount("passthrough_ll", "direct", allow_other=True) as m:
        direct = pjdfstest(m)
    with mount("passthrough_ll", "rebound", allow_other=True,
               config="[sandbox]\ncapabilities = []\n") as m:
        bare = pjdfstest(m)
    lost = sorted(t for t, outcome in direct.items() if outcome == "ok" and bare.get(t) == "FAILED")
    print(f"{len(lost)} tests fail without capabilities, e.g. {lost[:3]}")
    assert len(lost) >= 10, lost
