//! The object table's changes as a log (its journal), for a successor rebound that takes the
//! mount over after rebound itself died (SIGKILL) and left no hand-over behind.
//!
//! Only what the kernel holds is journaled, in the kernel's ids: a success with its reply as
//! the kernel got it, a forget, a release, a lock taken. The driver's ids are not: a successor
//! starts a new driver, which is restored by path like any restarted one. So a table rebuilt
//! from a snapshot and the records after it is in the form of one built by observation (the
//! fast path): every id the kernel holds stands for itself as the driver's too (see
//! [`ObjectTable::take_kernel_ids_as_drivers`]), and replaying a record gives the kernel's
//! side of the table exactly what the record's change gave it.
//!
//! Owns: the records' form, noting them as the table changes (once asked to), and replaying
//! them. Must not: do I/O (the proxy writes them where they outlive rebound).

use std::sync::Arc;

use fuse_wire::abi::UNIQUE_RESEND;
use serde::{Deserialize, Serialize};

use super::{DriverNode, ObjectTable, PendingChange};

/// One change of what the kernel holds.
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum Record {
    /// A change committed with the reply the kernel got (ids in the kernel's).
    Success {
        change: PendingChange,
        reply: Vec<u8>,
    },
    Forget {
        node: u64,
        count: u64,
    },
    Release {
        fh: u64,
        dir: bool,
    },
    Locked {
        fh: u64,
        request: Vec<u8>,
    },
    /// A release of handle `fh` the kernel had opened on `node` (appended after the others,
    /// so that older journals read on).
    ReleaseOf {
        fh: u64,
        dir: bool,
        node: u64,
    },
    /// A success (as `Success`) with the kernel's `unique` of its request, written by rebound
    /// from 2026-11-29 on.
    SuccessOf {
        unique: u64,
        change: PendingChange,
        reply: Vec<u8>,
    },
    /// The reply of a success whose change a snapshot already holds: carried over into a new
    /// journal file, so that compacting the journal between a commit and its reply keeps the
    /// reply for a successor (see [`reply_records`]).
    Replied {
        unique: u64,
        reply: Vec<u8>,
    },
}

/// The replies of the successes among `records` (as [`ObjectTable::take_journal`] gave them),
/// as records that give a replayed table those replies to answer by and change nothing: what
/// a journal file started from a snapshot carries over from the file before. Records after
/// one that cannot be read are left out.
pub fn reply_records(mut records: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Ok((record, rest)) = postcard::take_from_bytes::<Record>(records) {
        records = rest;
        if let Record::SuccessOf { unique, reply, .. } | Record::Replied { unique, reply } = record
        {
            out = postcard::to_extend(&Record::Replied { unique, reply }, out).unwrap_or_default();
        }
    }
    out
}

/// How many of the latest committed replies a replay keeps, and how many bytes of them at
/// most (a READDIRPLUS reply can be 128 KiB): see [`ReplayedReplies`]. A reply can be
/// committed and not yet written only for the requests rebound was answering at its death: a
/// handful (one per reader thread and recovery), far fewer than this.
const REPLIES_KEPT: usize = 1024;
const REPLY_BYTES_KEPT: usize = 8 << 20;

/// The replies of the latest successes a replayed journal committed, by the kernel's `unique`
/// of their requests. rebound commits a change, journal included, before it writes the reply
/// to the kernel; dead in between, it leaves a change the journal holds and the kernel never
/// heard of, and the kernel sends the request again (`FUSE_NOTIFY_RESEND`). Executed again, an
/// OPEN or CREATE was committed twice, and the first handle, which the kernel never had and so
/// never releases, was reopened at every restart, and lost once its file was unlinked. The
/// successor answers such a request with the reply committed for it instead.
#[derive(Debug, Default)]
pub(super) struct ReplayedReplies {
    order: std::collections::VecDeque<u64>,
    replies: std::collections::HashMap<u64, Vec<u8>>,
    bytes: usize,
}

impl ReplayedReplies {
    fn keep(&mut self, unique: u64, reply: Vec<u8>) {
        let unique = unique & !UNIQUE_RESEND;
        self.bytes += reply.len();
        match self.replies.insert(unique, reply) {
            Some(earlier) => self.bytes -= earlier.len(),
            None => self.order.push_back(unique),
        }
        while self.order.len() > REPLIES_KEPT || self.bytes > REPLY_BYTES_KEPT {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            self.bytes -= self.replies.remove(&oldest).map_or(0, |r| r.len());
        }
    }

    fn take(&mut self, unique: u64) -> Option<Vec<u8>> {
        let unique = unique & !UNIQUE_RESEND;
        let reply = self.replies.remove(&unique)?;
        self.order.retain(|&u| u != unique);
        self.bytes -= reply.len();
        Some(reply)
    }
}

/// Records that cannot be read back (not written by this journal, or cut short).
#[derive(Debug, thiserror::Error)]
#[error("unreadable journal record after {replayed} records: {source}")]
pub struct JournalError {
    pub replayed: usize,
    source: postcard::Error,
}

