//! The driver's sandbox as policy: from the `[sandbox]` and `[limits]` settings and the
//! driver's command line, what it sees (its mount namespace), what it may write, which system
//! calls it may not make, which capabilities it keeps, its network and its rlimits.
//!
//! Owns: the deny lists, the profiles' views of the file system (capabilities by name:
//! `capabilities`).
//! Must not: apply any of it (`rebound_sys::sandbox` does, between fork and exec) or make
//! a path lookup on the driver's mount point (the mount may be waiting for this driver).

mod capabilities;
pub mod named;
pub mod program;

use std::collections::BTreeMap;
use std::ffi::{CString, OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

pub use capabilities::{capability, capability_names, own_capabilities};
use rebound_sys::sandbox::{NewRoot, Sandbox, Step};

use crate::config::{Config, Profile};
use crate::paths::normalize;
use named::{
    command_line_paths, derived_capabilities, known_driver, likely_mountpoint, named_paths,
};

/// System calls no file-system driver needs, denied (`EPERM`) under both profiles: loading
/// kernel code, rebooting, tracing or reading other processes, keyrings, the clock, swap,
/// accounting, changing root or entering namespaces, mount calls other than the intercepted
/// `mount(2)`, raw I/O ports, the kernel log.
pub const DENIED_SYSCALLS: &[(&str, i64)] = &[
    ("init_module", libc::SYS_init_module),
    ("finit_module", libc::SYS_finit_module),
    ("delete_module", libc::SYS_delete_module),
    ("reboot", libc::SYS_reboot),
    ("kexec_load", libc::SYS_kexec_load),
    ("kexec_file_load", libc::SYS_kexec_file_load),
    ("ptrace", libc::SYS_ptrace),
    ("process_vm_readv", libc::SYS_process_vm_readv),
    ("process_vm_writev", libc::SYS_process_vm_writev),
    ("kcmp", libc::SYS_kcmp),
    ("bpf", libc::SYS_bpf),
    ("perf_event_open", libc::SYS_perf_event_open),
    ("add_key", libc::SYS_add_key),
    ("request_key", libc::SYS_request_key),
    ("keyctl", libc::SYS_keyctl),
    ("clock_settime", libc::SYS_clock_settime),
    ("clock_adjtime", libc::SYS_clock_adjtime),
    ("settimeofday", libc::SYS_settimeofday),
    ("adjtimex", libc::SYS_adjtimex),
    ("swapon", libc::SYS_swapon),
    ("swapoff", libc::SYS_swapoff),
    ("acct", libc::SYS_acct),
    ("pivot_root", libc::SYS_pivot_root),
    ("chroot", libc::SYS_chroot),
    ("setns", libc::SYS_setns),
    ("open_by_handle_at", libc::SYS_open_by_handle_at),
    ("open_tree", libc::SYS_open_tree),
    ("move_mount", libc::SYS_move_mount),
    ("fsconfig", libc::SYS_fsconfig),
    ("fsmount", libc::SYS_fsmount),
    ("fspick", libc::SYS_fspick),
    ("mount_setattr", libc::SYS_mount_setattr),
    ("syslog", libc::SYS_syslog),
    ("sethostname", libc::SYS_sethostname),
    ("setdomainname", libc::SYS_setdomainname),
    ("quotactl", libc::SYS_quotactl),
    ("vhangup", libc::SYS_vhangup),
    ("lookup_dcookie", libc::SYS_lookup_dcookie),
    #[cfg(target_arch = "x86_64")]
    ("iopl", libc::SYS_iopl),
    #[cfg(target_arch = "x86_64")]
    ("ioperm", libc::SYS_ioperm),
    #[cfg(target_arch = "x86_64")]
    ("uselib", libc::SYS_uselib),
];

/// Denied under `strict` too: new namespaces, `io_uring` (a large kernel surface no FUSE
/// driver's protocol path needs), `userfaultfd`, NUMA page moves and `personality`.
pub const STRICT_DENIED_SYSCALLS: &[(&str, i64)] = &[
    ("unshare", libc::SYS_unshare),
    ("userfaultfd", libc::SYS_userfaultfd),
    ("io_uring_setup", libc::SYS_io_uring_setup),
    ("io_uring_enter", libc::SYS_io_uring_enter),
    ("io_uring_register", libc::SYS_io_uring_register),
    ("move_pages", libc::SYS_move_pages),
    ("migrate_pages", libc::SYS_migrate_pages),
    ("personality", libc::SYS_personality),
];

/// Whether some profile denies the system call `name` (what `allow_syscalls` may name).
pub fn deniable(name: &str) -> bool {
    DENIED_SYSCALLS
        .iter()
        .chain(STRICT_DENIED_SYSCALLS)
        .any(|(n, _)| *n == name)
}

/// The name of system call `nr`, if some profile denies it.
pub fn denied_name(nr: i64) -> Option<&'static str> {
    DENIED_SYSCALLS
        .iter()
        .chain(STRICT_DENIED_SYSCALLS)
        .find(|&&(_, n)| n == nr)
        .map(|&(name, _)| name)
}

