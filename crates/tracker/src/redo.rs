//! The redo log (ODFT's checkpoint and log): the changes a driver acknowledged since it last
//! made its state durable, kept so a restarted driver can be brought forward to them.
//!
//! Some drivers lose acknowledged work when they die: fuse2fs keeps block bitmaps and recent
//! metadata in memory until it flushes, so after a crash its image lacks files the
//! applications were told exist. rebound records each successful mutation with the paths of
//! the nodes it names (at the time), asks the driver to flush now and then (a checkpoint),
//! drops what the checkpoint covers, and replays the rest, by path, in a restarted driver.
//!
//! Owns: the entries, the memory bound, and the choice of files a checkpoint can flush
//! through. Must not: do I/O (the proxy replays and checkpoints).

use std::collections::VecDeque;
use std::sync::Arc;

use fuse_wire::Opcode;

/// A path from the root, one name per component.
pub type Path = Vec<Box<[u8]>>;

/// One acknowledged change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mutation {
    /// The request in the kernel's ids.
    pub request: Arc<[u8]>,
    /// The path of each node id field of the request (in the order of
    /// `Request::id_fields`), or `None` for a node without one (unlinked while open): such a
    /// change cannot be replayed.
    pub paths: Vec<Option<Path>>,
    /// The inode number of the file the change is about when it was acknowledged: the file a
    /// name leads to (UNLINK, RMDIR, the source of RENAME), the file made (CREATE, MKDIR,
    /// ...), or the node changed (WRITE, SETATTR, ...); 0 if unknown. A name may lead to
    /// another file by the time of a replay.
    pub ino: u64,
}

/// Beyond this many bytes of entries, the log is dropped (and the loss reported): a driver
/// that cannot be checkpointed must not take rebound's memory with it.
const MAX_BYTES: usize = 256 << 20;
/// Files remembered as candidates to flush through.
const WRITTEN_KEPT: usize = 8;

/// The mutations since the last checkpoint.
#[derive(Debug, Default)]
pub struct RedoLog {
    entries: Vec<Mutation>,
    bytes: usize,
    /// Entries dropped by checkpoints or by overflow since the log began; the index of
    /// `entries[0]` in the whole history.
    dropped: u64,
    /// The log overflowed and was dropped since the last checkpoint.
    pub overflowed: bool,
    /// How many checkpoints have covered entries since the mount began: the entries follow
    /// the state of checkpoint number `checkpoints` (an image checkpoint's file is named by it).
    checkpoints: u64,
    /// Regular files lately written, most recent first: a checkpoint opens one to flush.
    written: VecDeque<u64>,
    /// A follower: a driver started on a copy of a checkpoint (a spare standby), brought
    /// forward apart from the serving driver. See [`RedoLog::follow_from_now`].
    follower: Option<Follower>,
}

/// Where a follower stands in the history, and the entries checkpoints covered that it lacks.
#[derive(Debug, Default)]
struct Follower {
    /// The index in the whole history of the first entry it lacks.
    position: u64,
    /// The entries from `position` that checkpoints dropped from the log.
    covered: Vec<Mutation>,
    bytes: usize,
}

/// Beyond this many bytes of entries kept for a follower, it is given up: one that far
/// behind is no quicker than a roll-back.
const MAX_FOLLOWER_BYTES: usize = 64 << 20;

/// Whether a successful request of `opcode` changes what the driver stores.
pub fn is_mutation(opcode: Opcode) -> bool {
    use Opcode::*;
    matches!(
        opcode,
        Create
            | Mknod
            | Mkdir
            | Symlink
            | Link
            | Unlink
            | Rmdir
            | Rename
            | Rename2
            | Setattr
            | Write
            | Fallocate
            | Setxattr
            | Removexattr
    )
}

/// A [`RedoLog`]'s entries as plain data, for a successor rebound that takes the mount over.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct RedoSnapshot {
    /// Oldest first.
    entries: Vec<MutationSnapshot>,
    overflowed: bool,
    #[serde(default)]
    checkpoints: u64,
}

