//! Confining a driver between `fork` and `exec`: its cgroups, rlimits, namespaces, file-system
//! view, capabilities and `no_new_privs`, applied in that order (namespaces and mounts need
//! capabilities, so those are dropped after them; the seccomp filter comes last, in
//! [`crate::spawn`]). Also placing a mount into a driver's mount namespace from outside.
//!
//! Everything the child does is prepared before the fork ([`Sandbox`] holds C strings and
//! numbers only), so the child makes system calls and nothing else.
//!
//! Must not: decide what a driver may see or do (which paths, which capabilities, which
//! limits); that is the caller's policy, handed over as a [`Sandbox`].

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// One step of building the driver's root in its new mount namespace. Paths are absolute, in
/// the namespace as it is while the steps run (before `pivot_root`).
#[derive(Debug, Clone)]
pub enum Step {
    /// Create a directory (an existing one is fine).
    Dir(CString),
    /// Create an empty file to bind a file onto (an existing one is fine).
    File(CString),
    /// Bind `source` at `target`, with everything mounted below `source` when `recursive`.
    Bind {
        source: CString,
        target: CString,
        recursive: bool,
    },
    /// Make the mount at `target` (and, when `recursive`, those below it) read-only.
    ReadOnly { target: CString, recursive: bool },
    /// Mount a fresh tmpfs at `target` with `options` (e.g. `mode=0755,size=16m`).
    Tmpfs { target: CString, options: CString },
    /// Detach whatever is mounted at `target`, if anything is.
    Detach(CString),
    /// Create the symbolic link `link` pointing at `target`.
    Symlink { target: CString, link: CString },
}

/// A new root for the driver: `steps` build it at `root`, which then becomes `/`.
#[derive(Debug, Clone)]
pub struct NewRoot {
    pub root: CString,
    pub steps: Vec<Step>,
    /// The working directory inside the new root (`/` when it is not there).
    pub cwd: CString,
}

/// Everything that confines one driver, prepared before the fork.
#[derive(Debug, Clone, Default)]
pub struct Sandbox {
    /// `cgroup.procs` files the driver joins (one per cgroup v1 hierarchy, or one for v2).
    pub cgroup_procs: Vec<CString>,
    /// `(resource, limit)` pairs for `setrlimit`, soft and hard limit alike.
    pub rlimits: Vec<(libc::__rlimit_resource_t, u64)>,
    /// A network namespace of its own (only a loopback interface, down).
    pub new_network: bool,
    /// A mount namespace of its own with this root; `None` keeps rebound's view.
    pub new_root: Option<NewRoot>,
    /// The capabilities the driver keeps (bit `n` is capability `n`); `None` leaves them.
    pub capabilities: Option<u64>,
    /// Set `no_new_privs` (setuid bits and file capabilities grant nothing).
    pub no_new_privs: bool,
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

impl Sandbox {
    /// Applies the sandbox to the calling process. Async-signal-safe: call it between `fork`
    /// and `exec` (the caller must be single-threaded for the namespace changes).
    pub fn apply(&self) -> io::Result<()> {
        for procs in &self.cgroup_procs {
            join_cgroup(procs)?;
        }
        for &(resource, limit) in &self.rlimits {
            let rlim = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            // SAFETY: `rlim` is a live rlimit the kernel only reads.
            check(unsafe { libc::setrlimit(resource, &rlim) })?;
        }
        let mut flags = 0;
        if self.new_network {
            flags |= libc::CLONE_NEWNET;
        }
        if self.new_root.is_some() {
            flags |= libc::CLONE_NEWNS;
        }
        if flags != 0 {
            // SAFETY: unshare takes flags only; the child is single-threaded.
            check(unsafe { libc::unshare(flags) })?;
        }
        if let Some(root) = &self.new_root {
            enter_new_root(root)?;
        }
        if let Some(keep) = self.capabilities {
            limit_capabilities(keep)?;
        }
        if self.no_new_privs {
            crate::seccomp::set_no_new_privs()?;
        }
        Ok(())
    }
}

fn join_cgroup(procs: &CStr) -> io::Result<()> {
    // SAFETY: `procs` is a NUL-terminated path; the returned descriptor is closed below.
    let fd = unsafe { libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
    check(fd)?;
    // "0" means the writing process.
    // SAFETY: writes one byte from a static buffer to the descriptor opened above.
    let written = unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) };
    let error = io::Error::last_os_error();
    // SAFETY: `fd` was opened above and is not used afterwards.
    unsafe { libc::close(fd) };
    if written != 1 {
        return Err(error);
    }
    Ok(())
}

