//! What the supervisor hears: the proxy's events (a driver gone, misbehaving, restored,
//! initialised; a recovery measured), the end of processes (reaped, a driver that daemonized,
//! no driver process left in a phase), and the driver's cgroup figures put on the board.
//!
//! Owns: turning those into failures, phases and status. Must not: restart anything itself
//! (`restart` does).

use std::time::{Duration, Instant};

use super::process::{self, Exit};
use super::restart::Cause;
use super::{log_stats, unmount, Phase, Run, Step};
use crate::proxy::{ProxyEvent, Restored};

/// How long the status waits for a process of a driver that answered INIT to read its
/// channel before it names the likeliest one anyway.
const SETTLE: Duration = Duration::from_millis(500);
/// How long the mount's readiness waits for the process rebound started to exit once a
/// process of its own serves: a daemonizing driver's parent (gocryptfs) exits when its daemon
/// tells it the mount works, which is when the driver run directly would return.
const PARENT_WAIT: Duration = Duration::from_secs(5);
/// Fast mode: how long a serving driver process that holds no descriptor of the connection
/// is given to unmount or end before it counts as failed.
const HOLDERLESS_GRACE: Duration = Duration::from_secs(1);

/// What the status is to say once the driver's serving process is known.
#[derive(Debug, Clone, Copy)]
pub(super) enum Announcement {
    /// The first driver answered INIT.
    Ready,
    /// A successor was restored (and whether it was an upgrade's new driver).
    Recovered { upgraded: bool },
}

/// An announcement waiting for its serving process, from `since`.
#[derive(Debug)]
pub(super) struct PendingAnnouncement {
    what: Announcement,
    since: Instant,
}

