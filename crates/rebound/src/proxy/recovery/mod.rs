//! Shadow replay: bringing a freshly started driver to the state the kernel believes its
//! predecessor had, then handing it the requests that were waiting.
//!
//! In order: replay the kernel's INIT; with a redo log, apply again what the failed driver
//! acknowledged and lost ([`replay`]); delete the hidden files it left ([`leftovers`]); look every node the kernel holds up again by its path,
//! parents first; reopen every open handle with its original flags (less `O_CREAT`, `O_EXCL`
//! and `O_TRUNC`, which did their work the first time); then deal with every request the
//! failed driver left unanswered. Requests that are safe to repeat are sent again. For those
//! that change the namespace (CREATE, MKDIR, MKNOD, SYMLINK, LINK, UNLINK, RMDIR, RENAME), the
//! new driver is first asked whether the change already happened, and if it did, the kernel
//! gets the answer the first attempt would have given. Objects that cannot be found again are
//! counted as lost: requests on them fail with `EIO`, and nothing else does.
//!
//! Owns: the restore sequence (the decision, per request, to repeat or to settle it is
//! [`settle`]'s).
//! Must not: hold the object table's lock across a request to the driver.

mod follower;
mod leftovers;
mod listing;
mod replay;
mod settle;

pub(super) use follower::Follower;
pub(super) use listing::{forget_unprimed, prime_reopened_directory};
use listing::{list_from_start, unprimed_listing};
use replay::log_skipped;
use settle::hand_on_strays;

use std::collections::HashSet;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fuse_wire::ids::{
    forget_request, lookup_request, open_request, read_u64, release_request, write_u64,
};
use fuse_wire::{DriverMessage, Opcode, ReplyShape, Request};
use rustix::io::Errno;
use rustix::net::SendFlags;
use tracker::{Inflight, PendingChange, ToDriver};
use zerocopy::FromBytes;

use super::{answer_in_drivers_place, lock, mark_recovery_phase, write_to_kernel, Link, Shared};

/// What a recovery restored.
#[derive(Clone, Debug, Default)]
pub struct Restored {
    /// Nodes the kernel holds, looked up in the new driver when first needed.
    pub nodes: usize,
    /// Handles reopened.
    pub handles: usize,
    /// Handles that could not be reopened.
    pub lost: usize,
    /// Requests the failed driver left unanswered, repeated or settled.
    pub resent: usize,
    /// Time from the new driver's channel to serving.
    pub restore_ms: f64,
    /// Changes of the redo log applied again.
    pub replayed: usize,
    /// Hidden files of failed drivers deleted (see [`leftovers`]).
    pub leftovers: usize,
}

/// Most of rebound's own requests out at once during a restore.
const BATCH: usize = 256;
/// How much of a reopened directory rebound reads to make the driver list it.
const PRIMING_READDIR_SIZE: u32 = 4096;
/// Offset of `unique` in `fuse_in_header`.
const UNIQUE_AT: usize = std::mem::offset_of!(fuse_wire::InHeader, unique);

/// Flags a handle is reopened with: what it was opened with, less what only makes sense once,
/// as the channel gives them to a driver (see `requests::driver_flags`).
fn reopen_flags(flags: u32) -> u32 {
    use rustix::fs::OFlags;
    super::requests::driver_flags(flags & !(OFlags::CREATE | OFlags::EXCL | OFlags::TRUNC).bits())
}

