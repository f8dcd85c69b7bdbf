//! What rebound does with a driver's `mount(2)` and `umount2(2)`, reported by the seccomp
//! filter (see `rebound_sys::seccomp`); calls on other processes go to [`targets`].
//!
//! A FUSE mount names an open `/dev/fuse` descriptor in its options (`fd=N`). rebound opens
//! its own `/dev/fuse`, mounts with that descriptor instead, and replaces the caller's
//! descriptor `N` with the driver's end of a message channel before answering "success". The
//! caller may be the driver itself (libfuse as root, go-fuse's direct mount) or `fusermount3`,
//! which then passes the channel to the driver as it would have passed `/dev/fuse`. Either way
//! the driver never holds a real connection to the kernel.
//!
//! Owns: reading the call's arguments from the caller's memory, performing the mount and the
//! unmount, answering the caller. Must not: touch the mounted file system (a path lookup on it
//! could wait on the very driver that is blocked in this call).

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::paths::normalize;

use rebound_sys::seccomp::{self, Notification};
use rustix::io::Errno;

use crate::proxy::{Channel, Proxy};
use crate::sandbox;
use crate::supervisor::process;
use crate::supervisor::targets::{self, Verdict};

/// The outcome of one intercepted system call.
pub enum Intercepted {
    /// The driver's FUSE mount is in place; rebound holds the kernel end.
    Mounted(Box<Mount>),
    /// A restarted driver mounted again: it got a new channel, and the kernel's mount stays.
    Reattached {
        /// rebound's end of the new channel.
        channel: OwnedFd,
        channel_inode: u64,
        caller: u32,
    },
    /// The driver unmounted rebound's mount.
    Unmounted,
    /// A system call the sandbox denies, failed with `EPERM`: its name.
    Denied(&'static str),
    /// Anything else: answered, nothing to do.
    Other,
}

/// A FUSE mount made on behalf of the driver.
pub struct Mount {
    pub mountpoint: PathBuf,
    pub fstype: String,
    /// rebound's `/dev/fuse` descriptor for this mount.
    pub kernel: OwnedFd,
    /// rebound's end of the driver's channel; in fast mode, rebound's reference to the
    /// driver's own clone of `kernel`.
    pub channel: OwnedFd,
    /// Inode of the driver's end of the channel, to find which process holds it; 0 for a
    /// clone of `kernel` (see [`process::holder_of_channel`]).
    pub channel_inode: u64,
    /// Fast mode: the observer of the new connection, attached before the driver could
    /// answer INIT. `None`: the driver got a channel (guarded mode).
    pub observer: Option<rebound_observe::Observer>,
    /// `mountpoint` as the mount table names it (see [`crate::paths::in_mount_table`]).
    pub in_mount_table: PathBuf,
    /// The process that called `mount(2)`.
    pub caller: u32,
    /// The caller is a mount helper (`fusermount3`), not the driver itself.
    pub by_helper: bool,
    /// The caller's `mount(2)`, answered once rebound serves the mount.
    pub answer: PendingMount,
}

/// A first mount's `mount(2)`, left unanswered until the mount is served: a fast-mode driver
/// serves the kernel from the moment its call returns, and the status must name the mount
/// by then.
pub struct PendingMount {
    id: u64,
}

impl PendingMount {
    /// Answers the caller: success, or `errno`.
    pub fn answer(self, listener: BorrowedFd<'_>, outcome: Result<(), Errno>) {
        let answered = match outcome {
            Ok(()) => seccomp::respond(listener, self.id, 0, 0),
            Err(errno) => seccomp::respond(listener, self.id, -1, errno.raw_os_error()),
        };
        if let Err(e) = answered {
            // The caller died meanwhile: nothing waits for the answer.
            tracing::debug!("answering the driver's mount(2): {e}");
        }
    }
}

/// Arguments of `mount(2)` as read from the caller.
struct MountCall {
    source: Option<Vec<u8>>,
    target: PathBuf,
    fstype: Option<Vec<u8>>,
    flags: u64,
    data: Option<Vec<u8>>,
}

impl MountCall {
    fn is_fuse(&self) -> bool {
        self.fstype
            .as_deref()
            .is_some_and(|t| t == b"fuse" || t.starts_with(b"fuse.") || t.starts_with(b"fuseblk"))
    }
}

/// The target of a FUSE `mount(2)` (read from the caller, who waits in it), or `None` for any
/// other mount or a call that cannot be read.
pub fn fuse_mount_target(notif: &Notification) -> Option<PathBuf> {
    let call = read_mount_call(notif).ok()?;
    call.is_fuse().then_some(call.target)
}

/// A first mount served on the fast path (see [`handle`]).
pub struct Fast<'a> {
    /// The observer loaded for it, taken once the mount is made.
    pub observer: &'a mut Option<rebound_observe::LoadedObserver>,
    /// Where the observer is pinned, to outlive rebound (see `keeper::observer_pins`).
    pub pins: Option<&'a Path>,
}

