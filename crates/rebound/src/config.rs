//! `rebound.toml`: per-mount settings, with defaults built in.
//!
//! Owns: the file format, its defaults and its error messages (one line naming the key).
//! Must not: act on the settings.

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

/// Settings for one `rebound run`. Every key is optional; unknown keys are errors.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// How long the driver may take from start to `mount(2)` before rebound gives up on it
    /// (it may be a command that is not a FUSE driver at all).
    pub mount_timeout_ms: u64,
    /// How long a stopping driver gets to finish (flush its image, close its connection)
    /// before it is killed. Killing a driver mid-flush can corrupt what it stores, so this is
    /// generous; a second SIGINT/SIGTERM to rebound kills at once.
    pub stop_timeout_ms: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            mount_timeout_ms: 30_000,
            stop_timeout_ms: 60_000,
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
            match line.split_once('=') {
                Some((key, _)) if !message.contains(key.trim()) => {
                    format!("line {line_no}: `{}`: {message}", key.trim())
                }
                _ => format!("line {line_no}: {message}"),
            }
        })?;
        config.check()?;
        Ok(config)
    }

    fn check(&self) -> Result<(), String> {
        if self.mount_timeout_ms == 0 {
            return Err("mount_timeout_ms: must be greater than 0".into());
        }
        if self.stop_timeout_ms == 0 {
            return Err("stop_timeout_ms: must be greater than 0".into());
        }
        Ok(())
    }

    pub fn mount_timeout(&self) -> Duration {
        Duration::from_millis(self.mount_timeout_ms)
    }

    pub fn stop_timeout(&self) -> Duration {
        Duration::from_millis(self.stop_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_gives_defaults() {
        let config = Config::parse("").unwrap();
        assert_eq!(config.mount_timeout_ms, 30_000);
    }

    #[test]
    fn unknown_key_is_named_on_one_line() {
        let err = Config::parse("mount_timeout_ms = 5\nmount_timout = 3\n").unwrap_err();
        assert!(err.contains("mount_timout"), "{err}");
        assert!(err.starts_with("line 2:"), "{err}");
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
