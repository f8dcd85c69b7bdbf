//! The objects the kernel holds through the driver: node ids with their lookup counts and the
//! name that leads to each, and open file and directory handles with their flags.
//!
//! This is what a restarted driver must be brought back to (shadow-driver replay): every live
//! node re-resolved by its path, every handle reopened. Changes are committed only for requests
//! the driver answered successfully with a valid reply (VINO's transactions); FORGET and
//! RELEASE take effect when the kernel sends them, since the kernel has let go either way.
//!
//! Memory: one entry per node the kernel remembers and per open handle, each with one name;
//! it follows what the kernel holds, not the traffic.

use std::collections::HashMap;

use fuse_wire::abi::ROOT_ID;
use fuse_wire::change::{direntplus_entries, entry_node, forget_entries, open_handle};
use fuse_wire::Change;

/// A node the kernel knows, and the name it was last reached by.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    /// Lookups the kernel holds (and will FORGET).
    pub lookups: u64,
    /// `None` once the name was removed (unlinked while the kernel still holds the node):
    /// such a node cannot be found again by path.
    pub name: Option<(u64, Box<[u8]>)>,
}

/// An open handle: the node it is on and the flags it was opened with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handle {
    pub node: u64,
    pub flags: u32,
}

/// A change waiting for the driver's reply, owned so it can wait in the inflight table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
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

/// Nodes and handles, with an index from `(parent, name)` to node.
#[derive(Debug, Default)]
pub struct ObjectTable {
    nodes: HashMap<u64, Node>,
    names: HashMap<(u64, Box<[u8]>), u64>,
    /// Keyed by `(fh, is_dir)`: drivers may reuse an fh value (some answer 0 to every open),
    /// so each key holds every handle the kernel has open under it.
    handles: HashMap<(u64, bool), Vec<Handle>>,
}

