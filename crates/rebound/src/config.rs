//! `rebound.toml`: per-mount settings, with defaults built in.
//!
//! Owns: the file format, its defaults and its error messages (one line naming the key).
//! Must not: act on the settings.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// Settings for one `rebound run`. Every key is optional; unknown keys are errors.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `rebound run --learn FILE`: where learning mode writes what the driver used (see
    /// `capability_trace`); not a key of the file.
    #[serde(skip)]
    pub learn: Option<PathBuf>,
    /// The file these settings were read from, if any (a reloaded rebound reads it again);
    /// not a key of the file.
    #[serde(skip)]
    pub source: Option<PathBuf>,
    /// Where requests go while the driver is healthy: `guarded` through rebound, which checks
    /// every reply before the kernel sees it; `fast` straight from the kernel's queue to the
    /// driver, with rebound beside the path keeping its tracker by observation (BPF) until the
    /// driver fails, and guarded from then on; `auto`, fast unless `redo_log` is on.
    pub mode: Mode,
    /// How long the driver may take from start to `mount(2)` before rebound gives up on it
    /// (it may be a command that is not a FUSE driver at all).
    pub mount_timeout_ms: u64,
    /// How long a stopping driver gets to finish (flush its image, close its connection)
    /// before it is killed. Killing a driver mid-flush can corrupt what it stores, so this is
    /// generous; a second SIGINT/SIGTERM to rebound kills at once.
    pub stop_timeout_ms: u64,
    /// How long the driver may leave a request unanswered before rebound declares it hung.
    /// Generous, since a network driver can be legitimately slow.
    pub request_timeout_ms: u64,
    /// While requests wait, rebound periodically sends the driver a cheap liveness probe; a
    /// probe unanswered for this long means the driver hangs.
    pub probe_timeout_ms: u64,
    /// At most this many restarts within `restart_window_ms`; 0 means never restart.
    pub restart_budget: u32,
    /// The sliding window `restart_budget` counts restarts in.
    pub restart_window_ms: u64,
    /// The delay before a restart that follows another within the window; doubles with each
    /// further restart, up to `restart_backoff_max_ms`.
    pub restart_backoff_ms: u64,
    /// The longest delay before a restart.
    pub restart_backoff_max_ms: u64,
    /// How long a driver restarted while it still runs (it sent a refused reply, a restarted
    /// one is asked for a second opinion, `rebound restart`) gets to exit by itself once its
    /// channel is closed, before SIGKILL. A libfuse driver then flushes what it holds (fuse2fs
    /// its image's metadata): killed at once, it may leave its store inconsistent. 0 kills at
    /// once, as after a crash or a hang.
    pub restart_grace_ms: u64,
    /// What happens once the restart budget is spent and the driver fails again.
    pub on_budget_exhausted: BudgetPolicy,
    /// A command run after a failed driver is gone and before its successor starts, to bring
    /// what it stores back to a consistent state (e.g. `["e2fsck", "-fy", "disk.img"]` for
    /// fuse2fs, which keeps metadata in memory until it flushes). Empty: none.
    pub pre_restart: Vec<String>,
    /// Keep every change the driver acknowledges until a checkpoint (an FSYNC rebound sends
    /// through a file lately written) makes it durable, and replay the rest in a restarted
    /// driver. For drivers that lose acknowledged work when killed (fuse2fs).
    pub redo_log: bool,
    /// How often the driver is checkpointed when `redo_log` is on.
    pub checkpoint_interval_ms: u64,
    /// Also checkpoint as soon as the redo log holds this many changes (0: by interval
    /// only): bounds what a recovery replays, at the cost of more checkpoints.
    pub checkpoint_changes: u64,
    /// The file the driver keeps its state in (fuse2fs's image), on a file system that can
    /// clone files (XFS, btrfs). With `redo_log`, each checkpoint also clones it (see
    /// [`crate::checkpoint`]), and a failed driver's successor gets it back as it was then:
    /// consistent without a `pre_restart` check, brought forward by the redo log.
    pub image: Option<PathBuf>,
    /// When the driver answers with an error no working driver gives for that request (a
    /// LOOKUP failing with EFAULT, an UNLINK with ENOSPC, any EIO), restart it and ask the new
    /// one; its answer stands. Damaged code that does not crash is caught this way.
    pub second_opinion: bool,
    /// After a restarted driver gave the same error, errors are forwarded without a second
    /// opinion for this long: they are real (a failing disk or network).
    pub second_opinion_cooldown_ms: u64,
    /// Whether a successor is started ahead of a failure, initialised and held at its
    /// `mount(2)`, so that a recovery does not wait for a process to start.
    pub standby: StandbyPolicy,
    /// What the driver may see and do.
    pub sandbox: SandboxConfig,
    /// What the driver may consume, and when hoarding means it must be restarted.
    pub limits: Limits,
    /// Prometheus metrics of the mount (off unless a key is set).
    pub metrics: MetricsConfig,
    /// A keeper process holds the kernel connection and finds the tracker's journal, so that
    /// if rebound itself dies (SIGKILL, a crash), a successor takes the mount over and
    /// applications see no error (guarded mode; see `keeper`).
    pub keeper: bool,
    /// When a driver serves the kernel's queue (fast mode), raise the host's
    /// `fs.pipe-max-size` to what libfuse 3 needs to read requests by splice (see `host`), so
    /// that a driver's death cannot fail a request it was copying.
    pub raise_pipe_max_size: bool,
}

