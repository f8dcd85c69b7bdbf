//! The object table's own tests: ids, names, handles and locks across driver restarts.

use super::*;

pub(super) fn entry_reply(node: u64) -> Vec<u8> {
    let mut body = node.to_ne_bytes().to_vec();
    body.resize(128, 0);
    body
}

/// An entry reply for `node` whose attributes say `mode` and `nlink`.
fn entry_with(node: u64, mode: u32, nlink: u32) -> Vec<u8> {
    let entry = EntryOut {
        nodeid: node,
        attr: fuse_wire::abi::Attr {
            mode,
            nlink,
            ..Default::default()
        },
        ..Default::default()
    };
    zerocopy::IntoBytes::as_bytes(&entry).to_vec()
}

#[test]
fn impossible_entries_are_told_from_possible_ones() {
    let mut t = ObjectTable::new();
    let a = looked_up(&mut t, ROOT_ID, b"a", 5);
    let lookup = |name: &[u8]| PendingChange::Entry {
        parent: ROOT_ID,
        name: name.into(),
    };
    let file = 0o100644;
    // The same name again, a new node, or a file with two links: fine.
    assert_eq!(
        t.impossible_entry(Opcode::Lookup, &lookup(b"a"), &entry_with(5, file, 1)),
        None
    );
    assert_eq!(
        t.impossible_entry(Opcode::Lookup, &lookup(b"b"), &entry_with(6, file, 1)),
        None
    );
    assert_eq!(
        t.impossible_entry(Opcode::Lookup, &lookup(b"b"), &entry_with(5, file, 2)),
        None
    );
    assert_eq!(
        t.impossible_entry(Opcode::Link, &lookup(b"b"), &entry_with(5, file, 2)),
        None
    );
    // Another name for a file with one link, or for a directory; the root as a child.
    let why = t.impossible_entry(Opcode::Lookup, &lookup(b"b"), &entry_with(5, file, 1));
    assert!(why.is_some_and(|w| w.contains(&a.to_string())));
    assert!(t
        .impossible_entry(Opcode::Lookup, &lookup(b"b"), &entry_with(5, 0o040755, 3))
        .is_some());
    assert!(t
        .impossible_entry(Opcode::Lookup, &lookup(b"b"), &entry_with(ROOT_ID, file, 1))
        .is_some());
    // A new directory that is a node the kernel holds.
    assert!(t
        .impossible_entry(Opcode::Mkdir, &lookup(b"d"), &entry_with(5, 0o040755, 2))
        .is_some());
    assert_eq!(
        t.impossible_entry(Opcode::Mkdir, &lookup(b"d"), &entry_with(7, 0o040755, 2)),
        None
    );
}

fn open_reply(fh: u64) -> Vec<u8> {
    let mut body = fh.to_ne_bytes().to_vec();
    body.resize(16, 0);
    body
}

/// Looks `parent/name` up, the driver answering `driver`; returns the kernel's id.
pub(super) fn looked_up(table: &mut ObjectTable, parent: u64, name: &[u8], driver: u64) -> u64 {
    let pending = PendingChange::of(Change::Entry { parent, name });
    let mut reply = entry_reply(driver);
    table.on_success(0, pending, &mut reply);
    entry_node(&reply).unwrap()
}

pub(super) fn opened(table: &mut ObjectTable, node: u64, driver_fh: u64) -> u64 {
    let pending = PendingChange::of(Change::Open {
        node,
        flags: 2,
        dir: false,
    });
    let mut reply = open_reply(driver_fh);
    table.on_success(0, pending, &mut reply);
    open_handle(&reply, false).unwrap()
}

#[test]
fn a_snapshot_brings_back_the_same_table() {
    let mut t = ObjectTable::new();
    let d = looked_up(&mut t, ROOT_ID, b"d", 10);
    let f = looked_up(&mut t, d, b"f", 11);
    let fh = opened(&mut t, f, 77);
    t.begin_generation(1);
    let g = looked_up(&mut t, ROOT_ID, b"g", 12);
    let json = serde_json::to_string(&t.snapshot()).unwrap();
    let back = ObjectTable::from_snapshot(serde_json::from_str(&json).unwrap());
    assert_eq!(serde_json::to_string(&back.snapshot()).unwrap(), json);
    // Its indexes work: by name, by the driver's id, and the handle.
    assert_eq!(back.pending_path(f).unwrap().len(), 2);
    assert_eq!(back.pending_path(g), Some(Vec::new()));
    assert_eq!(back.handles.get(&(fh, false)).map(|h| h.node), Some(f));
    assert_eq!(back.by_driver.get(&12), Some(&g));
    assert_eq!(back.names.get(&(d, b"f"[..].into())), Some(&f));
}

