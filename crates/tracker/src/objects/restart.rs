//! What a restarted driver is brought back to: when a new driver replaces the old one, every
//! driver id is forgotten and the kernel's nodes become pending, to be looked up by their
//! paths when first needed; handles are reopened at once; a node or handle the new driver
//! gives back is recorded here.
//!
//! Owns: the table's side of a restart. Must not: talk to a driver (the proxy's recovery
//! does, with what these methods say to ask).

use fuse_wire::abi::ROOT_ID;

use super::{DriverNode, ObjectTable, PendingChange};

/// One step of a path to look up: `(node, parent, name)`.
pub type PathStep = (u64, u64, Box<[u8]>);

/// What a restarted driver must be brought back to at once: the open handles. (Nodes are
/// looked up when first needed.)
#[derive(Debug, Default)]
pub struct RestorePlan {
    /// `(fh, dir, node, flags)`.
    pub handles: Vec<(u64, bool, u64, u32)>,
}

impl ObjectTable {
    /// A new driver replaces the old one: every driver id is forgotten. Nodes become
    /// pending (looked up by path when first needed); the plan lists the handles to reopen.
    pub fn begin_generation(&mut self, generation: u64) -> RestorePlan {
        self.generation = generation;
        self.by_driver.clear();
        for node in self.nodes.values_mut() {
            node.driver = DriverNode::Pending;
            node.driver_lookups = 0;
        }
        for handle in self.handles.values_mut() {
            handle.driver = None;
        }
        RestorePlan {
            handles: self
                .handles
                .iter()
                .map(|(&(fh, dir), h)| (fh, dir, h.node, h.flags))
                .collect(),
        }
    }

    /// The pending nodes on the way from the root to `node`, as `(node, parent, name)` from
    /// the top: what a restarted driver must be asked, in order, before `node` can be used.
    /// Empty if `node` is known (or not tracked); `None` if the way is lost (the node or one
    /// above it has no name, or is lost).
    pub fn pending_path(&self, node: u64) -> Option<Vec<PathStep>> {
        let mut chain = Vec::new();
        let mut at = node;
        while at != ROOT_ID {
            let Some(entry) = self.nodes.get(&at) else {
                break;
            };
            match (&entry.driver, &entry.name) {
                (DriverNode::Known(_), _) => break,
                (DriverNode::Pending, Some((parent, name))) => {
                    chain.push((at, *parent, name.clone()));
                    at = *parent;
                }
                (DriverNode::Lost, _) | (DriverNode::Pending, None) => return None,
            }
            if chain.len() > 4096 {
                return None;
            }
        }
        chain.reverse();
        Some(chain)
    }

    /// A node the kernel holds by a name `change` acts on (the entry an UNLINK, RMDIR or
    /// RENAME removes or replaces) that the restarted driver has not been asked for yet.
    /// The kernel sends such a request without a LOOKUP when it has the name cached, and a
    /// driver may count on having been asked for every name the kernel holds (fuse-overlayfs
    /// frees the node it never counted, and then uses it): it is asked for the name first.
    pub(super) fn pending_named(&self, change: &PendingChange) -> Option<u64> {
        let pending = |parent: u64, name: &[u8]| {
            self.node_named(parent, name).filter(|node| {
                self.nodes
                    .get(node)
                    .is_some_and(|e| e.driver == DriverNode::Pending)
            })
        };
        match change {
            PendingChange::Remove { parent, name } => pending(*parent, name),
            PendingChange::Rename {
                parent,
                name,
                new_parent,
                new_name,
                ..
            } => pending(*parent, name).or_else(|| pending(*new_parent, new_name)),
            _ => None,
        }
    }

    /// The restarted driver has no node for `node`: requests on it fail from now on.
    /// Returns whether it was pending until now.
    pub fn mark_lost(&mut self, node: u64) -> bool {
        match self.nodes.get_mut(&node) {
            Some(entry) if entry.driver == DriverNode::Pending => {
                entry.driver = DriverNode::Lost;
                true
            }
            _ => false,
        }
    }

    /// The current driver gives `node` the inode number `ino` (a restarted one may number a
    /// file anew: fuse2fs when the file was made again by a replay). 0: unknown, kept.
    pub fn renumber(&mut self, node: u64, ino: u64) {
        if let (Some(entry), true) = (self.nodes.get_mut(&node), ino != 0) {
            entry.ino = ino;
        }
    }

    /// The driver generation whose ids the table holds.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Driver `generation` knows `node` as `driver` (one lookup). Returns false if the kernel
    /// has let go of the node meanwhile, or if that driver is no longer the one the table is
    /// for (its answer came late; its ids mean other files to its successor); the caller then
    /// makes the driver forget it.
    pub fn restore_node(&mut self, node: u64, driver: u64, generation: u64) -> bool {
        if generation != self.generation {
            return false;
        }
        let Some(entry) = self.nodes.get_mut(&node) else {
            return false;
        };
        match entry.driver {
            DriverNode::Known(known) if known == driver => entry.driver_lookups += 1,
            DriverNode::Pending => {
                entry.driver = DriverNode::Known(driver);
                entry.driver_lookups = 1;
            }
            // Found again as something else meanwhile: this lookup goes back.
            DriverNode::Known(_) | DriverNode::Lost => return false,
        }
        self.by_driver.entry(driver).or_insert(node);
        true
    }

    /// The new driver reopened the kernel's `fh` as `driver`. Returns false if the kernel has
    /// closed it meanwhile; the caller then releases it in the driver.
    pub fn restore_handle(&mut self, fh: u64, dir: bool, driver: u64) -> bool {
        match self.handles.get_mut(&(fh, dir)) {
            Some(handle) => {
                handle.driver = Some(driver);
                true
            }
            None => false,
        }
    }

    /// The driver handed out one more lookup of a node (a lookup of rebound's own, during
    /// recovery). Returns false if the kernel does not hold the node.
    pub fn count_driver_lookup(&mut self, driver: u64) -> bool {
        let Some(&node) = self.by_driver.get(&driver) else {
            return false;
        };
        match self.nodes.get_mut(&node) {
            Some(entry) => {
                entry.driver_lookups += 1;
                true
            }
            None => false,
        }
    }
}
