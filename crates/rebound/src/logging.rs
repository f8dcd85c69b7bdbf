//! Where rebound's log goes: stderr, formatted for a terminal or a file; or, when stderr is
//! the journal (systemd says so in `JOURNAL_STREAM`), the journal's own protocol, so that each
//! entry carries fields of the mount it is about (`REBOUND_MOUNTPOINT`, `REBOUND_DRIVER`) and
//! `journalctl REBOUND_MOUNTPOINT=/mnt/disk` finds them.
//!
//! Owns: choosing and building the subscriber. Must not: decide what is logged.

use std::os::unix::fs::MetadataExt;

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

/// Sets up logging at `level` (`RUST_LOG` overrides), with `fields` on every journal entry.
pub fn init(level: &str, fields: &[(&str, String)]) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    let journal = stderr_is_journal()
        .then(|| tracing_journald::layer().ok())
        .flatten()
        .map(|layer| {
            layer
                .with_syslog_identifier("rebound".into())
                .with_custom_fields(fields.iter().map(|(k, v)| (*k, v.as_bytes())))
        });
    match journal {
        Some(journal) => tracing_subscriber::registry()
            .with(filter)
            .with(journal)
            .init(),
        None => tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_target(false)
            .init(),
    }
}

/// Whether stderr is the stream `JOURNAL_STREAM` (`DEVICE:INODE`) names.
fn stderr_is_journal() -> bool {
    let Some(stream) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Ok(stderr) = std::fs::metadata("/proc/self/fd/2") else {
        return false;
    };
    stream.to_string_lossy() == format!("{}:{}", stderr.dev(), stderr.ino())
}
