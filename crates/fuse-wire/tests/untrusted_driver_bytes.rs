//! Property tests: no bytes a driver can send make rebound's parser panic, nothing that
//! passes validation contradicts its own header, and every id field found lies inside its
//! message. Runs in the default test suite.

use fuse_wire::abi::{size, EntryOut, OutHeader};
use fuse_wire::ids::{self, IdField, NODE_IN_REQUEST};
use fuse_wire::{fix_init_reply, DriverMessage, NotifyCode, Opcode, ReplyShape, Request};
use proptest::prelude::*;
use zerocopy::IntoBytes;

fn any_shape() -> impl Strategy<Value = ReplyShape> {
    prop_oneof![
        Just(ReplyShape::NoReply),
        Just(ReplyShape::ErrorOnly),
        Just(ReplyShape::Empty),
        any::<bool>().prop_map(|negative_ok| ReplyShape::Entry { negative_ok }),
        Just(ReplyShape::Create),
        Just(ReplyShape::Attr),
        Just(ReplyShape::Open),
        any::<u32>().prop_map(|max| ReplyShape::Write { max }),
        any::<u32>().prop_map(ReplyShape::UpTo),
        (0usize..512).prop_map(ReplyShape::Exact),
        Just(ReplyShape::Statfs),
        Just(ReplyShape::Init),
        any::<u32>().prop_map(|out_size| ReplyShape::Ioctl { out_size }),
        Just(ReplyShape::Any),
    ]
}

/// A message whose header length is right but whose other fields and body are arbitrary:
/// this reaches the per-opcode checks, which random bytes alone rarely do.
fn framed_message() -> impl Strategy<Value = Vec<u8>> {
    (
        any::<i32>(),
        any::<u64>(),
        proptest::collection::vec(any::<u8>(), 0..400),
    )
        .prop_map(|(error, unique, body)| {
            let header = OutHeader {
                len: (size::OUT_HEADER + body.len()) as u32,
                error,
                unique,
            };
            let mut msg = header.as_bytes().to_vec();
            msg.extend_from_slice(&body);
            msg
        })
}

fn exercise(bytes: &[u8], shape: ReplyShape, minor: u32) {
    if let Ok(msg) = DriverMessage::parse(bytes) {
        assert_eq!(msg.header.len as usize, bytes.len());
        let _ = msg.validate_notification();
        if msg.validate_reply(shape, minor).is_ok() && msg.header.error != 0 {
            assert!(msg.body.is_empty(), "an error reply carries no body");
        }
    }
    let mut copy = bytes.to_vec();
    if fix_init_reply(&mut copy, 1 << 20).is_ok() {
        assert_eq!(copy.len(), bytes.len(), "INIT rewrite keeps the length");
    }
    if let Ok(r) = Request::parse(bytes) {
        let _ = r.reply_shape();
        if let fuse_wire::Change::BatchForget { entries } = r.change() {
            let _ = fuse_wire::change::forget_entries(entries).count();
        }
    }
    let _ = fuse_wire::change::direntplus_entries(bytes).count();
    let _ = fuse_wire::change::open_handle(bytes, true);
    exercise_ids(bytes, minor);
}

/// An id field holds a whole 8 bytes inside `msg`, and a node field is never node 0.
fn check_field(msg: &[u8], field: IdField) {
    let inside = |at: usize| at.checked_add(8).is_some_and(|end| end <= msg.len());
    assert!(inside(field.at()), "{field:?} in {} bytes", msg.len());
    match field {
        IdField::Node { at } => assert_ne!(ids::read_u64(msg, at), Some(0), "{field:?}"),
        IdField::Handle { node_at, .. } => {
            assert!(node_at == NODE_IN_REQUEST || inside(node_at), "{field:?}")
        }
    }
}

