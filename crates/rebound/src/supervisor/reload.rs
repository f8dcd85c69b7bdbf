//! `rebound reload`: this run's rebound replaced by the binary now installed, with the mount
//! kept (JuiceFS's smooth upgrade, CernVM-FS's reload, for every driver).
//!
//! The proxy is drained (the driver is sent nothing new and answers what it holds; in fast
//! mode there is nothing to drain: the take-over resends what the driver had read), the
//! driver stopped gracefully (its channel closed, or in fast mode one SIGTERM, and
//! `restart_grace_ms` to flush and exit), and,
//! once it exited by itself, rebound writes its state to `RUN_DIR/<pid>.handover` and execs
//! the installed binary as `rebound run --resume FILE`, keeping its pid and the kernel's
//! `/dev/fuse` descriptors. The successor reads the file, builds its proxy over those
//! descriptors with the object tracker and the redo log handed over, asks the kernel to send
//! again what its predecessor had read (`FUSE_NOTIFY_RESEND`), and starts a driver on the
//! recovery path, which brings it to the kernel's state. Applications wait, and see no error.
//! A driver that does not exit by itself, or a hand-over that cannot be written, ends the
//! reload: the driver is restarted here, as after a failure.
//!
//! Owns: the hand-over file and the exec. Must not: keep anything of the predecessor but what
//! the file says and the descriptors it names.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use super::restart::Cause;
use super::{Phase, Run, Served, Step};
use crate::control::{self, MountStatus};
use crate::keeper::KeptMount;
use crate::proxy::{HandOver, Proxy};

/// How long the driver gets to answer what it was sent before the hand-over.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// What a successor rebound is handed.
#[derive(Debug, Serialize, Deserialize)]
pub struct Succession {
    /// The driver's command line, as bytes.
    argv: Vec<Vec<u8>>,
    /// The config file the run was started with (read again: a reload takes its changes).
    pub config: Option<PathBuf>,
    mountpoint: PathBuf,
    mounted_by_helper: bool,
    status: MountStatus,
    proxy: HandOver,
    /// Set when the predecessor died and its keeper took over (see `keeper`).
    #[serde(default)]
    pub death: Option<Death>,
}

/// How a predecessor rebound died.
#[derive(Debug, Serialize, Deserialize)]
pub struct Death {
    pub pid: u32,
}

impl Succession {
    /// Reads (and removes) the hand-over file `path`, and takes the kernel queues it names.
    pub fn take(path: &Path) -> anyhow::Result<Succession> {
        let text = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let _ = std::fs::remove_file(path);
        let mut succession: Succession = serde_json::from_slice(&text)
            .with_context(|| format!("{}: not a hand-over", path.display()))?;
        succession
            .proxy
            .inherit_queues()
            .context("taking the kernel queues over")?;
        Ok(succession)
    }

    /// The succession a keeper builds when its rebound died.
    pub fn after_death(
        kept: &KeptMount,
        status: MountStatus,
        proxy: HandOver,
        death: Death,
    ) -> Succession {
        Succession {
            argv: kept.argv.clone(),
            config: kept.config.clone(),
            mountpoint: kept.mountpoint.clone(),
            mounted_by_helper: kept.mounted_by_helper,
            status,
            proxy,
            death: Some(death),
        }
    }

    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    pub fn argv(&self) -> Vec<OsString> {
        self.argv.iter().cloned().map(OsString::from_vec).collect()
    }
}

/// The rebound binary now installed where this one was started from.
pub fn installed_binary() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("finding rebound's binary")?;
    // Replaced by a package upgrade, the old file shows as deleted: the path has the new.
    Ok(PathBuf::from(
        exe.to_string_lossy()
            .trim_end_matches(" (deleted)")
            .to_string(),
    ))
}

