//! The redo log's replay: bringing a restarted driver forward by the changes its predecessor
//! acknowledged since the last checkpoint, applied again by path, and walking paths in a driver
//! with lookups of rebound's own (given back afterwards).
//!
//! Owns: what is applied, what is left out and why (logged by reason). Must not: decide when a
//! replay happens (see `restore`) or what is logged (see `tracker::redo`).

use std::collections::HashMap;
use std::io;

use fuse_wire::abi::size;
use fuse_wire::ids::{
    forget_request, fsync_request, read_u64, truncate_request, unlink_request, write_u64,
};
use fuse_wire::{Opcode, ReplyShape, Request};
use tracker::PendingChange;

use super::NewDriver;

/// Walks paths in a driver during a replay, remembering what it found (node, inode number)
/// and the lookups it made the driver hand out (forgotten at the end).
#[derive(Default)]
pub(super) struct Walker {
    pub(super) found: HashMap<tracker::redo::Path, (u64, u64)>,
    pub(super) lookups: HashMap<u64, u64>,
    /// Whether the driver's inode numbers survived the restart, so that they tell whether a
    /// name still leads to the file a logged change was about.
    pub(super) numbers_kept: bool,
    /// Inode numbers of files the replay made again: logged number → the new file's.
    pub(super) renumbered: HashMap<u64, u64>,
    /// Handles the replay opened for writing, kept for the next writes to the same file
    /// (driver node → handle, flags): closed before a name is removed, and at the end.
    pub(super) writable: HashMap<u64, (u64, u32)>,
}

impl Walker {
    /// Forgets what was found at `path` and below (it was removed or renamed).
    pub(super) fn forget_path(&mut self, path: Option<&tracker::redo::Path>, name: &[u8]) {
        match path {
            Some(dir) => self.found.retain(|found, _| {
                !(found.len() > dir.len() && found.starts_with(dir) && *found[dir.len()] == *name)
            }),
            None => self.found.clear(),
        }
    }

    /// Whether `ino` (found now) is the file logged as `logged`; true when that cannot be told.
    pub(super) fn same_file(&self, logged: u64, ino: u64) -> bool {
        !self.numbers_kept
            || logged == 0
            || ino == 0
            || ino == self.renumbered.get(&logged).copied().unwrap_or(logged)
    }
}

/// Why a logged change was not applied again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum Skip {
    /// A file it names had no path when it was logged (unlinked while open): nothing
    /// reaches it, and nothing will read what it changed.
    NoPath,
    /// A path it names leads nowhere in the new driver: a directory on the way is gone (the
    /// change was to something removed or renamed before the failure, or the store lost it).
    PathGone,
    /// The file could not be opened again to write it.
    NotOpened,
    /// The new driver refused it (this errno).
    Refused(i32),
    /// The logged request does not parse (never expected).
    Unreadable,
}

impl std::fmt::Display for Skip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Skip::NoPath => write!(f, "the file had been unlinked while open"),
            Skip::PathGone => write!(f, "its path leads nowhere now"),
            Skip::NotOpened => write!(f, "the file could not be opened"),
            Skip::Refused(errno) => write!(
                f,
                "the new driver refused it ({})",
                std::io::Error::from_raw_os_error(*errno)
            ),
            Skip::Unreadable => write!(f, "the logged request does not parse"),
        }
    }
}

/// A logged change not applied again, for the log.
pub(super) struct SkippedChange {
    what: String,
    paths: Vec<String>,
    why: Skip,
}

/// The answer of a replayed change: applied, or refused with its errno.
pub(super) fn refused(reply: Result<Vec<u8>, i32>) -> Result<(), Skip> {
    reply.map(|_| ()).map_err(Skip::Refused)
}

pub(super) fn show_path(path: Option<&tracker::redo::Path>) -> String {
    path.map_or_else(
        || "(no path)".into(),
        |p| {
            let names: Vec<String> = p
                .iter()
                .map(|n| String::from_utf8_lossy(n).into())
                .collect();
            format!("/{}", names.join("/"))
        },
    )
}

