//! Checkpoints (ODFT): every `checkpoint_interval_ms` while the redo log holds changes, as soon
//! as it holds `checkpoint_changes` (what a recovery replays, and so its time, is bounded by
//! that, at the cost of more checkpoints under heavy writes), and right after each recovery,
//! the serving driver is made to flush what it keeps in memory (an FSYNC through a file lately
//! written: fuse2fs then flushes everything), and the redo log
//! drops the changes that made durable.
//!
//! With an image checkpoint ([`crate::checkpoint`]), what is durable is the clone, not the
//! image: requests are held from before the FSYNC until the clone is made (the driver may
//! have nothing in flight then, or the clone could hold half a change), and the changes before
//! it are dropped only once the clone exists.
//!
//! A standby successor may be started on a spare of the image's current checkpoint: the redo
//! log then keeps, for it, what later checkpoints cover, and a thread here gives it every
//! acknowledged change a few milliseconds later (`follow`).
//!
//! Owns: when checkpoints happen, the quiet around them, and the redo log's part in a spare.
//! Must not: replay (see [`super::recovery`]) or clone files itself.

use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

use super::{lock, recovery, Link, Proxy, Shared};
use crate::checkpoint::ImageCheckpoint;

impl Proxy {
    /// Makes a spare of the image's current checkpoint (see [`ImageCheckpoint::make_spare`])
    /// and has the redo log keep what it lacks: `(checkpoint number, spare)`. `None` without
    /// an image and a redo log.
    pub fn make_spare(&self) -> Option<std::io::Result<(u64, PathBuf)>> {
        let (Some(image), Some(redo)) = (&self.shared.image, &self.shared.redo) else {
            return None;
        };
        Some(image.checkpoint.make_spare(|number| {
            let mut log = redo.lock().unwrap_or_else(|e| e.into_inner());
            debug_assert_eq!(log.checkpoints(), number);
            log.follow_from_now();
        }))
    }

    /// The standby on the spare answered its INIT: from now on, it is given the changes the
    /// serving driver acknowledges, a few milliseconds later, through `channel` (a copy of
    /// rebound's end).
    pub fn follow_spare_with(&self, channel: OwnedFd) {
        *lock(&self.shared.spare_standby) = Some(recovery::Follower::new(channel));
    }

    /// At a failure: the standby on the spare is no longer brought forward (waiting for the
    /// change under way, after which the follower's batch ends). Returns how many logged changes it lacks, if the redo log still
    /// holds them, and how many a driver on the image rolled back would lack.
    pub fn stop_following_spare(&self) -> Option<(usize, usize)> {
        self.shared.spare_wanted.store(true, Ordering::Relaxed);
        lock(&self.shared.spare_standby).take();
        self.shared.spare_wanted.store(false, Ordering::Relaxed);
        let log = lock(self.shared.redo.as_ref()?);
        log.lacking()
            .is_some()
            .then(|| (log.lacking_len(), log.len()))
    }

    /// The spare is no longer needed: removed, and the redo log keeps no more for it.
    pub fn drop_spare(&self) {
        lock(&self.shared.spare_standby).take();
        if let (Some(image), Some(redo)) = (&self.shared.image, &self.shared.redo) {
            lock(redo).unfollow();
            image.checkpoint.remove_spare();
        }
    }

    /// Whether the redo log still holds what the standby on the spare lacks.
    pub fn spare_followed(&self) -> bool {
        let Some(redo) = &self.shared.redo else {
            return false;
        };
        lock(redo).has_follower()
    }

    /// The number of the checkpoint the redo log follows, with a redo log.
    pub fn checkpoint_number(&self) -> Option<u64> {
        let redo = self.shared.redo.as_ref()?;
        Some(redo.lock().unwrap_or_else(|e| e.into_inner()).checkpoints())
    }

    /// Whether the redo log is empty (or there is none).
    pub fn redo_log_empty(&self) -> bool {
        self.shared
            .redo
            .as_ref()
            .is_none_or(|redo| redo.lock().unwrap_or_else(|e| e.into_inner()).is_empty())
    }
}

/// An image checkpoint and the gate around it: requests go to the driver through its read
/// side, and a checkpoint holds its write side while the driver must have nothing to do.
pub(super) struct ImageGate {
    checkpoint: Arc<ImageCheckpoint>,
    gate: RwLock<()>,
}

impl ImageGate {
    pub(super) fn new(checkpoint: Arc<ImageCheckpoint>) -> ImageGate {
        ImageGate {
            checkpoint,
            gate: RwLock::new(()),
        }
    }

    /// Held by a request on its way to the driver (or to its parking place).
    pub(super) fn pass(&self) -> RwLockReadGuard<'_, ()> {
        self.gate.read().unwrap_or_else(|e| e.into_inner())
    }
}

/// How long requests may be held while the driver finishes those it has, before the
/// checkpoint is put off.
const DRAIN_LIMIT: Duration = Duration::from_millis(100);

/// Wakes the checkpointer before its interval is up.
#[derive(Default)]
pub(super) struct CheckpointDue {
    due: Mutex<bool>,
    woken: Condvar,
    /// The redo log's length that calls for a checkpoint (0: none does).
    changes: usize,
}

impl CheckpointDue {
    pub(super) fn new(changes: usize) -> CheckpointDue {
        CheckpointDue {
            changes,
            ..CheckpointDue::default()
        }
    }

    /// The redo log now holds `len` changes. Wakes the checkpointer at each further
    /// `changes` of them (not at every change: this runs on the request path, and a put-off
    /// checkpoint is asked for again `changes` later, or by the interval).
    pub(super) fn logged(&self, len: usize) {
        if self.changes != 0 && len >= self.changes && len.is_multiple_of(self.changes) {
            self.soon();
        }
    }