/// Every name `allow_syscalls` may take, for error messages.
pub fn deniable_names() -> String {
    DENIED_SYSCALLS
        .iter()
        .chain(STRICT_DENIED_SYSCALLS)
        .map(|(n, _)| *n)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Where the driver's new root is assembled (in its own mount namespace only).
const STAGE: &str = "/run/rebound-root";

/// System directories visible (read-only) under `strict`.
const SYSTEM_DIRS: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/proc", "/sys",
];

/// Device nodes visible to the driver (its `/dev` is otherwise an empty tmpfs; devices named
/// on its command line are added).
const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty", "fuse"];

/// Directories the driver gets its own of under both profiles: `/dev` (with [`DEVICES`]), and
/// empty `/dev/shm`, `/run` and `/tmp`.
const PRIVATE_DIRS: &[&str] = &["/dev", "/run", "/tmp"];

/// Directories of `/run` the resolver's configuration lives in (`/etc/resolv.conf` links
/// there on hosts with systemd-resolved or resolvconf): a network driver needs them.
const RESOLVER_DIRS: &[&str] = &["/run/systemd/resolve", "/run/resolvconf"];

/// How the driver being started relates to the mount it serves.
pub enum MountPoint<'a> {
    /// A first start: the mount point is not known yet (nor mounted).
    Unknown,
    /// A restart (or a standby's start): the mount point is not mounted in the driver's view,
    /// as at a first start. A driver that mounts through a helper is shown the mount once its
    /// mount(2) is answered (see `supervisor::intercept`).
    Hidden(&'a Path),
}

/// The sandbox of one driver start, the system calls its filter denies, and what the driver
/// was given (on its command line, in its environment) that its view hides.
pub struct DriverSandbox {
    pub sandbox: Sandbox,
    pub denied: Vec<u32>,
    pub hidden: Vec<Hidden>,
}

/// A path the driver's command line or environment names that its view does not show, and the
/// `[sandbox]` key that would show it: logged, so that a driver failing for want of it is
/// explained by rebound and not only by the driver's own puzzling error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hidden {
    pub path: PathBuf,
    /// Where the driver was given it: `None` for its command line, or an environment variable.
    pub variable: Option<String>,
}

impl Hidden {
    /// The key that shows it: what the command line names the driver may write (as
    /// `command_line_paths` would let it), what its environment names it may read.
    pub fn key(&self) -> &'static str {
        match self.variable {
            None => "writable_paths",
            Some(_) => "readable_paths",
        }
    }
}

impl std::fmt::Display for Hidden {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let named_by = match &self.variable {
            None => "the command line".to_string(),
            Some(var) => format!("${var}"),
        };
        write!(
            f,
            "{} (named by {named_by}) is hidden by the sandbox; `[sandbox] {} = [{:?}]` shows it",
            self.path.display(),
            self.key(),
            self.path
        )
    }
}

