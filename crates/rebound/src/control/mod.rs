//! The control socket of each `rebound run` (this file: the server side and the status
//! record) and its clients (`client`: `rebound status`, which asks them all, `rebound restart`
//! and `rebound upgrade`, which ask one run).
//!
//! Every `rebound run` listens on `RUN_DIR/<pid>.sock`. A client writes one line with a
//! command and reads one line of JSON back:
//! - `status`: the mount's [`MountStatus`]. A client that writes nothing within 200 ms gets
//!   the same (clients from before the commands only read).
//! - `corrupt N SEED` (fault injection): the proxy corrupts the driver's next N replies in
//!   transit, before its checks; answers `{"ok":true,...}`.
//! - `restart`: the run restarts its driver through the trigger it gave
//!   [`ControlSocket::start`]; the [`RestartAnswer`] comes once the board shows that recovery
//!   finished (or failed, or the run stops), after 120 s at most.
//! - `upgrade` or `upgrade ["PROGRAM", "ARG", ...]` (a JSON array): the same, with the driver
//!   replaced by its own command line run anew or by the one given; answered as `restart`,
//!   `ok` only if the new driver is the one serving.
//! - `reload`: the run hands its mount over to the rebound binary now installed (it execs
//!   it, same pid); answered once taken, and `reloads` in the successor's status says done.
//!
//! Each connection has its own short-lived thread, so a slow restart does not hold up status
//! queries. `rebound status` lists the sockets, asks each, and prints a table (or the JSON
//! array with `--json`). A socket whose run is gone (connection refused) is removed.
//!
//! Owns: the status record, the socket's life, the wire format (a command line, then one JSON
//! object per line).
//! Must not: change the run it describes other than through the trigger the run gave it;
//! restarting and upgrading are the supervisor's business.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::proxy::{ProxyStats, RecoveryTiming};

mod client;
pub use client::{find_run, query_all, render_table, request_corrupt, request_restart};