/// Driver `generation`'s id for the kernel's `node`: looked up by path, parents first, if the
/// restarted driver has not been asked for it yet. `None` if it cannot be found (it is then
/// lost: requests on it fail with `EIO`). Runs on whichever thread needs the node; fails if
/// `driver` is replaced meanwhile (what it answered means nothing to its successor).
pub(super) fn resolve(
    shared: &Shared,
    driver: &OwnedFd,
    generation: u64,
    node: u64,
    timeout: Duration,
) -> io::Result<Option<u64>> {
    // Bound first: a guard in a `match` scrutinee would live through the arms, which lock.
    let chain = shared.objects().pending_path(node);
    let chain = match chain {
        Some(chain) => chain,
        None => {
            lost(shared, node);
            return Ok(None);
        }
    };
    for (at, parent, name) in chain {
        let parent_id = shared.objects().node_to_driver(parent);
        let parent = match parent_id {
            ToDriver::Mapped(parent) => parent,
            ToDriver::Unknown => {
                untracked(shared, parent, at);
                return Ok(None);
            }
            ToDriver::Lost | ToDriver::Pending => {
                lost(shared, at);
                return Ok(None);
            }
        };
        let calls = &shared.calls;
        let unique = calls.next_unique();
        let reply = calls.call_all(
            driver,
            &[(unique, lookup_request(unique, parent, &name))],
            timeout,
        )?;
        let found = reply.first().and_then(|reply| {
            let parsed = DriverMessage::parse(reply).ok()?;
            parsed
                .validate_reply(ReplyShape::Entry { negative_ok: true }, shared.minor())
                .ok()?;
            let node = (parsed.header.error == 0)
                .then(|| read_u64(parsed.body, 0))
                .flatten()
                .filter(|&d| d != 0)?;
            Some((node, tracker::objects::entry_ino(parsed.body, 0)))
        });
        let mut objects = shared.objects();
        if objects.generation() != generation {
            drop(objects);
            if let Some((driver_node, _)) = found {
                let _ = calls.send(driver, &forget_request(calls.next_unique(), driver_node, 1));
            }
            return Err(io::Error::other("the driver was replaced"));
        }
        match found {
            Some((driver_node, ino)) => {
                if objects.restore_node(at, driver_node, generation) {
                    objects.renumber(at, ino);
                    drop(objects);
                    shared.stats.restored_nodes.fetch_add(1, Ordering::Relaxed);
                } else {
                    drop(objects);
                    let _ =
                        calls.send(driver, &forget_request(calls.next_unique(), driver_node, 1));
                }
            }
            None => {
                drop(objects);
                lost(shared, at);
                return Ok(None);
            }
        }
    }
    let mapped = shared.objects().node_to_driver(node);
    Ok(match mapped {
        ToDriver::Mapped(driver_node) => Some(driver_node),
        ToDriver::Unknown => {
            untracked(shared, node, node);
            None
        }
        ToDriver::Pending | ToDriver::Lost => None,
    })
}

/// `node`, on the way to `wanted`, is not in the table: the kernel let it go, so whatever
/// still names it is a leftover. Its id means nothing to the new driver, and one that takes
/// ids for pointers (passthrough_ll) dies of it at every restart; `wanted` is lost instead.
fn untracked(shared: &Shared, node: u64, wanted: u64) {
    tracing::warn!("node {node} (the way to node {wanted}) is not tracked: {wanted} is lost");
    lost(shared, wanted);
}

/// A request in flight, for logs: its opcode and the id fields it had in the kernel's ids.
fn describe(request: &Inflight) -> String {
    let mut bytes = request.request.bytes().to_vec();
    request.request.patches.undo(&mut bytes);
    match Request::parse(&bytes) {
        Ok(req) => {
            let ids: Vec<u64> = req
                .id_fields()
                .into_iter()
                .filter_map(|f| read_u64(&bytes, f.at()))
                .collect();
            // Where a READ or WRITE lands (both begin fh, offset, size).
            let range = matches!(req.opcode, Some(Opcode::Read | Opcode::Write))
                .then(|| fuse_wire::abi::ReadIn::read_from_prefix(req.body).ok())
                .flatten()
                .map(|(io, _)| format!(" at {} +{}", io.offset, io.size))
                .unwrap_or_default();
            format!("{:?} {ids:?}{range}", req.opcode)
        }
        Err(_) => format!("opcode {}", request.opcode),
    }
}

/// Marks a node the new driver does not have as lost, counting it once.
fn lost(shared: &Shared, node: u64) {
    if shared.objects().mark_lost(node) {
        shared.stats.lost_objects.fetch_add(1, Ordering::Relaxed);
    }
}

