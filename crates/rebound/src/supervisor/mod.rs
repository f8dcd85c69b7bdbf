//! The supervisor of one `rebound run` (MINIX 3's reincarnation server): starts the driver,
//! intercepts its mount, keeps the proxy running, notices when the driver fails, and restarts
//! it within a budget.
//!
//! Owns: the lifecycle (starting, serving, recovering, failed, stopping), signals, the
//! restart policy, exit codes and the log lines that explain them. Must not: touch FUSE
//! messages (that is the proxy) or contain `unsafe`.
//!
//! Everything happens on one thread around one `poll(2)`: the seccomp listener, termination
//! signals, SIGCHLD, the proxy's events and operator commands are all file descriptors.
//! This file holds the run's state, its start and its loop; `events` what the loop hears,
//! `timers` what the clock decides, `restart` what a failure leads to, `upgrade` the
//! operator's replacement of the driver, `standby` the successor kept ready, `intercept` the
//! driver's calls and `attach` what they lead to, `stop` how the run ends, `command` what runs
//! as the driver.

mod attach;
mod command;
mod events;
mod hoarding;
mod intercept;
mod process;
mod reload;
mod restart;
mod standby;
mod stop;
mod targets;
mod timers;
mod upgrade;

use std::collections::{BTreeSet, VecDeque};
use std::ffi::{OsStr, OsString};
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use rebound_sys::spawn;
use rustix::event::{poll, PollFd, PollFlags, Timespec};

use crate::cgroup::DriverCgroup;
use crate::checkpoint::ImageCheckpoint;
use crate::config::{Config, Profile};
use crate::control::{self, ControlSocket, OperatorRequest, StatusBoard};
use crate::keeper::Keeper;
use crate::proxy::{Proxy, ProxyEvent};
use crate::sandbox::MountPoint;
use crate::service::ServiceManager;
use command::DriverCommand;
pub(crate) use process::runs_on;
use process::Exit;
pub use reload::{installed_binary, Death, Succession};
use restart::Cause;
use stop::{log_stats, unmount};

/// Where the run is in its life.
#[derive(Debug)]
enum Phase {
    /// Waiting for the first driver to mount, until the deadline.
    Starting { deadline: Instant },
    /// The mount is served through the proxy.
    Serving,
    /// The driver failed; a new one is on its way. Requests wait.
    Recovering(Step),
    /// The restart budget is spent: requests fail with `EIO` until `retry_at`.
    Failed { retry_at: Instant },
    /// Waiting for the driver's processes to exit; escalating to SIGKILL past the deadline.
    Stopping {
        deadline: Instant,
        killed: bool,
        exit_code: i32,
        /// The driver unmounted by itself; its own exit status then decides rebound's.
        driver_initiated: bool,
        /// Once the mount is gone: since when the driver's processes have made no progress,
        /// and how far they had got then (see `Run::kill_if_stuck`).
        quiet: Option<(Instant, u64)>,
        /// Fast mode, a driver that unmounted by itself: when its connection is ended, unless
        /// it has exited by then (see `Intercepted::Unmounted` in `attach`).
        end_connection_at: Option<Instant>,
    },
}

/// The steps of a recovery.
#[derive(Debug)]
enum Step {
    /// Waiting for what is left of the failed driver to be gone: until `kill_at` for it to
    /// exit by itself (a driver restarted while it still runs), then killing it.
    Reaping {
        since: Instant,
        deadline: Instant,
        kill_at: Option<Instant>,
    },
    /// Waiting out the back-off before starting a new driver.
    Backoff { until: Instant },
    /// The new driver runs; waiting for its `mount(2)`.
    Mounting { deadline: Instant },
    /// The proxy brings the new driver to the old one's state.
    Restoring,
}

/// Where the loop says whether it took an operator's request.
type OperatorAnswer = mpsc::Sender<Result<(), String>>;

/// What a seccomp listener has to say on one turn of the loop.
enum Readiness {
    /// A call to handle.
    Call,
    /// Every process under its filter has exited.
    Gone,
    Idle,
}

