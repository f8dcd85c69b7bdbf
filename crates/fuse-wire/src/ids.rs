//! Where the node ids and file handles are in a message, so that rebound can translate them
//! between the kernel's numbering and the numbering of a driver restarted since the kernel
//! learned them: kernel to driver in requests, driver to kernel in replies and notifications.
//!
//! Owns: the offsets of id fields in requests, replies and notifications; reading and writing
//! such a field; the few requests rebound sends a driver on its own while it recovers.
//! Must not: keep or translate ids (the tracker owns the maps), panic on any input, or allocate
//! outside the request builders (which run only during recovery, not per message). Every offset
//! it reports is that of a whole 8-byte field inside the message it was given, and a node field
//! is reported only when it holds a node id (never 0, which names no node).

use crate::abi::{
    self, size, BatchForgetIn, CopyFileRangeIn, Dirent, EntryOut, FallocateIn, FlushIn, ForgetIn,
    ForgetOne, FsyncIn, GetattrIn, InHeader, IoctlIn, LinkIn, LkIn, LseekIn, NotifyCode,
    NotifyDeleteOut, NotifyInvalEntryOut, NotifyInvalInodeOut, NotifyRetrieveOut, NotifyStoreOut,
    Opcode, OpenIn, OpenOut, OutHeader, PollIn, ReadIn, ReleaseIn, Rename2In, RenameIn, SetattrIn,
    StatxIn, WriteIn,
};
use crate::reply::entry_size;
use crate::request::Request;
use core::mem::{offset_of, size_of};
use zerocopy::{FromBytes, IntoBytes};

/// A field holding an id, by its byte offset in the whole message (header included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdField {
    /// A node id.
    Node { at: usize },
    /// A file handle, opened on the node whose id is at `node_at` in the same message, from
    /// OPENDIR if `dir`. In a request that node is the kernel's; in a CREATE or TMPFILE reply
    /// it is the entry's node, as numbered before or after that field is translated. An
    /// OPEN/OPENDIR reply names no node: `node_at` is [`NODE_IN_REQUEST`].
    Handle {
        at: usize,
        node_at: usize,
        dir: bool,
    },
}

impl IdField {
    /// Offset of the id itself.
    pub fn at(&self) -> usize {
        match *self {
            IdField::Node { at } | IdField::Handle { at, .. } => at,
        }
    }
}

/// `node_at` of the handle in an OPEN/OPENDIR reply: the node is the header `nodeid` of the
/// request it answers, which the caller holds. (Offset 0 of a message is its length, never an
/// id, so this value cannot be mistaken for a real field.)
pub const NODE_IN_REQUEST: usize = 0;

/// Offset of `nodeid` in `fuse_in_header`.
const HEADER_NODEID: usize = offset_of!(InHeader, nodeid);
const IN: usize = size::IN_HEADER;
const OUT: usize = size::OUT_HEADER;

/// Most id fields one request carries: COPY_FILE_RANGE's node, `fh_in`, `nodeid_out`, `fh_out`.
pub const MAX_REQUEST_IDS: usize = 4;

/// The id fields of one request, in message order; a fixed array, so building it allocates
/// nothing.
#[derive(Clone, Copy)]
pub struct IdFields {
    fields: [IdField; MAX_REQUEST_IDS],
    len: usize,
}

impl IdFields {
    fn new() -> Self {
        IdFields {
            fields: [IdField::Node { at: 0 }; MAX_REQUEST_IDS],
            len: 0,
        }
    }

    fn push(&mut self, field: Option<IdField>) {
        // `MAX_REQUEST_IDS` covers every opcode, so the slot always exists.
        if let (Some(field), Some(slot)) = (field, self.fields.get_mut(self.len)) {
            *slot = field;
            self.len += 1;
        }
    }

    pub fn as_slice(&self) -> &[IdField] {
        self.fields.get(..self.len).unwrap_or_default()
    }
}

impl core::fmt::Debug for IdFields {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

impl IntoIterator for IdFields {
    type Item = IdField;
    type IntoIter = core::iter::Take<core::array::IntoIter<IdField, MAX_REQUEST_IDS>>;