impl Run<'_> {
    /// Starts a reload: drains the driver and stops it gracefully. Refused (with why) unless
    /// the driver serves; a driver that still holds requests after the drain's timeout is
    /// restarted instead (the reload is off).
    pub(super) fn on_reload(&mut self) -> Result<(), String> {
        let Some(s) = &self.served else {
            return Err("the driver is not serving".into());
        };
        if !matches!(self.phase, Phase::Serving) || self.learner.is_some() {
            return Err("the driver is not serving (or the run is learning)".into());
        }
        let started = Instant::now();
        // Beside the path no request crosses the proxy, so none can be held back for a drain:
        // the driver is stopped as it is, and the take-over resends what it had read.
        if !s.proxy.is_beside() && !s.proxy.drain(DRAIN_TIMEOUT) {
            self.driver_failed("a reload's drain timed out", Cause::Operator);
            return Err(format!(
                "the driver still held requests after {} s; it was restarted instead",
                DRAIN_TIMEOUT.as_secs()
            ));
        }
        if s.proxy.is_beside() {
            tracing::info!("reloading rebound: stopping the driver (fast mode: no drain)");
        } else {
            tracing::info!(
                "reloading rebound: the driver answered what it held in {:.1} ms; stopping it",
                started.elapsed().as_secs_f64() * 1000.0
            );
        }
        self.service.reloading();
        self.reloading = true;
        self.drop_standby("rebound is reloading", false);
        self.driver_failed("reload requested by the operator", Cause::Reload);
        Ok(())
    }

    /// The stopped driver's processes are gone: hands over to the successor (does not return
    /// if it can), or says why not (the driver is then restarted here).
    pub(super) fn hand_over(&mut self) {
        self.reloading = false;
        if !self.exited_by_itself {
            tracing::error!(
                "reload: the driver did not exit by itself within restart_grace_ms; it is \
                 restarted here instead"
            );
            return;
        }
        let Err(e) = self.exec_successor() else {
            return;
        };
        tracing::error!("reload: {e:#}; the driver is restarted here instead");
    }

    fn exec_successor(&mut self) -> anyhow::Result<()> {
        let s = self.served.as_ref().context("nothing served")?;
        let succession = Succession {
            argv: self.command.argv_bytes(),
            config: self.config.source.clone(),
            mountpoint: s.mountpoint.clone(),
            mounted_by_helper: s.mounted_by_helper,
            status: self.board.snapshot(),
            proxy: s.proxy.hand_over(),
            death: None,
        };
        let path = control::run_dir().join(format!("{}.handover", std::process::id()));
        std::fs::write(&path, serde_json::to_vec(&succession)?)
            .with_context(|| format!("writing {}", path.display()))?;
        // (The cgroups stay: the successor, with the same pid, takes the same ones over, with
        // the limits of the config it reads again; should the exec fail, this run keeps them.)
        let exe = installed_binary()?;
        tracing::info!(
            "reload: handing {} over to {}",
            s.mountpoint.display(),
            exe.display()
        );
        s.proxy
            .keep_queues_across_exec(true)
            .context("keeping the kernel queues across exec")?;
        // The successor starts its own keeper; this one must not take the mount over.
        if let Some(mut keeper) = self.keeper.take() {
            keeper.end();
        }
        let e = std::process::Command::new(&exe)
            .arg("run")
            .arg("--resume")
            .arg(&path)
            .exec();
        // Still here: no successor. No driver started from now on may inherit the queues.
        let _ = s.proxy.keep_queues_across_exec(false);
        let _ = std::fs::remove_file(&path);
        Err(e).with_context(|| format!("exec {}", exe.display()))
    }

    /// The successor's side: the mount served by a proxy over the inherited kernel queues,
    /// the status carried on, and the recovery path started for a new driver.
    pub(super) fn resume(&mut self, succession: Succession) -> anyhow::Result<()> {
        let events = self.events_tx.take().context("second mount")?;
        let proxy = Proxy::resume(succession.proxy, events, self.proxy_options())
            .context("taking the kernel connection over")?;
        self.board
            .attach(proxy.stats.clone(), Box::new(proxy.held_objects_reader()));
        let status = succession.status;
        let died = succession.death.is_some();
        // (A keeper's status may be older than the kernel's INIT: the journal is not.)
        let ready = status.ready || proxy.initialized();
        self.board.update(|b| {
            *b = MountStatus {
                ready,
                state: "recovering".into(),
                driver_pid: None,
                standby_pid: None,
                rebound_pid: std::process::id(),
                reloads: status.reloads + u64::from(!died),
                rebound_deaths: status.rebound_deaths + u64::from(died),
                ..status
            };
        });
        *self.log_label.lock().unwrap_or_else(|e| e.into_inner()) =
            succession.mountpoint.display().to_string();
        match &succession.death {
            Some(death) => tracing::info!(
                "took {} over from rebound pid {}, which died; starting its driver",
                succession.mountpoint.display(),
                death.pid
            ),
            None => tracing::info!(
                "took {} over from the previous rebound; starting its driver",
                succession.mountpoint.display()
            ),
        }
        self.served = Some(Served {
            in_mount_table: crate::paths::in_mount_table(&succession.mountpoint),
            mountpoint: succession.mountpoint,
            channel_inode: 0,
            proxy,
            mounted_by_helper: succession.mounted_by_helper,
        });
        self.keep_mount();
        self.phase = Phase::Recovering(Step::Backoff {
            until: Instant::now(),
        });
        Ok(())
    }
}