#[test]
fn the_kernel_sees_a_node_with_the_generation_it_first_got() {
    let mut t = ObjectTable::new();
    let with_generation = |node: u64, generation: u64| {
        let entry = EntryOut {
            nodeid: node,
            generation,
            ..Default::default()
        };
        zerocopy::IntoBytes::as_bytes(&entry).to_vec()
    };
    let lookup = || {
        PendingChange::of(Change::Entry {
            parent: ROOT_ID,
            name: b"f",
        })
    };
    let generation_of = |reply: &[u8]| EntryOut::read_from_prefix(reply).unwrap().0.generation;
    let mut first = with_generation(5, 7);
    t.on_success(0, lookup(), &mut first);
    assert_eq!(generation_of(&first), 7);
    // A restarted driver numbers its generations afresh: the kernel still gets 7.
    t.begin_generation(1);
    let mut again = with_generation(9, 1);
    t.on_success(0, lookup(), &mut again);
    assert_eq!((entry_node(&again), generation_of(&again)), (Some(5), 7));
    // Once the kernel has forgotten the node, a new entry brings its own generation.
    t.forget(5, 2);
    let mut fresh = with_generation(9, 3);
    t.on_success(0, lookup(), &mut fresh);
    assert_eq!(generation_of(&fresh), 3);
}

#[test]
fn inode_numbers_are_known_by_name_and_by_path() {
    let mut t = ObjectTable::new();
    let numbered = |node: u64, ino: u64| {
        let mut entry = EntryOut {
            nodeid: node,
            ..Default::default()
        };
        entry.attr.ino = ino;
        zerocopy::IntoBytes::as_bytes(&entry).to_vec()
    };
    let dir = PendingChange::of(Change::Entry {
        parent: ROOT_ID,
        name: b"d",
    });
    t.on_success(0, dir, &mut numbered(5, 50));
    let file = PendingChange::of(Change::Entry {
        parent: 5,
        name: b"f",
    });
    t.on_success(0, file, &mut numbered(6, 60));
    looked_up(&mut t, ROOT_ID, b"unnumbered", 7);
    assert_eq!(t.ino_named(5, b"f"), 60);
    assert_eq!(t.ino_named(5, b"g"), 0);
    assert_eq!(t.ino_named(ROOT_ID, b"unnumbered"), 0);
    let mut paths = t.numbered_paths(8);
    paths.sort();
    let path = |names: &[&[u8]]| names.iter().map(|&n| Box::from(n)).collect::<Vec<_>>();
    assert_eq!(paths, vec![(path(&[b"d"]), 50), (path(&[b"d", b"f"]), 60)]);
    assert_eq!(t.numbered_paths(1).len(), 1);
}

#[test]
fn lookups_are_counted_and_forgotten() {
    let mut t = ObjectTable::new();
    looked_up(&mut t, 1, b"a", 10);
    looked_up(&mut t, 1, b"a", 10);
    assert_eq!(t.node(10).unwrap().lookups, 2);
    assert_eq!(t.forget(10, 1), DriverForget::Send { node: 10, count: 1 });
    assert_eq!(t.node(10).unwrap().lookups, 1);
    t.forget(10, 1);
    assert_eq!(t.node(10), None);
    assert!(t.is_consistent());
}

#[test]
fn paths_follow_renames_and_end_at_unlinks() {
    let mut t = ObjectTable::new();
    looked_up(&mut t, 1, b"dir", 2);
    looked_up(&mut t, 2, b"file", 3);
    assert_eq!(t.path(3).unwrap(), vec![&b"dir"[..], b"file"]);
    let pending = PendingChange::of(Change::Rename {
        parent: 2,
        name: b"file",
        new_parent: 1,
        new_name: b"moved",
        exchange: false,
    });
    t.on_success(0, pending, &mut []);
    assert_eq!(t.path(3).unwrap(), vec![&b"moved"[..]]);
    let pending = PendingChange::of(Change::Remove {
        parent: 1,
        name: b"moved",
    });
    t.on_success(0, pending, &mut []);
    assert_eq!(t.path(3), None, "unlinked while held: no path");
    assert_eq!(t.node(3).unwrap().lookups, 1, "the kernel still holds it");
    assert!(t.is_consistent());
}

