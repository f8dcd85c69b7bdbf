#!/usr/bin/env python3
"""Fault-injection campaigns: Nooks' experiment (TOCS 2005, section 4) on real FUSE drivers,
each fault injected once into the directly mounted driver and once into the same driver under
rebound, and the outcomes compared.

Owns: the trials (a fresh mount, a short verifying workload, `rebound inject` at a random
moment of it, a bounded wait, the outcome classified, everything torn down), the outcome
classes, the results as JSON lines, and the Markdown report with its charts.
Must not: choose or apply faults itself (that is `rebound inject`, which plans them from the
seed over the driver's module files, so both modes get the same faults), nor leave a mount or
a process behind whatever a trial does.

    bench/campaign.py [--drivers fuse2fs,passthrough_ll,sshfs] [--per-type 50]
                      [--per-type-other 10] [--faults 5]
                      [--types source,...,nop,kill,hang,leak,corrupt] [--seed 1]
                      [--out bench/results]
    bench/campaign.py --report bench/results/campaign-*.jsonl   (only the report and charts)

A trial (driver, fault type, index) has a seed derived from the campaign seed; the seed fixes
the faults (`rebound inject --seed`), the workload's operations and the moment of injection.
The workload (a child process, so that a hang cannot block the runner): creates 120 small
files with known content, reading earlier ones back (cached pages dropped first) and comparing
every byte, renaming and unlinking some and listing the directory against what it expects;
after operation INJECT_AT (random) it stops until the runner has injected; at the end it
re-reads every file and lists the directory once more. Outcome classes, most severe first:
  mount_lost   an operation failed with ENOTCONN, or the mount point is dead afterwards
  hung         the workload did not finish within HANG_S seconds of the injection, or the
               unmount at the end did not within STOP_S
  corrupted    a byte read back differs, the listing is wrong, or `e2fsck -fn` finds errors
               in the image after the unmount (fuse2fs)
  app_error    an operation failed with any other error
  recovered    (rebound) the driver failed and was restarted, and none of the above happened
  no_effect    nothing of the above, and the driver did not fail
`corrupt` (a reply corrupted in transit) exists only in rebound's channel: its direct runs are
`not_applicable`. A trial whose injection itself failed is `not_injected`, and not counted.
"""

import argparse
import json
import os
import platform
import random
import select
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests" / "e2e"))
import mounts  # noqa: E402  (tests/e2e/mounts.py)
from recovery import latency_cdf, load, percentile  # noqa: E402  (bench/recovery.py)
from run import REBOUND, REPO  # noqa: E402  (bench/run.py)

DRIVERS = ("fuse2fs", "passthrough_ll", "sshfs", "gofuse")
CODE_TYPES = ("source", "destination", "pointer", "interface", "branch", "loop", "text", "nop")
OTHER_TYPES = ("kill", "hang", "leak", "corrupt")
TYPES = CODE_TYPES + OTHER_TYPES
EXES = {"fuse2fs": "fuse2fs", "passthrough_ll": "passthrough_ll", "sshfs": "sshfs",
        "gofuse": "gofuse-loopback"}
FAILURES = ("mount_lost", "hung", "corrupted", "app_error")
CLASSES = FAILURES + ("recovered", "no_effect")
HANG_S = 6.0       # seconds the workload may take after the injection before it counts as hung
STOP_S = 8.0      # seconds a normal stop (unmount) may take before it counts as hung
READY_S = 20.0     # seconds the workload may take to reach its injection point
FILES = 120
LEAK_MB = 2048

# --- the workload (runs in a child process) --------------------------------------------------


def content(seed, i, gen):
    head = f"file {i} generation {gen} seed {seed}\n".encode()
    rng = random.Random(seed * 1000003 + i * 7919 + gen)
    return head + rng.randbytes(600 + (i * 37) % 1400)


