//! The FUSE kernel ABI (`include/uapi/linux/fuse.h`) as plain Rust data.
//!
//! Owns: opcodes, notification codes, INIT flags and the fixed-layout structs that rebound reads
//! or rewrites. Structs keep the kernel's field names and derive `FromBytes`/`IntoBytes`, so they
//! are read by copying out of a byte slice (no alignment requirement, no `unsafe`).
//! Must not: interpret semantics (that is `request`/`reply`), or assume input is well formed.

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Protocol major version spoken by every kernel since 2.6.
pub const KERNEL_VERSION: u32 = 7;
/// The inode number of the file system root.
pub const ROOT_ID: u64 = 1;
/// Set in `unique` of the reply to an INTERRUPT: ordinary requests have even ids, and the
/// driver answers an interrupt with the interrupted request's id plus this bit
/// (`FUSE_INT_REQ_BIT` in the kernel's `fuse_dev_i.h`).
pub const INT_REQ_BIT: u64 = 1;
/// Replies may carry `-errno` down to, not including, this value (`fuse_dev_do_write`).
pub const MIN_ERROR: i32 = -512;
/// Longest path the kernel asks READLINK for.
pub const PATH_MAX: usize = 4096;

/// Request opcodes (`enum fuse_opcode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Opcode {
    Lookup = 1,
    Forget = 2,
    Getattr = 3,
    Setattr = 4,
    Readlink = 5,
    Symlink = 6,
    Mknod = 8,
    Mkdir = 9,
    Unlink = 10,
    Rmdir = 11,
    Rename = 12,
    Link = 13,
    Open = 14,
    Read = 15,
    Write = 16,
    Statfs = 17,
    Release = 18,
    Fsync = 20,
    Setxattr = 21,
    Getxattr = 22,
    Listxattr = 23,
    Removexattr = 24,
    Flush = 25,
    Init = 26,
    Opendir = 27,
    Readdir = 28,
    Releasedir = 29,
    Fsyncdir = 30,
    Getlk = 31,
    Setlk = 32,
    Setlkw = 33,
    Access = 34,
    Create = 35,
    Interrupt = 36,
    Bmap = 37,
    Destroy = 38,
    Ioctl = 39,
    Poll = 40,
    NotifyReply = 41,
    BatchForget = 42,
    Fallocate = 43,
    Readdirplus = 44,
    Rename2 = 45,
    Lseek = 46,
    CopyFileRange = 47,
    SetupMapping = 48,
    RemoveMapping = 49,
    Syncfs = 50,
    Tmpfile = 51,
    Statx = 52,
    /// 7.45: like COPY_FILE_RANGE, with a 64-bit result.
    CopyFileRange64 = 53,
}

impl Opcode {
    /// Decodes a raw opcode; `None` for values this build does not know.
    pub fn from_raw(raw: u32) -> Option<Self> {
        use Opcode::*;
        Some(match raw {
            1 => Lookup,
            2 => Forget,
            3 => Getattr,
            4 => Setattr,
            5 => Readlink,
            6 => Symlink,
            8 => Mknod,
            9 => Mkdir,
            10 => Unlink,
            11 => Rmdir,
            12 => Rename,
            13 => Link,
            14 => Open,
            15 => Read,
            16 => Write,
            17 => Statfs,
            18 => Release,
            20 => Fsync,
            21 => Setxattr,
            22 => Getxattr,
            23 => Listxattr,
            24 => Removexattr,
            25 => Flush,
            26 => Init,
            27 => Opendir,
            28 => Readdir,
            29 => Releasedir,
            30 => Fsyncdir,
            31 => Getlk,
            32 => Setlk,
            33 => Setlkw,
            34 => Access,
            35 => Create,
            36 => Interrupt,
            37 => Bmap,
            38 => Destroy,
            39 => Ioctl,
            40 => Poll,
            41 => NotifyReply,
            42 => BatchForget,
            43 => Fallocate,
            44 => Readdirplus,
            45 => Rename2,
            46 => Lseek,
            47 => CopyFileRange,
            48 => SetupMapping,
            49 => RemoveMapping,
            50 => Syncfs,
            51 => Tmpfile,
            52 => Statx,
            53 => CopyFileRange64,
            _ => return None,
        })
    }
}

/// Codes of unsolicited messages from the driver (`enum fuse_notify_code`), sent with
/// `unique == 0` and the code in the `error` field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum NotifyCode {
    Poll = 1,
    InvalInode = 2,
    InvalEntry = 3,
    Store = 4,
    Retrieve = 5,
    Delete = 6,
    Resend = 7,
    IncEpoch = 8,
}

