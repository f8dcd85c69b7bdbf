//! The objects the kernel holds through the driver: node ids with their lookup counts and the
//! name that leads to each, and open file and directory handles with their flags; and, for
//! each, the id the current driver knows it by.
//!
//! This is what a restarted driver must be brought back to (shadow-driver replay): every live
//! node re-resolved by its path, every handle reopened. Changes are committed only for requests
//! the driver answered successfully with a valid reply (VINO's transactions); FORGET and
//! RELEASE take effect when the kernel sends them, since the kernel has let go either way.
//!
//! Ids: the table is keyed by the ids the kernel holds, which never change. A driver's ids are
//! its own: the first driver's are the kernel's (until they collide, which in guarded mode
//! gives the kernel a fresh id; in fast mode the kernel holds the driver's value, so a handle
//! value given again is noted instead), a restarted driver's are whatever its lookups and
//! opens return. Every request is translated kernel to driver
//! and every reply driver to kernel through this table.
//!
//! Memory: one entry per node the kernel remembers and per open handle, each with one name;
//! it follows what the kernel holds, not the traffic.

use std::collections::HashMap;
use std::sync::Arc;

use fuse_wire::abi::{size, EntryOut, ROOT_ID};
use fuse_wire::change::{direntplus_entries, entry_node, open_handle};
use fuse_wire::ids::{read_u64, IdField};
use fuse_wire::Change;
use fuse_wire::Opcode;
use zerocopy::FromBytes;

use crate::inflight::Patches;

mod journal;
mod restart;
mod snapshot;
pub use journal::{reply_records, JournalError};
pub use restart::{PathStep, RestorePlan};
pub use snapshot::ObjectSnapshot;

/// The inode number in the attributes of the `fuse_entry_out` at `at` of `reply` (0 if cut
/// short).
pub fn entry_ino(reply: &[u8], at: usize) -> u64 {
    reply
        .get(at..)
        .and_then(|entry| EntryOut::read_from_prefix(entry).ok())
        .map_or(0, |(entry, _)| entry.attr.ino)
}

/// The generation field of the `fuse_entry_out` at `at` of `reply`, if it is whole.
const GENERATION_AT: usize = std::mem::offset_of!(EntryOut, generation);

/// The file type bits of a mode, and a directory's.
const S_IFMT: u32 = 0o170000;
const S_IFDIR: u32 = 0o040000;

/// A node the kernel knows, and the name it was last reached by.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    /// Lookups the kernel holds (and will FORGET).
    pub lookups: u64,
    /// `None` once the name was removed (unlinked while the kernel still holds the node):
    /// such a node cannot be found again by path.
    pub name: Option<(u64, Box<[u8]>)>,
    /// What the current driver knows the node as.
    pub driver: DriverNode,
    /// Lookups the current driver has handed out for the node, which it must be FORGET-ed.
    pub driver_lookups: u64,
    /// The inode number the driver last gave in the node's attributes (0: none yet). Drivers
    /// that report the backing store's (fuse2fs, passthrough_ll, go-fuse) keep it across
    /// restarts, so it tells which file a name leads to now.
    pub ino: u64,
    /// The generation the kernel was given with the node's first entry. The kernel takes an
    /// entry for a node it holds with another generation as a reused id and fails the inode
    /// (EIO); a restarted driver may number generations afresh (fuse-overlayfs does), so every
    /// later entry is given this one.
    pub generation: u64,
}

/// A node as the current driver knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DriverNode {
    /// By this id.
    Known(u64),
    /// Not yet: a restarted driver is asked for it by path when it is first needed.
    Pending,
    /// Not at all: its path is gone. Requests on it fail with `EIO`.
    Lost,
}

/// An open handle: the node it is on, the flags it was opened with, and the driver's handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handle {
    pub node: u64,
    pub flags: u32,
    /// `None` if a restart could not reopen it.
    pub driver: Option<u64>,
}

