//! What a driver's command line names, and what rebound knows a driver needs: the paths it
//! is given (shown in its view), and the capabilities a known driver cannot start without.
//!
//! Owns: finding paths in arguments and option values, and the built-in per-driver table.
//! Must not: build the view (see [`super::build`]).

use std::ffi::{OsStr, OsString};
use std::fs::Metadata;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use crate::paths::normalize;

/// Capabilities known drivers cannot start without, kept on top of `capabilities` (least
/// authority: each gets what it needs, found by running it): ntfs-3g drops its supplementary
/// groups at start (`setgroups`), and exits if it cannot.
const BUILT_IN_CAPABILITIES: &[(&str, &[&str])] = &[
    ("ntfs-3g", &["CAP_SETGID"]),
    ("mount.ntfs-3g", &["CAP_SETGID"]),
    ("lowntfs-3g", &["CAP_SETGID"]),
    ("mount.lowntfs-3g", &["CAP_SETGID"]),
];

/// What [`BUILT_IN_CAPABILITIES`] gives the driver `argv` runs.
pub fn built_in_capabilities(argv: &[OsString]) -> &'static [&'static str] {
    let program = argv
        .first()
        .and_then(|p| Path::new(p).file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    BUILT_IN_CAPABILITIES
        .iter()
        .find(|(name, _)| *name == program)
        .map_or(&[], |(_, caps)| caps)
}

/// Every existing path named on the command line, alone or as the value of an option
/// (`-o source=/srv,IdentityFile=/k`), or in a list of them (fuse-overlayfs's
/// `lowerdir=/a:/b`, unionfs's and mergerfs's branches `/a=RW:/b=RO`), normalised; never `/`,
/// nor the mount point once it is known (never looked up: it may wait for this very driver).
pub(super) fn named_paths(
    argv: &[OsString],
    cwd: &Path,
    mountpoint: Option<&Path>,
) -> Vec<(PathBuf, Metadata)> {
    let mut candidates: Vec<&[u8]> = Vec::new();
    for arg in argv.iter().skip(1) {
        let bytes = arg.as_bytes();
        candidates.push(bytes);
        for option in bytes.split(|&b| b == b',') {
            let value = match option.iter().position(|&b| b == b'=') {
                Some(eq) => &option[eq + 1..],
                None => option,
            };
            candidates.push(value);
            for member in option.split(|&b| b == b':') {
                candidates.push(member);
                // A branch's mode after its path (`/a=RW`), or an option's name before it.
                if let Some(eq) = member.iter().position(|&b| b == b'=') {
                    candidates.extend([&member[..eq], &member[eq + 1..]]);
                }
            }
        }
    }
    let mut out: Vec<(PathBuf, Metadata)> = Vec::new();
    for candidate in candidates {
        if candidate.is_empty() || candidate.starts_with(b"-") {
            continue;
        }
        let path = normalize(&cwd.join(Path::new(OsStr::from_bytes(candidate))));
        if path == Path::new("/") || mountpoint.is_some_and(|m| path.starts_with(m)) {
            continue;
        }
        if out.iter().any(|(seen, _)| *seen == path) {
            continue;
        }
        if let Ok(meta) = std::fs::metadata(&path) {
            out.push((path, meta));
        }
    }
    out
}

/// The paths of [`named_paths`] the driver may write: regular files and directories outside
/// the system's trees (`/dev` but for `/dev/shm`, `/proc`, `/sys`), and block devices (a disk
/// the driver serves, `fuse2fs /dev/sdb1`, is its own).
pub(super) fn command_line_paths(
    argv: &[OsString],
    cwd: &Path,
    mountpoint: Option<&Path>,
) -> Vec<PathBuf> {
    named_paths(argv, cwd, mountpoint)
        .into_iter()
        .filter(|(path, meta)| {
            let system = (path.starts_with("/dev") && !path.starts_with("/dev/shm"))
                || path.starts_with("/proc")
                || path.starts_with("/sys");
            meta.file_type().is_block_device() || (!system && (meta.is_file() || meta.is_dir()))
        })
        .map(|(path, _)| path)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_on_the_command_line_are_found_in_options_too() {
        let dir = std::env::temp_dir();
        let argv: Vec<OsString> = vec![
            "drv".into(),
            "-o".into(),
            format!("source={},xattr", dir.display()).into(),
            "/dev/null".into(),
            "/no/such/path".into(),
        ];
        assert_eq!(
            command_line_paths(&argv, Path::new("/"), None),
            vec![dir.clone()]
        );
        assert!(command_line_paths(&argv, Path::new("/"), Some(&dir)).is_empty());
    }

    #[test]
    fn paths_in_lists_of_branches_are_found() {
        let tmp = std::env::temp_dir();
        let (a, b) = (tmp.join("rebound-branch-a"), tmp.join("rebound-branch-b"));
        for dir in [&a, &b] {
            std::fs::create_dir_all(dir).unwrap();
        }
        let (a_, b_) = (a.display(), b.display());
        for list in [
            format!("{a_}=RW:{b_}=RO"),
            format!("{a_}:{b_}"),
            format!("lowerdir={a_}:{b_}"),
        ] {
            let argv: Vec<OsString> = vec!["drv".into(), "-o".into(), list.clone().into()];
            let found = command_line_paths(&argv, Path::new("/"), None);
            assert_eq!(found, vec![a.clone(), b.clone()], "{list}");
        }
        for dir in [&a, &b] {
            std::fs::remove_dir(dir).unwrap();
        }
    }
}