/// `[metrics]`: where the mount's metrics are exposed, in Prometheus' text format.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// `ADDRESS:PORT` to answer `GET /metrics` on (`"127.0.0.1:9464"`).
    pub listen: Option<String>,
    /// A file rewritten with the metrics every `textfile_interval_ms` (for node_exporter's
    /// textfile collector).
    pub textfile: Option<PathBuf>,
    pub textfile_interval_ms: u64,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            listen: None,
            textfile: None,
            textfile_interval_ms: 10_000,
        }
    }
}

impl MetricsConfig {
    /// The address to listen on, if one is set.
    pub fn listen_addr(&self) -> Option<std::net::SocketAddr> {
        self.listen.as_deref().and_then(|a| a.parse().ok())
    }

    fn check(&self) -> Result<(), String> {
        if let Some(listen) = &self.listen {
            if listen.parse::<std::net::SocketAddr>().is_err() {
                return Err(format!(
                    "metrics.listen: `{listen}` is not ADDRESS:PORT (e.g. \"127.0.0.1:9464\")"
                ));
            }
        }
        if self.textfile_interval_ms < 100 {
            return Err("metrics.textfile_interval_ms: must be at least 100".into());
        }
        Ok(())
    }
}

/// `[sandbox]`: the driver's confinement (see the README's configuration table).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxConfig {
    pub profile: Profile,
    /// Paths the driver may write besides those on its command line.
    pub writable_paths: Vec<PathBuf>,
    /// Paths the driver may read besides the system's directories (`strict` only: under
    /// `default` the whole tree is readable).
    pub readable_paths: Vec<PathBuf>,
    /// Whether files and directories named on the driver's command line (`disk.img`,
    /// `-o source=DIR`) are writable in its view.
    pub command_line_paths: bool,
    /// Whether the driver shares the host's network; unset: yes under `default`, no under
    /// `strict`.
    pub network: Option<bool>,
    /// Capabilities the driver keeps (`"CAP_CHOWN"`). Unset: derived from its command line
    /// (the file capabilities for a driver given a directory to serve, none otherwise).
    pub capabilities: Option<Vec<String>>,
    /// System calls of the profile's deny list the driver may make after all (`"ptrace"`).
    pub allow_syscalls: Vec<String>,
}

/// The data path while the driver is healthy (see [`Config::mode`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    Guarded,
    Fast,
    /// Fast unless the redo log is kept (it must see every change before the kernel does).
    #[default]
    Auto,
}

