//! The driver's capability checks, traced (the kernel's `capability:cap_capable` tracepoint,
//! Linux 6.14+, through a tracefs instance of rebound's own), for two uses:
//! - learning mode (`rebound run --learn FILE`): the driver runs in its usual view with every
//!   capability rebound has and no system call denied; the capabilities the kernel granted it
//!   and the calls of the deny list it made (reported by the filter, then let through) are
//!   written to FILE as a `[sandbox]` section, rewritten at each new one so that it is
//!   complete however the run ends;
//! - otherwise, each capability the sandbox kept from the driver and that the kernel then
//!   refused it is logged once, with the key that gives it: a driver failing with `EPERM` is
//!   explained by rebound, not only by its own puzzling error.
//!
//! Both want each capability once (refused, or granted), so the tracepoint's filter in the
//! kernel keeps only checks of the kind wanted, of capabilities not yet seen: a driver checks
//! some at every request (`CAP_SYS_ADMIN`, refused, at each private `mmap`, in
//! `cap_vm_enough_memory`), and reading and parsing those lines took 80% of rebound's CPU in
//! fast mode.
//!
//! Which tasks are traced: learning mode follows rebound's tasks and what they fork
//! (`set_event_pid`), so the driver's helpers count too. That costs every context switch and
//! wake-up of the host a probe (the kernel keeps per-CPU "ignore this task" flags current):
//! 0.3 µs of fuse2fs's CPU per request (bench/results/fast-mode-costs-2026-11-27.md). The
//! refusal log, which runs as long as the driver, follows the driver's command name instead
//! (`comm` in the filter, checked only at a capability check), and rebound's check that the
//! task is the driver's does the rest.
//!
//! Owns: the tracefs instance, the reading thread, the learned sets and the file.
//! Must not: grant anything (the sandbox does, from the config) or decide what a driver
//! should have: it writes what was used, for the operator to review.

use std::collections::{BTreeSet, HashMap};
use std::ffi::{OsStr, OsString};
use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use rebound_sys::sandbox::CAPABILITY_NAMES;

const TRACEFS: &str = "/sys/kernel/tracing";
/// The switch of the tracepoint, in an instance.
const ENABLE: &str = "events/capability/cap_capable/enable";
/// Its filter, in an instance: what it refuses is dropped before it is formatted or read.
const FILTER: &str = "events/capability/cap_capable/filter";
/// The instances rebound makes are named this, then the pid of the `rebound run`.
const INSTANCE_PREFIX: &str = "rebound-";

/// A tracefs instance tracing capability checks, and the thread that reads it and hands each
/// check of a driver thread to its callback. Removed when dropped.
struct CapabilityTrace {
    stop: Arc<AtomicBool>,
    instance: PathBuf,
}

