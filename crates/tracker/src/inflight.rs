//! Requests forwarded to the driver and not yet answered.
//!
//! A reply is accepted only for a request in this table, checked against the shape that
//! request calls for, and removes it. After a restart, recovery will need it to know which
//! requests the kernel is still waiting on.
//!
//! Memory: one entry per request in flight; the kernel bounds those (`max_background` plus
//! synchronous callers), so the table stays small whatever the traffic.

use std::collections::HashMap;
use std::sync::Mutex;

use fuse_wire::ReplyShape;

use crate::objects::PendingChange;

/// One request the driver has not answered yet.
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

    /// Records a request about to be sent to the driver. A `unique` the kernel reuses while
    /// still in flight would be a kernel bug; the newer request wins.
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

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Inflight>> {
        // A panic while holding the lock cannot leave the map half-updated (each operation is
        // a single HashMap call), so a poisoned lock is still usable.
        self.requests.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GETATTR: Inflight = Inflight {
        opcode: 3,
        shape: ReplyShape::Attr,
        change: PendingChange::None,
        queue: 0,
    };

    #[test]
    fn a_reply_consumes_its_request_once() {
        let table = InflightTable::new();
        table.insert(10, GETATTR);
        assert_eq!(table.len(), 1);
        assert_eq!(table.take(10), Some(GETATTR));
        assert_eq!(
            table.take(10),
            None,
            "a second reply to the same request is refused"
        );
        assert!(table.is_empty());
    }
}
