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
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::thread::JoinHandle;

use rustix::net::{
    recvmsg, sendmsg, socketpair, AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage,
    RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};

use crate::sandbox::Sandbox;
use crate::seccomp;

/// Spawns `command` confined by `sandbox` and under the interception filter, which also denies
/// the system calls `denied` with `EPERM`, for a driver that will read rebound's channel if
/// `channel` (see [`seccomp::Filter::new`]). Returns the child and the filter's notification
/// listener.
pub fn spawn_intercepted(
    command: &mut Command,
    sandbox: &Sandbox,
    denied: &[u32],
    channel: bool,
) -> io::Result<(Child, OwnedFd)> {
    let (ours, theirs) = prepare(command, sandbox, (denied, channel), None)?;
    let child = command.spawn();
    // Closed as soon as the child has exec'd or died: a child that dies before it sends its
    // listener then reads as end of file below instead of a wait that never ends.
    drop(theirs);
    let child = child?;
    let (_, listener) = receive_fd(ours.as_fd())?;
    Ok((child, listener))
}

/// A child started by [`spawn_gated`], waiting before `exec`.
pub struct Gated {
    pub pid: i32,
    /// The filter's notification listener.
    pub listener: OwnedFd,
    /// One byte written here lets it `exec`; closing it ends it.
    pub gate: OwnedFd,
    /// Runs `exec` (`Command::spawn` returns only after it), then `then`.
    pub thread: JoinHandle<()>,
}

/// Like [`spawn_intercepted`], but the child waits, confined and filtered, before `exec` until
/// a byte arrives on its gate: everything of a start but the program's own is paid in
/// advance. `then` gets the child once it has exec'd (or the error), on a thread of its own.
pub fn spawn_gated(
    mut command: Command,
    sandbox: &Sandbox,
    denied: &[u32],
    then: impl FnOnce(io::Result<Child>) + Send + 'static,
) -> io::Result<Gated> {
    let (gate_rx, gate) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    let gate_fds = (gate_rx.as_raw_fd(), gate.as_raw_fd());
    let (ours, theirs) = prepare(&mut command, sandbox, (denied, true), Some(gate_fds))?;
    let thread = std::thread::Builder::new()
        .name("driver-exec".into())
        .spawn(move || {
            let spawned = command.spawn();
            drop(gate_rx);
            drop(theirs);
            then(spawned);
        })?;
    let (pid, listener) = receive_fd(ours.as_fd())?;
    Ok(Gated {
        pid,
        listener,
        gate,
        thread,
    })
}

/// Sets up the child's side of a spawn: its session, sandbox and filter, the listener sent
/// back on the first socket returned, and with `gate` (a pipe's read and write ends), the wait
/// for a byte on it. The second socket is the child's end: the caller closes it once `spawn`
/// returned, so that a child dying before it sends reads as end of file on the first.
fn prepare(
    command: &mut Command,
    sandbox: &Sandbox,
    (denied, channel): (&[u32], bool),
    gate: Option<(RawFd, RawFd)>,
) -> io::Result<(OwnedFd, OwnedFd)> {
    // Both are prepared here: the child allocates nothing.
    let mut filter = seccomp::Filter::new(denied, channel)?;
    let sandbox = sandbox.clone();
    let (ours, theirs) = socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?;
    // The child's copy stays open until exec (CLOEXEC). The closure keeps only the number: the
    // parent's copy is returned, to be closed once `spawn` returned.
    let theirs_fd = theirs.as_raw_fd();
    // SAFETY: the closure runs in the forked child before exec and only makes system calls
    // (those of the sandbox, seccomp, getpid, sendmsg and read on stack buffers, close); it
    // allocates nothing and takes no locks, so it is async-signal-safe. The child has a single
    // thread, as `unshare` needs. `gate` stays open in the child: it is closed by CLOEXEC at
    // exec, and in the parent only after `spawn` returned; so does `theirs_fd`.
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
            // SAFETY: `theirs_fd` is open in the child until exec (see above).
            send_fd(BorrowedFd::borrow_raw(theirs_fd), listener.as_fd())?;
            drop(listener);
            if let Some((gate, writer)) = gate {
                // Its copy of the write end would keep the gate from ever reading closed.
                // SAFETY: `writer` is the child's own copy, used nowhere else in it.
                libc::close(writer);
                let mut byte = [0u8; 1];
                // SAFETY: `gate` is open in the child until exec (see above).
                let gate = BorrowedFd::borrow_raw(gate);
                if rustix::io::read(gate, &mut byte)? == 0 {
                    // The gate was closed: rebound no longer wants this start.
                    return Err(io::Error::from(io::ErrorKind::Interrupted));
                }
            }
            Ok(())
        });
    }
    Ok((ours, theirs))
}

/// Sends `fd` with this process's pid (the child's, which rebound needs before `exec`).
fn send_fd(channel: BorrowedFd<'_>, fd: BorrowedFd<'_>) -> io::Result<()> {
    let fds = [fd];
    let pid = rustix::process::getpid()
        .as_raw_nonzero()
        .get()
        .to_ne_bytes();
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    control.push(SendAncillaryMessage::ScmRights(&fds));
    sendmsg(
        channel,
        &[io::IoSlice::new(&pid)],
        &mut control,
        SendFlags::empty(),
    )?;
    Ok(())
}

/// The child's pid and the descriptor it sent.
fn receive_fd(channel: BorrowedFd<'_>) -> io::Result<(i32, OwnedFd)> {
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut pid = [0u8; 4];
    let msg = recvmsg(
        channel,
        &mut [io::IoSliceMut::new(&mut pid)],
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
                return Ok((i32::from_ne_bytes(pid), fd));
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn a_child_killed_before_it_sends_its_listener_is_an_error_not_a_wait() {
        let (done, outcome) = mpsc::channel();
        std::thread::spawn(move || {
            let mut command = Command::new("/bin/true");
            // Runs before the hook of `prepare`: the child dies before it sends anything, as a
            // driver killed between fork and exec does.
            // SAFETY: raise is async-signal-safe; the child allocates nothing.
            unsafe {
                command.pre_exec(|| {
                    libc::raise(libc::SIGKILL);
                    Ok(())
                });
            }
            let spawned = spawn_intercepted(&mut command, &Sandbox::default(), &[], false);
            let _ = done.send(spawned.map(|(mut child, _)| child.wait()).is_err());
        });
        let is_error = outcome
            .recv_timeout(Duration::from_secs(20))
            .expect("spawn_intercepted still waits for a listener from a dead child");
        assert!(is_error);
    }
}