impl CapabilityTrace {
    /// `is_driver(tid)` says whether a thread is one of the driver's (its helpers' included);
    /// `on_first(capability)` gets each capability the first time the kernel granted it to
    /// one (`granted`), or refused it (not `granted`). With `comm`, only tasks of that name
    /// are traced; else rebound's tasks and what they fork. Fails when tracefs or the
    /// tracepoint is missing.
    fn start(
        granted: bool,
        comm: Option<String>,
        is_driver: impl Fn(i32) -> bool + Send + 'static,
        on_first: impl FnMut(&'static str) + Send + 'static,
    ) -> anyhow::Result<CapabilityTrace> {
        let root = Path::new(TRACEFS);
        if !root.join("instances").exists() {
            rustix::mount::mount(
                "tracefs",
                root,
                "tracefs",
                rustix::mount::MountFlags::empty(),
                c"",
            )
            .with_context(|| format!("mounting tracefs on {TRACEFS}"))?;
        }
        remove_stale_instances(&root.join("instances"));
        let instance = root
            .join("instances")
            .join(format!("{INSTANCE_PREFIX}{}", std::process::id()));
        fs::create_dir_all(&instance)
            .with_context(|| format!("creating {}", instance.display()))?;
        let trace = CapabilityTrace {
            stop: Arc::new(AtomicBool::new(false)),
            instance,
        };
        // Only the driver's tasks (by name), or rebound's own tasks and what they start
        // (drivers, standbys, helpers), are traced, in the kernel: the rest of the host's
        // checks never reach the buffer.
        if comm.is_none() {
            let tasks: Vec<String> = fs::read_dir("/proc/self/task")
                .context("listing rebound's threads")?
                .flatten()
                .map(|t| t.file_name().to_string_lossy().into_owned())
                .collect();
            fs::write(trace.instance.join("options/event-fork"), "1")
                .context("following forks in the trace")?;
            fs::write(trace.instance.join("set_event_pid"), tasks.join(" "))
                .context("tracing rebound's tasks only")?;
        }
        let filter = CheckFilter {
            path: trace.instance.join(FILTER),
            granted,
            comm,
            seen: BTreeSet::new(),
        };
        filter.write().context("filtering the capability trace")?;
        let event = trace.instance.join(ENABLE);
        fs::write(&event, "1").with_context(|| {
            format!(
                "enabling {} (the kernel's capability tracepoint, Linux 6.14+)",
                event.display()
            )
        })?;
        let pipe = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(trace.instance.join("trace_pipe"))
            .context("opening the trace pipe")?;
        let stop = trace.stop.clone();
        std::thread::Builder::new()
            .name("capability-trace".into())
            .spawn(move || read_checks(pipe, &stop, filter, is_driver, on_first))?;
        Ok(trace)
    }
}

impl Drop for CapabilityTrace {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = fs::write(self.instance.join(ENABLE), "0");
        // The reader closes the pipe within a poll interval; the instance goes after it.
        for _ in 0..20 {
            if fs::remove_dir(&self.instance).is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Instances left by `rebound run`s that are gone (killed before they could remove theirs).
fn remove_stale_instances(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(INSTANCE_PREFIX) else {
            continue;
        };
        if pid.parse::<u32>().is_ok() && !Path::new("/proc").join(pid).exists() {
            let _ = fs::write(entry.path().join(ENABLE), "0");
            let _ = fs::remove_dir(entry.path());
        }
    }
}

/// Logs, once each, the capabilities the kernel refused the driver that rebound could have
/// given it, with the key that does.
pub struct RefusalLog {
    _trace: CapabilityTrace,
}

impl RefusalLog {
    /// `grantable`: the capabilities rebound itself has (bit n is capability n); `program`:
    /// the driver's program (its name is what the kernel calls its tasks).
    pub fn start(
        grantable: u64,
        program: &OsStr,
        is_driver: impl Fn(i32) -> bool + Send + 'static,
    ) -> anyhow::Result<RefusalLog> {
        let trace = CapabilityTrace::start(false, task_name(program), is_driver, move |cap| {
            let grantable =
                crate::sandbox::capability(cap).is_some_and(|n| grantable & (1 << n) != 0);
            if grantable {
                tracing::info!(
                    "the kernel refused the driver {cap}, which its sandbox keeps from it; if \
                     the driver fails for want of it, `[sandbox] capabilities` with \"{cap}\" \
                     gives it"
                );
            }
        })?;
        Ok(RefusalLog { _trace: trace })
    }
}

/// The name the kernel gives the tasks of `program` once it is executed (its file name, cut to
/// 15 bytes), if a filter can name it (printable, without quotes or backslashes).
fn task_name(program: &OsStr) -> Option<String> {
    let name = Path::new(program).file_name()?.as_encoded_bytes();
    let name = &name[..name.len().min(15)];
    let printable = |b: &u8| b.is_ascii_graphic() && !matches!(b, b'"' | b'\\');
    (!name.is_empty() && name.iter().all(printable))
        .then(|| String::from_utf8_lossy(name).into_owned())
}

/// What a learning run has seen the driver use.
pub struct Learner {
    learned: Arc<Mutex<Learned>>,
    _trace: CapabilityTrace,
}

struct Learned {
    out: PathBuf,
    header: String,
    capabilities: BTreeSet<&'static str>,
    syscalls: BTreeSet<&'static str>,
}

impl Learner {
    /// Starts recording into `out` what the driver `argv` uses; `is_driver` as for
    /// [`CapabilityTrace::start`].
    pub fn start(
        out: &Path,
        argv: &[OsString],
        is_driver: impl Fn(i32) -> bool + Send + 'static,
    ) -> anyhow::Result<Learner> {
        let command: Vec<String> = argv
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let learned = Arc::new(Mutex::new(Learned {
            out: out.to_path_buf(),
            header: format!(
                "# Learned by `rebound run --learn` from: {}\n# What the driver used under the \
                 workload of that run; review it before use (the kernel also checks some \
                 capabilities a driver does without).\n",
                command.join(" ")
            ),
            capabilities: BTreeSet::new(),
            syscalls: BTreeSet::new(),
        }));
        learned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .write()
            .with_context(|| format!("writing {}", out.display()))?;
        let recorder = learned.clone();
        let trace = CapabilityTrace::start(true, None, is_driver, move |cap| {
            let mut learned = recorder.lock().unwrap_or_else(|e| e.into_inner());
            if learned.capabilities.insert(cap) {
                tracing::info!("learning: the driver uses {cap}");
                learned.save();
            }
        })?;
        tracing::info!(
            "learning: the driver keeps every capability and no system call is denied; what \
             it uses goes to {}",
            out.display()
        );
        Ok(Learner {
            learned,
            _trace: trace,
        })
    }