/// Translates a request for the current driver, looking up what it names if need be.
pub(super) fn translate(
    shared: &Shared,
    driver: &OwnedFd,
    generation: u64,
    msg: &mut [u8],
    fields: fuse_wire::ids::IdFields,
    change: &PendingChange,
    timeout: Duration,
) -> Result<tracker::Patches, tracker::Untranslated> {
    // Each round looks up one more pending node.
    for _ in 0..=tracker::MAX_PENDING {
        let translated = shared.objects().to_driver(msg, fields, change);
        let pending = match translated {
            Err(tracker::Untranslated::Pending(node)) => node,
            done => return done,
        };
        match resolve(shared, driver, generation, pending, timeout) {
            Ok(Some(_)) => {}
            Ok(None) => return Err(tracker::Untranslated::Lost),
            // The driver did not answer: the node is still to be looked up.
            Err(e) => {
                tracing::debug!("node {pending} is still to be looked up: {e}");
                return Err(tracker::Untranslated::Pending(pending));
            }
        }
    }
    Err(tracker::Untranslated::Lost)
}

/// Opens the kernel's `node` in driver `generation` for writing, FSYNCs and closes it (a
/// checkpoint: fuse2fs then flushes everything it holds). Returns whether the FSYNC succeeded.
pub(super) fn flush_through(
    shared: &Shared,
    driver: &Arc<OwnedFd>,
    generation: u64,
    timeout: Duration,
    node: u64,
) -> io::Result<bool> {
    NewDriver {
        init_reply: std::cell::OnceCell::new(),
        shared,
        driver,
        generation,
        timeout,
        direct: false,
    }
    .flush_through(node)
}

/// A driver and the means to talk to it.
struct NewDriver<'a> {
    /// The new driver's reply to the replayed INIT.
    init_reply: std::cell::OnceCell<Vec<u8>>,
    shared: &'a Shared,
    driver: &'a Arc<OwnedFd>,
    generation: u64,
    timeout: Duration,
    /// Replies are read here, not by a reader thread of the proxy's (a standby's channel).
    direct: bool,
}

/// Brings driver `generation`, reachable through `driver`, up to the kernel's state and makes
/// it the serving driver. `init_reply` and `on_spare` as for `Proxy::attach_driver`. What it
/// took of the failed driver's requests and left unanswered when a later driver replaced it
/// meanwhile goes to that one ([`hand_on_strays`]).
pub(super) fn restore(
    shared: &Shared,
    driver: &Arc<OwnedFd>,
    generation: u64,
    timeout: Duration,
    init: (Option<Vec<u8>>, bool),
) -> Result<Restored, String> {
    let mut taken = HashSet::new();
    let outcome = restore_taking(shared, driver, generation, timeout, init, &mut taken);
    hand_on_strays(shared, generation, timeout, &Vec::from_iter(taken));
    outcome
}

