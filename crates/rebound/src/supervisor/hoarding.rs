//! Resource hoarding (VINO): memory that grows towards its limit, tasks that reach theirs,
//! descriptors that leak, CPU spent while nothing is asked of the driver. Each turns into a
//! cause the supervisor restarts the driver for, before the kernel's limit bites (or, for
//! memory, with the kernel's OOM kill in the driver's cgroup as the last resort). A request
//! held past its deadline is the proxy's liveness check.
//!
//! Owns: the thresholds and the wording of the causes. Must not: restart anything.

use std::time::{Duration, Instant};

use crate::cgroup::{DriverCgroup, Usage};
use crate::config::Limits;

/// Share of a limit at which usage counts as hoarding.
const NEAR_LIMIT_PERCENT: u64 = 90;
/// How often descriptors are counted (per driver process).
const FD_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// The hoarding checks of one run, across restarts.
pub struct Watch {
    /// Counters as they were when the current driver started: only new events are its.
    baseline: Usage,
    /// Start of the current idle window: when, the CPU time then, the request count then.
    idle_since: Option<(Instant, u64, u64)>,
    last_fd_check: Instant,
    /// The open-file limit of each driver process.
    fd_limit: u64,
    /// What the cgroup had used at the last check.
    latest: Usage,
}

impl Watch {
    pub fn new(limits: &Limits) -> Watch {
        let fd_limit = if limits.open_files != 0 {
            limits.open_files
        } else {
            rustix::process::getrlimit(rustix::process::Resource::Nofile)
                .current
                .unwrap_or(u64::MAX)
        };
        Watch {
            baseline: Usage::default(),
            idle_since: None,
            last_fd_check: Instant::now(),
            fd_limit,
            latest: Usage::default(),
        }
    }

    /// What the driver's cgroup had used at the last check.
    pub fn latest(&self) -> Usage {
        self.latest
    }

    /// A new driver starts: what the cgroup counted so far was its predecessor's.
    pub fn driver_started(&mut self, cgroup: Option<&DriverCgroup>) {
        if let Some(cgroup) = cgroup {
            self.baseline = cgroup.usage();
        }
        self.idle_since = None;
    }

    /// Why the driver's processes died, when the kernel killed one for the memory limit.
    pub fn death_cause(&self, cgroup: Option<&DriverCgroup>, limits: &Limits) -> Option<String> {
        let usage = cgroup?.usage();
        (usage.oom_kills > self.baseline.oom_kills).then(|| {
            format!(
                "memory hoarding: the driver reached its memory limit of {} MiB and the kernel \
                 killed it (OOM in the driver's cgroup)",
                limits.memory_mb
            )
        })
    }

    /// Checks the serving driver; `Some(cause)` when it hoards. `requests` counts the requests
    /// the driver was sent so far, `pending` whether one waits for its reply now.
    pub fn check(
        &mut self,
        cgroup: Option<&DriverCgroup>,
        limits: &Limits,
        requests: u64,
        pending: bool,
    ) -> Option<String> {
        let now = Instant::now();
        if let Some(cgroup) = cgroup {
            let usage = cgroup.usage();
            self.latest = usage;
            if let Some(cause) = self.death_cause(Some(cgroup), limits) {
                return Some(cause);
            }
            let memory = limits.memory_mb << 20;
            if memory != 0 && usage.anon_bytes * 100 >= memory * NEAR_LIMIT_PERCENT {
                return Some(format!(
                    "memory hoarding: {} MiB of anonymous memory, {NEAR_LIMIT_PERCENT}% of the \
                     limit of {} MiB",
                    usage.anon_bytes >> 20,
                    limits.memory_mb
                ));
            }
            if limits.tasks != 0
                && (usage.tasks >= limits.tasks
                    || usage.task_limit_hits > self.baseline.task_limit_hits)
            {
                return Some(format!(
                    "task hoarding: {} tasks, the limit is {} (a fork failed: {})",
                    usage.tasks,
                    limits.tasks,
                    usage.task_limit_hits > self.baseline.task_limit_hits
                ));
            }
            if let Some(cause) = self.check_idle_cpu(limits, now, usage.cpu_ns, requests, pending) {
                return Some(cause);
            }
            if now.duration_since(self.last_fd_check) >= FD_CHECK_INTERVAL {
                self.last_fd_check = now;
                if let Some(cause) = self.check_descriptors(&cgroup.processes()) {
                    return Some(cause);
                }
            }
        } else if now.duration_since(self.last_fd_check) >= FD_CHECK_INTERVAL {
            self.last_fd_check = now;
            return self.check_descriptors(&super::process::descendants());
        }
        None
    }

    fn check_idle_cpu(
        &mut self,
        limits: &Limits,
        now: Instant,
        cpu_ns: u64,
        requests: u64,
        pending: bool,
    ) -> Option<String> {
        if limits.idle_cpu_percent == 0 {
            return None;
        }
        let window = limits.idle_cpu_window();
        match self.idle_since {
            Some((_, _, count)) if pending || count != requests => {
                self.idle_since = Some((now, cpu_ns, requests));
            }
            Some((since, cpu_then, _)) if now.duration_since(since) >= window => {
                let spent = Duration::from_nanos(cpu_ns.saturating_sub(cpu_then));
                let elapsed = now.duration_since(since);
                self.idle_since = Some((now, cpu_ns, requests));
                if spent.as_nanos() * 100
                    >= elapsed.as_nanos() * u128::from(limits.idle_cpu_percent)
                {
                    return Some(format!(
                        "CPU hoarding: {} ms of CPU in {} ms with no request pending",
                        spent.as_millis(),
                        elapsed.as_millis()
                    ));
                }
            }
            Some(_) => {}
            None => self.idle_since = Some((now, cpu_ns, requests)),
        }
        None
    }

    fn check_descriptors(&self, pids: &[i32]) -> Option<String> {
        let threshold = self.fd_limit.saturating_mul(NEAR_LIMIT_PERCENT) / 100;
        for &pid in pids {
            let open = super::process::open_files(pid);
            if open >= threshold {
                return Some(format!(
                    "descriptor leak: pid {pid} holds {open} open files, {NEAR_LIMIT_PERCENT}% \
                     of its limit of {}",
                    self.fd_limit
                ));
            }
        }
        None
    }
}