/// `(request, the path of each id field, ino)`: a [`Mutation`] as plain data.
type MutationSnapshot = (Vec<u8>, Vec<Option<Vec<Vec<u8>>>>, u64);

impl RedoSnapshot {
    /// See [`RedoLog::checkpoints`].
    pub fn checkpoints(&self) -> u64 {
        self.checkpoints
    }

    /// A snapshot in postcard (a journal's), also one written before checkpoints were
    /// counted (by the rebound a package upgrade replaced, whose death a new one takes over).
    pub fn from_postcard(bytes: &[u8]) -> Result<RedoSnapshot, postcard::Error> {
        postcard::from_bytes(bytes).or_else(|e| {
            let (entries, overflowed) = postcard::from_bytes(bytes).map_err(|_| e)?;
            Ok(RedoSnapshot {
                entries,
                overflowed,
                checkpoints: 0,
            })
        })
    }
}

impl Mutation {
    fn to_plain(&self) -> MutationSnapshot {
        let path = |p: &Path| p.iter().map(|c| c.to_vec()).collect();
        let paths = self.paths.iter().map(|p| p.as_ref().map(path)).collect();
        (self.request.to_vec(), paths, self.ino)
    }

    fn from_plain((request, paths, ino): MutationSnapshot) -> Mutation {
        let paths = paths
            .into_iter()
            .map(|p| p.map(|p| p.into_iter().map(Vec::into_boxed_slice).collect()))
            .collect();
        Mutation {
            request: request.into(),
            paths,
            ino,
        }
    }
}

impl RedoLog {
    pub fn snapshot(&self) -> RedoSnapshot {
        RedoSnapshot {
            entries: self.entries.iter().map(Mutation::to_plain).collect(),
            overflowed: self.overflowed,
            checkpoints: self.checkpoints,
        }
    }

    pub fn from_snapshot(snapshot: RedoSnapshot) -> RedoLog {
        let mut log = RedoLog::default();
        for entry in snapshot.entries {
            log.record(Mutation::from_plain(entry));
        }
        log.overflowed |= snapshot.overflowed;
        log.checkpoints = snapshot.checkpoints;
        log
    }

    pub fn record(&mut self, mutation: Mutation) {
        self.bytes += mutation.request.len();
        self.entries.push(mutation);
        if self.bytes > MAX_BYTES {
            self.dropped += self.entries.len() as u64;
            self.entries.clear();
            self.bytes = 0;
            self.overflowed = true;
            self.follower = None;
        }
    }

    /// A follower starts, on a copy of the current checkpoint (number
    /// [`RedoLog::checkpoints`]): it lacks every entry, and what checkpoints cover from now on
    /// is kept for it until it has it ([`RedoLog::followed`]). Replaces any other follower.
    pub fn follow_from_now(&mut self) {
        self.follower = Some(Follower {
            position: self.dropped,
            ..Follower::default()
        });
    }

    /// The follower is gone (or became the driver): nothing more is kept for it.
    pub fn unfollow(&mut self) {
        self.follower = None;
    }

    /// What the follower lacks, oldest first, and the position it reaches with them; `None`
    /// without a follower (or one given up: see [`MAX_FOLLOWER_BYTES`]).
    pub fn lacking(&self) -> Option<(Vec<Mutation>, u64)> {
        let follower = self.follower.as_ref()?;
        let skip = follower.position.saturating_sub(self.dropped) as usize;
        let entries = follower
            .covered
            .iter()
            .chain(self.entries.iter().skip(skip));
        Some((entries.cloned().collect(), self.mark()))
    }

    /// Whether there is a follower (see [`RedoLog::follow_from_now`]).
    pub fn has_follower(&self) -> bool {
        self.follower.is_some()
    }

    /// How many entries the follower lacks (0 without one).
    pub fn lacking_len(&self) -> usize {
        self.follower.as_ref().map_or(0, |f| {
            let skip = f.position.saturating_sub(self.dropped) as usize;
            f.covered.len() + self.entries.len().saturating_sub(skip)
        })
    }

