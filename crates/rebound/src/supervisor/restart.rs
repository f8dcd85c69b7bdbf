//! Failures and restarts: what the supervisor does once a driver has failed (or an operator
//! asked for a restart): the failure counted by cause, what is left of the driver stopped
//! (killed, or given its grace to exit by itself), the next restart scheduled within the
//! budget and its back-off, and what the budget's policy says once it is spent.
//!
//! Owns: the causes, the budget, the back-off, `pre_restart`. Must not: start a driver
//! (`start_driver` and the standby do) or restore one (the proxy's recovery does).

use std::process::Command;
use std::time::{Duration, Instant};

use rebound_sys::spawn;
use rustix::process::Signal;

use super::{process, unmount, Phase, Run, Step};
use crate::config::BudgetPolicy;

/// What made a driver fail, as `rebound status` counts failures (`failures_by_cause`).
#[derive(Clone, Copy, Debug)]
pub(super) enum Cause {
    /// Its processes died or its channel closed (a crash, a kill).
    Crash,
    /// A request or a liveness probe went unanswered.
    Hang,
    /// It sent a message the checks refused.
    RefusedReply,
    /// It gave an answer no working driver gives, which a restarted one is asked about.
    SecondOpinion,
    /// It took more than its limits allow, or was killed for it.
    Hoarding,
    /// `rebound restart`.
    Operator,
    /// `rebound upgrade`.
    Upgrade,
    /// `rebound reload` (the driver stopped for rebound's successor).
    Reload,
    /// Fast mode's observer loaded but could not attach to the mount: the first driver, started
    /// with fast mode's filter, is replaced by one with guarded mode's.
    Fallback,
    /// A new driver failed (in any way) while being brought to the old one's state.
    DuringRestore,
}

impl Cause {
    pub(super) fn name(self) -> &'static str {
        match self {
            Cause::Crash => "crash",
            Cause::Hang => "hang",
            Cause::RefusedReply => "refused_reply",
            Cause::SecondOpinion => "second_opinion",
            Cause::Hoarding => "hoarding",
            Cause::Operator => "operator",
            Cause::Upgrade => "upgrade",
            Cause::Reload => "reload",
            Cause::Fallback => "fallback",
            Cause::DuringRestore => "during_restore",
        }
    }
}

