//! What a request changes in the set of objects the kernel holds through the driver (node ids
//! with their lookup counts and names, open handles), read from the request and its reply.
//!
//! Owns: decoding the request bodies and reply entries that the object tracker needs.
//! Must not: keep state (the tracker does), allocate, or panic on any input. A body too short
//! for what its opcode promises yields [`Change::None`]: the kernel never sends one, and the
//! driver will answer it with an error the tracker ignores.

use crate::abi::{size, Opcode, OpenOut};
use crate::ids::{direntplus_links, read_u32, read_u64};
use crate::request::Request;
use zerocopy::FromBytes;

/// The effect of one request on the kernel's objects, committed by the tracker only when the
/// driver's reply is valid and successful (FORGET has no reply and takes effect at once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change<'a> {
    None,
    /// LOOKUP, MKNOD, MKDIR, SYMLINK, LINK: the reply's node gains a lookup as `parent/name`.
    Entry {
        parent: u64,
        name: &'a [u8],
    },
    /// CREATE: as `Entry`, and a file handle opened with `flags`.
    Create {
        parent: u64,
        name: &'a [u8],
        flags: u32,
    },
    /// OPEN, OPENDIR: a handle on `node`, opened with `flags`.
    Open {
        node: u64,
        flags: u32,
        dir: bool,
    },
    /// RELEASE, RELEASEDIR: the handle `fh` on `node` is closed.
    Release {
        node: u64,
        fh: u64,
        dir: bool,
    },
    /// FORGET: `node` loses `count` lookups.
    Forget {
        node: u64,
        count: u64,
    },
    /// BATCH_FORGET: `(node, count)` pairs, 16 bytes each.
    BatchForget {
        entries: &'a [u8],
    },
    /// UNLINK, RMDIR: `parent/name` is gone.
    Remove {
        parent: u64,
        name: &'a [u8],
    },
    /// RENAME, RENAME2: `parent/name` is now `new_parent/new_name` (and what was there is
    /// gone, or swapped with RENAME_EXCHANGE).
    Rename {
        parent: u64,
        name: &'a [u8],
        new_parent: u64,
        new_name: &'a [u8],
        exchange: bool,
    },
    /// READDIRPLUS: every entry of the reply in directory `dir` gains a lookup.
    ReaddirPlus {
        dir: u64,
    },
}

/// `RENAME_EXCHANGE` in RENAME2's flags.
const RENAME_EXCHANGE: u32 = 1 << 1;