/// Looks for ids in `bytes` as every kind of message rebound translates.
fn exercise_ids(bytes: &[u8], minor: u32) {
    if let Ok(request) = Request::parse(bytes) {
        for field in request.id_fields() {
            check_field(bytes, field);
        }
    }
    for entry in ids::batch_forget_entries(bytes) {
        assert_eq!(ids::read_u64(bytes, entry.at), Some(entry.node));
        assert_eq!(ids::read_u64(bytes, entry.at + 8), Some(entry.nlookup));
    }
    for opcode in (0..64).filter_map(Opcode::from_raw) {
        ids::for_each_reply_id(opcode, minor, bytes, |field| check_field(bytes, field));
    }
    for code in (0..16).filter_map(NotifyCode::from_raw) {
        ids::for_each_notification_id(code, bytes, |field| check_field(bytes, field));
    }
}

/// A READDIRPLUS body of plausible records (names from a few telling bytes, some records left
/// unpadded), cut at an arbitrary point: random bytes almost never frame a record.
fn direntplus_body() -> impl Strategy<Value = Vec<u8>> {
    let byte = prop_oneof![8 => Just(b'a'), 1 => Just(b'.'), 1 => Just(b'/')];
    let name = proptest::collection::vec(byte, 0..12);
    let node = prop_oneof![Just(0u64), 1u64..4, any::<u64>()];
    let record = (node, name, proptest::bool::weighted(0.8));
    let records = proptest::collection::vec(record, 0..6);
    (records, proptest::option::of(any::<usize>())).prop_map(|(records, cut)| {
        let mut body = Vec::new();
        for (nodeid, name, pad) in records {
            body.extend_from_slice(
                EntryOut {
                    nodeid,
                    ..Default::default()
                }
                .as_bytes(),
            );
            body.extend_from_slice(&nodeid.to_ne_bytes()); // ino
            body.extend_from_slice(&0u64.to_ne_bytes()); // off
            body.extend_from_slice(&(name.len() as u32).to_ne_bytes());
            body.extend_from_slice(&0u32.to_ne_bytes()); // type
            body.extend_from_slice(&name);
            if pad {
                body.resize(body.len().div_ceil(8) * 8, 0);
            }
        }
        if let Some(cut) = cut {
            body.truncate(cut % (body.len() + 1));
        }
        body
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600),
                                shape in any_shape(), minor in 0u32..50) {
        exercise(&bytes, shape, minor);
    }

    #[test]
    fn framed_requests_never_panic(opcode in 0u32..60, nodeid in any::<u64>(),
                                   body in proptest::collection::vec(any::<u8>(), 0..400)) {
        let header = fuse_wire::InHeader {
            len: (size::IN_HEADER + body.len()) as u32,
            opcode,
            nodeid,
            ..Default::default()
        };
        let mut msg = header.as_bytes().to_vec();
        msg.extend_from_slice(&body);
        exercise(&msg, ReplyShape::Any, 31);
    }

    #[test]
    fn successful_replies_have_ids_only_inside(body in proptest::collection::vec(any::<u8>(), 0..400),
                                               minor in 0u32..50) {
        exercise_ids(&reply(0, &body), minor);
    }

    #[test]
    fn readdirplus_ids_lie_inside_whole_records(body in direntplus_body()) {
        let msg = reply(0, &body);
        let mut found = 0;
        ids::for_each_reply_id(Opcode::Readdirplus, 31, &msg, |field| {
            check_field(&msg, field);
            found += 1;
        });
        assert_eq!(found, fuse_wire::change::direntplus_entries(&body).count());
    }

    #[test]
    fn framed_messages_never_panic(bytes in framed_message(), shape in any_shape(),
                                   minor in 0u32..50) {
        exercise(&bytes, shape, minor);
    }
}

#[test]
fn an_oversized_read_reply_is_refused() {
    let header = OutHeader {
        len: (size::OUT_HEADER + 10) as u32,
        error: 0,
        unique: 9,
    };
    let mut msg = header.as_bytes().to_vec();
    msg.extend_from_slice(&[0u8; 10]);
    let parsed = DriverMessage::parse(&msg).unwrap();
    assert!(parsed.validate_reply(ReplyShape::UpTo(10), 31).is_ok());
    assert!(parsed.validate_reply(ReplyShape::UpTo(9), 31).is_err());
    assert!(parsed.validate_reply(ReplyShape::Empty, 31).is_err());
}

