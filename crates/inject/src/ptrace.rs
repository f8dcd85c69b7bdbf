//! Stopping every thread of a live process with ptrace, reading and writing its memory, and
//! making one of its threads run a system call.
//!
//! Owns: `PTRACE_SEIZE` + `PTRACE_INTERRUPT` of all threads (threads born meanwhile included),
//! memory access through `/proc/PID/mem` (which writes read-only text pages, as a debugger
//! does), syscall injection, and detaching cleanly (pending signals handed back) when dropped.
//! Must not: decide what to write. All of it goes through `nix`'s safe wrappers, so this
//! module needs no `unsafe`.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use nix::errno::Errno;
use nix::sys::ptrace;
use nix::sys::signal::Signal;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

/// How long to wait for a thread to stop (one in uninterruptible sleep may not, for a while;
/// the memory writes do not need it to).
const STOP_WAIT: Duration = Duration::from_secs(2);

/// A process whose threads are all attached (and stopped, those that could be in time).
pub struct Stopped {
    pid: i32,
    /// Attached threads: whether they are in a stop, and a signal to hand back on detach.
    threads: HashMap<i32, (bool, Option<Signal>)>,
    mem: File,
}

fn tasks(pid: i32) -> anyhow::Result<Vec<i32>> {
    let mut out: Vec<i32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .with_context(|| format!("process {pid}"))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    out.sort_unstable();
    Ok(out)
}

impl Stopped {
    pub fn attach(pid: i32) -> anyhow::Result<Stopped> {
        let mem = File::options()
            .read(true)
            .write(true)
            .open(format!("/proc/{pid}/mem"))
            .with_context(|| format!("opening /proc/{pid}/mem"))?;
        let mut me = Stopped {
            pid,
            threads: HashMap::new(),
            mem,
        };
        // Until a pass finds no thread it has not attached: a thread may clone another.
        loop {
            let new: Vec<i32> = tasks(pid)?
                .into_iter()
                .filter(|t| !me.threads.contains_key(t))
                .collect();
            if new.is_empty() {
                break;
            }
            for tid in new {
                match ptrace::seize(Pid::from_raw(tid), ptrace::Options::empty()) {
                    Ok(()) => {}
                    Err(Errno::ESRCH) => continue,
                    Err(e) => bail!("PTRACE_SEIZE of thread {tid} of process {pid}: {e}"),
                }
                me.threads.insert(tid, (false, None));
                let _ = ptrace::interrupt(Pid::from_raw(tid));
            }
        }
        if me.threads.is_empty() {
            bail!("process {pid} has no thread left to attach");
        }
        me.wait_stops();
        Ok(me)
    }

