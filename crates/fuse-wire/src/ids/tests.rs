//! The id translation's own tests: every opcode's id fields, found and rewritten.

use super::*;
use crate::abi::FileLock;
use crate::change::Change;

const NODE: u64 = 0x1000_0000_0000_0011;
const FH: u64 = 0xf000_0000_0000_00f1;

fn request(opcode: Opcode, nodeid: u64, body: &[u8]) -> Vec<u8> {
    let header = InHeader {
        len: (IN + body.len()) as u32,
        opcode: opcode as u32,
        unique: 2,
        nodeid,
        ..Default::default()
    };
    let mut msg = header.as_bytes().to_vec();
    msg.extend_from_slice(body);
    msg
}

fn reply(error: i32, body: &[u8]) -> Vec<u8> {
    let header = OutHeader {
        len: (OUT + body.len()) as u32,
        error,
        unique: if error > 0 { 0 } else { 2 },
    };
    let mut msg = header.as_bytes().to_vec();
    msg.extend_from_slice(body);
    msg
}

/// What an id field reads back as, so that tests state ids rather than offsets.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    Node(u64),
    /// `node` is `None` for [`NODE_IN_REQUEST`].
    Handle {
        fh: u64,
        node: Option<u64>,
        dir: bool,
    },
}

fn file(fh: u64, node: u64) -> Seen {
    Seen::Handle {
        fh,
        node: Some(node),
        dir: false,
    }
}

fn dir(fh: u64, node: u64) -> Seen {
    Seen::Handle {
        fh,
        node: Some(node),
        dir: true,
    }
}

fn seen(msg: &[u8], fields: impl IntoIterator<Item = IdField>) -> Vec<Seen> {
    let read = |at: usize| read_u64(msg, at).expect("offset inside the message");
    fields
        .into_iter()
        .map(|field| match field {
            IdField::Node { at } => Seen::Node(read(at)),
            IdField::Handle { at, node_at, dir } => Seen::Handle {
                fh: read(at),
                node: (node_at != NODE_IN_REQUEST).then(|| read(node_at)),
                dir,
            },
        })
        .collect()
}

fn request_ids(msg: &[u8]) -> Vec<Seen> {
    seen(msg, Request::parse(msg).unwrap().id_fields())
}

fn reply_ids(opcode: Opcode, minor: u32, msg: &[u8]) -> Vec<Seen> {
    let mut fields = Vec::new();
    for_each_reply_id(opcode, minor, msg, |field| fields.push(field));
    seen(msg, fields)
}

fn notification_ids(code: NotifyCode, body: &[u8]) -> Vec<Seen> {
    let msg = reply(code as i32, body);
    let mut fields = Vec::new();
    for_each_notification_id(code, &msg, |field| fields.push(field));
    seen(&msg, fields)
}

fn all_opcodes() -> impl Iterator<Item = Opcode> {
    (0..=64).filter_map(Opcode::from_raw)
}

#[test]
fn header_node_is_an_id_wherever_the_opcode_addresses_a_node() {
    use Opcode::*;
    for op in all_opcodes() {
        let body = [0u8; 64];
        let ids = request_ids(&request(op, NODE, &body));
        let addresses_node = !matches!(op, Init | Destroy | Interrupt | BatchForget);
        assert_eq!(
            ids.first() == Some(&Seen::Node(NODE)),
            addresses_node,
            "{op:?}: {ids:?}"
        );
        let none = request_ids(&request(op, 0, &body));
        assert!(!none.contains(&Seen::Node(0)), "{op:?}: {none:?}");
    }
    // STATFS and FORGET name their node in the header and nowhere else.
    let forget = request(Forget, NODE, ForgetIn { nlookup: 3 }.as_bytes());
    assert_eq!(request_ids(&forget), [Seen::Node(NODE)]);
    assert_eq!(request_ids(&request(Statfs, 1, &[])), [Seen::Node(1)]);
}

#[test]
fn rename_and_link_name_a_second_node() {
    let mut rename = RenameIn { newdir: 7 }.as_bytes().to_vec();
    rename.extend_from_slice(b"a\0b\0");
    assert_eq!(
        request_ids(&request(Opcode::Rename, NODE, &rename)),
        [Seen::Node(NODE), Seen::Node(7)]
    );
    let mut rename2 = Rename2In {
        newdir: 8,
        flags: 2,
        padding: 0,
    }
    .as_bytes()
    .to_vec();
    rename2.extend_from_slice(b"a\0b\0");
    assert_eq!(
        request_ids(&request(Opcode::Rename2, NODE, &rename2)),
        [Seen::Node(NODE), Seen::Node(8)]
    );
    let mut link = LinkIn { oldnodeid: 9 }.as_bytes().to_vec();
    link.extend_from_slice(b"new\0");
    assert_eq!(
        request_ids(&request(Opcode::Link, NODE, &link)),
        [Seen::Node(NODE), Seen::Node(9)]
    );
}