/// When a standby successor is kept ready.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StandbyPolicy {
    /// Unless it cannot be correct: with a `pre_restart` command (the store is repaired after
    /// a failure, under a successor that opened it before), or for a driver known to read its
    /// writable store at start (fuse2fs, ntfs-3g, ...: a successor started earlier would serve
    /// a stale copy of the image's metadata).
    #[default]
    Auto,
    /// Always (the operator knows the driver reads its store lazily).
    On,
    /// Never: every restart starts a new process.
    Off,
}

/// How tightly the driver is confined.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Profile {
    /// Only the system's directories (read-only), its own paths and a private `/tmp` are
    /// visible; no network unless asked for.
    Strict,
    /// The host's tree is visible read-only, its own paths writable; the host's network.
    #[default]
    Default,
    /// No confinement beyond the mount interception, for debugging. Limits still apply.
    Off,
}

impl Profile {
    /// The name the config file gives it.
    pub fn name(self) -> &'static str {
        match self {
            Profile::Strict => "strict",
            Profile::Default => "default",
            Profile::Off => "off",
        }
    }
}

/// `[limits]`: resources per driver (its cgroup and rlimits), and the hoarding checks.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Memory of the driver's cgroup, in MiB; 0: no limit. The driver is restarted when its
    /// anonymous memory passes 90% of this, and the kernel's OOM killer, should it act first,
    /// can pick only from the driver's cgroup.
    pub memory_mb: u64,
    /// Tasks (processes and threads) of the driver's cgroup; 0: no limit. Reaching it means
    /// a restart.
    pub tasks: u64,
    /// CPU time, in percent of one CPU; 0: no limit (the default: a cap would slow a driver
    /// that serves in parallel on an otherwise idle machine; spinning is caught by
    /// `idle_cpu_percent`).
    pub cpu_percent: u64,
    /// Open files per driver process (RLIMIT_NOFILE); 0: rebound's own limit. A process that
    /// holds 90% of the limit leaks descriptors: the driver is restarted.
    pub open_files: u64,
    /// Largest core dump, in MiB (RLIMIT_CORE); 0: none.
    pub core_mb: u64,
    /// A driver that spends more than this percentage of one CPU over `idle_cpu_window_ms`
    /// while no request is pending spins: it is restarted. 0: never.
    pub idle_cpu_percent: u64,
    /// The window `idle_cpu_percent` is measured over.
    pub idle_cpu_window_ms: u64,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        SandboxConfig {
            profile: Profile::Default,
            writable_paths: Vec::new(),
            readable_paths: Vec::new(),
            command_line_paths: true,
            network: None,
            capabilities: None,
            allow_syscalls: Vec::new(),
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            memory_mb: 1024,
            tasks: 512,
            cpu_percent: 0,
            open_files: 0,
            core_mb: 0,
            idle_cpu_percent: 50,
            idle_cpu_window_ms: 10_000,
        }
    }
}

impl SandboxConfig {
    /// Whether the driver shares the host's network.
    pub fn network(&self) -> bool {
        self.network.unwrap_or(self.profile != Profile::Strict)
    }
}

/// What rebound does when the driver fails and the restart budget is spent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BudgetPolicy {
    /// Keep the mount; every request fails with `EIO` until a later restart succeeds (once
    /// the oldest restart leaves the window, or on `rebound restart`).
    #[default]
    FailRequests,
    /// Unmount and stop, as if the mount had been removed by the user.
    Unmount,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            learn: None,
            source: None,
            mode: Mode::Auto,
            mount_timeout_ms: 30_000,
            stop_timeout_ms: 60_000,
            request_timeout_ms: 60_000,
            probe_timeout_ms: 10_000,
            restart_budget: 5,
            restart_window_ms: 60_000,
            restart_backoff_ms: 100,
            restart_backoff_max_ms: 5_000,
            restart_grace_ms: 2_000,
            on_budget_exhausted: BudgetPolicy::FailRequests,
            pre_restart: Vec::new(),
            redo_log: false,
            checkpoint_interval_ms: 1_000,
            checkpoint_changes: 0,
            image: None,
            second_opinion: true,
            second_opinion_cooldown_ms: 60_000,
            standby: StandbyPolicy::Auto,
            sandbox: SandboxConfig::default(),
            limits: Limits::default(),
            metrics: MetricsConfig::default(),
            keeper: true,
            raise_pipe_max_size: true,
        }
    }
}

