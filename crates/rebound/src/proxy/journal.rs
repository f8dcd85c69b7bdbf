//! The tracker's journal on disk (`RUN_DIR/PID.journal/`), where it outlives rebound: what a
//! successor needs to take the mount over when rebound dies without a hand-over (SIGKILL; see
//! `supervisor::keeper`).
//!
//! Each file `journal.N` is a sequence of frames (`u32` length, kind, bytes): a snapshot of
//! the object table first (and of the redo log, if one is kept), then the tracker's records
//! (see `tracker::objects::journal`), the redo log's entries and checkpoints, and the
//! kernel's INIT and the root's attributes as they change. A table's records are written
//! while its lock is held, before the reply that made them goes to the kernel, so the file is
//! never behind what the kernel was told (beside the path, where the kernel has each reply
//! before rebound sees it, an observed batch is written at its end). When a file grows past
//! [`COMPACT_AT`], the next one starts with a new snapshot, and only then is the old one
//! removed: a reader takes the newest file whose snapshot is whole. The replies of the latest
//! records go over to the new file (as `tracker::reply_records`), since a reply may still be on
//! its way to the kernel. A frame cut short by rebound's death is the last, and is ignored (its
//! reply never reached the kernel).
//!
//! Owns: the files' form, writing and reading them. Must not: decide what is journaled (the
//! tracker does) or when a successor reads it (the keeper does).

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use tracker::{Mutation, ObjectSnapshot, ObjectTable, RedoLog, RedoSnapshot};

use super::{lock, Shared};

/// A file is started anew, with a snapshot, past this size.
const COMPACT_AT: u64 = 32 << 20;

/// How many of the latest flushes' records, and how many bytes of them at most, a new file
/// takes the replies of. A reply is committed and not yet written only for the requests
/// rebound is answering (one per reader thread, and recovery's): a handful of flushes.
const RECENT_FLUSHES: usize = 16;
const RECENT_BYTES: usize = 8 << 20;

const SNAPSHOT: u8 = 1;
const RECORDS: u8 = 2;
/// The kernel's INIT request (as kept for new drivers) after the negotiated minor (`u32`).
const INIT: u8 = 3;
const ROOT_ATTR: u8 = 4;
const REDO_SNAPSHOT: u8 = 5;
const REDO_ENTRY: u8 = 6;
/// A checkpoint covered this many of the redo log's oldest entries (`u64`).
const REDO_CHECKPOINT: u8 = 7;
/// The snapshot's handles given again (`ObjectSnapshot::reissued`), right after the snapshot
/// when there are any: the snapshot frame keeps the layout older rebounds wrote and read.
const REISSUED: u8 = 8;

/// The journal being written.
pub(super) struct Journal {
    dir: PathBuf,
    file: Mutex<Current>,
}

struct Current {
    file: File,
    number: u64,
    size: u64,
    /// A write failed (logged once): the journal is no longer trusted, or written.
    failed: bool,
    recent: RecentRecords,
}

/// The records of the latest flushes, newest last, bounded by [`RECENT_FLUSHES`] and
/// [`RECENT_BYTES`].
#[derive(Default)]
struct RecentRecords {
    flushes: VecDeque<Vec<u8>>,
    bytes: usize,
}

impl RecentRecords {
    fn keep(&mut self, records: Vec<u8>) {
        self.bytes += records.len();
        self.flushes.push_back(records);
        while self.flushes.len() > RECENT_FLUSHES || self.bytes > RECENT_BYTES {
            let Some(oldest) = self.flushes.pop_front() else {
                break;
            };
            self.bytes -= oldest.len();
        }
    }

    /// Their replies, as records that change nothing when replayed.
    fn replies(&self) -> Vec<u8> {
        self.flushes
            .iter()
            .flat_map(|records| tracker::reply_records(records))
            .collect()
    }
}

/// What a journal gives back.
pub struct Journaled {
    /// In the form of a table built by observation (see `tracker::objects::journal`).
    pub objects: ObjectTable,
    pub init: Option<Vec<u8>>,
    pub minor: u32,
    pub root_attr: Option<Vec<u8>>,
    /// The redo log, if one was kept.
    pub redo: Option<RedoLog>,
}

fn file_path(dir: &Path, number: u64) -> PathBuf {
    dir.join(format!("journal.{number}"))
}

