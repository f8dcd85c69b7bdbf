//! The supervisor of one `rebound run`: starts the driver, intercepts its mount, keeps the
//! proxy running, and decides what happens when either side goes away.
//!
//! Owns: the lifecycle (starting, serving, stopping), signals, exit codes and the log lines
//! that explain them. Must not: touch FUSE messages (that is the proxy) or contain `unsafe`.
//!
//! Everything happens on one thread around one `poll(2)`: the seccomp listener, termination
//! signals, SIGCHLD and the proxy's events are all file descriptors.

mod intercept;
mod process;

use std::ffi::OsString;
use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rebound_sys::{seccomp, spawn};
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::process::Signal;

use crate::config::Config;
use crate::control::{self, ControlSocket, StatusBoard};
use crate::proxy::{Proxy, ProxyEvent};
use intercept::Intercepted;
use process::Exit;

/// Where the run is in its life.
#[derive(Debug)]
enum Phase {
    /// Waiting for the driver to mount, until the deadline.
    Starting { deadline: Instant },
    /// The mount is served through the proxy.
    Serving,
    /// Waiting for the driver's processes to exit; escalating to SIGKILL past the deadline.
    Stopping {
        deadline: Instant,
        killed: bool,
        exit_code: i32,
        /// The driver unmounted by itself; its own exit status then decides rebound's.
        driver_initiated: bool,
    },
}

/// The mount being served.
struct Served {
    mountpoint: PathBuf,
    channel_inode: u64,
    proxy: Proxy,
}