/// The mount being served.
struct Served {
    mountpoint: PathBuf,
    /// `mountpoint` as the mount table names it (symbolic links resolved at the mount).
    in_mount_table: PathBuf,
    /// Inode of the current driver's end of its channel.
    channel_inode: u64,
    proxy: Proxy,
    /// The driver mounted through a helper (fusermount) rather than by itself.
    mounted_by_helper: bool,
}

/// Everything one run keeps between turns of its loop.
struct Run<'a> {
    config: &'a Config,
    /// The driver this run starts (replaced by `rebound upgrade`).
    command: DriverCommand,
    /// The command an upgrade under way replaces, until the new driver serves.
    upgrade_from: Option<DriverCommand>,
    /// The failed driver's processes all exited before they had to be killed.
    exited_by_itself: bool,
    /// The driver is being stopped for a successor rebound (`rebound reload`).
    reloading: bool,
    board: Arc<StatusBoard>,
    phase: Phase,
    served: Option<Served>,
    /// What the status is to say once the driver's serving process is known.
    announcing: Option<events::PendingAnnouncement>,
    /// The seccomp listener of the current driver's processes.
    listener: OwnedFd,
    listener_open: bool,
    /// The process rebound started for the current driver, and how it ended.
    driver_pid: i32,
    driver_exit: Option<Exit>,
    /// Fast mode: since when no process of the serving driver has held the connection while
    /// its serving process ran on (see `check_driver_beside`).
    holderless_since: Option<Instant>,
    /// When restarts were started, within the restart window.
    restarts: VecDeque<Instant>,
    events_tx: Option<UnixStream>,
    /// The cgroup the driver runs in.
    cgroup: Option<DriverCgroup>,
    /// The standby successor's own cgroup, which becomes the driver's when it takes over (the
    /// two swap): while both run, a process is the standby's if it is in this one.
    standby_cgroup: Option<DriverCgroup>,
    watch: hoarding::Watch,
    /// What the driver's stderr lines are prefixed with in the log: its mount point, once known.
    log_label: Arc<Mutex<String>>,
    stderr_loggers: Vec<JoinHandle<()>>,
    /// What the first driver was given that its sandbox hides (repeated if it fails to mount).
    hidden: Vec<crate::sandbox::Hidden>,
    /// The successor kept ready while the driver serves, and when the next may start.
    standby: Option<standby::Standby>,
    standby_pace: standby::StandbyPace,
    /// The kind of standby this run keeps, or why it keeps none.
    standby_kind: Result<standby::StandbyKind, String>,
    /// The redo log's checkpoint count at the last recovery: a spare's standby waits for a
    /// later checkpoint (see `keep_standby`).
    spare_after: Option<u64>,
    /// A spare's standby waits for that checkpoint: the loop looks again soon.
    spare_waits: bool,
    /// The driver being attached runs on the image's spare.
    attaching_spare: bool,
    /// The driver's image and its last checkpoint, if `image` is set.
    image: Option<Arc<ImageCheckpoint>>,
    /// The denied system calls already logged (each once: a driver may retry one in a loop).
    denied_logged: BTreeSet<&'static str>,
    /// Learning mode's recorder (`--learn`).
    learner: Option<crate::capability_trace::Learner>,
    /// The service manager that started rebound, if any (systemd).
    service: ServiceManager,
    /// The process that takes the mount over should rebound die (see [`crate::keeper`]).
    keeper: Option<Keeper>,
    /// Fast mode's observer, loaded before the first driver started and attached at its
    /// mount; `None` in guarded mode, where fast mode is not available, in a successor
    /// rebound's run, and once taken for the mount.
    observer: Option<rebound_observe::LoadedObserver>,
    /// The first driver was started with fast mode's filter (its observer loaded): served on
    /// a channel instead, it must be replaced (see `Cause::Fallback`).
    fast_filter: bool,
    /// The driver is being replaced for `Cause::Fallback`: not a restart the budget counts.
    falling_back: bool,
}