/// The sandbox of one driver start: `program` is what the driver's program is made of
/// ([`program::find`], found once per run), shown read-only wherever it is. `image_as`:
/// `(image, file)` shows `file` at the image's path, writable (a standby's spare, see
/// `supervisor::standby`); only with a view.
pub fn build(
    config: &Config,
    argv: &[OsString],
    program: &[program::Part],
    mountpoint: MountPoint<'_>,
    cgroup_procs: Vec<PathBuf>,
    image_as: Option<(&Path, &Path)>,
) -> anyhow::Result<DriverSandbox> {
    let settings = &config.sandbox;
    let limits = &config.limits;
    let mut sandbox = Sandbox {
        cgroup_procs: cgroup_procs.iter().map(|p| c_path(p)).collect(),
        ..Sandbox::default()
    };
    if limits.open_files != 0 {
        sandbox
            .rlimits
            .push((libc::RLIMIT_NOFILE, limits.open_files));
    }
    sandbox
        .rlimits
        .push((libc::RLIMIT_CORE, limits.core_mb.saturating_mul(1 << 20)));
    if settings.profile == Profile::Off {
        if image_as.is_some() {
            anyhow::bail!("a file shown at the image's path needs the sandbox's view");
        }
        return Ok(DriverSandbox {
            sandbox,
            denied: Vec::new(),
            hidden: Vec::new(),
        });
    }
    sandbox.new_network = !settings.network();
    sandbox.no_new_privs = true;
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
    // At a first start, where the driver will likely mount: the mount's, not the driver's.
    let guessed = match mountpoint {
        MountPoint::Unknown => likely_mountpoint(argv, &cwd),
        MountPoint::Hidden(_) => None,
    };
    let mounted = match mountpoint {
        MountPoint::Unknown => None,
        MountPoint::Hidden(m) => Some(m),
    };
    let (derived, serves) = derived_capabilities(argv, &cwd, mounted.or(guessed.as_deref()));
    let driver = known_driver(argv);
    // The mount point, which is not bound into the view. At a first start only a driver known
    // to refuse a mount point that is a mount (a bind is one) has its likely one left out: a
    // wrong guess would leave a directory the driver writes read-only.
    let known = mounted.or(guessed
        .as_deref()
        .filter(|_| driver.is_some_and(|d| d.refuses_a_mounted_mount_point)));
    let kept: Vec<&str> = match &settings.capabilities {
        Some(list) => list.iter().map(String::as_str).collect(),
        None => derived.to_vec(),
    };
    let learning = config.learn.is_some();
    if let (None, Some(dir), MountPoint::Unknown, false) =
        (&settings.capabilities, &serves, &mountpoint, learning)
    {
        tracing::info!(
            "the driver keeps {} to serve {} for every user, as it would as root outside \
             rebound (`[sandbox] capabilities` sets its own list)",
            derived.join(", "),
            dir.display()
        );
    }
    // Learning: every capability rebound has itself, to see which are used.
    let own = own_capabilities();
    let wanted = if learning {
        own
    } else {
        kept.into_iter()
            .chain(
                driver
                    .into_iter()
                    .flat_map(|d| d.capabilities.iter().copied()),
            )
            .filter_map(capability)
            .fold(0u64, |bits, cap| bits | 1 << cap)
    };
    // A capability rebound lacks (a container's root often has no CAP_SYS_RESOURCE or
    // CAP_LINUX_IMMUTABLE) cannot be passed on: capset(2) would fail the start. Without it the
    // driver has what it would have run directly here.
    let lacking = wanted & !own;
    if lacking != 0 && matches!(mountpoint, MountPoint::Unknown) {
        tracing::warn!(
            "rebound does not have {} itself (not in its permitted set), so the driver runs \
             without",
            capability_names(lacking).join(", ")
        );
    }
    sandbox.capabilities = Some(wanted & own);
    // Every path bound into the view, and whether the driver may write it; sorted, so that a
    // directory is bound before what lies below it.
    let mut grants: BTreeMap<PathBuf, bool> = BTreeMap::new();
    let mut grant = |path: PathBuf, writable: bool| {
        // The mount point is the mount's, not a path of the driver's; and a lookup in it
        // would wait for the driver being started.
        if known.is_none_or(|m| !path.starts_with(m)) {
            *grants.entry(path).or_default() |= writable;
        }
    };
    for path in &settings.readable_paths {
        grant(path.clone(), false);
    }
    for part in program {
        grant(part.path.clone(), false);
    }
    for path in &settings.writable_paths {
        grant(path.clone(), true);
    }
    for path in driver.map(|d| d.writable_paths()).unwrap_or_default() {
        grant(path, true);
    }
    if let Some(dir) = driver.and_then(|d| d.one_mount_dir(argv, &cwd)) {
        grant(dir, true);
    }
    if settings.command_line_paths {
        for path in command_line_paths(argv, &cwd, known) {
            grant(path, true);
        }
    }
    // A writable path inside another is bound with it: a bind of its own would be a mount
    // of its own, and a rename between the two would fail (EXDEV).
    let nested: Vec<PathBuf> = grants
        .iter()
        .filter(|&(path, &writable)| {
            writable
                && grants
                    .iter()
                    .any(|(outer, &w)| w && outer != path && path.starts_with(outer))
        })
        .map(|(path, _)| path.clone())
        .collect();
    for path in nested {
        grants.remove(&path);
    }
    // Reported at a first start only; a restart's would be the same.
    let hidden = match mountpoint {
        MountPoint::Unknown => hidden(
            settings.profile,
            &grants,
            argv,
            &cwd,
            known,
            &mut std::env::vars_os(),
        ),
        MountPoint::Hidden(_) => Vec::new(),
    };

    let stage = Path::new(STAGE);
    std::fs::create_dir_all(stage)?;
    let inside = |p: &Path| c_path(&stage.join(p.strip_prefix("/").unwrap_or(p)));
    let mut steps = Vec::new();
    match settings.profile {
        Profile::Default => {
            steps.push(Step::Bind {
                source: c"/".into(),
                target: c_path(stage),
                recursive: true,
            });
            // Before anything is mounted over them: a copy hidden under the private /tmp
            // would hold its connection as well as a visible one.
            steps.extend(detach_fuse_copies(&inside));
            steps.push(Step::ReadOnly {
                target: c_path(stage),
                recursive: true,
            });
            // What a read-only view does not protect is replaced: device nodes (a read-only
            // mount does not stop a write to a disk), and /run and /tmp with the host's
            // sockets (the system bus, container runtimes: uid 0 is root to them).
            private_dirs(&mut steps, &inside);
            // The rest of the view is the host's, read-only: only what is writable, or in a
            // private directory, needs a bind.
            for (path, &writable) in &grants {
                if writable || is_private(path) {
                    bind(&mut steps, &inside, path, writable, is_private(path));
                }
            }
        }
        Profile::Strict => {
            steps.push(Step::Tmpfs {
                target: c_path(stage),
                options: c"mode=0755,size=1m".into(),
            });
            for dir in SYSTEM_DIRS.iter().map(Path::new) {
                match std::fs::symlink_metadata(dir) {
                    Ok(meta) if meta.file_type().is_symlink() => {
                        if let Ok(target) = std::fs::read_link(dir) {
                            steps.push(Step::Symlink {
                                target: c_path(&target),
                                link: inside(dir),
                            });
                        }
                    }
                    Ok(_) => {
                        steps.push(Step::Dir(inside(dir)));
                        steps.push(Step::Bind {
                            source: c_path(dir),
                            target: inside(dir),
                            recursive: true,
                        });
                        steps.push(Step::ReadOnly {
                            target: inside(dir),
                            recursive: true,
                        });
                    }
                    Err(_) => {}
                }
            }
            private_dirs(&mut steps, &inside);
            for (path, &writable) in &grants {
                let shown = SYSTEM_DIRS.iter().any(|d| path.starts_with(d));
                if writable || !shown {
                    bind(&mut steps, &inside, path, writable, true);
                }
            }
        }
        Profile::Off => unreachable!("handled above"),
    }
    if let Some((image, file)) = image_as {
        let create = settings.profile == Profile::Strict || is_private(image);
        bind_from(&mut steps, &inside, file, image, true, create);
    }
    // The mount point, where the view does not have it: made (not mounted).
    if let Some(m) = known.filter(|m| settings.profile == Profile::Strict || is_private(m)) {
        for ancestor in ancestors(m) {
            steps.push(Step::Dir(inside(ancestor)));
        }
    }
    // Secrets root may read (the driver is still uid 0) are hidden behind /dev/null.
    for secret in secrets() {
        steps.push(Step::Bind {
            source: c"/dev/null".into(),
            target: inside(&secret),
            recursive: false,
        });
    }
    if settings.profile == Profile::Strict {
        steps.extend(detach_fuse_copies(&inside));
        steps.push(Step::ReadOnly {
            target: c_path(stage),
            recursive: false,
        });
    }
    sandbox.new_root = Some(NewRoot {
        root: c_path(stage),
        steps,
        cwd: c_path(&cwd),
    });

    let mut denied: Vec<u32> = DENIED_SYSCALLS
        .iter()
        .chain(if settings.profile == Profile::Strict {
            STRICT_DENIED_SYSCALLS
        } else {
            &[]
        })
        .filter(|(name, _)| !settings.allow_syscalls.iter().any(|a| a == name))
        .map(|&(_, nr)| nr as u32)
        .collect();
    denied.sort_unstable();
    denied.dedup();
    Ok(DriverSandbox {
        sandbox,
        denied,
        hidden,
    })
}