/// Logs the changes a replay left out, counted by reason, with an example of each.
pub(super) fn log_skipped(skipped: &[SkippedChange]) {
    if skipped.is_empty() {
        return;
    }
    let mut by_reason: std::collections::BTreeMap<Skip, (usize, &SkippedChange)> =
        std::collections::BTreeMap::new();
    for change in skipped {
        by_reason.entry(change.why).or_insert((0, change)).0 += 1;
    }
    let reasons: Vec<String> = by_reason
        .iter()
        .map(|(why, (n, example))| {
            format!(
                "{n} because {why} (e.g. {} of {})",
                example.what,
                example.paths.join(", ")
            )
        })
        .collect();
    tracing::warn!(
        "{} logged changes could not be replayed: {}",
        skipped.len(),
        reasons.join("; ")
    );
}

impl NewDriver<'_> {
    /// Opens the kernel's `node` for writing, FSYNCs and closes it. Returns whether the
    /// FSYNC succeeded. The file is reached by its path with lookups of rebound's own, given
    /// back at the end: the kernel may forget the node at any moment, and a driver asked
    /// about a node it was told to forget may abort (libfuse's "node not found").
    pub(super) fn flush_through(&self, node: u64) -> io::Result<bool> {
        let path: Option<Vec<Box<[u8]>>> = self
            .shared
            .objects()
            .path(node)
            .map(|path| path.into_iter().map(Box::from).collect());
        let Some(path) = path else {
            return Ok(false);
        };
        let mut walker = Walker::default();
        let flushed = self.fsync_at(&mut walker, &path);
        self.forget_lookups(walker);
        flushed
    }

    pub(super) fn fsync_at(&self, walker: &mut Walker, path: &[Box<[u8]>]) -> io::Result<bool> {
        let Some((driver_node, _)) = self.walk(walker, path)? else {
            return Ok(false);
        };
        let write_only = rustix::fs::OFlags::WRONLY.bits();
        let Some(open_out) = self.open(driver_node, write_only, false)? else {
            return Ok(false);
        };
        let fh = read_u64(&open_out, 0).unwrap_or(0);
        let synced = self.call(fsync_request(0, driver_node, fh), ReplyShape::Empty)?;
        self.release(driver_node, fh, write_only, false);
        Ok(synced.is_ok())
    }

    /// Gives back the lookups `walker` made the driver hand out.
    pub(super) fn forget_lookups(&self, walker: Walker) {
        let calls = &self.shared.calls;
        for (node, count) in walker.lookups {
            let _ = calls.send(
                self.driver,
                &forget_request(calls.next_unique(), node, count),
            );
        }
    }

    /// The driver's node at `path`, looked up component by component, and its inode number
    /// (0 for the root, which is not looked up).
    pub(super) fn walk(
        &self,
        walker: &mut Walker,
        path: &[Box<[u8]>],
    ) -> io::Result<Option<(u64, u64)>> {
        let mut found = (fuse_wire::abi::ROOT_ID, 0);
        for depth in 0..path.len() {
            let prefix = &path[..=depth];
            if let Some(&known) = walker.found.get(prefix) {
                found = known;
                continue;
            }
            match self.named(walker, found.0, &path[depth])? {
                Some(next) => {
                    walker.found.insert(prefix.to_vec(), next);
                    found = next;
                }
                None => return Ok(None),
            }
        }
        Ok(Some(found))
    }

    /// The node `name` in the driver's directory `parent` leads to and its inode number, if
    /// it exists.
    pub(super) fn named(
        &self,
        walker: &mut Walker,
        parent: u64,
        name: &[u8],
    ) -> io::Result<Option<(u64, u64)>> {
        Ok(self.lookup(parent, name)?.map(|(node, entry)| {
            *walker.lookups.entry(node).or_default() += 1;
            (node, tracker::objects::entry_ino(&entry, 0))
        }))
    }

    /// Whether the driver's inode numbers survived the restart: every file of a sample the
    /// kernel holds that the driver still has under its name has the number it had, and
    /// not every one of them is numbered as the driver's node id. (libfuse's high-level API
    /// without `use_ino` gives each file its node id, a counter from 2 in each process, so
    /// the first files looked up may well have their old numbers by chance.)
    pub(super) fn numbers_kept(&self, walker: &mut Walker) -> io::Result<bool> {
        let sample = self.shared.objects().numbered_paths(8);
        let (mut compared, mut node_ids) = (0, 0);
        for (path, ino) in sample {
            if let Some((node, now)) = self.walk(walker, &path)? {
                if now != ino {
                    return Ok(false);
                }
                compared += 1;
                node_ids += usize::from(node == now);
            }
        }
        Ok(compared > node_ids)
    }

    /// Applies the logged changes again, by path, skipping what is already done (the image
    /// may hold part of them, and newer changes too: where the driver's inode numbers survive
    /// restarts, a change is skipped when its name now leads to another file). Returns how
    /// many were applied, and each change that could not be with why.
    pub(super) fn replay(
        &self,
        entries: &[tracker::Mutation],
    ) -> io::Result<(usize, Vec<SkippedChange>)> {
        self.replay_until(entries, || false)
    }

    /// [`NewDriver::replay`] of the first of `entries`, up to the first at which `stop` says
    /// so.
    pub(super) fn replay_until(
        &self,
        entries: &[tracker::Mutation],
        stop: impl Fn() -> bool,
    ) -> io::Result<(usize, Vec<SkippedChange>)> {
        let mut walker = Walker::default();
        if !entries.is_empty() {
            // After a roll-back the image is exactly as at the checkpoint, and the log holds
            // everything since: each change applies, whatever the inode numbers say.
            walker.numbers_kept = self.shared.image.is_none() && self.numbers_kept(&mut walker)?;
        }
        let replayed = self.replay_with(&mut walker, entries, stop)?;
        self.close_writable(&mut walker);
        self.forget_lookups(walker);
        Ok(replayed)
    }

    /// [`NewDriver::replay`] with `walker`, which keeps what it found and opened.
    fn replay_with(
        &self,
        walker: &mut Walker,
        entries: &[tracker::Mutation],
        stop: impl Fn() -> bool,
    ) -> io::Result<(usize, Vec<SkippedChange>)> {
        let (mut applied, mut skipped) = (0, Vec::new());
        for mutation in entries {
            if stop() {
                break;
            }
            let what = mutation
                .request
                .get(4..8)
                .and_then(|op| Opcode::from_raw(u32::from_ne_bytes(op.try_into().ok()?)))
                .map_or_else(|| "?".to_string(), |op| format!("{op:?}"));
            let replayed = self.replay_one(walker, mutation).map_err(|e| {
                io::Error::new(e.kind(), format!("{what} of {:?}: {e}", mutation.paths))
            })?;
            match replayed {
                Ok(()) => applied += 1,
                Err(why) => skipped.push(SkippedChange {
                    what,
                    paths: mutation
                        .paths
                        .iter()
                        .map(|p| show_path(p.as_ref()))
                        .collect(),
                    why,
                }),
            }
        }
        Ok((applied, skipped))
    }

    /// Replays one change, or says why it cannot be.
    pub(super) fn replay_one(
        &self,
        walker: &mut Walker,
        mutation: &tracker::Mutation,
    ) -> io::Result<Result<(), Skip>> {
        use rustix::fs::OFlags;
        let mut bytes = mutation.request.to_vec();
        let Ok(req) = Request::parse(&bytes) else {
            return Ok(Err(Skip::Unreadable));
        };
        let (op, change, shape, fields) = (
            req.opcode,
            PendingChange::of(req.change()),
            req.reply_shape(),
            req.id_fields(),
        );
        let node_fields: Vec<usize> = fields
            .into_iter()
            .filter_map(|field| match field {
                fuse_wire::IdField::Node { at } => Some(at),
                fuse_wire::IdField::Handle { .. } => None,
            })
            .collect();
        if node_fields.len() != mutation.paths.len() {
            return Ok(Err(Skip::Unreadable));
        }
        let mut nodes = Vec::with_capacity(node_fields.len());
        let mut node_ino = 0;
        for (at, path) in node_fields.iter().zip(&mutation.paths) {
            let Some(path) = path else {
                return Ok(Err(Skip::NoPath));
            };
            let Some((node, ino)) = self.walk(walker, path)? else {
                // A name removed from a directory that is gone now is gone with it (removed
                // later by `rm -r`, or never made durable): nothing is left to do.
                if matches!(op, Some(Opcode::Unlink | Opcode::Rmdir)) {
                    return Ok(Ok(()));
                }
                return Ok(Err(Skip::PathGone));
            };
            write_u64(&mut bytes, *at, node);
            if nodes.is_empty() {
                node_ino = ino;
            }
            nodes.push(node);
        }
        let body = size::IN_HEADER;
        let first = nodes.first().copied().unwrap_or(fuse_wire::abi::ROOT_ID);
        let logged = mutation.ino;
        match (op, &change) {
            (Some(Opcode::Create), PendingChange::Create { name, flags, .. }) => {
                if let Some((node, ino)) = self.named(walker, first, name)? {
                    // Made before (or the name now leads to a newer file: leave it alone).
                    if flags & OFlags::TRUNC.bits() != 0 && walker.same_file(logged, ino) {
                        let _ = self.call(truncate_request(0, node), ReplyShape::Attr)?;
                    }
                    return Ok(Ok(()));
                }
                // fuse_create_in.flags: the file may have been created and lost; no O_EXCL.
                let flags = flags & !OFlags::EXCL.bits();
                bytes[body..body + 4].copy_from_slice(&flags.to_ne_bytes());
                if let Ok(reply) = self.call(bytes, shape)? {
                    self.made_again(walker, logged, &reply);
                    if let (Some(node), Some(fh)) = (
                        read_u64(&reply, 0),
                        fuse_wire::change::open_handle(&reply, true),
                    ) {
                        self.keep_writable(walker, node, fh, flags);
                    }
                }
            }
            (
                Some(Opcode::Mknod | Opcode::Mkdir | Opcode::Symlink | Opcode::Link),
                PendingChange::Entry { name, .. },
            ) => {
                if self.named(walker, first, name)?.is_none() {
                    if let Ok(reply) = self.call(bytes, shape)? {
                        self.made_again(walker, logged, &reply);
                    }
                }
            }
            (Some(Opcode::Unlink | Opcode::Rmdir), PendingChange::Remove { name, .. }) => {
                let done = match self.named(walker, first, name)? {
                    None => Ok(()),
                    // The name now leads to a newer file: the removal was done before.
                    Some((_, ino)) if !walker.same_file(logged, ino) => Ok(()),
                    Some(_) => {
                        self.close_writable(walker);
                        refused(self.call(bytes, shape)?)
                    }
                };
                walker.forget_path(mutation.paths.first().and_then(Option::as_ref), name);
                return Ok(done);
            }
            (
                Some(Opcode::Rename | Opcode::Rename2),
                PendingChange::Rename {
                    name,
                    new_name,
                    exchange,
                    ..
                },
            ) => {
                let to = nodes.get(1).copied().unwrap_or(first);
                self.close_writable(walker);
                let done = match self.named(walker, first, name)? {
                    None => Ok(()),
                    Some(_) if *exchange => refused(self.call(bytes, shape)?),
                    // The name now leads to a newer file: the rename was done before.
                    Some((_, ino)) if !walker.same_file(logged, ino) => Ok(()),
                    Some((_, ino)) => {
                        let target = self.named(walker, to, new_name)?.map_or(0, |(_, t)| t);
                        if self.complete_half_rename(first, name, ino, target)? {
                            Ok(())
                        } else {
                            refused(self.call(bytes, shape)?)
                        }
                    }
                };
                let from_dir = mutation.paths.first().and_then(Option::as_ref);
                let to_dir = mutation.paths.get(1).and_then(Option::as_ref).or(from_dir);
                walker.forget_path(from_dir, name);
                walker.forget_path(to_dir, new_name);
                return Ok(done);
            }
            // The node's path now leads to another file: the change was to a file since
            // renamed or removed, and the image has what became of it.
            _ if !walker.same_file(logged, node_ino) => return Ok(Ok(())),
            (Some(Opcode::Write | Opcode::Fallocate), _) => {
                let fh = match walker.writable.get(&first) {
                    Some(&(fh, _)) => fh,
                    None => {
                        let write_only = OFlags::WRONLY.bits();
                        let Some(open_out) = self.open(first, write_only, false)? else {
                            return Ok(Err(Skip::NotOpened));
                        };
                        let fh = read_u64(&open_out, 0).unwrap_or(0);
                        walker.writable.insert(first, (fh, write_only));
                        fh
                    }
                };
                // `fh` is the first field of fuse_write_in and fuse_fallocate_in.
                write_u64(&mut bytes, body, fh);
                return Ok(refused(self.call(bytes, shape)?));
            }
            (Some(Opcode::Setattr), _) => {
                // No handle: fuse_setattr_in.valid without FATTR_FH.
                let valid =
                    u32::from_ne_bytes(bytes[body..body + 4].try_into().unwrap_or_default());
                let valid = valid & !fuse_wire::abi::FATTR_FH;
                bytes[body..body + 4].copy_from_slice(&valid.to_ne_bytes());
                return Ok(refused(self.call(bytes, shape)?));
            }
            _ => return Ok(refused(self.call(bytes, shape)?)),
        }
        Ok(Ok(()))
    }

    /// Keeps a handle the replay got (from CREATE) for the file's next writes, if it can
    /// write at an offset; closes it otherwise.
    pub(super) fn keep_writable(&self, walker: &mut Walker, node: u64, fh: u64, flags: u32) {
        let access = flags & rustix::fs::OFlags::ACCMODE.bits();
        // A write through an O_APPEND handle would land at the end, not at its offset.
        if access == rustix::fs::OFlags::RDONLY.bits()
            || flags & rustix::fs::OFlags::APPEND.bits() != 0
            || walker.writable.contains_key(&node)
        {
            self.release(node, fh, flags, false);
        } else {
            walker.writable.insert(node, (fh, flags));
        }
    }

    /// Closes the handles the replay keeps: before a name goes (a driver may keep an open
    /// file it is asked to unlink under a hidden name), and at the end.
    pub(super) fn close_writable(&self, walker: &mut Walker) {
        for (node, (fh, flags)) in walker.writable.drain() {
            self.release(node, fh, flags, false);
        }
    }

    /// Notes the inode number of a file the replay made again (`reply`, an entry) in place of
    /// the logged one's.
    pub(super) fn made_again(&self, walker: &mut Walker, logged: u64, reply: &[u8]) {
        if let Some(node) = read_u64(reply, 0) {
            *walker.lookups.entry(node).or_default() += 1;
        }
        let ino = tracker::objects::entry_ino(reply, 0);
        if logged != 0 && ino != 0 && ino != logged {
            walker.renumbered.insert(logged, ino);
        }
    }

    /// Completes a rename the driver did half of: `name` in `from` and the target lead to the
    /// same file (inode numbers `source` and `target` as looked up now; 0 for none). The
    /// kernel never sends a rename of two names of one file (it has nothing to do), so only a
    /// rename cut between linking the new name and removing the old one leaves this
    /// (fuse2fs's, once `e2fsck` has counted both links); sent again, the driver would do
    /// nothing, as POSIX says, and the old name would stay. Returns whether it found one and
    /// removed the old name.
    pub(super) fn complete_half_rename(
        &self,
        from: u64,
        name: &[u8],
        source: u64,
        target: u64,
    ) -> io::Result<bool> {
        if source == 0 || source != target {
            return Ok(false);
        }
        tracing::info!(
            "completing a rename cut in half by the driver's failure: removing the old name {:?}",
            String::from_utf8_lossy(name)
        );
        Ok(self
            .call(unlink_request(0, from, name), ReplyShape::Empty)?
            .is_ok())
    }
}
