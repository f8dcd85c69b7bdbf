"""Fault injection (issue 4), end to end on a test driver (passthrough_ll): `rebound inject`
writes the planned bytes into the live driver, the same seed gives the same faults in another
process of the same driver (whatever ASLR did), and one trial of each fault type, run by the
campaign runner (bench/campaign.py) in both modes, gets the expected classification.

Owns: those checks. Must not: measure anything (bench/campaign.py and scripts/campaign.sh do).
"""
import json
import subprocess
import sys

import pytest

import mounts

sys.path.insert(0, str(mounts.REPO / "bench"))
import campaign  # noqa: E402  (bench/campaign.py)

DRIVER = "passthrough_ll"


def inject(rebound_bin, pid, *args):
    res = subprocess.run([str(rebound_bin), "inject", "--pid", str(pid), *args],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in res.stdout.splitlines()]


def driver_pid(m):
    pid = campaign.driver_pid(m)
    assert pid, f"no driver process for {m.describe()}"
    return pid


@pytest.mark.parametrize("fault", campaign.CODE_TYPES)
def test_code_fault_lands_in_memory_and_is_reproducible(mount, rebound_bin, fault):
    plans = []
    for _ in range(2):
        with mount(DRIVER, "direct") as m:
            pid = driver_pid(m)
            plan = inject(rebound_bin, pid, "--fault", fault, "--count", "5", "--seed", "7",
                          "--dry-run")
            plans.append([(r["module"], r["file_offset"], r["new_bytes"]) for r in plan])
            recs = inject(rebound_bin, pid, "--fault", fault, "--count", "5", "--seed", "7")
            assert len(recs) == 5
            with open(f"/proc/{pid}/mem", "rb") as mem:
                for r in recs:
                    assert r["new_bytes"] != r["old_bytes"]
                    assert len(r["new_bytes"]) == len(r["old_bytes"])
                    mem.seek(int(r["addr"], 16))
                    assert mem.read(len(r["new_bytes"]) // 2).hex() == r["new_bytes"], r
                    if fault != "text":
                        assert r["after"] != "(bad)", r
            # Down without asserting a clean stop: the faults may have broken the driver.
            m.cleanup()
            m.stopped = True
    assert plans[0] == plans[1], "the same seed planned different faults"


EXPECTED = {
    # fault: (direct outcome, rebound outcome); None: not injectable in that mode
    "kill": ("mount_lost", "recovered"),
    "hang": ("hung", "recovered"),
    "corrupt": ("not_applicable", "recovered"),
    # Directly nothing limits the driver's memory; under rebound its cgroup's limit does.
    "leak": ("no_effect", "recovered"),
}


@pytest.mark.parametrize("fault", campaign.TYPES)
def test_one_trial_of_each_type_is_classified(rebound_bin, fault, monkeypatch):
    if fault == "corrupt":
        # A reply is corrupted in transit only where replies cross rebound.
        monkeypatch.setattr(campaign, "REBOUND_MODE", "guarded")
    seed = campaign.trial_seed(1, DRIVER, fault, 0)
    direct = campaign.run_mode(DRIVER, "direct", fault, seed, 5, None)
    reb = campaign.run_mode(DRIVER, "rebound", fault, seed, 5, None)
    assert direct["outcome"] != "not_injected", direct
    assert reb["outcome"] != "not_injected", reb
    if fault in EXPECTED:
        assert (direct["outcome"], reb["outcome"]) == EXPECTED[fault], (direct, reb)
    else:
        # A code fault may or may not hit executed code, and may fail the driver or only its
        # answers; but rebound never loses the mount or hangs. What fails under rebound is a
        # live driver's wrong answers, which rebound does not see, or sees (a second opinion)
        # only after the application got one: the same trial fails directly.
        assert direct["outcome"] in campaign.CLASSES, direct
        assert reb["outcome"] not in ("mount_lost", "hung"), reb
        if reb["outcome"] in campaign.FAILURES:
            assert direct["outcome"] in campaign.FAILURES, (direct, reb)


def test_a_corrupt_trial_is_not_applicable_in_fast_mode(rebound_bin, monkeypatch):
    """Beside the path the driver's replies reach the kernel without crossing rebound: rebound
    refuses to corrupt them (naming guarded mode), and the campaign counts the trial as
    not applicable rather than as a fault that was not injected."""
    monkeypatch.setattr(campaign, "REBOUND_MODE", "fast")
    seed = campaign.trial_seed(1, DRIVER, "corrupt", 0)
    row = campaign.run_mode(DRIVER, "rebound", "corrupt", seed, 5, None)
    assert row["outcome"] == "not_applicable", row
    assert "guarded" in row["inject_error"], row