fn frame(kind: u8, bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() + 5);
    out.extend_from_slice(&u32::try_from(bytes.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.push(kind);
    out.extend_from_slice(bytes);
    out
}

impl Journal {
    /// Starts the journal in `dir` (emptied first) with a snapshot of `table`, which notes
    /// its changes from now on.
    pub(super) fn create(dir: &Path, table: &mut ObjectTable, shared: &Shared) -> io::Result<Self> {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir)?;
        table.keep_journal();
        let _ = table.take_journal();
        let redo = shared.redo.as_ref().map(lock);
        let (file, size) = start_file(dir, 0, &table.snapshot(), redo.as_deref(), &[], shared)?;
        Ok(Journal {
            dir: dir.to_path_buf(),
            file: Mutex::new(Current {
                file,
                number: 0,
                size,
                failed: false,
                recent: RecentRecords::default(),
            }),
        })
    }

    /// Writes what `table` noted since the last call (its lock is held by the caller).
    pub(super) fn flush(&self, table: &mut ObjectTable, shared: &Shared) {
        let records = table.take_journal();
        if records.is_empty() {
            return;
        }
        self.append(RECORDS, &records);
        let due = {
            let mut current = lock(&self.file);
            current.recent.keep(records);
            current.size > COMPACT_AT && !current.failed
        };
        if due {
            self.start_anew(&table.snapshot(), shared);
        }
    }

    pub(super) fn note_init(&self, minor: u32, request: &[u8]) {
        let mut bytes = minor.to_le_bytes().to_vec();
        bytes.extend_from_slice(request);
        self.append(INIT, &bytes);
    }

    pub(super) fn note_root_attr(&self, attr: &[u8]) {
        self.append(ROOT_ATTR, attr);
    }

    /// An entry of the redo log (its lock held by the caller, as for the next two).
    pub(super) fn note_mutation(&self, mutation: &Mutation) {
        self.append(REDO_ENTRY, &RedoLog::journal_entry(mutation));
    }

    pub(super) fn note_checkpoint(&self, covered: usize) {
        self.append(REDO_CHECKPOINT, &(covered as u64).to_le_bytes());
    }

    fn append(&self, kind: u8, bytes: &[u8]) {
        let mut current = lock(&self.file);
        if current.failed {
            return;
        }
        let frame = frame(kind, bytes);
        match current.file.write_all(&frame) {
            Ok(()) => current.size += frame.len() as u64,
            Err(e) => {
                current.failed = true;
                tracing::error!(
                    "writing the tracker's journal in {}: {e}; should rebound itself die, \
                     the mount is lost",
                    self.dir.display()
                );
            }
        }
    }

    /// The next file, from a snapshot; the old one is removed once it is written.
    fn start_anew(&self, snapshot: &ObjectSnapshot, shared: &Shared) {
        // Locks in the order of the writers: the table's (held by the caller), the redo log's,
        // the file's.
        let redo = shared.redo.as_ref().map(lock);
        let mut current = lock(&self.file);
        let number = current.number + 1;
        let replies = current.recent.replies();
        match start_file(
            &self.dir,
            number,
            snapshot,
            redo.as_deref(),
            &replies,
            shared,
        ) {
            Ok((file, size)) => {
                let recent = std::mem::take(&mut current.recent);
                let old = std::mem::replace(
                    &mut *current,
                    Current {
                        file,
                        number,
                        size,
                        failed: false,
                        recent,
                    },
                );
                let _ = std::fs::remove_file(file_path(&self.dir, old.number));
            }
            Err(e) => tracing::warn!(
                "starting the tracker's journal anew in {}: {e}; it keeps growing",
                self.dir.display()
            ),
        }
    }

    /// Removes the journal (the run ended: nothing is left to take over).
    pub(super) fn remove(&self) {
        lock(&self.file).failed = true;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The snapshot's frames: the snapshot, then the handles given again if there are any.
fn snapshot_frames(snapshot: &ObjectSnapshot) -> io::Result<Vec<u8>> {
    let encoded = postcard::to_stdvec(snapshot).map_err(io::Error::other)?;
    let mut bytes = frame(SNAPSHOT, &encoded);
    if !snapshot.reissued().is_empty() {
        let encoded = postcard::to_stdvec(snapshot.reissued()).map_err(io::Error::other)?;
        bytes.extend(frame(REISSUED, &encoded));
    }
    Ok(bytes)
}

/// A journal file of `snapshot` and the table's `records` after it (for tests elsewhere).
#[cfg(test)]
pub(super) fn file_of(snapshot: &ObjectSnapshot, records: &[u8]) -> Vec<u8> {
    let mut bytes = snapshot_frames(snapshot).unwrap();
    bytes.extend(frame(RECORDS, records));
    bytes
}

/// Writes `journal.NUMBER` with the snapshot, what the proxy keeps beside the table, and the
/// `replies` carried over from the file before.
fn start_file(
    dir: &Path,
    number: u64,
    snapshot: &ObjectSnapshot,
    redo: Option<&RedoLog>,
    replies: &[u8],
    shared: &Shared,
) -> io::Result<(File, u64)> {
    let mut bytes = snapshot_frames(snapshot)?;
    if let Some(redo) = redo {
        let encoded = postcard::to_stdvec(&redo.snapshot()).map_err(io::Error::other)?;
        bytes.extend(frame(REDO_SNAPSHOT, &encoded));
    }
    if let Some(init) = lock(&shared.init).as_deref() {
        let mut init_bytes = shared.minor().to_le_bytes().to_vec();
        init_bytes.extend_from_slice(init);
        bytes.extend(frame(INIT, &init_bytes));
    }
    if let Some(attr) = lock(&shared.root_attr).as_deref() {
        bytes.extend(frame(ROOT_ATTR, attr));
    }
    if !replies.is_empty() {
        bytes.extend(frame(RECORDS, replies));
    }
    let mut file = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(file_path(dir, number))?;
    file.write_all(&bytes)?;
    Ok((file, bytes.len() as u64))
}

/// Reads the journal in `dir`: the newest file whose snapshot is whole, replayed.
pub fn read(dir: &Path) -> io::Result<Journaled> {
    let mut numbers: Vec<u64> = std::fs::read_dir(dir)?
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_prefix("journal.")?
                .parse()
                .ok()
        })
        .collect();
    numbers.sort_unstable_by(|a, b| b.cmp(a));
    let mut last_error = None;
    for number in numbers {
        let bytes = std::fs::read(file_path(dir, number))?;
        match read_file(&bytes) {
            Ok(journaled) => return Ok(journaled),
            Err(e) => last_error = Some(format!("journal.{number}: {e}")),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidData,
        last_error.unwrap_or_else(|| format!("{}: no journal", dir.display())),
    ))
}

