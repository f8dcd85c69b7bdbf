//! The driver's cgroup: one per `rebound run`, kept across restarts, holding every process of
//! the driver and nothing else. Memory, tasks and CPU are limited there, so that what a driver
//! hoards is bounded by the kernel and an out-of-memory kill can only pick the driver's own
//! processes. Works on cgroup v2 (when its controllers are available) and on v1 hierarchies.
//!
//! The cpu controller is joined only for a CPU limit (`limits.cpu_percent`): a group of its
//! own competes for CPU as one task would, so under contention a driver of several processes
//! (sshfs and its ssh) would get less than it does mounted directly. Without it, the CPU used
//! is read from v2's `cpu.stat` (kept without the controller), v1's `cpuacct` where it is a
//! hierarchy apart from `cpu`, or else the processes' own times in `/proc`.
//!
//! Owns: creating, limiting, reading and removing the cgroup. Must not: decide what a reading
//! means (the supervisor's hoarding checks do).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::config::Limits;

const ROOT: &str = "/sys/fs/cgroup";

/// One run's cgroup.
#[derive(Debug)]
pub enum DriverCgroup {
    /// A cgroup v2 directory.
    V2(PathBuf),
    /// One directory per v1 hierarchy: memory, pids, cpu (cpuacct may share cpu's).
    V1 {
        memory: Option<PathBuf>,
        pids: Option<PathBuf>,
        cpu: Option<PathBuf>,
        cpuacct: Option<PathBuf>,
    },
}

/// What the cgroup has used, as far as the kernel reports it.
#[derive(Debug, Default, Clone, Copy)]
pub struct Usage {
    /// Anonymous memory (what a leak grows; page cache is reclaimable and not counted).
    pub anon_bytes: u64,
    /// Processes the kernel's OOM killer has killed in the cgroup.
    pub oom_kills: u64,
    /// Tasks (processes and threads) now.
    pub tasks: u64,
    /// Times a fork failed because the task limit was reached.
    pub task_limit_hits: u64,
    /// CPU time used, in nanoseconds.
    pub cpu_ns: u64,
}

/// Removes the cgroups under `parent` left by runs that are gone (killed before they could
/// remove theirs); `rmdir` refuses any that still holds a process.
fn remove_stale(parent: &Path) {
    let Ok(entries) = fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        // `PID` or `PID-2` (see `create`).
        let run = name.to_str().map(|n| n.split('-').next().unwrap_or(n));
        let Some(pid) = run.and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = fs::remove_dir(entry.path());
        }
    }
}

fn write(dir: &Path, file: &str, value: &str) -> io::Result<()> {
    fs::write(dir.join(file), value)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", dir.join(file).display())))
}

