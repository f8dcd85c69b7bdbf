//! Requests from the kernel: header parsing, the reply each request calls for, and the INIT
//! rewrite that hides capabilities a driver behind rebound cannot use.
//!
//! Owns: reading `fuse_in_header` and the few request bodies whose fields bound the reply.
//! Must not: panic on any input (the kernel is trusted, but this code is also fuzzed), or
//! allocate (it runs once per request on the hot path).

use crate::abi::{self, size, InHeader, InitIn, IoctlIn, Opcode, OpenIn, ReadIn, WriteIn};
use crate::ids::read_u32;
use crate::WireError;
use std::mem::offset_of;
use zerocopy::{FromBytes, IntoBytes};

/// A request read from `/dev/fuse`, borrowed from the read buffer.
#[derive(Debug)]
pub struct Request<'a> {
    pub header: InHeader,
    /// `None` for an opcode this build does not know; it is forwarded unchanged.
    pub opcode: Option<Opcode>,
    /// Everything after the header, up to `header.len`.
    pub body: &'a [u8],
}

impl<'a> Request<'a> {
    /// Parses one request. `buf` is exactly what one `read(2)` of `/dev/fuse` returned.
    pub fn parse(buf: &'a [u8]) -> Result<Self, WireError> {
        let (header, _) = InHeader::read_from_prefix(buf).map_err(|_| WireError::Short {
            need: size::IN_HEADER,
            got: buf.len(),
        })?;
        let len = header.len as usize;
        if len != buf.len() {
            return Err(WireError::LengthMismatch {
                header: header.len,
                got: buf.len(),
            });
        }
        Ok(Request {
            header,
            opcode: Opcode::from_raw(header.opcode),
            body: &buf[size::IN_HEADER..],
        })
    }

    /// What a valid reply to this request looks like.
    pub fn reply_shape(&self) -> ReplyShape {
        use Opcode::*;
        let Some(op) = self.opcode else {
            return ReplyShape::Any;
        };
        match op {
            Forget | BatchForget | NotifyReply => ReplyShape::NoReply,
            Interrupt => ReplyShape::ErrorOnly,
            Lookup => ReplyShape::Entry { negative_ok: true },
            Mknod | Mkdir | Symlink | Link => ReplyShape::Entry { negative_ok: false },
            Create | Tmpfile => ReplyShape::Create,
            Getattr | Setattr => ReplyShape::Attr,
            Open | Opendir => ReplyShape::Open,
            Readlink => ReplyShape::UpTo(abi::PATH_MAX as u32),
            // Their `size` is where a protocol before 7.9 has it too (its shorter bodies end
            // after `size` and one more word: fuser's default speaks 7.8).
            Read | Readdir | Readdirplus => {
                ReplyShape::UpTo(read_u32(self.body, offset_of!(ReadIn, size)).unwrap_or(0))
            }
            Write => ReplyShape::Write {
                max: read_u32(self.body, offset_of!(WriteIn, size)).unwrap_or(0),
            },
            CopyFileRange => ReplyShape::Write { max: u32::MAX },
            Getxattr | Listxattr => {
                match abi::GetxattrIn::read_from_prefix(self.body).map(|(g, _)| g.size) {
                    Ok(0) | Err(_) => ReplyShape::Exact(size::GETXATTR_OUT),
                    Ok(n) => ReplyShape::UpTo(n),
                }
            }
            Statfs => ReplyShape::Statfs,
            Init => ReplyShape::Init,
            Getlk => ReplyShape::Exact(size::LK_OUT),
            Bmap => ReplyShape::Exact(size::BMAP_OUT),
            Poll => ReplyShape::Exact(size::POLL_OUT),
            Lseek => ReplyShape::Exact(size::LSEEK_OUT),
            CopyFileRange64 => ReplyShape::Exact(size::COPY_FILE_RANGE_OUT),
            Statx => ReplyShape::Exact(size::STATX_OUT),
            Ioctl => ReplyShape::Ioctl {
                out_size: IoctlIn::read_from_prefix(self.body).map_or(0, |(i, _)| i.out_size),
            },
            Unlink | Rmdir | Rename | Rename2 | Release | Releasedir | Fsync | Fsyncdir
            | Setxattr | Removexattr | Flush | Setlk | Setlkw | Access | Fallocate | Syncfs
            | Destroy | SetupMapping | RemoveMapping => ReplyShape::Empty,
        }
    }
}

/// The reply a request calls for when it succeeds (`error == 0`). Any request may instead be
/// answered by a bare header carrying `-errno`, except those with [`ReplyShape::NoReply`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyShape {
    /// FORGET, BATCH_FORGET, NOTIFY_REPLY: the driver must not answer.
    NoReply,
    /// INTERRUPT: the driver may answer only with an error (`EAGAIN`, `ENOSYS`).
    ErrorOnly,
    /// A header and nothing else.
    Empty,
    /// `fuse_entry_out`; `negative_ok` allows node id 0 (a cached negative LOOKUP).
    Entry { negative_ok: bool },
    /// `fuse_entry_out` followed by `fuse_open_out`.
    Create,
    /// `fuse_attr_out`.
    Attr,
    /// `fuse_open_out`.
    Open,
    /// `fuse_write_out` whose `size` must not exceed `max`.
    Write { max: u32 },
    /// Variable data of at most this many bytes.
    UpTo(u32),
    /// A fixed-size struct of this many bytes.
    Exact(usize),
    /// `fuse_statfs_out`.
    Statfs,
    /// `fuse_init_out`, possibly in an older, shorter layout.
    Init,
    /// `fuse_ioctl_out` followed by at most `out_size` bytes (or a retry's iovecs).
    Ioctl { out_size: u32 },
    /// Unknown opcode: forwarded unchecked, the kernel validates it.
    Any,
}

