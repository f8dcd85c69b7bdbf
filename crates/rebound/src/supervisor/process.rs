//! The driver's process tree, seen from rebound as child subreaper.
//!
//! Drivers daemonize (fork, parent exits) and start helpers (`ssh`, `fusermount3`). rebound
//! is a child subreaper, so every orphan of the tree becomes its child and nothing escapes
//! supervision. rebound starts no other long-lived processes, so "rebound's descendants" is
//! exactly the driver's tree, and a standby successor's (`standby.rs`), which the callers
//! that must spare it name.
//!
//! Owns: reaping, listing descendants, signalling them, and reading their state in `/proc`
//! (parents, groups, whether they are dying). Must not: decide when to do so.

use std::collections::{HashMap, HashSet};

use rustix::process::{Pid, Signal, WaitOptions, WaitStatus};

/// How a process ended, in the shell's terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    Code(i32),
    Signal(i32),
}

impl Exit {
    fn from_status(status: WaitStatus) -> Exit {
        if let Some(code) = status.exit_status() {
            Exit::Code(code)
        } else if let Some(sig) = status.terminating_signal() {
            Exit::Signal(sig)
        } else {
            Exit::Code(1)
        }
    }

    /// The exit code a shell would report for this ending.
    pub fn shell_code(self) -> i32 {
        match self {
            Exit::Code(code) => code,
            Exit::Signal(sig) => 128 + sig,
        }
    }
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Exit::Code(code) => write!(f, "exit status {code}"),
            Exit::Signal(sig) => write!(f, "signal {sig}"),
        }
    }
}

/// Reaps every exited child without blocking. Returns `(pid, how it ended)` for each.
pub fn reap_all() -> Vec<(i32, Exit)> {
    let mut reaped = Vec::new();
    while let Ok(Some((pid, status))) = rustix::process::wait(WaitOptions::NOHANG) {
        reaped.push((pid.as_raw_nonzero().get(), Exit::from_status(status)));
    }
    reaped
}

/// Whether rebound still has any child process (running or not yet reaped).
pub fn has_children() -> bool {
    rustix::process::waitid(
        rustix::process::WaitId::All,
        rustix::process::WaitIdOptions::EXITED
            | rustix::process::WaitIdOptions::NOHANG
            | rustix::process::WaitIdOptions::NOWAIT,
    )
    .is_ok()
}

/// The direct children of this process (running or not yet reaped), from each thread's
/// `children` file: far cheaper than a walk of `/proc`.
pub fn children() -> Vec<i32> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for task in tasks.flatten() {
        if let Ok(list) = std::fs::read_to_string(task.path().join("children")) {
            out.extend(
                list.split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok()),
            );
        }
    }
    out
}

/// Every live descendant of this process, parents before children.
pub fn descendants() -> Vec<i32> {
    descendants_except(&[])
}

/// Every live descendant of this process but those in `spare` and their own descendants,
/// parents before children.
pub fn descendants_except(spare: &[i32]) -> Vec<i32> {
    below(std::process::id() as i32, spare)
}

/// `root` and its live descendants (a standby's process tree).
pub fn tree_of(root: i32) -> Vec<i32> {
    let mut out = below(root, &[]);
    out.insert(0, root);
    out
}

/// The live descendants of `root` but those in `spare` and their own, parents before children,
/// from one walk of `/proc`.
fn below(root: i32, spare: &[i32]) -> Vec<i32> {
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        if let Some(ppid) = parent_of(pid) {
            children.entry(ppid).or_default().push(pid);
        }
    }
    let mut out = Vec::new();
    let mut queue = vec![root];
    while let Some(pid) = queue.pop() {
        if let Some(kids) = children.get(&pid) {
            let kids = kids.iter().copied().filter(|k| !spare.contains(k));
            out.extend(kids.clone());
            queue.extend(kids);
        }
    }
    out
}

/// How far the processes `pids` have got: a sum that grows with their CPU time (clock ticks,
/// every thread) and the bytes their system calls read and wrote (a slow upload uses little
/// CPU), and whether a thread of theirs is running or waiting on a device (state `R` or `D`).
pub fn activity(pids: &[i32]) -> (u64, bool) {
    let mut progress = 0u64;
    let mut busy = false;
    for pid in pids {
        let stat = format!("/proc/{pid}/stat");
        let ticks = |n| stat_field::<u64>(&stat, n).unwrap_or(0);
        let io = std::fs::read_to_string(format!("/proc/{pid}/io")).unwrap_or_default();
        let bytes = io
            .lines()
            .filter(|l| l.starts_with("rchar:") || l.starts_with("wchar:"))
            .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok());
        progress = bytes.fold(
            progress.wrapping_add(ticks(11) + ticks(12)),
            u64::wrapping_add,
        );
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        busy |= tasks.flatten().any(|task| {
            let state: Option<String> = stat_field(&format!("{}/stat", task.path().display()), 0);
            matches!(state.as_deref(), Some("R" | "D"))
        });
    }
    (progress, busy)
}

