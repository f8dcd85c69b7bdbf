//! Seccomp user notification (`SECCOMP_RET_USER_NOTIF`, Linux 5.0+; `ADDFD` 5.9+).
//!
//! The filter hands `mount(2)`, `umount2(2)`, `ioctl(FUSE_DEV_IOC_CLONE)` and offset-less
//! `splice(2)` of the driver's whole process tree to rebound, which performs them itself (or
//! lets them continue) and answers in the driver's place. A driver on rebound's channel may
//! not make a pipe larger than 1 MiB (`EPERM`, as the host's default limit answers it): libfuse
//! 3 then reads the channel with `read(2)`, where a splice would be a copy more and a report
//! to rebound per request. `fsopen(2)` fails with
//! `ENOSYS` so that libraries fall back to `mount(2)`, and the system calls of a deny list
//! (chosen by the caller) go to rebound too, which fails them with `EPERM` and says which
//! setting would allow them (a denied call is rare: the round trip costs nothing that
//! counts). Calls that act on another process by its pid (signals, `pidfd_open`,
//! `prlimit64`, scheduling and priorities) go to rebound too, which
//! lets through only those aimed at the driver's own processes: the driver runs as uid 0, and
//! the kernel would let it signal every root process. `kill(-1)` fails at once; the driver's
//! calls on itself (`raise`, the Go runtime's preemption signals) never leave the kernel.
//! Every other system call runs untouched, so the filter costs nothing on the driver's I/O
//! path: one filter, one program, checked in order.
//!
//! Must not: decide anything about the calls it reports.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

const SECCOMP_SET_MODE_FILTER: libc::c_uint = 1;
const SECCOMP_FILTER_FLAG_NEW_LISTENER: libc::c_ulong = 1 << 3;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
const SECCOMP_RET_USER_NOTIF: u32 = 0x7fc0_0000;
const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
const SECCOMP_USER_NOTIF_FLAG_CONTINUE: u32 = 1;
const SECCOMP_ADDFD_FLAG_SETFD: u32 = 1;

// ioctl numbers: _IOWR('!', 0, seccomp_notif), _IOWR('!', 1, seccomp_notif_resp),
// _IOW('!', 2, u64), _IOW('!', 3, seccomp_notif_addfd).
const IOCTL_NOTIF_RECV: libc::c_ulong = 0xc050_2100;
const IOCTL_NOTIF_SEND: libc::c_ulong = 0xc018_2101;
const IOCTL_NOTIF_ID_VALID: libc::c_ulong = 0x4008_2102;
const IOCTL_NOTIF_ADDFD: libc::c_ulong = 0x4018_2103;

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xc000_003e;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xc000_00b7;
/// System call numbers at or above this belong to the x32 ABI on x86_64; refuse them.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// `struct seccomp_data`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct SeccompData {
    pub nr: i32,
    pub arch: u32,
    pub instruction_pointer: u64,
    pub args: [u64; 6],
}

/// `struct seccomp_notif`: one intercepted system call.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Notification {
    pub id: u64,
    pub pid: u32,
    pub flags: u32,
    pub data: SeccompData,
}

#[repr(C)]
struct NotifResp {
    id: u64,
    val: i64,
    error: i32,
    flags: u32,
}

#[repr(C)]
struct NotifAddfd {
    id: u64,
    flags: u32,
    srcfd: u32,
    newfd: u32,
    newfd_flags: u32,
}

/// System calls the filter reports to rebound (`ioctl` only for `FUSE_DEV_IOC_CLONE`, `splice`
/// only without offsets).
pub const NR_MOUNT: i64 = libc::SYS_mount;
pub const NR_UMOUNT2: i64 = libc::SYS_umount2;
pub const NR_IOCTL: i64 = libc::SYS_ioctl;
pub const NR_SPLICE: i64 = libc::SYS_splice;