impl Request<'_> {
    /// The change this request makes if it succeeds.
    pub fn change(&self) -> Change<'_> {
        let node = self.header.nodeid;
        let body = self.body;
        let Some(op) = self.opcode else {
            return Change::None;
        };
        let u32_at = |at: usize| read_u32(body, at);
        let u64_at = |at: usize| read_u64(body, at);
        let change = match op {
            Opcode::Lookup | Opcode::Unlink | Opcode::Rmdir | Opcode::Symlink => first_name(body)
                .map(|name| match op {
                    Opcode::Unlink | Opcode::Rmdir => Change::Remove { parent: node, name },
                    _ => Change::Entry { parent: node, name },
                }),
            // fuse_mknod_in: mode, rdev, umask, padding.
            Opcode::Mknod => first_name(body.get(16..).unwrap_or_default())
                .map(|name| Change::Entry { parent: node, name }),
            // fuse_mkdir_in: mode, umask.
            Opcode::Mkdir => first_name(body.get(8..).unwrap_or_default())
                .map(|name| Change::Entry { parent: node, name }),
            // fuse_link_in: oldnodeid. The new name is in directory `node`.
            Opcode::Link => first_name(body.get(8..).unwrap_or_default())
                .map(|name| Change::Entry { parent: node, name }),
            // fuse_create_in: flags, mode, umask, open_flags.
            Opcode::Create => u32_at(0).and_then(|flags| {
                first_name(body.get(16..)?).map(|name| Change::Create {
                    parent: node,
                    name,
                    flags,
                })
            }),
            // fuse_open_in: flags, open_flags.
            Opcode::Open | Opcode::Opendir => u32_at(0).map(|flags| Change::Open {
                node,
                flags,
                dir: op == Opcode::Opendir,
            }),
            // fuse_release_in: fh, flags, release_flags, lock_owner.
            Opcode::Release | Opcode::Releasedir => u64_at(0).map(|fh| Change::Release {
                node,
                fh,
                dir: op == Opcode::Releasedir,
            }),
            Opcode::Forget => u64_at(0).map(|count| Change::Forget { node, count }),
            // fuse_batch_forget_in: count, dummy; then fuse_forget_one { nodeid, nlookup }.
            Opcode::BatchForget => u32_at(0).and_then(|count| {
                let len = (count as usize).checked_mul(16)?;
                body.get(8..8usize.checked_add(len)?)
                    .map(|entries| Change::BatchForget { entries })
            }),
            // fuse_rename_in: newdir; fuse_rename2_in: newdir, flags, padding.
            Opcode::Rename | Opcode::Rename2 => {
                let skip = if op == Opcode::Rename { 8 } else { 16 };
                let exchange = op == Opcode::Rename2
                    && u32_at(8).is_some_and(|flags| flags & RENAME_EXCHANGE != 0);
                u64_at(0).and_then(|new_parent| {
                    let names = body.get(skip..)?;
                    let name = first_name(names)?;
                    let new_name = first_name(names.get(name.len() + 1..)?)?;
                    Some(Change::Rename {
                        parent: node,
                        name,
                        new_parent,
                        new_name,
                        exchange,
                    })
                })
            }
            Opcode::Readdirplus => Some(Change::ReaddirPlus { dir: node }),
            _ => None,
        };
        change.unwrap_or(Change::None)
    }
}

/// The opcodes whose requests can change what the kernel holds through a driver (a
/// [`Change`] other than none, FORGETs aside): names, nodes and handles.
pub const CHANGING: [Opcode; 15] = [
    Opcode::Lookup,
    Opcode::Mknod,
    Opcode::Mkdir,
    Opcode::Symlink,
    Opcode::Link,
    Opcode::Create,
    Opcode::Unlink,
    Opcode::Rmdir,
    Opcode::Rename,
    Opcode::Rename2,
    Opcode::Open,
    Opcode::Opendir,
    Opcode::Release,
    Opcode::Releasedir,
    Opcode::Readdirplus,
];

/// The node id a successful entry reply (LOOKUP, MKNOD, MKDIR, SYMLINK, LINK, CREATE) names.
pub fn entry_node(reply_body: &[u8]) -> Option<u64> {
    // `nodeid` is the first field of fuse_entry_out in every layout.
    read_u64(reply_body, 0)
}

/// The file handle of a successful OPEN/OPENDIR reply, or of CREATE (after its entry).
pub fn open_handle(reply_body: &[u8], after_entry: bool) -> Option<u64> {
    let at = if after_entry {
        reply_body.len().checked_sub(size::OPEN_OUT)?
    } else {
        0
    };
    OpenOut::read_from_prefix(reply_body.get(at..)?)
        .ok()
        .map(|(open, _)| open.fh)
}

/// The `(node, lookups)` pairs of a BATCH_FORGET.
pub fn forget_entries(entries: &[u8]) -> impl Iterator<Item = (u64, u64)> + '_ {
    entries
        .chunks_exact(16)
        .filter_map(|e| Some((read_u64(e, 0)?, read_u64(e, 8)?)))
}

/// The entries of a READDIRPLUS reply that give the kernel a lookup: `(at, node, name)`, where
/// `at` is the offset of the entry (and of its node id) in `reply_body`, without `.`, `..` and
/// negative (node 0) entries, as the kernel's `fuse_direntplus_link` counts them, and, as its
/// `parse_dirplus` does, stopping at a record cut short, unpadded or badly named.
pub fn direntplus_entries(reply_body: &[u8]) -> impl Iterator<Item = (usize, u64, &[u8])> + '_ {
    direntplus_links(reply_body)
}

