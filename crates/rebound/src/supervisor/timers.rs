//! What the clock decides: how long the supervisor's loop may wait, and on each turn, the
//! deadlines of every phase (a driver that does not mount, a request or probe unanswered, a
//! failed driver past its grace, the back-off over, the budget's retry, a stop taking too
//! long) and the serving driver's hoarding checks.
//!
//! Owns: the deadlines' handling. Must not: decide what a failure means (`restart` does).

use std::time::{Duration, Instant};

use rustix::process::Signal;

use super::restart::Cause;
use super::{process, start_driver, Phase, Run, Started, Step};
use crate::proxy::ProxyEvent;
use crate::sandbox::MountPoint;

impl Run<'_> {
    pub(super) fn poll_timeout(&self) -> Duration {
        let now = Instant::now();
        let until = |at: Instant| at.saturating_duration_since(now);
        let tick = Duration::from_millis(250);
        match &self.phase {
            Phase::Starting { deadline } => until(*deadline),
            Phase::Stopping {
                deadline, killed, ..
            } => {
                if *killed {
                    tick
                } else {
                    until(*deadline).min(tick)
                }
            }
            // A checkpoint lands within milliseconds of a recovery.
            Phase::Serving
                if (self.spare_waits && self.standby.is_none()) || self.spare_to_follow() =>
            {
                Duration::from_millis(5)
            }
            Phase::Serving | Phase::Recovering(Step::Restoring) => tick,
            Phase::Recovering(Step::Reaping {
                kill_at: Some(at), ..
            }) => until(*at).min(tick),
            Phase::Recovering(Step::Reaping { deadline, .. } | Step::Mounting { deadline }) => {
                until(*deadline).min(tick)
            }
            Phase::Recovering(Step::Backoff { until: at }) => until(*at),
            Phase::Failed { retry_at } => until(*retry_at),
        }
    }

    pub(super) fn on_tick(&mut self) -> anyhow::Result<()> {
        let now = Instant::now();
        self.take_over_from_dying_driver();
        self.answer_for_dying_driver_threads(now);
        self.kill_if_stuck(now);
        if self.holderless_since.is_some() {
            self.check_driver_beside();
        }
        match &mut self.phase {
            Phase::Starting { deadline } if now >= *deadline => {
                tracing::error!(
                    "`{}` did not mount a FUSE file system within {} ms; is it a FUSE driver?",
                    self.command.name,
                    self.config.mount_timeout_ms
                );
                self.phase = self.stopping(true, 1);
            }
            Phase::Serving
                if self
                    .served
                    .as_ref()
                    .is_some_and(|s| s.proxy.is_beside() && s.proxy.kernel_gone()) =>
            {
                // Fast mode: no reader of rebound's sees the unmount, and a driver stuck in
                // its teardown would never end to show it.
                self.on_proxy_event(ProxyEvent::KernelGone);
            }
            Phase::Serving => {
                if let Some(s) = &self.served {
                    // A second opinion costs a restart; never the last one of the budget, which
                    // is kept for a crash.
                    let window = self.config.restart_window();
                    let recent = self
                        .restarts
                        .iter()
                        .filter(|&&at| now.duration_since(at) < window)
                        .count() as u32;
                    s.proxy
                        .allow_second_opinions(recent + 1 < self.config.restart_budget);
                }
                let hang = self.served.as_ref().and_then(|s| {
                    s.proxy
                        .check_liveness(self.config.request_timeout(), self.config.probe_timeout())
                });
                self.check_helper_mount();
                let cause = hang.map(|why| (why, Cause::Hang)).or_else(|| {
                    let s = self.served.as_ref()?;
                    let requests = s
                        .proxy
                        .stats
                        .requests
                        .load(std::sync::atomic::Ordering::Relaxed);
                    self.watch
                        .check(
                            self.cgroup.as_ref(),
                            &self.config.limits,
                            requests,
                            s.proxy.waiting_since().is_some(),
                        )
                        .map(|why| (why, Cause::Hoarding))
                });
                self.publish_usage();
                if let Some((why, kind)) = cause {
                    self.driver_failed(&why, kind);
                } else {
                    self.keep_standby(now);
                }
            }
            Phase::Recovering(Step::Reaping {
                kill_at: Some(at), ..
            }) if now < *at => {}
            Phase::Recovering(Step::Reaping {
                deadline, kill_at, ..
            }) if now < *deadline => {
                if kill_at.take().is_some() {
                    tracing::warn!(
                        "the failed driver did not exit within restart_grace_ms ({} ms); killing it",
                        self.config.restart_grace_ms
                    );
                }
                // A driver that forks as fast as it can may have made new processes since
                // the last signal.
                process::signal_all(Signal::KILL, &self.standby_processes());
            }
            Phase::Recovering(Step::Reaping { deadline, .. }) if now >= *deadline => {
                tracing::warn!("processes of the failed driver do not exit; restarting anyway");
                // Fast mode: the successor is served through the proxy, which must hold the
                // queue first (the driver's read requests are resent; it reads no more, with
                // SIGKILL pending).
                self.take_over_queue();
                self.recovery_phase_done("reap");
                self.next_restart();
            }
            Phase::Recovering(Step::Backoff { until }) if now >= *until => {
                if !std::mem::take(&mut self.falling_back) {
                    self.restarts.push_back(now);
                }
                self.recovery_phase_done("backoff");
                // A standby on a spare of the image takes over with the spare as the image;
                // any other successor finds the image rolled back to the last checkpoint.
                let spare = self.usable_spare();
                self.spare_after = self
                    .served
                    .as_ref()
                    .and_then(|s| s.proxy.checkpoint_number());
                let mut swapped = false;
                if let Some(image) = &self.image {
                    if spare.is_some() {
                        match image.swap_in_spare() {
                            Ok(took) => {
                                swapped = true;
                                tracing::info!(
                                    "the standby's spare is the image now ({:.1} ms)",
                                    took.as_secs_f64() * 1000.0
                                );
                            }
                            Err(e) => tracing::error!("renaming the spare over the image: {e}"),
                        }
                    }
                    if !swapped {
                        self.roll_back_image();
                    }
                    self.recovery_phase_done("rollback");
                }
                if !self.config.pre_restart.is_empty() && !self.upgraded_from_clean_exit() {
                    self.run_pre_restart();
                    self.recovery_phase_done("pre_restart");
                }
                if spare.is_some() && !swapped {
                    self.drop_standby("it does not take over: its spare is not the image", false);
                }
                // After the store is repaired: a standby held before exec has not opened it.
                self.attaching_spare = swapped;
                if self.promote_standby(now)? {
                    return Ok(());
                }
                self.attaching_spare = false;
                if swapped {
                    // The image is the spare, which no one brings forward now.
                    self.roll_back_image();
                }
                // The new driver starts where the mount point is not mounted, as at its first
                // start (see `start_driver`); one that mounts through fusermount is shown the
                // mount once its mount(2) is answered (see `intercept`).
                let mountpoint = self.served.as_ref().map(|s| s.mountpoint.clone());
                let view = match &mountpoint {
                    Some(m) => MountPoint::Hidden(m),
                    None => MountPoint::Unknown,
                };
                self.watch.driver_started(self.cgroup.as_ref());
                let Started {
                    pid,
                    listener,
                    logger,
                    ..
                } = start_driver(
                    self.config,
                    &self.command,
                    view,
                    self.cgroup.as_ref(),
                    self.log_label.clone(),
                    (false, false),
                    None,
                )?;
                self.stderr_loggers.push(logger);
                tracing::info!("restarted driver `{}` as pid {pid}", self.command.name);
                self.listener = listener;
                self.listener_open = true;
                self.driver_pid = pid;
                self.driver_exit = None;
                self.holderless_since = None;
                self.board.update(|b| b.driver_pid = Some(pid));
                self.phase = Phase::Recovering(Step::Mounting {
                    deadline: now + self.config.mount_timeout(),
                });
            }
            Phase::Recovering(Step::Mounting { deadline }) if now >= *deadline => {
                tracing::error!(
                    "the new driver did not mount within {} ms",
                    self.config.mount_timeout_ms
                );
                self.restart_failed();
            }
            Phase::Failed { retry_at } if now >= *retry_at => {
                tracing::info!("trying the driver again");
                self.phase = Phase::Recovering(Step::Backoff { until: now });
                self.board.update(|b| b.state = "recovering".into());
            }
            Phase::Stopping {
                end_connection_at: at @ Some(_),
                ..
            } if at.is_some_and(|at| now >= at) => {
                *at = None;
                // Still running: it waits for its reads to end, as after a real unmount.
                if let Some(s) = &self.served {
                    s.proxy.disconnect_driver();
                }
            }
            Phase::Stopping {
                deadline, killed, ..
            } if now >= *deadline && !*killed => {
                tracing::warn!(
                    "driver did not stop within {} ms; killing it",
                    self.config.stop_timeout_ms
                );
                // Processes waiting on requests to the mount die only once answered.
                if let Some(s) = &self.served {
                    s.proxy.fail_requests();
                }
                process::signal_all(Signal::KILL, &[]);
                *killed = true;
                *deadline = now + self.config.stop_timeout();
            }
            _ => {}
        }
        Ok(())
    }

    /// Clones the image's last checkpoint back over it.
    fn roll_back_image(&self) {
        let Some(image) = &self.image else {
            return;
        };
        match image.roll_back() {
            Ok(took) => tracing::info!(
                "image rolled back to its last checkpoint in {:.1} ms",
                took.as_secs_f64() * 1000.0
            ),
            Err(e) => tracing::error!("rolling the image back: {e}"),
        }
    }
}