#[test]
fn rename_over_an_existing_name_unlinks_the_target() {
    let mut t = ObjectTable::new();
    looked_up(&mut t, 1, b"a", 2);
    looked_up(&mut t, 1, b"b", 3);
    let pending = PendingChange::of(Change::Rename {
        parent: 1,
        name: b"a",
        new_parent: 1,
        new_name: b"b",
        exchange: false,
    });
    t.on_success(0, pending, &mut []);
    assert_eq!(t.path(2).unwrap(), vec![&b"b"[..]]);
    assert_eq!(t.path(3), None);
    assert!(t.is_consistent());
}

#[test]
fn a_failed_request_changes_nothing() {
    let t = ObjectTable::new();
    let _pending = PendingChange::of(Change::Entry {
        parent: 1,
        name: b"x",
    });
    // No on_success: the driver answered with an error.
    assert_eq!(t.node_count(), 0);
}

#[test]
fn a_reused_driver_handle_gets_distinct_kernel_handles() {
    let mut t = ObjectTable::new();
    let a = opened(&mut t, 5, 0);
    let b = opened(&mut t, 6, 0);
    assert_eq!(a, 0, "the first keeps the driver's value");
    assert_ne!(a, b);
    assert_eq!(t.handle_to_driver(b, false), ToDriver::Mapped(0));
    assert_eq!(t.handle_count(), 2);
    assert_eq!(t.release(b, false, 6), ToDriver::Mapped(0));
    assert_eq!(t.handle_count(), 1);
}

#[test]
fn in_fast_mode_a_reused_handle_outlives_the_late_release_of_its_earlier_use() {
    // The driver closes fd 70 (node 5's), opens node 6 on it again, and answers the open
    // before the release: fast mode sees them in that order, with the kernel holding 70.
    let mut t = ObjectTable::new();
    t.set_kernel_holds_driver_handles(true);
    assert_eq!(opened(&mut t, 5, 70), 70);
    assert_eq!(opened(&mut t, 6, 70), 70, "the kernel's fh is the driver's");
    assert_eq!(
        t.release(70, false, 5),
        ToDriver::Lost,
        "node 5's: nothing left to close"
    );
    assert_eq!(
        t.handle_to_driver(70, false),
        ToDriver::Mapped(70),
        "node 6's stays"
    );
    assert_eq!(t.handles.get(&(70, false)).map(|h| h.node), Some(6));
    assert_eq!(t.release(70, false, 6), ToDriver::Mapped(70));
    assert_eq!(t.handle_count(), 0);
}

#[test]
fn a_reused_handle_outlives_the_late_release_of_its_earlier_use_across_a_snapshot() {
    // As above, with a hand-over to a successor rebound (serving guarded) in between.
    let mut t = ObjectTable::new();
    t.set_kernel_holds_driver_handles(true);
    opened(&mut t, 5, 70);
    opened(&mut t, 6, 70);
    // Encoded as a journal does: the snapshot, and the handles given again apart.
    let snapshot = t.snapshot();
    let mut decoded: ObjectSnapshot =
        postcard::from_bytes(&postcard::to_stdvec(&snapshot).unwrap()).unwrap();
    assert!(
        decoded.reissued().is_empty(),
        "not in the snapshot's own encoding"
    );
    decoded.set_reissued(snapshot.reissued().clone());
    let mut t = ObjectTable::from_snapshot(decoded);
    assert!(t.releases_an_earlier_use(70, false, 5));
    assert!(!t.releases_an_earlier_use(70, false, 6));
    assert_eq!(t.release(70, false, 5), ToDriver::Lost, "node 5's");
    assert_eq!(
        t.handle_to_driver(70, false),
        ToDriver::Mapped(70),
        "node 6's stays"
    );
    assert_eq!(t.release(70, false, 6), ToDriver::Mapped(70));
}

