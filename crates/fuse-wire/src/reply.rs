//! Messages from the driver: replies and notifications, checked before the kernel sees them.
//!
//! Owns: the rules a driver message must satisfy to be forwarded (Nooks' wrapper checks):
//! lengths consistent with the header and with the request, error values in range, node ids
//! and attributes the kernel can accept, INIT capabilities rebound can carry.
//! Must not: panic or index out of bounds on any bytes (the driver is untrusted and this
//! module is fuzzed), or allocate on the hot path.

use crate::abi::{self, size, Attr, AttrOut, EntryOut, InitOut, NotifyCode, OutHeader, WriteOut};
use crate::request::ReplyShape;
use crate::WireError;
use zerocopy::{FromBytes, IntoBytes};

/// A driver message whose header is consistent with its length.
#[derive(Debug)]
pub struct DriverMessage<'a> {
    pub header: OutHeader,
    /// Everything after the header.
    pub body: &'a [u8],
}

impl<'a> DriverMessage<'a> {
    /// Parses the header of one message as written by the driver in one `write(2)`.
    pub fn parse(buf: &'a [u8]) -> Result<Self, WireError> {
        let (header, _) = OutHeader::read_from_prefix(buf).map_err(|_| WireError::Short {
            need: size::OUT_HEADER,
            got: buf.len(),
        })?;
        if header.len as usize != buf.len() {
            return Err(WireError::LengthMismatch {
                header: header.len,
                got: buf.len(),
            });
        }
        Ok(DriverMessage {
            header,
            body: &buf[size::OUT_HEADER..],
        })
    }

    /// `unique == 0` marks an unsolicited notification.
    pub fn is_notification(&self) -> bool {
        self.header.unique == 0
    }

    /// Checks a reply against the request it answers. `minor` is the negotiated protocol minor
    /// version (0 before INIT completes), which decides the legacy struct sizes.
    pub fn validate_reply(&self, shape: ReplyShape, minor: u32) -> Result<(), WireError> {
        let error = self.header.error;
        if !(abi::MIN_ERROR < error && error <= 0) {
            return Err(WireError::ErrorOutOfRange(error));
        }
        if shape == ReplyShape::NoReply {
            return Err(WireError::UnexpectedReply);
        }
        if error != 0 {
            return expect_len(self.body, 0);
        }
        let body = self.body;
        match shape {
            ReplyShape::NoReply => Err(WireError::UnexpectedReply),
            ReplyShape::ErrorOnly => Err(WireError::UnexpectedReply),
            ReplyShape::Empty => expect_len(body, 0),
            ReplyShape::Entry { negative_ok } => {
                expect_len(body, entry_size(minor))?;
                check_entry(body, negative_ok)
            }
            ReplyShape::Create => {
                expect_len(body, entry_size(minor) + size::OPEN_OUT)?;
                check_entry(body, false)
            }
            ReplyShape::Attr => {
                let want = if minor < 9 {
                    size::ATTR_OUT_COMPAT
                } else {
                    size::ATTR_OUT
                };
                expect_len(body, want)?;
                check_attr(&read_padded::<AttrOut>(body).attr)
            }
            ReplyShape::Open => expect_len(body, size::OPEN_OUT),
            ReplyShape::Write { max } => {
                expect_len(body, size::WRITE_OUT)?;
                let (out, _) = WriteOut::read_from_prefix(body).map_err(|_| short(body))?;
                if out.size > max {
                    return Err(WireError::TooLong {
                        max: max as usize,
                        got: out.size as usize,
                    });
                }
                Ok(())
            }
            ReplyShape::UpTo(max) => expect_at_most(body, max as usize),
            ReplyShape::Exact(n) => expect_len(body, n),
            ReplyShape::Statfs => {
                if body.len() == size::STATFS_OUT
                    || (minor < 4 && body.len() == size::STATFS_OUT_COMPAT)
                {
                    Ok(())
                } else {
                    Err(WireError::BadBodyLength {
                        want: size::STATFS_OUT,
                        got: body.len(),
                    })
                }
            }
            ReplyShape::Init => {
                if body.len() < size::INIT_OUT_MIN {
                    return Err(short(body));
                }
                expect_at_most(body, size::INIT_OUT)
            }
            ReplyShape::Ioctl { out_size } => {
                if body.len() < size::IOCTL_OUT {
                    return Err(short(body));
                }
                // A retry reply carries up to FUSE_IOCTL_MAX_IOV in and out iovecs instead.
                let iovecs = 2 * 256 * 16;
                expect_at_most(body, size::IOCTL_OUT + (out_size as usize).max(iovecs))
            }
            ReplyShape::Any => Ok(()),
        }
    }