impl NotifyCode {
    /// Decodes a notification code; `None` for unknown codes.
    pub fn from_raw(raw: i32) -> Option<Self> {
        use NotifyCode::*;
        Some(match raw {
            1 => Poll,
            2 => InvalInode,
            3 => InvalEntry,
            4 => Store,
            5 => Retrieve,
            6 => Delete,
            7 => Resend,
            8 => IncEpoch,
            _ => return None,
        })
    }
}

/// INIT flag (low word): the `flags2` field is valid.
pub const INIT_EXT: u32 = 1 << 30;
/// INIT flag (low word): the driver sets `max_pages`.
pub const MAX_PAGES: u32 = 1 << 22;
/// INIT flag (high word, bit 37): passthrough to backing files. Needs ioctls on a real
/// `/dev/fuse`, which the driver does not have behind rebound.
pub const FLAGS2_PASSTHROUGH: u32 = 1 << (37 - 32);
/// INIT flag (high word, bit 41): requests over io_uring, which bypasses the channel.
pub const FLAGS2_OVER_IO_URING: u32 = 1 << (41 - 32);
/// High-word INIT flags rebound never offers to a driver.
pub const FLAGS2_MASKED: u32 = FLAGS2_PASSTHROUGH | FLAGS2_OVER_IO_URING;

/// `struct fuse_in_header`: precedes every request from the kernel.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct InHeader {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
    pub total_extlen: u16,
    pub padding: u16,
}

/// `struct fuse_out_header`: precedes every reply and notification from the driver.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct OutHeader {
    pub len: u32,
    pub error: i32,
    pub unique: u64,
}

/// `struct fuse_init_in` (7.36+ layout; older kernels send only the first 16 bytes).
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct InitIn {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    pub flags: u32,
    /// 7.36
    pub flags2: u32,
    pub unused: [u32; 11],
}

/// `struct fuse_init_out` (7.36+ layout; older drivers send 8 or 24 bytes).
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct InitOut {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    pub flags: u32,
    pub max_background: u16,
    pub congestion_threshold: u16,
    pub max_write: u32,
    /// 7.23
    pub time_gran: u32,
    /// 7.28
    pub max_pages: u16,
    pub map_alignment: u16,
    /// 7.36
    pub flags2: u32,
    /// 7.40
    pub max_stack_depth: u32,
    /// 7.43
    pub request_timeout: u16,
    pub unused: [u16; 11],
}

/// `struct fuse_attr`.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct Attr {
    pub ino: u64,
    pub size: u64,
    pub blocks: u64,
    pub atime: u64,
    pub mtime: u64,
    pub ctime: u64,
    pub atimensec: u32,
    pub mtimensec: u32,
    pub ctimensec: u32,
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub blksize: u32,
    pub flags: u32,
}

/// `struct fuse_entry_out`: reply to LOOKUP, MKNOD, MKDIR, SYMLINK, LINK (and first part of
/// CREATE/TMPFILE).
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct EntryOut {
    pub nodeid: u64,
    pub generation: u64,
    pub entry_valid: u64,
    pub attr_valid: u64,
    pub entry_valid_nsec: u32,
    pub attr_valid_nsec: u32,
    pub attr: Attr,
}

/// `struct fuse_attr_out`: reply to GETATTR and SETATTR.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct AttrOut {
    pub attr_valid: u64,
    pub attr_valid_nsec: u32,
    pub dummy: u32,
    pub attr: Attr,
}

/// `struct fuse_open_out`: reply to OPEN and OPENDIR (second part of CREATE).
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct OpenOut {
    pub fh: u64,
    pub open_flags: u32,
    pub backing_id: i32,
}

/// `struct fuse_read_in`: body of READ, READDIR, READDIRPLUS.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct ReadIn {
    pub fh: u64,
    pub offset: u64,
    pub size: u32,
    pub read_flags: u32,
    pub lock_owner: u64,
    pub flags: u32,
    pub padding: u32,
}

/// `struct fuse_write_in`: body of WRITE, followed by the data.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct WriteIn {
    pub fh: u64,
    pub offset: u64,
    pub size: u32,
    pub write_flags: u32,
    pub lock_owner: u64,
    pub flags: u32,
    pub padding: u32,
}

/// `struct fuse_write_out`: reply to WRITE and COPY_FILE_RANGE.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct WriteOut {
    pub size: u32,
    pub padding: u32,
}

/// `struct fuse_getxattr_in`: body of GETXATTR (before the name) and LISTXATTR.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct GetxattrIn {
    pub size: u32,
    pub padding: u32,
}

