"""The recovery workloads without any failure: on a plain directory, on each driver mounted
directly and under rebound.

Owns: the proof that workloads.py is right, so that an error it reports under chaos
(test_recovery.py) is rebound's: each workload must pass on a local directory and on every
driver mounted directly. Shorter than under chaos: a few seconds of held-open and model; the
tree at the session's size. At the soak scale (REBOUND_SOAK=1) each also runs through rebound
with no failure, to tell a soak's error under failures from one without; the default suite
leaves that to the differential tests and to the workloads under failures themselves (they
took 79 s of one of its runs).
"""

import dataclasses

import pytest

import mounts
import workloads

pytestmark = pytest.mark.usefixtures("many_open_files")

DRIVERS = ["fuse2fs", "passthrough_ll", "sshfs", "gofuse"]
SHORT = 4.0  # seconds of held-open and model
IMAGE_SIZE = (1024 if workloads.soak() else 256) * mounts.MiB  # fuse2fs's: the tree must fit


def short_scale():
    s = workloads.scale()
    return dataclasses.replace(s, held_seconds=min(s.held_seconds, SHORT),
                               model_seconds=min(s.model_seconds, SHORT))


def check(result, root=None):
    assert result.ok, result.summary()
    if root is not None and result.recheck is not None:
        problems = result.recheck(root)
        assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize("workload", workloads.WORKLOADS)
def test_workload_on_a_plain_directory(workdir, tree_tarball, workload):
    result = workloads.run(workload, workdir, scale_=short_scale(), tarball=tree_tarball)
    check(result, workdir)


@pytest.mark.parametrize("workload", workloads.WORKLOADS)
@pytest.mark.parametrize("mode", mounts.MODES if workloads.soak() else ["direct"])
@pytest.mark.parametrize("driver", DRIVERS)
def test_workload_on_a_mount(mount, tree_tarball, driver, mode, workload):
    if workload == "tree" and (why := mounts.descriptor_shortfall(driver,
                                                                  len(tree_tarball.entries))):
        pytest.skip(why)
    result = None

    def backing_store_holds_the_result(m):
        if m.src.exists():
            check(result, m.src)

    with mount(driver, mode, image_size=IMAGE_SIZE, after_stop=backing_store_holds_the_result,
               watchdog=1800.0 if workloads.soak() else mounts.WATCHDOG) as m:
        result = workloads.run(workload, m.mnt, scale_=short_scale(), tarball=tree_tarball)
        check(result)