/// Field `n` (0: the state) after the parenthesised command name of a `stat` file of
/// `/proc` (a process's or a thread's), which may itself contain spaces and parentheses.
fn stat_field<T: std::str::FromStr>(stat_file: &str, n: usize) -> Option<T> {
    let stat = std::fs::read_to_string(stat_file).ok()?;
    let after_comm = &stat[stat.rfind(')')? + 1..];
    after_comm.split_whitespace().nth(n)?.parse().ok()
}

fn parent_of(pid: i32) -> Option<i32> {
    stat_field(&format!("/proc/{pid}/stat"), 1)
}

/// The process group of `pid`.
pub fn process_group_of(pid: i32) -> Option<i32> {
    stat_field(&format!("/proc/{pid}/stat"), 2)
}

/// `PF_EXITING` in a task's flags (field 6 after the command name): the task is in `exit(2)`.
const PF_EXITING: u32 = 0x4;

/// The threads of rebound's descendants that are dying (see [`dying`]).
pub fn dying_threads() -> HashSet<u32> {
    let mut found = HashSet::new();
    for pid in descendants() {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for tid in tasks
            .flatten()
            .filter_map(|t| t.file_name().to_str()?.parse().ok())
        {
            if dying(&format!("/proc/{pid}/task/{tid}")) {
                found.insert(tid);
            }
        }
    }
    found
}

/// Whether the driver has processes (rebound's descendants but those in `spare`, a standby's)
/// and every one of them is dying (see [`dying`]).
pub fn all_dying(spare: &[i32]) -> bool {
    let processes = descendants_except(spare);
    !processes.is_empty() && processes.iter().all(|pid| dying(&format!("/proc/{pid}")))
}

/// Whether process `pid` runs on: it exists, has not exited, and is not dying.
pub fn runs_on(pid: i32) -> bool {
    let task = format!("/proc/{pid}");
    let state: Option<String> = stat_field(&format!("{task}/stat"), 0);
    matches!(state.as_deref(), Some(s) if s != "Z" && s != "X") && !dying(&task)
}

/// Whether the task at `/proc` path `task` is dying: in `exit(2)`, or with a SIGKILL pending
/// (which a process dying of any signal sends each of its threads) that it has not yet acted
/// on, because it waits in a system call only an answer ends.
fn dying(task: &str) -> bool {
    let flags: Option<u32> = stat_field(&format!("{task}/stat"), 6);
    flags.is_some_and(|f| f & PF_EXITING != 0) || kill_pending(task)
}

/// Whether SIGKILL is pending for the task at `/proc` path `task`, to it or to its process.
fn kill_pending(task: &str) -> bool {
    let sigkill = 1u64 << (libc::SIGKILL - 1);
    std::fs::read_to_string(format!("{task}/status")).is_ok_and(|status| {
        status
            .lines()
            .filter_map(|l| {
                l.strip_prefix("SigPnd:")
                    .or_else(|| l.strip_prefix("ShdPnd:"))
            })
            .any(|mask| u64::from_str_radix(mask.trim(), 16).is_ok_and(|m| m & sigkill != 0))
    })
}

