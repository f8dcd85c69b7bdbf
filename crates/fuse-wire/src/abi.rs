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
/// Set in the `unique` of a request the kernel queues again after `FUSE_NOTIFY_RESEND`.
pub const UNIQUE_RESEND: u64 = 1 << 63;
/// High-word INIT flags rebound never offers to a driver.
pub const FLAGS2_MASKED: u32 = FLAGS2_PASSTHROUGH | FLAGS2_OVER_IO_URING;

/// `fuse_getattr_in.getattr_flags` (also `fuse_statx_in`): `fh` is valid (`FUSE_GETATTR_FH`).
pub const GETATTR_FH: u32 = 1 << 0;
/// `fuse_setattr_in.valid`: `size` is to be set (`FATTR_SIZE`).
pub const FATTR_SIZE: u32 = 1 << 3;
/// `fuse_setattr_in.valid`: `fh` is valid (`FATTR_FH`).
pub const FATTR_FH: u32 = 1 << 6;
/// `fuse_write_in.write_flags`: a write-back of cached pages, not a write(2) (`FUSE_WRITE_CACHE`).
pub const WRITE_CACHE: u32 = 1 << 0;
/// `fuse_ioctl_in.flags`: the ioctl is on a directory, `fh` is from OPENDIR (`FUSE_IOCTL_DIR`).
pub const IOCTL_DIR: u32 = 1 << 4;
/// Longest name in a directory entry (`FUSE_NAME_MAX` in the kernel's `fuse_i.h`).
pub const NAME_MAX: usize = 1024;

/// `FUSE_DIRENT_ALIGN`: directory records are padded to 8 bytes; `None` on overflow.
pub fn dirent_align(len: usize) -> Option<usize> {
    const ALIGN: usize = core::mem::size_of::<u64>();
    Some(len.checked_add(ALIGN - 1)? & !(ALIGN - 1))
}

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

/// `struct fuse_forget_in`: body of FORGET.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct ForgetIn {
    pub nlookup: u64,
}

/// `struct fuse_batch_forget_in`: body of BATCH_FORGET, followed by `count` [`ForgetOne`].
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct BatchForgetIn {
    pub count: u32,
    pub dummy: u32,
}

/// `struct fuse_forget_one`: one entry of BATCH_FORGET.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct ForgetOne {
    pub nodeid: u64,
    pub nlookup: u64,
}

/// `struct fuse_getattr_in`: body of GETATTR (protocol 7.9+).
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct GetattrIn {
    pub getattr_flags: u32,
    pub dummy: u32,
    pub fh: u64,
}

/// `struct fuse_statx_in`: body of STATX.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct StatxIn {
    pub getattr_flags: u32,
    pub reserved: u32,
    pub fh: u64,
    pub sx_flags: u32,
    pub sx_mask: u32,
}

/// `struct fuse_setattr_in`: body of SETATTR.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct SetattrIn {
    pub valid: u32,
    pub padding: u32,
    pub fh: u64,
    pub size: u64,
    pub lock_owner: u64,
    pub atime: u64,
    pub mtime: u64,
    pub ctime: u64,
    pub atimensec: u32,
    pub mtimensec: u32,
    pub ctimensec: u32,
    pub mode: u32,
    pub unused4: u32,
    pub uid: u32,
    pub gid: u32,
    pub unused5: u32,
}

/// `struct fuse_rename_in`: body of RENAME, before the two names.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct RenameIn {
    pub newdir: u64,
}

/// `struct fuse_rename2_in`: body of RENAME2, before the two names.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct Rename2In {
    pub newdir: u64,
    pub flags: u32,
    pub padding: u32,
}

/// `struct fuse_link_in`: body of LINK, before the new name.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct LinkIn {
    pub oldnodeid: u64,
}

/// `struct fuse_open_in`: body of OPEN and OPENDIR.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct OpenIn {
    pub flags: u32,
    pub open_flags: u32,
}

/// `struct fuse_release_in`: body of RELEASE and RELEASEDIR.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct ReleaseIn {
    pub fh: u64,
    pub flags: u32,
    pub release_flags: u32,
    pub lock_owner: u64,
}

/// `struct fuse_flush_in`: body of FLUSH.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct FlushIn {
    pub fh: u64,
    pub unused: u32,
    pub padding: u32,
    pub lock_owner: u64,
}

/// `struct fuse_fsync_in`: body of FSYNC and FSYNCDIR.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct FsyncIn {
    pub fh: u64,
    pub fsync_flags: u32,
    pub padding: u32,
}

/// `struct fuse_file_lock`.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct FileLock {
    pub start: u64,
    pub end: u64,
    pub r#type: u32,
    pub pid: u32,
}