/// Runs `argv` as a FUSE driver behind rebound until the mount ends, or, with `succession`,
/// takes over the mount a predecessor rebound handed over (`rebound reload`). Returns the
/// exit code.
pub fn run(
    config: &Config,
    argv: &[OsString],
    succession: Option<Succession>,
) -> anyhow::Result<i32> {
    let command = DriverCommand::new(argv.to_vec())?;
    let driver_name = command.name.clone();
    // Before rebound is child subreaper (a reloaded rebound still is): the keeper must not
    // become its descendant.
    let keeper = if config.keeper {
        let _ = rustix::process::set_child_subreaper(None);
        Keeper::spawn()
            .inspect_err(|e| {
                tracing::warn!("no keeper ({e:#}): should rebound itself die, the mount is lost")
            })
            .ok()
    } else {
        None
    };
    rustix::process::set_child_subreaper(Some(rustix::process::getpid()))
        .context("becoming child subreaper")?;

    let terminate = SignalPipe::new(&[signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM])?;
    let child_exit = SignalPipe::new(&[signal_hook::consts::SIGCHLD])?;
    let (events_rx, events_tx) = UnixStream::pair().context("creating the event channel")?;
    let (commands_rx, commands_tx) = UnixStream::pair().context("creating the command channel")?;
    commands_rx.set_nonblocking(true)?;

    // Before any driver has the image open: this first checkpoint is the state to go back to
    // (a successor takes its predecessor's, which the redo log handed over goes with, from
    // the hand-over or, after rebound's death, from the journal).
    let image = match &config.image {
        Some(path) if succession.is_some() => Some(Arc::new(
            ImageCheckpoint::adopt(path).map_err(|e| anyhow::anyhow!(e))?,
        )),
        Some(path) => Some(Arc::new(
            ImageCheckpoint::new(path).map_err(|e| anyhow::anyhow!(e))?,
        )),
        None => None,
    };
    let cgroup = match DriverCgroup::create(&std::process::id().to_string(), &config.limits) {
        Ok(Some(cgroup)) => Some(cgroup),
        Ok(None) => {
            tracing::warn!(
                "no cgroup file system: the driver's memory, tasks and CPU are not limited"
            );
            None
        }
        Err(e) => {
            tracing::warn!("cannot create the driver's cgroup ({e}): its memory, tasks and CPU are not limited");
            None
        }
    };
    let log_label = Arc::new(Mutex::new(driver_name.clone()));
    let mut watch = hoarding::Watch::new(&config.limits);
    watch.driver_started(cgroup.as_ref());
    for part in &command.program {
        tracing::debug!("sandbox: shows {} ({})", part.path.display(), part.what);
    }
    // Before the driver starts: its first capability checks count.
    // (A thread is the driver's if its process is one of rebound's descendants.)
    let drivers_thread = |tid| crate::capability_trace::thread_of(tid, &process::descendants());
    let learner = match &config.learn {
        Some(out) => Some(
            crate::capability_trace::Learner::start(out, argv, drivers_thread)
                .context("learning mode")?,
        ),
        None => None,
    };
    // Otherwise, what the sandbox keeps from the driver and the kernel then refuses it is
    // logged, once each (where the kernel can trace it).
    let _refusals = match (&learner, config.sandbox.profile) {
        (None, Profile::Default | Profile::Strict) => crate::capability_trace::RefusalLog::start(
            crate::sandbox::own_capabilities(),
            argv.first().map_or(OsStr::new(""), |p| p.as_os_str()),
            drivers_thread,
        )
        .inspect_err(|e| tracing::debug!("capability refusals are not logged: {e:#}"))
        .ok(),
        _ => None,
    };
    // Fast mode's observer is loaded before the first driver starts: on a kernel that cannot
    // observe, the driver then gets guarded mode's filter from the start (its splices into
    // rebound's channel are seen).
    let observer = (succession.is_none() && config.fast())
        .then(|| {
            let shared = crate::keeper::shared_forget_pins();
            rebound_observe::LoadedObserver::load(crate::proxy::observed_opcodes(), Some(&shared))
                .inspect_err(|e| {
                    tracing::warn!("mode = \"fast\" is not available here, serving guarded: {e}")
                })
                .ok()
        })
        .flatten();
    let started = match &succession {
        // The driver starts on the recovery path, once the proxy is taken over.
        Some(_) => None,
        None => Some(start_driver(
            config,
            &command,
            MountPoint::Unknown,
            cgroup.as_ref(),
            log_label.clone(),
            (false, observer.is_some()),
            None,
        )),
    };
    let (pid, listener, logger, hidden) = match started {
        Some(Ok(started)) => {
            tracing::info!("started driver `{driver_name}` as pid {}", started.pid);
            let logger = Some(started.logger);
            (started.pid, Some(started.listener), logger, started.hidden)
        }
        Some(Err(e)) => {
            if let Some(cgroup) = &cgroup {
                cgroup.remove();
            }
            return Err(e);
        }
        None => (0, None, None, Vec::new()),
    };
    let listener_open = listener.is_some();
    // (No driver yet: a descriptor that never becomes readable stands in for its listener.)
    let listener = match listener {
        Some(listener) => listener,
        None => rustix::fs::open(
            "/dev/null",
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )?,
    };

    let board = Arc::new(StatusBoard::default());
    board.update(|s| {
        s.state = "starting".into();
        s.driver = argv
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        s.driver_pid = Some(pid);
        s.rebound_pid = std::process::id();
    });
    // An operator's request is taken by the loop, which answers whether it took it.
    let (operator_tx, operator_rx) = mpsc::channel::<(OperatorRequest, OperatorAnswer)>();
    let operator_trigger = Box::new(move |request| {
        let (answer_tx, answer_rx) = mpsc::channel();
        operator_tx
            .send((request, answer_tx))
            .map_err(|_| "the run is stopping".to_string())?;
        let _ = (&commands_tx).write_all(b"r");
        answer_rx
            .recv_timeout(Duration::from_secs(10))
            .unwrap_or_else(|_| Err("the run did not take the request within 10 s".into()))
    });
    crate::metrics::start(&config.metrics, &board)?;
    let _control = ControlSocket::start(&control::run_dir(), board.clone(), operator_trigger)
        .inspect_err(|e| tracing::warn!("no status socket: {e:#}"))
        .ok();

    let mut run = Run {
        config,
        command,
        upgrade_from: None,
        exited_by_itself: false,
        reloading: false,
        board,
        phase: Phase::Starting {
            deadline: Instant::now() + config.mount_timeout(),
        },
        served: None,
        announcing: None,
        listener,
        listener_open,
        driver_pid: pid,
        driver_exit: None,
        holderless_since: None,
        restarts: VecDeque::new(),
        events_tx: Some(events_tx),
        cgroup,
        standby_cgroup: None,
        watch,
        log_label,
        stderr_loggers: logger.into_iter().collect(),
        hidden,
        standby: None,
        standby_pace: standby::StandbyPace::new(),
        standby_kind: standby::kind(config, argv),
        spare_after: None,
        spare_waits: false,
        attaching_spare: false,
        image,
        denied_logged: BTreeSet::new(),
        learner,
        service: ServiceManager::from_env(),
        keeper,
        fast_filter: observer.is_some(),
        falling_back: false,
        observer,
    };
    if let Some(known) = crate::sandbox::named::known_driver(argv) {
        if config.sandbox.profile != Profile::Off {
            let paths: Vec<String> = known.home_dirs.iter().map(|d| format!("~/{d}")).collect();
            tracing::info!(
                "sandbox: {} keeps {} (rebound's profile of it: {})",
                run.command.name,
                known
                    .capabilities
                    .iter()
                    .copied()
                    .chain(paths.iter().map(|p| p.as_str()))
                    .collect::<Vec<_>>()
                    .join(", "),
                known.why
            );
        }
    }
    match &run.standby_kind {
        Err(why) => tracing::info!("no standby successor: {why}"),
        Ok(kind) => {
            if let standby::StandbyKind::BeforeExec(why) = kind {
                tracing::info!("the standby successor is held before exec: {why}");
            }
            run.standby_cgroup = standby::cgroup(config, run.cgroup.as_ref());
        }
    }

    if let Some(succession) = succession {
        run.resume(succession)?;
    }

    loop {
        run.service.loop_turned();
        if let Some(keeper) = &mut run.keeper {
            keeper.status(|| run.board.snapshot());
        }
        let timeout = run.poll_timeout();
        let timeout = run
            .announcement_due()
            .map_or(timeout, |due| due.min(timeout));
        let (listener, standby, terminate_ready, child_ready, event_ready, command) = {
            let mut fds = vec![
                PollFd::new(&terminate.reader, PollFlags::IN),
                PollFd::new(&child_exit.reader, PollFlags::IN),
                PollFd::new(&events_rx, PollFlags::IN),
                PollFd::new(&commands_rx, PollFlags::IN),
            ];
            let listener_at = run.listener_open.then(|| {
                fds.push(PollFd::new(&run.listener, PollFlags::IN));
                fds.len() - 1
            });
            let standby_at = run.standby.as_ref().map(|standby| {
                fds.push(PollFd::new(&standby.listener, PollFlags::IN));
                fds.len() - 1
            });
            let timespec = Timespec::try_from(timeout).unwrap_or(Timespec {
                tv_sec: 1,
                tv_nsec: 0,
            });
            match poll(&mut fds, Some(&timespec)) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e).context("poll"),
            }
            let ready = |i: usize| {
                fds.get(i)
                    .is_some_and(|f| f.revents().contains(PollFlags::IN))
            };
            let readiness = |at: Option<usize>| {
                let revents = at.and_then(|i| fds.get(i)).map(PollFd::revents);
                match revents {
                    Some(r) if r.contains(PollFlags::IN) => Readiness::Call,
                    Some(r) if r.intersects(PollFlags::HUP | PollFlags::ERR) => Readiness::Gone,
                    _ => Readiness::Idle,
                }
            };
            (
                readiness(listener_at),
                readiness(standby_at),
                ready(0),
                ready(1),
                ready(2),
                ready(3),
            )
        };

        match listener {
            Readiness::Call => run.on_intercepted_call()?,
            // Every process under the filter has exited; nothing more will be reported.
            Readiness::Gone => run.listener_open = false,
            Readiness::Idle => {}
        }
        match standby {
            Readiness::Call => run.on_standby_call(),
            Readiness::Gone => run.drop_standby("its processes all ended", true),
            Readiness::Idle => {}
        }
        if terminate_ready {
            terminate.drain();
            run.on_stop_signal();
        }
        if event_ready {
            let mut byte = [0u8; 1];
            if let (Ok(1), Some(event)) =
                ((&events_rx).read(&mut byte), ProxyEvent::from_byte(byte[0]))
            {
                run.on_proxy_event(event);
            }
        }
        if command {
            let mut buf = [0u8; 16];
            while matches!((&commands_rx).read(&mut buf), Ok(n) if n > 0) {}
            while let Ok((request, answer)) = operator_rx.try_recv() {
                let _ = answer.send(match request {
                    OperatorRequest::Restart => {
                        run.on_restart_command();
                        Ok(())
                    }
                    OperatorRequest::Upgrade(argv) => run.on_upgrade(argv),
                    OperatorRequest::Reload => run.on_reload(),
                });
            }
        }
        if child_ready {
            child_exit.drain();
        }
        run.reap();
        let was_reaping = matches!(run.phase, Phase::Recovering(Step::Reaping { .. }));
        let mut ended = run.on_processes_gone(child_ready);
        if ended.is_none()
            && !was_reaping
            && matches!(run.phase, Phase::Recovering(Step::Reaping { .. }))
        {
            // A failure found on this turn (the driver's processes all gone, say) may have
            // nothing left to reap: no further SIGCHLD would wake the loop before the tick.
            ended = run.on_processes_gone(true);
        }
        if let Some(code) = ended {
            run.finish();
            return Ok(code);
        }
        run.on_tick()?;
        run.settle_announcement();
    }
}

