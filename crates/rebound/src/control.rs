//! The control socket of each `rebound run`, and `rebound status`, which reads them all.
//!
//! Every `rebound run` listens on `RUN_DIR/<pid>.sock` and answers each connection with one
//! line of JSON describing its mount ([`MountStatus`]). `rebound status` lists the sockets,
//! asks each, and prints a table (or the JSON array with `--json`). A socket whose run is
//! gone (connection refused) is removed.
//!
//! Owns: the status record, the socket's life, the wire format (one JSON object per line).
//! Must not: change the run it describes (status is read-only).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::proxy::ProxyStats;

/// Where the control sockets live; `REBOUND_RUN_DIR` overrides it (for tests).
pub fn run_dir() -> PathBuf {
    std::env::var_os("REBOUND_RUN_DIR").map_or_else(|| PathBuf::from("/run/rebound"), PathBuf::from)
}

/// What `rebound status` reports of one mount.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct MountStatus {
    pub mountpoint: String,
    /// The process serving the mount (the daemon, once a driver has daemonized).
    pub driver_pid: Option<i32>,
    /// `starting`, `serving` or `stopping`.
    pub state: String,
    pub restarts: u32,
    /// The last failure of the driver and its cause, if any.
    pub last_failure: Option<String>,
    /// Recent recovery latencies, detection to first request served, in milliseconds.
    pub recovery_ms: Vec<f64>,
    pub driver: Vec<String>,
    pub rebound_pid: u32,
    pub requests: u64,
    pub refused_replies: u64,
    pub nodes: usize,
    pub open_handles: usize,
}

/// The live status of this run, updated by the supervisor and read by the socket's thread.
#[derive(Default)]
pub struct StatusBoard {
    status: Mutex<MountStatus>,
    counters: Mutex<Option<Counters>>,
}

type HeldObjects = Box<dyn Fn() -> (usize, usize) + Send>;

struct Counters {
    stats: Arc<ProxyStats>,
    held: HeldObjects,
}

impl StatusBoard {
    pub fn update(&self, change: impl FnOnce(&mut MountStatus)) {
        change(&mut self.status.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// Makes the proxy's counters part of every snapshot from now on.
    pub fn attach(&self, stats: Arc<ProxyStats>, held: HeldObjects) {
        *self.counters.lock().unwrap_or_else(|e| e.into_inner()) = Some(Counters { stats, held });
    }

    pub fn snapshot(&self) -> MountStatus {
        let mut status = self
            .status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(c) = &*self.counters.lock().unwrap_or_else(|e| e.into_inner()) {
            status.requests = c.stats.requests.load(Relaxed);
            status.refused_replies = c.stats.refused.load(Relaxed);
            (status.nodes, status.open_handles) = (c.held)();
        }
        status
    }
}

/// The listening socket of this run; removed when dropped.
pub struct ControlSocket {
    path: PathBuf,
}

impl ControlSocket {
    /// Starts answering status queries for `board` on `dir/<pid>.sock`.
    pub fn start(dir: &Path, board: Arc<StatusBoard>) -> anyhow::Result<ControlSocket> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join(format!("{}.sock", std::process::id()));
        // A socket left by an earlier process with our pid is stale by definition.
        let _ = std::fs::remove_file(&path);
        let listener =
            UnixListener::bind(&path).with_context(|| format!("binding {}", path.display()))?;
        std::thread::Builder::new()
            .name("control".into())
            .spawn(move || {
                for mut conn in listener.incoming().flatten() {
                    let _ = conn.set_write_timeout(Some(Duration::from_secs(1)));
                    if let Ok(line) = serde_json::to_string(&board.snapshot()) {
                        let _ = writeln!(conn, "{line}");
                    }
                }
            })?;
        Ok(ControlSocket { path })
    }
}

impl Drop for ControlSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Asks every live run for its status, in mount point order.
pub fn query_all(dir: &Path) -> Vec<MountStatus> {
    let mut all: Vec<MountStatus> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|e| e == "sock"))
        .filter_map(|path| match query(&path) {
            Ok(status) => Some(status),
            Err(QueryError::Gone) => {
                let _ = std::fs::remove_file(&path);
                None
            }
            Err(QueryError::Other(e)) => {
                tracing::warn!("{}: {e}", path.display());
                None
            }
        })
        .collect();
    all.sort_by(|a, b| a.mountpoint.cmp(&b.mountpoint));
    all
}

enum QueryError {
    /// Nobody listens: the run is gone.
    Gone,
    Other(String),
}

fn query(path: &Path) -> Result<MountStatus, QueryError> {
    let conn = UnixStream::connect(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound => QueryError::Gone,
        _ => QueryError::Other(e.to_string()),
    })?;
    let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
    let mut line = String::new();
    BufReader::new(conn)
        .read_line(&mut line)
        .map_err(|e| QueryError::Other(e.to_string()))?;
    serde_json::from_str(&line).map_err(|e| QueryError::Other(format!("bad status: {e}")))
}

/// The table `rebound status` prints.
pub fn render_table(all: &[MountStatus]) -> String {
    let mut out = format!(
        "{:<32} {:>10} {:<9} {:>8} {:>11} {:<24} {}\n",
        "MOUNTPOINT", "DRIVER-PID", "STATE", "RESTARTS", "LAST-RECOV", "LAST-FAILURE", "DRIVER"
    );
    for s in all {
        let pid = s
            .driver_pid
            .map_or_else(|| "-".to_string(), |p| p.to_string());
        let recovery = s
            .recovery_ms
            .last()
            .map_or_else(|| "-".to_string(), |ms| format!("{ms:.1} ms"));
        out += &format!(
            "{:<32} {:>10} {:<9} {:>8} {:>11} {:<24} {}\n",
            s.mountpoint,
            pid,
            s.state,
            s.restarts,
            recovery,
            s.last_failure.as_deref().unwrap_or("-"),
            s.driver.first().map_or("", String::as_str),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_answers_its_status_and_a_gone_run_is_cleaned_up() {
        let dir = std::env::temp_dir().join(format!("rebound-control-test-{}", std::process::id()));
        let board = Arc::new(StatusBoard::default());
        board.update(|s| {
            s.mountpoint = "/mnt/x".into();
            s.state = "serving".into();
            s.driver_pid = Some(42);
        });
        let socket = ControlSocket::start(&dir, board.clone()).unwrap();
        // A stale socket of a run that no longer exists.
        let stale = dir.join("999999999.sock");
        drop(UnixListener::bind(&stale).unwrap());

        let all = query_all(&dir);
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].mountpoint, "/mnt/x");
        assert_eq!(all[0].driver_pid, Some(42));
        assert!(!stale.exists(), "the stale socket is removed");
        assert!(render_table(&all).contains("/mnt/x"));

        drop(socket);
        assert!(query_all(&dir).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