fn mount(
    source: Option<&CStr>,
    target: &CStr,
    fstype: Option<&CStr>,
    flags: libc::c_ulong,
    data: Option<&CStr>,
) -> io::Result<()> {
    let ptr = |s: Option<&CStr>| s.map_or(std::ptr::null(), |s| s.as_ptr());
    // SAFETY: every pointer is NULL or a NUL-terminated string that outlives the call.
    check(unsafe {
        libc::mount(
            ptr(source),
            target.as_ptr(),
            ptr(fstype),
            flags,
            ptr(data).cast(),
        )
    })
}

/// `struct mount_attr` of `mount_setattr(2)`.
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;

fn set_read_only(target: &CStr, recursive: bool) -> io::Result<()> {
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    let flags = if recursive { libc::AT_RECURSIVE } else { 0 };
    // SAFETY: `target` is NUL-terminated and `attr` a live mount_attr of the size passed.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            target.as_ptr(),
            flags as libc::c_uint,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    check(rc as libc::c_int)
}

fn run_step(step: &Step) -> io::Result<()> {
    match step {
        Step::Dir(path) => {
            // SAFETY: `path` is NUL-terminated.
            if unsafe { libc::mkdir(path.as_ptr(), 0o755) } < 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EEXIST) {
                    return Err(e);
                }
            }
            Ok(())
        }
        Step::File(path) => {
            // SAFETY: `path` is NUL-terminated; the descriptor is closed at once.
            let fd = unsafe {
                libc::open(
                    path.as_ptr(),
                    // Read-only: the file may already be there in a read-only bind (a
                    // writable file in a read-only directory), where O_WRONLY would fail.
                    libc::O_RDONLY | libc::O_CREAT | libc::O_CLOEXEC,
                    0o644,
                )
            };
            check(fd)?;
            // SAFETY: `fd` was just opened and is not used afterwards.
            unsafe { libc::close(fd) };
            Ok(())
        }
        Step::Bind {
            source,
            target,
            recursive,
        } => {
            let mut flags = libc::MS_BIND;
            if *recursive {
                flags |= libc::MS_REC;
            }
            mount(Some(source), target, None, flags, None)
        }
        Step::ReadOnly { target, recursive } => set_read_only(target, *recursive),
        Step::Tmpfs { target, options } => mount(
            Some(c"tmpfs"),
            target,
            Some(c"tmpfs"),
            libc::MS_NOSUID | libc::MS_NODEV,
            Some(options),
        ),
        Step::Detach(target) => {
            // SAFETY: `target` is NUL-terminated.
            match check(unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) }) {
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOENT)) => Ok(()),
                other => other,
            }
        }
        Step::Symlink { target, link } => {
            // SAFETY: both are NUL-terminated.
            check(unsafe { libc::symlink(target.as_ptr(), link.as_ptr()) })
        }
    }
}

fn enter_new_root(new_root: &NewRoot) -> io::Result<()> {
    // Nothing done here may reach rebound's namespace, nor anything rebound mounts later
    // reach this one (rebound places the driver's own FUSE mount here when it needs to see it).
    mount(None, c"/", None, libc::MS_REC | libc::MS_PRIVATE, None)?;
    for step in &new_root.steps {
        run_step(step)?;
    }
    // SAFETY: NUL-terminated path.
    check(unsafe { libc::chdir(new_root.root.as_ptr()) })?;
    // pivot_root(".", ".") stacks the old root under the new one; detaching "." then drops it.
    // SAFETY: both arguments are NUL-terminated static strings.
    check(unsafe { libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) } as i32)?;
    // SAFETY: NUL-terminated static string.
    check(unsafe { libc::umount2(c".".as_ptr(), libc::MNT_DETACH) })?;
    // SAFETY: NUL-terminated paths.
    unsafe {
        if libc::chdir(new_root.cwd.as_ptr()) < 0 {
            check(libc::chdir(c"/".as_ptr()))?;
        }
    }
    Ok(())
}

/// `struct __user_cap_header_struct` and `__user_cap_data_struct` (version 3: two of them).
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
const PR_CAP_AMBIENT: libc::c_int = 47;
const PR_CAP_AMBIENT_CLEAR_ALL: libc::c_ulong = 4;

