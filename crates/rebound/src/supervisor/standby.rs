//! A standby successor (MINIX 3's reincarnation server keeps what a restart needs ready; ODFT
//! restores an initialised driver): a second driver process, started while the first one
//! serves, in the sandbox and cgroup a restart would give it, that runs until its FUSE
//! `mount(2)` and is held there, unanswered. A recovery answers that call with a channel to
//! the kernel's mount, and the successor serves at once: its process start, libraries, cgroup
//! migration and its own set-up (an SSH session, a source directory opened) were paid before
//! the failure.
//!
//! Owns: whether a standby can be correct for a driver, the standby's calls until it is held,
//! its death before use and the pace of replacing it. Must not: start it (the supervisor's
//! `start_driver` does, as for a restart) or answer its held mount (`intercept` does, at the
//! hand-over, as for any restarted driver).

use std::ffi::OsString;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rebound_sys::seccomp::{self, Notification};
use rustix::process::Signal;

use super::{process, start_driver, Phase, Run, Step};
use crate::cgroup::DriverCgroup;
use crate::config::{Config, Profile, StandbyPolicy};
use crate::sandbox::MountPoint;
use crate::supervisor::intercept;

/// Drivers that read their writable store into memory when they start (an image's bitmaps,
/// inode tables, an archive's index): a successor started before a failure would serve a
/// copy of the store as it was then, and write it back over what the serving driver wrote.
const READS_STORE_AT_START: &[&str] = &[
    "fuse2fs",
    "fuse-ext2",
    "ntfs-3g",
    "lowntfs-3g",
    "mount.ntfs",
    "mount.ntfs-3g",
    "mount.lowntfs-3g",
    "exfat-fuse",
    "mount.exfat-fuse",
    "archivemount",
];

/// The longest wait before a standby that died unused is replaced.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(60);

/// Why no standby is kept for this run, or `None` when one is.
pub fn not_wanted(config: &Config, argv: &[OsString]) -> Option<String> {
    match config.standby {
        StandbyPolicy::Off => return Some("standby = \"off\"".into()),
        StandbyPolicy::On => return None,
        StandbyPolicy::Auto => {}
    }
    if config.restart_budget == 0 {
        return Some("restart_budget = 0".into());
    }
    if !config.pre_restart.is_empty() {
        return Some(
            "pre_restart repairs the store after a failure, under a successor that \
                     would have opened it before"
                .into(),
        );
    }
    if config.image.is_some() {
        return Some(
            "the image is rolled back after a failure, under a successor that would have \
             read it before"
                .into(),
        );
    }
    let program = Path::new(argv.first()?).file_name()?.to_string_lossy();
    READS_STORE_AT_START
        .contains(&program.as_ref())
        .then(|| format!("{program} reads its writable store at start"))
}

/// A standby driver, from its start until it takes over or dies.
pub struct Standby {
    /// The process rebound started (the leader of its session).
    pub pid: i32,
    /// Its seccomp listener, polled beside the serving driver's.
    pub listener: OwnedFd,
    pub logger: JoinHandle<()>,
    /// What its stderr lines are prefixed with: "MOUNTPOINT (standby)" until it takes over.
    pub label: Arc<Mutex<String>>,
    /// Its FUSE `mount(2)`, held unanswered until the hand-over.
    pub held: Option<Notification>,
    pub started: Instant,
}