/// The first NUL-terminated name in `bytes`, without its NUL; `None` if unterminated or empty.
fn first_name(bytes: &[u8]) -> Option<&[u8]> {
    let end = bytes.iter().position(|&b| b == 0)?;
    (end > 0).then(|| &bytes[..end])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::{EntryOut, InHeader};
    use zerocopy::IntoBytes;

    fn request(opcode: Opcode, nodeid: u64, body: &[u8]) -> Vec<u8> {
        let header = InHeader {
            len: (size::IN_HEADER + body.len()) as u32,
            opcode: opcode as u32,
            unique: 1,
            nodeid,
            ..Default::default()
        };
        let mut buf = header.as_bytes().to_vec();
        buf.extend_from_slice(body);
        buf
    }

    #[test]
    fn lookup_and_mkdir_name_their_entry() {
        let buf = request(Opcode::Lookup, 7, b"file\0");
        let req = Request::parse(&buf).unwrap();
        assert_eq!(
            req.change(),
            Change::Entry {
                parent: 7,
                name: b"file"
            }
        );

        let mut body = vec![0u8; 8];
        body.extend_from_slice(b"dir\0");
        let buf = request(Opcode::Mkdir, 1, &body);
        let req = Request::parse(&buf).unwrap();
        assert_eq!(
            req.change(),
            Change::Entry {
                parent: 1,
                name: b"dir"
            }
        );
    }

    #[test]
    fn rename2_reads_both_names_and_exchange() {
        let mut body = Vec::new();
        body.extend_from_slice(&9u64.to_ne_bytes());
        body.extend_from_slice(&RENAME_EXCHANGE.to_ne_bytes());
        body.extend_from_slice(&0u32.to_ne_bytes());
        body.extend_from_slice(b"a\0bb\0");
        let buf = request(Opcode::Rename2, 3, &body);
        assert_eq!(
            Request::parse(&buf).unwrap().change(),
            Change::Rename {
                parent: 3,
                name: b"a",
                new_parent: 9,
                new_name: b"bb",
                exchange: true
            }
        );
    }

    #[test]
    fn truncated_bodies_change_nothing() {
        for op in [
            Opcode::Rename,
            Opcode::Create,
            Opcode::BatchForget,
            Opcode::Lookup,
        ] {
            let buf = request(op, 2, &[1, 2, 3]);
            assert_eq!(
                Request::parse(&buf).unwrap().change(),
                Change::None,
                "{op:?}"
            );
        }
    }

    #[test]
    fn direntplus_skips_dots_negative_entries_and_what_the_kernel_does_not_read() {
        let mut body = Vec::new();
        for (node, name) in [
            (1u64, &b"."[..]),
            (5, b"x"),
            (0, b"neg"),
            (6, b"longer-name"),
            (7, b"tail"),
        ] {
            let entry = EntryOut {
                nodeid: node,
                ..Default::default()
            };
            body.extend_from_slice(entry.as_bytes());
            body.extend_from_slice(&node.to_ne_bytes()); // ino
            body.extend_from_slice(&0u64.to_ne_bytes()); // off
            body.extend_from_slice(&(name.len() as u32).to_ne_bytes());
            body.extend_from_slice(&0u32.to_ne_bytes()); // type
            body.extend_from_slice(name);
            if node != 7 {
                body.resize((body.len() + 7) & !7, 0);
            }
        }
        // The kernel stops at a record without its padding: node 7 gains no lookup.
        let found: Vec<_> = direntplus_entries(&body).collect();
        assert_eq!(
            found,
            vec![(160, 5, &b"x"[..]), (480, 6, &b"longer-name"[..])]
        );
    }
}
