//! More queues on a FUSE connection (`FUSE_DEV_IOC_CLONE`), and its descriptors kept across
//! `execve` for a successor rebound.
//!
//! A cloned `/dev/fuse` descriptor reads from the same connection's request queue, but keeps
//! its own list of requests being processed: a reply must be written to the descriptor that
//! read the request. rebound gives each clone its own forwarding thread.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use rustix::fs::{open, Mode, OFlags};

/// `FUSE_DEV_IOC_CLONE`: `_IOR(229, 0, uint32_t)`.
const FUSE_DEV_IOC_CLONE: libc::c_ulong = 0x8004_e500;

/// Opens a new `/dev/fuse` descriptor attached to the connection of `master`.
pub fn clone_connection(master: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let clone = open("/dev/fuse", OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())?;
    attach_to_connection(clone.as_fd(), master)?;
    Ok(clone)
}

/// Attaches `clone`, a `/dev/fuse` opened and not yet used (a driver's, taken with
/// `pidfd_getfd`), to the connection of `master`.
pub fn attach_to_connection(clone: BorrowedFd<'_>, master: BorrowedFd<'_>) -> io::Result<()> {
    let mut master_fd = master.as_raw_fd() as u32;
    // SAFETY: the ioctl reads one u32 (the master descriptor number) from the pointer, which
    // points at a live local; both descriptors are open for the duration of the call.
    let rc = unsafe {
        libc::ioctl(
            clone.as_raw_fd(),
            FUSE_DEV_IOC_CLONE,
            &mut master_fd as *mut u32,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Keeps `/dev/fuse` descriptors across `execve` (a successor rebound takes the mount over:
/// their close-on-exec flag cleared), or, with `keep` false, no longer (set again, should the
/// exec fail: no driver rebound starts later may inherit them).
pub fn keep_across_exec(fds: &[BorrowedFd<'_>], keep: bool) -> io::Result<()> {
    let flags = if keep {
        rustix::io::FdFlags::empty()
    } else {
        rustix::io::FdFlags::CLOEXEC
    };
    for fd in fds {
        rustix::io::fcntl_setfd(fd, flags)?;
    }
    Ok(())
}

/// Takes ownership of a `/dev/fuse` descriptor a predecessor left open across `execve`, by
/// its number. Fails unless `fd` is open on `/dev/fuse`; it is made close-on-exec again.
pub fn inherited(fd: i32) -> io::Result<OwnedFd> {
    let target = std::fs::read_link(format!("/proc/self/fd/{fd}"))?;
    if target != std::path::Path::new("/dev/fuse") {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("descriptor {fd} is {}, not /dev/fuse", target.display()),
        ));
    }
    // SAFETY: `fd` is open in this process (its /proc entry was just read) on /dev/fuse, and
    // nothing else in this process owns it: it was inherited across execve, and the caller
    // takes each inherited number once.
    let owned = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    rustix::io::fcntl_setfd(&owned, rustix::io::FdFlags::CLOEXEC)?;
    Ok(owned)
}
