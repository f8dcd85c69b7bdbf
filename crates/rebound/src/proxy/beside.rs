//! The fast path (`mode = "fast"`): while the first driver serves the kernel's queue itself,
//! on a clone of rebound's connection, rebound stands beside the path. The observer
//! (`rebound-observe`) reports each request that ended, with its reply, and each forget the
//! driver read; they go to the [`ObjectTable`] as the forwarding threads would have recorded
//! them, so that a failure finds the tracker as current as in guarded mode.
//!
//! When the driver fails, [`Proxy::take_over`] drains what is left, detaches the observer,
//! puts back in the queue the requests the dead driver had read (`FUSE_NOTIFY_RESEND`: they
//! are kept, because rebound holds the driver's device open) and starts the forwarding
//! threads. From then on the mount is guarded, exactly as if it had been from the start: a
//! new driver's ids differ from the kernel's, and only the proxy translates them.
//!
//! Owns: the observation thread, what an observed event changes, the take-over, and the hang
//! check while beside. Must not: check replies (they reached the kernel before rebound saw
//! them) or forward anything.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fuse_wire::abi::{size, ROOT_ID};
use fuse_wire::ids::read_u64;
use fuse_wire::{Opcode, OutHeader};
use rebound_observe::{Event, Observer, Seen};
use tracker::PendingChange;
use zerocopy::FromBytes;

use super::{
    cache_root_attr, commit_change, is_ours, lock, Link, ProxyEvent, RequestInfo, Shared, NODEID_AT,
};

/// How often the observer's ring is drained: batches cost nothing a driver notices, a wake-up
/// per event cost 0.41 of its stat speed (bench/results/fast-path-spike-2026-11-25.md).
const DRAIN_EVERY: Duration = Duration::from_millis(20);

/// What rebound keeps while the driver serves the kernel's queue.
pub(super) struct Beside {
    /// `None` once the proxy has taken over.
    observer: Mutex<Option<Observer>>,
    /// rebound's references to the driver's `/dev/fuse` descriptors: while one is open, the
    /// requests the driver read stay with the kernel when the driver dies.
    devices: Mutex<Vec<OwnedFd>>,
    /// The connection's files in fusectl (`/sys/fs/fuse/connections/N`), opened while the
    /// connection is known to live: once it is gone they read and act on nothing, where a
    /// path would name whichever mount has the number next (numbers are reused at once).
    control: Option<Control>,
    /// When a request last ended, for the hang check.
    last_end: Mutex<Instant>,
    /// Where the connection is mounted, for the liveness probe.
    mountpoint: std::path::PathBuf,
    /// The liveness probe out, if one is.
    probe: Mutex<Option<Probe>>,
    /// When the counts by opcode were last read (see [`COUNT_EVERY`]).
    counted: Mutex<Instant>,
    /// rebound ended the connection itself ([`Beside::end_connection`]): the mount is dead
    /// but still mounted, for rebound to unmount.
    ended: AtomicBool,
}

/// A connection's directory in fusectl, and its `abort` file. (`waiting` is opened anew for
/// each read, in the directory held: fusectl's files cannot be read again at offset 0.)
struct Control {
    dir: OwnedFd,
    abort: std::fs::File,
}