/// `struct fuse_lk_in`: body of GETLK, SETLK, SETLKW.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct LkIn {
    pub fh: u64,
    pub owner: u64,
    pub lk: FileLock,
    pub lk_flags: u32,
    pub padding: u32,
}

/// `struct fuse_lseek_in`: body of LSEEK.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct LseekIn {
    pub fh: u64,
    pub offset: u64,
    pub whence: u32,
    pub padding: u32,
}

/// `struct fuse_fallocate_in`: body of FALLOCATE.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct FallocateIn {
    pub fh: u64,
    pub offset: u64,
    pub length: u64,
    pub mode: u32,
    pub padding: u32,
}

/// `struct fuse_poll_in`: body of POLL. `kh` is the kernel's own handle, not the driver's.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct PollIn {
    pub fh: u64,
    pub kh: u64,
    pub flags: u32,
    pub events: u32,
}

/// `struct fuse_copy_file_range_in`: body of COPY_FILE_RANGE and COPY_FILE_RANGE_64.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct CopyFileRangeIn {
    pub fh_in: u64,
    pub off_in: u64,
    pub nodeid_out: u64,
    pub fh_out: u64,
    pub off_out: u64,
    pub len: u64,
    pub flags: u64,
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

/// `struct fuse_dirent`: one READDIR record (and the tail of a READDIRPLUS record), followed by
/// `namelen` name bytes and padding to [`dirent_align`].
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct Dirent {
    pub ino: u64,
    pub off: u64,
    pub namelen: u32,
    pub r#type: u32,
}

/// `struct fuse_notify_inval_inode_out`.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct NotifyInvalInodeOut {
    pub ino: u64,
    pub off: i64,
    pub len: i64,
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

/// `struct fuse_notify_retrieve_out`.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct NotifyRetrieveOut {
    pub notify_unique: u64,
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
        assert_eq!(size_of::<NotifyInvalInodeOut>(), size::NOTIFY_INVAL_INODE);
        assert_eq!(size_of::<NotifyRetrieveOut>(), size::NOTIFY_RETRIEVE);
        assert_eq!(size_of::<ForgetIn>(), 8);
        assert_eq!(size_of::<BatchForgetIn>(), 8);
        assert_eq!(size_of::<ForgetOne>(), 16);
        assert_eq!(size_of::<GetattrIn>(), 16);
        assert_eq!(size_of::<StatxIn>(), 24);
        assert_eq!(size_of::<SetattrIn>(), 88);
        assert_eq!(size_of::<RenameIn>(), 8);
        assert_eq!(size_of::<Rename2In>(), 16);
        assert_eq!(size_of::<LinkIn>(), 8);
        assert_eq!(size_of::<OpenIn>(), 8);
        assert_eq!(size_of::<ReleaseIn>(), 24);
        assert_eq!(size_of::<FlushIn>(), 24);
        assert_eq!(size_of::<FsyncIn>(), 16);
        assert_eq!(size_of::<FileLock>(), 24);
        assert_eq!(size_of::<LkIn>(), 48);
        assert_eq!(size_of::<LseekIn>(), 24);
        assert_eq!(size_of::<FallocateIn>(), 32);
        assert_eq!(size_of::<PollIn>(), 24);
        assert_eq!(size_of::<CopyFileRangeIn>(), 56);
        assert_eq!(size_of::<Dirent>(), 24);
    }

    /// Sizes alone miss two swapped fields of one type; the id fields are checked by place.
    #[test]
    fn id_fields_sit_where_the_kernel_puts_them() {
        use core::mem::offset_of;
        assert_eq!(
            offset_of!(InHeader, nodeid),
            16,
            "after len, opcode, unique"
        );
        assert_eq!(offset_of!(CopyFileRangeIn, fh_in), 0);
        assert_eq!(offset_of!(CopyFileRangeIn, nodeid_out), 16);
        assert_eq!(offset_of!(CopyFileRangeIn, fh_out), 24);
        assert_eq!(offset_of!(GetattrIn, fh), 8);
        assert_eq!(offset_of!(StatxIn, fh), 8);
        assert_eq!(offset_of!(SetattrIn, fh), 8);
        assert_eq!(offset_of!(IoctlIn, flags), 8);
        assert_eq!(offset_of!(NotifyDeleteOut, child), 8);
        assert_eq!(offset_of!(NotifyRetrieveOut, nodeid), 8);
        assert_eq!(offset_of!(Dirent, namelen), 16);
    }

    #[test]
    fn dirents_are_padded_to_eight_bytes() {
        assert_eq!(dirent_align(0), Some(0));
        assert_eq!(dirent_align(25), Some(32));
        assert_eq!(dirent_align(32), Some(32));
        assert_eq!(dirent_align(usize::MAX), None);
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
