//! `mount.rebound`: the helper `mount(8)` runs for `mount -t rebound.DRIVER` and fstab lines
//! of that type, so a driver under rebound mounts like any other file system.
//!
//! `mount(8)` calls `/sbin/mount.rebound SPEC DIR [-sfnv] [-N NS] [-o OPTIONS] [-t TYPE]`
//! (a link to the `rebound` binary; libmount tries `mount.rebound.fuse2fs`, then drops the
//! subtype). The driver's command line is built as `mount.fuse` builds it: `DRIVER SPEC DIR
//! -o OPTIONS` (no SPEC when it is `none`), with the options only `mount(8)` and systemd read
//! removed. Options for rebound itself: `config=FILE` (its `--config`), `driver=PROGRAM`
//! (instead of the subtype), `log=FILE` (where the run logs; by default
//! `/var/log/rebound/MOUNTPOINT.log`). The helper starts `rebound run` in the background and
//! returns once the mount serves, or with the run's last log lines and status 32 (mount
//! failure) if it ends first.
//!
//! Owns: the helper's argument syntax, the driver command line it makes, waiting for the mount.
//! Must not: serve the mount (the `rebound run` it starts does).

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use crate::config::Config;
use crate::control;

/// `mount(8)`'s status for a mount that failed, and for bad usage.
const MOUNT_FAILURE: u8 = 32;
const USAGE: u8 = 1;

/// Options `mount(8)`, fstab and systemd read, which no driver is given (as `mount.fuse`).
const MOUNT_ONLY: &[&str] = &[
    "defaults", "auto", "noauto", "nofail", "user", "nouser", "users", "owner", "group", "_netdev",
    "netdev",
];
const MOUNT_ONLY_PREFIXES: &[&str] = &["x-", "comment="];
/// systemd's default `PATH`, for a helper started without one.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// What a helper invocation asks for.
#[derive(Debug, PartialEq)]
pub struct HelperMount {
    /// `rebound run`'s arguments: `[--config FILE] -- DRIVER...`.
    pub run_args: Vec<OsString>,
    pub mountpoint: PathBuf,
    /// Where the run logs.
    pub log: PathBuf,
    /// `-f`: everything but the mount.
    pub fake: bool,
    /// The run's config, for its mount timeout.
    pub config: Option<PathBuf>,
}

/// Whether this process was started as the mount helper (by the name it was run under).
pub fn invoked_as_helper() -> bool {
    std::env::args_os()
        .next()
        .and_then(|arg0| {
            Path::new(&arg0)
                .file_name()
                .map(|n| n.to_string_lossy().starts_with("mount.rebound"))
        })
        .unwrap_or(false)
}

/// Runs the helper with `args` (without argv[0]).
pub fn main(args: &[OsString]) -> ExitCode {
    let helper = match parse(args) {
        Ok(helper) => helper,
        Err(message) => {
            eprintln!("mount.rebound: {message}");
            eprintln!(
                "usage: mount -t rebound.DRIVER SPEC DIR -o [config=FILE,][driver=PROGRAM,]OPTIONS"
            );
            return ExitCode::from(USAGE);
        }
    };
    if helper.fake {
        return ExitCode::SUCCESS;
    }
    match start(&helper) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("mount.rebound: {}: {message}", helper.mountpoint.display());
            ExitCode::from(MOUNT_FAILURE)
        }
    }
}

/// Parses `SPEC DIR [-sfnv] [-N NS] [-o OPTIONS] [-t TYPE]`.
pub fn parse(args: &[OsString]) -> Result<HelperMount, String> {
    let mut positional = Vec::new();
    let (mut options, mut fstype, mut fake) = (Vec::<String>::new(), None::<String>, false);
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.to_str() {
            Some("-o") => {
                let value = args.next().ok_or("-o needs options")?;
                options.extend(text(value)?.split(',').map(str::to_string));
            }
            Some("-t") => fstype = Some(text(args.next().ok_or("-t needs a type")?)?.into()),
            Some("-N") => {
                args.next().ok_or("-N needs a namespace")?;
                return Err("-N (another mount namespace) is not supported".into());
            }
            Some(flags) if flags.starts_with('-') && flags.len() > 1 => {
                for flag in flags[1..].chars() {
                    match flag {
                        'f' => fake = true,
                        's' | 'n' | 'v' => {}
                        other => return Err(format!("unknown option -{other}")),
                    }
                }
            }
            _ => positional.push(arg.clone()),
        }
    }
    let [spec, dir] = &positional[..] else {
        return Err(format!(
            "expected a source and a mount point, got {} arguments",
            positional.len()
        ));
    };
    let mut driver = fstype
        .as_deref()
        .and_then(|t| t.split_once('.'))
        .map(|(_, subtype)| subtype.to_string());
    let (mut config, mut log, mut kept) = (None, None, Vec::new());
    for option in options.into_iter().filter(|o| !o.is_empty()) {
        match option.split_once('=') {
            Some(("config", file)) => config = Some(PathBuf::from(file)),
            Some(("driver", program)) => driver = Some(program.to_string()),
            Some(("log", file)) => log = Some(PathBuf::from(file)),
            _ if MOUNT_ONLY.contains(&option.as_str())
                || MOUNT_ONLY_PREFIXES.iter().any(|p| option.starts_with(p)) => {}
            _ => kept.push(option),
        }
    }
    let driver = driver.ok_or("no driver: give the type as rebound.DRIVER, or driver=PROGRAM")?;
    let mountpoint = std::path::absolute(Path::new(dir))
        .map_err(|e| format!("{}: {e}", Path::new(dir).display()))?;
    let mut run_args: Vec<OsString> = Vec::new();
    if let Some(config) = &config {
        run_args.extend(["--config".into(), config.clone().into_os_string()]);
    }
    run_args.extend(["--".into(), driver.into()]);
    if spec != "none" {
        run_args.push(spec.clone());
    }
    run_args.push(mountpoint.clone().into_os_string());
    if !kept.is_empty() {
        run_args.extend(["-o".into(), kept.join(",").into()]);
    }
    let log = log.unwrap_or_else(|| default_log(&mountpoint));
    Ok(HelperMount {
        run_args,
        mountpoint,
        log,
        fake,
        config,
    })
}

