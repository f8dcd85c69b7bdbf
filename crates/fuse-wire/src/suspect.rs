//! Error replies that are more likely a failing driver than an answer about its files.
//!
//! A driver whose code is damaged does not always crash: it may answer a LOOKUP with `EFAULT`,
//! a READ of an open file with `ENOENT`, an UNLINK with `ENOSPC`. Such a reply is well formed,
//! so validation passes it, and the application sees the error. rebound can ask a restarted
//! driver instead (a second opinion; the proxy decides when). This module says which errors
//! are suspect: those no working driver gives for that request, given what the kernel already
//! checked before sending it (the parent of a LOOKUP is a directory it holds, the handle of a
//! READ is one the driver gave and the kernel opened for reading, ...).
//!
//! Owns: the table of suspect errors per request type. Must not: decide what happens to the
//! request (the proxy does), or treat as suspect an error a working driver gives in normal
//! use (`ENOENT` from LOOKUP, `ERANGE` from GETXATTR, `EAGAIN` from SETLK, `EACCES`, ...).

use crate::Opcode;

// Linux errno values, as the FUSE protocol carries them.
const ENOENT: i32 = 2;
const ESRCH: i32 = 3;
const EIO: i32 = 5;
const ENXIO: i32 = 6;
const EBADF: i32 = 9;
const ECHILD: i32 = 10;
const ENOMEM: i32 = 12;
const EFAULT: i32 = 14;
const EEXIST: i32 = 17;
const ENODEV: i32 = 19;
const ENOTDIR: i32 = 20;
const EISDIR: i32 = 21;
const EINVAL: i32 = 22;
const ENOSPC: i32 = 28;
const EROFS: i32 = 30;
const EPIPE: i32 = 32;
const ERANGE: i32 = 34;
const EDEADLK: i32 = 35;
const ENOSYS: i32 = 38;
const ENOTEMPTY: i32 = 39;
const ENODATA: i32 = 61;
const EPROTO: i32 = 71;
const EBADMSG: i32 = 74;
const ENOTSOCK: i32 = 88;
const ECONNABORTED: i32 = 103;
const ECONNRESET: i32 = 104;
const ENOTCONN: i32 = 107;
const ESTALE: i32 = 116;
const ECANCELED: i32 = 125;
const EOWNERDEAD: i32 = 130;
const ENOTRECOVERABLE: i32 = 131;

/// Whether `errno` as the answer to a request of `opcode` suggests the driver itself is
/// failing. Requests whose errors are the driver's own business (IOCTL, POLL), the
/// session's own (INIT, DESTROY) and attribute queries (GETXATTR, LISTXATTR: a driver
/// without extended attributes answers them with anything, rclone with EIO, and the kernel
/// asks for `security.capability` at every write; a wrong answer changes nothing) are never
/// suspect.
pub fn is_suspect_error(opcode: Opcode, errno: i32) -> bool {
    use Opcode::*;
    if matches!(
        opcode,
        Init | Destroy
            | Interrupt
            | Ioctl
            | Poll
            | Bmap
            | NotifyReply
            | Forget
            | BatchForget
            | Getxattr
            | Listxattr
    ) {
        return false;
    }
    // Requests on something the kernel holds open (its handle came from the driver).
    let on_handle = matches!(
        opcode,
        Read | Write | Flush | Release | Releasedir | Fsync | Fsyncdir | Readdir | Readdirplus
    );
    // Requests naming an entry in a directory the kernel holds.
    let in_directory = matches!(opcode, Lookup | Create | Mkdir | Mknod | Symlink | Link);
    match errno {
        // Never an answer about files: the driver's own trouble (a bad pointer, a handle or
        // connection it lost, memory, a dead lock owner), or a storage error worth a retry.
        EIO | EFAULT | EBADF | ENOMEM | ESRCH | ECHILD | EPIPE | ENOTSOCK | EPROTO | EBADMSG
        | ECANCELED | ECONNABORTED | ECONNRESET | ENOTCONN | EOWNERDEAD | ENOTRECOVERABLE
        | ESTALE | ENODEV => true,
        // The kernel refuses writes to a read-only mount itself; a driver that says so of a
        // writable one has lost track. (Whether the store is writable is the proxy's to know:
        // a driver that is read-only by design answers this to every change.)
        EROFS => true,
        // The end of the data for SEEK_DATA/SEEK_HOLE; otherwise nothing.
        ENXIO => opcode != Lseek,
        // A detected deadlock is SETLKW's to report.
        EDEADLK => !matches!(opcode, Setlk | Setlkw),
        // "Buffer too small" and "no such attribute" are the xattr protocol (the queries are
        // never suspect, above).
        ERANGE => true,
        ENODATA => opcode != Removexattr,
        // The kernel only sends these for nodes and handles it holds, in directories it holds.
        ENOENT => on_handle || matches!(opcode, Create | Mkdir | Mknod | Symlink),
        ENOTDIR => on_handle || in_directory || matches!(opcode, Getattr | Open | Opendir),
        EISDIR => matches!(
            opcode,
            Read | Write | Getattr | Lookup | Readdir | Readdirplus | Opendir
        ),
        EEXIST => on_handle || matches!(opcode, Lookup | Getattr | Unlink | Rmdir | Open),
        ENOTEMPTY => !matches!(opcode, Rmdir | Rename | Rename2),
        // Nothing to allocate in reading, looking up or removing.
        ENOSPC => matches!(
            opcode,
            Read | Getattr
                | Lookup
                | Unlink
                | Rmdir
                | Release
                | Releasedir
                | Readdir
                | Readdirplus
                | Opendir
                | Statfs
        ),
        // EINVAL is legitimate for I/O (O_DIRECT alignment), opens, renames with flags and
        // attribute changes; not for these.
        EINVAL => matches!(
            opcode,
            Lookup
                | Getattr
                | Readdir
                | Readdirplus
                | Unlink
                | Rmdir
                | Mkdir
                | Release
                | Releasedir
                | Flush
                | Statfs
                | Opendir
        ),
        // A driver may leave anything unimplemented, but not the operations a mount cannot
        // work without, once it has been serving them.
        ENOSYS => matches!(
            opcode,
            Lookup | Getattr | Read | Open | Opendir | Readdir | Release | Releasedir
        ),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Opcode::*;

    #[test]
    fn normal_answers_are_not_suspect() {
        for (op, errno) in [
            (Lookup, ENOENT),
            (Create, EEXIST),
            (Mkdir, ENOSPC),
            (Rmdir, ENOTEMPTY),
            (Getxattr, ERANGE),
            (Getxattr, ENODATA),
            (Getxattr, EIO),
            (Listxattr, EIO),
            (Setlkw, EDEADLK),
            (Lseek, ENXIO),
            (Write, EINVAL),
            (Create, ENOSYS),
            (Ioctl, EIO),
            (Init, EIO),
            (Open, 13), // EACCES
        ] {
            assert!(!is_suspect_error(op, errno), "{op:?} {errno}");
        }
    }

    #[test]
    fn a_failing_drivers_answers_are_suspect() {
        for (op, errno) in [
            (Lookup, EIO),
            (Lookup, EFAULT),
            (Read, ENOENT),
            (Read, EBADF),
            (Create, ENODATA),
            (Create, ENOENT),
            (Unlink, ENOSPC),
            (Getattr, EINVAL),
            (Write, EROFS),
            (Rename, ERANGE),
            (Readdir, ENOSYS),
        ] {
            assert!(is_suspect_error(op, errno), "{op:?} {errno}");
        }
    }
}