    fn into_iter(self) -> Self::IntoIter {
        self.fields.into_iter().take(self.len)
    }
}

impl<'a> IntoIterator for &'a IdFields {
    type Item = IdField;
    type IntoIter = core::iter::Copied<core::slice::Iter<'a, IdField>>;

    fn into_iter(self) -> Self::IntoIter {
        self.as_slice().iter().copied()
    }
}

impl Request<'_> {
    /// The id fields of this request from the kernel. The header `nodeid` is one for every
    /// opcode that addresses a node: all but INIT, DESTROY, INTERRUPT and BATCH_FORGET (whose
    /// entries [`batch_forget_entries`] gives). NOTIFY_REPLY's is the node of the driver's
    /// RETRIEVE notification. Not covered: unknown opcodes (nothing is known of their layout),
    /// and the `fh` of SETUPMAPPING, which only virtio-fs sends, never `/dev/fuse`.
    pub fn id_fields(&self) -> IdFields {
        use Opcode::*;
        let mut fields = IdFields::new();
        let Some(op) = self.opcode else {
            return fields;
        };
        let body = self.body;
        // Offsets below are in the body; what is reported is in the whole message.
        let node = |off: usize| {
            read_u64(body, off)
                .filter(|&id| id != 0)
                .map(|_| IdField::Node { at: IN + off })
        };
        let handle = |off: usize, node_at: usize, dir: bool| {
            read_u64(body, off).map(|_| IdField::Handle {
                at: IN + off,
                node_at,
                dir,
            })
        };
        let file = |off: usize| handle(off, HEADER_NODEID, false);
        let flag = |off: usize, bit: u32| read_u32(body, off).is_some_and(|v| v & bit != 0);

        if !matches!(op, Init | Destroy | Interrupt | BatchForget) && self.header.nodeid != 0 {
            fields.push(Some(IdField::Node { at: HEADER_NODEID }));
        }
        match op {
            Rename => fields.push(node(offset_of!(RenameIn, newdir))),
            Rename2 => fields.push(node(offset_of!(Rename2In, newdir))),
            Link => fields.push(node(offset_of!(LinkIn, oldnodeid))),
            Getattr if flag(offset_of!(GetattrIn, getattr_flags), abi::GETATTR_FH) => {
                fields.push(file(offset_of!(GetattrIn, fh)))
            }
            Statx if flag(offset_of!(StatxIn, getattr_flags), abi::GETATTR_FH) => {
                fields.push(file(offset_of!(StatxIn, fh)))
            }
            Setattr if flag(offset_of!(SetattrIn, valid), abi::FATTR_FH) => {
                fields.push(file(offset_of!(SetattrIn, fh)))
            }
            Ioctl => {
                let dir = flag(offset_of!(IoctlIn, flags), abi::IOCTL_DIR);
                fields.push(handle(offset_of!(IoctlIn, fh), HEADER_NODEID, dir));
            }
            CopyFileRange | CopyFileRange64 => {
                let nodeid_out = offset_of!(CopyFileRangeIn, nodeid_out);
                fields.push(file(offset_of!(CopyFileRangeIn, fh_in)));
                fields.push(node(nodeid_out));
                fields.push(handle(
                    offset_of!(CopyFileRangeIn, fh_out),
                    IN + nodeid_out,
                    false,
                ));
            }
            _ => {
                if let Some((off, dir)) = handle_in_body(op) {
                    fields.push(handle(off, HEADER_NODEID, dir));
                }
            }
        }
        fields
    }
}

/// Where the body of `op` holds the handle it always carries, and whether it is a directory's.
fn handle_in_body(op: Opcode) -> Option<(usize, bool)> {
    use Opcode::*;
    Some(match op {
        Read => (offset_of!(ReadIn, fh), false),
        Readdir | Readdirplus => (offset_of!(ReadIn, fh), true),
        Write => (offset_of!(WriteIn, fh), false),
        Release => (offset_of!(ReleaseIn, fh), false),
        Releasedir => (offset_of!(ReleaseIn, fh), true),
        Flush => (offset_of!(FlushIn, fh), false),
        Fsync => (offset_of!(FsyncIn, fh), false),
        Fsyncdir => (offset_of!(FsyncIn, fh), true),
        Getlk | Setlk | Setlkw => (offset_of!(LkIn, fh), false),
        Lseek => (offset_of!(LseekIn, fh), false),
        Fallocate => (offset_of!(FallocateIn, fh), false),
        Poll => (offset_of!(PollIn, fh), false),
        _ => return None,
    })
}