#[test]
fn in_fast_mode_one_value_for_two_handles_of_a_node_takes_two_releases() {
    let mut t = ObjectTable::new();
    t.set_kernel_holds_driver_handles(true);
    opened(&mut t, 5, 0);
    opened(&mut t, 5, 0);
    assert_eq!(t.release(0, false, 5), ToDriver::Lost);
    assert_eq!(t.handle_count(), 1, "one use is still open");
    assert_eq!(t.release(0, false, 5), ToDriver::Mapped(0));
    assert_eq!(t.handle_count(), 0);
    assert_eq!(t.release(0, false, 5), ToDriver::Unknown);
}

pub(super) fn lock_request(owner: u64, start: u64, end: u64, typ: u32, flock: bool) -> Arc<[u8]> {
    let mut msg = vec![0u8; size::IN_HEADER];
    for field in [7u64, owner, start, end] {
        msg.extend_from_slice(&field.to_ne_bytes());
    }
    for field in [typ, 0, u32::from(flock), 0] {
        msg.extend_from_slice(&field.to_ne_bytes());
    }
    msg.into()
}

#[test]
fn only_locks_that_still_hold_are_kept() {
    let (rd, wr, un): (u32, u32, u32) = (0, 1, 2);
    let mut t = ObjectTable::new();
    let flock_ex = lock_request(1, 0, 0, wr, true);
    t.locked(7, lock_request(1, 0, 0, rd, true));
    t.locked(7, flock_ex.clone());
    assert_eq!(
        t.locks_of(7),
        vec![flock_ex.clone()],
        "the later flock replaces"
    );
    let posix = lock_request(9, 0, 99, wr, false);
    t.locked(7, posix.clone());
    t.locked(7, lock_request(8, 0, i64::MAX as u64, un, false));
    assert_eq!(t.locks_of(7).len(), 2, "another owner's unlock leaves them");
    t.locked(7, lock_request(9, 0, i64::MAX as u64, un, false));
    assert_eq!(
        t.locks_of(7),
        vec![flock_ex],
        "the owner's full unlock ends its locks"
    );
    t.locked(7, lock_request(1, 0, 0, un, true));
    assert!(t.locks_of(7).is_empty());
    t.locked(7, posix);
    t.release(7, false, 0);
    assert!(
        t.locks_of(7).is_empty(),
        "closing the handle ends its locks"
    );
}

#[test]
fn a_restarted_driver_is_asked_for_an_entry_before_it_removes_or_replaces_it() {
    let mut t = ObjectTable::new();
    let dir = looked_up(&mut t, ROOT_ID, b"dir", 100);
    let file = looked_up(&mut t, dir, b"file", 200);
    let other = looked_up(&mut t, dir, b"other", 300);
    t.begin_generation(1);
    assert!(t.restore_node(dir, 101, 1));
    let remove = |name: &[u8]| PendingChange::of(Change::Remove { parent: dir, name });
    // UNLINK names `dir` by id (known now) and `file` by name (not asked for yet).
    let mut msg = [0u8; 8];
    assert_eq!(
        t.to_driver(&mut msg, [], &remove(b"file")),
        Err(Untranslated::Pending(file))
    );
    assert!(
        t.to_driver(&mut msg, [], &remove(b"absent")).is_ok(),
        "no such node"
    );
    // A RENAME over `other` needs both.
    let rename = PendingChange::of(Change::Rename {
        parent: dir,
        name: b"file",
        new_parent: dir,
        new_name: b"other",
        exchange: false,
    });
    assert_eq!(
        t.to_driver(&mut msg, [], &rename),
        Err(Untranslated::Pending(file))
    );
    assert!(t.restore_node(file, 201, 1));
    assert_eq!(
        t.to_driver(&mut msg, [], &rename),
        Err(Untranslated::Pending(other))
    );
    assert!(t.mark_lost(other));
    assert!(
        t.to_driver(&mut msg, [], &rename).is_ok(),
        "a lost one is not asked for"
    );
}

