"""What the suite needs of its host, and drivers installed anywhere.

Owns: the proof that set-up provides what a bare machine lacks (fusectl, a cgroup tree), and that a
driver under the default sandbox still sees its own program wherever it lives — in /tmp (a
checkout, a build tree, a virtualenv, a script beside its modules) or on a tmpfs in /dev/shm —
without seeing the rest of /tmp; and that what the sandbox hides of what a driver is given is
named in rebound's log with the key that shows it.
Must not: test the sandbox's denials (test_sandbox.py does).
"""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import mounts
from test_isolation import Running

EXAMPLES = Path("/usr/share/doc/libfuse3-dev/examples")


def test_setup_mounts_fusectl_where_it_is_missing():
    """A machine without systemd does not mount fusectl; the README's commands must."""
    subprocess.run(["umount", mounts.FUSECTL], check=True)
    try:
        assert not os.path.ismount(mounts.FUSECTL)
        res = subprocess.run([str(mounts.REPO / "scripts" / "deps.sh")], capture_output=True,
                             text=True, timeout=900)
        assert res.returncode == 0, res.stderr
        assert os.path.ismount(mounts.FUSECTL), res.stderr
        assert "mounting fusectl" in res.stderr, res.stderr
        # Idempotent: a second run leaves it as it is.
        res = subprocess.run([str(mounts.REPO / "scripts" / "deps.sh")], capture_output=True,
                             text=True, timeout=900)
        assert res.returncode == 0 and "mounting fusectl" not in res.stderr, res.stderr
    finally:
        if not os.path.ismount(mounts.FUSECTL):
            subprocess.run(["mount", "-t", "fusectl", "fusectl", mounts.FUSECTL], check=True)


def test_host_set_up_mounts_a_cgroup_tree_where_there_is_none():
    """In a mount namespace of its own where /sys/fs/cgroup holds nothing (as in a bare
    container), scripts/host.sh mounts cgroup2 there; the host's tree is not touched."""
    script = f"umount -R /sys/fs/cgroup && {mounts.REPO / 'scripts' / 'host.sh'} " \
             "&& stat -f -c %T /sys/fs/cgroup"
    res = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["cgroup2fs"], res
    assert "mounting cgroup2" in res.stderr, res.stderr


def python_package(work):
    """A driver split into modules, in work/prog: driver.py imports rogue_driver beside it."""
    prog = work / "prog"
    prog.mkdir()
    shutil.copy(mounts.fixture_script("rogue_driver.py"), prog)
    (prog / "driver.py").write_text("import rogue_driver\nrogue_driver.main()\n")
    return prog


def layout_script(work):
    prog = python_package(work)
    return [sys.executable, str(prog / "driver.py")], {}, None


def layout_module_in_cwd(work):
    prog = python_package(work)
    return [sys.executable, "-m", "rogue_driver"], {}, prog


def layout_pythonpath(work):
    prog = python_package(work)
    return [sys.executable, "-m", "rogue_driver"], {"PYTHONPATH": str(prog)}, "/"


def layout_virtualenv(work):
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    site = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    shutil.copy(mounts.fixture_script("rogue_driver.py"), site)
    # The venv's own entry point, as pip would install it: a script whose #! names the venv.
    entry = venv / "bin" / "rogue-driver"
    entry.write_text(f"#!{venv / 'bin' / 'python'}\nimport rogue_driver\nrogue_driver.main()\n")
    entry.chmod(0o755)
    return [str(entry)], {}, "/"


