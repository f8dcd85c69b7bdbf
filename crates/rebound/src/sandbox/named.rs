//! What a driver's command line names, and what rebound knows a driver needs: the paths it
//! is given (shown in its view), where it will likely mount, what a known driver needs
//! beyond that, and the capabilities derived from what it serves.
//!
//! Owns: finding paths in arguments and option values, and the built-in per-driver table.
//! Must not: build the view (see [`super::build`]).

use std::ffi::{OsStr, OsString};
use std::fs::Metadata;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use crate::paths::normalize;

/// What rebound knows a packaged driver needs beyond what its command line names (least
/// authority: each gets what it needs, found by running it), kept on top of the config.
pub struct KnownDriver {
    /// Its program names.
    pub programs: &'static [&'static str],
    /// Capabilities it cannot do without.
    pub capabilities: &'static [&'static str],
    /// Directories under `$HOME` it writes (made if missing).
    pub home_dirs: &'static [&'static str],
    /// It refuses to mount where its mount table shows a mount already (see
    /// [`likely_mountpoint`]).
    pub refuses_a_mounted_mount_point: bool,
    /// Options (`-o name=DIR`) whose directories must be in one mount of its view (it renames
    /// from one to the other): their closest common directory is bound instead.
    pub one_mount: &'static [&'static str],
    /// Why, for the log.
    pub why: &'static str,
}

const KNOWN_DRIVERS: &[KnownDriver] = &[
    KnownDriver {
        programs: &["ntfs-3g", "mount.ntfs-3g", "lowntfs-3g", "mount.lowntfs-3g"],
        capabilities: &["CAP_SETGID"],
        home_dirs: &[],
        refuses_a_mounted_mount_point: false,
        one_mount: &[],
        why: "it drops its supplementary groups at start (setgroups), and exits if it cannot",
    },
    KnownDriver {
        programs: &["rclone"],
        capabilities: &[],
        home_dirs: &[".cache/rclone"],
        refuses_a_mounted_mount_point: true,
        one_mount: &[],
        why: "its VFS cache lives there (--vfs-cache-mode); without it, writes fail",
    },
    KnownDriver {
        programs: &["fuse-overlayfs"],
        capabilities: &[],
        home_dirs: &[],
        refuses_a_mounted_mount_point: false,
        one_mount: &["upperdir", "workdir"],
        why: "it renames from its work directory to its upper one, so both are bound as one",
    },
];

/// rebound's profile of the driver `argv` runs, if it knows it.
pub fn known_driver(argv: &[OsString]) -> Option<&'static KnownDriver> {
    let program = argv
        .first()
        .and_then(|p| Path::new(p).file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    KNOWN_DRIVERS
        .iter()
        .find(|d| d.programs.contains(&program.as_str()))
}

impl KnownDriver {
    /// The closest directory that holds every directory of its [`KnownDriver::one_mount`]
    /// options on the command line `argv` (run in `cwd`), unless that is `/`.
    pub fn one_mount_dir(&self, argv: &[OsString], cwd: &Path) -> Option<PathBuf> {
        let mut dirs = argv.iter().flat_map(|arg| {
            arg.as_bytes()
                .split(|&b| b == b',')
                .filter_map(|option| {
                    let eq = option.iter().position(|&b| b == b'=')?;
                    let name = std::str::from_utf8(&option[..eq]).ok()?;
                    self.one_mount.contains(&name).then(|| {
                        normalize(&cwd.join(Path::new(OsStr::from_bytes(&option[eq + 1..]))))
                    })
                })
                .collect::<Vec<_>>()
        });
        let first = dirs.next()?;
        let common = dirs.fold(first, |common, dir| {
            common
                .ancestors()
                .find(|a| dir.starts_with(a))
                .map_or_else(|| PathBuf::from("/"), Path::to_path_buf)
        });
        (common != Path::new("/")).then_some(common)
    }

    /// The directories it writes, made if missing (a bind needs its source).
    pub fn writable_paths(&self) -> Vec<PathBuf> {
        let Some(home) = std::env::var_os("HOME").filter(|h| !h.is_empty()) else {
            return Vec::new();
        };
        self.home_dirs
            .iter()
            .map(|dir| Path::new(&home).join(dir))
            .filter(|dir| std::fs::create_dir_all(dir).is_ok())
            .collect()
    }
}

/// What a driver given a host directory to serve needs to act there for every user, as it
/// does when it runs directly as root: set owners, pass permission checks, keep set-id bits,
/// make device nodes, set file capabilities and the immutable flag, and take on the caller's
/// identity for a request (gocryptfs does, with `allow_other`). Without them a POSIX suite
/// run as several users was reported (issue 16) to differ from the direct mount in 69 test
/// files, and to match it with all of them but `CAP_SETUID` and `CAP_SETGID`.
/// `open_by_handle_at`, which `CAP_DAC_READ_SEARCH` would open to the whole host file
/// system, stays denied by the filter; the driver is uid 0 already, so another identity gives
/// it nothing more.
pub const FILE_CAPABILITIES: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_MKNOD",
    "CAP_SETFCAP",
    "CAP_LINUX_IMMUTABLE",
];