impl Run<'_> {
    /// Puts `what` on the board (and tells the service manager) once a process of the driver
    /// reads the channel, or after SETTLE. A daemonizing driver (gocryptfs) answers INIT
    /// from its child while its parent, which rebound started and which leads the session,
    /// still holds the channel: named then, the status would name a process about to exit.
    /// The mount is ready once that parent has exited (see [`PARENT_WAIT`]): go-fuse drivers
    /// open a file of their own mount then (its "poll hack"), and gocryptfs deadlocks if a
    /// request that changes its user id comes first.
    fn announce(&mut self, what: Announcement) {
        if let Some(earlier) = self.announcing.take() {
            self.publish(earlier.what, None);
        }
        self.announcing = Some(PendingAnnouncement {
            what,
            since: Instant::now(),
        });
        self.settle_announcement();
    }

    /// Publishes the pending announcement if its serving process is known, its time is up,
    /// or the driver no longer serves.
    pub(super) fn settle_announcement(&mut self) {
        let (Some(pending), Some(s)) = (&self.announcing, &self.served) else {
            return;
        };
        let holder = self.channel_holder(s.channel_inode);
        let serving = matches!(self.phase, Phase::Serving);
        let waited = pending.since.elapsed();
        let unsettled = waited < SETTLE && !holder.is_some_and(|h| h.reading);
        let parent_waits = matches!(pending.what, Announcement::Ready)
            && waited < PARENT_WAIT
            && self.driver_exit.is_none()
            && holder.is_some_and(|h| h.pid != self.driver_pid);
        if serving && (unsettled || parent_waits) {
            return;
        }
        let what = pending.what;
        self.announcing = None;
        self.publish(what, holder.filter(|_| serving).map(|h| h.pid));
    }

    /// While an announcement waits: how soon to look again.
    pub(super) fn announcement_due(&self) -> Option<Duration> {
        self.announcing.as_ref().map(|_| Duration::from_millis(5))
    }

    fn publish(&mut self, what: Announcement, serving: Option<i32>) {
        self.board.update(|b| {
            match what {
                Announcement::Ready => b.ready = true,
                Announcement::Recovered { upgraded } => {
                    // (A driver that failed meanwhile is "recovering" again.)
                    if matches!(self.phase, Phase::Serving) {
                        b.state = "serving".into();
                    }
                    b.restarts += 1;
                    b.upgrades += u64::from(upgraded);
                }
            }
            if serving.is_some() {
                b.driver_pid = serving;
            }
        });
        let status = self.board.snapshot();
        self.service.serving(&status.mountpoint, status.restarts);
    }

    pub(super) fn on_proxy_event(&mut self, event: ProxyEvent) {
        if matches!(event, ProxyEvent::DriverGone) && self.unmount_follows_close() {
            return;
        }
        let Some(s) = &self.served else {
            return;
        };
        match event {
            ProxyEvent::KernelGone => {
                if !matches!(self.phase, Phase::Stopping { .. }) {
                    tracing::info!(
                        "{} was unmounted; stopping the driver",
                        s.mountpoint.display()
                    );
                    self.phase = self.stopping(true, 0);
                }
            }
            ProxyEvent::DriverGone if !s.proxy.driver_channel_closed() => {
                // Reported while the failed driver was current, read once its successor
                // was attached (the failure was found another way on the same turn).
                tracing::debug!("a driver that is no longer current closed its channel");
            }
            ProxyEvent::DriverGone => {
                let how = self
                    .driver_exit
                    .map_or_else(String::new, |e| format!(" ({e})"));
                self.driver_failed(&format!("driver closed its channel{how}"), Cause::Crash);
            }
            ProxyEvent::DriverMisbehaved => {
                let Some(why) = s.proxy.misbehaviour() else {
                    // Reported by a driver that failed another way before this was read.
                    tracing::debug!("a driver that is no longer current misbehaved");
                    return;
                };
                let kind = if why.ends_with(crate::proxy::SECOND_OPINION) {
                    Cause::SecondOpinion
                } else {
                    Cause::RefusedReply
                };
                self.driver_failed(&format!("misbehaved: {why}"), kind);
            }
            // Either event reads the outcome stored last, whichever it is: a failed restore's
            // event may be read after its successor's outcome replaced its own.
            ProxyEvent::Recovered | ProxyEvent::RecoveryFailed => match s.proxy.take_restored() {
                Some(Ok(restored)) => self.on_recovered(restored),
                Some(Err(why)) => {
                    tracing::error!("the new driver could not be restored: {why}");
                    self.restart_failed();
                }
                None => {}
            },
            ProxyEvent::Initialized => {
                if matches!(self.phase, Phase::Serving) {
                    self.announce(Announcement::Ready);
                }
                self.init_standby();
            }
            ProxyEvent::RecoveryMeasured => {
                for timing in s.proxy.take_recovery_timings() {
                    let phases: Vec<String> = timing
                        .phases
                        .iter()
                        .map(|(phase, ms)| format!("{phase} {ms:.1}"))
                        .collect();
                    tracing::info!(
                        "serving again {:.1} ms after the failure ({})",
                        timing.total_ms,
                        phases.join(", ")
                    );
                    self.board.record_recovery(&timing);
                }
            }
        }
    }

    fn on_recovered(&mut self, restored: Restored) {
        let Some(s) = &self.served else {
            return;
        };
        tracing::info!(
            "recovered {}: {} logged changes replayed, {} handles reopened, {} lost, \
                     {} nodes to look up as needed, {} waiting requests resent or settled, in \
                     {:.1} ms",
            s.mountpoint.display(),
            restored.replayed,
            restored.handles,
            restored.lost,
            restored.nodes,
            restored.resent,
            restored.restore_ms
        );
        if matches!(self.phase, Phase::Stopping { .. }) {
            // The mount went (a user's umount seen while the successor was restored): the run
            // stops; serving again would take the driver's own unmount for a failure to
            // restart from, and mount it anew.
            return;
        }
        let upgraded = self.upgrade_served();
        self.phase = Phase::Serving;
        self.announce(Announcement::Recovered { upgraded });
        // The next failure's successor, started now rather than at the next tick:
        // failures can come faster than ticks.
        self.keep_standby(Instant::now());
    }

    pub(super) fn reap(&mut self) {
        // Reap on every turn: a SIGCHLD can be coalesced with another.
        let reaped = process::reap_all();
        let any_reaped = !reaped.is_empty();
        for (pid, exit) in reaped {
            tracing::debug!("pid {pid} ended with {exit}");
            if Some(pid) == self.standby_pid() {
                if !self.standby_daemonized(exit) {
                    self.drop_standby(&format!("it ended ({exit})"), true);
                }
                continue;
            }
            if pid != self.driver_pid {
                // The daemon a driver became: how it ended is the failure's cause (the
                // process rebound started exited 0 when it daemonized). Only while it serves,
                // or stops because it unmounted by itself (sshfs whose ssh died unmounts and
                // exits 1: restarted); a driver rebound stopped ends with its leader's status.
                let its_own = matches!(
                    self.phase,
                    Phase::Serving
                        | Phase::Stopping {
                            driver_initiated: true,
                            ..
                        }
                );
                if its_own && Some(pid) == self.board.snapshot().driver_pid {
                    tracing::info!("the driver's serving process {pid} ended ({exit})");
                    self.driver_exit = Some(exit);
                }
                continue;
            }
            self.driver_exit = Some(exit);
            if let (Phase::Serving | Phase::Recovering(Step::Restoring), Some(s)) =
                (&self.phase, &self.served)
            {
                if let Some(daemon) = self.channel_holder(s.channel_inode) {
                    tracing::info!("driver daemonized; pid {} serves the mount", daemon.pid);
                    self.board.update(|s| s.driver_pid = Some(daemon.pid));
                }
            }
        }
        if any_reaped {
            self.check_driver_beside();
        }
    }

    /// The process serving through the channel with inode `inode` (see
    /// [`process::holder_of_channel`]). A socket is the channel's alone; `/dev/fuse` (fast
    /// mode, inode 0) is also held by a standby waiting at its `mount(2)`, which is left out.
    fn channel_holder(&self, inode: u64) -> Option<process::ChannelHolder> {
        let standby = if inode == 0 {
            self.standby_processes()
        } else {
            Vec::new()
        };
        process::holder_of_channel(inode, &standby)
    }

    /// Fast mode, once the failed driver is gone: the proxy serves the kernel's queue from now
    /// on, with the requests the driver had read put back in it.
    pub(super) fn take_over_queue(&mut self) {
        if let Some(s) = &self.served {
            match s.proxy.take_over() {
                Ok(true) => tracing::info!(
                    "the proxy took the kernel's queue over from the failed driver; {} is \
                     guarded from now on",
                    s.mountpoint.display()
                ),
                Ok(false) => {}
                Err(e) => tracing::error!("taking the kernel's queue over: {e}"),
            }
        }
    }

    /// Fast mode: a driver process that waits on its own mount cannot finish dying until its
    /// request is answered, and once the driver read it, only the driver (or rebound) can
    /// answer it. So once every driver process is dying and requests wait with none ending
    /// (for a second while it serves, which a working driver never lets happen; sooner while
    /// it is stopped or reaped), the proxy takes the queue over: the request is resent to
    /// it, and answered with the dying threads' others (see `answer_for_dying_driver_threads`).
    pub(super) fn take_over_from_dying_driver(&mut self) {
        let Some(s) = self.served.as_ref().filter(|s| s.proxy.is_beside()) else {
            return;
        };
        let quiet = match self.phase {
            Phase::Serving => Duration::from_secs(1),
            Phase::Stopping { .. } | Phase::Recovering(Step::Reaping { .. }) => {
                Duration::from_millis(200)
            }
            _ => return,
        };
        if !s.proxy.beside_stalled(quiet) || !process::all_dying(&self.standby_processes()) {
            return;
        }
        tracing::warn!(
            "the driver's processes are all dying, and requests it read wait: the proxy takes \
             the queue over to answer them"
        );
        if matches!(self.phase, Phase::Serving) {
            self.driver_failed(
                "driver process dying, held by a request it read",
                Cause::Crash,
            );
        }
        self.take_over_queue();
    }

    /// Fast mode, after a process ended: no channel closes when a driver dies beside the path,
    /// so its death is seen here, as no process of it holding the connection any more; an
    /// unmount is seen as the connection's end.
    pub(super) fn check_driver_beside(&mut self) {
        let Some(s) = self.served.as_ref().filter(|s| s.proxy.is_beside()) else {
            return;
        };
        if !matches!(self.phase, Phase::Serving) {
            return;
        }
        if s.proxy.kernel_gone() {
            return self.on_proxy_event(ProxyEvent::KernelGone);
        }
        if self.channel_holder(0).is_some() {
            self.holderless_since = None;
        } else {
            if !s.proxy.initialized() {
                // A daemonizing driver's parent exits once its daemon runs; a look at /proc
                // right then once found neither holding the connection (sshfs, once in 16
                // runs of the suite), and its daemon served a run that was stopping.
                // (A standby without a cgroup of its own shares the driver's.)
                let standby = self.standby_processes();
                let left = match &self.cgroup {
                    Some(cgroup) => cgroup.processes(),
                    None => process::descendants_except(&standby),
                };
                if left.iter().any(|pid| !standby.contains(pid)) {
                    return;
                }
                // It left before it answered INIT (sshfs that cannot reach its server): as in
                // guarded mode, its exit status ends the run; no restart would do better.
                tracing::info!("the driver left before it answered the kernel's INIT");
                self.phase = self.stopping(false, 0);
                return;
            }
            // A driver that unmounts by itself (libfuse's `fuse_kern_unmount`) closes its
            // descriptor first and calls `umount2` after: a look at /proc in between found
            // none holding the connection, with sshfs alive and about to unmount (1 run in
            // 15). So while its serving process runs on, the verdict waits, for its unmount
            // or its end, up to a grace the clock enforces (`on_tick`).
            let serving = self.board.snapshot().driver_pid;
            let since = *self.holderless_since.get_or_insert_with(Instant::now);
            if serving.is_some_and(process::runs_on) && since.elapsed() < HOLDERLESS_GRACE {
                tracing::debug!("no driver process holds the connection; its own runs on");
                return;
            }
            // Worded as in guarded mode, where the same death is seen as the processes gone.
            let how = self
                .driver_exit
                .map_or_else(String::new, |e| format!("{e}; "));
            self.driver_failed(
                &format!("driver process gone ({how}none holds the connection any more)"),
                Cause::Crash,
            );
        }
    }

    /// What the driver's cgroup used at the last hoarding check, on the board.
    pub(super) fn publish_usage(&self) {
        let usage = self.watch.latest();
        let cpu_ms = usage.cpu_ns / 1_000_000;
        let current = self.board.snapshot();
        if (
            current.driver_memory_bytes,
            current.driver_tasks,
            current.driver_cpu_ms,
        ) != (usage.anon_bytes, usage.tasks, cpu_ms)
        {
            self.board.update(|b| {
                b.driver_memory_bytes = usage.anon_bytes;
                b.driver_tasks = usage.tasks;
                b.driver_cpu_ms = cpu_ms;
            });
        }
    }

    /// Whether no process of the driver is left (a standby's do not count). While serving,
    /// looked for (beyond the cheap check for no child at all) only once a child exited this
    /// turn: the look reads `/proc`, and serving turns come with every intercepted splice.
    pub(super) fn driver_processes_gone(&self, child_exited: bool) -> bool {
        if !process::has_children() {
            return true;
        }
        if self.standby.is_none() {
            return false;
        }
        if matches!(self.phase, Phase::Serving) && !child_exited {
            return false;
        }
        let standby = self.standby_processes();
        process::children().iter().all(|pid| standby.contains(pid))
    }

    /// When no driver process is left: what that means in each phase. Returns the exit code
    /// when the run is over.
    pub(super) fn on_processes_gone(&mut self, child_exited: bool) -> Option<i32> {
        if !self.driver_processes_gone(child_exited) {
            return None;
        }
        let driver_name = &self.command.name;
        match self.phase {
            Phase::Starting { .. } => Some(match self.driver_exit {
                Some(exit) if exit != Exit::Code(0) => {
                    tracing::error!("driver `{driver_name}` failed before mounting ({exit})");
                    self.explain_sandbox();
                    exit.shell_code()
                }
                _ => {
                    tracing::error!(
                        "`{driver_name}` exited without mounting a FUSE file system; is it a FUSE driver?"
                    );
                    1
                }
            }),
            Phase::Serving => {
                if self
                    .served
                    .as_ref()
                    .is_some_and(|s| s.proxy.is_beside() && s.proxy.kernel_gone())
                {
                    self.on_proxy_event(ProxyEvent::KernelGone);
                    return None;
                }
                let how = self
                    .driver_exit
                    .map_or_else(|| "exited".to_string(), |e| e.to_string());
                self.driver_failed(&format!("driver process gone ({how})"), Cause::Crash);
                None
            }
            Phase::Recovering(Step::Reaping { kill_at, .. }) => {
                // (`kill_at` is taken when the kill is sent.)
                self.exited_by_itself = kill_at.is_some();
                self.take_over_queue();
                if self.reloading {
                    // Returns only if there is no successor to hand over to.
                    self.hand_over();
                }
                self.recovery_phase_done("reap");
                self.next_restart();
                None
            }
            Phase::Recovering(Step::Mounting { .. } | Step::Restoring) => {
                let how = self
                    .driver_exit
                    .map_or_else(|| "exited".to_string(), |e| e.to_string());
                tracing::error!("the new driver `{driver_name}` ended ({how}) before serving");
                self.restart_failed();
                self.next_restart();
                None
            }
            Phase::Recovering(Step::Backoff { .. }) | Phase::Failed { .. } => None,
            Phase::Stopping {
                exit_code,
                driver_initiated,
                killed,
                ..
            } => {
                let failed = self
                    .driver_exit
                    .filter(|e| driver_initiated && !killed && *e != Exit::Code(0));
                // Whether the mount has served: a driver that fails before it answers INIT
                // (sshfs that cannot reach its server) ends the run with its exit status. So
                // does one whose connection rebound ended (fast mode): nothing is left to
                // serve.
                let restartable = self
                    .served
                    .as_ref()
                    .is_some_and(|s| s.proxy.initialized() && !s.proxy.connection_ended());
                if let (Some(exit), true) = (failed, restartable) {
                    // It asked to unmount and then failed: a crash on its way out (a Rust
                    // driver's panic unwinds into its unmount). The mount is still rebound's:
                    // the driver is restarted.
                    self.phase = Phase::Serving;
                    self.driver_failed(
                        &format!("driver failed after it asked to unmount ({exit})"),
                        Cause::Crash,
                    );
                    return None;
                }
                if let Some(s) = &self.served {
                    log_stats(s);
                    if driver_initiated || s.proxy.connection_ended() {
                        unmount(&s.mountpoint);
                    }
                }
                if let Some(exit) = failed {
                    tracing::error!("driver `{driver_name}` failed ({exit})");
                    return Some(exit.shell_code());
                }
                Some(exit_code)
            }
        }
    }
}