/// How an id the kernel sent maps to the current driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToDriver {
    Mapped(u64),
    /// A node the restarted driver must first be asked for ([`ObjectTable::pending_path`]).
    Pending,
    /// The object did not survive a restart; requests on it fail with `EIO`.
    Lost,
    /// Not tracked (an id the kernel got some other way); passed on unchanged.
    Unknown,
}

/// The most nodes a request can leave to be asked of a restarted driver first: its ids, and
/// the two entries a RENAME removes or replaces.
pub const MAX_PENDING: usize = fuse_wire::ids::MAX_REQUEST_IDS + 2;

/// Why a request cannot be translated for the current driver yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Untranslated {
    /// It names an object that did not survive a restart.
    Lost,
    /// It names this node, which the restarted driver must be asked for first.
    Pending(u64),
}

/// What a FORGET of the kernel becomes for the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DriverForget {
    /// Send FORGET(`node`, `count`) in the driver's ids.
    Send { node: u64, count: u64 },
    /// The driver keeps (or never had) its lookups: send nothing.
    Nothing,
}

/// A change waiting for the driver's reply, owned so it can wait in the inflight table.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum PendingChange {
    #[default]
    None,
    Entry {
        parent: u64,
        name: Box<[u8]>,
    },
    Create {
        parent: u64,
        name: Box<[u8]>,
        flags: u32,
    },
    Open {
        node: u64,
        flags: u32,
        dir: bool,
    },
    Remove {
        parent: u64,
        name: Box<[u8]>,
    },
    Rename {
        parent: u64,
        name: Box<[u8]>,
        new_parent: u64,
        new_name: Box<[u8]>,
        exchange: bool,
    },
    ReaddirPlus {
        dir: u64,
    },
}

impl PendingChange {
    /// What a request will change if the driver answers it with success. FORGET and RELEASE
    /// are not here: they take effect at once, through [`ObjectTable::forget`] and
    /// [`ObjectTable::release`].
    pub fn of(change: Change<'_>) -> PendingChange {
        match change {
            Change::None
            | Change::Forget { .. }
            | Change::BatchForget { .. }
            | Change::Release { .. } => PendingChange::None,
            Change::Entry { parent, name } => PendingChange::Entry {
                parent,
                name: name.into(),
            },
            Change::Create {
                parent,
                name,
                flags,
            } => PendingChange::Create {
                parent,
                name: name.into(),
                flags,
            },
            Change::Open { node, flags, dir } => PendingChange::Open { node, flags, dir },
            Change::Remove { parent, name } => PendingChange::Remove {
                parent,
                name: name.into(),
            },
            Change::Rename {
                parent,
                name,
                new_parent,
                new_name,
                exchange,
            } => PendingChange::Rename {
                parent,
                name: name.into(),
                new_parent,
                new_name: new_name.into(),
                exchange,
            },
            Change::ReaddirPlus { dir } => PendingChange::ReaddirPlus { dir },
        }
    }
}

/// Lock requests kept per handle, at most.
const MAX_LOCKS_KEPT: usize = 64;

/// What the tracker needs of a SETLK/SETLKW request (`fuse_lk_in`).
struct LockRequest {
    owner: u64,
    start: u64,
    end: u64,
    unlock: bool,
    flock: bool,
}

impl LockRequest {
    fn parse(request: &[u8]) -> Option<LockRequest> {
        // fuse_lk_in: fh, owner, fuse_file_lock { start, end, type, pid }, lk_flags.
        let body = request.get(size::IN_HEADER..)?;
        let u32_at = |at: usize| Some(u32::from_ne_bytes(body.get(at..at + 4)?.try_into().ok()?));
        const F_UNLCK: u32 = 2;
        const FUSE_LK_FLOCK: u32 = 1;
        Some(LockRequest {
            owner: read_u64(body, 8)?,
            start: read_u64(body, 16)?,
            end: read_u64(body, 24)?,
            unlock: u32_at(32)? == F_UNLCK,
            flock: u32_at(40)? & FUSE_LK_FLOCK != 0,
        })
    }