fn read_file(mut bytes: &[u8]) -> Result<Journaled, String> {
    let mut frames = Vec::new();
    while bytes.len() >= 5 {
        let len = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
        let Some(body) = bytes.get(5..5 + len) else {
            break; // cut short by rebound's death: its reply never went out
        };
        frames.push((bytes[4], body));
        bytes = &bytes[5 + len..];
    }
    let Some((SNAPSHOT, snapshot)) = frames.first().copied() else {
        return Err("no whole snapshot".into());
    };
    let mut snapshot: ObjectSnapshot =
        postcard::from_bytes(snapshot).map_err(|e| format!("snapshot: {e}"))?;
    let mut frames = frames.into_iter().skip(1).peekable();
    if let Some(&(REISSUED, body)) = frames.peek() {
        snapshot.set_reissued(
            postcard::from_bytes(body).map_err(|e| format!("handles given again: {e}"))?,
        );
        frames.next();
    }
    let mut journaled = Journaled {
        objects: ObjectTable::from_snapshot(snapshot),
        init: None,
        minor: 0,
        root_attr: None,
        redo: None,
    };
    journaled.objects.take_kernel_ids_as_drivers();
    for (kind, body) in frames {
        match kind {
            RECORDS => {
                journaled.objects.replay(body).map_err(|e| e.to_string())?;
            }
            INIT if body.len() >= 4 => {
                journaled.minor = u32::from_le_bytes([body[0], body[1], body[2], body[3]]);
                journaled.init = Some(body[4..].to_vec());
            }
            ROOT_ATTR => journaled.root_attr = Some(body.to_vec()),
            REDO_SNAPSHOT => {
                let snapshot =
                    RedoSnapshot::from_postcard(body).map_err(|e| format!("redo log: {e}"))?;
                journaled.redo = Some(RedoLog::from_snapshot(snapshot));
            }
            REDO_ENTRY => journaled
                .redo
                .get_or_insert_with(RedoLog::default)
                .replay(body)
                .map_err(|e| format!("redo log entry: {e}"))?,
            REDO_CHECKPOINT if body.len() == 8 => {
                let mut count = [0u8; 8];
                count.copy_from_slice(body);
                if let Some(redo) = &mut journaled.redo {
                    redo.forget_oldest(u64::from_le_bytes(count) as usize);
                }
            }
            other => return Err(format!("unknown frame kind {other}")),
        }
    }
    Ok(journaled)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_cut_short_is_left_out_and_a_file_without_a_snapshot_is_refused() {
        let snapshot = postcard::to_stdvec(&ObjectTable::new().snapshot()).unwrap();
        let mut bytes = frame(SNAPSHOT, &snapshot);
        bytes.extend(frame(ROOT_ATTR, b"attr"));
        let whole = bytes.len();
        bytes.extend(frame(ROOT_ATTR, b"newer attr"));
        let journaled = read_file(&bytes[..bytes.len() - 1]).unwrap();
        assert_eq!(journaled.root_attr.as_deref(), Some(&b"attr"[..]));
        assert_eq!(
            read_file(&bytes).unwrap().root_attr.as_deref(),
            Some(&b"newer attr"[..])
        );
        assert!(read_file(&bytes[5..whole]).is_err());
        assert!(read_file(&[]).is_err());
    }

    /// What `flush` journals for an OPEN of `node` answered with `fh`, request `unique`.
    fn opened(table: &mut ObjectTable, unique: u64, node: u64, fh: u64) -> (Vec<u8>, Vec<u8>) {
        let mut reply = fh.to_ne_bytes().to_vec();
        reply.resize(16, 0);
        let open = tracker::PendingChange::Open {
            node,
            flags: 2,
            dir: false,
        };
        table.on_success(unique, open, &mut reply.clone());
        (table.take_journal(), reply)
    }

    #[test]
    fn a_new_file_keeps_the_latest_replies_and_applies_their_changes_once() {
        let mut table = ObjectTable::new();
        table.set_kernel_holds_driver_handles(true);
        table.keep_journal();
        let mut recent = RecentRecords::default();
        let mut replies = Vec::new();
        for k in 0..RECENT_FLUSHES as u64 + 4 {
            let (records, reply) = opened(&mut table, 100 + k, 5 + k, 70 + k);
            recent.keep(records);
            replies.push((100 + k, reply));
        }
        // The journal compacted right after the last commit: the new file is the snapshot,
        // which holds every change, and the replies carried over.
        let mut bytes = snapshot_frames(&table.snapshot()).unwrap();
        bytes.extend(frame(RECORDS, &recent.replies()));
        let mut successor = read_file(&bytes).unwrap().objects;
        for (unique, _) in &replies[..4] {
            assert_eq!(
                successor.take_replayed_reply(*unique),
                None,
                "older than kept"
            );
        }
        for (unique, reply) in &replies[4..] {
            let resent = unique | fuse_wire::abi::UNIQUE_RESEND;
            assert_eq!(successor.take_replayed_reply(resent).as_ref(), Some(reply));
        }
        let last = RECENT_FLUSHES as u64 + 3;
        assert!(
            !successor.releases_an_earlier_use(70 + last, false, 5 + last),
            "the change was applied again over the snapshot"
        );
        // Carrying the records themselves over would have applied it twice.
        let mut twice = snapshot_frames(&table.snapshot()).unwrap();
        twice.extend(frame(RECORDS, &recent.flushes[RECENT_FLUSHES - 1]));
        assert!(read_file(&twice).unwrap().objects.releases_an_earlier_use(
            70 + last,
            false,
            5 + last
        ));
    }

    #[test]
    fn handles_given_again_cross_the_journal_and_an_older_journal_still_reads() {
        // A fast-mode driver gives fh 70 to node 6 before node 5's use of it is released.
        let mut table = ObjectTable::new();
        table.set_kernel_holds_driver_handles(true);
        for node in [5, 6] {
            let mut reply = 70u64.to_ne_bytes().to_vec();
            reply.resize(16, 0);
            let open = tracker::PendingChange::Open {
                node,
                flags: 2,
                dir: false,
            };
            table.on_success(0, open, &mut reply);
        }
        let snapshot = table.snapshot();
        assert!(!snapshot.reissued().is_empty());
        let journaled = read_file(&snapshot_frames(&snapshot).unwrap()).unwrap();
        assert!(journaled.objects.releases_an_earlier_use(70, false, 5));
        // What a rebound before the frame of its own wrote: the snapshot frame alone, in the
        // same layout.
        let older = frame(SNAPSHOT, &postcard::to_stdvec(&snapshot).unwrap());
        let journaled = read_file(&older).unwrap();
        assert!(!journaled.objects.releases_an_earlier_use(70, false, 5));
        assert!(journaled.objects.handle_to_driver(70, false) != tracker::ToDriver::Unknown);
    }
}