#[test]
fn every_request_on_an_open_file_names_its_handle() {
    use Opcode::*;
    let read = ReadIn {
        fh: FH,
        size: 4096,
        ..Default::default()
    };
    let mut write = WriteIn {
        fh: FH,
        size: 3,
        ..Default::default()
    }
    .as_bytes()
    .to_vec();
    write.extend_from_slice(b"abc");
    let release = ReleaseIn {
        fh: FH,
        flags: 2,
        ..Default::default()
    };
    let fsync = FsyncIn {
        fh: FH,
        ..Default::default()
    };
    let lock = LkIn {
        fh: FH,
        owner: 5,
        lk: FileLock {
            start: 1,
            end: 2,
            ..Default::default()
        },
        ..Default::default()
    };
    let flush = FlushIn {
        fh: FH,
        lock_owner: 5,
        ..Default::default()
    };
    let lseek = LseekIn {
        fh: FH,
        offset: 9,
        ..Default::default()
    };
    let fallocate = FallocateIn {
        fh: FH,
        length: 9,
        ..Default::default()
    };
    let poll = PollIn {
        fh: FH,
        kh: 77,
        ..Default::default()
    };
    let ioctl = IoctlIn {
        fh: FH,
        cmd: 5,
        ..Default::default()
    };
    let cases: [(Opcode, &[u8], bool); 16] = [
        (Read, read.as_bytes(), false),
        (Readdir, read.as_bytes(), true),
        (Readdirplus, read.as_bytes(), true),
        (Write, &write, false),
        (Release, release.as_bytes(), false),
        (Releasedir, release.as_bytes(), true),
        (Fsync, fsync.as_bytes(), false),
        (Fsyncdir, fsync.as_bytes(), true),
        (Getlk, lock.as_bytes(), false),
        (Setlk, lock.as_bytes(), false),
        (Setlkw, lock.as_bytes(), false),
        (Flush, flush.as_bytes(), false),
        (Lseek, lseek.as_bytes(), false),
        (Fallocate, fallocate.as_bytes(), false),
        (Poll, poll.as_bytes(), false),
        (Ioctl, ioctl.as_bytes(), false),
    ];
    for (op, body, is_dir) in cases {
        let handle = if is_dir {
            dir(FH, NODE)
        } else {
            file(FH, NODE)
        };
        assert_eq!(
            request_ids(&request(op, NODE, body)),
            [Seen::Node(NODE), handle],
            "{op:?}"
        );
    }
    let dir_ioctl = IoctlIn {
        fh: FH,
        flags: abi::IOCTL_DIR,
        ..Default::default()
    };
    assert_eq!(
        request_ids(&request(Ioctl, NODE, dir_ioctl.as_bytes())),
        [Seen::Node(NODE), dir(FH, NODE)]
    );
}

#[test]
fn attribute_requests_name_a_handle_only_when_their_flag_says_so() {
    use Opcode::*;
    for with_fh in [false, true] {
        let want: &[Seen] = if with_fh {
            &[Seen::Node(NODE), file(FH, NODE)]
        } else {
            &[Seen::Node(NODE)]
        };
        let getattr = GetattrIn {
            getattr_flags: if with_fh { abi::GETATTR_FH } else { 0 },
            dummy: 0,
            fh: FH,
        };
        assert_eq!(
            request_ids(&request(Getattr, NODE, getattr.as_bytes())),
            want
        );
        let statx = StatxIn {
            getattr_flags: if with_fh { abi::GETATTR_FH } else { 0 },
            fh: FH,
            sx_mask: 0x7ff,
            ..Default::default()
        };
        assert_eq!(request_ids(&request(Statx, NODE, statx.as_bytes())), want);
        let size_only = 1 << 3;
        let setattr = SetattrIn {
            valid: size_only | if with_fh { abi::FATTR_FH } else { 0 },
            fh: FH,
            size: 10,
            ..Default::default()
        };
        assert_eq!(
            request_ids(&request(Setattr, NODE, setattr.as_bytes())),
            want
        );
    }
    // Protocol 7.8 and older send GETATTR without a body.
    assert_eq!(
        request_ids(&request(Getattr, NODE, &[])),
        [Seen::Node(NODE)]
    );
}