/// Copies of the host's FUSE mounts would keep their connections alive after the host
/// unmounts them (nothing propagates between the namespaces), even hidden under another
/// mount: they are detached, the driver's own mount among them (it is not mounted where the
/// driver starts).
fn detach_fuse_copies(inside: &impl Fn(&Path) -> CString) -> Vec<Step> {
    crate::paths::fuse_mounts()
        .unwrap_or_default()
        .into_iter()
        .map(|fuse_mount| Step::Detach(inside(&fuse_mount)))
        .collect()
}

/// Binds `path` (a file or a directory; missing ones are skipped) into the new root; under
/// `strict` (`create`) its place is made first.
fn bind(
    steps: &mut Vec<Step>,
    inside: &impl Fn(&Path) -> CString,
    path: &Path,
    writable: bool,
    create: bool,
) {
    bind_from(steps, inside, path, path, writable, create);
}

/// [`bind`] of `source`, shown at `path`.
fn bind_from(
    steps: &mut Vec<Step>,
    inside: &impl Fn(&Path) -> CString,
    source: &Path,
    path: &Path,
    writable: bool,
    create: bool,
) {
    let Ok(meta) = std::fs::metadata(source) else {
        return;
    };
    if create {
        if let Some(parent) = path.parent() {
            for ancestor in ancestors(parent) {
                steps.push(Step::Dir(inside(ancestor)));
            }
        }
        steps.push(if meta.is_dir() {
            Step::Dir(inside(path))
        } else {
            Step::File(inside(path))
        });
    }
    steps.push(Step::Bind {
        source: c_path(source),
        target: inside(path),
        recursive: meta.is_dir(),
    });
    if !writable {
        steps.push(Step::ReadOnly {
            target: inside(path),
            recursive: meta.is_dir(),
        });
    }
}

