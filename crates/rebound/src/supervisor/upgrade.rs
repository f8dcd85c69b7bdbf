//! `rebound upgrade`: the driver replaced by a new binary or a new command line, with the
//! mount and every open file kept.
//!
//! An upgrade is a restart by the operator with another `DriverCommand`: the old driver's
//! channel is closed and it gets `restart_grace_ms` to finish what it holds and exit by itself
//! (so its store is consistent, and `pre_restart` is skipped when it exited 0), then the new
//! one is brought to the old one's state on the recovery path (image rollback, redo log,
//! nodes, handles, waiting requests). A new driver that fails before it serves is not kept:
//! the previous command line comes back and serves again, and the operator is told.
//!
//! Owns: taking an upgrade request, checking the new command line, going back after a failed
//! one. Must not: restart the driver by any other path than `driver_failed`.

use std::ffi::OsString;

use super::command::DriverCommand;
use super::process::Exit;
use super::{standby, Cause, Phase, Run, Step};

impl Run<'_> {
    /// Starts an upgrade to `argv`, or to the driver's own command line with its executable
    /// opened anew. Refused (with why) unless the driver serves or the run has given up on
    /// it (an upgrade may bring the fix), or if the new command line does not name the mount
    /// point or its program cannot be opened.
    pub(super) fn on_upgrade(&mut self, argv: Option<Vec<OsString>>) -> Result<(), String> {
        if !matches!(self.phase, Phase::Serving | Phase::Failed { .. }) {
            return Err(format!(
                "the driver is not serving (state: {})",
                self.board.snapshot().state
            ));
        }
        let argv = argv.unwrap_or_else(|| self.command.argv.clone());
        let new = DriverCommand::new(argv).map_err(|e| format!("{e:#}"))?;
        if let Some(s) = &self.served {
            if !new.names(&s.mountpoint) {
                return Err(format!(
                    "the new command line does not name the mount point {}",
                    s.mountpoint.display()
                ));
            }
        }
        tracing::info!("upgrading the driver to `{}`", lossy(&new.argv).join(" "));
        self.standby_kind = standby::kind(self.config, &new.argv);
        self.upgrade_from = Some(std::mem::replace(&mut self.command, new));
        // The standby runs the old program.
        self.drop_standby("the driver is being upgraded", false);
        let driver = lossy(&self.command.argv);
        self.board.update(|b| b.driver = driver);
        match self.phase {
            Phase::Failed { .. } => {
                self.restarts.clear();
                self.phase = Phase::Recovering(Step::Backoff {
                    until: std::time::Instant::now(),
                });
                self.board.update(|b| b.state = "recovering".into());
            }
            _ => self.driver_failed("upgrade requested by the operator", Cause::Upgrade),
        }
        Ok(())
    }

    /// Whether the driver being replaced left its store as a clean exit does: an upgrade,
    /// and the old driver exited 0 by itself within its grace. (`pre_restart` is then not
    /// needed.)
    pub(super) fn upgraded_from_clean_exit(&self) -> bool {
        self.upgrade_from.is_some()
            && self.exited_by_itself
            && self.driver_exit == Some(Exit::Code(0))
    }

    /// The driver serves again after a restart: whether it was an upgrade's, now done (the
    /// caller counts it on the board with the restart, in one update).
    pub(super) fn upgrade_served(&mut self) -> bool {
        let upgraded = self.upgrade_from.take().is_some();
        if upgraded {
            tracing::info!("upgraded: `{}` serves", self.command.name);
        }
        upgraded
    }

    /// A new driver failed before it served: if it was an upgrade's, the previous command
    /// line takes its place again.
    pub(super) fn upgrade_failed(&mut self) {
        if let Some(previous) = self.upgrade_from.take() {
            let failed = lossy(&self.command.argv).join(" ");
            tracing::error!(
                "the upgraded driver failed before it served; going back to `{}`",
                lossy(&previous.argv).join(" ")
            );
            self.board.update(|b| {
                b.last_failure = Some(format!("`{failed}` failed before it served"));
            });
            self.standby_kind = standby::kind(self.config, &previous.argv);
            self.command = previous;
            self.drop_standby("the upgrade is undone", false);
            let driver = lossy(&self.command.argv);
            self.board.update(|b| b.driver = driver);
        }
    }
}

fn lossy(argv: &[OsString]) -> Vec<String> {
    argv.iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
}