/// Runs `argv` as a FUSE driver behind rebound until the mount ends. Returns the exit code.
pub fn run(config: &Config, argv: &[OsString]) -> anyhow::Result<i32> {
    let Some((program, args)) = argv.split_first() else {
        bail!("no driver command given");
    };
    let driver_name = program.to_string_lossy().into_owned();
    rustix::process::set_child_subreaper(Some(rustix::process::getpid()))
        .context("becoming child subreaper")?;

    let terminate = SignalPipe::new(&[signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM])?;
    let child_exit = SignalPipe::new(&[signal_hook::consts::SIGCHLD])?;
    let (events_rx, events_tx) = UnixStream::pair().context("creating the event channel")?;

    let mut command = Command::new(program);
    command.args(args).process_group(0);
    let (child, listener) = spawn::spawn_intercepted(&mut command)
        .with_context(|| format!("cannot start driver `{driver_name}`"))?;
    let initial_pid = child.id() as i32;
    tracing::info!("started driver `{driver_name}` as pid {initial_pid}");

    let board = Arc::new(StatusBoard::default());
    board.update(|s| {
        s.state = "starting".into();
        s.driver = argv
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        s.driver_pid = Some(initial_pid);
        s.rebound_pid = std::process::id();
    });
    // No-op until recovery wires it to the poll loop (`rebound restart` times out meanwhile).
    let _control = ControlSocket::start(&control::run_dir(), board.clone(), Box::new(|| {}))
        .inspect_err(|e| tracing::warn!("no status socket: {e:#}"))
        .ok();

    let mut phase = Phase::Starting {
        deadline: Instant::now() + config.mount_timeout(),
    };
    let mut served: Option<Served> = None;
    let mut initial_exit: Option<Exit> = None;
    let mut listener_open = true;
    let mut events_tx = Some(events_tx);

    loop {
        let timeout = match &phase {
            Phase::Starting { deadline } | Phase::Stopping { deadline, .. } => {
                deadline.saturating_duration_since(Instant::now())
            }
            Phase::Serving => Duration::from_secs(1),
        };
        let (listener_ready, listener_hup, terminate_ready, child_ready, event_ready) = {
            let mut fds = vec![
                PollFd::new(&terminate.reader, PollFlags::IN),
                PollFd::new(&child_exit.reader, PollFlags::IN),
                PollFd::new(&events_rx, PollFlags::IN),
            ];
            if listener_open {
                fds.push(PollFd::new(&listener, PollFlags::IN));
            }
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
            let hup = fds
                .get(3)
                .is_some_and(|f| f.revents().intersects(PollFlags::HUP | PollFlags::ERR));
            (ready(3), hup, ready(0), ready(1), ready(2))
        };

        if listener_ready {
            match seccomp::receive(listener.as_fd()) {
                Ok(notif) => {
                    let ours = served.as_ref().map(|s| intercept::Served {
                        mountpoint: &s.mountpoint,
                        channel_inode: s.channel_inode,
                        proxy: &s.proxy,
                    });
                    match intercept::handle(listener.as_fd(), &notif, ours) {
                        Intercepted::Mounted(mount) => {
                            tracing::info!(
                                "mounted {} ({}) for pid {}; serving it through rebound",
                                mount.mountpoint.display(),
                                mount.fstype,
                                mount.caller
                            );
                            let tx = events_tx.take().context("second mount")?;
                            let proxy = Proxy::start(mount.kernel, mount.channel, tx)
                                .context("starting the proxy")?;
                            board
                                .attach(proxy.stats.clone(), Box::new(proxy.held_objects_reader()));
                            board.update(|s| {
                                s.mountpoint = mount.mountpoint.display().to_string();
                                s.state = "serving".into();
                            });
                            served = Some(Served {
                                mountpoint: mount.mountpoint,
                                channel_inode: mount.channel_inode,
                                proxy,
                            });
                            phase = Phase::Serving;
                        }
                        Intercepted::Unmounted => {
                            // The driver is done with the mount; its reader threads must
                            // not wait for requests that will never come.
                            if let Some(s) = &served {
                                s.proxy.disconnect_driver();
                            }
                            if !matches!(phase, Phase::Stopping { .. }) {
                                tracing::info!("the driver unmounted its file system");
                                phase = stopping(config, &board, false, 0);
                            }
                        }
                        Intercepted::Other => {}
                    }
                }
                Err(e) if e.raw_os_error() == Some(rustix::io::Errno::NOENT.raw_os_error()) => {}
                Err(e) => tracing::debug!("seccomp receive: {e}"),
            }
        } else if listener_hup {
            // Every process under the filter has exited; nothing more will be reported.
            listener_open = false;
        }

        if terminate_ready {
            terminate.drain();
            match &mut phase {
                Phase::Stopping { killed, .. } => {
                    // A second request to stop: the operator does not want to wait for the
                    // driver to finish writing.
                    if !*killed {
                        tracing::warn!("second stop signal: killing the driver");
                        process::signal_all(Signal::KILL);
                        *killed = true;
                    }
                }
                _ => {
                    tracing::info!("stopping on signal");
                    if let Some(s) = &served {
                        unmount(&s.mountpoint);
                    }
                    phase = stopping(config, &board, true, 0);
                }
            }
        }

        if event_ready {
            let mut byte = [0u8; 1];
            if let (Ok(1), Some(event)) =
                ((&events_rx).read(&mut byte), ProxyEvent::from_byte(byte[0]))
            {
                if let (Phase::Serving, Some(s)) = (&phase, &served) {
                    match event {
                        ProxyEvent::KernelGone => {
                            tracing::info!(
                                "{} was unmounted; stopping the driver",
                                s.mountpoint.display()
                            );
                            phase = stopping(config, &board, true, 0);
                        }
                        ProxyEvent::DriverGone => {
                            board.update(|b| {
                                b.last_failure = Some("driver closed its channel".into())
                            });
                            tracing::error!(
                                "the driver closed its channel to {}",
                                s.mountpoint.display()
                            );
                            unmount(&s.mountpoint);
                            phase = stopping(config, &board, true, 1);
                        }
                    }
                }
            }
        }

        if child_ready {
            child_exit.drain();
        }
        // Reap on every turn: a SIGCHLD can be coalesced with another.
        for (pid, exit) in process::reap_all() {
            tracing::debug!("pid {pid} ended with {exit}");
            if pid == initial_pid {
                initial_exit = Some(exit);
                if let (Phase::Serving, Some(s)) = (&phase, &served) {
                    match process::holder_of_socket(s.channel_inode) {
                        Some(daemon) => {
                            tracing::info!("driver daemonized; pid {daemon} serves the mount");
                            board.update(|s| s.driver_pid = Some(daemon));
                        }
                        None => tracing::debug!("driver pid {pid} exited ({exit})"),
                    }
                }
            }
        }
        if !process::has_children() {
            match phase {
                Phase::Starting { .. } => {
                    return Ok(match initial_exit {
                        Some(exit) if exit != Exit::Code(0) => {
                            tracing::error!(
                                "driver `{driver_name}` failed before mounting ({exit})"
                            );
                            exit.shell_code()
                        }
                        _ => {
                            tracing::error!(
                                "`{driver_name}` exited without mounting a FUSE file system; is it a FUSE driver?"
                            );
                            1
                        }
                    });
                }
                Phase::Serving => {
                    let how = initial_exit.map_or_else(|| "exited".to_string(), |e| e.to_string());
                    if let Some(s) = &served {
                        tracing::error!(
                            "the driver of {} is gone ({how}); unmounting",
                            s.mountpoint.display()
                        );
                        unmount(&s.mountpoint);
                        log_stats(s);
                    }
                    return Ok(1);
                }
                Phase::Stopping {
                    exit_code,
                    driver_initiated,
                    ..
                } => {
                    if let Some(s) = &served {
                        log_stats(s);
                    }
                    // A driver that unmounts and fails (sshfs that cannot reach its server)
                    // has failed, whatever the unmount did.
                    if let Some(exit) =
                        initial_exit.filter(|e| driver_initiated && *e != Exit::Code(0))
                    {
                        tracing::error!("driver `{driver_name}` failed ({exit})");
                        return Ok(exit.shell_code());
                    }
                    return Ok(exit_code);
                }
            }
        }

        let now = Instant::now();
        match &mut phase {
            Phase::Starting { deadline } if now >= *deadline => {
                tracing::error!(
                    "`{driver_name}` did not mount a FUSE file system within {} ms; is it a FUSE driver?",
                    config.mount_timeout_ms
                );
                phase = stopping(config, &board, true, 1);
            }
            Phase::Stopping {
                deadline, killed, ..
            } if now >= *deadline && !*killed => {
                tracing::warn!(
                    "driver did not stop within {} ms; killing it",
                    config.stop_timeout_ms
                );
                process::signal_all(Signal::KILL);
                *killed = true;
                *deadline = now + config.stop_timeout();
            }
            _ => {}
        }
    }
}