#[test]
fn copy_file_range_names_both_files() {
    let copy = CopyFileRangeIn {
        fh_in: FH,
        off_in: 1,
        nodeid_out: 0x22,
        fh_out: 0xf2,
        off_out: 3,
        len: 4,
        flags: 0,
    };
    for op in [Opcode::CopyFileRange, Opcode::CopyFileRange64] {
        let msg = request(op, NODE, copy.as_bytes());
        assert_eq!(
            request_ids(&msg),
            [
                Seen::Node(NODE),
                file(FH, NODE),
                Seen::Node(0x22),
                file(0xf2, 0x22)
            ],
            "{op:?}"
        );
        assert_eq!(
            Request::parse(&msg).unwrap().id_fields().as_slice().len(),
            MAX_REQUEST_IDS
        );
    }
}

#[test]
fn a_field_cut_short_is_left_out() {
    let copy = CopyFileRangeIn {
        fh_in: FH,
        nodeid_out: 0x22,
        fh_out: 0xf2,
        ..Default::default()
    };
    // Up to, not including, the last byte of fh_out.
    let cut = offset_of!(CopyFileRangeIn, fh_out) + 7;
    let msg = request(Opcode::CopyFileRange, NODE, &copy.as_bytes()[..cut]);
    assert_eq!(
        request_ids(&msg),
        [Seen::Node(NODE), file(FH, NODE), Seen::Node(0x22)]
    );
    let read = ReadIn {
        fh: FH,
        ..Default::default()
    };
    let msg = request(Opcode::Read, NODE, &read.as_bytes()[..7]);
    assert_eq!(request_ids(&msg), [Seen::Node(NODE)]);
    let msg = request(Opcode::Link, NODE, &[9, 0, 0]);
    assert_eq!(request_ids(&msg), [Seen::Node(NODE)]);
}

#[test]
fn unknown_opcodes_have_no_known_ids() {
    let mut msg = request(Opcode::Getattr, NODE, &[0; 16]);
    msg[offset_of!(InHeader, opcode)] = 200;
    assert!(Request::parse(&msg)
        .unwrap()
        .id_fields()
        .as_slice()
        .is_empty());
}

#[test]
fn batch_forget_entries_read_back_and_stop_at_count_or_end() {
    let entries = [(NODE, 1u64), (0x22, 2), (0x33, 3)];
    let mut body = BatchForgetIn {
        count: entries.len() as u32,
        dummy: 0,
    }
    .as_bytes()
    .to_vec();
    for (nodeid, nlookup) in entries {
        body.extend_from_slice(ForgetOne { nodeid, nlookup }.as_bytes());
    }
    // The kernel sends BATCH_FORGET with header nodeid 0.
    let msg = request(Opcode::BatchForget, 0, &body);
    assert!(request_ids(&msg).is_empty());
    let found: Vec<_> = batch_forget_entries(&msg).collect();
    assert_eq!(found.len(), entries.len());
    for (entry, (nodeid, nlookup)) in found.iter().zip(entries) {
        assert_eq!((entry.node, entry.nlookup), (nodeid, nlookup));
        assert_eq!(read_u64(&msg, entry.at), Some(nodeid));
        assert_eq!(read_u64(&msg, entry.at + 8), Some(nlookup));
    }

    let mut fewer = msg.clone();
    write_u64(&mut fewer, IN, 2); // count (and dummy) = 2
    assert_eq!(batch_forget_entries(&fewer).count(), 2);
    let mut more = msg.clone();
    write_u64(&mut more, IN, 1000);
    assert_eq!(batch_forget_entries(&more).count(), 3);
    let cut = &msg[..msg.len() - 1];
    assert_eq!(batch_forget_entries(cut).count(), 2);
    let not_batch = request(Opcode::Forget, NODE, &body);
    assert_eq!(batch_forget_entries(&not_batch).count(), 0);
}

fn entry(nodeid: u64) -> EntryOut {
    let mut entry = EntryOut {
        nodeid,
        generation: 1,
        ..Default::default()
    };
    entry.attr.ino = nodeid;
    entry.attr.mode = 0o100644;
    entry
}