/// Starts the driver in its sandbox and under the seccomp filter; returns its pid, the
/// filter's listener, the thread that logs its stderr, and what its sandbox hides of what it
/// was given (logged at a first start: as a warning when the command line names it).
///
/// A restarted driver that mounts by itself (`MountPoint::Hidden`) runs in a mount namespace
/// where the mount point it will serve is not mounted: whatever it does to the mount point
/// before it can serve (libfuse stats it, libfuse 2 lists it to refuse a non-empty one,
/// fusermount enters it) must not become a request to the mount it is about to serve, which
/// waits for it (and may hold the directory's lock that the driver's own listing then waits
/// for).
///
/// `gated`: held before `exec` (a standby). `beside`: the first driver of fast mode, which gets
/// a real `/dev/fuse` clone: its splices need no interception. `image_as`: a file shown at
/// the image's path (a spare, see `standby`).
fn start_driver(
    config: &Config,
    driver: &DriverCommand,
    mountpoint: MountPoint<'_>,
    cgroup: Option<&DriverCgroup>,
    log_label: Arc<Mutex<String>>,
    (gated, beside): (bool, bool),
    image_as: Option<(&std::path::Path, &std::path::Path)>,
) -> anyhow::Result<Started> {
    let mut command = driver.command();
    command.stderr(std::process::Stdio::piped());
    let procs = cgroup.map(DriverCgroup::procs_files).unwrap_or_default();
    let sandboxed = config.sandbox.profile != Profile::Off;
    if let (MountPoint::Hidden(mountpoint), false) = (&mountpoint, sandboxed) {
        // Registered before the filter, whose pre-exec step would intercept this unmount. (A
        // sandboxed driver's own namespace is built without the mount instead.)
        spawn::outside_mount(&mut command, mountpoint)?;
    }
    let prepared = crate::sandbox::build(
        config,
        &driver.argv,
        &driver.program,
        mountpoint,
        procs,
        image_as,
    )
    .context("preparing the driver's sandbox")?;
    // (Only a first start reports any: a restart's would be the same.)
    for hidden in &prepared.hidden {
        if hidden.variable.is_none() {
            tracing::warn!("{hidden}");
        } else {
            tracing::debug!("{hidden}");
        }
    }
    let cannot = || format!("cannot start driver `{}`", driver.name);
    if gated {
        let exec = move |child: std::io::Result<std::process::Child>| match child {
            Ok(mut child) => {
                if let Some(stderr) = child.stderr.take() {
                    log_lines(stderr, &log_label);
                }
            }
            Err(e) => tracing::debug!("a driver held before exec did not start: {e}"),
        };
        let gated = spawn::spawn_gated(command, &prepared.sandbox, &prepared.denied, exec)
            .with_context(cannot)?;
        return Ok(Started {
            pid: gated.pid,
            listener: gated.listener,
            logger: gated.thread,
            hidden: prepared.hidden,
            gate: Some(gated.gate),
        });
    }
    let (mut child, listener) =
        spawn::spawn_intercepted(&mut command, &prepared.sandbox, &prepared.denied, !beside)
            .with_context(cannot)?;
    let stderr = child.stderr.take().context("the driver's stderr")?;
    let logger = std::thread::Builder::new()
        .name("driver-stderr".into())
        .spawn(move || log_lines(stderr, &log_label))
        .context("starting the driver's stderr logger")?;
    Ok(Started {
        pid: child.id() as i32,
        listener,
        logger,
        hidden: prepared.hidden,
        gate: None,
    })
}