impl Control {
    fn open(connection: u32) -> std::io::Result<Control> {
        use rustix::fs::{openat, Mode, OFlags, CWD};
        let dir = openat(
            CWD,
            format!("/sys/fs/fuse/connections/{connection}"),
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let abort = openat(
            &dir,
            "abort",
            OFlags::WRONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(Control {
            dir,
            abort: abort.into(),
        })
    }

    /// The `waiting` count; `None` once the connection is gone (the kernel empties its files).
    fn waiting(&self) -> Option<u64> {
        use rustix::fs::{openat, Mode, OFlags};
        use std::io::Read;
        let file = openat(
            &self.dir,
            "waiting",
            OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        );
        let mut text = String::new();
        std::fs::File::from(file.ok()?)
            .read_to_string(&mut text)
            .ok()?;
        text.trim().parse().ok()
    }
}

/// How often the observer's counts by opcode go to the metrics: a map read per opcode.
const COUNT_EVERY: Duration = Duration::from_secs(1);

/// A liveness probe beside the path: a `statfs(2)` of the mount from a thread of rebound's,
/// which only the driver can answer (the kernel keeps no file system statistics of a FUSE
/// mount). A hung driver leaves the thread waiting until a successor answers it (resent).
struct Probe {
    sent: Instant,
    answered: Arc<AtomicBool>,
}

impl Probe {
    fn send(mountpoint: &std::path::Path) -> Option<Probe> {
        let answered = Arc::new(AtomicBool::new(false));
        let done = answered.clone();
        let path = mountpoint.to_path_buf();
        std::thread::Builder::new()
            .name("liveness-probe".into())
            .spawn(move || {
                // Any answer, an error included, is the driver's (or the kernel's) and live.
                let _ = rustix::fs::statfs(&path);
                done.store(true, Ordering::Relaxed);
            })
            .inspect_err(|e| tracing::warn!("starting a liveness probe: {e}"))
            .ok()?;
        Some(Probe {
            sent: Instant::now(),
            answered,
        })
    }
}

impl Beside {
    pub(super) fn new(observer: Observer, device: OwnedFd) -> Beside {
        let connection = observer.connection();
        let mountpoint = observer.mountpoint().to_path_buf();
        Beside {
            observer: Mutex::new(Some(observer)),
            devices: Mutex::new(vec![device]),
            control: Control::open(connection)
                .inspect_err(|e| tracing::warn!("opening connection {connection} in fusectl: {e}"))
                .ok(),
            last_end: Mutex::new(Instant::now()),
            mountpoint,
            probe: Mutex::new(None),
            counted: Mutex::new(Instant::now()),
            ended: AtomicBool::new(false),
        }
    }

    /// Ends the connection (fusectl's `abort`): the driver's reads fail with `ENODEV`, as
    /// they do once a mount is gone. A driver that unmounted waits for that, and a copy of the
    /// mount in its own namespace (see `supervisor::intercept`) keeps the connection open.
    /// A connection already gone is left alone (the kernel ignores the write).
    pub(super) fn end_connection(&self) {
        use std::io::Write;
        let Some(control) = &self.control else { return };
        match (&control.abort).write_all(b"1") {
            Ok(()) => self.ended.store(true, Ordering::Relaxed),
            Err(e) => tracing::warn!("ending the connection through fusectl: {e}"),
        }
    }

    /// Whether rebound ended the connection (see [`Beside::end_connection`]).
    pub(super) fn ended(&self) -> bool {
        self.ended.load(Ordering::Relaxed)
    }

    /// Keeps a reference to another of the driver's descriptors on the connection.
    pub(super) fn keep_device(&self, device: OwnedFd) {
        lock(&self.devices).push(device);
    }

    /// Whether the driver still serves the kernel's queue (the proxy has not taken over).
    pub(super) fn active(&self) -> bool {
        lock(&self.observer).is_some()
    }

    /// How many requests of the connection wait for an answer (fusectl's `waiting`).
    fn waiting(&self) -> Option<u64> {
        self.control.as_ref()?.waiting()
    }

    /// Whether requests wait and none has ended for `quiet`.
    pub(super) fn stalled(&self, quiet: Duration) -> bool {
        lock(&self.last_end).elapsed() >= quiet && self.waiting().is_some_and(|n| n > 0)
    }
}

/// The opcodes the observer reports (see `rebound_observe::Observer::attach`): those that
/// change what the tracker holds, INIT, and the locks taken again after a restart.
pub fn observed_opcodes() -> u64 {
    fuse_wire::change::CHANGING
        .iter()
        .chain(&[Opcode::Init, Opcode::Setlk, Opcode::Setlkw])
        .fold(0, |mask, &op| mask | 1 << (op as u32))
}

/// Starts the thread that drains the observer into the tracker until the take-over.
pub(super) fn spawn_observation(shared: &Arc<Shared>) -> std::io::Result<()> {
    let shared = shared.clone();
    std::thread::Builder::new()
        .name("observer".into())
        .spawn(move || {
            let mut readers = ForgetReaders::default();
            loop {
                std::thread::sleep(DRAIN_EVERY);
                if !drain(&shared, &mut readers) {
                    return;
                }
            }
        })?;
    Ok(())
}

/// Feeds what the observer holds to the tracker now, rather than at the next batch (nothing
/// to do once the proxy has taken over, or if it never stood beside).
pub(super) fn drain_now(shared: &Shared) {
    drain(shared, &mut ForgetReaders::default());
}

/// Feeds what the observer holds to the tracker. Returns false once the proxy has taken over.
fn drain(shared: &Shared, readers: &mut ForgetReaders) -> bool {
    let Some(beside) = &shared.beside else {
        return false;
    };
    // Held while the events are fed: a take-over waits for the batch under way.
    let mut observer = lock(&beside.observer);
    let Some(observer) = observer.as_mut() else {
        return false;
    };
    // Counted as the proxy counts what it forwards: the status and the metrics show them.
    let ended = observer.ended();
    let before = shared.stats.requests.swap(ended, Ordering::Relaxed);
    if ended != before {
        *lock(&beside.last_end) = Instant::now();
        shared.stats.replies.store(ended, Ordering::Relaxed);
    }
    let mut counted = lock(&beside.counted);
    if counted.elapsed() >= COUNT_EVERY {
        *counted = Instant::now();
        shared.stats.by_opcode.observed(&observer.ended_by_opcode());
    }
    drop(counted);
    shared.journal_after(|| {
        observer.drain_with(|seen| match seen {
            Seen::Request {
                request,
                reply,
                cut,
            } => observed_request(shared, request, reply, cut),
            Seen::Forget {
                node,
                count,
                reader,
            } if readers.is_driver(reader) => {
                // The driver has it already; only the table's count drops.
                let _ = shared.objects().forget(node, count);
            }
            Seen::Forget { .. } => {}
        })
    });
    true
}

/// Which processes that read forgets are the driver's: forgets of every FUSE connection are
/// seen, and node ids of two connections may be equal.
#[derive(Default)]
struct ForgetReaders(HashMap<u32, bool>);

impl ForgetReaders {
    fn is_driver(&mut self, reader: u32) -> bool {
        *self.0.entry(reader).or_insert_with(|| is_ours(reader))
    }
}

/// Records a request the driver answered, as [`super::check_driver_message`] and
/// [`super::on_request`] record one that crosses the proxy.
fn observed_request(shared: &Shared, request: &[u8], reply: &mut [u8], cut: bool) {
    let Ok(info) = RequestInfo::of(request) else {
        tracing::warn!("observed an unparsable request; the tracker may be behind");
        return;
    };
    let Ok((header, _)) = OutHeader::read_from_prefix(reply) else {
        return;
    };
    if cut && matches!(info.change, PendingChange::ReaddirPlus { .. }) && header.error == 0 {
        tracing::warn!(
            "a READDIRPLUS reply was not seen whole: node ids it gave may not survive a \
             restart of the driver"
        );
    }
    if let Some((fh, dir, node)) = info.release {
        let _ = shared.objects().release(fh, dir, node);
    }
    if header.error != 0 {
        return;
    }
    if info.opcode == Some(Opcode::Init) {
        return observed_init(shared, request, reply);
    }
    let body = &mut reply[size::OUT_HEADER..];
    match info.opcode {
        Some(Opcode::Setlk | Opcode::Setlkw) => {
            // Taken again if the driver is restarted (`fh` leads fuse_lk_in).
            if let Some(fh) = read_u64(request, size::IN_HEADER) {
                shared.objects().locked(fh, request.to_vec().into());
            }
        }
        Some(Opcode::Getattr) if read_u64(request, NODEID_AT) == Some(ROOT_ID) => {
            cache_root_attr(shared, body);
        }
        _ => {}
    }
    commit_change(shared, info.header.unique, &info.change, body);
}

/// The first driver's INIT: kept to give to its successors (without what rebound never
/// offers, since they serve behind the proxy), and its version.
fn observed_init(shared: &Shared, request: &[u8], reply: &mut [u8]) {
    let mut kept = request.to_vec();
    fuse_wire::mask_init_request(&mut kept);
    *lock(&shared.init) = Some(kept.clone());
    // (Read through the check a guarded INIT reply passes; the copy it changes is rebound's.)
    match fuse_wire::fix_init_reply(reply, u32::MAX) {
        Ok(init) => {
            shared.minor.store(init.minor, Ordering::Relaxed);
            if let Some(journal) = shared.journal.get() {
                journal.note_init(init.minor, &kept);
            }
            shared.buffers.fit(init.max_write);
            tracing::info!(
                "driver speaks FUSE 7.{} on the kernel's queue (fast mode), max_write {} bytes",
                init.minor,
                init.max_write
            );
        }
        Err(e) => tracing::warn!("observed an INIT reply rebound cannot read: {e}"),
    }
    shared.report(ProxyEvent::Initialized);
}

/// A successor after rebound died in fast mode: what the dead run's observer saw and had not
/// drained (it stayed attached, pinned in `dir`: see `keeper`) goes to the tracker its journal
/// rebuilt. Its driver is dead by now, so nothing more is to come. (Forgets are left: whose
/// they were can no longer be told, and a count too high only keeps a node longer.)
pub(super) fn replay_pinned(shared: &Shared, dir: &std::path::Path) {
    match rebound_observe::drain_pinned(dir) {
        Ok(events) => {
            let mut requests = 0;
            shared.journal_after(|| {
                for event in events {
                    if let Event::Request {
                        request,
                        mut reply,
                        cut,
                    } = event
                    {
                        observed_request(shared, &request, &mut reply, cut);
                        requests += 1;
                    }
                }
            });
            tracing::info!(
                "{requests} requests the dead rebound's observer saw last are in the tracker"
            );
        }
        Err(e) => tracing::warn!(
            "what the dead rebound's observer saw last is lost ({e}): nodes and handles the \
             kernel got from it fail with EIO"
        ),
    }
}

/// The driver is gone (every process that held its device): the proxy takes the kernel's
/// queue over. Returns false if it already had (or never stood beside).
pub(super) fn take_over(shared: &Arc<Shared>) -> std::io::Result<bool> {
    let Some(beside) = &shared.beside else {
        return Ok(false);
    };
    {
        // The last batch: every request the kernel ended is in the ring by now.
        drain_now(shared);
        let Some(observer) = lock(&beside.observer).take() else {
            return Ok(false);
        };
        // The proxy counts on from the observer's last counts.
        shared.stats.by_opcode.observed(&observer.ended_by_opcode());
    }
    {
        let mut link = shared.link.write().unwrap_or_else(|e| e.into_inner());
        if matches!(*link, Link::Beside) {
            *link = Link::Recovering { attached: None };
        }
    }
    // From now on the proxy rewrites what the kernel is given.
    shared.objects().set_kernel_holds_driver_handles(false);
    // Back in the queue, with FUSE_UNIQUE_RESEND set in their unique: the requests the dead
    // driver had read and not answered.
    match super::resend_requests(shared) {
        Ok(parked) => tracing::debug!("{parked} requests the driver had read were sent again"),
        Err(e) => tracing::error!(
            "FUSE_NOTIFY_RESEND failed ({e}): requests the driver had read stay unanswered"
        ),
    }
    // Released only now: a release before the resend would end those requests with an error.
    lock(&beside.devices).clear();
    shared.stats.beside.store(false, Ordering::Relaxed);
    super::spawn_queue_readers(shared)?;
    Ok(true)
}

/// While beside: whether the driver hangs, as [`super::Proxy::check_liveness`] says: a request
/// has waited `request_timeout` (its age from the observer), requests wait and none has ended
/// for `request_timeout`, or a liveness probe (sent once requests have waited
/// [`super::probe_after`] with none ending) is unanswered after `probe_timeout`.
pub(super) fn hang(
    beside: &Beside,
    request_timeout: Duration,
    probe_timeout: Duration,
) -> Option<String> {
    let mut probe = lock(&beside.probe);
    if probe
        .as_ref()
        .is_some_and(|p| p.answered.load(Ordering::Relaxed))
    {
        *probe = None;
    }
    if let Some(out) = probe.as_ref() {
        let waited = out.sent.elapsed();
        if waited >= probe_timeout {
            return Some(format!(
                "hang: liveness probe unanswered for {} ms",
                waited.as_millis()
            ));
        }
    }
    // One request held while others are answered: its age, which the observer knows.
    let oldest = lock(&beside.observer)
        .as_mut()
        .and_then(Observer::oldest_waiting);
    if let Some(waited) = oldest.filter(|waited| *waited >= request_timeout) {
        return Some(format!(
            "hang: a request unanswered for {} ms",
            waited.as_millis()
        ));
    }
    let quiet = lock(&beside.last_end).elapsed();
    if quiet < super::probe_after(probe_timeout) {
        return None;
    }
    let waiting = beside.waiting().filter(|&n| n > 0)?;
    if quiet >= request_timeout {
        return Some(format!(
            "hang: {waiting} requests waiting and none answered for {} ms",
            quiet.as_millis()
        ));
    }
    if probe.is_none() {
        *probe = Probe::send(&beside.mountpoint);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_observer_reports_what_changes_the_tracker_and_not_the_data_path() {
        let mask = observed_opcodes();
        let has = |op: Opcode| mask & 1 << (op as u32) != 0;
        for op in [
            Opcode::Lookup,
            Opcode::Create,
            Opcode::Readdirplus,
            Opcode::Init,
        ] {
            assert!(has(op), "{op:?}");
        }
        for op in [Opcode::Read, Opcode::Write, Opcode::Getattr, Opcode::Statfs] {
            assert!(!has(op), "{op:?}");
        }
    }
}