/// Whether `path` lies in one of the [`PRIVATE_DIRS`].
fn is_private(path: &Path) -> bool {
    PRIVATE_DIRS.iter().any(|dir| path.starts_with(dir))
}

/// The driver's own `/dev`, `/dev/shm`, `/run` and `/tmp` (see [`PRIVATE_DIRS`]).
fn private_dirs(steps: &mut Vec<Step>, inside: &impl Fn(&Path) -> CString) {
    let dev = Path::new("/dev");
    steps.push(Step::Dir(inside(dev)));
    steps.push(Step::Tmpfs {
        target: inside(dev),
        options: c"mode=0755,size=64k".into(),
    });
    for node in DEVICES {
        let path = dev.join(node);
        if path.exists() {
            steps.push(Step::File(inside(&path)));
            steps.push(Step::Bind {
                source: c_path(&path),
                target: inside(&path),
                recursive: false,
            });
        }
    }
    for (link, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        steps.push(Step::Symlink {
            target: c_path(Path::new(target)),
            link: inside(&dev.join(link)),
        });
    }
    for (dir, options) in [
        ("/dev/shm", c"mode=1777,size=64m"),
        ("/run", c"mode=0755"),
        ("/tmp", c"mode=1777"),
    ] {
        steps.push(Step::Dir(inside(Path::new(dir))));
        steps.push(Step::Tmpfs {
            target: inside(Path::new(dir)),
            options: options.into(),
        });
    }
    for dir in RESOLVER_DIRS.iter().map(Path::new) {
        bind(steps, inside, dir, false, true);
    }
}

/// `/a`, `/a/b`, `/a/b/c` for `/a/b/c`.
fn ancestors(path: &Path) -> Vec<&Path> {
    let mut all: Vec<&Path> = path.ancestors().filter(|a| a.parent().is_some()).collect();
    all.reverse();
    all
}