fn read_u64(path: PathBuf) -> u64 {
    fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// The value of `key` in a flat-keyed file (`memory.stat`, `memory.events`).
fn read_key(path: PathBuf, key: &str) -> u64 {
    fs::read_to_string(path)
        .ok()
        .and_then(|text| {
            text.lines().find_map(|line| {
                let (k, v) = line.split_once(' ')?;
                (k == key).then(|| v.trim().parse().ok()).flatten()
            })
        })
        .unwrap_or(0)
}

/// The CPU time `processes` have used (user and system, their threads' included), from
/// `/proc/PID/stat`; a process that is gone counts nothing.
fn processes_cpu_ns(processes: &[i32]) -> u64 {
    let tick_ns = 1_000_000_000 / rustix::param::clock_ticks_per_second();
    let ticks = |pid: &i32| -> Option<u64> {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Fields after the command name (which may hold spaces and parentheses): utime and
        // stime are the 12th and 13th.
        let mut fields = stat.rsplit_once(')')?.1.split_whitespace().skip(11);
        let utime: u64 = fields.next()?.parse().ok()?;
        let stime: u64 = fields.next()?.parse().ok()?;
        Some(utime + stime)
    };
    processes.iter().filter_map(ticks).sum::<u64>() * tick_ns
}

impl DriverCgroup {
    /// Creates the cgroup `rebound/NAME` and sets `limits` on it. NAME is the run's pid, and
    /// `PID-2` for its second (see `supervisor::standby`). `None` when this machine has
    /// no usable cgroup file system (the driver then runs unlimited, with a warning).
    pub fn create(name: &str, limits: &Limits) -> io::Result<Option<DriverCgroup>> {
        let root = Path::new(ROOT);
        let v2_controllers = fs::read_to_string(root.join("cgroup.controllers")).ok();
        if let Some(controllers) = v2_controllers.filter(|c| c.contains("memory")) {
            let parent = root.join("rebound");
            fs::create_dir_all(&parent)?;
            let cpu = (limits.cpu_percent != 0).then_some("cpu");
            let wanted: Vec<&str> = ["memory", "pids"]
                .into_iter()
                .chain(cpu)
                .filter(|c| controllers.split_whitespace().any(|have| have == *c))
                .collect();
            let enable = wanted
                .iter()
                .map(|c| format!("+{c}"))
                .collect::<Vec<_>>()
                .join(" ");
            write(root, "cgroup.subtree_control", &enable)?;
            write(&parent, "cgroup.subtree_control", &enable)?;
            remove_stale(&parent);
            let dir = parent.join(name);
            fs::create_dir_all(&dir)?;
            let cgroup = DriverCgroup::V2(dir);
            cgroup.set_limits(limits)?;
            return Ok(Some(cgroup));
        }
        let hierarchy = |controller: &str| -> io::Result<Option<PathBuf>> {
            let base = root.join(controller);
            if !base.join("cgroup.procs").exists() {
                return Ok(None);
            }
            remove_stale(&base.join("rebound"));
            let dir = base.join("rebound").join(name);
            fs::create_dir_all(&dir)?;
            Ok(Some(dir))
        };
        let memory = hierarchy("memory")?;
        let pids = hierarchy("pids")?;
        let limited = limits.cpu_percent != 0;
        // cpu and cpuacct are usually one hierarchy mounted twice: cpuacct alone is joined only
        // where it is not.
        let cpu_dir = fs::canonicalize(root.join("cpu")).ok();
        let shared = cpu_dir.is_some() && cpu_dir == fs::canonicalize(root.join("cpuacct")).ok();
        let cpu = if limited { hierarchy("cpu")? } else { None };
        let cpuacct = if limited || !shared {
            hierarchy("cpuacct")?
        } else {
            None
        };
        if memory.is_none() && pids.is_none() && cpu.is_none() {
            return Ok(None);
        }
        let cgroup = DriverCgroup::V1 {
            memory,
            pids,
            cpu,
            cpuacct,
        };
        cgroup.set_limits(limits)?;
        Ok(Some(cgroup))
    }

    fn set_limits(&self, limits: &Limits) -> io::Result<()> {
        let memory = limits.memory_mb.saturating_mul(1 << 20);
        match self {
            DriverCgroup::V2(dir) => {
                if memory != 0 {
                    write(dir, "memory.max", &memory.to_string())?;
                    // Swapping would only delay the limit, at the host's expense.
                    let _ = write(dir, "memory.swap.max", "0");
                }
                if limits.tasks != 0 {
                    write(dir, "pids.max", &limits.tasks.to_string())?;
                }
                if limits.cpu_percent != 0 {
                    write(
                        dir,
                        "cpu.max",
                        &format!("{} 100000", limits.cpu_percent * 1000),
                    )?;
                }
            }
            DriverCgroup::V1 {
                memory: memory_dir,
                pids,
                cpu,
                ..
            } => {
                if let (Some(dir), true) = (memory_dir, memory != 0) {
                    write(dir, "memory.limit_in_bytes", &memory.to_string())?;
                    let _ = write(dir, "memory.memsw.limit_in_bytes", &memory.to_string());
                    let _ = write(dir, "memory.swappiness", "0");
                }
                if let (Some(dir), true) = (pids, limits.tasks != 0) {
                    write(dir, "pids.max", &limits.tasks.to_string())?;
                }
                if let (Some(dir), true) = (cpu, limits.cpu_percent != 0) {
                    write(dir, "cpu.cfs_period_us", "100000")?;
                    write(
                        dir,
                        "cpu.cfs_quota_us",
                        &(limits.cpu_percent * 1000).to_string(),
                    )?;
                }
            }
        }
        Ok(())
    }

    /// The `cgroup.procs` files a new driver process writes itself into.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        match self {
            DriverCgroup::V2(dir) => vec![dir.join("cgroup.procs")],
            DriverCgroup::V1 {
                memory,
                pids,
                cpu,
                cpuacct,
            } => {
                // Joining one of two mounts of the same hierarchy joins both.
                let mut files: Vec<PathBuf> = [memory, pids, cpu, cpuacct]
                    .into_iter()
                    .flatten()
                    .map(|d| fs::canonicalize(d).unwrap_or_else(|_| d.clone()))
                    .map(|d| d.join("cgroup.procs"))
                    .collect();
                files.sort();
                files.dedup();
                files
            }
        }
    }

    /// What the cgroup has used so far.
    pub fn usage(&self) -> Usage {
        match self {
            DriverCgroup::V2(dir) => Usage {
                anon_bytes: read_key(dir.join("memory.stat"), "anon"),
                oom_kills: read_key(dir.join("memory.events"), "oom_kill"),
                tasks: read_u64(dir.join("pids.current")),
                task_limit_hits: read_key(dir.join("pids.events"), "max"),
                cpu_ns: read_key(dir.join("cpu.stat"), "usage_usec") * 1000,
            },
            DriverCgroup::V1 {
                memory,
                pids,
                cpu,
                cpuacct,
            } => {
                let mut usage = Usage::default();
                if let Some(dir) = memory {
                    usage.anon_bytes = read_key(dir.join("memory.stat"), "rss");
                    usage.oom_kills = read_key(dir.join("memory.oom_control"), "oom_kill");
                }
                if let Some(dir) = pids {
                    usage.tasks = read_u64(dir.join("pids.current"));
                    usage.task_limit_hits = read_key(dir.join("pids.events"), "max");
                }
                match cpuacct.as_ref().or(cpu.as_ref()) {
                    Some(dir) => usage.cpu_ns = read_u64(dir.join("cpuacct.usage")),
                    None => usage.cpu_ns = processes_cpu_ns(&self.processes()),
                }
                usage
            }
        }
    }

    /// The processes in the cgroup.
    pub fn processes(&self) -> Vec<i32> {
        let procs = self.procs_files().into_iter().next();
        procs
            .and_then(|p| fs::read_to_string(p).ok())
            .map(|text| text.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    }

    /// Removes the cgroup once its processes are gone.
    pub fn remove(&self) {
        let dirs: Vec<&PathBuf> = match self {
            DriverCgroup::V2(dir) => vec![dir],
            DriverCgroup::V1 {
                memory,
                pids,
                cpu,
                cpuacct,
            } => [memory, pids, cpu, cpuacct].into_iter().flatten().collect(),
        };
        for dir in dirs {
            if let Err(e) = fs::remove_dir(dir) {
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::debug!("removing cgroup {}: {e}", dir.display());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_keyed_files_are_read() {
        let dir = std::env::temp_dir().join(format!("rebound-cgroup-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(
            dir.join("memory.events"),
            "low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n",
        )
        .unwrap();
        assert_eq!(read_key(dir.join("memory.events"), "oom_kill"), 2);
        assert_eq!(read_key(dir.join("memory.events"), "max"), 3);
        assert_eq!(read_key(dir.join("memory.events"), "absent"), 0);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_process_s_cpu_time_is_read_from_proc() {
        let me = std::process::id() as i32;
        let spin = std::time::Instant::now();
        while spin.elapsed() < std::time::Duration::from_millis(50) {
            std::hint::black_box(0u64);
        }
        // At least the 50 ms just spent, give or take a clock tick; a pid that is gone, none.
        assert!(
            processes_cpu_ns(&[me]) >= 30_000_000,
            "{}",
            processes_cpu_ns(&[me])
        );
        assert_eq!(processes_cpu_ns(&[i32::MAX]), 0);
    }
}