#[test]
fn a_restarted_driver_gets_its_own_ids_and_the_kernel_keeps_its_own() {
    let mut t = ObjectTable::new();
    let dir = looked_up(&mut t, 1, b"dir", 100);
    let file = looked_up(&mut t, dir, b"file", 200);
    looked_up(&mut t, dir, b"file", 200);
    let fh = opened(&mut t, file, 7);
    // Unlinked while open: cannot be found again.
    let gone = looked_up(&mut t, 1, b"gone", 300);
    let gone_fh = opened(&mut t, gone, 8);
    let pending = PendingChange::of(Change::Remove {
        parent: 1,
        name: b"gone",
    });
    t.on_success(0, pending, &mut []);

    let plan = t.begin_generation(1);
    assert_eq!(plan.handles.len(), 2);
    assert_eq!(t.node_to_driver(dir), ToDriver::Pending, "until looked up");
    let path: Vec<u64> = t.pending_path(file).unwrap().iter().map(|p| p.0).collect();
    assert_eq!(path, vec![dir, file], "from the top");
    assert_eq!(t.pending_path(gone), None, "no name, no way back");
    assert!(t.mark_lost(gone));
    assert_eq!(t.node_to_driver(gone), ToDriver::Lost);

    // A lookup the failed driver answered too late is not taken for the new one's.
    assert!(!t.restore_node(dir, 150, 0));
    assert_eq!(t.node_to_driver(dir), ToDriver::Pending);

    // The new driver's ids: one collides with a kernel id of another node.
    assert!(t.restore_node(dir, 200, 1));
    assert!(t.restore_node(file, 201, 1));
    assert!(t.restore_handle(fh, false, 9));
    assert_eq!(t.node_to_driver(dir), ToDriver::Mapped(200));
    assert_eq!(t.node_to_driver(file), ToDriver::Mapped(201));
    assert_eq!(t.handle_to_driver(fh, false), ToDriver::Mapped(9));
    assert_eq!(t.node_to_driver(gone), ToDriver::Lost);
    assert_eq!(t.handle_to_driver(gone_fh, false), ToDriver::Lost);
    assert_eq!(t.node_from_driver(200), Some(dir));

    // A new node whose driver id the kernel already uses for another node.
    let new = looked_up(&mut t, dir, b"new", 100);
    assert_ne!(new, 100, "kernel id 100 is taken by `dir`");
    assert_eq!(t.node_to_driver(new), ToDriver::Mapped(100));
    // A repeated lookup of a restored node maps back to the kernel's id.
    assert_eq!(looked_up(&mut t, dir, b"file", 201), file);

    // The kernel held `file` twice before, and once more now; the new driver handed out
    // two lookups (restore + the one above), and is forgotten exactly those.
    assert_eq!(
        t.forget(file, 2),
        DriverForget::Send {
            node: 201,
            count: 1
        }
    );
    assert_eq!(
        t.forget(file, 1),
        DriverForget::Send {
            node: 201,
            count: 1
        }
    );
    assert_eq!(t.node(file), None);
    // A lost node is forgotten by the kernel only.
    assert_eq!(t.forget(gone, 1), DriverForget::Nothing);
    assert!(t.is_consistent());
}

#[test]
fn a_forget_is_not_sent_to_a_driver_whose_generation_has_not_begun() {
    let mut t = ObjectTable::new();
    let dir = looked_up(&mut t, 1, b"dir", 100);
    looked_up(&mut t, 1, b"dir", 100);
    let file = looked_up(&mut t, dir, b"file", 200);
    // Driver 1 is attached; the table still holds driver 0's ids.
    assert_eq!(t.forget_sent_to(dir, 1, 1), DriverForget::Nothing);
    assert_eq!(
        t.node(dir).map(|n| n.lookups),
        Some(1),
        "the kernel's count drops"
    );
    t.begin_generation(1);
    assert!(t.restore_node(file, 300, 1));
    assert_eq!(
        t.forget_sent_to(file, 1, 1),
        DriverForget::Send {
            node: 300,
            count: 1
        }
    );
    // A forget read for driver 0 after driver 1 began is not sent to driver 0.
    assert_eq!(t.forget_sent_to(dir, 1, 0), DriverForget::Nothing);
    assert_eq!(t.node(dir), None);
    assert!(t.is_consistent());
}

#[test]
fn a_name_is_found_by_its_borrowed_key() {
    let mut index = NameIndex::default();
    index.insert((7, b"abc"[..].into()), 9);
    assert_eq!(index.get(&NameRef(7, b"abc")), Some(&9));
    assert_eq!(index.get(&NameRef(7, b"ab")), None);
    assert_eq!(index.get(&NameRef(8, b"abc")), None);
    assert_eq!(index.remove(&NameRef(7, b"abc")), Some(9));
}
