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
mod tests;
