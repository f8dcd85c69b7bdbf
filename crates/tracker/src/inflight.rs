//! Requests the kernel is waiting on: sent to the driver and not yet answered, or parked while
//! a new driver is being brought up.
//!
//! A reply is accepted only for a request in this table, checked against the shape that
//! request calls for, and removes it. Each entry keeps the request's bytes, so that after a
//! restart it can be sent again to the new driver (shadow replay), and when it was sent, so
//! that a driver that stops answering is noticed.
//!
//! Memory: one entry per request in flight; the kernel bounds those (`max_background` plus
//! synchronous callers), so the table stays small whatever the traffic.

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use fuse_wire::ReplyShape;
use rebound_sys::resident::ResidentBuffer;

use crate::objects::PendingChange;

/// The bytes of a request as the kernel sent it, shared with the thread that sends it (so a
/// large WRITE is never copied).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestBytes {
    /// A buffer of which the first `len` bytes are the request. Ids in it are the driver's
    /// once sent; `patches` holds the kernel's.
    pub buf: Arc<RequestStore>,
    pub len: usize,
    pub patches: Patches,
}

/// Where a request's bytes are kept: a copy (small requests), or the very buffer the kernel
/// wrote a large one into (a WRITE is never copied).
#[derive(Debug)]
pub enum RequestStore {
    Copied(Vec<u8>),
    Read(ResidentBuffer),
}

impl Deref for RequestStore {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            RequestStore::Copied(bytes) => bytes,
            RequestStore::Read(buffer) => buffer,
        }
    }
}

impl DerefMut for RequestStore {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            RequestStore::Copied(bytes) => bytes,
            RequestStore::Read(buffer) => buffer,
        }
    }
}

/// A copy is always a `Vec`: only the proxy's read buffers need be resident.
impl Clone for RequestStore {
    fn clone(&self) -> Self {
        RequestStore::Copied(self.to_vec())
    }
}

impl PartialEq for RequestStore {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for RequestStore {}

impl RequestBytes {
    pub fn bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

/// Id fields rewritten for the driver, with the kernel's values, so a request can be
/// translated again for another driver. A request has at most four id fields.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Patches {
    fields: [(usize, u64); 4],
    len: usize,
}

impl Patches {
    /// Records that the u64 at `at` is to hold (or held) `value`.
    pub fn push(&mut self, at: usize, value: u64) {
        if self.len < self.fields.len() {
            self.fields[self.len] = (at, value);
            self.len += 1;
        }
    }

    /// Writes these values into `msg`; returns what they replaced (so `apply` of the
    /// result undoes it).
    pub fn apply(&self, msg: &mut [u8]) -> Patches {
        let mut replaced = Patches::default();
        for &(at, value) in &self.fields[..self.len] {
            if let Some(field) = msg.get_mut(at..at + 8) {
                let old = u64::from_ne_bytes(field.try_into().unwrap_or_default());
                field.copy_from_slice(&value.to_ne_bytes());
                replaced.push(at, old);
            }
        }
        replaced
    }

    /// Puts the kernel's ids back into `msg`.
    pub fn undo(&self, msg: &mut [u8]) {
        self.apply(msg);
    }
}

/// One request the kernel waits on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inflight {
    /// Raw opcode, for logs (unknown opcodes are forwarded too).
    pub opcode: u32,
    /// What a successful reply must look like.
    pub shape: ReplyShape,
    /// What a successful reply commits to the object table.
    pub change: PendingChange,
    /// Which of rebound's kernel queues read the request (its reply must go back there).
    pub queue: u8,
    pub request: RequestBytes,
    /// The driver generation it was sent to and when; `None` while parked.
    pub sent: Option<(u64, Instant)>,
    /// Drivers that failed while this request was theirs (crashed or hung with it in flight,
    /// or answered it with garbage). A request that keeps failing drivers is the likely
    /// cause, and is failed alone instead of taking every restart of the budget.
    pub failures: u8,
    /// Its error reply looked like the driver failing, and it was sent again to a restarted
    /// driver for a second opinion; that one's answer stands.
    pub doubted: bool,
}

/// The requests in flight, keyed by the kernel's `unique`.
#[derive(Debug, Default)]
pub struct InflightTable {
    requests: Mutex<HashMap<u64, Inflight>>,
}