    /// Checks an unsolicited notification and returns its code.
    pub fn validate_notification(&self) -> Result<NotifyCode, WireError> {
        let code = NotifyCode::from_raw(self.header.error)
            .ok_or(WireError::UnknownNotification(self.header.error))?;
        let body = self.body;
        match code {
            NotifyCode::Poll => expect_len(body, size::NOTIFY_POLL)?,
            NotifyCode::InvalInode => expect_len(body, size::NOTIFY_INVAL_INODE)?,
            NotifyCode::Retrieve => expect_len(body, size::NOTIFY_RETRIEVE)?,
            NotifyCode::Resend | NotifyCode::IncEpoch => expect_len(body, size::NOTIFY_INC_EPOCH)?,
            NotifyCode::InvalEntry => {
                let (out, name) =
                    abi::NotifyInvalEntryOut::read_from_prefix(body).map_err(|_| short(body))?;
                check_name(name, out.namelen)?;
            }
            NotifyCode::Delete => {
                let (out, name) =
                    abi::NotifyDeleteOut::read_from_prefix(body).map_err(|_| short(body))?;
                check_name(name, out.namelen)?;
            }
            NotifyCode::Store => {
                let (out, data) =
                    abi::NotifyStoreOut::read_from_prefix(body).map_err(|_| short(body))?;
                expect_len(data, out.size as usize)?;
            }
        }
        Ok(code)
    }
}

/// What rebound needs to remember of a completed INIT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InitReply {
    pub minor: u32,
    pub max_write: u32,
}

/// Rewrites a validated, successful INIT reply in place so it asks only for what rebound can
/// carry: no masked capabilities, `max_write` within rebound's buffers. Returns what was agreed.
pub fn fix_init_reply(buf: &mut [u8], max_write_limit: u32) -> Result<InitReply, WireError> {
    let msg = DriverMessage::parse(buf)?;
    if msg.header.error != 0 {
        return Err(WireError::ErrorOutOfRange(msg.header.error));
    }
    if msg.body.len() < size::INIT_OUT_MIN || msg.body.len() > size::INIT_OUT {
        return Err(WireError::BadInit("length"));
    }
    let copied = msg.body.len();
    let mut init = read_padded::<InitOut>(msg.body);
    if init.major != abi::KERNEL_VERSION {
        return Err(WireError::BadInit("major version is not 7"));
    }
    init.flags2 &= !abi::FLAGS2_MASKED;
    init.max_write = init.max_write.min(max_write_limit);
    let max_pages = max_write_limit.div_ceil(4096).min(u16::MAX as u32) as u16;
    if init.max_pages > max_pages {
        init.max_pages = max_pages;
    }
    let agreed = InitReply {
        minor: init.minor,
        max_write: init.max_write,
    };
    buf[size::OUT_HEADER..size::OUT_HEADER + copied].copy_from_slice(&init.as_bytes()[..copied]);
    Ok(agreed)
}

/// Size of `fuse_entry_out` at protocol minor `minor`.
pub(crate) fn entry_size(minor: u32) -> usize {
    if minor < 9 {
        size::ENTRY_OUT_COMPAT
    } else {
        size::ENTRY_OUT
    }
}

/// Reads `T` from the start of `body`, filling with zeros what a legacy (shorter) layout lacks.
fn read_padded<T: FromBytes + IntoBytes>(body: &[u8]) -> T {
    let mut value = T::new_zeroed();
    let dst = value.as_mut_bytes();
    let n = body.len().min(dst.len());
    dst[..n].copy_from_slice(&body[..n]);
    value
}

fn check_entry(body: &[u8], negative_ok: bool) -> Result<(), WireError> {
    let entry = read_padded::<EntryOut>(body);
    if entry.nodeid == 0 {
        return if negative_ok {
            Ok(())
        } else {
            Err(WireError::ZeroNodeId)
        };
    }
    check_attr(&entry.attr)
}

/// The checks of the kernel's `fuse_invalid_attr`, done before the kernel sees the reply.
fn check_attr(attr: &Attr) -> Result<(), WireError> {
    const S_IFMT: u32 = 0o170000;
    let valid_type = matches!(
        attr.mode & S_IFMT,
        0o100000 | 0o040000 | 0o120000 | 0o020000 | 0o060000 | 0o010000 | 0o140000
    );
    if !valid_type {
        return Err(WireError::BadAttr("file type"));
    }
    if attr.size > i64::MAX as u64 {
        return Err(WireError::BadAttr("size"));
    }
    Ok(())
}

fn check_name(name: &[u8], namelen: u32) -> Result<(), WireError> {
    let namelen = namelen as usize;
    // The name is followed by its terminating NUL.
    if name.len() != namelen.saturating_add(1) || name.last() != Some(&0) {
        return Err(WireError::BadBodyLength {
            want: namelen.saturating_add(1),
            got: name.len(),
        });
    }
    Ok(())
}

fn expect_len(body: &[u8], want: usize) -> Result<(), WireError> {
    if body.len() == want {
        Ok(())
    } else {
        Err(WireError::BadBodyLength {
            want,
            got: body.len(),
        })
    }
}

fn expect_at_most(body: &[u8], max: usize) -> Result<(), WireError> {
    if body.len() <= max {
        Ok(())
    } else {
        Err(WireError::TooLong {
            max,
            got: body.len(),
        })
    }
}

fn short(body: &[u8]) -> WireError {
    WireError::Short {
        need: size::OUT_HEADER + 1,
        got: body.len(),
    }
}

/// Builds the bare error reply rebound sends in the driver's place (`-errno` for `unique`).
pub fn error_reply(unique: u64, errno: i32) -> [u8; size::OUT_HEADER] {
    let header = OutHeader {
        len: size::OUT_HEADER as u32,
        error: -errno,
        unique,
    };
    let mut out = [0u8; size::OUT_HEADER];
    out.copy_from_slice(header.as_bytes());
    out
}
