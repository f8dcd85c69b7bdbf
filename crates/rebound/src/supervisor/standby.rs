//! A standby successor (MINIX 3's reincarnation server keeps what a restart needs ready; ODFT
//! restores an initialised driver): a second driver process, started while the first one
//! serves, in the sandbox a restart would give it. Its FUSE `mount(2)` is answered at once
//! with a channel of its own that stays silent until a failure: the standby goes on with what
//! drivers do after mounting (sshfs opens its SSH session only then, libfuse daemonizes) and
//! reads its channel. rebound then gives it the kernel's INIT (replayed), so that what a driver
//! does at INIT (securefs derives its key there) is done too. A recovery hands that channel to
//! the proxy, and the successor serves at once: its process start, libraries, cgroup, its own
//! set-up and its INIT were paid before the failure.
//!
//! The standby runs in a cgroup of its own, which becomes the driver's at the hand-over (the
//! two swap): that is how its processes are told from the driver's once it has daemonized.
//! Without that cgroup, its mount is held unanswered instead, and what drivers do after
//! mounting is left for the hand-over.
//!
//! A driver whose image is rolled back after a failure (`image`) cannot start before the
//! failure on the image itself; its standby runs on a *spare*, a clone of the last checkpoint
//! shown to it at the image's path, and is brought forward at the hand-over by the redo log's
//! changes since that checkpoint (kept for it), while the spare is renamed over the image.
//! Once it has answered its INIT, the proxy gives it every acknowledged change a batch later
//! (`proxy::checkpoints::follow`), so that the hand-over replays only the last few.
//!
//! Owns: whether a standby can be correct for a driver, the standby's calls until it waits
//! for its INIT, which processes are its, its death before use and the pace of replacing it.
//! Must not: start it (the supervisor's `start_driver` does, as for a restart) or restore it
//! (the proxy does, as for any restarted driver).

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
use crate::supervisor::process::Exit;