impl ObjectTable {
    /// From now on, every change of what the kernel holds is noted, for
    /// [`ObjectTable::take_journal`].
    pub fn keep_journal(&mut self) {
        self.journal.get_or_insert_with(Vec::new);
    }

    /// The records noted since the last call (empty if none, or if no journal is kept).
    pub fn take_journal(&mut self) -> Vec<u8> {
        self.journal
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// The reply a replayed journal committed for the request `unique`, once: a request
    /// rebound committed and died before it answered (see [`ReplayedReplies`]). (Compared
    /// without the bit the kernel sets in a request it sends again.)
    pub fn take_replayed_reply(&mut self, unique: u64) -> Option<Vec<u8>> {
        self.replayed_replies.take(unique)
    }

    pub(super) fn journaling(&self) -> bool {
        self.journal.is_some()
    }

    pub(super) fn note(&mut self, record: &Record) {
        if let Some(journal) = self.journal.take() {
            // (Encoding into a Vec of plain data cannot fail; an error would lose the record.)
            self.journal = Some(postcard::to_extend(record, journal).unwrap_or_default());
        }
    }

    /// Makes every id the kernel holds the driver's as well, as in a table built by
    /// observation: what a snapshot must become before records are replayed on it.
    pub fn take_kernel_ids_as_drivers(&mut self) {
        self.by_driver.clear();
        for (&id, node) in &mut self.nodes {
            node.driver = DriverNode::Known(id);
            node.driver_lookups = node.lookups;
            self.by_driver.insert(id, id);
        }
        for (&(fh, _), handle) in &mut self.handles {
            handle.driver = Some(fh);
        }
    }

    /// Applies the records in `bytes` (see [`ObjectTable::take_journal`]) in order. Returns
    /// how many there were.
    pub fn replay(&mut self, mut bytes: &[u8]) -> Result<usize, JournalError> {
        // Not noted again while replayed. The records hold the kernel's ids, which stand for
        // the driver's too (see `take_kernel_ids_as_drivers`): a value open twice is the
        // kernel's twice, never given a fresh id.
        let journal = self.journal.take();
        let holds = std::mem::replace(&mut self.kernel_holds_driver_handles, true);
        let mut replayed = 0;
        let result = loop {
            if bytes.is_empty() {
                break Ok(replayed);
            }
            let (record, rest) = match postcard::take_from_bytes::<Record>(bytes) {
                Ok(parsed) => parsed,
                Err(source) => break Err(JournalError { replayed, source }),
            };
            bytes = rest;
            replayed += 1;
            match record {
                // (Written by rebound before 2026-11-29: no unique to answer by.)
                Record::Success { change, mut reply } => self.on_success(0, change, &mut reply),
                Record::SuccessOf {
                    unique,
                    change,
                    mut reply,
                } => {
                    self.on_success(unique, change, &mut reply);
                    self.replayed_replies.keep(unique, reply);
                }
                Record::Forget { node, count } => {
                    let _ = self.forget(node, count);
                }
                // (Written by rebound before 2026-11-28: the node of the handle open then.)
                Record::Release { fh, dir } => {
                    let node = self.handles.get(&(fh, dir)).map_or(0, |h| h.node);
                    let _ = self.release(fh, dir, node);
                }
                Record::ReleaseOf { fh, dir, node } => {
                    let _ = self.release(fh, dir, node);
                }
                Record::Locked { fh, request } => self.locked(fh, Arc::from(request)),
                Record::Replied { unique, reply } => self.replayed_replies.keep(unique, reply),
            }
        };
        self.journal = journal;
        self.kernel_holds_driver_handles = holds;
        result
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{lock_request, looked_up as lookup, opened as open};
    use super::*;

    /// What the kernel holds, in order: nodes with lookups and names, handles, locks.
    fn kernel_side(table: &ObjectTable) -> String {
        let mut nodes: Vec<_> = table
            .nodes
            .iter()
            .map(|(id, n)| (*id, n.lookups, n.name.clone()))
            .collect();
        nodes.sort();
        let mut handles: Vec<_> = table
            .handles
            .iter()
            .map(|(k, h)| (*k, h.node, h.flags))
            .collect();
        handles.sort();
        let mut locks: Vec<_> = table.locks.iter().map(|(k, v)| (*k, v.len())).collect();
        locks.sort();
        format!("{nodes:?} {handles:?} {locks:?}")
    }

    #[test]
    fn fast_modes_reused_handle_replays_as_it_was_seen() {
        // Observed in fast mode: the driver reused fh 70 for node b before the release of
        // node a's use of it was seen, with a lock on the earlier use.
        let mut table = ObjectTable::new();
        table.set_kernel_holds_driver_handles(true);
        table.keep_journal();
        let a = lookup(&mut table, 1, b"a", 10);
        let b = lookup(&mut table, 1, b"b", 11);
        open(&mut table, a, 70);
        table.locked(70, lock_request(1, 0, 0, 1, true));
        assert_eq!(table.locks_of(70).len(), 1);
        open(&mut table, b, 70);
        assert!(
            table.locks_of(70).is_empty(),
            "the earlier use's lock ended with it"
        );
        let _ = table.release(70, false, a);
        let records = table.take_journal();

        let mut successor = ObjectTable::new();
        successor.replay(&records).unwrap();
        assert_eq!(kernel_side(&successor), kernel_side(&table));
        assert_eq!(successor.handles.get(&(70, false)).map(|h| h.node), Some(b));
    }

    #[test]
    fn a_snapshot_and_the_records_after_it_give_the_kernels_side_back() {
        let mut table = ObjectTable::new();
        table.keep_journal();
        let a = lookup(&mut table, 1, b"a", 10);
        let b = lookup(&mut table, a, b"b", 11);
        let fh = open(&mut table, b, 0);
        // A restarted driver: its ids differ from the kernel's from now on.
        table.begin_generation(1);
        let a_again = lookup(&mut table, 1, b"a", 50);
        assert_eq!(a_again, a);
        let snapshot = table.snapshot();
        let _ = table.take_journal();

        // After the snapshot: a node only this driver named (a fresh kernel id, as 10 and 11
        // are the kernel's), handles that collide, forgets and a release.
        let c = lookup(&mut table, a, b"c", 10);
        assert_ne!(c, 10, "the kernel holds 10 already");
        let fh2 = open(&mut table, c, 0);
        let fh3 = open(&mut table, c, 0);
        let _ = table.forget(b, 1);
        let _ = table.release(fh, false, b);
        let _ = lookup(&mut table, a, b"c", 10);
        let _ = table.forget(c, 1);
        let records = table.take_journal();
        assert!(!records.is_empty());

        let mut successor = ObjectTable::from_snapshot(snapshot);
        successor.take_kernel_ids_as_drivers();
        assert_eq!(successor.replay(&records).unwrap(), 7);
        assert_eq!(kernel_side(&successor), kernel_side(&table));
        assert!(successor.is_consistent());
        assert!(successor.handles.contains_key(&(fh2, false)));
        assert!(successor.handles.contains_key(&(fh3, false)));
        // Nothing is noted while replaying, and nothing without a journal.
        assert!(successor.take_journal().is_empty());
    }

    #[test]
    fn a_replay_gives_each_committed_reply_back_once_by_its_request() {
        let mut table = ObjectTable::new();
        table.keep_journal();
        let a = lookup(&mut table, 1, b"a", 10);
        let mut open_out = 7u64.to_ne_bytes().to_vec();
        open_out.resize(16, 0);
        let open = PendingChange::Open {
            node: a,
            flags: 2,
            dir: false,
        };
        table.on_success(42, open, &mut open_out);
        let records = table.take_journal();

        let mut successor = ObjectTable::new();
        successor.replay(&records).unwrap();
        assert_eq!(successor.handles.len(), 1);
        // The kernel sends the request again with its resend bit set.
        let resent = 42 | UNIQUE_RESEND;
        assert_eq!(successor.take_replayed_reply(resent), Some(open_out));
        assert_eq!(successor.take_replayed_reply(resent), None, "given once");
        assert_eq!(successor.take_replayed_reply(43), None);
    }

    #[test]
    fn a_replay_keeps_only_the_latest_replies() {
        let mut table = ObjectTable::new();
        table.keep_journal();
        let count = REPLIES_KEPT as u64 + 10;
        for unique in 1..=count {
            let name = format!("n{unique}");
            table.on_success(
                unique,
                PendingChange::Entry {
                    parent: 1,
                    name: name.as_bytes().into(),
                },
                &mut super::super::tests::entry_reply(unique + 100),
            );
        }
        let mut successor = ObjectTable::new();
        successor.replay(&table.take_journal()).unwrap();
        assert!(successor.take_replayed_reply(1).is_none());
        assert!(successor.take_replayed_reply(count).is_some());
        assert!(successor.replayed_replies.order.len() < REPLIES_KEPT);
    }

    #[test]
    fn the_replies_kept_are_bounded_in_bytes_too() {
        let mut kept = ReplayedReplies::default();
        let big = REPLY_BYTES_KEPT / 4 + 1;
        for unique in 1..=4 {
            kept.keep(unique, vec![0; big]);
        }
        assert!(kept.bytes <= REPLY_BYTES_KEPT);
        assert!(kept.take(1).is_none(), "the oldest went");
        assert_eq!(kept.take(4 | UNIQUE_RESEND).map(|r| r.len()), Some(big));
        assert_eq!(kept.bytes, 2 * big);
    }

    #[test]
    fn an_unreadable_record_is_an_error_not_a_panic() {
        let mut table = ObjectTable::new();
        table.keep_journal();
        let _ = lookup(&mut table, 1, b"a", 10);
        let mut records = table.take_journal();
        let whole = records.len();
        records.extend_from_slice(&[9, 200, 1]);
        let err = ObjectTable::new().replay(&records).unwrap_err();
        assert_eq!(err.replayed, 1);
        assert!(ObjectTable::new().replay(&records[..whole - 1]).is_err());
    }
}