impl Config {
    /// Reads and checks a config file. The error is one line naming the file, the line and
    /// the problem.
    pub fn load(path: &Path) -> Result<Config, String> {
        let text =
            std::fs::read_to_string(path).map_err(|e| format!("config {}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("config {}: {e}", path.display()))
    }

    fn parse(text: &str) -> Result<Config, String> {
        let config: Config = toml::from_str(text).map_err(|e| {
            let message = e.message().replace('\n', " ");
            let Some(span) = e.span() else {
                return message;
            };
            let start = span.start.min(text.len());
            let line_start = text[..start].rfind('\n').map_or(0, |i| i + 1);
            let line_no = 1 + text[..start].matches('\n').count();
            // Type errors point at the value; name the key it belongs to.
            let line = text[line_start..].lines().next().unwrap_or_default();
            let table = text[..line_start]
                .lines()
                .rev()
                .map(str::trim)
                .find(|l| l.starts_with('[') && l.ends_with(']'))
                .map(|l| l.trim_matches(['[', ']']).trim());
            match line.split_once('=') {
                Some((key, _)) if !message.contains(key.trim()) => {
                    let key = key.trim();
                    match table {
                        Some(table) => format!("line {line_no}: `{table}.{key}`: {message}"),
                        None => format!("line {line_no}: `{key}`: {message}"),
                    }
                }
                _ => match table {
                    Some(table) if !line.trim_start().starts_with('[') => {
                        format!("line {line_no}: in [{table}]: {message}")
                    }
                    _ => format!("line {line_no}: {message}"),
                },
            }
        })?;
        config.check()?;
        Ok(config)
    }

    fn check(&self) -> Result<(), String> {
        if self.standby == StandbyPolicy::On && !self.pre_restart.is_empty() {
            return Err(
                "standby: \"on\" cannot go with pre_restart, which repairs the store \
                        after a failure: a standby would have opened it before"
                    .into(),
            );
        }
        if self.image.is_some() && !self.redo_log {
            return Err(
                "image: needs redo_log = true (what came after the checkpoint is replayed \
                 from it)"
                    .into(),
            );
        }
        if self.standby == StandbyPolicy::On
            && self.image.is_some()
            && self.sandbox.profile == Profile::Off
        {
            return Err(
                "standby: \"on\" with image needs the sandbox: the standby runs on a spare of \
                 the image shown at its path, and without a view it would open the image itself"
                    .into(),
            );
        }
        if self.mode == Mode::Fast && self.redo_log {
            return Err(
                "mode: \"fast\" cannot go with redo_log, which must see every change before \
                 the kernel does"
                    .into(),
            );
        }
        if self.mount_timeout_ms == 0 {
            return Err("mount_timeout_ms: must be greater than 0".into());
        }
        if self.stop_timeout_ms == 0 {
            return Err("stop_timeout_ms: must be greater than 0".into());
        }
        if self.request_timeout_ms == 0 {
            return Err("request_timeout_ms: must be greater than 0".into());
        }
        if self.probe_timeout_ms == 0 {
            return Err("probe_timeout_ms: must be greater than 0".into());
        }
        if self.checkpoint_interval_ms == 0 {
            return Err("checkpoint_interval_ms: must be greater than 0".into());
        }
        if self.restart_window_ms == 0 {
            return Err("restart_window_ms: must be greater than 0".into());
        }
        if self.restart_backoff_max_ms < self.restart_backoff_ms {
            return Err(format!(
                "restart_backoff_max_ms: must be at least restart_backoff_ms ({})",
                self.restart_backoff_ms
            ));
        }
        self.sandbox.check()?;
        self.metrics.check()?;
        self.limits.check()
    }

    pub fn mount_timeout(&self) -> Duration {
        Duration::from_millis(self.mount_timeout_ms)
    }

    /// Whether the first driver serves the kernel's queue itself (see [`Config::mode`]).
    pub fn fast(&self) -> bool {
        match self.mode {
            Mode::Fast => true,
            Mode::Auto => !self.redo_log,
            Mode::Guarded => false,
        }
    }

    pub fn restart_grace(&self) -> Duration {
        Duration::from_millis(self.restart_grace_ms)
    }

    pub fn stop_timeout(&self) -> Duration {
        Duration::from_millis(self.stop_timeout_ms)
    }
}

impl SandboxConfig {
    fn check(&self) -> Result<(), String> {
        for (key, paths) in [
            ("sandbox.writable_paths", &self.writable_paths),
            ("sandbox.readable_paths", &self.readable_paths),
        ] {
            for path in paths {
                if !path.is_absolute() {
                    return Err(format!(
                        "{key}: `{}` is not an absolute path",
                        path.display()
                    ));
                }
                if path == Path::new("/") {
                    return Err(format!("{key}: `/` would give the driver the whole host"));
                }
            }
        }
        for name in self.capabilities.iter().flatten() {
            if crate::sandbox::capability(name).is_none() {
                return Err(format!(
                    "sandbox.capabilities: `{name}` is not a capability (write e.g. \"CAP_CHOWN\")"
                ));
            }
        }
        for name in &self.allow_syscalls {
            if !crate::sandbox::deniable(name) {
                return Err(format!(
                    "sandbox.allow_syscalls: `{name}` is not denied by any profile (denied: {})",
                    crate::sandbox::deniable_names()
                ));
            }
        }
        Ok(())
    }
}

impl Limits {
    fn check(&self) -> Result<(), String> {
        if self.memory_mb != 0 && self.memory_mb < 16 {
            return Err("limits.memory_mb: must be 0 (no limit) or at least 16".into());
        }
        if self.tasks != 0 && self.tasks < 8 {
            return Err("limits.tasks: must be 0 (no limit) or at least 8".into());
        }
        if self.open_files != 0 && self.open_files < 64 {
            return Err("limits.open_files: must be 0 (rebound's limit) or at least 64".into());
        }
        if self.cpu_percent > 100 * 1024 {
            return Err("limits.cpu_percent: at most 102400 (1024 CPUs)".into());
        }
        if self.idle_cpu_percent > 100 {
            return Err("limits.idle_cpu_percent: a percentage of one CPU, at most 100".into());
        }
        if self.idle_cpu_window_ms < 500 {
            return Err("limits.idle_cpu_window_ms: must be at least 500".into());
        }
        Ok(())
    }

    pub fn idle_cpu_window(&self) -> Duration {
        Duration::from_millis(self.idle_cpu_window_ms)
    }
}

impl Config {
    pub fn checkpoint_interval(&self) -> Duration {
        Duration::from_millis(self.checkpoint_interval_ms)
    }

    /// `None` when second opinions are off.
    pub fn second_opinion_cooldown(&self) -> Option<Duration> {
        self.second_opinion
            .then(|| Duration::from_millis(self.second_opinion_cooldown_ms))
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }

    pub fn probe_timeout(&self) -> Duration {
        Duration::from_millis(self.probe_timeout_ms)
    }

    pub fn restart_window(&self) -> Duration {
        Duration::from_millis(self.restart_window_ms)
    }

    pub fn restart_backoff(&self) -> Duration {
        Duration::from_millis(self.restart_backoff_ms)
    }

    pub fn restart_backoff_max(&self) -> Duration {
        Duration::from_millis(self.restart_backoff_max_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_gives_defaults() {
        let config = Config::parse("").unwrap();
        assert_eq!(config.mount_timeout_ms, 30_000);
        assert_eq!(config.request_timeout(), Duration::from_secs(60));
        assert_eq!(config.probe_timeout(), Duration::from_secs(10));
        assert_eq!(config.restart_budget, 5);
        assert_eq!(config.restart_window(), Duration::from_secs(60));
        assert_eq!(config.restart_backoff(), Duration::from_millis(100));
        assert_eq!(config.restart_backoff_max(), Duration::from_secs(5));
        assert_eq!(config.on_budget_exhausted, BudgetPolicy::FailRequests);
    }

    #[test]
    fn restart_settings_are_read() {
        let config = Config::parse(
            "restart_budget = 0\non_budget_exhausted = \"unmount\"\n\
             restart_backoff_ms = 50\nrestart_backoff_max_ms = 50\n",
        )
        .unwrap();
        assert_eq!(config.restart_budget, 0, "0 means never restart");
        assert_eq!(config.on_budget_exhausted, BudgetPolicy::Unmount);
        assert_eq!(config.restart_backoff_max(), config.restart_backoff());
    }

    #[test]
    fn an_unknown_policy_is_named_with_the_allowed_values() {
        let err = Config::parse("on_budget_exhausted = \"retry\"").unwrap_err();
        assert!(err.contains("`on_budget_exhausted`"), "{err}");
        assert!(
            err.contains("fail-requests") && err.contains("unmount"),
            "{err}"
        );
        assert!(!err.contains('\n'), "{err}");
    }

    #[test]
    fn an_image_needs_the_redo_log_and_a_standby_the_sandbox() {
        let err = Config::parse("image = \"/srv/disk.img\"").unwrap_err();
        assert!(err.starts_with("image: needs redo_log"), "{err}");
        let on = "image = \"/srv/disk.img\"\nredo_log = true\nstandby = \"on\"";
        assert!(Config::parse(on).is_ok());
        let err = Config::parse(&format!("{on}\n[sandbox]\nprofile = \"off\"")).unwrap_err();
        assert!(
            err.starts_with("standby:") && err.contains("sandbox"),
            "{err}"
        );
        let config = Config::parse("image = \"/srv/disk.img\"\nredo_log = true").unwrap();
        assert_eq!(config.image.as_deref(), Some(Path::new("/srv/disk.img")));
    }

    #[test]
    fn the_mode_is_read_and_fast_refuses_a_redo_log() {
        assert_eq!(Config::parse("").unwrap().mode, Mode::Auto);
        assert_eq!(Config::parse("mode = \"fast\"").unwrap().mode, Mode::Fast);
        assert!(Config::parse("mode = \"auto\"").unwrap().fast());
        assert!(!Config::parse("mode = \"auto\"\nredo_log = true")
            .unwrap()
            .fast());
        assert!(Config::parse("").unwrap().fast());
        assert!(!Config::parse("mode = \"guarded\"").unwrap().fast());
        let err = Config::parse("mode = \"fast\"\nredo_log = true").unwrap_err();
        assert!(err.starts_with("mode:"), "{err}");
        let err = Config::parse("mode = \"quick\"").unwrap_err();
        assert!(err.contains("`mode`") && err.contains("guarded"), "{err}");
    }

    #[test]
    fn backoff_max_below_backoff_is_refused() {
        let err =
            Config::parse("restart_backoff_ms = 1000\nrestart_backoff_max_ms = 500").unwrap_err();
        assert!(err.starts_with("restart_backoff_max_ms:"), "{err}");
        assert!(!err.contains('\n'), "{err}");
        for key in [
            "request_timeout_ms",
            "probe_timeout_ms",
            "restart_window_ms",
        ] {
            let err = Config::parse(&format!("{key} = 0")).unwrap_err();
            assert!(err.starts_with(key), "{err}");
        }
    }

    #[test]
    fn unknown_key_is_named_on_one_line() {
        let err = Config::parse("mount_timeout_ms = 5\nmount_timout = 3\n").unwrap_err();
        assert!(err.contains("mount_timout"), "{err}");
        assert!(err.starts_with("line 2:"), "{err}");
        assert!(!err.contains('\n'), "{err}");
    }

    #[test]
    fn the_pipe_limit_is_raised_unless_asked_not_to() {
        assert!(Config::parse("").unwrap().raise_pipe_max_size);
        assert!(
            !Config::parse("raise_pipe_max_size = false\n")
                .unwrap()
                .raise_pipe_max_size
        );
        let err = Config::parse("raise_pipe_max_size = 2\n").unwrap_err();
        assert!(err.contains("raise_pipe_max_size"), "{err}");
    }

    #[test]
    fn sandbox_and_limits_are_read() {
        let config = Config::parse(
            "[sandbox]\nprofile = \"strict\"\nwritable_paths = [\"/srv/x\"]\n\
             capabilities = [\"CAP_CHOWN\"]\nallow_syscalls = [\"ptrace\"]\n\
             [limits]\nmemory_mb = 64\ntasks = 32\n",
        )
        .unwrap();
        assert_eq!(config.sandbox.profile, Profile::Strict);
        assert!(
            !config.sandbox.network(),
            "strict has no network by default"
        );
        assert_eq!(config.limits.memory_mb, 64);
        assert_eq!(config.limits.tasks, 32);
        assert_eq!(config.limits.cpu_percent, 0, "a default: no cap");
        let config = Config::parse("").unwrap();
        assert_eq!(config.sandbox.profile, Profile::Default);
        assert!(config.sandbox.network());
    }

    #[test]
    fn sandbox_and_limits_errors_name_the_key() {
        let err = Config::parse("[sandbox]\nprofil = \"strict\"\n").unwrap_err();
        assert!(err.starts_with("line 2:"), "{err}");
        assert!(err.contains("profil"), "{err}");
        let err = Config::parse("[sandbox]\nprofile = \"lax\"\n").unwrap_err();
        assert!(err.contains("`sandbox.profile`"), "{err}");
        assert!(err.contains("strict") && err.contains("off"), "{err}");
        let err = Config::parse("[limits]\nmemory_mb = \"lots\"\n").unwrap_err();
        assert!(err.contains("`limits.memory_mb`"), "{err}");
        let err = Config::parse("[limits]\nmemory_mb = -5\n").unwrap_err();
        assert!(err.contains("`limits.memory_mb`"), "{err}");
        let err = Config::parse("[limits]\nmemory_mb = 3\n").unwrap_err();
        assert!(err.starts_with("limits.memory_mb:"), "{err}");
        let err = Config::parse("[sandbox]\nwritable_paths = [\"rel\"]\n").unwrap_err();
        assert!(err.starts_with("sandbox.writable_paths:"), "{err}");
        let err = Config::parse("[sandbox]\ncapabilities = [\"CAP_FLY\"]\n").unwrap_err();
        assert!(err.starts_with("sandbox.capabilities:"), "{err}");
        let err = Config::parse("[sandbox]\nallow_syscalls = [\"read\"]\n").unwrap_err();
        assert!(err.starts_with("sandbox.allow_syscalls:"), "{err}");
        let err = Config::parse("[metrics]\nlisten = \"localhost\"\n").unwrap_err();
        assert!(err.starts_with("metrics.listen:"), "{err}");
        let config = Config::parse("[metrics]\nlisten = \"127.0.0.1:9464\"\n").unwrap();
        assert_eq!(
            config.metrics.listen_addr(),
            Some(([127, 0, 0, 1], 9464).into())
        );
        let err = Config::parse("[limit]\ntasks = 5\n").unwrap_err();
        assert!(err.contains("limit"), "{err}");
        assert!(!err.contains('\n'), "{err}");
    }

    #[test]
    fn wrong_type_and_impossible_value_are_refused() {
        let err = Config::parse("mount_timeout_ms = \"soon\"").unwrap_err();
        assert!(err.contains("line 1"), "{err}");
        assert!(err.contains("`mount_timeout_ms`"), "{err}");
        let err = Config::parse("stop_timeout_ms = 0").unwrap_err();
        assert!(err.contains("stop_timeout_ms"), "{err}");
    }
}