/// Hides from the driver the INIT capabilities that need a real `/dev/fuse` on its side.
/// `buf` is a whole INIT request; anything else is left untouched.
pub fn mask_init_request(buf: &mut [u8]) {
    let Ok(req) = Request::parse(buf) else { return };
    if req.opcode != Some(Opcode::Init) {
        return;
    }
    let body = &mut buf[size::IN_HEADER..];
    if let Ok((mut init, _)) = InitIn::read_from_prefix(body) {
        init.flags2 &= !abi::FLAGS2_MASKED;
        // Cannot fail: the prefix was just read from the same slice.
        let _ = init.write_to_prefix(body);
    }
}

/// Replaces the open flags of an OPEN or CREATE request (the first field of both
/// `fuse_open_in` and `fuse_create_in`) with what `change` makes of them. `buf` is a whole
/// request; any other is left untouched. (The flags are the caller's `open(2)` flags, whose
/// values differ between architectures: `change` names them.)
pub fn map_open_flags(buf: &mut [u8], change: impl FnOnce(u32) -> u32) {
    // The header alone: the caller parsed the request already (this is on the request path).
    let Ok((header, _)) = InHeader::read_from_prefix(buf) else {
        return;
    };
    if ![Opcode::Open as u32, Opcode::Create as u32].contains(&header.opcode) {
        return;
    }
    if let Ok((mut open, _)) = OpenIn::read_from_prefix(&buf[size::IN_HEADER..]) {
        open.flags = change(open.flags);
        let _ = open.write_to_prefix(&mut buf[size::IN_HEADER..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(opcode: u32, body: &[u8]) -> Vec<u8> {
        let header = InHeader {
            len: (size::IN_HEADER + body.len()) as u32,
            opcode,
            unique: 42,
            nodeid: 1,
            ..Default::default()
        };
        let mut buf = header.as_bytes().to_vec();
        buf.extend_from_slice(body);
        buf
    }

    #[test]
    fn read_reply_is_bounded_by_the_requested_size() {
        let read_in = ReadIn {
            fh: 7,
            offset: 0,
            size: 4096,
            ..Default::default()
        };
        let buf = request(Opcode::Read as u32, read_in.as_bytes());
        let req = Request::parse(&buf).unwrap();
        assert_eq!(req.header.unique, 42);
        assert_eq!(req.reply_shape(), ReplyShape::UpTo(4096));
    }

    #[test]
    fn a_protocol_before_7_9_bounds_reads_and_writes_too() {
        // fuse_read_in and fuse_write_in before 7.9: fh, offset, size, one more word.
        let mut body = Vec::new();
        body.extend_from_slice(&7u64.to_ne_bytes());
        body.extend_from_slice(&0u64.to_ne_bytes());
        body.extend_from_slice(&4096u32.to_ne_bytes());
        body.extend_from_slice(&0u32.to_ne_bytes());
        let read = request(Opcode::Read as u32, &body);
        let req = Request::parse(&read).unwrap();
        assert_eq!(req.reply_shape(), ReplyShape::UpTo(4096));
        body.extend_from_slice(&[0u8; 4096]);
        let write = request(Opcode::Write as u32, &body);
        let req = Request::parse(&write).unwrap();
        assert_eq!(req.reply_shape(), ReplyShape::Write { max: 4096 });
    }

    #[test]
    fn getxattr_size_query_expects_the_size_struct() {
        let buf = request(Opcode::Getxattr as u32, &[0, 0, 0, 0, 0, 0, 0, 0, b'a', 0]);
        let req = Request::parse(&buf).unwrap();
        assert_eq!(req.reply_shape(), ReplyShape::Exact(size::GETXATTR_OUT));
    }

    #[test]
    fn short_or_inconsistent_requests_are_errors() {
        assert!(Request::parse(&[0u8; 10]).is_err());
        let mut buf = request(Opcode::Getattr as u32, &[0u8; 16]);
        buf.push(0);
        assert!(matches!(
            Request::parse(&buf),
            Err(WireError::LengthMismatch { .. })
        ));
    }

    #[test]
    fn init_masks_passthrough_and_io_uring_only() {
        let init = InitIn {
            major: 7,
            minor: 44,
            flags: abi::INIT_EXT | abi::MAX_PAGES,
            flags2: abi::FLAGS2_PASSTHROUGH | abi::FLAGS2_OVER_IO_URING | 1,
            ..Default::default()
        };
        let mut buf = request(Opcode::Init as u32, init.as_bytes());
        mask_init_request(&mut buf);
        let (out, _) = InitIn::read_from_prefix(&buf[size::IN_HEADER..]).unwrap();
        assert_eq!(out.flags2, 1);
        assert_eq!(out.flags, abi::INIT_EXT | abi::MAX_PAGES);
    }

    #[test]
    fn open_flags_are_changed_in_open_and_create_only() {
        let open = OpenIn {
            flags: 0o40002,
            open_flags: 7,
        };
        for opcode in [Opcode::Open, Opcode::Create] {
            // (CREATE's body is longer; its first two fields are OPEN's.)
            let mut body = open.as_bytes().to_vec();
            body.extend_from_slice(&[0; 8]);
            let mut buf = request(opcode as u32, &body);
            map_open_flags(&mut buf, |flags| flags & !0o40000);
            let (out, _) = OpenIn::read_from_prefix(&buf[size::IN_HEADER..]).unwrap();
            assert_eq!((out.flags, out.open_flags), (2, 7), "{opcode:?}");
        }
        let mut other = request(Opcode::Opendir as u32, open.as_bytes());
        let before = other.clone();
        map_open_flags(&mut other, |_| 0);
        assert_eq!(other, before);
    }
}
