//! How a run ends: an operator's stop signal, a driver's own unmount after it closed its
//! channel, the stopping phase, the final clean-up, and what should happen at rebound's own
//! death (the keeper, given the mount while it serves).
//!
//! Owns: the way out of a run. Must not: decide that a driver failed (that is `events` and
//! `restart`) or touch FUSE messages.

use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::process::Signal;

use super::{process, Phase, Run, Served};
use crate::cgroup::DriverCgroup;
use crate::keeper::KeptMount;

/// How long a stopping driver may sit idle after its mount went away (see
/// [`Run::kill_if_stuck`]), at most: half of `stop_timeout_ms` if that is shorter, so that
/// a stuck driver is told from a slow one within the time a user allowed.
const STUCK_AT_STOP: Duration = Duration::from_secs(10);

impl Run<'_> {
    pub(super) fn on_stop_signal(&mut self) {
        match &mut self.phase {
            Phase::Stopping { killed, .. } => {
                // A second request to stop: the operator does not want to wait for the
                // driver to finish writing.
                if !*killed {
                    tracing::warn!("second stop signal: killing the driver");
                    if let Some(s) = &self.served {
                        s.proxy.fail_requests();
                    }
                    process::signal_all(Signal::KILL, &[]);
                    *killed = true;
                }
            }
            _ => {
                tracing::info!("stopping on signal");
                if let Some(s) = &self.served {
                    if matches!(self.phase, Phase::Recovering(_) | Phase::Failed { .. }) {
                        // No driver will answer what waits.
                        s.proxy.fail_requests();
                    }
                    unmount(&s.mountpoint);
                }
                self.phase = self.stopping(true, 0);
            }
        }
    }

    /// Whether a driver that closed its channel is unmounting, an orderly end rather than a
    /// failure. libfuse closes the channel first and then unmounts (`fuse_kern_unmount`), so
    /// while the process that served still runs (not dying: a crash closes the channel as the
    /// process dies), its `umount2` may be on the way: waited for, briefly.
    pub(super) fn unmount_follows_close(&mut self) -> bool {
        const GRACE: Duration = Duration::from_millis(200);
        let serving = self.board.snapshot().driver_pid.unwrap_or(self.driver_pid);
        if !matches!(self.phase, Phase::Serving) || !process::runs_on(serving) {
            return false;
        }
        let deadline = Instant::now() + GRACE;
        while self.listener_open && process::runs_on(serving) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let mut fds = [PollFd::new(&self.listener, PollFlags::IN)];
            let wait = Timespec::try_from(left.min(Duration::from_millis(10))).ok();
            if matches!(poll(&mut fds, wait.as_ref()), Ok(n) if n > 0) {
                if let Err(e) = self.on_intercepted_call() {
                    tracing::debug!("a call while the channel closed: {e}");
                }
                if !matches!(self.phase, Phase::Serving) {
                    return true;
                }
            }
        }
        false
    }

    /// The run is over and no driver process is left: its log lines are written, its cgroup
    /// removed, its slot of the host's forget program given up (which the last run to stop
    /// detaches).
    pub(super) fn finish(&mut self) {
        self.end_keeping();
        rebound_observe::leave_shared_forgets(&crate::keeper::shared_forget_pins());
        for logger in self.stderr_loggers.drain(..) {
            let _ = logger.join();
        }
        for cgroup in [&self.cgroup, &self.standby_cgroup].into_iter().flatten() {
            cgroup.remove();
        }
    }

    /// Gives the keeper the mount once it serves (the kernel queues, what a successor must
    /// know) and starts the tracker's journal. Without either, rebound's death loses the
    /// mount (said once). In fast mode the keeper also takes the driver's own descriptors on
    /// the connection at rebound's death, and the successor what the observer, pinned, saw
    /// last (see `keeper`).
    pub(super) fn keep_mount(&mut self) {
        let (Some(keeper), Some(s)) = (&mut self.keeper, &self.served) else {
            return;
        };
        let journal = crate::keeper::journal_dir(std::process::id());
        let kept = KeptMount {
            argv: self.command.argv_bytes(),
            config: self.config.source.clone(),
            mountpoint: s.mountpoint.clone(),
            mounted_by_helper: s.mounted_by_helper,
            journal: journal.clone(),
            cgroup_procs: self
                .cgroup
                .iter()
                .chain(&self.standby_cgroup)
                .flat_map(DriverCgroup::procs_files)
                .collect(),
        };
        let kept = s
            .proxy
            .keep_journal(&journal)
            .and_then(|()| keeper.keep_mount(kept, &s.proxy.kernel_queues_fds()));
        match kept {
            // (The periodic one may not come before a death: the keeper's must be current.)
            Ok(()) => keeper.status_now(self.board.snapshot()),
            Err(e) => {
                tracing::warn!(
                    "the keeper cannot keep the mount ({e}): should rebound die, it is lost"
                );
                self.end_keeping();
            }
        }
    }

    /// The keeper exits without taking over, and the journal goes, and the observer's pins
    /// (it stays attached while rebound holds it).
    pub(super) fn end_keeping(&mut self) {
        if let Some(mut keeper) = self.keeper.take() {
            keeper.end();
            rebound_observe::remove_pins(&crate::keeper::pins_of(std::process::id()));
        }
        if let Some(s) = &self.served {
            s.proxy.remove_journal();
        }
    }

    /// Stopping, once the mount is gone (nothing is left for the driver to serve or flush to
    /// it): a driver whose processes have neither used CPU, read or written anything, nor
    /// waited on a device for [`STUCK_AT_STOP`] (or half of `stop_timeout_ms`) is stuck in
    /// its teardown, and is killed rather than waited for until `stop_timeout_ms`. libfuse's multithreaded loop cancels
    /// its workers at the end, and one cancelled holding the driver's lock leaves the join
    /// waiting forever. A driver still writing its store (fuse2fs closing its image) runs or
    /// waits on the disk, and is waited for.
    pub(super) fn kill_if_stuck(&mut self, now: Instant) {
        let Phase::Stopping {
            killed: false,
            quiet,
            ..
        } = &mut self.phase
        else {
            return;
        };
        let gone = self
            .served
            .as_ref()
            .is_some_and(|s| s.proxy.kernel_gone() || s.proxy.connection_ended());
        if !gone {
            return;
        }
        let (progress, busy) = process::activity(&process::descendants());
        match *quiet {
            _ if busy => *quiet = None,
            Some((since, before)) if before == progress => {
                let stuck_after = STUCK_AT_STOP.min(self.config.stop_timeout() / 2);
                if now.duration_since(since) < stuck_after {
                    return;
                }
                tracing::warn!(
                    "the driver has made no progress for {:.1} s since its mount went away: \
                     stuck in its teardown; killing it",
                    stuck_after.as_secs_f64()
                );
                process::signal_all(Signal::KILL, &[]);
                if let Phase::Stopping { killed, .. } = &mut self.phase {
                    *killed = true;
                }
            }
            _ => *quiet = Some((now, progress)),
        }
    }

    /// Enters the stopping phase; with `signal`, asks every driver process to terminate.
    pub(super) fn stopping(&mut self, signal: bool, exit_code: i32) -> Phase {
        self.board.update(|s| s.state = "stopping".into());
        self.service.stopping();
        // Stopped on purpose: rebound's death from now on must not bring the mount back.
        self.end_keeping();
        self.drop_standby("the run is stopping", false);
        if signal {
            process::signal_all(Signal::TERM, &[]);
        }
        Phase::Stopping {
            deadline: Instant::now() + self.config.stop_timeout(),
            killed: false,
            exit_code,
            driver_initiated: !signal,
            quiet: None,
            end_connection_at: None,
        }
    }
}

/// Unmounts, lazily if the file system is busy (the connection then dies with rebound).
pub(super) fn unmount(mountpoint: &std::path::Path) {
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

pub(super) fn log_stats(served: &Served) {
    use std::sync::atomic::Ordering::Relaxed;
    let stats = &served.proxy.stats;
    let (nodes, handles) = served.proxy.held_objects();
    tracing::info!(
        "{}: {} requests, {} replies, {} notifications, {} refused driver messages, {} requests \
         resent after restarts; the kernel still held {nodes} nodes and {handles} open handles",
        served.mountpoint.display(),
        stats.requests.load(Relaxed),
        stats.replies.load(Relaxed),
        stats.notifications.load(Relaxed),
        stats.refused.load(Relaxed),
        stats.resent.load(Relaxed),
    );
}