impl ObjectTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies what takes effect when the kernel sends the request (FORGET, BATCH_FORGET,
    /// RELEASE, RELEASEDIR) and returns what must wait for the reply.
    pub fn on_request(&mut self, change: Change<'_>) -> PendingChange {
        match change {
            Change::None => PendingChange::None,
            Change::Forget { node, count } => {
                self.forget(node, count);
                PendingChange::None
            }
            Change::BatchForget { entries } => {
                for (node, count) in forget_entries(entries) {
                    self.forget(node, count);
                }
                PendingChange::None
            }
            Change::Release { node, fh, dir } => {
                self.release(fh, dir, node);
                PendingChange::None
            }
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

    /// Commits a change whose request the driver answered with success; `reply` is the
    /// validated reply body.
    pub fn on_success(&mut self, change: PendingChange, reply: &[u8]) {
        match change {
            PendingChange::None => {}
            PendingChange::Entry { parent, name } => {
                if let Some(node) = entry_node(reply) {
                    self.lookup(node, parent, name);
                }
            }
            PendingChange::Create {
                parent,
                name,
                flags,
            } => {
                if let (Some(node), Some(fh)) = (entry_node(reply), open_handle(reply, true)) {
                    self.lookup(node, parent, name);
                    self.open(fh, false, Handle { node, flags });
                }
            }
            PendingChange::Open { node, flags, dir } => {
                if let Some(fh) = open_handle(reply, false) {
                    self.open(fh, dir, Handle { node, flags });
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
                for (node, name) in direntplus_entries(reply) {
                    self.lookup(node, dir, name.into());
                }
            }
        }
    }

    /// The node ids the kernel holds (root excluded).
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// The handles the kernel holds open.
    pub fn handle_count(&self) -> usize {
        self.handles.values().map(Vec::len).sum()
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

    fn lookup(&mut self, node: u64, parent: u64, name: Box<[u8]>) {
        if node == 0 || node == ROOT_ID {
            return;
        }
        // Whatever was known under this name before is no longer reachable by it.
        if let Some(previous) = self.names.insert((parent, name.clone()), node) {
            if previous != node {
                if let Some(old) = self.nodes.get_mut(&previous) {
                    old.name = None;
                }
            }
        }
        let entry = self.nodes.entry(node).or_insert(Node {
            lookups: 0,
            name: None,
        });
        entry.lookups += 1;
        if let Some(old_name) = entry.name.replace((parent, name.clone())) {
            if old_name != (parent, name) {
                self.names.remove(&old_name);
            }
        }
    }

    fn forget(&mut self, node: u64, count: u64) {
        let Some(entry) = self.nodes.get_mut(&node) else {
            return;
        };
        entry.lookups = entry.lookups.saturating_sub(count);
        if entry.lookups == 0 {
            if let Some(name) = self.nodes.remove(&node).and_then(|n| n.name) {
                self.names.remove(&name);
            }
        }
    }

    fn unlink(&mut self, parent: u64, name: &[u8]) {
        if let Some(node) = self.names.remove(&(parent, Box::from(name))) {
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
        let moved = self.names.remove(&(parent, name.clone()));
        let displaced = self.names.remove(&(new_parent, new_name.clone()));
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

    fn open(&mut self, fh: u64, dir: bool, handle: Handle) {
        self.handles.entry((fh, dir)).or_default().push(handle);
    }

    fn release(&mut self, fh: u64, dir: bool, node: u64) {
        if let Some(list) = self.handles.get_mut(&(fh, dir)) {
            if let Some(i) = list.iter().position(|h| h.node == node) {
                list.swap_remove(i);
            }
            if list.is_empty() {
                self.handles.remove(&(fh, dir));
            }
        }
    }

    /// Every index entry names a node that names it back (used by the tests).
    pub fn is_consistent(&self) -> bool {
        self.names.iter().all(|(key, node)| {
            self.nodes
                .get(node)
                .and_then(|n| n.name.as_ref())
                .is_some_and(|name| name == key)
        }) && self.nodes.values().all(|n| n.lookups > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry_reply(node: u64) -> Vec<u8> {
        let mut body = node.to_ne_bytes().to_vec();
        body.resize(128, 0);
        body
    }

    fn looked_up(table: &mut ObjectTable, parent: u64, name: &[u8], node: u64) {
        let pending = table.on_request(Change::Entry { parent, name });
        table.on_success(pending, &entry_reply(node));
    }

    #[test]
    fn lookups_are_counted_and_forgotten() {
        let mut t = ObjectTable::new();
        looked_up(&mut t, 1, b"a", 10);
        looked_up(&mut t, 1, b"a", 10);
        assert_eq!(t.node(10).unwrap().lookups, 2);
        t.on_request(Change::Forget { node: 10, count: 1 });
        assert_eq!(t.node(10).unwrap().lookups, 1);
        t.on_request(Change::Forget { node: 10, count: 1 });
        assert_eq!(t.node(10), None);
        assert!(t.is_consistent());
    }

    #[test]
    fn paths_follow_renames_and_end_at_unlinks() {
        let mut t = ObjectTable::new();
        looked_up(&mut t, 1, b"dir", 2);
        looked_up(&mut t, 2, b"file", 3);
        assert_eq!(t.path(3).unwrap(), vec![&b"dir"[..], b"file"]);
        let pending = t.on_request(Change::Rename {
            parent: 2,
            name: b"file",
            new_parent: 1,
            new_name: b"moved",
            exchange: false,
        });
        t.on_success(pending, &[]);
        assert_eq!(t.path(3).unwrap(), vec![&b"moved"[..]]);
        let pending = t.on_request(Change::Remove {
            parent: 1,
            name: b"moved",
        });
        t.on_success(pending, &[]);
        assert_eq!(t.path(3), None, "unlinked while held: no path");
        assert_eq!(t.node(3).unwrap().lookups, 1, "the kernel still holds it");
        assert!(t.is_consistent());
    }

    #[test]
    fn rename_over_an_existing_name_unlinks_the_target() {
        let mut t = ObjectTable::new();
        looked_up(&mut t, 1, b"a", 2);
        looked_up(&mut t, 1, b"b", 3);
        let pending = t.on_request(Change::Rename {
            parent: 1,
            name: b"a",
            new_parent: 1,
            new_name: b"b",
            exchange: false,
        });
        t.on_success(pending, &[]);
        assert_eq!(t.path(2).unwrap(), vec![&b"b"[..]]);
        assert_eq!(t.path(3), None);
        assert!(t.is_consistent());
    }

    #[test]
    fn a_failed_request_changes_nothing() {
        let mut t = ObjectTable::new();
        let _pending = t.on_request(Change::Entry {
            parent: 1,
            name: b"x",
        });
        // No on_success: the driver answered with an error.
        assert_eq!(t.node_count(), 0);
    }

    #[test]
    fn handles_with_the_same_fh_are_kept_apart() {
        let mut t = ObjectTable::new();
        let mut open_reply = 0u64.to_ne_bytes().to_vec();
        open_reply.resize(16, 0);
        for node in [5, 6] {
            let pending = t.on_request(Change::Open {
                node,
                flags: 2,
                dir: false,
            });
            t.on_success(pending, &open_reply);
        }
        assert_eq!(t.handle_count(), 2);
        t.on_request(Change::Release {
            node: 6,
            fh: 0,
            dir: false,
        });
        assert_eq!(t.handle_count(), 1);
    }
}