/// One `fuse_forget_one` of a BATCH_FORGET; `at` is the offset of its `nodeid` in the message
/// (its `nlookup` follows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForgetEntry {
    pub at: usize,
    pub node: u64,
    pub nlookup: u64,
}

/// The entries of a whole BATCH_FORGET message: `count` of them, or as many as the message
/// holds if fewer. Anything but a BATCH_FORGET yields none.
pub fn batch_forget_entries(msg: &[u8]) -> impl Iterator<Item = ForgetEntry> + '_ {
    const FIRST: usize = IN + size_of::<BatchForgetIn>();
    let is_batch_forget = InHeader::read_from_prefix(msg)
        .is_ok_and(|(header, _)| header.opcode == Opcode::BatchForget as u32);
    let count = if is_batch_forget {
        read_u32(msg, IN + offset_of!(BatchForgetIn, count)).unwrap_or(0)
    } else {
        0
    };
    msg.get(FIRST..)
        .unwrap_or_default()
        .chunks_exact(size_of::<ForgetOne>())
        .take(count as usize)
        .enumerate()
        .filter_map(|(i, bytes)| {
            let entry = ForgetOne::read_from_bytes(bytes).ok()?;
            Some(ForgetEntry {
                at: FIRST + i * size_of::<ForgetOne>(),
                node: entry.nodeid,
                nlookup: entry.nlookup,
            })
        })
}

/// Calls `f` with each id field of a validated, successful reply to `opcode` (`msg` is the
/// whole reply, header included; `minor` is the negotiated protocol minor, which decides the
/// size of `fuse_entry_out`). An error reply has none.
///
/// - LOOKUP, MKNOD, MKDIR, SYMLINK, LINK: the entry's node (none for a negative LOOKUP).
/// - CREATE, TMPFILE: the entry's node, then the handle opened on it.
/// - OPEN, OPENDIR: the handle, with `node_at` [`NODE_IN_REQUEST`].
/// - READDIRPLUS: the node of each entry the kernel links (not `.`, `..` or node 0), up to
///   where the kernel stops reading: a record cut short or unpadded, or whose name is empty,
///   longer than [`abi::NAME_MAX`] or holds a `/`.
pub fn for_each_reply_id(opcode: Opcode, minor: u32, msg: &[u8], mut f: impl FnMut(IdField)) {
    use Opcode::*;
    let Ok((header, body)) = OutHeader::read_from_prefix(msg) else {
        return;
    };
    if header.error != 0 {
        return;
    }
    let node = |off: usize| {
        read_u64(body, off)
            .filter(|&id| id != 0)
            .map(|_| IdField::Node { at: OUT + off })
    };
    let handle = |off: usize, node_at: usize, dir: bool| {
        read_u64(body, off).map(|_| IdField::Handle {
            at: OUT + off,
            node_at,
            dir,
        })
    };
    let mut emit = |field: Option<IdField>| field.into_iter().for_each(&mut f);
    let entry_node = offset_of!(EntryOut, nodeid);
    match opcode {
        Lookup | Mknod | Mkdir | Symlink | Link => emit(node(entry_node)),
        Create | Tmpfile => {
            // A CREATE with no node is invalid; its handle would belong to nothing.
            if let Some(entry) = node(entry_node) {
                emit(Some(entry));
                let fh = entry_size(minor) + offset_of!(OpenOut, fh);
                emit(handle(fh, OUT + entry_node, false));
            }
        }
        Open | Opendir => emit(handle(
            offset_of!(OpenOut, fh),
            NODE_IN_REQUEST,
            opcode == Opendir,
        )),
        Readdirplus => {
            for (off, _, _) in direntplus_links(body) {
                emit(Some(IdField::Node {
                    at: OUT + off + entry_node,
                }));
            }
        }
        _ => {}
    }
}