fn stmt(code: u16, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> libc::sock_filter {
    libc::sock_filter { code, jt, jf, k }
}

/// `FUSE_DEV_IOC_CLONE`: `_IOR(229, 0, uint32_t)`.
pub const FUSE_DEV_IOC_CLONE: u32 = 0x8004_e500;

/// Where the program's jumps land: the returns at its end.
struct Returns {
    allow: usize,
    notify: usize,
    enosys: usize,
    eperm: usize,
}

/// Instructions of the part about other processes, after the header and the deny list.
const PROCESSES_LEN: usize = 21;
/// Where in that part the driver's own pid goes (patched in by [`Filter::install`]).
const OWN_PID_AT: usize = 17;
/// Instructions of the interception part, after that.
const INTERCEPTION_LEN: usize = 15;
/// Instructions of the part bounding pipes, before the interception.
const PIPES_LEN: usize = 5;
/// `F_SETPIPE_SZ`.
const F_SETPIPE_SZ: u32 = 1031;
/// The largest pipe a driver on rebound's channel may make: the host's default
/// `fs.pipe-max-size`, below the 1 MiB and a page libfuse 3 asks for to splice its reads.
const CHANNEL_PIPE_MAX: u32 = 1 << 20;

/// System calls whose first argument is a process (or thread) id, 0 meaning the caller.
const ON_A_PROCESS: [i64; 11] = [
    libc::SYS_tgkill,
    libc::SYS_tkill,
    libc::SYS_rt_sigqueueinfo,
    libc::SYS_rt_tgsigqueueinfo,
    libc::SYS_pidfd_open,
    libc::SYS_prlimit64,
    libc::SYS_sched_setaffinity,
    libc::SYS_sched_setscheduler,
    libc::SYS_sched_setparam,
    libc::SYS_sched_setattr,
    libc::SYS_move_pages,
];

/// System calls on other processes that rebound checks always: `pidfd_send_signal` (its
/// descriptor may be a `/proc/PID` directory), and the priority calls, whose target is a pair.
const ON_PROCESSES: [i64; 3] = [
    libc::SYS_pidfd_send_signal,
    libc::SYS_setpriority,
    libc::SYS_ioprio_set,
];

/// Whether rebound is asked about system call `nr` when its target is another process.
pub fn is_on_processes(nr: i64) -> bool {
    nr == libc::SYS_kill || ON_A_PROCESS.contains(&nr) || ON_PROCESSES.contains(&nr)
}

impl Returns {
    fn for_denied(denied: usize) -> Returns {
        let allow = 4 + denied + PROCESSES_LEN + PIPES_LEN + INTERCEPTION_LEN;
        Returns {
            allow,
            notify: allow + 1,
            enosys: allow + 2,
            eperm: allow + 3,
        }
    }
}

/// The BPF program: foreign ABIs fail with `ENOSYS`, each of `denied` is reported (to be
/// failed with `EPERM`), then calls on other processes, with `channel` the bound on pipes,
/// then the interception (see the module comment), and everything else is allowed.
fn program(denied: &[u32], channel: bool) -> Vec<libc::sock_filter> {
    const LD_W_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    const JEQ_K: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    const JGE_K: u16 = (libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16;
    const JGT_K: u16 = (libc::BPF_JMP | libc::BPF_JGT | libc::BPF_K) as u16;
    const RET_K: u16 = (libc::BPF_RET | libc::BPF_K) as u16;
    // Offsets in struct seccomp_data: nr, arch, then args[i] at 16 + 8 i (low word first).
    const NR: u32 = 0;
    const ARCH: u32 = 4;
    const fn arg_low(i: u32) -> u32 {
        16 + 8 * i
    }
    const fn arg_high(i: u32) -> u32 {
        20 + 8 * i
    }
    let to = Returns::for_denied(denied.len());
    // A jump offset is relative to the next instruction and must fit in a byte; `Filter::new`
    // caps the deny list so that it does.
    let rel = |from: usize, target: usize| (target - from - 1) as u8;
    let mut prog = vec![
        /* 0 */ stmt(LD_W_ABS, ARCH),
        /* 1 */ jump(JEQ_K, AUDIT_ARCH, 0, rel(1, to.enosys)), // foreign ABI
        /* 2 */ stmt(LD_W_ABS, NR),
        /* 3 */ jump(JGE_K, X32_SYSCALL_BIT, rel(3, to.enosys), 0), // x32
    ];
    for &nr in denied {
        let at = prog.len();
        prog.push(jump(JEQ_K, nr, rel(at, to.notify), 0));
    }
    // Other processes. kill(0) is the driver's own process group (it leads a session of its
    // own), kill(-1) every process there is.
    let at = prog.len();
    prog.push(jump(JEQ_K, libc::SYS_kill as u32, 0, 3)); // not kill -> at + 4
    prog.push(stmt(LD_W_ABS, arg_low(0)));
    prog.push(jump(JEQ_K, 0, rel(at + 2, to.allow), 0));
    prog.push(jump(
        JEQ_K,
        u32::MAX,
        rel(at + 3, to.eperm),
        rel(at + 3, to.notify),
    ));
    let first_arg = at + 4 + ON_A_PROCESS.len();
    for (i, nr) in ON_A_PROCESS.iter().enumerate() {
        let here = at + 4 + i;
        let last = i + 1 == ON_A_PROCESS.len();
        // The last one falls through to the calls checked always.
        let no = if last { rel(here, first_arg + 3) } else { 0 };
        prog.push(jump(JEQ_K, *nr as u32, rel(here, first_arg), no));
    }
    prog.push(stmt(LD_W_ABS, arg_low(0)));
    prog.push(jump(JEQ_K, 0, rel(first_arg + 1, to.allow), 0));
    prog.push(jump(
        JEQ_K,
        0, // the driver's own pid, patched in by `Filter::install`
        rel(first_arg + 2, to.allow),
        rel(first_arg + 2, to.notify),
    ));
    for (i, nr) in ON_PROCESSES.iter().enumerate() {
        let here = first_arg + 3 + i;
        prog.push(jump(JEQ_K, *nr as u32, rel(here, to.notify), 0));
    }
    debug_assert_eq!(prog.len(), at + PROCESSES_LEN);
    debug_assert_eq!(first_arg + 2, at + OWN_PID_AT);
    // No system call has this number: without `channel`, the tests on it never match.
    let on_channel = |nr: i64| if channel { nr as u32 } else { u32::MAX };
    // fcntl(fd, F_SETPIPE_SZ, size): `cmd` and `size` are 32-bit (`pipe_fcntl`).
    let at = prog.len();
    prog.extend_from_slice(&[
        /* +0 */ jump(JEQ_K, on_channel(libc::SYS_fcntl), 0, 4), // not fcntl -> +5
        /* +1 */ stmt(LD_W_ABS, arg_low(1)),
        /* +2 */ jump(JEQ_K, F_SETPIPE_SZ, 0, rel(at + 2, to.allow)),
        /* +3 */ stmt(LD_W_ABS, arg_low(2)),
        /* +4 */
        jump(
            JGT_K,
            CHANNEL_PIPE_MAX,
            rel(at + 4, to.eperm),
            rel(at + 4, to.allow),
        ),
    ]);
    debug_assert_eq!(prog.len(), at + PIPES_LEN);
    let splice_nr = on_channel(libc::SYS_splice);
    // The interception: offsets below are relative, and the part sits just before the
    // returns, so they are the same whatever the length of the deny list.
    prog.extend_from_slice(&[
        /* +0 */ jump(JEQ_K, libc::SYS_mount as u32, 15, 0), // -> NOTIFY
        /* +1 */ jump(JEQ_K, libc::SYS_umount2 as u32, 14, 0), // -> NOTIFY
        /* +2 */ jump(JEQ_K, libc::SYS_fsopen as u32, 14, 0), // -> ENOSYS
        /* +3 */ jump(JEQ_K, libc::SYS_ioctl as u32, 0, 2), // not ioctl -> +6
        /* +4 */ stmt(LD_W_ABS, arg_low(1)),
        /* +5 */ jump(JEQ_K, FUSE_DEV_IOC_CLONE, 10, 9), // -> NOTIFY, else ALLOW
        // splice(fd_in, off_in, fd_out, off_out, len, flags) into the channel has no offsets;
        // splices with an offset (file to pipe) never involve the channel.
        /* +6 */
        jump(JEQ_K, splice_nr, 0, 8), // not splice -> ALLOW
        /* +7 */ stmt(LD_W_ABS, arg_low(1)),
        /* +8 */ jump(JEQ_K, 0, 0, 6), // off_in set -> ALLOW
        /* +9 */ stmt(LD_W_ABS, arg_high(1)),
        /* +10 */ jump(JEQ_K, 0, 0, 4),
        /* +11 */ stmt(LD_W_ABS, arg_low(3)),
        /* +12 */ jump(JEQ_K, 0, 0, 2),
        /* +13 */ stmt(LD_W_ABS, arg_high(3)),
        /* +14 */ jump(JEQ_K, 0, 1, 0), // both offsets NULL -> NOTIFY
    ]);
    prog.extend_from_slice(&[
        stmt(RET_K, SECCOMP_RET_ALLOW),
        stmt(RET_K, SECCOMP_RET_USER_NOTIF),
        stmt(RET_K, SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
        stmt(RET_K, SECCOMP_RET_ERRNO | libc::EPERM as u32),
    ]);
    debug_assert_eq!(prog.len(), to.eperm + 1);
    debug_assert_eq!(prog[to.allow].k, SECCOMP_RET_ALLOW);
    debug_assert_eq!(prog[to.notify].k, SECCOMP_RET_USER_NOTIF);
    prog
}

/// The most system calls a filter can deny (its jumps must reach the returns in one byte).
pub const MAX_DENIED: usize = 200;

/// A filter program, built before `fork` so that installing it in the child allocates nothing.
pub struct Filter {
    program: Vec<libc::sock_filter>,
}

impl Filter {
    /// The interception filter, which also reports each system call of `denied` (for the
    /// listener to fail with `EPERM`), and with `channel` (the driver will read rebound's
    /// channel, not a `/dev/fuse` of its own) the splices that may involve the channel and the
    /// bound on pipes. Fails when `denied` is longer than [`MAX_DENIED`].
    pub fn new(denied: &[u32], channel: bool) -> io::Result<Filter> {
        if denied.len() > MAX_DENIED {
            return Err(io::Error::other("too many system calls to deny"));
        }
        Ok(Filter {
            program: program(denied, channel),
        })
    }

    /// Installs the filter on the calling thread, for which the process's calls on itself by
    /// its pid are allowed, and returns the listener.
    ///
    /// Async-signal-safe: called between `fork` and `exec`, it makes system calls only.
    pub fn install(&mut self) -> io::Result<OwnedFd> {
        // SAFETY: getpid has no arguments and cannot fail.
        let pid = unsafe { libc::getpid() };
        self.own_pid(pid as u32);
        let fprog = libc::sock_fprog {
            len: self.program.len() as u16,
            filter: self.program.as_ptr() as *mut libc::sock_filter,
        };
        let load = || {
            // SAFETY: `fprog` points at `self.program`, which outlives the call; the kernel
            // copies the program before returning.
            unsafe {
                libc::syscall(
                    libc::SYS_seccomp,
                    SECCOMP_SET_MODE_FILTER,
                    SECCOMP_FILTER_FLAG_NEW_LISTENER,
                    &fprog as *const libc::sock_fprog,
                )
            }
        };
        let mut fd = load();
        if fd < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EACCES) {
            // Without CAP_SYS_ADMIN a filter needs no_new_privs.
            set_no_new_privs()?;
            fd = load();
        }
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the kernel just returned this new descriptor, which nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
    }
}

impl Filter {
    /// Allows the process `pid`'s calls on itself by its pid.
    fn own_pid(&mut self, pid: u32) {
        let at = self.program.len() - 4 - INTERCEPTION_LEN - PIPES_LEN - PROCESSES_LEN + OWN_PID_AT;
        self.program[at].k = pid;
    }
}

/// Sets `no_new_privs`: from now on `execve` grants no privileges (setuid bits and file
/// capabilities are ignored). Async-signal-safe.
pub fn set_no_new_privs() -> io::Result<()> {
    // SAFETY: PR_SET_NO_NEW_PRIVS takes integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn ioctl<T>(fd: BorrowedFd<'_>, request: libc::c_ulong, arg: *mut T) -> io::Result<libc::c_int> {
    // SAFETY: callers pass a pointer to a live value of the struct type that `request`
    // encodes; the kernel reads or writes at most that many bytes.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), request, arg) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// Receives the next notification, blocking until one arrives. `ENOENT` means the caller
/// died or was interrupted before it could be read; callers retry.
pub fn receive(listener: BorrowedFd<'_>) -> io::Result<Notification> {
    let mut notif = Notification::default();
    ioctl(listener, IOCTL_NOTIF_RECV, &mut notif)?;
    Ok(notif)
}

/// Whether the notification `id` still waits for an answer (its caller is alive and blocked).
/// Check after reading the caller's memory, before acting on what was read.
pub fn id_valid(listener: BorrowedFd<'_>, id: u64) -> bool {
    let mut id = id;
    ioctl(listener, IOCTL_NOTIF_ID_VALID, &mut id).is_ok()
}

/// Answers `id`: the system call returns `val`, or fails with `errno` when it is not zero.
pub fn respond(listener: BorrowedFd<'_>, id: u64, val: i64, errno: i32) -> io::Result<()> {
    let mut resp = NotifResp {
        id,
        val,
        error: -errno,
        flags: 0,
    };
    ioctl(listener, IOCTL_NOTIF_SEND, &mut resp).map(drop)
}

/// Lets the system call `id` run in the kernel as if there were no filter.
pub fn respond_continue(listener: BorrowedFd<'_>, id: u64) -> io::Result<()> {
    let mut resp = NotifResp {
        id,
        val: 0,
        error: 0,
        flags: SECCOMP_USER_NOTIF_FLAG_CONTINUE,
    };
    ioctl(listener, IOCTL_NOTIF_SEND, &mut resp).map(drop)
}

/// Installs `src` in the caller of notification `id` as descriptor number `target_fd`,
/// replacing what was there, atomically (like `dup3`).
pub fn install_fd_as(
    listener: BorrowedFd<'_>,
    id: u64,
    src: BorrowedFd<'_>,
    target_fd: u32,
    cloexec: bool,
) -> io::Result<()> {
    let mut addfd = NotifAddfd {
        id,
        flags: SECCOMP_ADDFD_FLAG_SETFD,
        srcfd: src.as_raw_fd() as u32,
        newfd: target_fd,
        newfd_flags: if cloexec { libc::O_CLOEXEC as u32 } else { 0 },
    };
    ioctl(listener, IOCTL_NOTIF_ADDFD, &mut addfd).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LD_W_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    const JEQ_K: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    const JGE_K: u16 = (libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16;
    const JGT_K: u16 = (libc::BPF_JMP | libc::BPF_JGT | libc::BPF_K) as u16;
    const RET_K: u16 = (libc::BPF_RET | libc::BPF_K) as u16;

    /// Runs `prog` on one system call as the kernel would, and returns its action.
    fn run(prog: &[libc::sock_filter], arch: u32, nr: i64, args: [i64; 6]) -> u32 {
        let mut data = Vec::new();
        data.extend_from_slice(&(nr as i32).to_ne_bytes());
        data.extend_from_slice(&arch.to_ne_bytes());
        data.extend_from_slice(&0u64.to_ne_bytes());
        for arg in args {
            data.extend_from_slice(&arg.to_ne_bytes());
        }
        let (mut a, mut pc) = (0u32, 0usize);
        loop {
            let ins = prog[pc];
            let (jt, jf) = (usize::from(ins.jt), usize::from(ins.jf));
            match ins.code {
                LD_W_ABS => {
                    let at = ins.k as usize;
                    a = u32::from_ne_bytes(data[at..at + 4].try_into().unwrap());
                    pc += 1;
                }
                JEQ_K => pc += 1 + if a == ins.k { jt } else { jf },
                JGE_K => pc += 1 + if a >= ins.k { jt } else { jf },
                JGT_K => pc += 1 + if a > ins.k { jt } else { jf },
                RET_K => return ins.k,
                other => panic!("unexpected instruction {other:#x} at {pc}"),
            }
        }
    }

    #[test]
    fn each_call_gets_the_intended_action() {
        let allow = SECCOMP_RET_ALLOW;
        let notify = SECCOMP_RET_USER_NOTIF;
        let enosys = SECCOMP_RET_ERRNO | libc::ENOSYS as u32;
        let eperm = SECCOMP_RET_ERRNO | libc::EPERM as u32;
        let own = 4242;
        let longest: Vec<u32> = (1000..1000 + MAX_DENIED as u32).collect();
        for denied in [
            &[][..],
            &[libc::SYS_reboot as u32, libc::SYS_bpf as u32],
            &longest,
        ] {
            let mut filter = Filter::new(denied, true).unwrap();
            filter.own_pid(own);
            let call = |nr: i64, args: [i64; 6]| run(&filter.program, AUDIT_ARCH, nr, args);
            let none = [0; 6];
            for &nr in denied {
                assert_eq!(call(i64::from(nr), none), notify);
            }
            assert_eq!(
                run(&filter.program, 0x4000_0003, libc::SYS_read, none),
                enosys
            );
            assert_eq!(call(i64::from(X32_SYSCALL_BIT) + 1, none), enosys);
            assert_eq!(call(libc::SYS_read, none), allow);
            assert_eq!(call(libc::SYS_getpid, none), allow);
            // The interception.
            assert_eq!(call(libc::SYS_mount, none), notify);
            assert_eq!(call(libc::SYS_umount2, none), notify);
            assert_eq!(call(libc::SYS_fsopen, none), enosys);
            let clone = i64::from(FUSE_DEV_IOC_CLONE);
            assert_eq!(call(libc::SYS_ioctl, [3, clone, 0, 0, 0, 0]), notify);
            assert_eq!(call(libc::SYS_ioctl, [3, 0x5401, 0, 0, 0, 0]), allow);
            assert_eq!(call(libc::SYS_splice, [3, 0, 4, 0, 4096, 0]), notify);
            assert_eq!(call(libc::SYS_splice, [3, 0x7000, 4, 0, 4096, 0]), allow);
            assert_eq!(
                call(libc::SYS_splice, [3, 0, 4, 0x7000 << 32, 4096, 0]),
                allow
            );
            // Pipes: libfuse 3's (1 MiB and a page) is refused, smaller ones are not.
            let setpipe = |size: i64| call(libc::SYS_fcntl, [5, 1031, size, 0, 0, 0]);
            assert_eq!(setpipe(1_052_672), eperm);
            assert_eq!(setpipe(2 << 20), eperm);
            assert_eq!(setpipe(1 << 20), allow);
            assert_eq!(setpipe(64 << 10), allow);
            assert_eq!(call(libc::SYS_fcntl, [5, 1032, 0, 0, 0, 0]), allow); // F_GETPIPE_SZ
            assert_eq!(
                call(libc::SYS_fcntl, [5, 1031 + (1 << 32), 2 << 20, 0, 0, 0]),
                eperm
            );
            // Other processes.
            assert_eq!(call(libc::SYS_kill, [0, 9, 0, 0, 0, 0]), allow);
            assert_eq!(call(libc::SYS_kill, [-1, 9, 0, 0, 0, 0]), eperm);
            assert_eq!(call(libc::SYS_kill, [77, 9, 0, 0, 0, 0]), notify);
            assert_eq!(call(libc::SYS_kill, [-77, 9, 0, 0, 0, 0]), notify);
            for nr in ON_A_PROCESS {
                assert!(is_on_processes(nr));
                assert_eq!(call(nr, [i64::from(own), 1, 0, 0, 0, 0]), allow, "{nr} own");
                assert_eq!(call(nr, none), allow, "{nr} self");
                assert_eq!(call(nr, [77, 1, 0, 0, 0, 0]), notify, "{nr} other");
            }
            for nr in ON_PROCESSES {
                assert!(is_on_processes(nr));
                assert_eq!(call(nr, none), notify, "{nr}");
            }
        }
        // A driver with a `/dev/fuse` of its own splices and makes its pipes untouched.
        let beside = Filter::new(&[], false).unwrap();
        let call = |nr: i64, args: [i64; 6]| run(&beside.program, AUDIT_ARCH, nr, args);
        assert_eq!(call(libc::SYS_splice, [3, 0, 4, 0, 4096, 0]), allow);
        assert_eq!(call(libc::SYS_fcntl, [5, 1031, 2 << 20, 0, 0, 0]), allow);
        assert_eq!(call(libc::SYS_mount, [0; 6]), notify);
        assert!(Filter::new(&longest[..MAX_DENIED], true).is_ok());
        assert!(Filter::new(&[0; MAX_DENIED + 1], true).is_err());
    }

    #[test]
    fn struct_sizes_match_the_ioctl_numbers() {
        assert_eq!(std::mem::size_of::<Notification>(), 0x50);
        assert_eq!(std::mem::size_of::<NotifResp>(), 0x18);
        assert_eq!(std::mem::size_of::<NotifAddfd>(), 0x18);
    }
}
