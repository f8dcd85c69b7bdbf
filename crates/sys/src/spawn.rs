//! Starting a driver confined by its sandbox and with the interception filter in place before
//! its first instruction.
//!
//! The filter must be installed in the child between `fork` and `exec` (so it covers the
//! driver and everything it starts, including a setuid `fusermount3`), but its listener
//! descriptor is needed in rebound. The child sends it back over a socket pair.
//!
//! Must not: decide how the driver is started (arguments and environment are set by the caller
//! on the `Command`; the driver always leads a session of its own).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};

use rustix::net::{
    recvmsg, sendmsg, socketpair, AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage,
    RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};

use crate::sandbox::Sandbox;
use crate::seccomp;

/// Spawns `command` confined by `sandbox` and under the interception filter, which also denies
/// the system calls `denied` with `EPERM`. Returns the child and the filter's notification
/// listener.
pub fn spawn_intercepted(
    command: &mut Command,
    sandbox: &Sandbox,
    denied: &[u32],
) -> io::Result<(Child, OwnedFd)> {
    // Both are prepared here: the child allocates nothing.
    let mut filter = seccomp::Filter::new(denied)?;
    let sandbox = sandbox.clone();
    let (ours, theirs) = socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?;
    let theirs_raw = theirs.as_raw_fd();
    // SAFETY: the closure runs in the forked child before exec and only makes system calls
    // (those of the sandbox, seccomp, sendmsg on stack buffers, close); it allocates nothing
    // and takes no locks, so it is async-signal-safe. The child has a single thread, as
    // `unshare` needs. `theirs_raw` stays open in the child: it is closed by CLOEXEC at exec.
    unsafe {
        command.pre_exec(move || {
            // A session of its own: kill(0) reaches only the driver's processes, and it
            // cannot move into a process group of rebound's session.
            // SAFETY: setsid takes no arguments.
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            // The sandbox first (its mounts need the capabilities it drops), the filter last:
            // it would report the sandbox's own mounts.
            sandbox.apply()?;
            let listener = filter.install()?;
            // SAFETY: `theirs_raw` is open in the child until exec (see above).
            let channel = BorrowedFd::borrow_raw(theirs_raw);
            send_fd(channel, listener.as_fd())?;
            drop(listener);
            Ok(())
        });
    }
    let child = command.spawn()?;
    drop(theirs);
    let listener = receive_fd(ours.as_fd())?;
    Ok((child, listener))
}

fn send_fd(channel: BorrowedFd<'_>, fd: BorrowedFd<'_>) -> io::Result<()> {
    let fds = [fd];
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    control.push(SendAncillaryMessage::ScmRights(&fds));
    sendmsg(
        channel,
        &[io::IoSlice::new(b"L")],
        &mut control,
        SendFlags::empty(),
    )?;
    Ok(())
}

fn receive_fd(channel: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut byte = [0u8; 1];
    let msg = recvmsg(
        channel,
        &mut [io::IoSliceMut::new(&mut byte)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    if msg.bytes == 0 {
        // The child exec'd (or failed) without sending: `spawn` reports exec errors itself.
        return Err(io::Error::other(
            "driver did not hand over its seccomp listener",
        ));
    }
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(mut fds) = message {
            if let Some(fd) = fds.next() {
                return Ok(fd);
            }
        }
    }
    Err(io::Error::other("seccomp listener missing from hand-over"))
}

/// Makes `command` run in a mount namespace of its own in which `mountpoint` is not mounted:
/// a tool that refuses to touch a mounted file system (e2fsck) can then repair the store of
/// a driver that died, while the kernel's mount stays in place for everyone else.
pub fn outside_mount(command: &mut Command, mountpoint: &std::path::Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    // Made before the fork: the child allocates nothing.
    let target = std::ffi::CString::new(mountpoint.as_os_str().as_bytes())?;
    // SAFETY: the closure runs in the forked child before exec and only makes system calls
    // (unshare, mount, umount2) on data prepared before the fork; it allocates nothing and
    // takes no locks, so it is async-signal-safe. The child has a single thread, so leaving
    // the namespace it shared with other threads is sound (`unshare_unsafe`'s condition).
    unsafe {
        command.pre_exec(move || {
            use rustix::mount::{MountPropagationFlags, UnmountFlags};
            rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNS)?;
            // Unmounting in the new namespace must not propagate back to rebound's.
            rustix::mount::mount_change(
                c"/",
                MountPropagationFlags::PRIVATE | MountPropagationFlags::REC,
            )?;
            rustix::mount::unmount(target.as_c_str(), UnmountFlags::DETACH)?;
            Ok(())
        });
    }
    Ok(())
}