/// The process (thread-group leader) of thread `tid` (`Tgid:` in its status).
pub fn thread_group_of(tid: i32) -> Option<i32> {
    std::fs::read_to_string(format!("/proc/{tid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Sends `signal` to every live descendant but those in `spare` and their descendants.
pub fn signal_all(signal: Signal, spare: &[i32]) {
    for pid in descendants_except(spare) {
        if let Some(pid) = Pid::from_raw(pid) {
            let _ = rustix::process::kill_process(pid, signal);
        }
    }
}

/// Whether `pid` is a mount helper (`fusermount`, `fusermount3`).
pub fn is_mount_helper(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .is_ok_and(|name| name.starts_with("fusermount"))
}

/// How many files process `pid` has open: the size the kernel gives its `/proc/PID/fd`
/// (Linux 6.2+, a count of its descriptor bitmap), or, where that is 0, a listing of it. A
/// passthrough driver holds a descriptor per node it knows, and listing thousands of them
/// each second was most of rebound's main thread's CPU.
pub fn open_files(pid: i32) -> u64 {
    let dir = format!("/proc/{pid}/fd");
    match std::fs::metadata(&dir) {
        Ok(m) if m.len() > 0 => m.len(),
        Ok(_) => std::fs::read_dir(&dir).map_or(0, |d| d.count() as u64),
        Err(_) => 0,
    }
}

/// Whether process `pid` has the file `(device, inode)` open.
pub fn has_open(pid: i32, (dev, ino): (u64, u64)) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .any(|fd| std::fs::metadata(fd.path()).is_ok_and(|m| m.dev() == dev && m.ino() == ino))
}

/// The descendant that serves the mount, of those holding a descriptor on the channel (the
/// socket with inode `inode`, or with `inode` 0, in fast mode, `/dev/fuse`: the driver's clone
/// of the connection), of the descendants but those in `spare` (a standby successor holds a
/// `/dev/fuse` of its own while it waits at its `mount(2)`). A driver's forks hold it too: lxcfs reads containers' figures
/// in short-lived children, a helper (`fusermount3`) holds it while it hands it over, and a
/// daemonizing driver holds it in parent and child for a moment. The serving one is the
/// deepest with a thread waiting to read the channel; when none waits (all busy), the
/// deepest that leads its session (rebound starts each driver in a session of its own, and a
/// daemon calls `setsid`), else the shallowest.
pub fn holder_of_channel(inode: u64, spare: &[i32]) -> Option<ChannelHolder> {
    let needle = match inode {
        0 => "/dev/fuse".to_string(),
        _ => format!("socket:[{inode}]"),
    };
    let holders: Vec<(i32, Vec<u64>)> = descendants_except(spare)
        .into_iter()
        .filter(|&pid| !is_mount_helper(pid))
        .filter_map(|pid| {
            let fds: Vec<u64> = std::fs::read_dir(format!("/proc/{pid}/fd"))
                .into_iter()
                .flatten()
                .flatten()
                .filter(|fd| {
                    std::fs::read_link(fd.path())
                        .is_ok_and(|target| target.as_os_str() == needle.as_str())
                })
                .filter_map(|fd| fd.file_name().to_str()?.parse().ok())
                .collect();
            (!fds.is_empty()).then_some((pid, fds))
        })
        .collect();
    let leads_session = |pid: i32| stat_field(&format!("/proc/{pid}/stat"), 3) == Some(pid);
    let reading = holders
        .iter()
        .rev()
        .find(|(pid, fds)| reads_one_of(*pid, fds));
    let leader = || holders.iter().rev().find(|(pid, _)| leads_session(*pid));
    let holder =
        |reading: bool| move |(pid, _): &(i32, Vec<u64>)| ChannelHolder { pid: *pid, reading };
    reading
        .map(holder(true))
        .or_else(|| leader().or(holders.first()).map(holder(false)))
}

/// The process `holder_of_channel` names, and whether it was seen waiting to read the channel
/// (else it was a guess: a daemonizing driver's parent, say, which leads its session until it
/// exits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelHolder {
    pub pid: i32,
    pub reading: bool,
}

/// Whether a thread of `pid` waits in a read of one of the descriptors `fds`
/// (`/proc/PID/task/TID/syscall`: the call's number and its first argument).
fn reads_one_of(pid: i32, fds: &[u64]) -> bool {
    const READS: [i64; 6] = [
        libc::SYS_read,
        libc::SYS_splice,
        libc::SYS_readv,
        libc::SYS_recvfrom,
        libc::SYS_recvmsg,
        libc::SYS_recvmmsg,
    ];
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .any(|task| {
            let Ok(call) = std::fs::read_to_string(task.path().join("syscall")) else {
                return false;
            };
            let mut words = call.split_whitespace();
            let number = words.next().and_then(|n| n.parse::<i64>().ok());
            let fd = words
                .next()
                .and_then(|a| u64::from_str_radix(a.trim_start_matches("0x"), 16).ok());
            matches!((number, fd), (Some(n), Some(fd)) if READS.contains(&n) && fds.contains(&fd))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    fn listed(pid: i32) -> u64 {
        std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64)
    }

    #[test]
    fn open_files_counts_what_a_listing_counts() {
        // A child whose descriptors nothing else changes (this process's other tests open
        // files in parallel): 0-2 and 3-9 once its shell has run the redirections and become
        // `sleep` (a POSIX shell names single digits only), with what it inherits besides.
        let redirections: String = (3..10).map(|fd| format!("{fd}</dev/null ")).collect();
        let mut child = Command::new("sh")
            .args(["-c", &format!("exec {redirections}; exec sleep 30")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap() != "sleep\n" {
            assert!(Instant::now() < deadline, "the child never became `sleep`");
            std::thread::sleep(Duration::from_millis(10));
        }
        let (counted, listing) = (open_files(pid), listed(pid));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(listing >= 10, "{listing}");
        assert_eq!(counted, listing);
        assert_eq!(open_files(pid), 0, "a reaped process has none");
    }
}