/// [`restore`], adding to `taken` every request it takes from the in-flight table.
fn restore_taking(
    shared: &Shared,
    driver: &Arc<OwnedFd>,
    generation: u64,
    timeout: Duration,
    (init_reply, on_spare): (Option<Vec<u8>>, bool),
    taken: &mut HashSet<u64>,
) -> Result<Restored, String> {
    let started = Instant::now();
    let new = NewDriver {
        init_reply: std::cell::OnceCell::new(),
        shared,
        driver,
        generation,
        timeout,
        direct: false,
    };
    // From now on, the first reply of the new driver to a kernel request ends the outage.
    shared
        .clock
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .awaiting_first_reply = true;
    match init_reply {
        // A standby answered it before the failure.
        Some(body) => {
            let _ = new.init_reply.set(body);
        }
        None => new.replay_init()?,
    }
    mark_recovery_phase(shared, "init");
    let mut restored = Restored::default();
    // Nodes are looked up when first needed; handles are reopened now, their nodes first.
    // Before that, what the failed driver acknowledged and lost is applied again.
    let plan = shared.objects().begin_generation(generation);
    restored.nodes = shared.objects().node_count();
    if let Some(redo) = &shared.redo {
        let mut log = redo.lock().unwrap_or_else(|e| e.into_inner());
        let entries = match on_spare {
            true => {
                let lacking = log.lacking();
                // The spare is the image now: a later driver is rolled back to the checkpoint.
                log.unfollow();
                lacking
                    .map(|(entries, _)| entries)
                    .ok_or("the redo log no longer holds what the spare lacks")?
            }
            false => log.entries(),
        };
        drop(log);
        let (applied, skipped) = new
            .replay(&entries)
            .map_err(|e| format!("replaying the redo log: {e}"))?;
        restored.replayed = applied;
        log_skipped(&skipped);
        mark_recovery_phase(shared, "replay");
    }
    let removal_dirs = shared
        .removal_dirs
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    if !removal_dirs.is_empty() {
        restored.leftovers = new
            .remove_leftovers(&removal_dirs)
            .map_err(|e| format!("removing hidden files: {e}"))?;
        // Cleaned: only a name removed from now on, by this driver, can leave another there
        // (listing them at every recovery cost the demo ~10 ms each). Kept if the cap cut the
        // cleaning short.
        if restored.leftovers < leftovers::MAX_REMOVED {
            lock(&shared.removal_dirs).retain(|dir| !removal_dirs.contains(dir));
        }
    }
    for chunk in plan.handles.chunks(BATCH) {
        new.restore_handles(chunk, &mut restored)?;
    }
    // The requests the failed driver left, settled or sent again while new ones park.
    superseded(&shared.link(), generation)?;
    let left = shared.inflight.take_not_sent_to(generation);
    taken.extend(left.iter().map(|(unique, _)| *unique));
    new.settle_all(left)
        .map_err(|e| format!("resending requests: {e}"))?;
    // Requests parked meanwhile are taken as the new driver takes over, in one step (none
    // parks after it), and sent once the link's lock is let go: sending one may look a node
    // up, and the proxy's reader of this driver, which waits for that lock to deliver any
    // other reply, would hold the lookup's reply behind it until the lookup timed out. New
    // requests may reach the driver before these: the kernel never has two in flight that
    // depend on each other.
    let mut link = shared.link.write().unwrap_or_else(|e| e.into_inner());
    superseded(&link, generation)?;
    let parked = shared.inflight.take_not_sent_to(generation);
    *link = Link::Serving {
        driver: driver.clone(),
        generation,
    };
    *lock(&shared.restored_init_reply) = new.init_reply.get().cloned();
    drop(link);
    // Counted once each: one that waited for a lookup above is taken again here.
    taken.extend(parked.iter().map(|(unique, _)| *unique));
    restored.resent = taken.len();
    new.send_all(parked);
    mark_recovery_phase(shared, "restore");
    shared
        .stats
        .resent
        .fetch_add(restored.resent as u64, Ordering::Relaxed);
    if shared.inflight.is_empty() {
        // Nothing waits: the new driver is ready to serve now.
        super::first_reply_served(shared);
    }
    if restored.replayed > 0 || restored.leftovers > 0 {
        // What was replayed is durable only once checkpointed: until then, another failure
        // replays it again.
        shared.checkpoint_due.soon();
    }
    restored.restore_ms = started.elapsed().as_secs_f64() * 1000.0;
    Ok(restored)
}

/// An error if driver `generation` is no longer the one attached: a later one replaced it
/// (the supervisor saw it fail another way while it was restored). Its restore stops there:
/// checked before it takes the failed driver's requests, and under the link's lock before it
/// takes over. (Between the first check and its take, both restores may take requests, each
/// its own; what the superseded one leaves goes to the serving driver as it ends:
/// [`hand_on_strays`].)
fn superseded(link: &Link, generation: u64) -> Result<(), String> {
    match link.current() {
        Some((_, g)) if g == generation => Ok(()),
        _ => Err("superseded by a later driver".into()),
    }
}