/// How long the server waits for a command before answering `status`.
const COMMAND_WAIT: Duration = Duration::from_millis(200);
/// The longest command line the server reads (an upgrade's carries a driver's command line).
const MAX_COMMAND: u64 = 256 * 1024;
/// How long a `restart` waits for the recovery to finish before answering anyway.
pub const RESTART_WAIT: Duration = Duration::from_secs(120);
/// How many recovery latencies [`MountStatus::recovery_ms`] keeps.
const KEPT_RECOVERIES: usize = 100;

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
    /// `starting`, `serving`, `recovering`, `failed` (no more restarts) or `stopping`.
    pub state: String,
    /// The driver has answered the kernel's INIT: the mount serves (the moment rebound tells
    /// a service manager READY, and `mount.rebound` returns).
    #[serde(default)]
    pub ready: bool,
    pub restarts: u32,
    /// Driver failures detected in all (crashes, hangs, closed channels).
    #[serde(default)]
    pub failures: u64,
    /// The failures counted by cause: `crash`, `hang`, `refused_reply`, `second_opinion`,
    /// `hoarding`, `operator` (`rebound restart`), `fallback` (fast mode's observer loaded but
    /// could not attach: the first driver is replaced by a guarded one); and `during_restore`, new drivers that
    /// failed before they served (not in `failures`, which counts serving drivers).
    #[serde(default)]
    pub failures_by_cause: BTreeMap<String, u64>,
    /// The last failure of the driver and its cause, if any.
    pub last_failure: Option<String>,
    /// Objects (nodes, open handles) the recoveries could not restore; each now fails with
    /// `EIO`.
    #[serde(default)]
    pub lost_objects: u64,
    /// Recent recovery latencies, detection to first request served, in milliseconds (the
    /// last 100; see [`StatusBoard::record_recovery`]).
    pub recovery_ms: Vec<f64>,
    /// The phases of the same recoveries, in milliseconds (`reap`, `backoff`, `rollback`,
    /// `pre_restart`, `spawn`, `init`, `replay`, `restore`, `first_request`; see `proxy::RecoveryTiming`).
    #[serde(default)]
    pub recovery_phases_ms: Vec<BTreeMap<String, f64>>,
    pub driver: Vec<String>,
    pub rebound_pid: u32,
    /// Where requests go now: `"fast"` (the driver serves the kernel's queue, rebound beside
    /// it) or `"guarded"` (through rebound); empty until the mount is made.
    #[serde(default)]
    pub data_path: String,
    pub requests: u64,
    pub refused_replies: u64,
    /// Error replies held back for a restarted driver's second opinion, and how many of
    /// those it confirmed (they were then forwarded).
    #[serde(default)]
    pub second_opinions: u64,
    #[serde(default)]
    pub second_opinions_confirmed: u64,
    pub nodes: usize,
    pub open_handles: usize,
    /// Changes the driver acknowledged that no checkpoint has made durable yet (with
    /// `redo_log`; a restarted driver is given them again).
    #[serde(default)]
    pub redo_log_entries: u64,
    /// The most changes the redo log has held.
    #[serde(default)]
    pub redo_log_max: u64,
    /// Checkpoints made, and the longest in milliseconds (with `image`, requests wait as long).
    #[serde(default)]
    pub checkpoints: u64,
    #[serde(default)]
    pub checkpoint_ms_max: f64,
    /// The standby successor held ready at its `mount(2)`, if one is (see
    /// `supervisor::standby`).
    #[serde(default)]
    pub standby_pid: Option<i32>,
    /// Recoveries in which a standby successor took over.
    #[serde(default)]
    pub standby_takeovers: u64,
    /// With `image`: logged changes the standby on the image's spare has not been given yet
    /// (0 without one). A failure finds a standby lacking many more than a roll-back would
    /// replay not worth taking over.
    #[serde(default)]
    pub standby_lacks: u64,
    /// Upgrades done (`rebound upgrade`): the new driver served.
    #[serde(default)]
    pub upgrades: u64,
    /// Times this run's rebound was replaced by a successor (`rebound reload`).
    #[serde(default)]
    pub reloads: u64,
    /// Times this run's rebound died (SIGKILL, a crash) and its keeper's successor took the
    /// mount over.
    #[serde(default)]
    pub rebound_deaths: u64,
    /// The current driver's cgroup: anonymous memory, tasks, CPU time (0 without a cgroup).
    #[serde(default)]
    pub driver_memory_bytes: u64,
    #[serde(default)]
    pub driver_tasks: u64,
    #[serde(default)]
    pub driver_cpu_ms: u64,
}

/// The answer to `restart`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct RestartAnswer {
    /// The driver was restarted and serves the mount again.
    pub ok: bool,
    /// The run's state when the answer was made.
    pub state: String,
    pub restarts: u32,
    /// The latency of the last recovery, in milliseconds.
    pub recovery_ms: Option<f64>,
    /// Why the restart did not happen or did not succeed.
    pub error: Option<String>,
}

/// The live status of this run, updated by the supervisor and read by the socket's threads.
#[derive(Default)]
pub struct StatusBoard {
    status: Mutex<MountStatus>,
    /// Notified on every update, for [`StatusBoard::wait_until`].
    changed: Condvar,
    counters: Mutex<Option<Counters>>,
    /// Every recovery's latency, for the metrics.
    pub recoveries: crate::metrics::Histogram,
}

type HeldObjects = Box<dyn Fn() -> (usize, usize) + Send>;

struct Counters {
    stats: Arc<ProxyStats>,
    held: HeldObjects,
}

impl StatusBoard {
    fn status(&self) -> MutexGuard<'_, MountStatus> {
        self.status.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes the status and wakes everyone waiting in [`StatusBoard::wait_until`].
    pub fn update(&self, change: impl FnOnce(&mut MountStatus)) {
        change(&mut self.status());
        self.changed.notify_all();
    }