    /// The follower has been given every entry before `position` (from [`RedoLog::lacking`]).
    pub fn followed(&mut self, position: u64) {
        let dropped = self.dropped;
        let Some(follower) = &mut self.follower else {
            return;
        };
        let given = position.saturating_sub(follower.position);
        let from_covered = (given as usize).min(follower.covered.len());
        let bytes: usize = follower.covered[..from_covered]
            .iter()
            .map(|m| m.request.len())
            .sum();
        follower.covered.drain(..from_covered);
        follower.bytes -= bytes;
        follower.position = follower.position.max(position);
        debug_assert!(!follower.covered.is_empty() || follower.position >= dropped);
    }

    /// A position in the history: everything recorded before it is covered by a checkpoint
    /// started now.
    pub fn mark(&self) -> u64 {
        self.dropped + self.entries.len() as u64
    }

    /// The number of the checkpoint the entries follow (0: the state at the mount's start).
    pub fn checkpoints(&self) -> u64 {
        self.checkpoints
    }

    /// A checkpoint started at `mark` succeeded: what it covers is durable in the driver, and
    /// it is checkpoint number [`RedoLog::checkpoints`] from now on. Returns how many entries
    /// it covered.
    pub fn checkpointed(&mut self, mark: u64) -> usize {
        let covered = mark
            .saturating_sub(self.dropped)
            .min(self.entries.len() as u64) as usize;
        let bytes = self.entries[..covered]
            .iter()
            .map(|m| m.request.len())
            .sum::<usize>();
        self.bytes -= bytes;
        let first = self.dropped;
        let drained = self.entries.drain(..covered);
        if let Some(follower) = &mut self.follower {
            // (Those before its position it has already.)
            let skip = follower.position.saturating_sub(first) as usize;
            for mutation in drained.skip(skip) {
                follower.bytes += mutation.request.len();
                follower.covered.push(mutation);
            }
            if follower.bytes > MAX_FOLLOWER_BYTES {
                self.follower = None;
            }
        }
        self.dropped += covered as u64;
        self.overflowed = false;
        self.checkpoints += 1;
        covered
    }

    /// One entry as bytes, for a journal that outlives rebound (see [`RedoLog::replay`]).
    pub fn journal_entry(mutation: &Mutation) -> Vec<u8> {
        postcard::to_stdvec(&mutation.to_plain()).unwrap_or_default()
    }

    /// Records an entry written by [`RedoLog::journal_entry`].
    pub fn replay(&mut self, bytes: &[u8]) -> Result<(), postcard::Error> {
        self.record(Mutation::from_plain(postcard::from_bytes(bytes)?));
        Ok(())
    }

    /// A checkpoint covered the `count` oldest entries (as [`RedoLog::checkpointed`] said).
    pub fn forget_oldest(&mut self, count: usize) {
        let _ = self.checkpointed(self.dropped + count as u64);
    }

