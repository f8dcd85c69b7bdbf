//! rebound's own requests to the driver: the lookups and opens that restore a restarted
//! driver, the replayed INIT, and liveness probes.
//!
//! Owns: the `unique` space of these requests (bit 62 set, even, so they can never be taken
//! for the kernel's requests, which count up from 0, or for INTERRUPT replies, which are odd),
//! and matching their replies to the caller waiting for each.
//! Must not: forward anything to the kernel.

use std::collections::HashMap;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use rustix::net::SendFlags;
use zerocopy::FromBytes;

const PRIVATE_BIT: u64 = 1 << 62;

/// One of rebound's own requests, waiting for its reply.
struct Call {
    sent: Instant,
    /// `None` until the reply arrives.
    reply: Option<Vec<u8>>,
}

/// Whether a reply answers one of rebound's own requests.
pub fn is_private(unique: u64) -> bool {
    unique & PRIVATE_BIT != 0
}

/// rebound's own requests waiting for their replies.
#[derive(Default)]
pub struct PrivateCalls {
    next: AtomicU64,
    waiting: Mutex<HashMap<u64, Call>>,
    arrived: Condvar,
    /// The liveness probe in flight, if any, and when it was sent.
    probe: Mutex<Option<(u64, Instant)>>,
    /// Bumped when the driver fails: calls waiting on it give up at once.
    aborts: AtomicU64,
}

impl PrivateCalls {
    pub fn next_unique(&self) -> u64 {
        PRIVATE_BIT | (self.next.fetch_add(1, Ordering::Relaxed) << 1)
    }

    /// Sends `requests` (each built with its `unique`) and waits for all their replies, at
    /// most `timeout` in all. Replies come back in the order of the requests. Sending them all
    /// before waiting lets the driver work on many at once (restoring thousands of nodes one
    /// round trip at a time would take a second).
    pub fn call_all(
        &self,
        driver: &OwnedFd,
        requests: &[(u64, Vec<u8>)],
        timeout: Duration,
    ) -> io::Result<Vec<Vec<u8>>> {
        let aborts = self.aborts.load(Ordering::Relaxed);
        let sent = Instant::now();
        self.lock().extend(
            requests
                .iter()
                .map(|(unique, _)| (*unique, Call { sent, reply: None })),
        );
        let forget_all = || {
            let mut waiting = self.lock();
            for (unique, _) in requests {
                waiting.remove(unique);
            }
        };
        for (_, request) in requests {
            trace_sent(request);
            if let Err(e) = rustix::net::send(driver, request, SendFlags::NOSIGNAL) {
                forget_all();
                return Err(e.into());
            }
        }
        let deadline = Instant::now() + timeout;
        let mut waiting = self.lock();
        loop {
            if self.aborts.load(Ordering::Relaxed) != aborts {
                drop(waiting);
                forget_all();
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "the driver failed",
                ));
            }
            let arrived = requests
                .iter()
                .all(|(unique, _)| waiting.get(unique).is_some_and(|c| c.reply.is_some()));
            if arrived {
                return Ok(requests
                    .iter()
                    .map(|(unique, _)| {
                        waiting
                            .remove(unique)
                            .and_then(|c| c.reply)
                            .unwrap_or_default()
                    })
                    .collect());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                drop(waiting);
                forget_all();
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the driver did not answer",
                ));
            }
            waiting = self
                .arrived
                .wait_timeout(waiting, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Sends a request whose reply nobody waits for (FORGET takes none; a RELEASE's is
    /// dropped on arrival).
    pub fn send(&self, driver: &OwnedFd, request: &[u8]) -> io::Result<()> {
        trace_sent(request);
        rustix::net::send(driver, request, SendFlags::NOSIGNAL)?;
        Ok(())
    }

    /// Sends a liveness probe unless one is already out.
    pub fn probe(&self, driver: &OwnedFd, build: impl FnOnce(u64) -> Vec<u8>) {
        let mut probe = self.probe.lock().unwrap_or_else(|e| e.into_inner());
        if probe.is_some() {
            return;
        }
        let unique = self.next_unique();
        if self.send(driver, &build(unique)).is_ok() {
            *probe = Some((unique, Instant::now()));
        }
    }

    /// Since when the liveness probe has been waiting for its reply.
    pub fn probe_waiting_since(&self) -> Option<Instant> {
        self.probe
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .map(|(_, at)| at)
    }

    /// Forgets the probe (a new driver will get its own).
    pub fn clear_probe(&self) {
        *self.probe.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// The driver failed: every call waiting on it fails now instead of at its timeout.
    pub fn abort_all(&self) {
        let _waiting = self.lock();
        self.aborts.fetch_add(1, Ordering::Relaxed);
        self.arrived.notify_all();
    }

    /// Hands a reply to whoever waits for it; a late reply (its caller gave up) is dropped.
    /// Returns true if it answered the liveness probe.
    pub fn deliver(&self, unique: u64, reply: &[u8]) -> bool {
        {
            let mut probe = self.probe.lock().unwrap_or_else(|e| e.into_inner());
            if probe.is_some_and(|(u, _)| u == unique) {
                *probe = None;
                return true;
            }
        }
        let mut waiting = self.lock();
        if let Some(call) = waiting.get_mut(&unique) {
            call.reply = Some(reply.to_vec());
            self.arrived.notify_all();
        }
        false
    }

    /// Since when the oldest call still unanswered has waited (a lookup a request waits for:
    /// a driver that stopped answering it hangs as much as one that leaves a request).
    pub fn oldest_waiting(&self) -> Option<Instant> {
        self.lock()
            .values()
            .filter(|c| c.reply.is_none())
            .map(|c| c.sent)
            .min()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Call>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Logs one of rebound's own requests at trace level: what a driver was asked, by whom.
fn trace_sent(request: &[u8]) {
    if tracing::enabled!(tracing::Level::TRACE) {
        if let Ok((header, rest)) = fuse_wire::InHeader::read_from_prefix(request) {
            let first = rest
                .get(..8)
                .map(|b| u64::from_ne_bytes(b.try_into().unwrap_or_default()));
            tracing::trace!(
                "own request {}: opcode {} node {} first field {first:?}",
                header.unique,
                header.opcode,
                header.nodeid
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_ids_are_even_and_marked() {
        let calls = PrivateCalls::default();
        let a = calls.next_unique();
        let b = calls.next_unique();
        assert!(is_private(a) && is_private(b));
        assert_ne!(a, b);
        assert_eq!(a & fuse_wire::abi::INT_REQ_BIT, 0);
        assert!(!is_private(2 * 1_000_000));
    }
}
