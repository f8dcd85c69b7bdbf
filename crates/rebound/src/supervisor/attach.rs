//! What the driver's intercepted calls lead to: its first `mount(2)` starts the proxy (or,
//! in fast mode, the observation beside the driver's own queue), a new driver's channel is
//! attached to the mount for its state to be restored, an unmount ends the run, and a denied
//! system call is logged once.
//!
//! Owns: turning an [`Intercepted`] outcome into the run's next phase. Must not: decode the
//! calls themselves (that is `intercept`) or touch FUSE messages (that is the proxy).

use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use anyhow::Context;
use rebound_sys::seccomp;

use super::intercept::{self, Intercepted};
use super::{process, Phase, Run, Served, Step};
use crate::config::Profile;
use crate::proxy::{Proxy, ProxyOptions};

/// How long a fast-mode driver that unmounted by itself has to exit before its connection is
/// ended: one that fails on its way out does so within milliseconds (sshfs, a Rust driver's
/// panic unwinding into its unmount).
const UNMOUNTED_DRIVER_EXIT: Duration = Duration::from_millis(500);

impl Run<'_> {
    pub(super) fn on_intercepted_call(&mut self) -> anyhow::Result<()> {
        let notif = match seccomp::receive(self.listener.as_fd()) {
            Ok(notif) => notif,
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::NOENT.raw_os_error()) => {
                return Ok(())
            }
            Err(e) => {
                tracing::debug!("seccomp receive: {e}");
                return Ok(());
            }
        };
        self.on_intercepted(&notif)
    }

    /// Handles one call of the current driver (one just received, or the held mount of a
    /// standby that has just become the driver).
    pub(super) fn on_intercepted(&mut self, notif: &seccomp::Notification) -> anyhow::Result<()> {
        // From the moment a failure is seen: a driver being killed may still unmount (sshfs
        // does when its ssh process dies first), and that must not take the mount down.
        let recovering = matches!(self.phase, Phase::Recovering(_));
        let ours = self.served.as_ref().map(|s| intercept::Served {
            mountpoint: &s.mountpoint,
            channel_inode: s.channel_inode,
            proxy: &s.proxy,
            recovering,
        });
        let sandboxed = self.config.sandbox.profile != Profile::Off;
        let driver_processes = std::cell::OnceCell::new();
        let is_driver = |tgid: i32| {
            driver_processes
                .get_or_init(|| match &self.cgroup {
                    Some(cgroup) => cgroup.processes(),
                    None => process::descendants(),
                })
                .contains(&tgid)
        };
        let learning = self.learner.is_some();
        // The status names the mount from the moment it exists (it is visible before the
        // proxy starts), and until the mount fails.
        let first_mount = (ours.is_none() && i64::from(notif.data.nr) == seccomp::NR_MOUNT)
            .then(|| intercept::fuse_mount_target(notif))
            .flatten();
        if let Some(target) = &first_mount {
            self.board
                .update(|b| b.mountpoint = target.display().to_string());
        }
        // With a keeper, the observer is pinned: it must outlive rebound (see `keeper`).
        let pins = (first_mount.is_some() && self.observer.is_some() && self.keeper.is_some())
            .then(|| {
                let keeper = self.keeper.as_ref().and_then(crate::keeper::Keeper::pid);
                crate::keeper::observer_pins(std::process::id(), keeper)
            })
            .flatten();
        let fast = self.observer.is_some().then_some(intercept::Fast {
            observer: &mut self.observer,
            pins: pins.as_deref(),
        });
        let outcome = intercept::handle(
            self.listener.as_fd(),
            notif,
            ours,
            (sandboxed, learning, fast),
            is_driver,
        );
        if first_mount.is_some() && !matches!(outcome, Intercepted::Mounted(_)) {
            self.board.update(|b| b.mountpoint.clear());
        }
        match outcome {
            Intercepted::Mounted(mount) => {
                *self.log_label.lock().unwrap_or_else(|e| e.into_inner()) =
                    mount.mountpoint.display().to_string();
                tracing::info!(
                    "mounted {} ({}) for pid {}; serving it through rebound",
                    mount.mountpoint.display(),
                    mount.fstype,
                    mount.caller
                );
                let mount = *mount;
                let tx = self.events_tx.take().context("second mount")?;
                let options = self.proxy_options();
                let observed = mount.observer.is_some();
                let proxy = match mount.observer {
                    Some(observer) => {
                        tracing::info!(
                            "fast mode: the driver serves the kernel's queue; rebound observes"
                        );
                        // Before the driver's `mount(2)` is answered: libfuse makes its
                        // pipes after that.
                        if self.config.raise_pipe_max_size {
                            crate::host::widen_pipes();
                        }
                        Proxy::start_beside(mount.kernel, mount.channel, observer, tx, options)
                    }
                    None => Proxy::start(mount.kernel, mount.channel, tx, options),
                };
                let proxy = match proxy {
                    Ok(proxy) => proxy,
                    Err(e) => {
                        mount
                            .answer
                            .answer(self.listener.as_fd(), Err(rustix::io::Errno::IO));
                        return Err(e).context("starting the proxy");
                    }
                };
                self.board
                    .attach(proxy.stats.clone(), Box::new(proxy.held_objects_reader()));
                self.board.update(|s| {
                    s.mountpoint = mount.mountpoint.display().to_string();
                    s.state = "serving".into();
                });
                mount.answer.answer(self.listener.as_fd(), Ok(()));
                self.served = Some(Served {
                    in_mount_table: mount.in_mount_table,
                    mountpoint: mount.mountpoint,
                    channel_inode: mount.channel_inode,
                    proxy,
                    mounted_by_helper: mount.by_helper,
                });
                self.keep_mount();
                self.phase = Phase::Serving;
                // Started with fast mode's filter but served on a channel (its observer did
                // not attach, or was lost with a mount that failed and was tried again).
                if self.fast_filter && !observed {
                    self.falling_back = true;
                    self.driver_failed(
                        "fast mode could not observe the mount: guarded mode's filter is needed",
                        super::restart::Cause::Fallback,
                    );
                    return Ok(());
                }
                self.keep_standby(Instant::now());
            }
            Intercepted::Reattached {
                channel,
                channel_inode,
                caller,
            } => self.attach(channel, channel_inode, caller, None)?,
            Intercepted::Unmounted => {
                // The driver is done with the mount; its reader threads must not wait for
                // requests that will never come. In fast mode that ends the kernel's
                // connection, after which no restart can serve the mount: a driver that
                // unmounts by itself while serving first gets a moment to exit, since one
                // that then fails (sshfs whose ssh died exits 1) is restarted instead.
                let serving = !matches!(self.phase, Phase::Stopping { .. });
                let beside = self.served.as_ref().is_some_and(|s| s.proxy.is_beside());
                if !(serving && beside) {
                    if let Some(s) = &self.served {
                        s.proxy.disconnect_driver();
                    }
                }
                if serving {
                    tracing::info!("the driver unmounted its file system");
                    self.phase = self.stopping(false, 0);
                    if let Phase::Stopping {
                        end_connection_at, ..
                    } = &mut self.phase
                    {
                        *end_connection_at = beside.then(|| Instant::now() + UNMOUNTED_DRIVER_EXIT);
                    }
                }
            }
            Intercepted::Denied(name) => {
                if let Some(learner) = &self.learner {
                    learner.syscall(name);
                } else if self.denied_logged.insert(name) {
                    tracing::warn!(
                        "the sandbox denied the system call `{name}` to the driver (EPERM); \
                         `[sandbox] allow_syscalls = [\"{name}\"]` allows it"
                    );
                }
            }
            Intercepted::Other => {}
        }
        Ok(())
    }

    /// The proxy's settings, from the config.
    pub(super) fn proxy_options(&self) -> ProxyOptions {
        ProxyOptions {
            checkpoint_interval: self
                .config
                .redo_log
                .then(|| self.config.checkpoint_interval()),
            checkpoint_timeout: self.config.probe_timeout(),
            checkpoint_changes: self.config.checkpoint_changes as usize,
            image: self.image.clone(),
            second_opinion_cooldown: self.config.second_opinion_cooldown(),
        }
    }

    /// A new driver (pid `caller` holds its end) has its channel to the mount: its state is
    /// restored through it (`init_reply`: its answer to the kernel's INIT, if it gave one).
    pub(super) fn attach(
        &mut self,
        channel: OwnedFd,
        channel_inode: u64,
        caller: u32,
        init_reply: Option<Vec<u8>>,
    ) -> anyhow::Result<()> {
        if let Some(s) = &mut self.served {
            tracing::info!(
                "new driver (pid {caller}) attached to {}; restoring its state",
                s.mountpoint.display()
            );
            s.channel_inode = channel_inode;
            s.proxy
                .attach_driver(
                    channel,
                    self.config.request_timeout(),
                    init_reply,
                    std::mem::take(&mut self.attaching_spare),
                )
                .context("starting the recovery")?;
            self.phase = Phase::Recovering(Step::Restoring);
        }
        Ok(())
    }
}