impl Standby {
    /// One intercepted call of the standby. Its FUSE mount of `mountpoint` is held; any other
    /// FUSE mount is refused (`EBUSY`: the run serves one mount); the rest is handled as for
    /// a serving driver. `is_driver` as for [`intercept::handle`].
    pub fn on_call(&mut self, mountpoint: &Path, sandboxed: bool, is_driver: impl Fn(i32) -> bool) {
        let Ok(notif) = seccomp::receive(self.listener.as_fd()) else {
            return;
        };
        if i64::from(notif.data.nr) == seccomp::NR_MOUNT {
            match intercept::fuse_mount_target(&notif) {
                Some(target) if target == mountpoint => {
                    tracing::info!(
                        "standby driver (pid {}) is ready, {:.0} ms after its start",
                        self.pid,
                        self.started.elapsed().as_secs_f64() * 1e3
                    );
                    self.held = Some(notif);
                    return;
                }
                Some(target) => {
                    tracing::warn!(
                        "standby driver asked for a FUSE mount on {}, not {}; refused",
                        target.display(),
                        mountpoint.display()
                    );
                    let busy = rustix::io::Errno::BUSY.raw_os_error();
                    let _ = seccomp::respond(self.listener.as_fd(), notif.id, -1, busy);
                    return;
                }
                None => {}
            }
        }
        intercept::handle(self.listener.as_fd(), &notif, None, sandboxed, is_driver);
    }

    /// Whether its held mount can still be answered (the caller still waits in it).
    pub fn ready(&self) -> bool {
        self.held
            .is_some_and(|n| seccomp::id_valid(self.listener.as_fd(), n.id))
    }
}

impl Run<'_> {
    pub(super) fn standby_pid(&self) -> Option<i32> {
        self.standby.as_ref().map(|s| s.pid)
    }

    /// While the driver serves: starts a standby successor if the run keeps one, none is
    /// there, and the pace allows.
    pub(super) fn keep_standby(&mut self, now: Instant) {
        if self.standby.is_some()
            || self.standby_not_wanted.is_some()
            || !self.standby_pace.due(now)
        {
            return;
        }
        let Some(s) = &self.served else {
            return;
        };
        // The view a restarted driver gets (see `start_driver`).
        let view = if s.mounted_by_helper {
            MountPoint::Visible(&s.mountpoint)
        } else {
            MountPoint::Hidden(&s.mountpoint)
        };
        let label = Arc::new(Mutex::new(format!("{} (standby)", s.mountpoint.display())));
        let started = start_driver(
            self.config,
            self.argv,
            &self.program,
            view,
            self.cgroup.as_ref(),
            label.clone(),
        );
        match started {
            Ok((pid, listener, logger, _)) => {
                tracing::debug!("started a standby driver as pid {pid}");
                self.standby = Some(Standby {
                    pid,
                    listener,
                    logger,
                    label,
                    held: None,
                    started: now,
                });
            }
            Err(e) => {
                let delay = self.standby_pace.failed(now);
                tracing::warn!("cannot start a standby driver: {e:#}; next try in {delay:?}");
            }
        }
    }

    pub(super) fn on_standby_call(&mut self) {
        let Some(mountpoint) = self.served.as_ref().map(|s| s.mountpoint.clone()) else {
            return;
        };
        let sandboxed = self.config.sandbox.profile != Profile::Off;
        let cgroup = self.cgroup.as_ref();
        let Some(standby) = &mut self.standby else {
            return;
        };
        let was_held = standby.held.is_some();
        standby.on_call(&mountpoint, sandboxed, |tgid| {
            cgroup
                .map_or_else(process::descendants, DriverCgroup::processes)
                .contains(&tgid)
        });
        if !was_held && standby.held.is_some() {
            let pid = standby.pid;
            self.standby_pace.succeeded();
            self.board.update(|b| b.standby_pid = Some(pid));
        }
    }

    /// Ends the standby: it died or its processes ended (`died`: the next one waits, see
    /// [`StandbyPace`]), or the run stops.
    pub(super) fn drop_standby(&mut self, why: &str, died: bool) {
        let Some(standby) = self.standby.take() else {
            return;
        };
        for pid in process::tree_of(standby.pid) {
            if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(pid, Signal::KILL);
            }
        }
        self.stderr_loggers.push(standby.logger);
        self.board.update(|b| b.standby_pid = None);
        if died {
            let delay = self.standby_pace.failed(Instant::now());
            tracing::warn!(
                "the standby driver (pid {}) ended before it was needed: {why}; the next one \
                 starts in {delay:?}",
                standby.pid
            );
        } else {
            tracing::debug!("standby driver (pid {}) stopped: {why}", standby.pid);
        }
    }

    /// At a restart: the standby, if there is one, becomes the driver, and its held mount is
    /// answered with a channel to the kernel's mount. Returns whether it did.
    pub(super) fn promote_standby(&mut self, now: Instant) -> anyhow::Result<bool> {
        let Some(standby) = self.standby.take_if(|s| s.held.is_none() || s.ready()) else {
            self.drop_standby("its mount(2) was abandoned", true);
            return Ok(false);
        };
        let waited_ms = standby.started.elapsed().as_secs_f64() * 1e3;
        tracing::info!(
            "standby driver (pid {}, started {waited_ms:.0} ms ago) takes over",
            standby.pid
        );
        self.watch.driver_started(self.cgroup.as_ref());
        let label = self
            .log_label
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        *standby.label.lock().unwrap_or_else(|e| e.into_inner()) = label;
        self.stderr_loggers.push(standby.logger);
        self.listener = standby.listener;
        self.listener_open = true;
        self.driver_pid = standby.pid;
        self.driver_exit = None;
        self.board.update(|b| {
            b.driver_pid = Some(standby.pid);
            b.standby_pid = None;
            b.standby_takeovers += 1;
        });
        self.phase = Phase::Recovering(Step::Mounting {
            deadline: now + self.config.mount_timeout(),
        });
        if let Some(s) = &self.served {
            s.proxy.shadow_requests_of_own_processes();
        }
        if let Some(held) = standby.held {
            self.on_intercepted(&held)?;
        }
        Ok(true)
    }
}

