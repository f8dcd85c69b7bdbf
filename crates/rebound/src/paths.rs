//! Paths as rebound compares them: lexically, or by resolving only what lies above a mount
//! point, never the mount point itself (a lookup on a FUSE mount point could wait on the very
//! driver rebound is dealing with); and the FUSE mount points the mount table names.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

/// Lexical normalisation: no `.` components, `..` removes the component before it, no
/// trailing slash.
pub fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other.as_os_str()),
        }
    }
    out
}

/// The paths `path` may be recorded as: the absolute path, normalised lexically (all that is
/// left when the path cannot be resolved), and the path with symbolic links resolved. The
/// mount point itself is never looked at (only its parent is canonicalised, and a symbolic
/// link in its place read), since a lookup on a mount whose driver hangs would block.
pub fn mount_point_forms(path: &Path) -> Vec<PathBuf> {
    let Ok(absolute) = std::path::absolute(path) else {
        return Vec::new();
    };
    // Lexically first: resolving a path that ends in `..` would enter what lies below.
    let mut current = normalize(&absolute);
    let mut forms = vec![current.clone()];
    // As many links as the kernel follows (MAXSYMLINKS).
    for _ in 0..40 {
        let resolved = match (current.parent(), current.file_name()) {
            (Some(parent), Some(name)) => match parent.canonicalize() {
                Ok(parent) => parent.join(name),
                Err(_) => break,
            },
            // `/`, or a link's target ending in `..`: not a mount point of a live FUSE mount
            // we could block on (the root, or a directory above one).
            _ => match current.canonicalize() {
                Ok(resolved) => resolved,
                Err(_) => break,
            },
        };
        match std::fs::read_link(&resolved) {
            Ok(target) => current = resolved.parent().unwrap_or(Path::new("/")).join(target),
            Err(_) => {
                forms.push(resolved);
                break;
            }
        }
    }
    forms
}

/// `mountpoint` as the mount table names a mount made there: its symbolic links resolved
/// without entering it (the last of [`mount_point_forms`]). A mount helper (fusermount3)
/// mounts the path as the driver gave it.
pub fn in_mount_table(mountpoint: &Path) -> PathBuf {
    mount_point_forms(mountpoint)
        .pop()
        .unwrap_or_else(|| mountpoint.to_path_buf())
}

/// Mount points of FUSE file systems in rebound's namespace, as the mount table names them.
pub fn fuse_mounts() -> std::io::Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(text
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let fstype = right.split_whitespace().next()?;
            if !(fstype == "fuse" || fstype.starts_with("fuse.") || fstype == "fuseblk") {
                return None;
            }
            let mountpoint = left.split_whitespace().nth(4)?;
            let bytes = rebound_observe::unescape_mount_field(mountpoint);
            Some(PathBuf::from(OsStr::from_bytes(&bytes)))
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalisation_is_lexical() {
        assert_eq!(normalize(Path::new("/a/./b/../c/")), PathBuf::from("/a/c"));
    }
}
