//! The client side of the control sockets: finding the runs and the one that serves a mount
//! point, asking them (`status`, `restart`, `upgrade`, `corrupt`), and the table `rebound
//! status` prints.
//!
//! Owns: connecting, the wire's client half, reading answers of runs older than a command.
//! Must not: act on a run other than by asking it.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{MountStatus, OperatorRequest, RestartAnswer, RESTART_WAIT};

/// Sends `corrupt N SEED` to the run listening on `socket`; returns its one-line answer.
pub fn request_corrupt(socket: &Path, n: u64, seed: u64) -> Result<String, String> {
    ask(
        socket,
        &format!("corrupt {n} {seed}"),
        Duration::from_secs(5),
    )
    .map_err(|e| match e {
        QueryError::Gone => "the run is gone".to_string(),
        QueryError::Other(e) => e,
    })
}

/// Asks every live run for its status, in mount point order.
pub fn query_all(dir: &Path) -> Vec<MountStatus> {
    query_sockets(dir).into_iter().map(|(_, s)| s).collect()
}

/// Every live run's socket and status, in mount point order.
fn query_sockets(dir: &Path) -> Vec<(PathBuf, MountStatus)> {
    let mut all: Vec<(PathBuf, MountStatus)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|e| e == "sock"))
        .filter_map(|path| match query(&path) {
            Ok(status) => Some((path, status)),
            Err(QueryError::Gone) => {
                // Stale only if its run is gone: a run that is reloading (exec'ing its
                // successor, same pid) is about to bind it anew.
                let pid = path
                    .file_stem()
                    .and_then(|p| p.to_str())
                    .unwrap_or_default();
                if !Path::new("/proc").join(pid).exists() {
                    let _ = std::fs::remove_file(&path);
                }
                None
            }
            Err(QueryError::Other(e)) => {
                tracing::warn!("{}: {e}", path.display());
                None
            }
        })
        .collect();
    all.sort_by(|a, b| a.1.mountpoint.cmp(&b.1.mountpoint));
    all
}

/// The socket and status of the live run that serves `mountpoint`, if any.
pub fn find_run(dir: &Path, mountpoint: &Path) -> Option<(PathBuf, MountStatus)> {
    let wanted = crate::paths::mount_point_forms(mountpoint);
    query_sockets(dir).into_iter().find(|(_, status)| {
        crate::paths::mount_point_forms(Path::new(&status.mountpoint))
            .iter()
            .any(|form| wanted.contains(form))
    })
}

/// Asks the run listening on `socket` for `request` and waits for the outcome. The error is
/// one line.
pub fn request_restart(socket: &Path, request: &OperatorRequest) -> Result<RestartAnswer, String> {
    let command = match request {
        OperatorRequest::Restart => "restart".to_string(),
        OperatorRequest::Upgrade(None) => "upgrade".to_string(),
        OperatorRequest::Reload => "reload".to_string(),
        OperatorRequest::Upgrade(Some(argv)) => {
            let argv: Vec<String> = argv
                .iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect();
            format!("upgrade {}", serde_json::Value::from(argv))
        }
    };
    let line =
        ask(socket, &command, RESTART_WAIT + Duration::from_secs(10)).map_err(|e| match e {
            QueryError::Gone => "the run is gone".to_string(),
            QueryError::Other(e) => e,
        })?;
    serde_json::from_str(&line).map_err(|e| {
        if serde_json::from_str::<MountStatus>(&line).is_ok() {
            "this rebound run is older than this command and cannot do it".to_string()
        } else {
            format!("bad answer to restart: {e}")
        }
    })
}

enum QueryError {
    /// Nobody listens: the run is gone.
    Gone,
    Other(String),
}

fn query(path: &Path) -> Result<MountStatus, QueryError> {
    let line = ask(path, "status", Duration::from_secs(2))?;
    serde_json::from_str(&line).map_err(|e| QueryError::Other(format!("bad status: {e}")))
}

/// Sends `command` and reads the one-line answer, waiting at most `wait` for it.
fn ask(path: &Path, command: &str, wait: Duration) -> Result<String, QueryError> {
    let mut conn = UnixStream::connect(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound => QueryError::Gone,
        _ => QueryError::Other(e.to_string()),
    })?;
    let _ = conn.set_write_timeout(Some(Duration::from_secs(2)));
    let _ = conn.set_read_timeout(Some(wait));
    // A run from before the commands answers without reading and may have closed already;
    // its answer is still there to read.
    let _ = writeln!(conn, "{command}");
    let mut line = String::new();
    BufReader::new(conn)
        .read_line(&mut line)
        .map_err(|e| QueryError::Other(e.to_string()))?;
    Ok(line)
}

/// The table `rebound status` prints.
pub fn render_table(all: &[MountStatus]) -> String {
    let mut out = format!(
        "{:<32} {:>10} {:<10} {:>8} {:>8} {:>11} {:<24} {}\n",
        "MOUNTPOINT",
        "DRIVER-PID",
        "STATE",
        "RESTARTS",
        "FAILURES",
        "LAST-RECOV",
        "LAST-FAILURE",
        "DRIVER"
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
            "{:<32} {:>10} {:<10} {:>8} {:>8} {:>11} {:<24} {}\n",
            s.mountpoint,
            pid,
            s.state,
            s.restarts,
            s.failures,
            recovery,
            s.last_failure.as_deref().unwrap_or("-"),
            s.driver.first().map_or("", String::as_str),
        );
    }
    out
}