impl NewDriver<'_> {
    /// Sends rebound's own requests (each built with the `unique` it is given) and returns,
    /// for each, the reply's body or the error the driver answered with.
    fn call_all(
        &self,
        builds: impl IntoIterator<Item = Vec<u8>>,
        shape: ReplyShape,
    ) -> io::Result<Vec<Result<Vec<u8>, i32>>> {
        let calls = &self.shared.calls;
        let requests: Vec<(u64, Vec<u8>)> = builds
            .into_iter()
            .map(|mut request| {
                let unique = calls.next_unique();
                write_u64(&mut request, UNIQUE_AT, unique);
                (unique, request)
            })
            .collect();
        let replies = match self.direct {
            true => follower::call_directly(self.driver, &requests, self.timeout)?,
            false => calls.call_all(self.driver, &requests, self.timeout)?,
        };
        Ok(replies
            .iter()
            .map(|reply| self.check_reply(reply, shape))
            .collect())
    }

    fn call(&self, request: Vec<u8>, shape: ReplyShape) -> io::Result<Result<Vec<u8>, i32>> {
        let mut replies = self.call_all([request], shape)?;
        Ok(replies.pop().unwrap_or(Err(Errno::IO.raw_os_error())))
    }

    /// The body of a valid successful reply, or its error. A reply that fails the checks
    /// fails that one request (and loses the object it was to restore); only a driver that
    /// does not answer at all fails the recovery.
    fn check_reply(&self, reply: &[u8], shape: ReplyShape) -> Result<Vec<u8>, i32> {
        let checked = DriverMessage::parse(reply).and_then(|parsed| {
            parsed
                .validate_reply(shape, self.shared.minor())
                .map(|_| parsed)
        });
        match checked {
            Ok(parsed) if parsed.header.error == 0 => Ok(parsed.body.to_vec()),
            Ok(parsed) => Err(-parsed.header.error),
            Err(e) => {
                self.shared.stats.refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!("refused the new driver's reply while restoring: {e}");
                Err(Errno::IO.raw_os_error())
            }
        }
    }

    fn replay_init(&self) -> Result<(), String> {
        let body = self.replay_init_reply()?;
        let _ = self.init_reply.set(body);
        Ok(())
    }

    /// The new driver's reply body to the kernel's INIT, replayed.
    fn replay_init_reply(&self) -> Result<Vec<u8>, String> {
        let init = self
            .shared
            .init
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or("no INIT to replay")?;
        match self
            .call(init, ReplyShape::Init)
            .map_err(|e| format!("INIT: {e}"))?
        {
            Ok(body) => Ok(body),
            Err(errno) => Err(format!(
                "INIT: the new driver refused it ({})",
                io::Error::from_raw_os_error(errno)
            )),
        }
    }

    /// Reopens `(fh, dir, node, flags)` and gives each handle the new driver's.
    fn restore_handles(
        &self,
        handles: &[(u64, bool, u64, u32)],
        restored: &mut Restored,
    ) -> Result<(), String> {
        let mut opens = Vec::new();
        for &(fh, dir, node, flags) in handles {
            match resolve(
                self.shared,
                self.driver,
                self.generation,
                node,
                self.timeout,
            )
            .map_err(|e| format!("restoring the node of a handle: {e}"))?
            {
                Some(driver_node) => opens.push((fh, dir, driver_node, flags)),
                None => self.handle_lost(restored, fh, &format!("node {node} is gone")),
            }
        }
        let replies = self
            .call_all(
                opens.iter().map(|&(_, dir, driver_node, flags)| {
                    open_request(0, driver_node, reopen_flags(flags), dir)
                }),
                ReplyShape::Open,
            )
            .map_err(|e| format!("reopening handles: {e}"))?;
        for (&(fh, dir, driver_node, flags), reply) in opens.iter().zip(replies) {
            let reply = match reply {
                Ok(open_out) => read_u64(&open_out, 0).ok_or(Errno::PROTO.raw_os_error()),
                Err(errno) => Err(errno),
            };
            match reply {
                Ok(driver_fh) => {
                    if self.shared.objects().restore_handle(fh, dir, driver_fh) {
                        restored.handles += 1;
                        self.retake_locks(fh)?;
                    } else {
                        self.release(driver_node, driver_fh, flags, dir);
                    }
                }
                Err(errno) => {
                    let why = io::Error::from_raw_os_error(errno);
                    let why = format!("reopening the driver's node {driver_node}: {why}");
                    self.handle_lost(restored, fh, &why);
                }
            }
        }
        // A reopened directory is read from its start once before the kernel goes on from
        // where it was (see `prime_reopened_directory`): when, and if, it does.
        let mut unprimed = lock(&self.shared.unprimed_dirs);
        unprimed.extend(opens.iter().filter(|o| o.1).map(|o| o.0));
        Ok(())
    }

    /// LOOKUP of `name` in the driver's directory `parent`: the node and the entry, or `None`
    /// if the driver has no such name.
    fn lookup(&self, parent: u64, name: &[u8]) -> io::Result<Option<(u64, Vec<u8>)>> {
        let reply = self.call(
            lookup_request(0, parent, name),
            ReplyShape::Entry { negative_ok: true },
        )?;
        let found = reply
            .ok()
            .and_then(|entry| Some((read_u64(&entry, 0).filter(|&n| n != 0)?, entry)));
        tracing::trace!(
            "lookup {parent}/{} -> {:?}",
            String::from_utf8_lossy(name),
            found.as_ref().map(|f| f.0)
        );
        Ok(found)
    }

    /// OPEN/OPENDIR of the driver's `node`: the `fuse_open_out`, or `None` if refused.
    fn open(&self, node: u64, flags: u32, dir: bool) -> io::Result<Option<Vec<u8>>> {
        Ok(self
            .call(open_request(0, node, flags, dir), ReplyShape::Open)?
            .ok())
    }

    fn forget(&self, driver_node: u64) {
        let calls = &self.shared.calls;
        let _ = calls.send(
            self.driver,
            &forget_request(calls.next_unique(), driver_node, 1),
        );
    }

    /// Closes a handle of rebound's own, waiting for the answer: a driver with many threads
    /// could otherwise take a FORGET sent after it first, drop the node, and abort on the
    /// RELEASE (libfuse's "node not found"; the kernel never forgets an open file).
    fn release(&self, driver_node: u64, driver_fh: u64, flags: u32, dir: bool) {
        let _ = self.call(
            release_request(0, driver_node, driver_fh, flags, dir),
            ReplyShape::Empty,
        );
    }

    /// A lookup of rebound's own that the kernel will not hear of: the driver's count of it
    /// goes to the node the kernel holds, or back to the driver at once.
    fn drop_lookup(&self, driver_node: u64) {
        if !self.shared.objects().count_driver_lookup(driver_node) {
            self.forget(driver_node);
        }
    }

    /// A handle the new driver could not reopen: requests on it fail with `EIO`.
    fn handle_lost(&self, restored: &mut Restored, fh: u64, why: &str) {
        tracing::warn!("handle {fh} could not be restored: {why}");
        restored.lost += 1;
        self.shared
            .stats
            .lost_objects
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Takes the locks held through the kernel's file handle `fh` again (never waiting: a
    /// lock someone else took meanwhile is lost, and counted).
    fn retake_locks(&self, fh: u64) -> Result<(), String> {
        let locks = self.shared.objects().locks_of(fh);
        for request in locks {
            let mut bytes = request.to_vec();
            bytes[4..8].copy_from_slice(&(Opcode::Setlk as u32).to_ne_bytes());
            let Ok(fields) = Request::parse(&bytes).map(|req| req.id_fields()) else {
                continue;
            };
            let taken = match translate(
                self.shared,
                self.driver,
                self.generation,
                &mut bytes,
                fields,
                &PendingChange::None,
                self.timeout,
            ) {
                Ok(_) => self
                    .call(bytes, ReplyShape::Empty)
                    .map_err(|e| format!("taking a lock again: {e}"))?
                    .is_ok(),
                Err(_) => false,
            };
            if !taken {
                tracing::warn!("a lock held through handle {fh} could not be taken again");
                self.shared
                    .stats
                    .lost_objects
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// The driver's id of the kernel's directory `parent`, looked up if need be.
    fn dir(&self, parent: u64) -> io::Result<Option<u64>> {
        resolve(
            self.shared,
            self.driver,
            self.generation,
            parent,
            self.timeout,
        )
    }

    /// Sends waiting requests to the new driver ([`NewDriver::send_again`]).
    fn send_all(&self, requests: Vec<(u64, Inflight)>) {
        for (unique, request) in requests {
            self.send_again(unique, request);
        }
    }

    /// Sends a waiting request to the new driver, in its ids.
    fn send_again(&self, unique: u64, mut request: Inflight) {
        let shared = self.shared;
        let queue = usize::from(request.queue);
        if request.opcode == Opcode::Init as u32 {
            // The first driver died before answering the kernel's INIT: the new one already
            // answered its replay, and a second INIT would start its session over.
            return self.answer_init(unique, queue);
        }
        let len = request.request.len;
        let bytes = Arc::make_mut(&mut request.request.buf);
        let msg = &mut bytes[..len];
        request.request.patches.undo(msg);
        let fields = match Request::parse(msg) {
            Ok(req) => req.id_fields(),
            Err(_) => return answer_in_drivers_place(shared, unique, queue, Errno::IO),
        };
        let is_listing =
            [Opcode::Readdir as u32, Opcode::Readdirplus as u32].contains(&request.opcode);
        let unprimed = is_listing.then(|| unprimed_listing(shared, msg)).flatten();
        match translate(
            shared,
            self.driver,
            self.generation,
            msg,
            fields,
            &request.change,
            self.timeout,
        ) {
            Ok(patches) => {
                request.request.patches = patches;
                if let Some(fh) = unprimed {
                    list_from_start(shared, self.driver, msg);
                    lock(&shared.unprimed_dirs).remove(&fh);
                }
            }
            Err(tracker::Untranslated::Pending(_)) => {
                // The driver did not answer a lookup. During a restore the request parks, for
                // the next round or the next driver. Once a driver serves, nothing would take
                // a parked request again: it counts as sent to this one, for the hang check.
                // (Put back under the link's lock: a later restore takes what is parked under it.)
                request.request.patches = tracker::Patches::default();
                let link = shared.link();
                let serving = matches!(*link, Link::Serving { .. });
                request.sent = serving.then(|| (self.generation, Instant::now()));
                shared.inflight.insert(unique, request);
                drop(link);
                return;
            }
            Err(tracker::Untranslated::Lost) => return self.lost(unique, queue),
        }
        let to_send = request.request.buf.clone();
        request.sent = Some((self.generation, Instant::now()));
        shared.inflight.insert(unique, request);
        // A failure here is the new driver failing; it will be noticed and this request
        // sent again to the next one.
        let _ = rustix::net::send(&**self.driver, &to_send[..len], SendFlags::NOSIGNAL);
    }

    /// Answers the kernel's INIT with the new driver's reply to the replayed one.
    fn answer_init(&self, unique: u64, queue: usize) {
        let Some(body) = self.init_reply.get() else {
            return answer_in_drivers_place(self.shared, unique, queue, Errno::IO);
        };
        let mut reply = super::success_reply(unique, body);
        match fuse_wire::fix_init_reply(&mut reply, super::MAX_WRITE) {
            Ok(init) => {
                self.shared.minor.store(init.minor, Ordering::Relaxed);
                write_to_kernel(self.shared, queue, &reply);
            }
            Err(_) => answer_in_drivers_place(self.shared, unique, queue, Errno::IO),
        }
    }

    fn lost(&self, unique: u64, queue: usize) {
        self.shared.stats.lost_uses.fetch_add(1, Ordering::Relaxed);
        answer_in_drivers_place(self.shared, unique, queue, Errno::IO);
    }
}
