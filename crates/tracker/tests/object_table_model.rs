//! Property test: any sequence of lookups, forgets, renames and unlinks keeps the object
//! table's name index consistent, and the lookup counts equal a simple model's.

use std::collections::HashMap;

use fuse_wire::Change;
use proptest::prelude::*;
use tracker::ObjectTable;

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
    ]
}

fn entry_reply(node: u64) -> Vec<u8> {
    let mut body = node.to_ne_bytes().to_vec();
    body.resize(128, 0);
    body
}

proptest! {
    #[test]
    fn index_stays_consistent_and_counts_match(ops in proptest::collection::vec(op(), 0..200)) {
        let mut table = ObjectTable::new();
        let mut lookups: HashMap<u64, u64> = HashMap::new();
        for op in ops {
            match op {
                Op::Lookup { parent, name, node } => {
                    let name = [b'a' + name];
                    let pending = table.on_request(Change::Entry { parent, name: &name });
                    table.on_success(pending, &entry_reply(node));
                    *lookups.entry(node).or_default() += 1;
                }
                Op::Forget { node, count } => {
                    table.on_request(Change::Forget { node, count });
                    if let Some(n) = lookups.get_mut(&node) {
                        *n = n.saturating_sub(count);
                        if *n == 0 { lookups.remove(&node); }
                    }
                }
                Op::Rename { name, new_name, exchange } => {
                    let (a, b) = ([b'a' + name], [b'a' + new_name]);
                    let pending = table.on_request(Change::Rename {
                        parent: 1, name: &a, new_parent: 1, new_name: &b, exchange,
                    });
                    table.on_success(pending, &[]);
                }
                Op::Unlink { name } => {
                    let a = [b'a' + name];
                    let pending = table.on_request(Change::Remove { parent: 1, name: &a });
                    table.on_success(pending, &[]);
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
    }
}