/// Drivers that read their writable store into memory when they start (an image's bitmaps,
/// inode tables, an archive's index; fuse-overlayfs caches each directory of its layers from
/// the first look, its root's at start): a successor started before a failure would serve a
/// copy of the store as it was then (fuse-overlayfs: a file created since is not found), and
/// write it back over what the serving driver wrote.
const READS_STORE_AT_START: &[&str] = &[
    "fuse-overlayfs",
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

/// A spare's standby does not take over when it lacks this many more logged changes than a
/// driver on the image rolled back to the last checkpoint would (it could not be brought
/// forward yet: its INIT not answered): replaying them (~0.3 ms each for fuse2fs) would take
/// longer than the roll-back and the driver's start it saves (~12 ms).
const SPARE_EXTRA_MAX: usize = 32;

/// What kind of standby successor a run keeps.
#[derive(Debug, PartialEq, Eq)]
pub enum StandbyKind {
    /// One that runs until it waits for its INIT (see the module doc).
    Initialised,
    /// One held before `exec`, confined, filtered and in its cgroup, with nothing of the
    /// driver run yet: for a driver that must not open its store before the failure (the
    /// reason given). Its start pays only for the program itself.
    BeforeExec(String),
    /// An initialised one on a spare of the image's last checkpoint (see the module doc).
    Spare,
}

/// The standby this run keeps, or why it keeps none.
pub fn kind(config: &Config, argv: &[OsString]) -> Result<StandbyKind, String> {
    match config.standby {
        StandbyPolicy::Off => return Err("standby = \"off\"".into()),
        // (`image` with the sandbox off is refused for "on" by the config's check.)
        StandbyPolicy::On if config.image.is_some() => return Ok(StandbyKind::Spare),
        StandbyPolicy::On => return Ok(StandbyKind::Initialised),
        StandbyPolicy::Auto => {}
    }
    if config.restart_budget == 0 {
        return Err("restart_budget = 0".into());
    }
    let before_exec = |why: String| Ok(StandbyKind::BeforeExec(why));
    if !config.pre_restart.is_empty() {
        return before_exec("pre_restart repairs the store after a failure".into());
    }
    if config.image.is_some() {
        if config.sandbox.profile == Profile::Off {
            return before_exec(
                "the image is rolled back after a failure, and without the sandbox's view a \
                 spare of it cannot be shown at its path"
                    .into(),
            );
        }
        return Ok(StandbyKind::Spare);
    }
    let program = Path::new(argv.first().ok_or("no driver")?)
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default();
    if READS_STORE_AT_START.contains(&program.as_str()) {
        return before_exec(format!("{program} reads its writable store at start"));
    }
    Ok(StandbyKind::Initialised)
}

/// The standby's own cgroup, beside the driver's `driver` and with the same limits; `None`
/// when the driver has none or it cannot be made (the standby then shares the driver's, and
/// its mount is held unanswered).
pub fn cgroup(config: &Config, driver: Option<&DriverCgroup>) -> Option<DriverCgroup> {
    driver?;
    // Not named for its role: the run's two cgroups swap roles at each takeover.
    let name = format!("{}-2", std::process::id());
    match DriverCgroup::create(&name, &config.limits) {
        Ok(cgroup) => cgroup,
        Err(e) => {
            tracing::warn!(
                "cannot create the standby's cgroup ({e}): its mount waits unanswered, and \
                 its set-up after mounting is left for the hand-over"
            );
            None
        }
    }
}

/// A standby driver, from its start until it takes over or dies.
pub struct Standby {
    /// The process rebound started (the leader of its session), then the daemon it became.
    pub pid: i32,
    /// Its seccomp listener, polled beside the serving driver's.
    pub listener: OwnedFd,
    pub logger: JoinHandle<()>,
    /// What its stderr lines are prefixed with: "MOUNTPOINT (standby)" until it takes over.
    pub label: Arc<Mutex<String>>,
    pub mount: StandbyMount,
    /// A standby held before `exec`: one byte written here lets it run.
    pub gate: Option<OwnedFd>,
    pub started: Instant,
    /// The number of the checkpoint whose spare it runs on.
    pub spare: Option<u64>,
    /// A spare's standby that answered its INIT is brought forward by the proxy, which reads
    /// its channel from then on: its INIT exchange, kept for the hand-over.
    pub followed: Option<Result<(u64, Vec<u8>), String>>,
}

/// Where a standby's FUSE `mount(2)` of the mount point stands.
pub enum StandbyMount {
    /// It has not called it yet.
    Pending,
    /// Held unanswered until the hand-over (without a cgroup of its own: see the module doc).
    Held(Notification),
    /// Answered with a channel that carries nothing but the INIT until the hand-over.
    Attached {
        /// rebound's end.
        channel: OwnedFd,
        /// The inode of the standby's end.
        channel_inode: u64,
        /// The process that called `mount(2)`.
        caller: u32,
        /// The kernel's INIT, given to it: its unique, and the exchange under way.
        init: Option<(u64, JoinHandle<std::io::Result<Vec<u8>>>)>,
    },
}

/// Sends `request` (an INIT) on `channel` and returns the reply, waiting at most `timeout`.
fn exchange_init(
    channel: OwnedFd,
    request: Vec<u8>,
    timeout: Duration,
) -> std::io::Result<Vec<u8>> {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let sent = Instant::now();
    rustix::net::send(&channel, &request, rustix::net::SendFlags::NOSIGNAL)?;
    let mut fds = [PollFd::new(&channel, PollFlags::IN)];
    let limit = Timespec::try_from(timeout).map_err(std::io::Error::other)?;
    if poll(&mut fds, Some(&limit))? == 0 {
        return Err(std::io::ErrorKind::TimedOut.into());
    }
    let mut reply = vec![0u8; 4096];
    let (len, _) = rustix::net::recv(&channel, &mut reply, rustix::net::RecvFlags::DONTWAIT)?;
    reply.truncate(len);
    tracing::info!(
        "standby driver answered INIT, {:.1} ms after it was sent",
        sent.elapsed().as_secs_f64() * 1e3
    );
    Ok(reply)
}

impl Standby {
    /// One intercepted call of the standby. Its FUSE mount of `mountpoint` is answered with
    /// a silent channel (`attach`) or held; any other FUSE mount is refused (`EBUSY`: the run
    /// serves one mount); the rest is handled as for a serving driver. `modes` and
    /// `is_driver` as for [`intercept::handle`].
    pub fn on_call(
        &mut self,
        mountpoint: &Path,
        attach: bool,
        modes: (bool, bool),
        is_driver: impl Fn(i32) -> bool,
    ) {
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
                    if !attach {
                        self.mount = StandbyMount::Held(notif);
                        return;
                    }
                    match intercept::attach_standby(self.listener.as_fd(), &notif) {
                        Ok(Some((channel, channel_inode))) => {
                            self.mount = StandbyMount::Attached {
                                channel,
                                channel_inode,
                                caller: notif.pid,
                                init: None,
                            }
                        }
                        Ok(None) => {}
                        Err(e) => tracing::debug!("answering the standby's mount: {e}"),
                    }
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
        // (A standby never mounts beside the path: it takes over from the proxy.)
        let (sandboxed, learning) = modes;
        let modes = (sandboxed, learning, None);
        let outcome = intercept::handle(self.listener.as_fd(), &notif, None, modes, is_driver);
        if let intercept::Intercepted::Mounted(mount) = outcome {
            // (A FUSE mount whose target could not be read above.) Not the run's mount: its
            // caller is answered, and the mount ends with rebound's descriptor.
            mount.answer.answer(self.listener.as_fd(), Ok(()));
        }
    }

    /// Gives it the kernel's INIT (`unique`, `request`) on a thread of its own: a driver may
    /// take long over it (securefs derives its key).
    fn start_init(&mut self, unique: u64, request: Vec<u8>, timeout: Duration) {
        let StandbyMount::Attached { channel, init, .. } = &mut self.mount else {
            return;
        };
        let exchange = channel.try_clone().and_then(|channel| {
            std::thread::Builder::new()
                .name("standby-init".into())
                .spawn(move || exchange_init(channel, request, timeout))
        });
        match exchange {
            Ok(thread) => *init = Some((unique, thread)),
            Err(e) => tracing::debug!("the standby gets its INIT at the hand-over: {e}"),
        }
    }

    /// Its INIT exchange, once over (waiting for it if need be): `None` if it was given none,
    /// else the INIT's unique and the reply, or why there is none.
    fn finish_init(&mut self) -> Option<Result<(u64, Vec<u8>), String>> {
        if let Some(exchange) = self.followed.take() {
            return Some(exchange);
        }
        let StandbyMount::Attached { init, .. } = &mut self.mount else {
            return None;
        };
        let (unique, thread) = init.take()?;
        Some(match thread.join() {
            Ok(Ok(reply)) => Ok((unique, reply)),
            Ok(Err(e)) => Err(format!("its INIT: {e}")),
            Err(_) => Err("its INIT: the exchange panicked".into()),
        })
    }

    /// Whether it reached its mount.
    fn mounted(&self) -> bool {
        !matches!(self.mount, StandbyMount::Pending)
    }

    /// Whether it can take over: its held mount can still be answered (the caller still
    /// waits in it), or a process of it still holds its channel.
    pub fn ready(&self) -> bool {
        match &self.mount {
            StandbyMount::Pending => false,
            StandbyMount::Held(n) => seccomp::id_valid(self.listener.as_fd(), n.id),
            StandbyMount::Attached { channel, .. } => {
                // A datagram socket whose peer is closed reads end-of-file at once.
                let mut byte = [0u8; 1];
                let flags = rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT;
                !matches!(rustix::net::recv(channel, &mut byte, flags), Ok((0, _)))
            }
        }
    }
}

impl Run<'_> {
    pub(super) fn standby_pid(&self) -> Option<i32> {
        self.standby.as_ref().map(|s| s.pid)
    }

    /// The standby's processes: those in its cgroup, or without one, its process tree.
    pub(super) fn standby_processes(&self) -> Vec<i32> {
        match (&self.standby, &self.standby_cgroup) {
            (None, _) => Vec::new(),
            (Some(_), Some(cgroup)) => cgroup.processes(),
            (Some(s), None) => process::tree_of(s.pid),
        }
    }

    /// The standby's first process ended with `exit`: whether that was it daemonizing (its
    /// mount answered, it exited 0, and its daemon holds its channel), which it survives.
    pub(super) fn standby_daemonized(&mut self, exit: Exit) -> bool {
        let Some(standby) = &mut self.standby else {
            return false;
        };
        let StandbyMount::Attached { channel_inode, .. } = standby.mount else {
            return false;
        };
        if exit != Exit::Code(0) || self.standby_cgroup.is_none() {
            return false;
        }
        let theirs = self.standby_cgroup.as_ref().map(DriverCgroup::processes);
        let Some(daemon) = process::holder_of_channel(channel_inode, &[])
            .map(|holder| holder.pid)
            .filter(|pid| theirs.as_ref().is_some_and(|t| t.contains(pid)))
        else {
            return false;
        };
        tracing::debug!("standby driver daemonized; pid {daemon} waits for its INIT");
        standby.pid = daemon;
        self.board.update(|b| b.standby_pid = Some(daemon));
        true
    }

    /// While the driver serves: starts a standby successor if the run keeps one, none is
    /// there, and the pace allows; has a spare's standby followed once it answered its INIT.
    pub(super) fn keep_standby(&mut self, now: Instant) {
        let (gated, spare) = match &self.standby_kind {
            Ok(StandbyKind::Initialised) => (false, false),
            Ok(StandbyKind::BeforeExec(_)) => (true, false),
            Ok(StandbyKind::Spare) => (false, true),
            Err(_) => return,
        };
        if spare {
            self.follow_spare();
        }
        if self.standby.is_some() || !self.standby_pace.due(now) {
            return;
        }
        let Some(s) = &self.served else {
            return;
        };
        let mut spare_file = None;
        if spare {
            // Right after a recovery, a checkpoint is about to cover what it replayed: a
            // spare of the one before would lack all of it.
            let checkpoint = s.proxy.checkpoint_number();
            self.spare_waits = !s.proxy.redo_log_empty() && checkpoint <= self.spare_after;
            if self.spare_waits {
                return;
            }
            match s.proxy.make_spare() {
                Some(Ok(made)) => spare_file = Some(made),
                Some(Err(e)) => {
                    let delay = self.standby_pace.failed(now);
                    tracing::warn!(
                        "cannot make a spare of the image for a standby driver: {e}; next try \
                         in {delay:?}"
                    );
                    return;
                }
                None => {}
            }
        }
        let image = self.image.as_ref().map(|image| image.image().to_path_buf());
        let image_as = image
            .as_deref()
            .zip(spare_file.as_ref().map(|(_, p)| p.as_path()));
        // The view a restarted driver gets (see `start_driver`).
        let view = MountPoint::Hidden(&s.mountpoint);
        let label = Arc::new(Mutex::new(format!("{} (standby)", s.mountpoint.display())));
        let started = start_driver(
            self.config,
            &self.command,
            view,
            self.standby_cgroup.as_ref().or(self.cgroup.as_ref()),
            label.clone(),
            (gated, false),
            image_as,
        );
        match started {
            Ok(started) => {
                let pid = started.pid;
                if gated {
                    // Nothing more will come from it until the hand-over.
                    self.standby_pace.succeeded();
                    self.board.update(|b| b.standby_pid = Some(pid));
                    tracing::debug!("started a standby driver as pid {pid}, held before exec");
                } else if let Some((base, _)) = &spare_file {
                    tracing::debug!(
                        "started a standby driver as pid {pid}, on a spare of checkpoint {base}"
                    );
                } else {
                    tracing::debug!("started a standby driver as pid {pid}");
                }
                self.standby = Some(Standby {
                    pid,
                    listener: started.listener,
                    logger: started.logger,
                    label,
                    mount: StandbyMount::Pending,
                    gate: started.gate,
                    started: now,
                    spare: spare_file.map(|(base, _)| base),
                    followed: None,
                });
            }
            Err(e) => {
                if let (Some(s), Some(_)) = (&self.served, &spare_file) {
                    s.proxy.drop_spare();
                }
                let delay = self.standby_pace.failed(now);
                tracing::warn!("cannot start a standby driver: {e:#}; next try in {delay:?}");
            }
        }
    }

    /// A spare's standby: once it answered its INIT, the proxy brings it forward (see the
    /// module doc); one the redo log can no longer bring forward is ended.
    fn follow_spare(&mut self) {
        let (Some(standby), Some(s)) = (&mut self.standby, &self.served) else {
            return;
        };
        if standby.spare.is_none() {
            return;
        }
        if !s.proxy.spare_followed() {
            self.drop_standby("the redo log no longer holds what its spare lacks", false);
            return;
        }
        let copy = match &standby.mount {
            StandbyMount::Attached {
                channel,
                init: Some((_, thread)),
                ..
            } if standby.followed.is_none() && thread.is_finished() => channel.try_clone(),
            _ => return,
        };
        let exchange = standby.finish_init();
        let checked = exchange.map(|exchange| {
            exchange.and_then(|(unique, reply)| {
                s.proxy
                    .check_standby_init(unique, &reply)
                    .map(|_| (unique, reply))
            })
        });
        match (checked, copy) {
            (Some(Ok(exchange)), Ok(copy)) => {
                s.proxy.follow_spare_with(copy);
                standby.followed = Some(Ok(exchange));
            }
            (Some(Err(why)), _) => self.drop_standby(&why, true),
            (_, Err(e)) => self.drop_standby(&format!("its channel: {e}"), true),
            (None, _) => {}
        }
    }

    /// Whether a spare's standby waits to be followed (see [`Run::follow_spare`]).
    pub(super) fn spare_to_follow(&self) -> bool {
        self.standby.as_ref().is_some_and(|standby| {
            standby.spare.is_some()
                && standby.followed.is_none()
                && matches!(standby.mount, StandbyMount::Attached { .. })
        })
    }

    /// At a failure: the checkpoint whose spare the standby runs on, if it can take over
    /// (ready, on the spare, and lacking not much more than a roll-back would); a spare's
    /// standby that cannot is ended.
    pub(super) fn usable_spare(&mut self) -> Option<u64> {
        let standby = self.standby.as_ref()?;
        let base = standby.spare?;
        let proxy = &self.served.as_ref()?.proxy;
        // What it will write is what becomes the image: checked, not assumed.
        let spare = self.image.as_ref().and_then(|image| image.spare_file_id());
        let holds_spare = || {
            spare.is_some_and(|file| {
                self.standby_processes()
                    .into_iter()
                    .any(|pid| process::has_open(pid, file))
            })
        };
        let why = if !standby.mounted() {
            "it has not reached its mount".to_string()
        } else if !standby.ready() {
            "it left its mount".to_string()
        } else if !holds_spare() {
            "it does not have the spare open".to_string()
        } else {
            match proxy.stop_following_spare() {
                None => "the redo log no longer holds what its spare lacks".to_string(),
                Some((lacks, rolled_back)) if lacks > rolled_back + SPARE_EXTRA_MAX => format!(
                    "it lacks {lacks} logged changes, a roll-back {rolled_back}; rolling back \
                     is quicker"
                ),
                Some(_) => return Some(base),
            }
        };
        tracing::info!("the standby on the image's spare does not take over: {why}");
        self.drop_standby("it did not take over", false);
        None
    }

    pub(super) fn on_standby_call(&mut self) {
        let Some(mountpoint) = self.served.as_ref().map(|s| s.mountpoint.clone()) else {
            return;
        };
        let sandboxed = self.config.sandbox.profile != Profile::Off;
        let attach = self.standby_cgroup.is_some();
        let cgroup = self.standby_cgroup.as_ref().or(self.cgroup.as_ref());
        let Some(standby) = &mut self.standby else {
            return;
        };
        let was_mounted = standby.mounted();
        let modes = (sandboxed, self.config.learn.is_some());
        standby.on_call(&mountpoint, attach, modes, |tgid| {
            cgroup
                .map_or_else(process::descendants, DriverCgroup::processes)
                .contains(&tgid)
        });
        if !was_mounted && standby.mounted() {
            let pid = standby.pid;
            self.init_standby();
            self.standby_pace.succeeded();
            self.board.update(|b| b.standby_pid = Some(pid));
        }
    }

    /// Gives a standby attached to its mount the kernel's INIT, if it has none yet and the
    /// kernel has sent one: at its mount, or (fast mode, where the INIT is seen a batch after
    /// it was answered) once the INIT is observed.
    pub(super) fn init_standby(&mut self) {
        let Some(standby) = &mut self.standby else {
            return;
        };
        let unanswered = matches!(standby.mount, StandbyMount::Attached { init: None, .. });
        if !unanswered || standby.followed.is_some() {
            return;
        }
        if let Some((unique, request)) = self
            .served
            .as_ref()
            .and_then(|s| s.proxy.init_for_standby())
        {
            standby.start_init(unique, request, self.config.request_timeout());
        }
    }

    /// Ends the standby: it died or its processes ended (`died`: the next one waits, see
    /// [`StandbyPace`]), or the run stops.
    pub(super) fn drop_standby(&mut self, why: &str, died: bool) {
        let processes = self.standby_processes();
        let Some(standby) = self.standby.take() else {
            return;
        };
        if let (Some(_), Some(s)) = (standby.spare, &self.served) {
            s.proxy.drop_spare();
        }
        for pid in processes {
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

    /// At a restart: the standby, if there is one, becomes the driver (and its cgroup the
    /// driver's), and is given the mount: its channel is handed to the proxy, or its held
    /// mount answered with one. Returns whether it did.
    pub(super) fn promote_standby(&mut self, now: Instant) -> anyhow::Result<bool> {
        // A standby that answered the kernel's INIT gives that answer; one that could not
        // answer it properly is no successor.
        let mut init_reply = None;
        let init = self.standby.as_mut().and_then(Standby::finish_init);
        let checked = init.map(|exchange| {
            let proxy = self.served.as_ref().map(|s| &s.proxy);
            exchange.and_then(|(unique, reply)| match proxy {
                Some(proxy) => proxy.check_standby_init(unique, &reply),
                None => Err("no mount".into()),
            })
        });
        match checked {
            Some(Ok(body)) => init_reply = Some(body),
            Some(Err(why)) => {
                self.drop_standby(&why, true);
                return Ok(false);
            }
            None => {}
        }
        if let Some(gate) = self.standby.as_ref().and_then(|s| s.gate.as_ref()) {
            if let Err(e) = rustix::io::write(gate, &[1]) {
                self.drop_standby(&format!("it could not be let run ({e})"), true);
                return Ok(false);
            }
        }
        // One still on its way to its mount will get there sooner than a new driver would.
        let Some(standby) = self.standby.take_if(|s| !s.mounted() || s.ready()) else {
            self.drop_standby("it left its mount", true);
            return Ok(false);
        };
        let waited_ms = standby.started.elapsed().as_secs_f64() * 1e3;
        let ahead = if init_reply.is_some() {
            ", its INIT answered"
        } else {
            ""
        };
        tracing::info!(
            "standby driver (pid {}, started {waited_ms:.0} ms ago{ahead}) takes over",
            standby.pid
        );
        if self.standby_cgroup.is_some() {
            std::mem::swap(&mut self.cgroup, &mut self.standby_cgroup);
        }
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
        self.holderless_since = None;
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
        match standby.mount {
            StandbyMount::Held(held) => self.on_intercepted(&held)?,
            StandbyMount::Attached {
                channel,
                channel_inode,
                caller,
                ..
            } => self.attach(channel, channel_inode, caller, init_reply)?,
            StandbyMount::Pending => {}
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
    fn image_drivers_and_repaired_stores_get_a_standby_held_before_exec() {
        let argv = |p: &str| vec![OsString::from(p), "x".into()];
        let before_exec =
            |k: Result<StandbyKind, String>| matches!(k, Ok(StandbyKind::BeforeExec(_)));
        let mut config = Config::default();
        assert_eq!(
            kind(&config, &argv("/usr/bin/sshfs")),
            Ok(StandbyKind::Initialised)
        );
        assert!(before_exec(kind(&config, &argv("/usr/sbin/fuse2fs"))));
        config.standby = StandbyPolicy::On;
        assert_eq!(
            kind(&config, &argv("fuse2fs")),
            Ok(StandbyKind::Initialised)
        );
        config.standby = StandbyPolicy::Auto;
        config.image = Some("disk.img".into());
        assert_eq!(kind(&config, &argv("fuse2fs")), Ok(StandbyKind::Spare));
        config.sandbox.profile = Profile::Off;
        assert!(
            before_exec(kind(&config, &argv("fuse2fs"))),
            "no view to show it in"
        );
        config.sandbox.profile = Profile::Default;
        config.image = None;
        config.pre_restart = vec!["e2fsck".into()];
        assert!(before_exec(kind(&config, &argv("passthrough_ll"))));
        config.pre_restart.clear();
        config.restart_budget = 0;
        assert!(kind(&config, &argv("passthrough_ll")).is_err());
        config.restart_budget = 5;
        config.standby = StandbyPolicy::Off;
        assert!(kind(&config, &argv("passthrough_ll")).is_err());
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