fn text(arg: &OsString) -> Result<&str, String> {
    arg.to_str()
        .ok_or_else(|| format!("{}: not UTF-8", arg.to_string_lossy()))
}

/// `/var/log/rebound/<mount point with / as ->.log`, as systemd names mount units.
fn default_log(mountpoint: &Path) -> PathBuf {
    let name = mountpoint
        .to_string_lossy()
        .trim_matches('/')
        .replace('/', "-");
    let name = if name.is_empty() { "-".into() } else { name };
    PathBuf::from("/var/log/rebound").join(format!("{name}.log"))
}

/// Starts `rebound run` in the background, logging to the helper's log file, and waits until
/// it serves the mount point.
fn start(helper: &HelperMount) -> Result<(), String> {
    let timeout = match &helper.config {
        Some(file) => Config::load(file)?.mount_timeout(),
        None => Config::default().mount_timeout(),
    } + Duration::from_secs(5);
    if let Some(dir) = helper.log.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&helper.log)
        .map_err(|e| format!("{}: {e}", helper.log.display()))?;
    let log_start = log.metadata().map(|m| m.len()).unwrap_or(0);
    let me = std::env::current_exe().map_err(|e| format!("finding rebound: {e}"))?;
    // mount(8) runs its helpers with an empty environment; the driver is found as a service
    // manager would find it.
    let path = std::env::var_os("PATH").unwrap_or_else(|| DEFAULT_PATH.into());
    let mut run = Command::new(me)
        .arg("run")
        .args(&helper.run_args)
        .env("PATH", path)
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(|e| e.to_string())?)
        .stderr(log)
        // Out of the caller's process group: a terminal's ^C is not for it.
        .process_group(0)
        .spawn()
        .map_err(|e| format!("starting rebound run: {e}"))?;
    let deadline = Instant::now() + timeout;
    loop {
        if let Some((_, status)) = control::find_run(&control::run_dir(), &helper.mountpoint) {
            if status.ready && status.rebound_pid == run.id() {
                return Ok(());
            }
        }
        match run.try_wait() {
            Ok(Some(exit)) => {
                return Err(format!(
                    "rebound run ended ({exit}) before the mount served:\n{}",
                    log_tail(&helper.log, log_start)
                ))
            }
            Ok(None) if Instant::now() >= deadline => {
                return Err(format!(
                    "not serving after {} s; rebound run (pid {}) logs to {}",
                    timeout.as_secs(),
                    run.id(),
                    helper.log.display()
                ))
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("waiting for rebound run: {e}")),
        }
    }
}

/// The last lines the run wrote to its log since `from`.
fn log_tail(log: &Path, from: u64) -> String {
    let text = std::fs::read(log).unwrap_or_default();
    let text = String::from_utf8_lossy(text.get(from as usize..).unwrap_or_default());
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(10)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<OsString> {
        line.split_whitespace().map(OsString::from).collect()
    }

    fn run_args(helper: &HelperMount) -> Vec<String> {
        helper
            .run_args
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn an_fstab_line_for_fuse2fs_becomes_its_command_line() {
        let helper = parse(&args(
            "/srv/disk.img /mnt/disk -o rw,fakeroot,config=/etc/rebound/disk.toml,nofail,x-systemd.automount -t rebound.fuse2fs",
        ))
        .unwrap();
        assert_eq!(
            run_args(&helper),
            [
                "--config",
                "/etc/rebound/disk.toml",
                "--",
                "fuse2fs",
                "/srv/disk.img",
                "/mnt/disk",
                "-o",
                "rw,fakeroot"
            ]
        );
        assert_eq!(helper.log, PathBuf::from("/var/log/rebound/mnt-disk.log"));
        assert!(!helper.fake);
    }

    #[test]
    fn a_driver_without_a_source_and_one_named_by_option() {
        let helper = parse(&args(
            "none /mnt/data -n -o driver=/usr/local/bin/passthrough_ll,source=/data,log=/tmp/l -t rebound",
        ))
        .unwrap();
        assert_eq!(
            run_args(&helper),
            [
                "--",
                "/usr/local/bin/passthrough_ll",
                "/mnt/data",
                "-o",
                "source=/data"
            ]
        );
        assert_eq!(helper.log, PathBuf::from("/tmp/l"));
    }

    #[test]
    fn bad_usage_is_named() {
        let err = parse(&args("/mnt/only -t rebound.sshfs")).unwrap_err();
        assert!(err.contains("a source and a mount point"), "{err}");
        let err = parse(&args("a /mnt -t rebound")).unwrap_err();
        assert!(err.contains("no driver"), "{err}");
        let err = parse(&args("a /mnt -x -t rebound.sshfs")).unwrap_err();
        assert!(err.contains("-x"), "{err}");
    }
}