    /// An unlock from the start of the file to its (largest possible) end.
    fn unlocks_all(&self) -> bool {
        self.unlock && self.start == 0 && self.end >= i64::MAX as u64
    }
}

/// Kernel ids handed out for driver ids that collide with ones the kernel holds start here,
/// far above what drivers use (counters from 1, inode numbers, or heap addresses, whose top
/// bits are clear in user space).
const FRESH_IDS: u64 = 0xfeed_0000_0000_0000;

/// `(parent, name)` to node. A hashbrown map, with std's keyed hasher (names are chosen by
/// applications), so that it is searched by a borrowed [`NameRef`] without building a key:
/// every request that names a file searches it.
type NameIndex = hashbrown::HashMap<(u64, Box<[u8]>), u64, std::hash::RandomState>;

/// A `(parent, name)` key of [`NameIndex`], borrowed; hashes as the owned key does.
#[derive(Hash)]
struct NameRef<'a>(u64, &'a [u8]);

impl hashbrown::Equivalent<(u64, Box<[u8]>)> for NameRef<'_> {
    fn equivalent(&self, key: &(u64, Box<[u8]>)) -> bool {
        self.0 == key.0 && self.1 == &*key.1
    }
}

/// Nodes and handles, with an index from `(parent, name)` to node.
#[derive(Debug)]
pub struct ObjectTable {
    nodes: HashMap<u64, Node>,
    names: NameIndex,
    /// Driver node id to the kernel's (the reverse of `Node::driver`).
    by_driver: HashMap<u64, u64>,
    /// Keyed by the kernel's `(fh, is_dir)`.
    handles: HashMap<(u64, bool), Handle>,
    /// Whether the kernel holds the driver's own handles, as it does while the first driver
    /// serves the kernel's queue (fast mode): a reply cannot be given another handle then.
    kernel_holds_driver_handles: bool,
    /// Handles the driver gave again while the kernel's release of an earlier use was still to
    /// be seen (fast mode sees a request when it ends, and a driver may close a handle, reuse
    /// its value and answer the open before it answers the release): the nodes of the earlier
    /// uses whose releases are still to come. Such a release leaves the handle as it is.
    reissued: HashMap<(u64, bool), Vec<u64>>,
    /// The lock requests (SETLK/SETLKW, in the kernel's ids) that succeeded on each file
    /// handle and still hold, oldest first: taken again in a restarted driver.
    locks: HashMap<u64, Vec<Arc<[u8]>>>,
    next_fresh: u64,
    /// The driver generation the driver ids belong to (see [`ObjectTable::begin_generation`]).
    generation: u64,
    /// Changes noted since last taken, if a journal is kept (see [`journal`]).
    journal: Option<Vec<u8>>,
    /// The latest replies a replayed journal committed, by request (see
    /// [`ObjectTable::take_replayed_reply`]).
    replayed_replies: journal::ReplayedReplies,
}

impl Default for ObjectTable {
    fn default() -> Self {
        ObjectTable {
            nodes: HashMap::new(),
            names: NameIndex::default(),
            by_driver: HashMap::new(),
            handles: HashMap::new(),
            kernel_holds_driver_handles: false,
            reissued: HashMap::new(),
            locks: HashMap::new(),
            next_fresh: FRESH_IDS,
            generation: 0,
            journal: None,
            replayed_replies: journal::ReplayedReplies::default(),
        }
    }
}