/// What the command line and the environment `env` name that the view of `profile` with
/// `grants` bound will not show (see [`Hidden`]). Only before the first mount: a path in the
/// mount point would wait for this driver.
fn hidden(
    profile: Profile,
    grants: &BTreeMap<PathBuf, bool>,
    argv: &[OsString],
    cwd: &Path,
    mountpoint: Option<&Path>,
    env: &mut dyn Iterator<Item = (OsString, OsString)>,
) -> Vec<Hidden> {
    let visible = |path: &Path| {
        if grants.keys().any(|g| path.starts_with(g)) {
            return true;
        }
        if let Ok(rest) = path.strip_prefix("/dev") {
            return rest.starts_with("fd")
                || DEVICES.iter().any(|d| rest == Path::new(d))
                || RESOLVER_DIRS.iter().any(|d| path.starts_with(d));
        }
        match profile {
            Profile::Strict => SYSTEM_DIRS.iter().any(|d| path.starts_with(d)),
            _ => !is_private(path) || RESOLVER_DIRS.iter().any(|d| path.starts_with(d)),
        }
    };
    let mut out: Vec<Hidden> = Vec::new();
    for (path, _) in named_paths(argv, cwd, mountpoint) {
        if !visible(&path) {
            out.push(Hidden {
                path,
                variable: None,
            });
        }
    }
    for (var, value) in env {
        // The shell's own bookkeeping, not something given to the driver.
        if ["PWD", "OLDPWD", "_"].iter().any(|v| var == *v) {
            continue;
        }
        for entry in value.as_bytes().split(|&b| b == b':') {
            let path = Path::new(OsStr::from_bytes(entry));
            if !path.is_absolute() || !path.exists() {
                continue;
            }
            let path = normalize(path);
            if !visible(&path) && out.iter().all(|h| h.path != path) {
                out.push(Hidden {
                    path,
                    variable: Some(var.to_string_lossy().into_owned()),
                });
            }
        }
    }
    out
}

/// Files that hold the host's secrets and that no driver needs: password hashes and the SSH
/// server's private keys.
fn secrets() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = [
        "/etc/shadow",
        "/etc/shadow-",
        "/etc/gshadow",
        "/etc/gshadow-",
    ]
    .iter()
    .map(PathBuf::from)
    .collect();
    if let Ok(dir) = std::fs::read_dir("/etc/ssh") {
        files.extend(dir.flatten().map(|e| e.path()).filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("ssh_host_") && n.ends_with("_key"))
        }));
    }
    files.retain(|f| f.is_file());
    files
}

fn c_path(path: &Path) -> CString {
    // Paths from the OS or the config file hold no NUL byte.
    CString::new(path.as_os_str().as_bytes()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ancestors_run_from_the_top() {
        assert_eq!(
            ancestors(Path::new("/a/b")),
            [Path::new("/a"), Path::new("/a/b")]
        );
    }

    #[test]
    fn what_the_view_hides_is_reported_with_the_key_that_shows_it() {
        let dir = std::env::temp_dir().join(format!("rebound-hidden-{}", std::process::id()));
        let (shown, hid) = (dir.join("shown"), dir.join("hid"));
        std::fs::create_dir_all(&shown).unwrap();
        std::fs::create_dir_all(&hid).unwrap();
        let grants = BTreeMap::from([(shown.clone(), true)]);
        let argv: Vec<OsString> = vec![
            "drv".into(),
            format!("source={},x=/etc", hid.display()).into(),
            shown.join(".").into(),
        ];
        let mut env = vec![
            ("SOCK_DIR".into(), format!("/usr:{}", hid.display()).into()),
            ("PWD".into(), dir.clone().into()),
        ]
        .into_iter();
        let found = hidden(
            Profile::Default,
            &grants,
            &argv,
            Path::new("/"),
            None,
            &mut env,
        );
        assert_eq!(
            found,
            [Hidden {
                path: hid.clone(),
                variable: None,
            }]
        );
        let mut env = vec![("SOCK_DIR".into(), hid.clone().into())].into_iter();
        let found = hidden(
            Profile::Strict,
            &grants,
            &argv[..1],
            Path::new("/"),
            None,
            &mut env,
        );
        assert_eq!(found.len(), 1);
        assert_eq!(
            (found[0].variable.as_deref(), found[0].key()),
            (Some("SOCK_DIR"), "readable_paths")
        );
        assert!(
            found[0].to_string().contains("readable_paths = ["),
            "{}",
            found[0]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_scratch_directory_in_dev_shm_is_the_drivers() {
        let dir = PathBuf::from(format!("/dev/shm/rebound-cl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let argv: Vec<OsString> = vec!["drv".into(), dir.clone().into(), "/dev/null".into()];
        assert_eq!(
            command_line_paths(&argv, Path::new("/"), None),
            std::slice::from_ref(&dir)
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn every_denied_call_is_known_to_the_config() {
        assert!(deniable("reboot") && deniable("unshare") && !deniable("read"));
    }
}
