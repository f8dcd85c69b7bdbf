//! The driver's system calls on other processes — signals, `pidfd_open`, `prlimit64`,
//! scheduling and priorities — which the seccomp filter reports when they name a pid other
//! than the caller's own (see `rebound_sys::seccomp`). The driver runs as uid 0: without this,
//! the kernel would let it signal, renice or limit every root process on the host.
//!
//! Owns: finding the processes a call reaches, and the verdict: it runs only if every one of
//! them is the driver's. Must not: act on the processes.
//!
//! Between the verdict and the call there is a window in which a target could exit and its
//! pid be reused by another process; the driver cannot choose which process gets the pid.

use rebound_sys::seccomp::Notification;

use crate::supervisor::process;
use rustix::io::Errno;

/// What becomes of one reported call.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// It reaches only the driver's processes: the kernel carries it out.
    Continue,
    /// It fails with this error, untried.
    Fail(Errno),
}

const PRIO_PROCESS: u64 = 0;
const PRIO_PGRP: u64 = 1;
const IOPRIO_WHO_PROCESS: u64 = 1;
const IOPRIO_WHO_PGRP: u64 = 2;

/// The verdict on `notif`, where `is_driver(tgid)` says whether a process is the driver's.
pub fn verdict(notif: &Notification, is_driver: impl Fn(i32) -> bool) -> Verdict {
    let nr = i64::from(notif.data.nr);
    let args = notif.data.args;
    // pid_t arguments are ints: the low 32 bits, sign included.
    let pid_arg = |i: usize| args[i] as i32;
    let targets = match nr {
        libc::SYS_kill => match pid_arg(0) {
            0 => Ok(Vec::new()),
            -1 => Err(Errno::PERM),
            pid if pid > 0 => thread_group_of(pid).map(|tgid| vec![tgid]),
            group => group_members(group.wrapping_neg()),
        },
        libc::SYS_setpriority | libc::SYS_ioprio_set => {
            let (process, group) = if nr == libc::SYS_setpriority {
                (PRIO_PROCESS, PRIO_PGRP)
            } else {
                (IOPRIO_WHO_PROCESS, IOPRIO_WHO_PGRP)
            };
            match (args[0], pid_arg(1)) {
                (which, 0) if which == process || which == group => Ok(Vec::new()),
                (which, pid) if which == process => thread_group_of(pid).map(|tgid| vec![tgid]),
                (which, pgid) if which == group => group_members(pgid),
                // A user's processes: the driver's uid is root's.
                _ => Err(Errno::PERM),
            }
        }
        libc::SYS_pidfd_send_signal => pidfd_target(notif.pid, pid_arg(0)).map(|pid| vec![pid]),
        // The rest name one process or thread, 0 meaning the caller.
        _ => match pid_arg(0) {
            0 => Ok(Vec::new()),
            pid => thread_group_of(pid).map(|tgid| vec![tgid]),
        },
    };
    match targets {
        Ok(targets) => match targets.iter().find(|&&tgid| !is_driver(tgid)) {
            None => Verdict::Continue,
            Some(other) => {
                tracing::warn!(
                    "refused: the driver (pid {}) made system call {nr} on pid {other}, which \
                     is not one of its processes",
                    notif.pid
                );
                Verdict::Fail(Errno::PERM)
            }
        },
        Err(errno) => Verdict::Fail(errno),
    }
}

/// The process (thread-group leader) of thread `tid`; `ESRCH` if there is none.
fn thread_group_of(tid: i32) -> Result<i32, Errno> {
    process::thread_group_of(tid).ok_or(Errno::SRCH)
}

/// The processes of process group `pgid`; `ESRCH` if there are none.
fn group_members(pgid: i32) -> Result<Vec<i32>, Errno> {
    let dir = std::fs::read_dir("/proc").map_err(|_| Errno::SRCH)?;
    let members: Vec<i32> = dir
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| process::process_group_of(pid) == Some(pgid))
        .collect();
    if members.is_empty() {
        return Err(Errno::SRCH);
    }
    Ok(members)
}

