"""`rebound observe`: a FUSE mount's requests seen from beside the path.

Owns the proof that the observer (a BPF program on the kernel's fuse_request_end tracepoint,
and on kfree where a driver's forgets are freed) reports, for a real mount it does not serve,
each request with the names and node ids it carries and its outcome, the node ids the driver's
replies gave, and the forgets of those ids: what rebound's fast path needs to keep its tracker.
"""

import os
import re
import subprocess
import time

import pytest

import mounts


def observe(mnt, seconds):
    """Starts `rebound observe` on mnt; returns the process once it says it is attached."""
    proc = subprocess.Popen([str(mounts.rebound_bin()), "observe", str(mnt), "--seconds",
                             str(seconds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    first = proc.stderr.readline()
    assert first.startswith("observing"), first + proc.stderr.read()
    return proc


@pytest.mark.parametrize("mode", ["direct", "rebound"])
def test_requests_names_node_ids_and_forgets_are_seen(mount, mode, rebound_bin):
    with mount("passthrough_ll", mode) as m:
        proc = observe(m.mnt, 3)
        (m.mnt / "d").mkdir()
        (m.mnt / "d" / "f").write_bytes(b"x")
        (m.mnt / "d" / "f").rename(m.mnt / "d" / "g")
        assert not (m.mnt / "d" / "absent").exists()
        (m.mnt / "d" / "g").unlink()
        (m.mnt / "d" / "h").write_bytes(b"y")
        listed = os.listdir(m.mnt / "d")
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
    lines = out.splitlines()

    def one(pattern):
        found = [re.search(pattern, line) for line in lines]
        found = [f for f in found if f]
        assert found, f"no line matches {pattern!r} in:\n{out}"
        return found[0]

    d = int(one(r"^MKDIR unique \d+ node 1 'd' -> node (\d+) ok$").group(1))
    f = int(one(rf"^CREATE unique \d+ node {d} 'f' -> node (\d+) ok$").group(1))
    assert f != d
    one(rf"^RENAME2? unique \d+ node {d} 'f' -> node {d} 'g' ok$")
    one(rf"^LOOKUP unique \d+ node {d} 'absent' error No such file or directory")
    one(rf"^UNLINK unique \d+ node {d} 'g' ok$")
    # The unlinked file's inode is evicted at once: its one lookup (from CREATE) is forgotten.
    one(rf"^FORGET node {f} count 1 \(read by pid \d+\)$")
    # A listing's entries, which the kernel counts lookups of, are seen with their node ids.
    assert listed == ["h"]
    h = int(one(rf"^CREATE unique \d+ node {d} 'h' -> node (\d+) ok$").group(1))
    one(rf"^READDIRPLUS unique \d+ node {d} \[.*'h' -> node {h}.*\] ok$")


def test_a_path_that_is_no_fuse_mount_is_named(tmp_path, rebound_bin):
    res = subprocess.run([str(mounts.rebound_bin()), "observe", str(tmp_path), "--seconds", "1"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 1
    assert f"{tmp_path} is not a FUSE mount point" in res.stderr