impl ObjectTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// Commits a change whose request (the kernel's `unique`) the driver answered with success.
    /// `reply` is the validated reply body in the driver's ids; the ids in it are rewritten to
    /// the kernel's.
    pub fn on_success(&mut self, unique: u64, change: PendingChange, reply: &mut [u8]) {
        let noted = (self.journaling() && change != PendingChange::None).then(|| change.clone());
        self.commit(change, reply);
        if let Some(change) = noted {
            let reply = reply.to_vec();
            self.note(&journal::Record::SuccessOf {
                unique,
                change,
                reply,
            });
        }
    }

    fn commit(&mut self, change: PendingChange, reply: &mut [u8]) {
        match change {
            PendingChange::None => {}
            PendingChange::Entry { parent, name } => {
                if let Some(driver) = entry_node(reply).filter(|&d| d != 0) {
                    let node = self.looked_up(driver, reply, 0, parent, name);
                    write_u64(reply, 0, node);
                }
            }
            PendingChange::Create {
                parent,
                name,
                flags,
            } => {
                if let (Some(driver), Some(driver_fh)) =
                    (entry_node(reply), open_handle(reply, true))
                {
                    let node = self.looked_up(driver, reply, 0, parent, name);
                    let fh = self.opened(driver_fh, false, node, flags);
                    write_u64(reply, 0, node);
                    write_u64(reply, reply.len() - size::OPEN_OUT, fh);
                }
            }
            PendingChange::Open { node, flags, dir } => {
                if let Some(driver_fh) = open_handle(reply, false) {
                    let fh = self.opened(driver_fh, dir, node, flags);
                    write_u64(reply, 0, fh);
                }
            }
            PendingChange::Remove { parent, name } => self.unlink(parent, &name),
            PendingChange::Rename {
                parent,
                name,
                new_parent,
                new_name,
                exchange,
            } => self.rename(parent, name, new_parent, new_name, exchange),
            PendingChange::ReaddirPlus { dir } => {
                let entries: Vec<(usize, u64, Box<[u8]>)> = direntplus_entries(reply)
                    .map(|(at, driver, name)| (at, driver, name.into()))
                    .collect();
                for (at, driver, name) in entries {
                    let node = self.looked_up(driver, reply, at, dir, name);
                    write_u64(reply, at, node);
                }
            }
        }
    }

    /// The kernel drops `count` lookups of `node`. Returns what the driver must be told: the
    /// same FORGET while the two agree; after a restart, the driver handed out fewer lookups
    /// and keeps one until the kernel lets go of the node.
    pub fn forget(&mut self, node: u64, count: u64) -> DriverForget {
        self.note(&journal::Record::Forget { node, count });
        let Some(entry) = self.nodes.get_mut(&node) else {
            return DriverForget::Send { node, count };
        };
        entry.lookups = entry.lookups.saturating_sub(count);
        let DriverNode::Known(driver) = entry.driver else {
            if entry.lookups == 0 {
                self.remove_node(node);
            }
            return DriverForget::Nothing;
        };
        let forward = if entry.lookups == 0 {
            entry.driver_lookups
        } else {
            count.min(entry.driver_lookups.saturating_sub(1))
        };
        entry.driver_lookups -= forward;
        if entry.lookups == 0 {
            self.remove_node(node);
        }
        if forward == 0 {
            DriverForget::Nothing
        } else {
            DriverForget::Send {
                node: driver,
                count: forward,
            }
        }
    }

    /// [`ObjectTable::forget`], for a FORGET that would go to driver `generation`: nothing is
    /// sent unless the table holds that driver's ids. A new driver is attached before its
    /// restore begins its generation here; in between, the ids would be the failed driver's,
    /// unknown to the new one, which has no lookup of the node to forget yet.
    pub fn forget_sent_to(&mut self, node: u64, count: u64, generation: u64) -> DriverForget {
        match self.forget(node, count) {
            forget if generation == self.generation => forget,
            _ => DriverForget::Nothing,
        }
    }

    /// A lock request on file handle `fh` succeeded (`request` in the kernel's ids). Only
    /// what still holds is kept: a flock replaces the handle's earlier flock, and an unlock
    /// of a whole file ends the owner's earlier POSIX locks.
    pub fn locked(&mut self, fh: u64, request: Arc<[u8]>) {
        if self.journaling() {
            let request = request.to_vec();
            self.note(&journal::Record::Locked { fh, request });
        }
        let Some(lock) = LockRequest::parse(&request) else {
            return;
        };
        let held = self.locks.entry(fh).or_default();
        held.retain(|earlier| {
            LockRequest::parse(earlier).is_some_and(|e| {
                if lock.flock {
                    !e.flock
                } else {
                    e.flock || e.owner != lock.owner || !lock.unlocks_all()
                }
            })
        });
        if !(lock.unlock && (lock.flock || lock.unlocks_all())) {
            held.push(request);
        }
        // A pathological stream of partial POSIX locks: keep the latest ones.
        let excess = held.len().saturating_sub(MAX_LOCKS_KEPT);
        held.drain(..excess);
        if held.is_empty() {
            self.locks.remove(&fh);
        }
    }

    /// The lock requests to take again on file handle `fh`, oldest first.
    pub fn locks_of(&self, fh: u64) -> Vec<Arc<[u8]>> {
        self.locks.get(&fh).cloned().unwrap_or_default()
    }

    /// Whether the kernel holds the driver's own handles (see `kernel_holds_driver_handles`):
    /// true while fast mode observes the first driver, false once the proxy takes over.
    pub fn set_kernel_holds_driver_handles(&mut self, holds: bool) {
        self.kernel_holds_driver_handles = holds;
    }

    /// Whether the kernel's release of `fh` on `node` is of an earlier use of a value the
    /// driver gave again (see `reissued`): it closes nothing.
    pub fn releases_an_earlier_use(&self, fh: u64, dir: bool, node: u64) -> bool {
        self.reissued
            .get(&(fh, dir))
            .is_some_and(|nodes| nodes.contains(&node))
    }

    /// The kernel closes handle `fh`, which it had opened on `node`. Returns the driver's
    /// handle to release, or `Lost` when there is none to close: the handle did not survive a
    /// restart, or the release is of an earlier use of a value the driver gave again (see
    /// `reissued`), and the handle open under it stays.
    pub fn release(&mut self, fh: u64, dir: bool, node: u64) -> ToDriver {
        self.note(&journal::Record::ReleaseOf { fh, dir, node });
        let key = (fh, dir);
        if let Some(earlier) = self.reissued.get_mut(&key) {
            if let Some(at) = earlier.iter().position(|&n| n == node) {
                earlier.remove(at);
                if earlier.is_empty() {
                    self.reissued.remove(&key);
                }
                return ToDriver::Lost;
            }
        }
        if !dir {
            self.locks.remove(&fh);
        }
        match self.handles.remove(&key) {
            Some(Handle {
                driver: Some(driver),
                ..
            }) => ToDriver::Mapped(driver),
            Some(_) => ToDriver::Lost,
            None => ToDriver::Unknown,
        }
    }

    /// The current driver's id for the kernel's node `node`.
    pub fn node_to_driver(&self, node: u64) -> ToDriver {
        if node == ROOT_ID {
            return ToDriver::Mapped(ROOT_ID);
        }
        match self.nodes.get(&node).map(|n| n.driver) {
            Some(DriverNode::Known(d)) => ToDriver::Mapped(d),
            Some(DriverNode::Pending) => ToDriver::Pending,
            Some(DriverNode::Lost) => ToDriver::Lost,
            None => ToDriver::Unknown,
        }
    }

    /// The current driver's handle for the kernel's `fh`.
    pub fn handle_to_driver(&self, fh: u64, dir: bool) -> ToDriver {
        match self.handles.get(&(fh, dir)) {
            Some(Handle {
                driver: Some(d), ..
            }) => ToDriver::Mapped(*d),
            Some(_) => ToDriver::Lost,
            None => ToDriver::Unknown,
        }
    }

    /// Rewrites the id `fields` of a request in `msg` from the kernel's ids to the current
    /// driver's, and returns the kernel's values so the request can be sent again to another
    /// driver. Changes nothing unless every field can be translated, and every entry `change`
    /// removes or replaces is known to the driver (see [`ObjectTable::pending_named`]).
    pub fn to_driver(
        &self,
        msg: &mut [u8],
        fields: impl IntoIterator<Item = IdField>,
        change: &PendingChange,
    ) -> Result<Patches, Untranslated> {
        if let Some(node) = self.pending_named(change) {
            return Err(Untranslated::Pending(node));
        }
        let mut patches = Patches::default();
        for field in fields {
            let at = field.at();
            let Some(kernel) = read_u64(msg, at) else {
                continue;
            };
            let mapped = match field {
                IdField::Node { .. } => self.node_to_driver(kernel),
                IdField::Handle { dir, .. } => self.handle_to_driver(kernel, dir),
            };
            match mapped {
                ToDriver::Mapped(driver) if driver != kernel => patches.push(at, driver),
                ToDriver::Mapped(_) | ToDriver::Unknown => {}
                ToDriver::Pending => return Err(Untranslated::Pending(kernel)),
                ToDriver::Lost => return Err(Untranslated::Lost),
            }
        }
        // `patches` holds the driver's values until they are written; then the kernel's.
        Ok(patches.apply(msg))
    }

    /// The kernel's id for a node the driver names (in a notification); `None` if the kernel
    /// does not hold it.
    pub fn node_from_driver(&self, driver: u64) -> Option<u64> {
        if driver == ROOT_ID {
            return Some(ROOT_ID);
        }
        self.by_driver.get(&driver).copied()
    }

    /// Why the successful reply `body` to a request of `opcode` that would make `change`
    /// cannot be right, if it cannot: a new file or directory (CREATE, MKNOD, MKDIR, SYMLINK)
    /// comes back as a node the kernel already holds (the kernel requires node ids to be
    /// unique while it holds them), or a LOOKUP returns a node the kernel holds under another
    /// name although the node has only one (a directory, or a file with one link). Such
    /// replies come from a driver whose lookups have gone wrong; a second driver may disagree.
    pub fn impossible_entry(
        &self,
        opcode: Opcode,
        change: &PendingChange,
        body: &[u8],
    ) -> Option<String> {
        let (parent, name) = match change {
            PendingChange::Entry { parent, name } | PendingChange::Create { parent, name, .. } => {
                (*parent, name)
            }
            _ => return None,
        };
        let (entry, _) = EntryOut::read_from_prefix(body).ok()?;
        let node = self.node_from_driver(entry.nodeid)?;
        let shown = String::from_utf8_lossy(name);
        match opcode {
            Opcode::Link => None,
            Opcode::Create | Opcode::Mknod | Opcode::Mkdir | Opcode::Symlink => Some(format!(
                "the new entry {shown:?} is node {node}, which the kernel already holds"
            )),
            _ if node == ROOT_ID => Some(format!("{shown:?} is the root")),
            _ => {
                let (known_parent, known_name) = self.nodes.get(&node)?.name.as_ref()?;
                let one_name = entry.attr.mode & S_IFMT == S_IFDIR || entry.attr.nlink == 1;
                (one_name && (*known_parent, &**known_name) != (parent, &**name)).then(|| {
                    format!(
                        "{shown:?} is node {node}, which the kernel holds as {:?} and which has \
                         one name",
                        String::from_utf8_lossy(known_name)
                    )
                })
            }
        }
    }

    /// The node the kernel knows as `parent/name`.
    pub fn node_named(&self, parent: u64, name: &[u8]) -> Option<u64> {
        self.names.get(&NameRef(parent, name)).copied()
    }

    /// The paths and inode numbers of up to `n` nodes the kernel holds (root excluded) whose
    /// inode number and path are known.
    pub fn numbered_paths(&self, n: usize) -> Vec<(Vec<Box<[u8]>>, u64)> {
        self.nodes
            .iter()
            .filter(|(_, node)| node.ino != 0)
            .filter_map(|(&id, node)| {
                let path = self.path(id)?;
                Some((path.into_iter().map(Box::from).collect(), node.ino))
            })
            .take(n)
            .collect()
    }

    /// The inode number of the file `name` in `parent` leads to, as last seen; 0 if unknown.
    pub fn ino_named(&self, parent: u64, name: &[u8]) -> u64 {
        self.node_named(parent, name)
            .and_then(|node| self.node(node))
            .map_or(0, |node| node.ino)
    }

    /// The node ids the kernel holds (root excluded).
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// The handles the kernel holds open.
    pub fn handle_count(&self) -> usize {
        self.handles.len()
    }

    pub fn node(&self, node: u64) -> Option<&Node> {
        self.nodes.get(&node)
    }

    /// The names leading from the root to `node`, or `None` if some node on the way has lost
    /// its name or is unknown (then it cannot be found again by path).
    pub fn path(&self, node: u64) -> Option<Vec<&[u8]>> {
        let mut components = Vec::new();
        let mut at = node;
        while at != ROOT_ID {
            let (parent, name) = self.nodes.get(&at)?.name.as_ref()?;
            components.push(&name[..]);
            at = *parent;
            // A cycle would be a driver lying about parents; a path is never this deep.
            if components.len() > 4096 {
                return None;
            }
        }
        components.reverse();
        Some(components)
    }

    /// The kernel gains a lookup of the driver's node `driver` as `parent/name`, from the entry
    /// at `at` of `reply` (whose generation is made the one the kernel knows); returns the
    /// kernel's id for it.
    fn looked_up(
        &mut self,
        driver: u64,
        reply: &mut [u8],
        at: usize,
        parent: u64,
        name: Box<[u8]>,
    ) -> u64 {
        if driver == ROOT_ID {
            return ROOT_ID;
        }
        let ino = entry_ino(reply, at);
        let generation_at = at + GENERATION_AT;
        let generation = read_u64(reply, generation_at).unwrap_or(0);
        let pending_here = self
            .names
            .get(&NameRef(parent, &name))
            .copied()
            .filter(|n| {
                self.nodes
                    .get(n)
                    .is_some_and(|e| e.driver == DriverNode::Pending)
            });
        let node = match (self.by_driver.get(&driver), pending_here) {
            (Some(&node), _) => node,
            // The restarted driver names a node the kernel holds by that path: the same one.
            (None, Some(node)) => {
                if let Some(entry) = self.nodes.get_mut(&node) {
                    entry.driver = DriverNode::Known(driver);
                    entry.driver_lookups = 0;
                }
                node
            }
            (None, None) if !self.nodes.contains_key(&driver) => driver,
            (None, None) => self.fresh_id(|t, id| t.nodes.contains_key(&id)),
        };
        self.by_driver.insert(driver, node);
        let entry = self.nodes.entry(node).or_insert(Node {
            lookups: 0,
            name: None,
            driver: DriverNode::Known(driver),
            driver_lookups: 0,
            ino: 0,
            generation,
        });
        if entry.generation != generation && reply.len() >= generation_at + 8 {
            write_u64(reply, generation_at, entry.generation);
        }
        if ino != 0 {
            entry.ino = ino;
        }
        entry.lookups += 1;
        entry.driver_lookups += 1;
        entry.driver = DriverNode::Known(driver);
        // `.` and `..` (NFS export lookups) name some other node's relation, not this one.
        if &name[..] != b"." && &name[..] != b".." {
            self.name(node, parent, name);
        }
        node
    }

    /// The kernel opened the driver's handle `driver` on `node`; returns the kernel's fh.
    fn opened(&mut self, driver: u64, dir: bool, node: u64, flags: u32) -> u64 {
        if self.kernel_holds_driver_handles {
            // The kernel has `driver` as its fh. A handle it still holds under that value (its
            // release not yet seen, or a driver that answers one value to every open) is
            // noted, so that its release does not end this one.
            if let Some(earlier) = self.handles.get(&(driver, dir)) {
                let node = earlier.node;
                self.reissued.entry((driver, dir)).or_default().push(node);
                if !dir {
                    // The earlier use's locks ended when the driver closed it.
                    self.locks.remove(&driver);
                }
            }
            self.handles.insert(
                (driver, dir),
                Handle {
                    node,
                    flags,
                    driver: Some(driver),
                },
            );
            return driver;
        }
        // Drivers may hand out one value for many handles (some answer 0 to every open): the
        // kernel gets a distinct one for each.
        let taken = |t: &Self, id: u64| {
            t.handles.contains_key(&(id, dir)) || t.reissued.contains_key(&(id, dir))
        };
        let fh = if taken(self, driver) {
            self.fresh_id(taken)
        } else {
            driver
        };
        self.handles.insert(
            (fh, dir),
            Handle {
                node,
                flags,
                driver: Some(driver),
            },
        );
        fh
    }

    fn fresh_id(&mut self, taken: impl Fn(&Self, u64) -> bool) -> u64 {
        loop {
            let id = self.next_fresh;
            self.next_fresh = self.next_fresh.wrapping_add(1).max(FRESH_IDS);
            if !taken(self, id) {
                return id;
            }
        }
    }

    fn name(&mut self, node: u64, parent: u64, name: Box<[u8]>) {
        // Whatever was known under this name before is no longer reachable by it.
        if let Some(previous) = self.names.insert((parent, name.clone()), node) {
            if previous != node {
                if let Some(old) = self.nodes.get_mut(&previous) {
                    old.name = None;
                }
            }
        }
        if let Some(entry) = self.nodes.get_mut(&node) {
            if let Some(old_name) = entry.name.replace((parent, name.clone())) {
                if old_name != (parent, name) {
                    self.names.remove(&old_name);
                }
            }
        }
    }

    fn remove_node(&mut self, node: u64) {
        if let Some(entry) = self.nodes.remove(&node) {
            if let Some(name) = entry.name {
                self.names.remove(&name);
            }
            if let DriverNode::Known(driver) = entry.driver {
                if self.by_driver.get(&driver) == Some(&node) {
                    self.by_driver.remove(&driver);
                }
            }
        }
    }

    fn unlink(&mut self, parent: u64, name: &[u8]) {
        if let Some(node) = self.names.remove(&NameRef(parent, name)) {
            if let Some(entry) = self.nodes.get_mut(&node) {
                entry.name = None;
            }
        }
    }

    fn rename(
        &mut self,
        parent: u64,
        name: Box<[u8]>,
        new_parent: u64,
        new_name: Box<[u8]>,
        exchange: bool,
    ) {
        let moved = self.names.remove(&NameRef(parent, &name));
        let displaced = self.names.remove(&NameRef(new_parent, &new_name));
        if let Some(node) = moved {
            self.names.insert((new_parent, new_name.clone()), node);
            if let Some(entry) = self.nodes.get_mut(&node) {
                entry.name = Some((new_parent, new_name));
            }
        }
        if let Some(node) = displaced {
            let entry = self.nodes.get_mut(&node);
            if exchange {
                self.names.insert((parent, name.clone()), node);
                if let Some(entry) = entry {
                    entry.name = Some((parent, name));
                }
            } else if let Some(entry) = entry {
                entry.name = None;
            }
        }
    }

    /// Every index entry names a node that names it back, every node is held, and every
    /// driver id maps back to a node that has it (used by the tests).
    pub fn is_consistent(&self) -> bool {
        self.names.iter().all(|(key, node)| {
            self.nodes
                .get(node)
                .and_then(|n| n.name.as_ref())
                .is_some_and(|name| name == key)
        }) && self.nodes.values().all(|n| n.lookups > 0)
            && self.by_driver.iter().all(|(d, k)| {
                self.nodes
                    .get(k)
                    .is_some_and(|n| n.driver == DriverNode::Known(*d))
            })
    }
}

fn write_u64(bytes: &mut [u8], at: usize, value: u64) {
    if let Some(field) = bytes.get_mut(at..at + 8) {
        field.copy_from_slice(&value.to_ne_bytes());
    }
}

#[cfg(test)]
mod tests;