#[test]
fn error_values_outside_the_kernels_range_are_refused() {
    for (error, ok) in [
        (0, true),
        (-2, true),
        (-511, true),
        (-512, false),
        (1, false),
    ] {
        let header = OutHeader {
            len: size::OUT_HEADER as u32,
            error,
            unique: 9,
        };
        let msg = header.as_bytes().to_vec();
        let parsed = DriverMessage::parse(&msg).unwrap();
        assert_eq!(
            parsed.validate_reply(ReplyShape::Empty, 31).is_ok(),
            ok,
            "error {error}"
        );
    }
}

fn reply(error: i32, body: &[u8]) -> Vec<u8> {
    let header = OutHeader {
        len: (size::OUT_HEADER + body.len()) as u32,
        error,
        unique: 5,
    };
    let mut msg = header.as_bytes().to_vec();
    msg.extend_from_slice(body);
    msg
}

#[test]
fn entries_must_name_a_node_with_a_real_file_type() {
    use fuse_wire::abi::EntryOut;
    let mut entry = EntryOut {
        nodeid: 0,
        ..Default::default()
    };
    entry.attr.mode = 0o040755;
    let negative = reply(0, entry.as_bytes());
    let msg = DriverMessage::parse(&negative).unwrap();
    assert!(msg
        .validate_reply(ReplyShape::Entry { negative_ok: true }, 31)
        .is_ok());
    assert!(msg
        .validate_reply(ReplyShape::Entry { negative_ok: false }, 31)
        .is_err());

    entry.nodeid = 77;
    entry.attr.mode = 0o755; // no file type bits
    let typeless = reply(0, entry.as_bytes());
    let msg = DriverMessage::parse(&typeless).unwrap();
    assert!(msg
        .validate_reply(ReplyShape::Entry { negative_ok: true }, 31)
        .is_err());

    // Protocol 7.8 and older use the 120-byte entry.
    entry.attr.mode = 0o100644;
    let legacy = reply(0, &entry.as_bytes()[..size::ENTRY_OUT_COMPAT]);
    let msg = DriverMessage::parse(&legacy).unwrap();
    assert!(msg
        .validate_reply(ReplyShape::Entry { negative_ok: false }, 8)
        .is_ok());
    assert!(msg
        .validate_reply(ReplyShape::Entry { negative_ok: false }, 31)
        .is_err());
}

#[test]
fn init_reply_loses_masked_capabilities_and_oversized_writes() {
    use fuse_wire::abi::{InitOut, FLAGS2_OVER_IO_URING, FLAGS2_PASSTHROUGH};
    let init = InitOut {
        major: 7,
        minor: 44,
        max_write: 16 << 20,
        max_pages: 4096,
        flags2: FLAGS2_PASSTHROUGH | FLAGS2_OVER_IO_URING | 1,
        ..Default::default()
    };
    let mut msg = reply(0, init.as_bytes());
    let agreed = fix_init_reply(&mut msg, 1 << 20).unwrap();
    assert_eq!(agreed.minor, 44);
    assert_eq!(agreed.max_write, 1 << 20);
    let sent = <InitOut as zerocopy::FromBytes>::read_from_bytes(&msg[size::OUT_HEADER..]).unwrap();
    assert_eq!(sent.flags2, 1);
    assert_eq!(sent.max_pages, 256);
    assert_eq!(sent.max_write, 1 << 20);

    // A libfuse 2 driver answers with the 24-byte layout; it stays 24 bytes.
    let mut old = reply(0, &init.as_bytes()[..24]);
    assert!(fix_init_reply(&mut old, 1 << 20).is_ok());
    assert_eq!(old.len(), size::OUT_HEADER + 24);
    let mut wrong_major = reply(0, InitOut { major: 8, ..init }.as_bytes());
    assert!(fix_init_reply(&mut wrong_major, 1 << 20).is_err());
}
