//! The object table as plain data, for a successor rebound that takes the mount over
//! (`rebound reload`): every node with its name, lookups and generation, every open handle,
//! the lock requests to take again. Its indexes (by name, by driver id) are rebuilt from the
//! nodes, so a snapshot cannot hold two that disagree.
//!
//! Owns: the snapshot's form. Must not: decide when one is taken or read.

use serde::{Deserialize, Serialize};

use super::{DriverNode, Handle, Node, ObjectTable};

/// An [`ObjectTable`], serialisable.
#[derive(Debug, Serialize, Deserialize)]
pub struct ObjectSnapshot {
    nodes: Vec<NodeSnapshot>,
    /// `(fh, is_dir, node, flags, driver's fh)`.
    handles: Vec<(u64, bool, u64, u32, Option<u64>)>,
    /// `(fh, lock requests)`.
    locks: Vec<(u64, Vec<Vec<u8>>)>,
    /// Handles the first driver gave again while the release of their earlier uses was still
    /// to be seen (`ObjectTable::reissued`). Not in the snapshot's own encoding, whose layout
    /// journals of older rebounds fix (postcard has no optional fields): a journal carries
    /// them in a frame of their own ([`ObjectSnapshot::reissued`], [`ObjectSnapshot::set_reissued`]).
    #[serde(skip)]
    reissued: Reissued,
    next_fresh: u64,
    generation: u64,
}

/// `(fh, is_dir, nodes)`: each handle value given again, with the nodes of its earlier uses.
pub type Reissued = Vec<(u64, bool, Vec<u64>)>;

impl ObjectSnapshot {
    /// The handles given again (see the field): encoded apart from the snapshot.
    pub fn reissued(&self) -> &Reissued {
        &self.reissued
    }

    /// Puts back the handles given again, as decoded apart from the snapshot.
    pub fn set_reissued(&mut self, reissued: Reissued) {
        self.reissued = reissued;
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct NodeSnapshot {
    id: u64,
    lookups: u64,
    name: Option<(u64, Vec<u8>)>,
    /// The driver's id, if it knows the node.
    driver: Option<u64>,
    lost: bool,
    driver_lookups: u64,
    ino: u64,
    generation: u64,
}

impl ObjectTable {
    pub fn snapshot(&self) -> ObjectSnapshot {
        let nodes = self
            .nodes
            .iter()
            .map(|(&id, n)| NodeSnapshot {
                id,
                lookups: n.lookups,
                name: n.name.as_ref().map(|(p, name)| (*p, name.to_vec())),
                driver: match n.driver {
                    DriverNode::Known(d) => Some(d),
                    _ => None,
                },
                lost: n.driver == DriverNode::Lost,
                driver_lookups: n.driver_lookups,
                ino: n.ino,
                generation: n.generation,
            })
            .collect();
        let mut snapshot = ObjectSnapshot {
            nodes,
            handles: self
                .handles
                .iter()
                .map(|(&(fh, dir), h)| (fh, dir, h.node, h.flags, h.driver))
                .collect(),
            locks: self
                .locks
                .iter()
                .map(|(&fh, locks)| (fh, locks.iter().map(|l| l.to_vec()).collect()))
                .collect(),
            reissued: self
                .reissued
                .iter()
                .map(|(&(fh, dir), nodes)| (fh, dir, nodes.clone()))
                .collect(),
            next_fresh: self.next_fresh,
            generation: self.generation,
        };
        // In id order: the same table always gives the same snapshot.
        snapshot.nodes.sort_unstable_by_key(|n| n.id);
        snapshot.handles.sort_unstable();
        snapshot.locks.sort_unstable();
        snapshot.reissued.sort_unstable();
        snapshot
    }

    pub fn from_snapshot(snapshot: ObjectSnapshot) -> ObjectTable {
        let mut table = ObjectTable {
            next_fresh: snapshot.next_fresh,
            generation: snapshot.generation,
            ..ObjectTable::default()
        };
        for n in snapshot.nodes {
            let name = n.name.map(|(p, name)| (p, name.into_boxed_slice()));
            if let Some((parent, name)) = &name {
                table.names.insert((*parent, name.clone()), n.id);
            }
            let driver = match (n.driver, n.lost) {
                (Some(d), _) => {
                    table.by_driver.insert(d, n.id);
                    DriverNode::Known(d)
                }
                (None, true) => DriverNode::Lost,
                (None, false) => DriverNode::Pending,
            };
            table.nodes.insert(
                n.id,
                Node {
                    lookups: n.lookups,
                    name,
                    driver,
                    driver_lookups: n.driver_lookups,
                    ino: n.ino,
                    generation: n.generation,
                },
            );
        }
        for (fh, dir, node, flags, driver) in snapshot.handles {
            table.handles.insert(
                (fh, dir),
                Handle {
                    node,
                    flags,
                    driver,
                },
            );
        }
        for (fh, locks) in snapshot.locks {
            table
                .locks
                .insert(fh, locks.into_iter().map(Into::into).collect());
        }
        for (fh, dir, nodes) in snapshot.reissued {
            table.reissued.insert((fh, dir), nodes);
        }
        table
    }
}