/// `struct fuse_ioctl_in`: body of IOCTL.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct IoctlIn {
    pub fh: u64,
    pub flags: u32,
    pub cmd: u32,
    pub arg: u64,
    pub in_size: u32,
    pub out_size: u32,
}

/// `struct fuse_notify_inval_entry_out` and `fuse_notify_delete_out` share this prefix shape
/// (two 64-bit ids or one id and a name length); the name follows, NUL-terminated.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct NotifyInvalEntryOut {
    pub parent: u64,
    pub namelen: u32,
    pub flags: u32,
}

/// `struct fuse_notify_delete_out`.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct NotifyDeleteOut {
    pub parent: u64,
    pub child: u64,
    pub namelen: u32,
    pub padding: u32,
}

/// `struct fuse_notify_store_out`: the data follows.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct NotifyStoreOut {
    pub nodeid: u64,
    pub offset: u64,
    pub size: u32,
    pub padding: u32,
}

/// Byte sizes of reply bodies that the protocol fixes, in the current layout.
pub mod size {
    pub const IN_HEADER: usize = 40;
    pub const OUT_HEADER: usize = 16;
    pub const ENTRY_OUT: usize = 128;
    /// `FUSE_COMPAT_ENTRY_OUT_SIZE`, for protocol minor < 9.
    pub const ENTRY_OUT_COMPAT: usize = 120;
    pub const ATTR_OUT: usize = 104;
    /// `FUSE_COMPAT_ATTR_OUT_SIZE`, for protocol minor < 9.
    pub const ATTR_OUT_COMPAT: usize = 96;
    pub const OPEN_OUT: usize = 16;
    pub const WRITE_OUT: usize = 8;
    pub const STATFS_OUT: usize = 80;
    /// `FUSE_COMPAT_STATFS_SIZE`, for protocol minor < 4.
    pub const STATFS_OUT_COMPAT: usize = 48;
    pub const GETXATTR_OUT: usize = 8;
    pub const LK_OUT: usize = 24;
    pub const BMAP_OUT: usize = 8;
    pub const IOCTL_OUT: usize = 16;
    pub const POLL_OUT: usize = 8;
    pub const LSEEK_OUT: usize = 8;
    pub const COPY_FILE_RANGE_OUT: usize = 8;
    pub const STATX_OUT: usize = 288;
    pub const INIT_OUT: usize = 64;
    /// `FUSE_COMPAT_INIT_OUT_SIZE`: major and minor only.
    pub const INIT_OUT_MIN: usize = 8;
    pub const NOTIFY_POLL: usize = 8;
    pub const NOTIFY_INVAL_INODE: usize = 24;
    pub const NOTIFY_INVAL_ENTRY: usize = 16;
    pub const NOTIFY_STORE: usize = 24;
    pub const NOTIFY_RETRIEVE: usize = 32;
    pub const NOTIFY_DELETE: usize = 24;
    pub const NOTIFY_INC_EPOCH: usize = 0;
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    /// Layout mistakes show up here, not as garbage on a live mount.
    #[test]
    fn struct_sizes_match_the_kernel() {
        assert_eq!(size_of::<InHeader>(), size::IN_HEADER);
        assert_eq!(size_of::<OutHeader>(), size::OUT_HEADER);
        assert_eq!(size_of::<InitIn>(), 64);
        assert_eq!(size_of::<InitOut>(), size::INIT_OUT);
        assert_eq!(size_of::<Attr>(), 88);
        assert_eq!(size_of::<EntryOut>(), size::ENTRY_OUT);
        assert_eq!(size_of::<AttrOut>(), size::ATTR_OUT);
        assert_eq!(size_of::<OpenOut>(), size::OPEN_OUT);
        assert_eq!(size_of::<ReadIn>(), 40);
        assert_eq!(size_of::<WriteIn>(), 40);
        assert_eq!(size_of::<WriteOut>(), size::WRITE_OUT);
        assert_eq!(size_of::<IoctlIn>(), 32);
        assert_eq!(size_of::<NotifyInvalEntryOut>(), size::NOTIFY_INVAL_ENTRY);
        assert_eq!(size_of::<NotifyDeleteOut>(), size::NOTIFY_DELETE);
        assert_eq!(size_of::<NotifyStoreOut>(), size::NOTIFY_STORE);
    }

    #[test]
    fn opcodes_round_trip() {
        for raw in 0..100u32 {
            if let Some(op) = Opcode::from_raw(raw) {
                assert_eq!(op as u32, raw);
            }
        }
        assert_eq!(Opcode::from_raw(7), None, "7 was never assigned");
        assert_eq!(Opcode::from_raw(19), None, "19 was never assigned");
    }
}