impl Run<'_> {
    pub(super) fn on_restart_command(&mut self) {
        match self.phase {
            Phase::Serving => {
                self.driver_failed("restart requested by the operator", Cause::Operator)
            }
            Phase::Failed { .. } => {
                tracing::info!("restart requested by the operator");
                self.restarts.clear();
                self.phase = Phase::Recovering(Step::Backoff {
                    until: Instant::now(),
                });
                self.board.update(|b| b.state = "recovering".into());
            }
            _ => {}
        }
    }

    /// The serving driver failed (`kind` of failure, `cause` in words): kill what is left of
    /// it and start the way back.
    pub(super) fn driver_failed(&mut self, cause: &str, kind: Cause) {
        if !matches!(
            self.phase,
            Phase::Serving | Phase::Recovering(Step::Restoring)
        ) {
            return;
        }
        let Some(s) = &self.served else {
            return;
        };
        // A process the kernel killed for the memory limit shows as a death or a closed
        // channel; name the reason.
        let hoarding = self
            .watch
            .death_cause(self.cgroup.as_ref(), &self.config.limits);
        let (cause, kind) = match &hoarding {
            Some(hoarding) => (format!("{hoarding} ({cause})"), Cause::Hoarding),
            None => (cause.to_string(), kind),
        };
        if matches!(self.phase, Phase::Recovering(_)) {
            tracing::error!("the new driver failed while being restored: {cause}");
            self.restart_failed();
            return;
        }
        self.count_failure(kind);
        tracing::error!(
            "driver of {} failed: {cause}; restarting it",
            s.mountpoint.display()
        );
        self.service.status(&format!("recovering: {cause}"));
        s.proxy.driver_failed();
        self.board.update(|b| {
            b.state = "recovering".into();
            b.failures += 1;
            b.last_failure = Some(cause.clone());
        });
        // A driver that still works may finish what it holds (its channel is closed now);
        // a dead, dying or hung one is killed.
        let grace = match kind {
            Cause::RefusedReply
            | Cause::SecondOpinion
            | Cause::Operator
            | Cause::Upgrade
            | Cause::Reload
            | Cause::Fallback => self.config.restart_grace(),
            Cause::Crash | Cause::Hang | Cause::Hoarding | Cause::DuringRestore => Duration::ZERO,
        };
        self.stop_driver(grace);
    }

    /// A restart did not bring a working driver: try again, within the budget.
    pub(super) fn restart_failed(&mut self) {
        self.count_failure(Cause::DuringRestore);
        self.upgrade_failed();
        if let Some(s) = &self.served {
            s.proxy.driver_failed();
        }
        self.stop_driver(Duration::ZERO);
    }

    /// Ends the failed driver's processes (their channel is closed): `grace` to exit by
    /// themselves before SIGKILL, or (no grace) SIGKILL at once.
    pub(super) fn stop_driver(&mut self, grace: Duration) {
        if let Some(s) = &self.served {
            s.proxy.fail_requests_of_driver();
        }
        // Known once its processes are all gone (see `on_processes_gone`).
        self.exited_by_itself = false;
        let now = Instant::now();
        let beside = self.served.as_ref().is_some_and(|s| s.proxy.is_beside());
        let kill_at = if grace.is_zero() {
            process::signal_all(Signal::KILL, &self.standby_processes());
            None
        } else {
            // Guarded, no SIGTERM: libfuse, its loop ended by the closed channel, restores
            // the default action before it flushes, and the signal would then kill it
            // mid-flush. Beside the path no channel of rebound's closes to end its loop: one
            // SIGTERM does, and its handler (still libfuse's) lets it flush. (A stopped
            // driver is continued, so that it sees either.)
            if beside {
                process::signal_all(Signal::TERM, &self.standby_processes());
            }
            process::signal_all(Signal::CONT, &self.standby_processes());
            Some(now + grace)
        };
        self.phase = Phase::Recovering(Step::Reaping {
            since: now,
            deadline: now + grace + Duration::from_secs(10),
            kill_at,
        });
    }

    pub(super) fn count_failure(&self, kind: Cause) {
        self.board.update(|b| {
            *b.failures_by_cause.entry(kind.name().into()).or_default() += 1;
        });
    }

    /// The recovery under way has passed `phase` (see `proxy::RecoveryTiming`).
    pub(super) fn recovery_phase_done(&self, phase: &'static str) {
        if let Some(s) = &self.served {
            s.proxy.recovery_phase_done(phase);
        }
    }

    /// The failed driver is gone: schedule the next restart, or apply the budget's policy.
    pub(super) fn next_restart(&mut self) {
        let now = Instant::now();
        let window = self.config.restart_window();
        while self
            .restarts
            .front()
            .is_some_and(|&at| now.duration_since(at) >= window)
        {
            self.restarts.pop_front();
        }
        let recent = self.restarts.len() as u32;
        // (A first driver replaced for its filter is no failure the budget is for; the flag
        // is taken when the restart starts, which then counts nothing either.)
        if recent >= self.config.restart_budget && !self.falling_back {
            self.budget_spent();
            return;
        }
        let backoff = if recent == 0 {
            Duration::ZERO
        } else {
            self.config
                .restart_backoff()
                .saturating_mul(1 << (recent - 1).min(16))
                .min(self.config.restart_backoff_max())
        };
        self.phase = Phase::Recovering(Step::Backoff {
            until: now + backoff,
        });
    }

    pub(super) fn budget_spent(&mut self) {
        let budget = self.config.restart_budget;
        let window_ms = self.config.restart_window_ms;
        let Some(s) = &self.served else {
            return;
        };
        match self.config.on_budget_exhausted {
            BudgetPolicy::FailRequests => {
                tracing::error!(
                    "{budget} restarts within {window_ms} ms: giving up for now; requests to {} \
                     fail with EIO until a later restart succeeds",
                    s.mountpoint.display()
                );
                s.proxy.fail_requests();
                self.board.update(|b| b.state = "failed".into());
                let retry_at = self
                    .restarts
                    .front()
                    .map_or_else(Instant::now, |&at| at + self.config.restart_window());
                self.phase = Phase::Failed { retry_at };
            }
            BudgetPolicy::Unmount => {
                tracing::error!(
                    "{budget} restarts within {window_ms} ms: giving up; unmounting {}",
                    s.mountpoint.display()
                );
                unmount(&s.mountpoint);
                s.proxy.fail_requests();
                // The driver is dead, but a standby may be starting: it goes too, and the
                // keeper is told (the run ends on purpose, with failure).
                self.phase = self.stopping(true, 1);
            }
        }
    }

    /// Runs the configured `pre_restart` command, bounded by the mount timeout, where the
    /// mount point is not mounted (see [`spawn::outside_mount`]).
    pub(super) fn run_pre_restart(&self) {
        let (Some((program, args)), Some(s)) =
            (self.config.pre_restart.split_first(), &self.served)
        else {
            return;
        };
        let started = Instant::now();
        let mut command = Command::new(program);
        command
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null());
        let outcome = spawn::outside_mount(&mut command, &s.mountpoint)
            .and_then(|()| command.spawn())
            .and_then(|mut child| {
                let deadline = started + self.config.mount_timeout();
                loop {
                    if let Some(status) = child.try_wait()? {
                        return Ok(status);
                    }
                    if Instant::now() >= deadline {
                        let _ = child.kill();
                        return child.wait();
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            });
        match outcome {
            Ok(status) => tracing::info!(
                "pre_restart `{}` ended with {status} after {} ms",
                self.config.pre_restart.join(" "),
                started.elapsed().as_millis()
            ),
            Err(e) => tracing::warn!("pre_restart `{program}`: {e}"),
        }
    }
}