/// The process that descriptor `fd` of thread `caller` refers to, if it is a pidfd
/// (`Pid:` in its fdinfo, in rebound's pid namespace). A `/proc/PID` directory, which
/// `pidfd_send_signal` also takes, is refused: its process cannot be told reliably from here.
fn pidfd_target(caller: u32, fd: i32) -> Result<i32, Errno> {
    let info =
        std::fs::read_to_string(format!("/proc/{caller}/fdinfo/{fd}")).map_err(|_| Errno::BADF)?;
    let pid: i32 = info
        .lines()
        .find_map(|l| l.strip_prefix("Pid:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or(Errno::PERM)?;
    // -1: the process has exited.
    if pid <= 0 {
        return Err(Errno::SRCH);
    }
    Ok(pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(nr: i64, args: [u64; 6]) -> Notification {
        Notification {
            pid: std::process::id(),
            data: rebound_sys::seccomp::SeccompData {
                nr: nr as i32,
                args,
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn only_the_drivers_processes_may_be_reached() {
        let me = std::process::id() as i32;
        let mine = |tgid: i32| tgid == me;
        let nobody = |_: i32| false;
        let kill = |pid: i32| call(libc::SYS_kill, [pid as u32 as u64, 0, 0, 0, 0, 0]);
        assert_eq!(verdict(&kill(me), mine), Verdict::Continue);
        assert_eq!(verdict(&kill(me), nobody), Verdict::Fail(Errno::PERM));
        assert_eq!(verdict(&kill(0), nobody), Verdict::Continue);
        assert_eq!(verdict(&kill(-1), mine), Verdict::Fail(Errno::PERM));
        // Our process group has us in it, and maybe others (the test harness).
        let group = rustix::process::getpgrp().as_raw_nonzero().get();
        assert_eq!(verdict(&kill(-group), nobody), Verdict::Fail(Errno::PERM));
        // A pid that does not exist: ESRCH, as the kernel would say.
        assert_eq!(verdict(&kill(i32::MAX), mine), Verdict::Fail(Errno::SRCH));
        // A thread of ours counts as us.
        let tid = rustix::thread::gettid().as_raw_nonzero().get();
        let tgkill = call(libc::SYS_tgkill, [tid as u64, tid as u64, 0, 0, 0, 0]);
        assert_eq!(verdict(&tgkill, mine), Verdict::Continue);
        // Priorities of a user's processes: never.
        let by_user = call(libc::SYS_setpriority, [2, 0, 19, 0, 0, 0]);
        assert_eq!(verdict(&by_user, mine), Verdict::Fail(Errno::PERM));
        let own = call(libc::SYS_setpriority, [PRIO_PROCESS, me as u64, 0, 0, 0, 0]);
        assert_eq!(verdict(&own, mine), Verdict::Continue);
    }

    #[test]
    fn a_pidfd_names_its_process() {
        let me = std::process::id() as i32;
        let pidfd = rustix::process::pidfd_open(
            rustix::process::Pid::from_raw(me).unwrap(),
            rustix::process::PidfdFlags::empty(),
        )
        .unwrap();
        use std::os::fd::AsRawFd;
        let fd = pidfd.as_raw_fd() as u64;
        let send = call(libc::SYS_pidfd_send_signal, [fd, 0, 0, 0, 0, 0]);
        assert_eq!(verdict(&send, |tgid| tgid == me), Verdict::Continue);
        assert_eq!(verdict(&send, |_| false), Verdict::Fail(Errno::PERM));
        // Not a pidfd.
        let stdin = call(libc::SYS_pidfd_send_signal, [0, 0, 0, 0, 0, 0]);
        assert!(matches!(verdict(&stdin, |_| true), Verdict::Fail(_)));
    }
}