#[test]
fn entry_replies_name_their_node_unless_negative() {
    for op in [
        Opcode::Lookup,
        Opcode::Mknod,
        Opcode::Mkdir,
        Opcode::Symlink,
        Opcode::Link,
    ] {
        let msg = reply(0, entry(0x55).as_bytes());
        assert_eq!(reply_ids(op, 31, &msg), [Seen::Node(0x55)], "{op:?}");
    }
    let negative = reply(0, entry(0).as_bytes());
    assert!(reply_ids(Opcode::Lookup, 31, &negative).is_empty());
    let failed = reply(-2, &[]);
    assert!(reply_ids(Opcode::Lookup, 31, &failed).is_empty());
    let attr = reply(0, &[0x55; size::ATTR_OUT]);
    assert!(reply_ids(Opcode::Getattr, 31, &attr).is_empty());
}

#[test]
fn create_replies_name_the_node_and_the_handle_opened_on_it() {
    let open = OpenOut {
        fh: FH,
        ..Default::default()
    };
    for (minor, entry_len) in [(31, size::ENTRY_OUT), (8, size::ENTRY_OUT_COMPAT)] {
        let mut body = entry(0x55).as_bytes()[..entry_len].to_vec();
        body.extend_from_slice(open.as_bytes());
        let msg = reply(0, &body);
        for op in [Opcode::Create, Opcode::Tmpfile] {
            assert_eq!(
                reply_ids(op, minor, &msg),
                [Seen::Node(0x55), file(FH, 0x55)],
                "{op:?} at 7.{minor}"
            );
        }
    }
}

#[test]
fn open_replies_name_a_handle_on_the_requests_node() {
    let msg = reply(
        0,
        OpenOut {
            fh: FH,
            ..Default::default()
        }
        .as_bytes(),
    );
    for (op, is_dir) in [(Opcode::Open, false), (Opcode::Opendir, true)] {
        let want = Seen::Handle {
            fh: FH,
            node: None,
            dir: is_dir,
        };
        assert_eq!(reply_ids(op, 31, &msg), [want]);
    }
}

/// One `fuse_direntplus`, padded to 8 bytes if `pad`.
fn direntplus(nodeid: u64, name: &[u8], pad: bool) -> Vec<u8> {
    let mut record = entry(nodeid).as_bytes().to_vec();
    let dirent = Dirent {
        ino: nodeid,
        off: 1,
        namelen: name.len() as u32,
        r#type: 8,
    };
    record.extend_from_slice(dirent.as_bytes());
    record.extend_from_slice(name);
    if pad {
        record.resize(abi::dirent_align(record.len()).unwrap(), 0);
    }
    record
}

#[test]
fn readdirplus_names_the_nodes_the_kernel_links() {
    let mut body = Vec::new();
    for (node, name) in [
        (0x51u64, &b"a"[..]),
        (0, b"negative"),
        (0x52, b"."),
        (0x53, b".."),
        (0x54, b"twenty-four-bytes-name.."),
    ] {
        body.extend_from_slice(&direntplus(node, name, true));
    }
    // The kernel ignores a last record that lacks its padding.
    body.extend_from_slice(&direntplus(0x55, b"tail", false));
    let msg = reply(0, &body);
    assert_eq!(
        reply_ids(Opcode::Readdirplus, 31, &msg),
        [Seen::Node(0x51), Seen::Node(0x54)]
    );

    // It stops at a record with an empty name or a '/' in it.
    for bad in [&b""[..], b"a/b"] {
        let mut body = direntplus(0x51, b"a", true);
        body.extend_from_slice(&direntplus(0x56, bad, true));
        body.extend_from_slice(&direntplus(0x57, b"after", true));
        let msg = reply(0, &body);
        assert_eq!(reply_ids(Opcode::Readdirplus, 31, &msg), [Seen::Node(0x51)]);
    }
}