    /// A checkpoint should come now (a recovery just replayed the redo log).
    pub(super) fn soon(&self) {
        *self.due.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.woken.notify_one();
    }

    /// Waits until `interval` has passed or a checkpoint is asked for.
    fn wait(&self, interval: Duration) {
        let due = self.due.lock().unwrap_or_else(|e| e.into_inner());
        let (mut due, _) = self
            .woken
            .wait_timeout_while(due, interval, |due| !*due)
            .unwrap_or_else(|e| e.into_inner());
        *due = false;
    }
}

/// The checkpointer's loop; runs for as long as rebound does.
pub(super) fn run(shared: &Shared, interval: Duration, timeout: Duration) {
    let Some(redo) = &shared.redo else {
        return;
    };
    loop {
        shared.checkpoint_due.wait(interval);
        if redo.lock().unwrap_or_else(|e| e.into_inner()).is_empty() {
            continue;
        }
        // With an image checkpoint, no request may reach the driver from here until the clone.
        let quiet = shared.image.as_ref().map(|image| {
            let held = image.gate.write().unwrap_or_else(|e| e.into_inner());
            (held, &image.checkpoint)
        });
        let started = Instant::now();
        let (driver, generation) = match &*shared.link() {
            Link::Serving { driver, generation } => (driver.clone(), *generation),
            _ => continue,
        };
        if quiet.is_some() && !drained(shared, started + DRAIN_LIMIT.min(timeout)) {
            tracing::debug!("checkpoint put off: requests still in flight");
            continue;
        }
        // Only this thread checkpoints: the number the log counts after this one holds.
        let (mark, candidates, number) = {
            let log = redo.lock().unwrap_or_else(|e| e.into_inner());
            (log.mark(), log.flush_candidates(), log.checkpoints() + 1)
        };
        let rollbacks = quiet.as_ref().map(|(_, image)| image.rollbacks());
        let covered = || {
            let mut log = redo.lock().unwrap_or_else(|e| e.into_inner());
            let covered = log.checkpointed(mark);
            if let Some(journal) = shared.journal.get() {
                journal.note_checkpoint(covered);
            }
            shared
                .stats
                .redo_entries
                .store(log.len() as u64, Ordering::Relaxed);
        };
        let flushed = candidates.into_iter().any(|node| {
            matches!(
                recovery::flush_through(shared, &driver, generation, timeout, node),
                Ok(true)
            )
        });
        if !flushed {
            continue;
        }
        match quiet.as_ref().zip(rollbacks) {
            Some(((_, image), rollbacks)) => match image.take(rollbacks, number, covered) {
                Ok(Some(_)) => {}
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!("checkpoint: cloning the image: {e}");
                    continue;
                }
            },
            None => covered(),
        }
        drop(quiet);
        let held_us = started.elapsed().as_micros() as u64;
        shared.stats.checkpoints.fetch_add(1, Ordering::Relaxed);
        shared
            .stats
            .checkpoint_us_max
            .fetch_max(held_us, Ordering::Relaxed);
        tracing::debug!(
            "checkpoint in {held_us} µs: {} changes left in the redo log",
            shared.stats.redo_entries.load(Ordering::Relaxed)
        );
    }
}

/// How often the follower looks for changes when the standby on the spare lacks none (with
/// a backlog it goes on at once: the longer a batch waits, the more a failure replays).
const FOLLOW_INTERVAL: Duration = Duration::from_millis(2);
/// At most this many changes at a time (a failure cuts a batch short after the change under
/// way; the longer a batch, the fewer lookups from the root).
const FOLLOW_BATCH: usize = 256;

/// The follower's loop (runs for as long as rebound does, with an image): gives the standby
/// on the spare, if there is one to follow, the changes acknowledged since it was last given
/// some (at most [`FOLLOW_BATCH`] at a time), so that a failure finds it lacking only the
/// last batch's (a roll-back lacks everything since the last checkpoint). A standby that
/// cannot take them is followed no more, and does not take over.
pub(super) fn follow(shared: &Shared, timeout: Duration) {
    let Some(redo) = &shared.redo else {
        return;
    };
    let mut idle = true;
    loop {
        // (A failure waiting for the standby gets it before the next batch.)
        if idle || shared.spare_wanted.load(Ordering::Relaxed) {
            std::thread::sleep(FOLLOW_INTERVAL);
        }
        idle = true;
        let mut spare = lock(&shared.spare_standby);
        let lacks = spare.as_ref().map_or(0, |_| lock(redo).lacking_len());
        shared
            .stats
            .standby_lacks
            .store(lacks as u64, Ordering::Relaxed);
        let Some(follower) = spare.as_mut() else {
            continue;
        };
        let Some((mut entries, end)) = lock(redo).lacking().filter(|(e, _)| !e.is_empty()) else {
            continue;
        };
        idle = false;
        // (What it lacks runs up to `end`.)
        let start = end - entries.len() as u64;
        entries.truncate(FOLLOW_BATCH);
        let started = Instant::now();
        match follower.give(shared, timeout, &entries, &shared.spare_wanted) {
            Ok(done) => {
                lock(redo).followed(start + done as u64);
                tracing::trace!(
                    "standby given {done} changes in {} µs",
                    started.elapsed().as_micros()
                );
            }
            Err(e) => {
                tracing::warn!("bringing the standby forward: {e}; it will not take over");
                *spare = None;
                lock(redo).unfollow();
            }
        }
    }
}

/// Waits until the driver has answered every request sent to it (new ones are held by the
/// gate), up to `deadline`.
fn drained(shared: &Shared, deadline: Instant) -> bool {
    while shared.inflight.oldest_sent().is_some() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    true
}