    /// Adds the latency of a finished recovery and its phases, keeping the last 100.
    pub fn record_recovery(&self, timing: &RecoveryTiming) {
        self.recoveries
            .observe(Duration::from_secs_f64(timing.total_ms / 1000.0));
        self.update(|s| {
            s.recovery_ms.push(timing.total_ms);
            let excess = s.recovery_ms.len().saturating_sub(KEPT_RECOVERIES);
            s.recovery_ms.drain(..excess);
            let phases = timing.phases.iter().map(|(p, ms)| (p.to_string(), *ms));
            s.recovery_phases_ms.push(phases.collect());
            let excess = s.recovery_phases_ms.len().saturating_sub(KEPT_RECOVERIES);
            s.recovery_phases_ms.drain(..excess);
        });
    }

    /// Waits until `done` holds for the status (checked now and after every update), for at
    /// most `timeout`. Returns the status that satisfied it, or `None` on timeout. The proxy's
    /// counters are not filled in.
    pub fn wait_until(
        &self,
        mut done: impl FnMut(&MountStatus) -> bool,
        timeout: Duration,
    ) -> Option<MountStatus> {
        let (status, result) = self
            .changed
            .wait_timeout_while(self.status(), timeout, |s| !done(s))
            .unwrap_or_else(|e| e.into_inner());
        (!result.timed_out()).then(|| status.clone())
    }

    /// Makes the proxy's counters part of every snapshot from now on.
    pub fn attach(&self, stats: Arc<ProxyStats>, held: HeldObjects) {
        *self.counters.lock().unwrap_or_else(|e| e.into_inner()) = Some(Counters { stats, held });
    }

    /// The proxy's counters, once attached.
    pub fn stats(&self) -> Option<Arc<ProxyStats>> {
        let counters = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        counters.as_ref().map(|c| c.stats.clone())
    }

    pub fn snapshot(&self) -> MountStatus {
        let mut status = self.status().clone();
        if let Some(c) = &*self.counters.lock().unwrap_or_else(|e| e.into_inner()) {
            status.requests = c.stats.requests.load(Relaxed);
            status.data_path = if c.stats.beside.load(Relaxed) {
                "fast"
            } else {
                "guarded"
            }
            .into();
            status.refused_replies = c.stats.refused.load(Relaxed);
            status.second_opinions = c.stats.doubted.load(Relaxed);
            status.second_opinions_confirmed = c.stats.doubts_confirmed.load(Relaxed);
            status.lost_objects = c.stats.lost_objects.load(Relaxed);
            status.redo_log_entries = c.stats.redo_entries.load(Relaxed);
            status.redo_log_max = c.stats.redo_entries_max.load(Relaxed);
            status.standby_lacks = c.stats.standby_lacks.load(Relaxed);
            status.checkpoints = c.stats.checkpoints.load(Relaxed);
            status.checkpoint_ms_max = c.stats.checkpoint_us_max.load(Relaxed) as f64 / 1000.0;
            (status.nodes, status.open_handles) = (c.held)();
        }
        status
    }
}

/// What an operator asks of a run on its control socket.
#[derive(Debug, Clone, PartialEq)]
pub enum OperatorRequest {
    /// Restart the driver as after a crash (`rebound restart`).
    Restart,
    /// Replace the driver (`rebound upgrade`): by this command line, or by its own run anew.
    Upgrade(Option<Vec<std::ffi::OsString>>),
    /// Replace this run's rebound by the binary now installed, the mount kept (`rebound
    /// reload`). Answered once taken: the run then execs its successor.
    Reload,
}

/// Asks the run for an [`OperatorRequest`]. It returns once the run has taken it (or refused
/// it, with why) and leads the board to a final state: `serving` with `restarts` incremented
/// (and `upgrades`, for an upgrade that took), or `failed`, or `stopping`.
pub type OperatorTrigger = Box<dyn Fn(OperatorRequest) -> Result<(), String> + Send + Sync>;
type Trigger = dyn Fn(OperatorRequest) -> Result<(), String> + Send + Sync;

/// The listening socket of this run; removed when dropped.
pub struct ControlSocket {
    path: PathBuf,
}