#[test]
fn notifications_name_their_nodes() {
    let inval_inode = NotifyInvalInodeOut {
        ino: 0x61,
        off: 0,
        len: -1,
    };
    assert_eq!(
        notification_ids(NotifyCode::InvalInode, inval_inode.as_bytes()),
        [Seen::Node(0x61)]
    );
    let mut inval_entry = NotifyInvalEntryOut {
        parent: 0x62,
        namelen: 1,
        flags: 0,
    }
    .as_bytes()
    .to_vec();
    inval_entry.extend_from_slice(b"x\0");
    assert_eq!(
        notification_ids(NotifyCode::InvalEntry, &inval_entry),
        [Seen::Node(0x62)]
    );
    let mut delete = NotifyDeleteOut {
        parent: 0x63,
        child: 0x64,
        namelen: 1,
        padding: 0,
    }
    .as_bytes()
    .to_vec();
    delete.extend_from_slice(b"x\0");
    assert_eq!(
        notification_ids(NotifyCode::Delete, &delete),
        [Seen::Node(0x63), Seen::Node(0x64)]
    );
    let mut store = NotifyStoreOut {
        nodeid: 0x65,
        offset: 0,
        size: 3,
        padding: 0,
    }
    .as_bytes()
    .to_vec();
    store.extend_from_slice(b"abc");
    assert_eq!(
        notification_ids(NotifyCode::Store, &store),
        [Seen::Node(0x65)]
    );
    let retrieve = NotifyRetrieveOut {
        notify_unique: 0x99,
        nodeid: 0x66,
        offset: 0,
        size: 10,
        padding: 0,
    };
    assert_eq!(
        notification_ids(NotifyCode::Retrieve, retrieve.as_bytes()),
        [Seen::Node(0x66)]
    );
    for code in [NotifyCode::Poll, NotifyCode::Resend, NotifyCode::IncEpoch] {
        assert!(notification_ids(code, &[0x77; 8]).is_empty(), "{code:?}");
    }
    // A child cut short is left out, the parent before it is not.
    assert_eq!(
        notification_ids(NotifyCode::Delete, &delete[..15]),
        [Seen::Node(0x63)]
    );
}

#[test]
fn u64_fields_are_read_and_written_only_whole() {
    let mut msg = [0u8; 16];
    assert!(write_u64(&mut msg, 8, 0x0102_0304_0506_0708));
    assert_eq!(read_u64(&msg, 8), Some(0x0102_0304_0506_0708));
    assert!(!write_u64(&mut msg, 9, 1));
    assert!(!write_u64(&mut msg, usize::MAX, 1));
    assert_eq!(read_u64(&msg, 9), None);
    assert_eq!(read_u64(&msg, usize::MAX), None);
    assert_eq!(msg[..8], [0; 8], "a refused write changes nothing");
}

#[test]
fn own_requests_parse_back_as_the_kernels_would() {
    let check = |msg: &[u8], opcode: Opcode, unique: u64| {
        let req = Request::parse(msg).unwrap();
        assert_eq!(req.opcode, Some(opcode));
        assert_eq!(req.header.unique, unique);
        let pid = std::process::id();
        assert_eq!(
            (req.header.uid, req.header.gid, req.header.pid),
            (0, 0, pid)
        );
        seen(msg, req.id_fields())
    };

    let msg = lookup_request(10, NODE, b"name");
    assert_eq!(check(&msg, Opcode::Lookup, 10), [Seen::Node(NODE)]);
    let req = Request::parse(&msg).unwrap();
    assert_eq!(
        req.change(),
        Change::Entry {
            parent: NODE,
            name: b"name"
        }
    );

    let msg = unlink_request(11, NODE, b"name");
    assert_eq!(check(&msg, Opcode::Unlink, 11), [Seen::Node(NODE)]);
    assert_eq!(
        Request::parse(&msg).unwrap().change(),
        Change::Remove {
            parent: NODE,
            name: b"name"
        }
    );

    for (is_dir, opcode, release_op) in [
        (false, Opcode::Open, Opcode::Release),
        (true, Opcode::Opendir, Opcode::Releasedir),
    ] {
        let msg = open_request(12, NODE, 2, is_dir);
        assert_eq!(check(&msg, opcode, 12), [Seen::Node(NODE)]);
        assert_eq!(
            Request::parse(&msg).unwrap().change(),
            Change::Open {
                node: NODE,
                flags: 2,
                dir: is_dir
            }
        );

        let msg = release_request(14, NODE, FH, 2, is_dir);
        let handle = if is_dir {
            dir(FH, NODE)
        } else {
            file(FH, NODE)
        };
        assert_eq!(check(&msg, release_op, 14), [Seen::Node(NODE), handle]);
        assert_eq!(
            Request::parse(&msg).unwrap().change(),
            Change::Release {
                node: NODE,
                fh: FH,
                dir: is_dir
            }
        );
    }

    let msg = getattr_request(16, NODE);
    assert_eq!(check(&msg, Opcode::Getattr, 16), [Seen::Node(NODE)]);
    assert_eq!(msg.len(), IN + size_of::<GetattrIn>());

    let msg = forget_request(18, NODE, 5);
    assert_eq!(check(&msg, Opcode::Forget, 18), [Seen::Node(NODE)]);
    assert_eq!(
        Request::parse(&msg).unwrap().change(),
        Change::Forget {
            node: NODE,
            count: 5
        }
    );
}
