//! The driver's notifications (invalidations, stores, retrieves), written to the kernel by a
//! thread of their own, in the order the driver sent them.
//!
//! A notification can block in the kernel for as long as a request in flight holds what it
//! needs: `FUSE_NOTIFY_INVAL_ENTRY` takes the directory's lock, which a LOOKUP waiting for its
//! reply holds. A driver writes it from one thread and the reply from another; if rebound's
//! reader of the driver's channel wrote both, the reply would wait behind the notification
//! and the notification behind the reply (rclone does this under pjdfstest).
//!
//! Owns: the queue and its writer thread. Must not: check or translate a notification (that
//! is done, with the driver's ids, before it is queued), or hold any proxy lock while it
//! writes.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::mpsc::{self, Receiver, Sender};

use rustix::io::Errno;

/// Notifications checked and in the kernel's ids, waiting for their writer.
pub struct NotificationQueue {
    sender: Sender<Vec<u8>>,
}

impl NotificationQueue {
    /// Starts the writer on `kernel` (a duplicate of rebound's `/dev/fuse` descriptor).
    /// `on_kernel_gone` runs once if the kernel's connection ends.
    pub fn start(
        kernel: OwnedFd,
        on_kernel_gone: impl Fn() + Send + 'static,
    ) -> std::io::Result<NotificationQueue> {
        let (sender, receiver) = mpsc::channel();
        std::thread::Builder::new()
            .name("notifications".into())
            .spawn(move || write_all(&kernel, &receiver, on_kernel_gone))?;
        Ok(NotificationQueue { sender })
    }

    /// Queues one notification (unbounded: the kernel holds one back only while a request
    /// the driver is answering holds what it needs).
    pub fn push(&self, msg: &[u8]) {
        // Only fails once the writer has ended with the kernel's connection.
        let _ = self.sender.send(msg.to_vec());
    }
}

fn write_all(kernel: &OwnedFd, queue: &Receiver<Vec<u8>>, on_kernel_gone: impl Fn()) {
    for msg in queue {
        match rustix::io::write(kernel.as_fd(), &msg) {
            Ok(_) => {}
            // About an inode or name the kernel no longer has: nothing to tell it.
            Err(Errno::NOENT) => {}
            Err(Errno::NODEV) => return on_kernel_gone(),
            Err(e) => tracing::warn!("kernel refused a driver notification: {e}"),
        }
    }
}