/// The mount rebound already serves for this driver.
pub struct Served<'a> {
    pub mountpoint: &'a Path,
    pub channel_inode: u64,
    pub proxy: &'a Proxy,
    /// A failed driver is being replaced: a mount of it is the new driver's, an unmount the
    /// old one's on its way out.
    pub recovering: bool,
}

/// Handles one notification.
/// With `sandboxed`, mounts other than FUSE mounts are refused (`EPERM`). `is_driver(tgid)`
/// says whether a process is the driver's (a call on another process must reach only those).
/// `modes` is (`sandboxed`, `learning`, `fast`): with `learning`, a call of the deny list runs
/// (and is reported); with `fast` (`Some`), a first mount gives the driver a clone of the kernel's
/// connection instead of a channel, if the connection can be observed.
pub fn handle(
    listener: BorrowedFd<'_>,
    notif: &Notification,
    served: Option<Served<'_>>,
    modes: (bool, bool, Option<Fast<'_>>),
    is_driver: impl Fn(i32) -> bool,
) -> Intercepted {
    let (sandboxed, learning, fast) = modes;
    let nr = i64::from(notif.data.nr);
    let ours = served.as_ref().map(|s| s.mountpoint);
    let recovering = served.as_ref().is_some_and(|s| s.recovering);
    let result = if seccomp::is_on_processes(nr) {
        match targets::verdict(notif, is_driver) {
            Verdict::Continue => seccomp::respond_continue(listener, notif.id),
            Verdict::Fail(errno) => seccomp::respond(listener, notif.id, -1, errno.raw_os_error()),
        }
        .map(|_| Intercepted::Other)
    } else if nr == seccomp::NR_MOUNT {
        handle_mount(listener, notif, ours, recovering, (sandboxed, fast))
    } else if nr == seccomp::NR_UMOUNT2 {
        handle_umount(listener, notif, ours, recovering)
    } else if nr == seccomp::NR_IOCTL {
        handle_clone(listener, notif, served)
    } else if nr == seccomp::NR_SPLICE {
        handle_splice(listener, notif, served)
    } else if let Some(name) = sandbox::denied_name(nr) {
        // Only the deny list's calls reach this point (the filter reports nothing else);
        // while learning, they run.
        if learning {
            seccomp::respond_continue(listener, notif.id)
        } else {
            seccomp::respond(listener, notif.id, -1, Errno::PERM.raw_os_error())
        }
        .map(|_| Intercepted::Denied(name))
    } else {
        seccomp::respond_continue(listener, notif.id).map(|_| Intercepted::Other)
    };
    result.unwrap_or_else(|e| {
        // Usually the caller died or was interrupted and nothing waits for an answer; if it
        // still waits, it must not wait forever.
        tracing::debug!("intercepted call of pid {} failed: {e}", notif.pid);
        let _ = seccomp::respond(listener, notif.id, -1, Errno::IO.raw_os_error());
        Intercepted::Other
    })
}

fn handle_mount(
    listener: BorrowedFd<'_>,
    notif: &Notification,
    ours: Option<&Path>,
    recovering: bool,
    (sandboxed, fast): (bool, Option<Fast<'_>>),
) -> io::Result<Intercepted> {
    let call = match read_mount_call(notif) {
        Ok(call) => call,
        Err(errno) => {
            seccomp::respond(listener, notif.id, -1, errno.raw_os_error())?;
            return Ok(Intercepted::Other);
        }
    };
    if !seccomp::id_valid(listener, notif.id) {
        return Ok(Intercepted::Other);
    }
    let is_fuse = call.is_fuse();
    if !is_fuse && sandboxed {
        tracing::warn!(
            "pid {} tried to mount {} ({}); refused: a sandboxed driver mounts only its FUSE \
             file system",
            notif.pid,
            call.target.display(),
            String::from_utf8_lossy(call.fstype.as_deref().unwrap_or_default())
        );
        seccomp::respond(listener, notif.id, -1, Errno::PERM.raw_os_error())?;
        return Ok(Intercepted::Other);
    }
    if !is_fuse {
        // Without a sandbox, the kernel decides as it would without rebound.
        seccomp::respond_continue(listener, notif.id)?;
        return Ok(Intercepted::Other);
    }
    if let Some(mountpoint) = ours.filter(|m| recovering && call.target == *m) {
        // The mount is rebound's and stays; the new driver gets a channel to it.
        return match reattach(listener, notif, &call) {
            Ok((channel, channel_inode)) => {
                show_to_helper(notif.pid, &call.target);
                seccomp::respond(listener, notif.id, 0, 0)?;
                Ok(Intercepted::Reattached {
                    channel,
                    channel_inode,
                    caller: notif.pid,
                })
            }
            Err(errno) => {
                tracing::warn!(
                    "could not give the new driver its channel to {}: {errno}",
                    mountpoint.display()
                );
                seccomp::respond(listener, notif.id, -1, errno.raw_os_error())?;
                Ok(Intercepted::Other)
            }
        };
    }
    if let Some(mountpoint) = ours {
        tracing::error!(
            "driver asked for a second FUSE mount on {} while serving {}; refused",
            call.target.display(),
            mountpoint.display()
        );
        seccomp::respond(listener, notif.id, -1, Errno::BUSY.raw_os_error())?;
        return Ok(Intercepted::Other);
    }
    match mount_for_driver(listener, notif, &call, fast) {
        // Answered by the supervisor once it serves the mount (see `PendingMount`).
        Ok(mount) => Ok(Intercepted::Mounted(Box::new(mount))),
        Err(errno) => {
            seccomp::respond(listener, notif.id, -1, errno.raw_os_error())?;
            Ok(Intercepted::Other)
        }
    }
}

/// Shows the mount at `target` to a caller that is a mount helper (`fusermount3`), in its
/// namespace: the driver that called the helper may check its mount by using it (go-fuse
/// opens a file in it) or by finding it in its mount table (rclone). A driver that mounts by
/// itself does not look at its mount afterwards, and the copy would only keep the connection
/// alive after the host's mount is gone. Returns whether the caller is a helper.
fn show_to_helper(pid: u32, target: &Path) -> bool {
    let by_helper = super::process::is_mount_helper(pid as i32);
    if by_helper {
        if let Err(e) = show_in_callers_namespace(pid, target) {
            tracing::warn!(
                "could not show {} in the driver's mount namespace: {e}",
                target.display()
            );
        }
    }
    by_helper
}

/// A caller in a mount namespace of its own (its sandbox) does not see mounts made in
/// rebound's, and nothing propagates between the two; a driver that checks its mount by using
/// it (go-fuse, through fusermount3) must see it. rebound places a copy of the new mount (the
/// same connection) at the same path in the caller's namespace. Only the mount just made is
/// copied: no path lookup goes into it.
fn show_in_callers_namespace(pid: u32, target: &Path) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let theirs = format!("/proc/{pid}/ns/mnt");
    if std::fs::metadata(&theirs)?.ino() == std::fs::metadata("/proc/self/ns/mnt")?.ino() {
        return Ok(());
    }
    let namespace = File::open(&theirs)?;
    let tree = rustix::mount::open_tree(
        rustix::fs::CWD,
        target,
        rustix::mount::OpenTreeFlags::OPEN_TREE_CLONE
            | rustix::mount::OpenTreeFlags::OPEN_TREE_CLOEXEC,
    )?;
    let target = CString::new(target.as_os_str().as_bytes())?;
    rebound_sys::sandbox::attach_in_namespace(namespace.as_fd(), tree.as_fd(), &target)
}

/// The caller's `/dev/fuse` descriptor named by `fd=N`, and whether it is close-on-exec.
/// Fails with the errno the caller should see.
fn callers_fuse_fd(notif: &Notification, call: &MountCall) -> Result<(u32, bool), Errno> {
    let data = call.data.as_deref().unwrap_or_default();
    let driver_fd = fuse_fd_option(data).ok_or(Errno::INVAL)?;
    let pid = notif.pid;
    // The kernel would refuse an fd that is not /dev/fuse; so do we, before mounting.
    let link =
        std::fs::read_link(format!("/proc/{pid}/fd/{driver_fd}")).map_err(|_| Errno::BADF)?;
    if link != Path::new("/dev/fuse") {
        return Err(Errno::INVAL);
    }
    Ok((driver_fd, fd_is_cloexec(pid, driver_fd)))
}

/// Puts the driver's end of a new channel in place of the caller's descriptor `fd`.
/// Returns rebound's end and the inode of the driver's.
fn install_channel(
    listener: BorrowedFd<'_>,
    notif: &Notification,
    fd: u32,
    cloexec: bool,
) -> Result<(OwnedFd, u64), Errno> {
    let io_errno = |e: &io::Error| Errno::from_io_error(e).unwrap_or(Errno::IO);
    let channel = Channel::new().map_err(|e| io_errno(&e))?;
    let channel_inode = rustix::fs::fstat(&channel.theirs)?.st_ino;
    seccomp::install_fd_as(listener, notif.id, channel.theirs.as_fd(), fd, cloexec).map_err(
        |e| {
            tracing::warn!("could not hand the channel to pid {}: {e}", notif.pid);
            io_errno(&e)
        },
    )?;
    Ok((channel.ours, channel_inode))
}

/// A restarted driver's mount of the mount point rebound still holds: no new mount, only a
/// new channel in place of the driver's `/dev/fuse`.
fn reattach(
    listener: BorrowedFd<'_>,
    notif: &Notification,
    call: &MountCall,
) -> Result<(OwnedFd, u64), Errno> {
    let (fd, cloexec) = callers_fuse_fd(notif, call)?;
    install_channel(listener, notif, fd, cloexec)
}

/// A standby successor's FUSE mount of the mount point rebound serves, answered before the
/// standby is needed: like a restarted driver's (no new mount, a channel in place of its
/// `/dev/fuse`), but the channel stays silent until the hand-over. Returns rebound's end and
/// the inode of the standby's, or `None` when the call was refused (the caller has its errno).
pub fn attach_standby(
    listener: BorrowedFd<'_>,
    notif: &Notification,
) -> io::Result<Option<(OwnedFd, u64)>> {
    let attached = read_mount_call(notif).and_then(|call| {
        let channel = reattach(listener, notif, &call)?;
        show_to_helper(notif.pid, &call.target);
        Ok(channel)
    });
    match attached {
        Ok(channel) => {
            seccomp::respond(listener, notif.id, 0, 0)?;
            Ok(Some(channel))
        }
        Err(errno) => {
            tracing::warn!("could not give the standby driver its channel: {errno}");
            seccomp::respond(listener, notif.id, -1, errno.raw_os_error())?;
            Ok(None)
        }
    }
}

/// Mounts with rebound's own `/dev/fuse` and gives the caller the channel in place of its
/// descriptor, or with `fast`, a clone of rebound's connection once an observer is attached
/// to it (failing that, the channel, and the reason is logged). Fails with the errno the
/// caller should see.
fn mount_for_driver(
    listener: BorrowedFd<'_>,
    notif: &Notification,
    call: &MountCall,
    fast: Option<Fast<'_>>,
) -> Result<Mount, Errno> {
    let (driver_fd, cloexec) = callers_fuse_fd(notif, call)?;
    let data = call.data.as_deref().unwrap_or_default();
    let kernel = rustix::fs::open(
        "/dev/fuse",
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?;
    let data = replace_fd_option(data, std::os::fd::AsRawFd::as_raw_fd(&kernel));
    let fstype = call.fstype.clone().unwrap_or_default();
    let source = call.source.clone().unwrap_or_else(|| fstype.clone());
    let to_c = |bytes: Vec<u8>| CString::new(bytes).map_err(|_| Errno::INVAL);
    rustix::mount::mount(
        to_c(source)?.as_c_str(),
        call.target.as_path(),
        to_c(fstype.clone())?.as_c_str(),
        rustix::mount::MountFlags::from_bits_retain(call.flags as _),
        to_c(data)?.as_c_str(),
    )?;
    // Found in the mount table as it names the mount: with symbolic links resolved (a helper
    // such as fusermount3 mounts the path as the driver gave it).
    let in_table = crate::paths::in_mount_table(&call.target);
    let loaded = fast.and_then(|fast| Some((fast.observer.take()?, fast.pins)));
    let observer = loaded.and_then(|(loaded, pins)| {
        loaded
            .attach(&in_table, pins)
            .inspect_err(|e| {
                if let Some(dir) = pins {
                    rebound_observe::remove_pins(dir);
                }
                tracing::warn!(
                    "mode = \"fast\" could not observe the mount, serving guarded; the driver \
                     is replaced by one with guarded mode's filter: {e}"
                )
            })
            .ok()
    });
    if let Some(observer) = &observer {
        match (observer.forget_slot(), observer.not_shared()) {
            (Some(slot), _) => tracing::info!(
                "the driver's forgets are seen by the host's shared kfree program (slot {slot})"
            ),
            (None, Some(why)) => tracing::warn!(
                "the host's shared kfree program cannot be used ({why}): this run sees forgets \
                 with a program of its own, which runs at every kfree of the host"
            ),
            (None, None) => {}
        }
    }
    let installed = match observer {
        Some(_) => install_clone(listener, notif, kernel.as_fd(), driver_fd, cloexec),
        None => install_channel(listener, notif, driver_fd, cloexec),
    };
    let (channel, channel_inode) = installed.inspect_err(|_| {
        let _ = rustix::mount::unmount(&call.target, rustix::mount::UnmountFlags::DETACH);
    })?;
    let by_helper = show_to_helper(notif.pid, &call.target);
    Ok(Mount {
        mountpoint: call.target.clone(),
        fstype: String::from_utf8_lossy(&fstype).into_owned(),
        kernel,
        channel,
        channel_inode,
        observer,
        in_mount_table: in_table,
        caller: notif.pid,
        by_helper,
        answer: PendingMount { id: notif.id },
    })
}

/// Puts a clone of `kernel` in place of the caller's descriptor `fd` (fast mode). Returns
/// rebound's reference to that same open file, and 0 for the channel inode.
fn install_clone(
    listener: BorrowedFd<'_>,
    notif: &Notification,
    kernel: BorrowedFd<'_>,
    fd: u32,
    cloexec: bool,
) -> Result<(OwnedFd, u64), Errno> {
    let io_errno = |e: &io::Error| Errno::from_io_error(e).unwrap_or(Errno::IO);
    let clone = rebound_sys::fuse_dev::clone_connection(kernel).map_err(|e| io_errno(&e))?;
    seccomp::install_fd_as(listener, notif.id, clone.as_fd(), fd, cloexec).map_err(|e| {
        tracing::warn!("could not hand the connection to pid {}: {e}", notif.pid);
        io_errno(&e)
    })?;
    Ok((clone, 0))
}

fn handle_umount(
    listener: BorrowedFd<'_>,
    notif: &Notification,
    ours: Option<&Path>,
    recovering: bool,
) -> io::Result<Intercepted> {
    let target = read_path(notif, notif.data.args[0]);
    if !seccomp::id_valid(listener, notif.id) {
        return Ok(Intercepted::Other);
    }
    let (Some(mountpoint), Ok(target)) = (ours, target) else {
        seccomp::respond_continue(listener, notif.id)?;
        return Ok(Intercepted::Other);
    };
    if normalize(&target) != normalize(mountpoint) {
        seccomp::respond_continue(listener, notif.id)?;
        return Ok(Intercepted::Other);
    }
    if recovering {
        // The failed driver on its way out, or a helper of it (fusermount's auto_unmount),
        // must not take the mount down: a new driver is coming. It is told the unmount
        // happened.
        seccomp::respond(listener, notif.id, 0, 0)?;
        return Ok(Intercepted::Other);
    }
    // rebound owns the mount, and unmounts it once the driver has ended cleanly: a driver
    // that unmounts and then fails (a Rust driver's panic unwinds into its unmount) is
    // restarted instead. The driver is told the unmount happened.
    seccomp::respond(listener, notif.id, 0, 0)?;
    Ok(Intercepted::Unmounted)
}

/// `ioctl(new_fd, FUSE_DEV_IOC_CLONE, &master)`: a multi-threaded driver (libfuse's
/// `clone_fd`) asks for one more descriptor on its connection. When `master` is the driver's
/// channel, `new_fd` becomes another descriptor on that same channel: as on a cloned
/// `/dev/fuse`, readers share the requests, and a reply written on any descriptor reaches
/// rebound, which routes it. In fast mode, where `master` is the driver's clone of the kernel's
/// connection, rebound makes the clone itself and keeps a reference to it, so that the
/// requests read through it outlive the driver as those read through the first one do.
fn handle_clone(
    listener: BorrowedFd<'_>,
    notif: &Notification,
    served: Option<Served<'_>>,
) -> io::Result<Intercepted> {
    let channel_inode = served.as_ref().map(|s| s.channel_inode);
    let pid = notif.pid;
    let new_fd = notif.data.args[0] as u32;
    let master = File::open(format!("/proc/{pid}/mem")).and_then(|mem| {
        let mut raw = [0u8; 4];
        mem.read_exact_at(&mut raw, notif.data.args[2])?;
        Ok(u32::from_ne_bytes(raw))
    });
    let is_channel = |fd: u32| {
        let link = std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).ok();
        channel_inode.is_some_and(|ino| link == Some(PathBuf::from(format!("socket:[{ino}]"))))
    };
    let Ok(master) = master else {
        seccomp::respond(listener, notif.id, -1, Errno::FAULT.raw_os_error())?;
        return Ok(Intercepted::Other);
    };
    if !seccomp::id_valid(listener, notif.id) {
        return Ok(Intercepted::Other);
    }
    let beside = served.as_ref().filter(|s| s.proxy.is_beside());
    if let Some(served) = beside {
        let adopted =
            (|| -> io::Result<()> { served.proxy.clone_for_driver(descriptor_of(pid, new_fd)?) })();
        return match adopted {
            Ok(()) => {
                seccomp::respond(listener, notif.id, 0, 0)?;
                tracing::debug!("pid {pid}: fd {new_fd} cloned from the connection");
                Ok(Intercepted::Other)
            }
            Err(e) => {
                tracing::warn!("pid {pid}: cloning the connection failed: {e}");
                let errno = e.raw_os_error().unwrap_or(Errno::IO.raw_os_error());
                seccomp::respond(listener, notif.id, -1, errno)?;
                Ok(Intercepted::Other)
            }
        };
    }
    if !is_channel(master) {
        seccomp::respond_continue(listener, notif.id)?;
        return Ok(Intercepted::Other);
    }
    let clone = || -> io::Result<()> {
        let channel = descriptor_of(pid, master)?;
        let cloexec = fd_is_cloexec(pid, new_fd);
        seccomp::install_fd_as(listener, notif.id, channel.as_fd(), new_fd, cloexec)
    };
    if let Err(e) = clone() {
        tracing::warn!("pid {pid}: cloning the channel failed: {e}");
        seccomp::respond(
            listener,
            notif.id,
            -1,
            e.raw_os_error().unwrap_or(Errno::IO.raw_os_error()),
        )?;
        return Ok(Intercepted::Other);
    }
    seccomp::respond(listener, notif.id, 0, 0)?;
    tracing::debug!("pid {pid}: fd {new_fd} cloned from the channel (fd {master})");
    Ok(Intercepted::Other)
}

/// `splice(pipe, NULL, fd_out, NULL, len, flags)`: when `fd_out` is the channel, rebound
/// takes the data from the driver's pipe itself (see [`Proxy::deliver_spliced`]); any other
/// splice runs as usual.
fn handle_splice(
    listener: BorrowedFd<'_>,
    notif: &Notification,
    served: Option<Served<'_>>,
) -> io::Result<Intercepted> {
    let pid = notif.pid;
    let [fd_in, _, fd_out, _, len, _] = notif.data.args;
    let to_channel = served.as_ref().is_some_and(|s| {
        std::fs::read_link(format!("/proc/{pid}/fd/{fd_out}"))
            .is_ok_and(|l| l == Path::new(&format!("socket:[{}]", s.channel_inode)))
    });
    let Some(served) = served.filter(|_| to_channel) else {
        seccomp::respond_continue(listener, notif.id)?;
        return Ok(Intercepted::Other);
    };
    let spliced = (|| -> io::Result<usize> {
        let pipe = descriptor_of(pid, fd_in as u32)?;
        if !seccomp::id_valid(listener, notif.id) {
            return Err(io::ErrorKind::Interrupted.into());
        }
        served.proxy.deliver_spliced(pipe.as_fd(), len as usize)
    })();
    match spliced {
        Ok(n) => seccomp::respond(listener, notif.id, n as i64, 0)?,
        Err(e) => seccomp::respond(
            listener,
            notif.id,
            -1,
            e.raw_os_error().unwrap_or(Errno::IO.raw_os_error()),
        )?,
    }
    Ok(Intercepted::Other)
}

/// rebound's own copy of descriptor `fd` of thread `tid`'s process (`pidfd_getfd`).
/// Descriptors belong to the thread group; pidfds name its leader, not a thread.
fn descriptor_of(tid: u32, fd: u32) -> io::Result<OwnedFd> {
    let pidfd =
        rustix::process::pidfd_open(thread_group_of(tid)?, rustix::process::PidfdFlags::empty())?;
    let fd =
        rustix::process::pidfd_getfd(&pidfd, fd as i32, rustix::process::PidfdGetfdFlags::empty())?;
    Ok(fd)
}

/// The thread-group leader of thread `tid`, for `pidfd_open`.
fn thread_group_of(tid: u32) -> io::Result<rustix::process::Pid> {
    process::thread_group_of(tid as i32)
        .and_then(rustix::process::Pid::from_raw)
        .ok_or_else(|| io::Error::other(format!("no thread group for {tid}")))
}

fn read_mount_call(notif: &Notification) -> Result<MountCall, Errno> {
    let args = notif.data.args;
    let mem = File::open(format!("/proc/{}/mem", notif.pid)).map_err(|_| Errno::SRCH)?;
    let string = |addr: u64, max: usize| -> Result<Option<Vec<u8>>, Errno> {
        if addr == 0 {
            return Ok(None);
        }
        read_c_string(&mem, addr, max)
            .map(Some)
            .map_err(|_| Errno::FAULT)
    };
    let target = read_path(notif, args[1]).map_err(|_| Errno::FAULT)?;
    Ok(MountCall {
        source: string(args[0], 4096)?,
        target,
        fstype: string(args[2], 256)?,
        flags: args[3],
        // The kernel copies at most one page of mount data.
        data: string(args[4], 4096)?,
    })
}

/// Reads a path argument and makes it absolute the way the caller would resolve it.
fn read_path(notif: &Notification, addr: u64) -> io::Result<PathBuf> {
    let mem = File::open(format!("/proc/{}/mem", notif.pid))?;
    let raw = read_c_string(&mem, addr, 4096)?;
    let path = Path::new(OsStr::from_bytes(&raw));
    let base = if path.is_absolute() {
        std::fs::read_link(format!("/proc/{}/root", notif.pid))?
    } else {
        std::fs::read_link(format!("/proc/{}/cwd", notif.pid))?
    };
    Ok(normalize(&base.join(path)))
}

/// Reads a NUL-terminated string of at most `max` bytes from another process, page by page so
/// that a string ending just before an unmapped page is still read.
fn read_c_string(mem: &File, addr: u64, max: usize) -> io::Result<Vec<u8>> {
    const PAGE: u64 = 4096;
    let mut out = Vec::new();
    let mut at = addr;
    while out.len() < max {
        let to_page_end = (PAGE - at % PAGE) as usize;
        let mut chunk = vec![0u8; to_page_end.min(max - out.len())];
        let n = mem.read_at(&mut chunk, at)?;
        if n == 0 {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        if let Some(end) = chunk[..n].iter().position(|&b| b == 0) {
            out.extend_from_slice(&chunk[..end]);
            return Ok(out);
        }
        out.extend_from_slice(&chunk[..n]);
        at += n as u64;
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        "string too long",
    ))
}

/// The `fd=N` option of FUSE mount data.
fn fuse_fd_option(data: &[u8]) -> Option<u32> {
    data.split(|&b| b == b',')
        .find_map(|opt| opt.strip_prefix(b"fd="))
        .and_then(|n| std::str::from_utf8(n).ok()?.parse().ok())
}

/// The mount data with `fd=N` pointing at rebound's descriptor instead.
fn replace_fd_option(data: &[u8], fd: i32) -> Vec<u8> {
    let ours = format!("fd={fd}");
    let options: Vec<&[u8]> = data
        .split(|&b| b == b',')
        .map(|opt| {
            if opt.starts_with(b"fd=") {
                ours.as_bytes()
            } else {
                opt
            }
        })
        .collect();
    options.join(&b","[..])
}

/// Whether the caller's descriptor has close-on-exec set (`flags:` in fdinfo is octal).
fn fd_is_cloexec(pid: u32, fd: u32) -> bool {
    const O_CLOEXEC: u32 = 0o2000000;
    std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}"))
        .ok()
        .and_then(|info| {
            info.lines()
                .find_map(|l| l.strip_prefix("flags:"))
                .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        })
        .is_some_and(|flags| flags & O_CLOEXEC != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fd_option_is_found_and_replaced() {
        let data = b"fd=5,rootmode=40000,user_id=0,group_id=0,default_permissions";
        assert_eq!(fuse_fd_option(data), Some(5));
        assert_eq!(
            replace_fd_option(data, 17),
            b"fd=17,rootmode=40000,user_id=0,group_id=0,default_permissions".to_vec()
        );
        assert_eq!(fuse_fd_option(b"rootmode=40000"), None);
        assert_eq!(fuse_fd_option(b"fd=x"), None);
    }

    #[test]
    fn strings_are_read_from_process_memory() {
        let text = std::ffi::CString::new("/mnt/some where").unwrap();
        let mem = File::open("/proc/self/mem").unwrap();
        let read = read_c_string(&mem, text.as_ptr() as u64, 4096).unwrap();
        assert_eq!(read, b"/mnt/some where");
        assert!(read_c_string(&mem, text.as_ptr() as u64, 4).is_err());
    }
}