/// A driver process rebound started.
struct Started {
    pid: i32,
    /// Its seccomp listener.
    listener: OwnedFd,
    /// Logs its stderr.
    logger: JoinHandle<()>,
    /// What its sandbox hides of what it was given.
    hidden: Vec<crate::sandbox::Hidden>,
    /// Started `gated`: it waits before `exec` until a byte is written here.
    gate: Option<OwnedFd>,
}

/// Logs each line the driver writes to its stderr, prefixed with `label`, until no process
/// holds the pipe any more.
fn log_lines(stderr: std::process::ChildStderr, label: &Mutex<String>) {
    use std::io::BufRead;
    let mut reader = std::io::BufReader::new(stderr);
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let text = String::from_utf8_lossy(&line);
                let label = label.lock().unwrap_or_else(|e| e.into_inner()).clone();
                tracing::warn!("{label}: {}", text.trim_end());
            }
        }
    }
}

impl Run<'_> {
    /// After the first driver failed before mounting: what its sandbox hid of what it was
    /// given, each with the key that shows it, or how to tell whether the sandbox is the cause.
    fn explain_sandbox(&self) {
        let profile = self.config.sandbox.profile;
        if profile == Profile::Off {
            return;
        }
        for hidden in &self.hidden {
            tracing::error!("{hidden}");
        }
        if self.hidden.is_empty() {
            tracing::info!(
                "the driver ran in the `{}` sandbox profile, which showed it everything its \
                 command line and environment name; `[sandbox] profile = \"off\"` tells \
                 whether the sandbox is the cause",
                profile.name()
            );
        }
    }

    /// Fails the requests of driver threads that are dying (see [`Proxy::fail_requests_of`]).
    /// Looked for while the driver is stopped, while it serves once a request has waited a
    /// second (a working driver keeps nothing waiting that long; the look reads `/proc`,
    /// which a recovery's latency should not pay for), and while it is reaped, also a second
    /// after the kill (requests a fast-mode driver had read wait unsent in the proxy once it
    /// took the queue over).
    fn answer_for_dying_driver_threads(&self, now: Instant) {
        let Some(s) = &self.served else {
            return;
        };
        let waited = || {
            s.proxy
                .waiting_since()
                .is_some_and(|since| now.duration_since(since) >= Duration::from_secs(1))
        };
        let look = match self.phase {
            Phase::Stopping { .. } => true,
            Phase::Serving => waited(),
            Phase::Recovering(Step::Reaping { since, .. }) => {
                waited() || now.duration_since(since) >= Duration::from_secs(1)
            }
            _ => false,
        };
        if look {
            let dying = process::dying_threads();
            if !dying.is_empty() {
                s.proxy.fail_requests_of(&dying);
            }
        }
    }

    /// A driver that mounted through a helper sees a copy of its mount in its own namespace
    /// (see `intercept`), which keeps the connection alive after a user's `umount` in the
    /// host: once the host's mount is gone, drop the copy too, so that the connection ends
    /// and the run stops as it would without a sandbox.
    fn check_helper_mount(&mut self) {
        let Some(s) = self.served.as_ref().filter(|s| s.mounted_by_helper) else {
            return;
        };
        // (Unreadable: taken as still mounted.)
        let mounted = crate::paths::fuse_mounts().map_or(true, |m| m.contains(&s.in_mount_table));
        if mounted {
            return;
        }
        // A standby of such a driver sees the mount too.
        self.drop_standby("the mount is gone", false);
        let Some(s) = self.served.as_ref() else {
            return;
        };
        // In every namespace of the driver's processes (a restarted driver's differs from the
        // first one's, and a helper may have gone meanwhile), once each.
        let target =
            std::ffi::CString::new(s.mountpoint.as_os_str().as_encoded_bytes()).unwrap_or_default();
        let mut seen = std::collections::HashSet::new();
        for pid in process::descendants() {
            let path = format!("/proc/{pid}/ns/mnt");
            let Ok(id) = std::fs::read_link(&path) else {
                continue;
            };
            let Ok(namespace) = std::fs::File::open(&path) else {
                continue;
            };
            if !seen.insert(id) {
                continue;
            }
            match rebound_sys::sandbox::detach_in_namespace(namespace.as_fd(), &target) {
                Ok(()) => tracing::info!(
                    "{} was unmounted; dropped the driver's copy of it (pid {pid})",
                    s.mountpoint.display()
                ),
                Err(e) => tracing::debug!("dropping the driver's copy of the mount: {e}"),
            }
        }
    }
}

/// Signals delivered as readable bytes on a socket, so that `poll` can wait for them.
struct SignalPipe {
    reader: UnixStream,
}

impl SignalPipe {
    fn new(signals: &[i32]) -> anyhow::Result<SignalPipe> {
        let (reader, writer) = UnixStream::pair().context("creating a signal pipe")?;
        reader.set_nonblocking(true)?;
        writer.set_nonblocking(true)?;
        for &signal in signals {
            signal_hook::low_level::pipe::register(signal, writer.try_clone()?)
                .with_context(|| format!("registering signal {signal}"))?;
        }
        Ok(SignalPipe { reader })
    }

    fn drain(&self) {
        let mut buf = [0u8; 64];
        while matches!((&self.reader).read(&mut buf), Ok(n) if n > 0) {}
    }
}