/// When the next standby may start: at once, unless standbys have been dying unused, then
/// after 1 s, 2 s, 4 s, ... up to a minute (a driver that cannot run twice, a server that
/// refuses a second session, must not be started in a loop).
#[derive(Debug)]
pub struct StandbyPace {
    failures: u32,
    next_at: Instant,
}

impl StandbyPace {
    pub fn new() -> StandbyPace {
        StandbyPace {
            failures: 0,
            next_at: Instant::now(),
        }
    }

    pub fn due(&self, now: Instant) -> bool {
        now >= self.next_at
    }

    /// A standby reached its mount: the next one may start at once.
    pub fn succeeded(&mut self) {
        self.failures = 0;
    }

    /// A standby died before it was needed; returns how long until the next.
    pub fn failed(&mut self, now: Instant) -> Duration {
        self.failures = self.failures.saturating_add(1);
        let delay = Duration::from_secs(1)
            .saturating_mul(1 << (self.failures - 1).min(6))
            .min(MAX_RETRY_DELAY);
        self.next_at = now + delay;
        delay
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_drivers_and_repaired_stores_get_no_standby() {
        let argv = |p: &str| vec![OsString::from(p), "x".into()];
        let mut config = Config::default();
        assert!(not_wanted(&config, &argv("/usr/bin/sshfs")).is_none());
        assert!(not_wanted(&config, &argv("/usr/sbin/fuse2fs")).is_some());
        config.standby = StandbyPolicy::On;
        assert!(not_wanted(&config, &argv("fuse2fs")).is_none());
        config.standby = StandbyPolicy::Auto;
        config.pre_restart = vec!["e2fsck".into()];
        assert!(not_wanted(&config, &argv("passthrough_ll")).is_some());
        config.pre_restart.clear();
        config.standby = StandbyPolicy::Off;
        assert!(not_wanted(&config, &argv("passthrough_ll")).is_some());
    }

    #[test]
    fn standbys_dying_unused_are_replaced_ever_more_slowly() {
        let mut pace = StandbyPace::new();
        let now = Instant::now();
        assert!(pace.due(now));
        assert_eq!(pace.failed(now), Duration::from_secs(1));
        assert!(!pace.due(now));
        assert_eq!(pace.failed(now), Duration::from_secs(2));
        for _ in 0..10 {
            pace.failed(now);
        }
        assert_eq!(pace.failed(now), MAX_RETRY_DELAY);
        pace.succeeded();
        assert_eq!(pace.failed(now), Duration::from_secs(1));
    }
}
