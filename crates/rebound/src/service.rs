//! What rebound tells the service manager that started it, by systemd's `sd_notify`
//! protocol (the `sd-notify` crate): `READY=1` once the mount serves (the driver answered the
//! kernel's INIT), a `STATUS=` line at each change, `WATCHDOG=1` while the supervisor's loop
//! turns (at half the interval systemd asks for), `STOPPING=1` when the run stops. Nothing
//! without `NOTIFY_SOCKET`, so the same binary runs in a terminal, a unit or a test.
//!
//! Owns: the notifications and their pacing. Must not: decide anything about the run.

use std::time::{Duration, Instant};

use sd_notify::NotifyState;

pub struct ServiceManager {
    /// A service manager listens (`NOTIFY_SOCKET` is set).
    listening: bool,
    /// How often systemd wants a `WATCHDOG=1`, if at all (`WatchdogSec=`).
    watchdog: Option<Duration>,
    last_ping: Instant,
    ready: bool,
}

impl ServiceManager {
    /// The service manager of this process, as its environment names it.
    pub fn from_env() -> ServiceManager {
        let mut usec = 0;
        let watchdog =
            sd_notify::watchdog_enabled(false, &mut usec).then(|| Duration::from_micros(usec));
        ServiceManager {
            listening: std::env::var_os("NOTIFY_SOCKET").is_some(),
            watchdog,
            last_ping: Instant::now(),
            ready: false,
        }
    }

    fn send(&self, states: &[NotifyState]) {
        if self.listening {
            if let Err(e) = sd_notify::notify(false, states) {
                tracing::debug!("sd_notify: {e}");
            }
        }
    }

    /// The mount serves (the first time: `READY=1`).
    pub fn serving(&mut self, mountpoint: &str, restarts: u32) {
        let status = format!("serving {mountpoint} ({restarts} restarts)");
        if self.ready {
            self.send(&[NotifyState::Status(&status)]);
        } else {
            self.ready = true;
            self.send(&[NotifyState::Ready, NotifyState::Status(&status)]);
        }
    }

    /// Something worth a status line happened (a failure and its recovery).
    pub fn status(&self, text: &str) {
        self.send(&[NotifyState::Status(text)]);
    }

    /// The supervisor's loop turned: feeds the watchdog when half its interval has passed.
    pub fn loop_turned(&mut self) {
        let Some(interval) = self.watchdog else {
            return;
        };
        if self.last_ping.elapsed() >= interval / 2 {
            self.last_ping = Instant::now();
            self.send(&[NotifyState::Watchdog]);
        }
    }

    /// The run hands its mount over to a successor, which says READY again.
    pub fn reloading(&mut self) {
        self.send(&[NotifyState::Reloading]);
    }

    pub fn stopping(&self) {
        self.send(&[NotifyState::Stopping]);
    }
}

/// The variables of the service manager's protocol, which a driver must not inherit (it would
/// speak for rebound's unit).
pub const PRIVATE_VARIABLES: &[&str] = &["NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"];