    /// A call of the deny list the driver made (let through while learning).
    pub fn syscall(&self, name: &'static str) {
        let mut learned = self.learned.lock().unwrap_or_else(|e| e.into_inner());
        if learned.syscalls.insert(name) {
            tracing::info!("learning: the driver calls `{name}`");
            learned.save();
        }
    }
}

impl Learned {
    fn write(&self) -> io::Result<()> {
        let list = |items: &BTreeSet<&str>| {
            items
                .iter()
                .map(|i| format!("\"{i}\""))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let text = format!(
            "{}[sandbox]\ncapabilities = [{}]\nallow_syscalls = [{}]\n",
            self.header,
            list(&self.capabilities),
            list(&self.syscalls)
        );
        let tmp = self.out.with_extension("learning");
        fs::write(&tmp, text)?;
        fs::rename(&tmp, &self.out)
    }

    fn save(&self) {
        if let Err(e) = self.write() {
            tracing::warn!("learning: writing {}: {e}", self.out.display());
        }
    }
}

/// The kernel's filter of the trace: checks of the kind wanted, of capabilities not yet seen.
struct CheckFilter {
    path: PathBuf,
    granted: bool,
    /// The tasks' name, when they are traced by name.
    comm: Option<String>,
    seen: BTreeSet<usize>,
}

impl CheckFilter {
    /// `ret == 0 && cap != 21 && ...` (tracefs's filter syntax).
    fn expression(&self) -> String {
        let mut expression = String::from(if self.granted { "ret == 0" } else { "ret != 0" });
        if let Some(comm) = &self.comm {
            expression.push_str(&format!(" && comm == \"{comm}\""));
        }
        for cap in &self.seen {
            expression.push_str(&format!(" && cap != {cap}"));
        }
        expression
    }

    fn write(&self) -> io::Result<()> {
        fs::write(&self.path, self.expression())
    }