def workload(root, seed, inject_at):
    """Runs the operations; prints `inject` after operation inject_at and waits for a line on
    stdin; prints one JSON line with what went wrong at the end."""
    root = Path(root)
    rng = random.Random(seed)
    res = {"ops": 0, "errors": [], "n_errors": 0, "enotconn": False, "mismatches": []}
    expected = {}  # name -> content
    state = {"injected": False}

    def point():
        res["ops"] += 1
        if res["ops"] == inject_at and not state["injected"]:
            state["injected"] = True
            print("inject", flush=True)
            sys.stdin.readline()

    def fail(what, e):
        res["n_errors"] += 1
        if e.errno == 107:  # ENOTCONN
            res["enotconn"] = True
        if len(res["errors"]) < 5:
            res["errors"].append(f"{what}: {e.strerror} (errno {e.errno})")

    def read_check(name):
        fd = os.open(root / name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            data = b""
            while chunk := os.read(fd, 65536):
                data += chunk
        finally:
            os.close(fd)
        if data != expected[name] and len(res["mismatches"]) < 5:
            res["mismatches"].append(f"{name}: {len(data)} bytes, expected "
                                     f"{len(expected[name])}")
        elif data != expected[name]:
            res["mismatches"].append("...")

    def listing(what):
        names = sorted(os.listdir(root))
        if names != sorted(expected):
            missing = sorted(set(expected) - set(names))[:3]
            extra = sorted(set(names) - set(expected))[:3]
            res["mismatches"].append(f"{what}: listing differs (missing {missing}, extra {extra})")

    def step(what, f, *args):
        if res["n_errors"] >= 20:
            return
        try:
            f(*args)
        except OSError as e:
            fail(what, e)
        point()

    def create(i):
        name = f"f{i:03d}"
        data = content(seed, i, 0)
        with open(root / name, "wb") as f:
            f.write(data)
        expected[name] = data

    def rename(name):
        new = name + ".r"
        os.rename(root / name, root / new)
        expected[new] = expected.pop(name)

    def unlink(name):
        os.unlink(root / name)
        del expected[name]

    def rewrite(name):
        data = content(seed, int(name[1:4]), 1)
        with open(root / name, "r+b") as f:
            f.truncate(0)
            f.write(data)
        expected[name] = data

    step("mkdir", os.mkdir, root)
    for i in range(FILES):
        step(f"create f{i:03d}", create, i)
        if expected and i % 3 == 2:
            name = rng.choice(sorted(expected))
            step(f"read {name}", read_check, name)
        if expected and i % 10 == 9:
            name = rng.choice(sorted(expected))
            step(f"rename {name}", rename, name)
        if expected and i % 15 == 14:
            name = rng.choice(sorted(expected))
            step(f"unlink {name}", unlink, name)
        if expected and i % 8 == 7:
            name = rng.choice(sorted(expected))
            step(f"rewrite {name}", rewrite, name)
        if i % 20 == 19:
            step("listdir", listing, "listdir")
    if not state["injected"]:
        state["injected"] = True
        print("inject", flush=True)
        sys.stdin.readline()
    step("final listdir", listing, "final listdir")
    for name in sorted(expected):
        step(f"final read {name}", read_check, name)
    print(json.dumps(res), flush=True)


# --- one trial --------------------------------------------------------------------------------


# rebound's data path in its runs (`--rebound-mode`): None for rebound's own default.
REBOUND_MODE = None


def rebound_config(driver):
    """Restart at once, as often as needed; hangs detected within a couple of seconds;
    fuse2fs with the redo log and its image repaired between drivers (as the README says)."""
    text = f'mode = "{REBOUND_MODE}"\n' if REBOUND_MODE else ""
    text += ("restart_budget = 1000000\nrestart_window_ms = 60000\n"
            "restart_backoff_ms = 0\nrestart_backoff_max_ms = 0\n"
            "request_timeout_ms = 2000\nprobe_timeout_ms = 1000\n")
    if driver == "fuse2fs":
        text += 'redo_log = true\npre_restart = ["e2fsck", "-fy", "@IMAGE@"]\n'
    return text


def status_of(mnt):
    try:
        out = subprocess.run([str(REBOUND), "status", "--json"], capture_output=True,
                             text=True, timeout=10)
        return next((s for s in json.loads(out.stdout) if s["mountpoint"] == str(mnt)), None)
    except (ValueError, subprocess.TimeoutExpired):
        return None


def exe_name(pid):
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return None


def driver_pid(m):
    if m.mode == "rebound":
        # A daemonizing driver is named once its parent is reaped: until then the status may
        # name a process that is gone (waited for, up to 5 s).
        def live():
            pid = (status_of(m.mnt) or {}).get("driver_pid")
            return pid if pid and mounts.alive(pid) else None
        return mounts.wait_for(live, 5)
    return next((p for p in m.driver_pids if exe_name(p) == EXES[m.driver]), None)


def mount_lost(mnt, timeout=3.0):
    """Whether stat of the mount point fails with ENOTCONN (or does not answer in time)."""
    try:
        res = subprocess.run(["stat", "-c", "%i", str(mnt)], capture_output=True, text=True,
                             timeout=timeout, env={**os.environ, "LC_ALL": "C"})
        return "not connected" in res.stderr
    except subprocess.TimeoutExpired:
        return True


def inject(m, fault, seed, count):
    """Runs `rebound inject` on the mount's driver; (log records, error or None)."""
    args = [str(REBOUND), "inject", "--fault", fault, "--seed", str(seed)]
    if fault == "corrupt":
        args += ["--mount", str(m.mnt), "--count", "1"]
    else:
        pid = driver_pid(m)
        if pid is None:
            return [], "no driver process found"
        args += ["--pid", str(pid), "--count", str(1 if fault in OTHER_TYPES else count)]
        if fault == "leak":
            args += ["--leak-mb", str(LEAK_MB)]
    try:
        res = subprocess.run(args, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return [], "rebound inject did not finish within 60 s"
    recs = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    return recs, (None if res.returncode == 0 else res.stderr.strip()[-300:])


def read_line(proc, timeout):
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else None


def run_mode(driver, mode, fault, seed, count, sshd):
    """One run of one trial: returns the result row (outcome and evidence)."""
    t0 = time.monotonic()
    row = {"driver": driver, "fault": fault, "seed": seed, "mode": mode}
    if fault == "corrupt" and mode == "direct":
        row.update(outcome="not_applicable", seconds=0.0)
        return row
    rng = random.Random(seed)
    inject_at = rng.randrange(5, 150)
    m = mounts.Mount(driver, mode, mounts.new_workdir(f"campaign-{driver}"), sshd=sshd,
                     watchdog=120.0)
    if mode == "rebound":
        m.config = rebound_config(driver)
    flags = {}
    wl = None
    try:
        m.prepare(32 * mounts.MiB)
        m.start()
        wl = subprocess.Popen([sys.executable, __file__, "--workload", str(m.mnt / "w"),
                               str(seed), str(inject_at)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
        line = read_line(wl, READY_S)
        if line is None or line.strip() != "inject":
            row.update(outcome="not_injected", inject_error=f"workload not ready: {line!r}")
            return row
        recs, err = inject(m, fault, seed, count)
        row["injections"] = recs
        if err and fault == "corrupt" and "guarded" in err:
            # Fast mode: the driver's replies do not cross rebound, so none can be corrupted
            # in transit (rebound refuses, naming guarded mode).
            row.update(outcome="not_applicable", inject_error=err)
            return row
        if err:
            row.update(outcome="not_injected", inject_error=err)
            return row
        wl.stdin.write("go\n")
        wl.stdin.flush()
        line = read_line(wl, HANG_S)
        result = json.loads(line) if line and line.startswith("{") else None
        flags["hung"] = result is None
        if result is not None:
            row["ops"] = result["ops"]
            row["errors"] = result["errors"]
            row["mismatches"] = result["mismatches"][:5]
            flags["mount_lost"] = result["enotconn"]
            flags["app_error"] = result["n_errors"] > 0 and not result["enotconn"]
            flags["corrupted"] = bool(result["mismatches"])
        if not flags["hung"] and mount_lost(m.mnt):
            flags["mount_lost"] = True
        if mode == "rebound":
            st = status_of(m.mnt) or {}
            row["driver_failures"] = st.get("failures", 0)
            row["restarts"] = st.get("restarts", 0)
            row["recovery_ms"] = st.get("recovery_ms", [])
            row["last_failure"] = st.get("last_failure")
            row["rebound_state"] = st.get("state")
            flags["driver_failed"] = row["driver_failures"] > 0 or row["restarts"] > 0
        else:
            pid = next((r["pid"] for r in recs if "pid" in r), None)
            flags["driver_failed"] = (flags["hung"] or flags.get("mount_lost", False)
                                      or (pid is not None and not mounts.alive(pid)))
    except Exception as e:  # a trial never takes the campaign down
        row.update(outcome="not_injected", inject_error=f"runner: {type(e).__name__}: {e}")
        return row
    finally:
        teardown(m, wl, flags, row)
        row["seconds"] = round(time.monotonic() - t0, 2)
    row["flags"] = flags
    row["outcome"] = next((c for c in FAILURES if flags.get(c)), None) or \
        ("recovered" if flags.get("driver_failed") else "no_effect")
    return row


def teardown(m, wl, flags, row):
    """Down in every case: a healthy mount the normal way (so its image is checked as a user
    would leave it), a failed one by aborting its connection; then e2fsck of an image, then
    no process, mount or directory left."""
    healthy = not (flags.get("hung") or flags.get("mount_lost")) and m.proc is not None
    try:
        if not healthy:
            conn = mounts.fuse_connection(m.mnt)
            if conn is not None:
                mounts.abort_connection(conn)
        if wl is not None and wl.poll() is None:
            mounts.kill_all([wl.pid], timeout=1.0)
            wl.wait(timeout=10)
        if healthy:
            # A driver the faults left hanging hangs the unmount too: that is the application
            # (umount) hung, and the connection is aborted so that the unmount returns.
            conn = mounts.fuse_connection(m.mnt)
            timer = None
            if conn is not None:
                def unhang():
                    flags["hung"] = True
                    row["stop_error"] = f"unmount hung for {STOP_S:.0f} s"
                    mounts.abort_connection(conn)
                timer = threading.Timer(STOP_S, unhang)
                timer.start()
            try:
                m.stop()
            except Exception as e:  # noqa: BLE001  a stop that fails is a finding, not a crash
                row["stop_error"] = f"{type(e).__name__}: {e}"[:300]
            finally:
                if timer is not None:
                    timer.cancel()
        else:
            if m.proc is not None and m.proc.poll() is None:
                m.proc.terminate()
            mounts.kill_all(list(m.leftover_processes()), timeout=2.0)
            mounts.umount(m.mnt)
        if mounts.DRIVERS[m.driver][1] == "image" and m.img.exists() and m.proc is not None \
                and "outcome" not in row:
            mounts.kill_all(list(m.leftover_processes()), timeout=5.0)
            ok, report = mounts.e2fsck(m.img)
            if not ok:
                flags["corrupted"] = True
                row["e2fsck"] = report[-400:]
    finally:
        try:
            m.cleanup()
        except RuntimeError as e:  # a mount left behind is noted; the campaign goes on
            row["cleanup_error"] = str(e)[:300]


# --- the report -------------------------------------------------------------------------------


def pct(a, b):
    return f"{100.0 * a / b:.1f}%" if b else "–"


def normalize(r):
    """A run whose unmount hung is `hung` whatever its workload saw (rows written before the
    runner bounded the unmount itself carry only the `stop_error`)."""
    err = r.get("stop_error") or ""
    if r.get("outcome") in ("recovered", "no_effect", "app_error", "corrupted") and \
            ("timed out" in err or "unmount hung" in err):
        r = {**r, "outcome": "hung", "flags": {**r.get("flags", {}), "hung": True}}
    return r


def pair_rows(rows):
    """{(driver, fault, seed): {mode: row}}, counted trials only."""
    trials = {}
    for r in map(normalize, rows):
        trials.setdefault((r["driver"], r["fault"], r["seed"]), {})[r["mode"]] = r
    return trials


def summarize(rows):
    """Per (driver, fault): counts for the Nooks-style table."""
    out = {}
    for (driver, fault, _), modes in sorted(pair_rows(rows).items()):
        d, rb = modes.get("direct"), modes.get("rebound")
        s = out.setdefault((driver, fault), {
            "trials": 0, "not_injected": 0, "direct_fail": 0, "rebound_fail": 0,
            "prevented": 0, "rebound_only_fail": 0, "recovered": 0,
            "direct": {c: 0 for c in CLASSES}, "rebound": {c: 0 for c in CLASSES}})
        if rb is None or rb["outcome"] == "not_injected" or \
                (d is not None and d["outcome"] == "not_injected"):
            s["not_injected"] += 1
            continue
        if rb["outcome"] == "not_applicable":  # corrupt in fast mode: nothing crosses rebound
            s["not_applicable"] = s.get("not_applicable", 0) + 1
            continue
        s["trials"] += 1
        rb_fail = rb["outcome"] in FAILURES
        s["rebound"][rb["outcome"]] += 1
        s["rebound_fail"] += rb_fail
        s["recovered"] += rb["outcome"] == "recovered"
        if d is not None and d["outcome"] != "not_applicable":
            s["direct"][d["outcome"]] += 1
            if d["outcome"] in FAILURES:
                s["direct_fail"] += 1
                s["prevented"] += not rb_fail
                # Nooks' split: the driver crashed or hung (fatal) or answered wrongly.
                kind = "fatal" if d["outcome"] in ("mount_lost", "hung") else "nonfatal"
                s[kind] = s.get(kind, 0) + 1
                s[kind + "_prevented"] = s.get(kind + "_prevented", 0) + (not rb_fail)
            elif rb_fail:
                s["rebound_only_fail"] += 1
    return out


def render(metas, rows, command, pngs=()):
    summ = summarize(rows)
    drivers = sorted({k[0] for k in summ}, key=lambda d: DRIVERS.index(d) if d in DRIVERS else 9)
    meta = metas[0] if metas else {}
    lines = ["# Fault injection: directly mounted drivers vs. rebound", "",
             "Nooks' experiment (Swift et al., TOCS 2005, section 4, Table II) on real FUSE "
             "drivers: each trial injects the same faults (same seed, same instructions of the "
             "same module files) once into the directly mounted driver and once into the driver "
             "under rebound, while a short workload verifies every byte it reads back. "
             "Outcome classes and the workload: see `bench/campaign.py`.", "",
             f"Regenerate: `{command}`", "",
             "Notes on method. Code faults (Nooks' Table II) go into the driver's own code "
             "(its executable and own libraries; not libc, libfuse, glib), 5 per trial, at "
             "random instructions, so many land in code the workload never runs (no effect), "
             "as in Nooks. `kill` sends SIGSEGV, SIGBUS, SIGABRT or SIGKILL; `hang` puts "
             "`jmp $` where the driver's threads wait for requests; `leak` maps and touches "
             f"{LEAK_MB} MiB that are never freed (no memory limit directly, so it harms nothing "
             "within a trial; under rebound the driver's cgroup has rebound's default limit, "
             "1024 MiB, and the leak is a failure to recover from); `corrupt` flips a bit of the header of the "
             "driver's next reply (and cuts its body short one time in four) inside rebound's "
             "channel, so it has no direct counterpart. Under rebound: restart at once, "
             "unlimited budget, a request unanswered for 2 s counts as a hang; fuse2fs with the "
             "redo log and `e2fsck -fy` before each restart. A failure is what the application "
             "or the data shows: mount lost (ENOTCONN), hung (no progress within "
             f"{HANG_S:.0f} s, or an unmount that hangs {STOP_S:.0f} s), corrupted (a byte read "
             "back differs, a wrong listing, or `e2fsck -fn` errors after the unmount), "
             "application error (any other errno).", "",
             f"Kernel {meta.get('kernel', '?')}, {meta.get('cpus', '?')} CPUs; "
             f"{meta.get('faults', '?')} faults per code-fault trial. Runs:", ""]
    for mt in metas:
        drv = mt.get("command", "").split("--drivers ")[-1].split(" ")[0]
        mine = [r for r in rows if r.get("driver") in drv.split(",")]
        busy = sum(r.get("seconds") or 0 for r in mine)
        lines.append(f"- {drv}: started {mt.get('started')}, commit {mt.get('commit')}, "
                     f"{len(mine)} runs (trial x mode), {busy / 60:.1f} min in trials")
    timed_out = sum("TimeoutExpired" in (r.get("stop_error") or "") for r in rows)
    lines += ["", f"{timed_out} runs' stop timed out (their driver or rebound did not exit "
              "within 30 s of the unmount); they count as hung.", ""]
    tot = {"direct_fail": 0, "prevented": 0, "trials": 0, "rebound_fail": 0,
           "rebound_only_fail": 0, "fatal": 0, "fatal_prevented": 0, "nonfatal": 0,
           "nonfatal_prevented": 0}
    for driver in drivers:
        lines += [f"## {driver}", "",
                  "| fault type | trials | direct failures | rebound failures | prevented "
                  "| rebound failed where direct did not | driver failed, recovered "
                  "transparently |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        dt = {k: 0 for k in tot}
        for fault in TYPES:
            s = summ.get((driver, fault))
            if not s:
                continue
            for k in dt:
                dt[k] += s.get(k, 0)
            direct = "n/a (no channel)" if fault == "corrupt" else str(s["direct_fail"])
            prevented = ("–" if fault == "corrupt" else
                         f"{s['prevented']}/{s['direct_fail']} "
                         f"({pct(s['prevented'], s['direct_fail'])})")
            extra = f" ({s['not_injected']} not injected)" if s["not_injected"] else ""
            lines.append(f"| {fault} | {s['trials']}{extra} | {direct} | {s['rebound_fail']} | "
                         f"{prevented} | {s['rebound_only_fail']} | {s['recovered']} |")
        for k in tot:
            tot[k] += dt[k]
        lines.append(f"| **all** | {dt['trials']} | {dt['direct_fail']} | {dt['rebound_fail']} "
                     f"| {dt['prevented']}/{dt['direct_fail']} "
                     f"({pct(dt['prevented'], dt['direct_fail'])}) | "
                     f"{dt['rebound_only_fail']} | |")
        lines += ["", "Outcomes by class (direct / rebound):", "",
                  "| fault type | " + " | ".join(CLASSES) + " |",
                  "|---|" + "---:|" * len(CLASSES)]
        for fault in TYPES:
            s = summ.get((driver, fault))
            if s:
                lines.append(f"| {fault} | " + " | ".join(
                    f"{'–' if fault == 'corrupt' else s['direct'][c]} / {s['rebound'][c]}"
                    for c in CLASSES) + " |")
        lines.append("")
    lines += ["## Against the goal", "",
              f"Goal: at least 99.5% of the trials in which the directly mounted driver fails "
              f"end with no application error and intact data under rebound. Measured: "
              f"**{tot['prevented']}/{tot['direct_fail']} "
              f"({pct(tot['prevented'], tot['direct_fail'])})** over {tot['trials']} trials; "
              f"{tot['rebound_only_fail']} trials failed under rebound but not directly.", "",
              "Split as Nooks did (fatal: the direct mount was lost or hung, i.e. the driver "
              "crashed or hung; non-fatal: the driver lived on but an operation failed or data "
              "came back wrong):", "",
              "| direct failures | trials | prevented under rebound | Nooks |",
              "|---|---:|---:|---|",
              f"| fatal (mount lost, hung) | {tot['fatal']} | {tot['fatal_prevented']} "
              f"({pct(tot['fatal_prevented'], tot['fatal'])}) | 313/317 crashes (99%) |",
              f"| non-fatal (error, corrupted) | {tot['nonfatal']} | "
              f"{tot['nonfatal_prevented']} ({pct(tot['nonfatal_prevented'], tot['nonfatal'])})"
              f" | 58.6% |", ""]
    bad = [r for r in map(normalize, rows)
           if r.get("mode") == "rebound" and r.get("outcome") in FAILURES]
    if bad:
        lines += why_table(bad)
        for r in bad[:40]:
            ev = "; ".join((r.get("errors") or []) + (r.get("mismatches") or []))[:200]
            if r.get("e2fsck"):
                ev += " e2fsck: " + r["e2fsck"].strip().splitlines()[-1][:100]
            lines.append(f"- {r['driver']} {r['fault']} seed {r['seed']}: **{r['outcome']}**"
                         f" (driver failures {r.get('driver_failures')}, last: "
                         f"{(r.get('last_failure') or '')[:120]}) {ev}")
        lines.append("")
    lat = [x for r in rows if r.get("mode") == "rebound" for x in r.get("recovery_ms") or []]
    if lat:
        lines += [f"Recovery latency under rebound (failure detected to first request served), "
                  f"{len(lat)} recoveries: median {percentile(lat, 50):.1f} ms, "
                  f"p99 {percentile(lat, 99):.1f} ms.", ""]
    for png, what in pngs:
        lines.append(f"![{what}]({png})")
    return "\n".join(lines) + "\n"


def why_table(bad):
    """Rebound's failures by driver and fault type, split by what rebound saw: nothing (the
    faulty driver stayed up and its wrong answers were well-formed, so every check passed
    them), or a driver failure it recovered from after wrong answers had already reached the
    application (or whose recovery itself failed)."""
    counts = {}
    for r in bad:
        seen = (r.get("driver_failures") or 0) > 0
        c = counts.setdefault((r["driver"], r["fault"]), [0, 0])
        c[seen] += 1
    lines = ["Why rebound failed, by driver and fault type: *unseen* = the driver never "
             "failed in rebound's eyes (it stayed up, answered in time, and its wrong answers "
             "were well-formed FUSE replies, so validation passed them); *too late* = rebound "
             "detected a failure and recovered, but before failing the driver had already sent "
             "wrong answers or written wrong data to its backing store "
             "(or its recovery failed).", "",
             "| driver | fault type | unseen | too late |", "|---|---|---:|---:|"]
    for (driver, fault), (unseen, late) in sorted(
            counts.items(), key=lambda kv: (kv[0][0], TYPES.index(kv[0][1]))):
        lines.append(f"| {driver} | {fault} | {unseen} | {late} |")
    return lines + ["", "Examples (driver, fault, seed: outcome, evidence):", ""]


def plot(rows, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    summ = summarize(rows)
    drivers = sorted({k[0] for k in summ}, key=lambda d: DRIVERS.index(d) if d in DRIVERS else 9)
    fig, axes = plt.subplots(len(drivers), 1, figsize=(9, 2.8 * len(drivers)), squeeze=False)
    for ax, driver in zip(axes[:, 0], drivers):
        faults = [f for f in TYPES if (driver, f) in summ]
        xs = range(len(faults))
        d = [summ[(driver, f)]["direct_fail"] for f in faults]
        r = [summ[(driver, f)]["rebound_fail"] for f in faults]
        ax.bar([x - 0.2 for x in xs], d, 0.4, label="direct: failures", color="#c44")
        ax.bar([x + 0.2 for x in xs], r, 0.4, label="rebound: failures", color="#48c")
        ax.set_xticks(list(xs), faults, rotation=25)
        ax.set_ylabel("trials")
        ax.set_title(driver)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0, 0].legend()
    fig.tight_layout()
    fig.savefig(out / "campaign-latest-failures.png", dpi=100)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    latency_cdf(ax, [(driver, [x for r in rows
                               if r["driver"] == driver and r.get("mode") == "rebound"
                               for x in r.get("recovery_ms") or []]) for driver in drivers],
                "rebound: recovery latency in the fault-injection campaign")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "campaign-latest-latency.png", dpi=100)


def plot_somehow(paths, out):
    """With this python's matplotlib, or the system python's (as bench/recovery.py does)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        system = "/usr/bin/python3"
        if (os.path.realpath(sys.executable) == os.path.realpath(system)
                or not os.path.exists(system)):
            print("campaign: no matplotlib; no charts", file=sys.stderr)
            return False
        res = subprocess.run([system, __file__, "--plot", str(out)] + [str(p) for p in paths])
        return res.returncode == 0
    plot(load(paths)[1], out)
    return True


def write_report(paths, out, command):
    metas, rows = load(paths)
    plotted = plot_somehow(paths, out)
    pngs = [("campaign-latest-failures.png", "failures by fault type, direct vs rebound"),
            ("campaign-latest-latency.png", "CDF of recovery latency")] if plotted else []
    md = render(metas, rows, command, pngs)
    (out / "campaign-latest.md").write_text(md)
    return md


# --- the campaign -----------------------------------------------------------------------------


class Progress:
    def __init__(self, total):
        self.total, self.done, self.t0 = total, 0, time.monotonic()

    def show(self, what):
        el = time.monotonic() - self.t0
        eta = el / self.done * (self.total - self.done) if self.done else 0
        width = 30
        fill = width * self.done // max(1, self.total)

        def hms(s):
            return f"{int(s) // 3600}:{int(s) % 3600 // 60:02d}:{int(s) % 60:02d}"

        sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                         f"elapsed {hms(el)} ETA {hms(eta)}  {what:<40.40}")
        sys.stderr.flush()


def trial_seed(base, driver, fault, i):
    return zlib.crc32(f"{base}/{driver}/{fault}/{i}".encode()) * 1000 + i


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drivers", default="fuse2fs,passthrough_ll,sshfs")
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--per-type", type=int, default=50, help="trials per fault type and driver")
    p.add_argument("--per-type-other", type=int, default=None,
                   help="trials per driver for kill, hang, leak, corrupt (default: --per-type)")
    p.add_argument("--faults", type=int, default=5, help="code faults injected per trial")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rebound-mode", choices=("auto", "fast", "guarded"),
                   help="rebound's data path in its runs (default: rebound's own default); "
                        "corrupt is not_applicable in fast mode")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    p.add_argument("--jsonl", help="write the results here (default: OUT/campaign-TIME.jsonl)")
    p.add_argument("--no-report", action="store_true", help="only the JSON lines")
    p.add_argument("--command", help=argparse.SUPPRESS)  # the regenerate command to print
    p.add_argument("--report", nargs="+", metavar="JSONL",
                   help="only render the report (and charts) of earlier result files")
    p.add_argument("--workload", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--plot", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.workload:
        workload(args.workload[0], int(args.workload[1]), int(args.workload[2]))
        return
    if args.plot:
        plot(load(args.plot[1:])[1], Path(args.plot[0]))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report:
        print(write_report(args.report, out, args.command
                           or "bench/campaign.py --report " + " ".join(args.report)))
        return
    global REBOUND_MODE
    REBOUND_MODE = args.rebound_mode
    drivers, types = args.drivers.split(","), args.types.split(",")
    bad = [d for d in drivers if d not in DRIVERS] + [t for t in types if t not in TYPES]
    if bad:
        sys.exit(f"campaign: unknown driver(s)/type(s) {bad}")
    if os.geteuid() != 0:
        sys.exit("campaign: mounts file systems and uses ptrace; run it as root")
    run_dir = mounts.new_workdir("campaign-run")
    os.environ["REBOUND_RUN_DIR"] = str(run_dir)
    os.environ.setdefault("REBOUND_BIN", str(REBOUND))
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    # scripts/campaign.sh names the commit its snapshot of the binary was built from.
    commit = os.environ.get("REBOUND_COMMIT") or subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
        capture_output=True, text=True).stdout.strip()
    command = " ".join(["bench/campaign.py"] + sys.argv[1:])
    meta = {"started": started, "commit": commit, "machine": platform.machine(),
            "kernel": platform.release(), "cpus": os.cpu_count(), "faults": args.faults,
            "per_type": args.per_type, "per_type_other": args.per_type_other, "seed": args.seed,
            "rebound_mode": args.rebound_mode, "command": command}
    path = Path(args.jsonl) if args.jsonl else out / f"campaign-{started.replace(':', '')}.jsonl"
    other = args.per_type if args.per_type_other is None else args.per_type_other
    plan = [(d, t, i) for d in drivers for t in types
            for i in range(other if t in OTHER_TYPES else args.per_type)]
    # Interleaved, so that a campaign cut short still has every type.
    plan.sort(key=lambda x: (x[0], x[2], types.index(x[1])))
    progress = Progress(len(plan))
    sshd = mounts.start_sshd() if "sshfs" in drivers else None
    try:
        with open(path, "w") as sink:
            sink.write(json.dumps({"meta": meta}) + "\n")
            for driver, fault, i in plan:
                seed = trial_seed(args.seed, driver, fault, i)
                progress.show(f"{driver} {fault} #{i}")
                for mode in ("direct", "rebound"):
                    row = run_mode(driver, mode, fault, seed, args.faults, sshd)
                    row["trial"] = i
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                progress.done += 1
                progress.show(f"{driver} {fault} #{i}")
    finally:
        sys.stderr.write("\n")
        if sshd is not None:
            sshd.stop()
        mounts.remove_workdir(run_dir)
    if args.no_report:
        print(f"results: {path}")
        return
    md = write_report([path], out, args.command or command)
    print(md)
    print(f"results: {path}, {out / 'campaign-latest.md'}")


if __name__ == "__main__":
    main()