/// Calls `f` with each node field of a notification with `code` (`msg` is the whole message,
/// header included): INVAL_INODE's `ino`, INVAL_ENTRY's `parent`, DELETE's `parent` and
/// `child`, STORE's and RETRIEVE's `nodeid`. POLL's `kh` is the kernel's own handle, not an id
/// to translate; the others carry none.
pub fn for_each_notification_id(code: NotifyCode, msg: &[u8], mut f: impl FnMut(IdField)) {
    let body = msg.get(OUT..).unwrap_or_default();
    let mut node = |off: usize| {
        if read_u64(body, off).is_some_and(|id| id != 0) {
            f(IdField::Node { at: OUT + off });
        }
    };
    match code {
        NotifyCode::InvalInode => node(offset_of!(NotifyInvalInodeOut, ino)),
        NotifyCode::InvalEntry => node(offset_of!(NotifyInvalEntryOut, parent)),
        NotifyCode::Delete => {
            node(offset_of!(NotifyDeleteOut, parent));
            node(offset_of!(NotifyDeleteOut, child));
        }
        NotifyCode::Store => node(offset_of!(NotifyStoreOut, nodeid)),
        NotifyCode::Retrieve => node(offset_of!(NotifyRetrieveOut, nodeid)),
        NotifyCode::Poll | NotifyCode::Resend | NotifyCode::IncEpoch => {}
    }
}

/// The records of a READDIRPLUS reply body that give the kernel a lookup on their node, as
/// `(offset of the record in body, node, name)`. Read as the kernel's `parse_dirplus` reads
/// them: it stops at a record that does not fit whole (padding to 8 bytes included), or whose
/// name is empty, longer than [`abi::NAME_MAX`] or holds a `/`; and `fuse_direntplus_link`
/// ignores node 0, `.` and `..`.
pub(crate) fn direntplus_links(body: &[u8]) -> impl Iterator<Item = (usize, u64, &[u8])> + '_ {
    const NAMELEN_AT: usize = size::ENTRY_OUT + offset_of!(Dirent, namelen);
    const NAME_AT: usize = size::ENTRY_OUT + size_of::<Dirent>();
    let mut at = 0;
    let records = core::iter::from_fn(move || {
        let rest = body.get(at..)?;
        let namelen = read_u32(rest, NAMELEN_AT)? as usize;
        if rest.len() < NAME_AT || namelen == 0 || namelen > abi::NAME_MAX {
            return None;
        }
        let record_len = abi::dirent_align(NAME_AT + namelen)?;
        let name = rest.get(NAME_AT..NAME_AT + namelen)?;
        if record_len > rest.len() || name.contains(&b'/') {
            return None;
        }
        let record = (at, read_u64(rest, offset_of!(EntryOut, nodeid))?, name);
        at += record_len;
        Some(record)
    });
    records.filter(|&(_, node, name)| node != 0 && name != b"." && name != b"..")
}

/// The native-endian `u64` at `at` in `msg`, if all 8 bytes are there.
pub fn read_u64(msg: &[u8], at: usize) -> Option<u64> {
    let bytes = msg.get(at..at.checked_add(8)?)?;
    Some(u64::from_ne_bytes(bytes.try_into().ok()?))
}

/// Writes `value` native-endian at `at` in `msg`; `false` (and nothing written) if the 8 bytes
/// are not all there.
pub fn write_u64(msg: &mut [u8], at: usize, value: u64) -> bool {
    match at.checked_add(8).and_then(|end| msg.get_mut(at..end)) {
        Some(field) => {
            field.copy_from_slice(&value.to_ne_bytes());
            true
        }
        None => false,
    }
}

/// The native-endian `u32` at `at` in `bytes`, if all 4 bytes are there.
pub(crate) fn read_u32(bytes: &[u8], at: usize) -> Option<u32> {
    let bytes = bytes.get(at..at.checked_add(4)?)?;
    Some(u32::from_ne_bytes(bytes.try_into().ok()?))
}