    /// Collects the stops the interrupts caused, for [`STOP_WAIT`] at most.
    fn wait_stops(&mut self) {
        let deadline = Instant::now() + STOP_WAIT;
        while self.threads.values().any(|t| !t.0) && Instant::now() < deadline {
            let mut progress = false;
            let tids: Vec<i32> = self.threads.keys().copied().collect();
            for tid in tids {
                if self.threads[&tid].0 {
                    continue;
                }
                match waitpid(
                    Pid::from_raw(tid),
                    Some(WaitPidFlag::__WALL | WaitPidFlag::WNOHANG),
                ) {
                    Ok(WaitStatus::PtraceEvent(..)) => {
                        self.threads.insert(tid, (true, None));
                        progress = true;
                    }
                    // A signal-delivery stop: stopped too; the signal goes back on detach.
                    Ok(WaitStatus::Stopped(_, sig)) => {
                        self.threads.insert(tid, (true, Some(sig)));
                        progress = true;
                    }
                    Ok(WaitStatus::Exited(..) | WaitStatus::Signaled(..)) | Err(_) => {
                        self.threads.remove(&tid);
                        progress = true;
                    }
                    Ok(_) => {}
                }
            }
            if !progress {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// The attached threads that are in a stop.
    pub fn stopped_threads(&self) -> Vec<i32> {
        let mut out: Vec<i32> = self
            .threads
            .iter()
            .filter(|(_, t)| t.0)
            .map(|(&tid, _)| tid)
            .collect();
        out.sort_unstable();
        out
    }

    pub fn read(&self, addr: u64, len: usize) -> anyhow::Result<Vec<u8>> {
        let mut buf = vec![0; len];
        self.mem
            .read_exact_at(&mut buf, addr)
            .with_context(|| format!("reading {len} bytes at {addr:#x}"))?;
        Ok(buf)
    }

    pub fn write(&self, addr: u64, bytes: &[u8]) -> anyhow::Result<()> {
        self.mem
            .write_all_at(bytes, addr)
            .with_context(|| format!("writing {} bytes at {addr:#x}", bytes.len()))
    }

    pub fn regs(&self, tid: i32) -> anyhow::Result<libc::user_regs_struct> {
        ptrace::getregs(Pid::from_raw(tid)).with_context(|| format!("registers of thread {tid}"))
    }

    /// Makes stopped thread `tid` execute system call `nr` with `args` where it stands, and
    /// puts it back as it was (registers, code, and a system call it was interrupted in, which
    /// restarts). Returns the call's result (negative errno on failure).
    pub fn syscall(&mut self, tid: i32, nr: u64, args: [u64; 6]) -> anyhow::Result<i64> {
        let pid = Pid::from_raw(tid);
        let saved = self.regs(tid)?;
        let at = saved.rip;
        let code = self.read(at, 2)?;
        self.write(at, &[0x0f, 0x05])?;
        let mut r = saved;
        (r.rax, r.rdi, r.rsi, r.rdx, r.r10, r.r8, r.r9) =
            (nr, args[0], args[1], args[2], args[3], args[4], args[5]);
        // No system call to restart on the way out of this stop.
        r.orig_rax = u64::MAX;
        let result = (|| {
            ptrace::setregs(pid, r)?;
            ptrace::step(pid, None)?;
            loop {
                match waitpid(pid, Some(WaitPidFlag::__WALL | WaitPidFlag::WNOHANG))? {
                    // A thread killed while traced (the OOM killer of its cgroup, a restart)
                    // may never report another stop: its process is gone for this purpose.
                    WaitStatus::StillAlive if being_killed(tid) => return Err(Errno::ESRCH),
                    WaitStatus::StillAlive => std::thread::sleep(Duration::from_millis(1)),
                    WaitStatus::Stopped(_, Signal::SIGTRAP) => break,
                    // Another signal arrived first: keep it for detach, go on stepping.
                    WaitStatus::Stopped(_, sig) => {
                        if let Some(t) = self.threads.get_mut(&tid) {
                            t.1 = Some(sig);
                        }
                        ptrace::step(pid, None)?;
                    }
                    WaitStatus::Exited(..) | WaitStatus::Signaled(..) => {
                        return Err(Errno::ESRCH);
                    }
                    _ => ptrace::step(pid, None)?,
                }
            }
            Ok(ptrace::getregs(pid)?.rax as i64)
        })();
        if result != Err(Errno::ESRCH) {
            self.write(at, &code)?;
            ptrace::setregs(pid, saved).with_context(|| format!("restoring thread {tid}"))?;
        }
        result.with_context(|| format!("system call {nr} in thread {tid}"))
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        for (&tid, &(stopped, sig)) in &self.threads {
            if stopped {
                let _ = ptrace::detach(Pid::from_raw(tid), sig);
            }
            // A thread not stopped yet is detached by the kernel when this process exits
            // (`rebound inject` exits right after).
        }
    }
}

/// Whether thread `tid` is gone or has SIGKILL pending (its own or its process's).
fn being_killed(tid: i32) -> bool {
    const SIGKILL_BIT: u64 = 1 << (libc::SIGKILL - 1);
    let Ok(status) = std::fs::read_to_string(format!("/proc/{tid}/status")) else {
        return true;
    };
    status.lines().any(|line| {
        let pending = line
            .strip_prefix("SigPnd:")
            .or_else(|| line.strip_prefix("ShdPnd:"));
        pending
            .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
            .is_some_and(|mask| mask & SIGKILL_BIT != 0)
    }) || status
        .lines()
        .any(|l| l.starts_with("State:") && (l.contains('Z') || l.contains('X')))
}
