//! Directories reopened in a restarted driver, listed from their start before the kernel goes
//! on from where it was, and only then.
//!
//! Owns: which reopened directory handles still need it, and the listing. Must not: reopen
//! handles (see `restore_handles`).

use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::time::Duration;

use fuse_wire::ids::{read_u64, readdir_request};
use tracker::PendingChange;

use super::{lock, Shared, PRIMING_READDIR_SIZE};

/// Before the first READDIR of a directory handle reopened in a restarted driver, if it does
/// not start at offset 0, the driver is made to list the directory from its start: libfuse's
/// high-level API reads a whole directory when asked for offset 0 and serves later offsets
/// from that copy (sshfs asserts it is never asked for another offset first). Done then, and
/// not at the restore: listing a large directory takes milliseconds (tar holds every
/// directory of the path it extracts to open, and lists none of them).
///
/// This one: the kernel's READDIR `msg` (its ids) on a serving driver.
pub(in crate::proxy) fn prime_reopened_directory(
    shared: &Shared,
    msg: &[u8],
    fields: &fuse_wire::ids::IdFields,
    change: &PendingChange,
) {
    let Some(fh) = unprimed_listing(shared, msg) else {
        return;
    };
    let Some((driver, _)) = shared.link().current().map(|(d, g)| (d.clone(), g)) else {
        return; // (Parked: primed when sent again, see `send_again`.)
    };
    let mut listing = msg.to_vec();
    if shared
        .objects()
        .to_driver(&mut listing, *fields, change)
        .is_ok()
    {
        list_from_start(shared, &driver, &listing);
        lock(&shared.unprimed_dirs).remove(&fh);
    }
}

/// The kernel's handle in READDIR `msg` if it was reopened and not listed yet, and `msg`
/// does not list from the start (which needs nothing more).
pub(super) fn unprimed_listing(shared: &Shared, msg: &[u8]) -> Option<u64> {
    let read_at = fuse_wire::abi::size::IN_HEADER;
    let (fh, offset) = (read_u64(msg, read_at)?, read_u64(msg, read_at + 8)?);
    let mut unprimed = lock(&shared.unprimed_dirs);
    if unprimed.is_empty() || !unprimed.contains(&fh) {
        return None;
    }
    if offset == 0 {
        unprimed.remove(&fh);
        return None;
    }
    Some(fh)
}

/// Sends `driver` a plain READDIR from offset 0 of the handle in `translated` (a READDIR or
/// READDIRPLUS in the driver's ids), and waits for the answer, which is of no use. (Plain: a
/// READDIRPLUS would hand out nodes no one forgets.)
pub(super) fn list_from_start(shared: &Shared, driver: &OwnedFd, translated: &[u8]) {
    let read_at = fuse_wire::abi::size::IN_HEADER;
    let (Some(node), Some(fh)) = (
        read_u64(
            translated,
            std::mem::offset_of!(fuse_wire::InHeader, nodeid),
        ),
        read_u64(translated, read_at),
    ) else {
        return;
    };
    let calls = &shared.calls;
    let unique = calls.next_unique();
    let listing = readdir_request(unique, node, fh, 0, PRIMING_READDIR_SIZE);
    let timeout = Duration::from_millis(shared.lookup_timeout_ms.load(Ordering::Relaxed));
    if let Err(e) = calls.call_all(driver, &[(unique, listing)], timeout) {
        tracing::debug!("listing a reopened directory from its start: {e}");
    }
}

/// The kernel released directory handle `fh`: it needs no listing any more.
pub(in crate::proxy) fn forget_unprimed(shared: &Shared, fh: u64) {
    let mut unprimed = lock(&shared.unprimed_dirs);
    if !unprimed.is_empty() {
        unprimed.remove(&fh);
    }
}