/// The capabilities derived from the command line when `capabilities` is unset, and the
/// directory that made them needed: [`FILE_CAPABILITIES`] for a driver given a directory
/// (a passthrough, an overlay, an encrypted tree), none for one whose store is an image, a
/// device or a remote host (ownership lives inside its store).
pub fn derived_capabilities(
    argv: &[OsString],
    cwd: &Path,
    mountpoint: Option<&Path>,
) -> (&'static [&'static str], Option<PathBuf>) {
    // A remote's path (`user@host:/srv`, rclone's `remote:dir`) is not served from here,
    // even when the same path exists locally.
    let is_remote = |arg: &OsString| {
        let bytes = arg.as_bytes();
        bytes.iter().position(|&b| b == b':').is_some_and(|colon| {
            let host = &bytes[..colon];
            !host.is_empty()
                && !host.contains(&b'/')
                && !host.contains(&b'=')
                && (host.contains(&b'@') || !cwd.join(OsStr::from_bytes(host)).exists())
        })
    };
    let local: Vec<OsString> = argv.iter().filter(|a| !is_remote(a)).cloned().collect();
    let served = named_paths(&local, cwd, mountpoint)
        .into_iter()
        .find(|(path, meta)| {
            meta.is_dir()
                && !["/dev", "/proc", "/sys"]
                    .iter()
                    .any(|s| path.starts_with(s))
        });
    match served {
        Some((path, _)) => (FILE_CAPABILITIES, Some(path)),
        None => (&[], None),
    }
}

/// Where a driver starting for the first time will likely mount: its last positional
/// argument (the convention of libfuse, go-fuse and rclone alike), if that is an empty
/// directory. No capabilities are derived from it; and for a driver that refuses a mount
/// point that is a mount (rclone), it is not bound into the view.
pub fn likely_mountpoint(argv: &[OsString], cwd: &Path) -> Option<PathBuf> {
    let mut last = None;
    let mut after_option = false;
    for arg in argv.iter().skip(1) {
        let bytes = arg.as_bytes();
        if bytes.starts_with(b"-") {
            // `-o opts` and `--name value` take the next argument; `-f`, `--name=v` do not.
            after_option = bytes == b"-o" || (bytes.starts_with(b"--") && !bytes.contains(&b'='));
            continue;
        }
        if !after_option {
            last = Some(arg);
        }
        after_option = false;
    }
    let path = normalize(&cwd.join(last?));
    let empty = std::fs::read_dir(&path).ok()?.next().is_none();
    (empty && path != Path::new("/")).then_some(path)
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

    fn argv(args: &[&str]) -> Vec<OsString> {
        args.iter().map(Into::into).collect()
    }

    #[test]
    fn the_mount_point_is_the_last_positional_empty_directory() {
        let tmp = std::env::temp_dir();
        let (src, mnt) = (tmp.join("rebound-guess-src"), tmp.join("rebound-guess-mnt"));
        for dir in [&src, &mnt] {
            std::fs::create_dir_all(dir).unwrap();
        }
        std::fs::write(src.join("f"), b"x").unwrap();
        let (s, m) = (src.to_str().unwrap(), mnt.to_str().unwrap());
        let cwd = Path::new("/");
        for args in [
            vec!["drv", s, m],
            vec!["drv", s, m, "-o", "fakeroot"],
            vec!["rclone", "mount", "--vfs-cache-mode", "writes", s, m],
            vec!["drv", "-f", m],
        ] {
            assert_eq!(
                likely_mountpoint(&argv(&args), cwd),
                Some(mnt.clone()),
                "{args:?}"
            );
        }
        // Not empty, or not a directory: not a mount point to guess.
        assert_eq!(likely_mountpoint(&argv(&["drv", m, s]), cwd), None);
        assert_eq!(likely_mountpoint(&argv(&["drv", "/dev/null"]), cwd), None);
        // A directory to serve, beside the mount point, is what derives capabilities.
        let guess = likely_mountpoint(&argv(&["drv", s, m]), cwd);
        let (caps, why) = derived_capabilities(&argv(&["drv", s, m]), cwd, guess.as_deref());
        assert_eq!((caps, why), (FILE_CAPABILITIES, Some(src.clone())));
        let remote = format!("root@127.0.0.1:{s}");
        let args = argv(&["sshfs", &remote, m]);
        let guess = likely_mountpoint(&args, cwd);
        assert_eq!(
            derived_capabilities(&args, cwd, guess.as_deref()),
            (&[][..], None)
        );
        let image = src.join("f");
        let args = argv(&["fuse2fs", image.to_str().unwrap(), m]);
        let guess = likely_mountpoint(&args, cwd);
        assert_eq!(
            derived_capabilities(&args, cwd, guess.as_deref()),
            (&[][..], None)
        );
        std::fs::remove_file(&image).unwrap();
        for dir in [&src, &mnt] {
            std::fs::remove_dir(dir).unwrap();
        }
    }

    #[test]
    fn an_overlays_upper_and_work_directories_are_bound_as_one() {
        let together = argv(&[
            "fuse-overlayfs",
            "-o",
            "lowerdir=/l,upperdir=/srv/c/upper,workdir=/srv/c/work",
            "/mnt",
        ]);
        let overlay = known_driver(&together).unwrap();
        let cwd = Path::new("/");
        assert_eq!(
            overlay.one_mount_dir(&together, cwd),
            Some(PathBuf::from("/srv/c"))
        );
        let apart = argv(&["fuse-overlayfs", "-o", "upperdir=/a/u,workdir=/b/w", "/m"]);
        assert_eq!(overlay.one_mount_dir(&apart, cwd), None);
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