/// Keeps only the capabilities in `keep`, in every set: the bounding set (so that `execve` as
/// root grants no more), the ambient set, and the effective, permitted and inheritable sets.
fn limit_capabilities(keep: u64) -> io::Result<()> {
    for cap in 0..64u64 {
        if keep & (1 << cap) != 0 {
            continue;
        }
        // SAFETY: integer arguments only. EINVAL past the kernel's last capability: done.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) } < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINVAL) {
                break;
            }
            return Err(e);
        }
    }
    // SAFETY: integer arguments only.
    check(unsafe { libc::prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) })?;
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let half = |bits: u32| CapData {
        effective: bits,
        permitted: bits,
        inheritable: bits,
    };
    let data = [half(keep as u32), half((keep >> 32) as u32)];
    // SAFETY: `header` and `data` are live structs of the layout capset(2) v3 expects.
    check(unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) } as i32)
}

/// Places the mount `tree` (a detached copy made with `open_tree(OPEN_TREE_CLONE)`) at `target`
/// in the mount namespace `namespace` (an open `/proc/PID/ns/mnt`). A short-lived child process
/// enters the namespace and attaches it; rebound itself is multithreaded and cannot.
pub fn attach_in_namespace(
    namespace: BorrowedFd<'_>,
    tree: BorrowedFd<'_>,
    target: &CStr,
) -> io::Result<()> {
    // SAFETY: the child only makes system calls (setns, move_mount, _exit) on data that exists
    // before the fork; it allocates nothing and takes no locks.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        // SAFETY: see above; `_exit` ends the child without running the parent's destructors.
        unsafe {
            let attached = libc::setns(namespace.as_raw_fd(), libc::CLONE_NEWNS) == 0
                && libc::syscall(
                    libc::SYS_move_mount,
                    tree.as_raw_fd(),
                    c"".as_ptr(),
                    libc::AT_FDCWD,
                    target.as_ptr(),
                    0x4 as libc::c_uint, // MOVE_MOUNT_F_EMPTY_PATH
                ) == 0;
            let code = if attached {
                0
            } else {
                *libc::__errno_location()
            };
            libc::_exit(code);
        }
    }
    wait_helper(pid)
}

/// Detaches whatever is mounted at `target` (every mount stacked there) in the mount
/// namespace `namespace`, from a short-lived child process that enters it (see
/// [`attach_in_namespace`]).
pub fn detach_in_namespace(namespace: BorrowedFd<'_>, target: &CStr) -> io::Result<()> {
    // SAFETY: as in `attach_in_namespace`: the child makes system calls only.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        // SAFETY: see above.
        unsafe {
            if libc::setns(namespace.as_raw_fd(), libc::CLONE_NEWNS) != 0 {
                libc::_exit(*libc::__errno_location());
            }
            // Every mount stacked there (a copy placed over a bind of the same mount).
            let mut detached = 0;
            while libc::umount2(target.as_ptr(), libc::MNT_DETACH) == 0 {
                detached += 1;
            }
            libc::_exit(if detached > 0 {
                0
            } else {
                *libc::__errno_location()
            });
        }
    }
    wait_helper(pid)
}

fn wait_helper(pid: libc::pid_t) -> io::Result<()> {
    let mut status = 0;
    loop {
        // SAFETY: waits for our own child; `status` is a live int.
        if unsafe { libc::waitpid(pid, &mut status, libc::__WALL) } >= 0 {
            break;
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
    match libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status)) {
        Some(0) => Ok(()),
        Some(errno) => Err(io::Error::from_raw_os_error(errno)),
        None => Err(io::Error::other("the helper entering the namespace died")),
    }
}

/// Capability numbers by name (`CAP_CHOWN` is 0), as in `<linux/capability.h>`.
pub const CAPABILITY_NAMES: [&str; 41] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capability_numbers_match_libc_where_it_has_them() {
        let index = |name: &str| CAPABILITY_NAMES.iter().position(|n| *n == name);
        assert_eq!(index("CAP_SYS_ADMIN"), Some(21));
        assert_eq!(index("CAP_SYS_MODULE"), Some(16));
        assert_eq!(index("CAP_CHECKPOINT_RESTORE"), Some(40));
        assert_eq!(index("CAP_MKNOD"), Some(27));
    }

    #[test]
    fn cap_structs_have_the_kernel_layout() {
        assert_eq!(std::mem::size_of::<CapHeader>(), 8);
        assert_eq!(std::mem::size_of::<CapData>(), 12);
        assert_eq!(std::mem::size_of::<MountAttr>(), 32);
    }
}