impl InflightTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a request about to be sent to the driver (or parked). A `unique` the kernel
    /// reuses while still in flight would be a kernel bug; the newer request wins.
    pub fn insert(&self, unique: u64, request: Inflight) {
        self.lock().insert(unique, request);
    }

    /// Removes and returns the request a reply answers, if it is in flight.
    pub fn take(&self, unique: u64) -> Option<Inflight> {
        self.lock().remove(&unique)
    }

    /// The queue that read a request still in flight.
    pub fn queue_of(&self, unique: u64) -> Option<u8> {
        self.lock().get(&unique).map(|r| r.queue)
    }

    /// When the longest-waiting request sent to the driver was sent.
    pub fn oldest_sent(&self) -> Option<Instant> {
        self.lock()
            .values()
            .filter_map(|r| r.sent.map(|(_, at)| at))
            .min()
    }

    /// Removes every request not yet sent to driver `generation`, in the kernel's order.
    pub fn take_not_sent_to(&self, generation: u64) -> Vec<(u64, Inflight)> {
        let mut taken = self.take_if(|r| r.sent.is_none_or(|(g, _)| g != generation));
        taken.sort_unstable_by_key(|(u, _)| *u);
        taken
    }

    /// Of the requests `uniques` names, removes those in flight and not sent to driver
    /// `generation`, in the kernel's order.
    pub fn take_named_not_sent_to(&self, uniques: &[u64], generation: u64) -> Vec<(u64, Inflight)> {
        let mut map = self.lock();
        let mut taken = Vec::new();
        for &unique in uniques {
            if map
                .get(&unique)
                .is_some_and(|r| r.sent.is_none_or(|(g, _)| g != generation))
            {
                taken.extend(map.remove(&unique).map(|r| (unique, r)));
            }
        }
        taken.sort_unstable_by_key(|(u, _)| *u);
        taken
    }

    /// Marks those of the requests `uniques` names that are parked as sent to driver
    /// `generation` at `at`.
    pub fn mark_named_sent(&self, uniques: &[u64], generation: u64, at: Instant) {
        let mut map = self.lock();
        for unique in uniques {
            if let Some(request) = map.get_mut(unique).filter(|r| r.sent.is_none()) {
                request.sent = Some((generation, at));
            }
        }
    }

    /// Removes every request.
    pub fn take_all(&self) -> Vec<(u64, Inflight)> {
        self.lock().drain().collect()
    }

    /// Removes the requests `pick` chooses.
    pub fn take_if(&self, mut pick: impl FnMut(&Inflight) -> bool) -> Vec<(u64, Inflight)> {
        let mut map = self.lock();
        let chosen: Vec<u64> = map
            .iter()
            .filter(|(_, r)| pick(r))
            .map(|(&u, _)| u)
            .collect();
        chosen
            .into_iter()
            .filter_map(|u| map.remove(&u).map(|r| (u, r)))
            .collect()
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether some request in flight satisfies `f`.
    pub fn any(&self, f: impl Fn(&Inflight) -> bool) -> bool {
        self.lock().values().any(f)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Inflight>> {
        // A panic while holding the lock cannot leave the map half-updated (each operation is
        // a single HashMap call or a loop of removals), so a poisoned lock is still usable.
        self.requests.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn getattr(sent: Option<u64>) -> Inflight {
        Inflight {
            opcode: 3,
            shape: ReplyShape::Attr,
            change: PendingChange::None,
            queue: 0,
            request: RequestBytes {
                buf: Arc::new(RequestStore::Copied(vec![0; 56])),
                len: 56,
                patches: Patches::default(),
            },
            sent: sent.map(|g| (g, Instant::now())),
            failures: 0,
            doubted: false,
        }
    }

    #[test]
    fn a_reply_consumes_its_request_once() {
        let table = InflightTable::new();
        let request = getattr(Some(0));
        table.insert(10, request.clone());
        assert_eq!(table.len(), 1);
        assert_eq!(table.take(10), Some(request));
        assert_eq!(
            table.take(10),
            None,
            "a second reply to the same request is refused"
        );
        assert!(table.is_empty());
    }

    #[test]
    fn requests_not_sent_to_a_generation_are_taken_in_order() {
        let table = InflightTable::new();
        table.insert(8, getattr(Some(1)));
        table.insert(4, getattr(None));
        table.insert(6, getattr(Some(2)));
        table.insert(2, getattr(Some(1)));
        let taken: Vec<u64> = table
            .take_not_sent_to(2)
            .into_iter()
            .map(|(u, _)| u)
            .collect();
        assert_eq!(taken, vec![2, 4, 8]);
        assert_eq!(table.len(), 1);
        assert!(table.oldest_sent().is_some());
    }

    #[test]
    fn only_the_named_requests_are_taken_or_marked() {
        let table = InflightTable::new();
        table.insert(8, getattr(None)); // named, parked
        table.insert(4, getattr(Some(1))); // named, sent to a failed driver
        table.insert(6, getattr(Some(2))); // named, sent to the serving one
        table.insert(2, getattr(None)); // parked by someone else
        let taken: Vec<u64> = table
            .take_named_not_sent_to(&[8, 6, 4, 10], 2)
            .into_iter()
            .map(|(u, _)| u)
            .collect();
        assert_eq!(taken, vec![4, 8]);
        table.insert(8, getattr(None));
        table.mark_named_sent(&[8, 6], 3, Instant::now());
        assert_eq!(table.take(8).and_then(|r| r.sent).map(|(g, _)| g), Some(3));
        assert_eq!(table.take(6).and_then(|r| r.sent).map(|(g, _)| g), Some(2));
        assert_eq!(table.take(2).map(|r| r.sent), Some(None));
    }

    #[test]
    fn patches_restore_the_kernels_ids() {
        let mut msg = 5u64.to_ne_bytes().repeat(2);
        let mut patches = Patches::default();
        patches.push(8, 5);
        msg[8..].copy_from_slice(&77u64.to_ne_bytes());
        patches.undo(&mut msg);
        assert_eq!(msg, 5u64.to_ne_bytes().repeat(2));
    }
}