    /// The entries to replay, oldest first. They stay until a checkpoint of the new driver
    /// covers them: until then, it could lose them too.
    pub fn entries(&self) -> Vec<Mutation> {
        self.entries.clone()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The kernel's `node` was just written (it is a regular file).
    pub fn note_written(&mut self, node: u64) {
        if self.written.front() != Some(&node) {
            self.written.retain(|&n| n != node);
            self.written.push_front(node);
            self.written.truncate(WRITTEN_KEPT);
        }
    }

    /// Files a checkpoint can open to flush through, most recently written first.
    pub fn flush_candidates(&self) -> Vec<u64> {
        self.written.iter().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mutation(len: usize) -> Mutation {
        Mutation {
            request: vec![0u8; len].into(),
            paths: Vec::new(),
            ino: 0,
        }
    }

    #[test]
    fn a_checkpoint_drops_what_came_before_it_only() {
        let mut log = RedoLog::default();
        log.record(mutation(10));
        log.record(mutation(20));
        let mark = log.mark();
        log.record(mutation(30));
        log.checkpointed(mark);
        assert_eq!(log.len(), 1);
        assert_eq!(log.entries()[0].request.len(), 30);
        // A stale mark covers nothing more.
        log.checkpointed(mark);
        assert_eq!(log.len(), 1);
    }

    #[test]
    fn a_snapshot_brings_back_the_same_entries() {
        let mut log = RedoLog::default();
        log.record(mutation(100));
        let mut named = mutation(50);
        named.paths = vec![Some(vec![b"d"[..].into(), b"f"[..].into()]), None];
        named.ino = 9;
        log.record(named);
        let json = serde_json::to_string(&log.snapshot()).unwrap();
        let back = RedoLog::from_snapshot(serde_json::from_str(&json).unwrap());
        assert_eq!(back.entries(), log.entries());
        assert_eq!(back.bytes, log.bytes);
    }

    #[test]
    fn the_checkpoint_the_entries_follow_is_counted_through_snapshots_and_journals() {
        let mut log = RedoLog::default();
        log.record(mutation(10));
        log.checkpointed(log.mark());
        log.record(mutation(20));
        assert_eq!(log.checkpoints(), 1);
        let mut back = RedoLog::from_snapshot(log.snapshot());
        assert_eq!(back.checkpoints(), 1);
        assert_eq!(back.snapshot().checkpoints(), 1);
        // A journal's checkpoint record, read back, counts as the checkpoint did.
        back.forget_oldest(1);
        assert_eq!((back.checkpoints(), back.len()), (2, 0));
        // In postcard, as a journal holds it, and as it was before the count.
        let bytes = postcard::to_stdvec(&log.snapshot()).unwrap();
        assert_eq!(
            RedoSnapshot::from_postcard(&bytes).unwrap().checkpoints(),
            1
        );
        let plain: Vec<MutationSnapshot> = log.entries.iter().map(Mutation::to_plain).collect();
        let older = postcard::to_stdvec(&(plain, false)).unwrap();
        let read = RedoSnapshot::from_postcard(&older).unwrap();
        assert_eq!((read.entries.len(), read.checkpoints()), (1, 0));
    }

    #[test]
    fn a_follower_lacks_what_came_since_its_position_through_checkpoints() {
        let lengths = |log: &RedoLog| {
            log.lacking()
                .map(|(e, _)| e.iter().map(|m| m.request.len()).collect::<Vec<_>>())
        };
        let mut log = RedoLog::default();
        log.record(mutation(1));
        log.checkpointed(log.mark());
        assert_eq!(lengths(&log), None, "no follower");
        log.follow_from_now();
        log.record(mutation(2));
        log.checkpointed(log.mark());
        log.record(mutation(3));
        assert_eq!(lengths(&log), Some(vec![2, 3]));
        assert_eq!(log.lacking_len(), 2);
        // Given both; the next checkpoint covers 3, which it has: nothing is kept.
        let (_, position) = log.lacking().unwrap();
        log.followed(position);
        log.record(mutation(4));
        log.checkpointed(log.mark());
        log.record(mutation(5));
        assert_eq!(lengths(&log), Some(vec![4, 5]));
        // Given 4 only (the position before 5 was recorded), then a checkpoint covers 5.
        log.followed(position + 1);
        log.checkpointed(log.mark());
        assert_eq!(lengths(&log), Some(vec![5]));
        log.unfollow();
        assert_eq!(lengths(&log), None);
        assert_eq!(log.lacking_len(), 0);
    }

    #[test]
    fn the_log_is_bounded() {
        let mut log = RedoLog::default();
        for _ in 0..3 {
            log.record(mutation(MAX_BYTES / 2));
        }
        assert!(log.overflowed);
        assert!(log.len() < 3);
    }

    #[test]
    fn written_files_are_remembered_most_recent_first() {
        let mut log = RedoLog::default();
        for node in [5, 6, 5, 7] {
            log.note_written(node);
        }
        assert_eq!(log.flush_candidates(), vec![7, 5, 6]);
    }
}