    /// Whether the check is wanted and its capability new; if so, the kernel drops the
    /// capability's checks from now on.
    fn first(&mut self, cap: usize, granted: bool) -> bool {
        if granted != self.granted || !self.seen.insert(cap) {
            return false;
        }
        if let Err(e) = self.write() {
            tracing::debug!("updating the capability trace's filter: {e}");
        }
        true
    }
}

/// Reads the trace pipe until stopped, handing the first wanted check of each capability by a
/// driver thread to `on_first`.
fn read_checks(
    mut pipe: fs::File,
    stop: &AtomicBool,
    mut filter: CheckFilter,
    is_driver: impl Fn(i32) -> bool,
    mut on_first: impl FnMut(&'static str),
) {
    let mut buf = vec![0u8; 1 << 16];
    let mut pending = String::new();
    // Whether each thread seen is the driver's, found once (a thread does not change sides).
    let mut drivers: HashMap<i32, bool> = HashMap::new();
    while !stop.load(Ordering::Relaxed) {
        match pipe.read(&mut buf) {
            Ok(0) => std::thread::sleep(Duration::from_millis(100)),
            Ok(n) => {
                pending.push_str(&String::from_utf8_lossy(&buf[..n]));
                while let Some(end) = pending.find('\n') {
                    let line: String = pending.drain(..=end).collect();
                    let Some((tid, cap, granted)) = parse_check(&line) else {
                        continue;
                    };
                    if *drivers.entry(tid).or_insert_with(|| is_driver(tid))
                        && filter.first(cap, granted)
                    {
                        if let Some(name) = CAPABILITY_NAMES.get(cap) {
                            on_first(name);
                        }
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => {
                tracing::warn!("reading the capability trace: {e}");
                return;
            }
        }
    }
}

/// The thread, the capability's number and whether it was granted, of one check (a `cap_capable`
/// line of the trace), unless it is rebound's own (the sandbox's set-up before the driver's
/// exec still runs as `rebound`).
/// `  fuse2fs-1234  [001] ..... 12.5: cap_capable: cred 0x.., ..., cap 21, ret 0`
fn parse_check(line: &str) -> Option<(i32, usize, bool)> {
    let (task, event) = line.split_once(" [")?;
    let (comm, tid) = task.trim().rsplit_once('-')?;
    if comm == "rebound" {
        return None;
    }
    let fields = event.split_once("cap_capable:")?.1;
    let field = |name: &str| {
        fields
            .split(", ")
            .find_map(|f| f.trim().strip_prefix(name))
            .and_then(|v| v.trim().parse::<i64>().ok())
    };
    let granted = field("ret ")? == 0;
    let cap = usize::try_from(field("cap ")?).ok()?;
    Some((tid.parse().ok()?, cap, granted))
}

/// Whether thread `tid` belongs to a process of `pids`.
pub fn thread_of(tid: i32, pids: &[i32]) -> bool {
    let status = fs::read_to_string(format!("/proc/{tid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|t| t.trim().parse::<i32>().ok())
        .is_some_and(|tgid| pids.contains(&tgid))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_are_read_from_trace_lines() {
        let line = "   fuse2fs-1234    [001] ..... 12.500: cap_capable: cred 0000000012345678, \
                    target_ns 00000000abcd, capable_ns 00000000abcd, cap 0, ret 0\n";
        assert_eq!(parse_check(line), Some((1234, 0, true)));
        let own = line.replace("fuse2fs-1234", "rebound-77");
        assert_eq!(parse_check(&own), None);
        let dashed = line.replace("fuse2fs-1234", "mount.ntfs-3g-99");
        assert_eq!(parse_check(&dashed), Some((99, 0, true)));
        let refused = line.replace("ret 0", "ret -1");
        assert_eq!(parse_check(&refused), Some((1234, 0, false)));
        assert_eq!(parse_check("# tracer: nop\n"), None);
    }

    #[test]
    fn tasks_are_named_as_the_kernel_names_them() {
        let name = |p: &str| task_name(OsStr::new(p));
        assert_eq!(name("/usr/bin/fuse2fs").as_deref(), Some("fuse2fs"));
        assert_eq!(name("mount.ntfs-3g").as_deref(), Some("mount.ntfs-3g"));
        assert_eq!(
            name("/x/a-very-long-driver-name").as_deref(),
            Some("a-very-long-dri")
        );
        assert_eq!(name("/x/with\"quote"), None);
        assert_eq!(name("/"), None);
    }

    #[test]
    fn the_filter_keeps_the_kind_wanted_of_capabilities_not_yet_seen() {
        let dir = std::env::temp_dir().join(format!("rebound-filter-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let mut filter = CheckFilter {
            path: dir.join("filter"),
            granted: false,
            comm: None,
            seen: BTreeSet::new(),
        };
        assert_eq!(filter.expression(), "ret != 0");
        assert!(
            !filter.first(21, true),
            "a granted check, when refusals are wanted"
        );
        assert!(filter.first(21, false));
        assert!(!filter.first(21, false), "each capability once");
        assert!(filter.first(2, false));
        assert_eq!(
            fs::read_to_string(dir.join("filter")).unwrap(),
            "ret != 0 && cap != 2 && cap != 21"
        );
        filter.granted = true;
        assert_eq!(filter.expression(), "ret == 0 && cap != 2 && cap != 21");
        filter.comm = Some("fuse2fs".into());
        assert_eq!(
            filter.expression(),
            "ret == 0 && comm == \"fuse2fs\" && cap != 2 && cap != 21"
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}