LAYOUTS = {
    "script beside its modules": layout_script,
    "python -m from the working directory": layout_module_in_cwd,
    "python -m through PYTHONPATH": layout_pythonpath,
    "virtualenv entry point": layout_virtualenv,
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_python_driver_under_tmp_sees_its_program_and_not_the_rest_of_tmp(workdir, layout):
    argv, env, cwd = LAYOUTS[layout](workdir)
    others = workdir / "not-the-drivers.txt"
    others.write_text("the rest of /tmp\n")
    r = Running(workdir, argv + [str(workdir / "mnt")], env=dict(os.environ, **env), cwd=cwd)
    try:
        r.wait_mounted()
        assert (r.mnt / "good").read_bytes() == b"good data\n"
        pid = mounts.mount_status(r.mnt)["driver_pid"]
        root = Path(f"/proc/{pid}/root")
        assert not (root / others.relative_to("/")).exists(), "the rest of /tmp is hidden"
        out = subprocess.run([str(mounts.rebound_bin()), "restart", str(r.mnt)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, (out, r.stderr())
        assert (r.mnt / "good").read_bytes() == b"good data\n"
    finally:
        r.cleanup()


def build_tree_driver(work):
    """passthrough_ll built as in a build tree under work: work/build/bin/passthrough_ll needs
    librbprobe.so, which only its RUNPATH ($ORIGIN/../../probe-lib) finds."""
    libdir, bindir = work / "probe-lib", work / "build" / "bin"
    libdir.mkdir()
    bindir.mkdir(parents=True)
    (work / "probe.c").write_text("int rebound_probe(void) { return 1; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(libdir / "librbprobe.so"),
                    str(work / "probe.c")], check=True, timeout=120)
    src = work / "passthrough_ll.c"
    examples = EXAMPLES / "passthrough_ll.c"
    if examples.exists():
        shutil.copy(examples, src)
    else:
        src.write_bytes(subprocess.run(["gunzip", "-c", f"{examples}.gz"], check=True,
                                       capture_output=True).stdout)
    shutil.copy(EXAMPLES / "passthrough_helpers.h", work)
    flags = subprocess.run(["pkg-config", "fuse3", "--cflags", "--libs"], check=True,
                           capture_output=True, text=True).stdout.split()
    subprocess.run(["gcc", "-O1", "-o", str(bindir / "passthrough_ll"), str(src), *flags,
                    "-lpthread", "-Wl,--no-as-needed", f"-L{libdir}", "-lrbprobe",
                    "-Wl,-rpath,$ORIGIN/../../probe-lib"], check=True, timeout=300)
    return bindir / "passthrough_ll"


def test_a_driver_built_under_tmp_finds_its_libraries(workdir):
    driver = build_tree_driver(workdir)
    src = workdir / "src"
    src.mkdir()
    (src / "hello").write_text("hello\n")
    r = Running(workdir, [str(driver), "-f", "-o", f"source={src}", str(workdir / "mnt")])
    try:
        r.wait_mounted()
        assert (r.mnt / "hello").read_text() == "hello\n"
    finally:
        r.cleanup()


@pytest.fixture
def shm_dir():
    path = Path(f"/dev/shm/rebound-e2e-{os.getpid()}")
    path.mkdir()
    yield path
    mounts.umount(path / "mnt")
    shutil.rmtree(path, ignore_errors=True)


def test_a_mount_on_a_tmpfs_in_dev_shm_serves_and_recovers(shm_dir):
    src = shm_dir / "src"
    src.mkdir()
    (src / "hello").write_text("hello\n")
    r = Running(shm_dir, [str(mounts.fixture_bin("passthrough_ll")), "-f", "-o",
                          f"source={src}", str(shm_dir / "mnt")])
    try:
        r.wait_mounted()
        assert (r.mnt / "hello").read_text() == "hello\n"
        (r.mnt / "new").write_text("written\n")
        assert (src / "new").read_text() == "written\n"
        out = subprocess.run([str(mounts.rebound_bin()), "restart", str(r.mnt)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, (out, r.stderr())
        assert (r.mnt / "new").read_text() == "written\n"
    finally:
        r.cleanup()


def test_what_the_sandbox_hides_is_named_with_the_key_that_shows_it(workdir):
    src = workdir / "src"
    src.mkdir()
    (workdir / "mnt").mkdir()
    cfg = workdir / "rebound.toml"
    cfg.write_text("[sandbox]\ncommand_line_paths = false\n")
    code, _, err, _ = mounts.run_rebound(
        ["run", "--config", str(cfg), "--", str(mounts.fixture_bin("passthrough_ll")), "-f",
         "-o", f"source={src}", str(workdir / "mnt")], timeout=60)
    assert code != 0, err
    assert "failed before mounting" in err, err
    expected = textwrap.dedent(f"""\
        {src} (named by the command line) is hidden by the sandbox; \
`[sandbox] writable_paths = ["{src}"]` shows it""")
    failure = err[err.index("failed before mounting"):]
    assert expected in failure, err
    # With the key it names, the same driver mounts.
    cfg.write_text(f'[sandbox]\ncommand_line_paths = false\nwritable_paths = ["{src}", '
                   f'"{workdir / "mnt"}"]\n')
    r = Running(workdir, [str(mounts.fixture_bin("passthrough_ll")), "-f", "-o",
                          f"source={src}", str(workdir / "mnt")], config=cfg.read_text())
    try:
        r.wait_mounted()
        (r.mnt / "x").write_text("x\n")
        assert (src / "x").read_text() == "x\n"
    finally:
        r.cleanup()