/// A request of rebound's own to the driver, as the kernel would frame it, with uid and gid 0
/// and the pid of the process making it (a driver that asks who calls finds a live process:
/// lxcfs answers a caller with pid 0 with EINVAL). `unique` must not collide with the ids of
/// kernel requests in flight.
fn own_request(opcode: Opcode, unique: u64, nodeid: u64, body: &[&[u8]]) -> Vec<u8> {
    let len = IN + body.iter().map(|part| part.len()).sum::<usize>();
    let header = InHeader {
        len: u32::try_from(len).unwrap_or(u32::MAX),
        opcode: opcode as u32,
        unique,
        nodeid,
        pid: std::process::id(),
        ..Default::default()
    };
    let mut msg = Vec::with_capacity(len);
    msg.extend_from_slice(header.as_bytes());
    for part in body {
        msg.extend_from_slice(part);
    }
    msg
}

/// LOOKUP of `name` in directory `parent`. `name` must not contain a NUL (names taken from the
/// kernel's requests never do); the terminating NUL is added here.
pub fn lookup_request(unique: u64, parent: u64, name: &[u8]) -> Vec<u8> {
    own_request(Opcode::Lookup, unique, parent, &[name, &[0]])
}

/// UNLINK of `name` in directory `parent` (no NUL in `name`, as for [`lookup_request`]).
pub fn unlink_request(unique: u64, parent: u64, name: &[u8]) -> Vec<u8> {
    own_request(Opcode::Unlink, unique, parent, &[name, &[0]])
}

/// OPEN (or OPENDIR if `dir`) of `node` with open(2) `flags`.
pub fn open_request(unique: u64, node: u64, flags: u32, dir: bool) -> Vec<u8> {
    let open = OpenIn {
        flags,
        open_flags: 0,
    };
    let opcode = if dir { Opcode::Opendir } else { Opcode::Open };
    own_request(opcode, unique, node, &[open.as_bytes()])
}

/// READDIR of `size` bytes from `offset` of directory handle `fh` on `node`.
pub fn readdir_request(unique: u64, node: u64, fh: u64, offset: u64, size: u32) -> Vec<u8> {
    let read = ReadIn {
        fh,
        offset,
        size,
        ..Default::default()
    };
    own_request(Opcode::Readdir, unique, node, &[read.as_bytes()])
}

/// GETATTR of `node`, without a handle.
pub fn getattr_request(unique: u64, node: u64) -> Vec<u8> {
    own_request(
        Opcode::Getattr,
        unique,
        node,
        &[GetattrIn::default().as_bytes()],
    )
}

/// FSYNC of handle `fh` on `node` (data and metadata).
pub fn fsync_request(unique: u64, node: u64, fh: u64) -> Vec<u8> {
    let fsync = FsyncIn {
        fh,
        ..Default::default()
    };
    own_request(Opcode::Fsync, unique, node, &[fsync.as_bytes()])
}

/// SETATTR of `node`'s size to 0, without a handle.
pub fn truncate_request(unique: u64, node: u64) -> Vec<u8> {
    let setattr = SetattrIn {
        valid: abi::FATTR_SIZE,
        ..Default::default()
    };
    own_request(Opcode::Setattr, unique, node, &[setattr.as_bytes()])
}

/// FORGET of `nlookup` lookups on `node`. The driver sends no reply.
pub fn forget_request(unique: u64, node: u64, nlookup: u64) -> Vec<u8> {
    let forget = ForgetIn { nlookup };
    own_request(Opcode::Forget, unique, node, &[forget.as_bytes()])
}

/// RELEASE (or RELEASEDIR if `dir`) of handle `fh` on `node`, opened with open(2) `flags`.
pub fn release_request(unique: u64, node: u64, fh: u64, flags: u32, dir: bool) -> Vec<u8> {
    let release = ReleaseIn {
        fh,
        flags,
        ..Default::default()
    };
    let opcode = if dir {
        Opcode::Releasedir
    } else {
        Opcode::Release
    };
    own_request(opcode, unique, node, &[release.as_bytes()])
}

#[cfg(test)]
mod tests {
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
}