/// Enters the stopping phase; with `signal`, asks every driver process to terminate.
fn stopping(config: &Config, board: &StatusBoard, signal: bool, exit_code: i32) -> Phase {
    board.update(|s| s.state = "stopping".into());
    if signal {
        process::signal_all(Signal::TERM);
    }
    Phase::Stopping {
        deadline: Instant::now() + config.stop_timeout(),
        killed: false,
        exit_code,
        driver_initiated: !signal,
    }
}

/// Unmounts, lazily if the file system is busy (the connection then dies with rebound).
fn unmount(mountpoint: &std::path::Path) {
    use rustix::mount::{unmount, UnmountFlags};
    match unmount(mountpoint, UnmountFlags::empty()) {
        Ok(()) => tracing::info!("unmounted {}", mountpoint.display()),
        Err(rustix::io::Errno::BUSY) => {
            if let Err(e) = unmount(mountpoint, UnmountFlags::DETACH) {
                tracing::warn!("lazy unmount of {}: {e}", mountpoint.display());
            } else {
                tracing::info!("{} is busy; detached it", mountpoint.display());
            }
        }
        // Already unmounted by the user or the driver.
        Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOENT) => {}
        Err(e) => tracing::warn!("unmount {}: {e}", mountpoint.display()),
    }
}

fn log_stats(served: &Served) {
    use std::sync::atomic::Ordering::Relaxed;
    let stats = &served.proxy.stats;
    let (nodes, handles) = served.proxy.held_objects();
    tracing::info!(
        "{}: {} requests, {} replies, {} notifications, {} refused driver messages; \
         the kernel still held {nodes} nodes and {handles} open handles",
        served.mountpoint.display(),
        stats.requests.load(Relaxed),
        stats.replies.load(Relaxed),
        stats.notifications.load(Relaxed),
        stats.refused.load(Relaxed),
    );
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