impl ControlSocket {
    /// Starts answering commands for `board` on `dir/<pid>.sock`; `restart` and `upgrade`
    /// call `trigger`.
    pub fn start(
        dir: &Path,
        board: Arc<StatusBoard>,
        trigger: OperatorTrigger,
    ) -> anyhow::Result<ControlSocket> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join(format!("{}.sock", std::process::id()));
        // A socket left by an earlier process with our pid is stale by definition.
        let _ = std::fs::remove_file(&path);
        let listener =
            UnixListener::bind(&path).with_context(|| format!("binding {}", path.display()))?;
        let trigger: Arc<Trigger> = Arc::from(trigger);
        std::thread::Builder::new()
            .name("control".into())
            .spawn(move || {
                for conn in listener.incoming().flatten() {
                    let (board, trigger) = (board.clone(), trigger.clone());
                    let spawned = std::thread::Builder::new()
                        .name("control-conn".into())
                        .spawn(move || serve(&conn, &board, &*trigger));
                    if let Err(e) = spawned {
                        tracing::warn!("control socket: no thread for a connection: {e}");
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

/// Answers one connection: reads the command, writes one JSON line.
fn serve(conn: &UnixStream, board: &StatusBoard, trigger: &Trigger) {
    let _ = conn.set_read_timeout(Some(COMMAND_WAIT));
    let mut line = String::new();
    // No whole line in time: a client from before the commands, which only reads.
    if BufReader::new(conn.take(MAX_COMMAND))
        .read_line(&mut line)
        .is_err()
    {
        line.clear();
    }
    let answer = match line.trim() {
        "" | "status" => serde_json::to_string(&board.snapshot()),
        "restart" => serde_json::to_string(&restart(board, trigger, OperatorRequest::Restart)),
        "upgrade" => {
            serde_json::to_string(&restart(board, trigger, OperatorRequest::Upgrade(None)))
        }
        "reload" => serde_json::to_string(&reload(board, trigger)),
        cmd if cmd.starts_with("upgrade ") => {
            match serde_json::from_str::<Vec<String>>(&cmd["upgrade ".len()..]) {
                Ok(argv) if !argv.is_empty() => {
                    let argv = argv.into_iter().map(Into::into).collect();
                    serde_json::to_string(&restart(
                        board,
                        trigger,
                        OperatorRequest::Upgrade(Some(argv)),
                    ))
                }
                _ => serde_json::to_string(&serde_json::json!({
                    "error": "usage: upgrade [\"PROGRAM\", \"ARG\", ...]"
                })),
            }
        }
        cmd if cmd.starts_with("corrupt ") => serde_json::to_string(&corrupt(board, cmd)),
        other => serde_json::to_string(&serde_json::json!({
            "error": format!("unknown command `{other}`; the commands are status, restart, upgrade, reload and corrupt")
        })),
    };
    let _ = conn.set_write_timeout(Some(Duration::from_secs(1)));
    if let Ok(answer) = answer {
        let mut conn = conn;
        let _ = writeln!(conn, "{answer}");
    }
}

/// Triggers a restart or an upgrade and waits for its outcome on the board.
fn restart(board: &StatusBoard, trigger: &Trigger, request: OperatorRequest) -> RestartAnswer {
    let before = board.snapshot();
    let refuse = |why: String| RestartAnswer {
        ok: false,
        state: before.state.clone(),
        restarts: before.restarts,
        recovery_ms: before.recovery_ms.last().copied(),
        error: Some(why),
    };
    match before.state.as_str() {
        "starting" => return refuse("the driver has not mounted yet".into()),
        "stopping" => return refuse("the run is stopping".into()),
        _ => {}
    }
    let upgrade = matches!(request, OperatorRequest::Upgrade(_));
    tracing::info!("{request:?} of the driver asked for on the control socket");
    if let Err(why) = trigger(request) {
        return refuse(why);
    }
    // Done when the new driver serves and its recovery latency is in (it is measured at the
    // first request served), or when it failed (again) or the run stops.
    let finished = board.wait_until(
        |s| {
            (s.restarts > before.restarts
                && s.state == "serving"
                && s.recovery_ms != before.recovery_ms)
                || (s.state == "failed"
                    && (before.state != "failed" || s.failures > before.failures))
                || s.state == "stopping"
        },
        RESTART_WAIT,
    );
    let now = finished.clone().unwrap_or_else(|| board.snapshot());
    let served = finished.is_some() && now.restarts > before.restarts && now.state == "serving";
    let ok = served && (!upgrade || now.upgrades > before.upgrades);
    let error = match (&finished, now.state.as_str()) {
        _ if ok => None,
        _ if served => Some(with_cause(
            "the upgrade was undone, and the previous driver serves again",
            &now.last_failure,
        )),
        (None, state) => Some(format!(
            "no restart finished within {} s (state: {state})",
            RESTART_WAIT.as_secs()
        )),
        (Some(_), "stopping") => Some("the run is stopping".into()),
        (Some(_), _) => Some(with_cause("the restart failed", &now.last_failure)),
    };
    RestartAnswer {
        ok,
        state: now.state,
        restarts: now.restarts,
        recovery_ms: now.recovery_ms.last().copied(),
        error,
    }
}

/// Asks the run to hand its mount over to a successor; answers once it is taken (the client
/// watches the successor's status for the outcome: this process will exec it).
fn reload(board: &StatusBoard, trigger: &Trigger) -> RestartAnswer {
    let before = board.snapshot();
    let error = match before.state.as_str() {
        "serving" => trigger(OperatorRequest::Reload).err(),
        state => Some(format!("the driver is not serving (state: {state})")),
    };
    RestartAnswer {
        ok: error.is_none(),
        state: before.state,
        restarts: before.restarts,
        recovery_ms: before.recovery_ms.last().copied(),
        error,
    }
}

/// Fault injection: `corrupt N SEED` makes the proxy corrupt the driver's next N replies in
/// transit, before its checks (see `proxy::corrupt_in_transit`).
fn corrupt(board: &StatusBoard, cmd: &str) -> serde_json::Value {
    let args: Vec<u64> = cmd
        .split_whitespace()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let [n, seed] = args[..] else {
        return serde_json::json!({ "error": "usage: corrupt N SEED" });
    };
    match &*board.counters.lock().unwrap_or_else(|e| e.into_inner()) {
        // Beside the path the driver's replies go to the kernel without crossing rebound.
        Some(c) if c.stats.beside.load(Relaxed) => serde_json::json!({
            "error": "the driver's replies do not cross rebound in fast mode; corrupting them \
                      in transit needs mode = \"guarded\""
        }),
        Some(c) => {
            c.stats.corrupt_seed.store(seed, Relaxed);
            c.stats.corrupt_next.store(n, Relaxed);
            tracing::warn!("fault injection: the next {n} driver replies will be corrupted");
            serde_json::json!({ "ok": true, "armed": n, "seed": seed })
        }
        None => serde_json::json!({ "error": "the proxy has not started" }),
    }
}

fn with_cause(what: &str, cause: &Option<String>) -> String {
    match cause {
        Some(cause) => format!("{what}: {cause}"),
        None => what.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn test_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("rebound-control-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn corrupt_arms_the_proxy() {
        let board = StatusBoard::default();
        assert!(corrupt(&board, "corrupt 3 7")["error"].is_string());
        let stats = Arc::new(ProxyStats::default());
        board.attach(stats.clone(), Box::new(|| (0, 0)));
        assert!(corrupt(&board, "corrupt 3")["error"].is_string());
        assert_eq!(corrupt(&board, "corrupt 3 7")["ok"], true);
        assert_eq!(stats.corrupt_next.load(Relaxed), 3);
        assert_eq!(stats.corrupt_seed.load(Relaxed), 7);
        stats.beside.store(true, Relaxed);
        let refused = corrupt(&board, "corrupt 5 7");
        assert!(
            refused["error"].as_str().unwrap().contains("guarded"),
            "{refused}"
        );
        assert_eq!(stats.corrupt_next.load(Relaxed), 3);
    }

    fn serving_board(mountpoint: &str) -> Arc<StatusBoard> {
        let board = Arc::new(StatusBoard::default());
        board.update(|s| {
            s.mountpoint = mountpoint.into();
            s.state = "serving".into();
            s.driver_pid = Some(42);
        });
        board
    }

    fn no_restart() -> OperatorTrigger {
        Box::new(|_| Ok(()))
    }

    /// Sends `command` (or nothing) and reads the answer line.
    fn raw(socket: &Path, command: Option<&str>) -> String {
        let mut conn = UnixStream::connect(socket).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        if let Some(command) = command {
            writeln!(conn, "{command}").unwrap();
        }
        let mut line = String::new();
        BufReader::new(conn).read_line(&mut line).unwrap();
        line
    }

    #[test]
    fn a_run_answers_its_status_and_a_gone_run_is_cleaned_up() {
        let dir = test_dir("status");
        let board = serving_board("/mnt/x");
        let socket = ControlSocket::start(&dir, board.clone(), no_restart()).unwrap();
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

    #[test]
    fn an_old_client_that_sends_nothing_gets_the_status_and_a_bad_command_an_error() {
        let dir = test_dir("old-client");
        let board = serving_board("/mnt/old");
        let _socket = ControlSocket::start(&dir, board, no_restart()).unwrap();
        let path = dir.join(format!("{}.sock", std::process::id()));

        let status: MountStatus = serde_json::from_str(&raw(&path, None)).unwrap();
        assert_eq!(status.mountpoint, "/mnt/old");
        let answer: serde_json::Value = serde_json::from_str(&raw(&path, Some("reboot"))).unwrap();
        let error = answer["error"].as_str().unwrap();
        assert!(
            error.contains("`reboot`") && error.contains("restart"),
            "{error}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn restart_waits_for_the_recovery_while_status_still_answers() {
        let dir = test_dir("restart");
        let board = serving_board("/mnt/r");
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let (finish_tx, finish_rx) = std::sync::mpsc::channel::<()>();
        let finish_rx = Arc::new(Mutex::new(finish_rx));
        let recovering = board.clone();
        // What the supervisor does on a trigger: wake up and recover on its own thread.
        let trigger: OperatorTrigger = Box::new(move |_| {
            let (board, started_tx, finish_rx) =
                (recovering.clone(), started_tx.clone(), finish_rx.clone());
            std::thread::spawn(move || {
                board.update(|s| s.state = "recovering".into());
                started_tx.send(()).unwrap();
                // Recovering until the test has seen status answer meanwhile.
                let _ = finish_rx
                    .lock()
                    .unwrap()
                    .recv_timeout(Duration::from_secs(10));
                board.update(|s| {
                    s.state = "serving".into();
                    s.restarts += 1;
                    s.failures += 1;
                });
                board.record_recovery(&RecoveryTiming {
                    total_ms: 5.0,
                    phases: vec![("spawn", 4.0), ("first_request", 1.0)],
                });
            });
            Ok(())
        });
        let _socket = ControlSocket::start(&dir, board.clone(), trigger).unwrap();
        let path = dir.join(format!("{}.sock", std::process::id()));

        let asker = {
            let path = path.clone();
            std::thread::spawn(move || request_restart(&path, &OperatorRequest::Restart))
        };
        started_rx.recv_timeout(Duration::from_secs(5)).unwrap();
        let asked = Instant::now();
        let all = query_all(&dir);
        assert!(
            asked.elapsed() < Duration::from_secs(1),
            "status is not held up"
        );
        assert_eq!(all[0].state, "recovering");
        finish_tx.send(()).unwrap();

        let answer = asker.join().unwrap().unwrap();
        assert_eq!(
            answer,
            RestartAnswer {
                ok: true,
                state: "serving".into(),
                restarts: 1,
                recovery_ms: Some(5.0),
                error: None,
            }
        );
        let all = query_all(&dir);
        assert_eq!((all[0].restarts, all[0].failures), (1, 1));
        assert!(render_table(&all).contains("5.0 ms"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_failed_or_refused_restart_says_why() {
        let dir = test_dir("restart-fails");
        let board = serving_board("/mnt/f");
        let failing = board.clone();
        let trigger: OperatorTrigger = Box::new(move |_| {
            let board = failing.clone();
            std::thread::spawn(move || {
                board.update(|s| {
                    s.state = "failed".into();
                    s.last_failure = Some("driver killed by SIGSEGV".into());
                })
            });
            Ok(())
        });
        let _socket = ControlSocket::start(&dir, board.clone(), trigger).unwrap();
        let path = dir.join(format!("{}.sock", std::process::id()));

        let answer = request_restart(&path, &OperatorRequest::Restart).unwrap();
        assert!(!answer.ok);
        assert_eq!(answer.state, "failed");
        assert_eq!(
            answer.error.as_deref(),
            Some("the restart failed: driver killed by SIGSEGV")
        );
        board.update(|s| s.state = "starting".into());
        let answer = request_restart(&path, &OperatorRequest::Restart).unwrap();
        assert_eq!(
            answer.error.as_deref(),
            Some("the driver has not mounted yet")
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_reload_is_answered_once_taken_and_only_while_serving() {
        let dir = test_dir("reload");
        let board = serving_board("/mnt/r");
        let asked = Arc::new(Mutex::new(Vec::new()));
        let seen = asked.clone();
        let trigger: OperatorTrigger = Box::new(move |request| {
            seen.lock().unwrap().push(request);
            Ok(())
        });
        let _socket = ControlSocket::start(&dir, board.clone(), trigger).unwrap();
        let path = dir.join(format!("{}.sock", std::process::id()));

        let answer = request_restart(&path, &OperatorRequest::Reload).unwrap();
        assert!(answer.ok && answer.error.is_none(), "{answer:?}");
        assert_eq!(*asked.lock().unwrap(), [OperatorRequest::Reload]);
        board.update(|s| s.state = "recovering".into());
        let answer = request_restart(&path, &OperatorRequest::Reload).unwrap();
        assert_eq!(
            answer.error.as_deref(),
            Some("the driver is not serving (state: recovering)")
        );
        assert_eq!(asked.lock().unwrap().len(), 1, "not asked of the run");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_board_keeps_the_last_recoveries_and_wakes_waiters() {
        let board = Arc::new(StatusBoard::default());
        for i in 0..150 {
            board.record_recovery(&RecoveryTiming {
                total_ms: f64::from(i),
                phases: vec![("spawn", f64::from(i))],
            });
        }
        let status = board.snapshot();
        let recoveries = status.recovery_ms;
        assert_eq!(recoveries.len(), 100);
        assert_eq!((recoveries[0], recoveries[99]), (50.0, 149.0));
        assert_eq!(status.recovery_phases_ms.len(), 100);
        assert_eq!(status.recovery_phases_ms[99]["spawn"], 149.0);

        assert!(board
            .wait_until(|s| s.restarts > 0, Duration::from_millis(20))
            .is_none());
        let updater = board.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            updater.update(|s| s.restarts = 1);
        });
        let seen = board.wait_until(|s| s.restarts > 0, Duration::from_secs(5));
        assert_eq!(seen.map(|s| s.restarts), Some(1));
    }

    #[test]
    fn a_run_is_found_by_its_mount_point_however_it_is_spelt() {
        let dir = test_dir("find");
        let mnt = dir.join("mnt");
        std::fs::create_dir_all(&mnt).unwrap();
        std::os::unix::fs::symlink("mnt", dir.join("link")).unwrap();
        let board = serving_board(&mnt.display().to_string());
        let _socket = ControlSocket::start(&dir, board, no_restart()).unwrap();

        for spelling in [
            mnt.clone(),
            dir.join("mnt/"),
            dir.join("./mnt/../mnt"),
            dir.join("link"),
        ] {
            let found = find_run(&dir, &spelling);
            assert!(found.is_some(), "{}", spelling.display());
        }
        assert!(find_run(&dir, &dir.join("elsewhere")).is_none());
        // A mount point that cannot be resolved any more is still found by its name.
        let gone = test_dir("find-gone").join("mnt");
        let board = serving_board(&gone.display().to_string());
        let other_dir = test_dir("find-other");
        let _other = ControlSocket::start(&other_dir, board, no_restart()).unwrap();
        assert!(find_run(&other_dir, &gone).is_some());
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(&other_dir);
    }
}
