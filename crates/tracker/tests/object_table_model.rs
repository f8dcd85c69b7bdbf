//! Property test: any sequence of lookups, forgets, renames and unlinks keeps the object
//! table's name index consistent, the lookup counts equal a simple model's, and across
//! restarts every driver is forgotten exactly the lookups it handed out.

use std::collections::HashMap;

use fuse_wire::Change;
use proptest::prelude::*;
use tracker::objects::{DriverForget, ToDriver};
use tracker::{ObjectTable, PendingChange};

#[derive(Clone, Debug)]
enum Op {
    Lookup {
        parent: u64,
        name: u8,
        node: u64,
    },
    Forget {
        node: u64,
        count: u64,
    },
    Rename {
        name: u8,
        new_name: u8,
        exchange: bool,
    },
    Unlink {
        name: u8,
    },
    /// The driver is replaced by a new one, which re-resolves what the kernel holds.
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1u64..4, 0u8..6, 2u64..12).prop_map(|(parent, name, node)| Op::Lookup {
            parent,
            name,
            node
        }),
        (2u64..12, 1u64..3).prop_map(|(node, count)| Op::Forget { node, count }),
        (0u8..6, 0u8..6, any::<bool>()).prop_map(|(name, new_name, exchange)| Op::Rename {
            name,
            new_name,
            exchange
        }),
        (0u8..6).prop_map(|name| Op::Unlink { name }),
        Just(Op::Restart),
    ]
}

fn entry_reply(node: u64) -> Vec<u8> {
    let mut body = node.to_ne_bytes().to_vec();
    body.resize(128, 0);
    body
}

/// The driver of generation `generation` calls its file `file` by this id.
fn driver_id(file: u64, generation: u64) -> u64 {
    file + 100 * generation
}

proptest! {
    #[test]
    fn index_stays_consistent_and_counts_match(ops in proptest::collection::vec(op(), 0..200)) {
        let mut table = ObjectTable::new();
        // The model: kernel lookups per kernel id, which file each kernel id is, and the
        // lookups each driver id has handed out and not yet been forgotten.
        let mut lookups: HashMap<u64, u64> = HashMap::new();
        let mut file_of: HashMap<u64, u64> = HashMap::new();
        let mut driver_out: HashMap<u64, u64> = HashMap::new();
        let mut generation = 0;
        for op in ops {
            match op {
                Op::Lookup { parent, name, node: file } => {
                    let name = [b'a' + name];
                    let pending = PendingChange::of(Change::Entry { parent, name: &name });
                    let driver = driver_id(file, generation);
                    let mut reply = entry_reply(driver);
                    table.on_success(0, pending, &mut reply);
                    let node = u64::from_ne_bytes(reply[..8].try_into().unwrap());
                    prop_assert_eq!(table.node_to_driver(node), ToDriver::Mapped(driver));
                    *lookups.entry(node).or_default() += 1;
                    file_of.insert(node, file);
                    *driver_out.entry(driver).or_default() += 1;
                }
                Op::Forget { node, count } => {
                    let Some(n) = lookups.get_mut(&node) else { continue };
                    if let DriverForget::Send { node: driver, count: sent } = table.forget(node, count) {
                        let out = driver_out.get_mut(&driver);
                        prop_assert!(out.as_ref().is_some_and(|o| **o >= sent), "over-forgotten");
                        *out.unwrap() -= sent;
                    }
                    *n = n.saturating_sub(count);
                    if *n == 0 { lookups.remove(&node); }
                }
                Op::Rename { name, new_name, exchange } => {
                    let (a, b) = ([b'a' + name], [b'a' + new_name]);
                    let pending = PendingChange::of(Change::Rename {
                        parent: 1, name: &a, new_parent: 1, new_name: &b, exchange,
                    });
                    table.on_success(0, pending, &mut []);
                }
                Op::Unlink { name } => {
                    let a = [b'a' + name];
                    let pending = PendingChange::of(Change::Remove { parent: 1, name: &a });
                    table.on_success(0, pending, &mut []);
                }
                Op::Restart => {
                    generation += 1;
                    driver_out.clear();
                    table.begin_generation(generation);
                    // Some nodes are asked for again (as requests name them), others stay
                    // pending or turn out lost.
                    let mut held: Vec<u64> = lookups.keys().copied().collect();
                    held.sort_unstable();
                    for node in held.into_iter().step_by(2) {
                        for (n, _, _) in table.pending_path(node).unwrap_or_default() {
                            let driver = driver_id(file_of[&n], generation);
                            if table.restore_node(n, driver, generation) {
                                *driver_out.entry(driver).or_default() += 1;
                            }
                        }
                    }
                }
            }
            prop_assert!(table.is_consistent());
        }
        prop_assert_eq!(table.node_count(), lookups.len());
        for (node, count) in &lookups {
            prop_assert_eq!(table.node(*node).map(|n| n.lookups), Some(*count));
            // A path, when there is one, leads back through known nodes.
            if let Some(path) = table.path(*node) {
                prop_assert!(!path.is_empty());
            }
        }
        // When the kernel lets go of everything, the driver is forgotten exactly what it
        // handed out.
        for (node, count) in lookups {
            if let DriverForget::Send { node: driver, count: sent } = table.forget(node, count) {
                *driver_out.get_mut(&driver).unwrap() -= sent;
            }
        }
        prop_assert!(driver_out.values().all(|&n| n == 0), "{:?}", driver_out);
    }
}
