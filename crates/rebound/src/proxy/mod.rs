//! The isolation layer's data path: rebound's end of `/dev/fuse` on one side, the driver's
//! message channel on the other, and every message checked and translated as it crosses.
//!
//! Owns: the proxy's shared state ([`Shared`]: the [`InflightTable`], the [`ObjectTable`], the
//! link to the driver) and its life cycle: started guarded or beside the path ([`beside`]),
//! serving, recovering (requests are parked and a few are answered by rebound itself, as
//! Nooks' shadow driver does), or failed (requests get `EIO`). The forwarding threads are in
//! [`requests`] (kernel to driver: the INIT rewrite, id translation) and [`replies`] (driver
//! to kernel: reply validation, the tracker's changes); what a driver's failure does to the
//! link is in [`failover`], and [`recovery`] brings a new driver up to the old one's state.
//! Must not: know about processes or mounts (the supervisor's), or allocate per request on the
//! forwarding path: each thread reuses its buffers.
//!
//! The channel is an `AF_UNIX` `SOCK_SEQPACKET` socket pair: like `/dev/fuse` it keeps message
//! boundaries, so an unmodified driver reads exactly one request per `read(2)` and writes one
//! reply per `write(2)`.

mod beside;
mod checkpoints;
mod failover;
mod handover;
mod journal;
mod notifications;
mod private;
mod recovery;
mod replies;
mod requests;

use std::collections::HashSet;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

use fuse_wire::abi::{self, size, ROOT_ID};
use fuse_wire::ids::{read_u64, write_u64};
use fuse_wire::{DriverMessage, InHeader, Opcode, OutHeader, ReplyShape, Request};
use rebound_sys::resident::ResidentBuffer;
use rustix::io::Errno;
use rustix::net::{RecvFlags, SendFlags};
use tracker::{
    DriverForget, Inflight, InflightTable, ObjectTable, Patches, PendingChange, RequestBytes,
    RequestStore, ToDriver,
};
use zerocopy::FromBytes;

use crate::checkpoint::ImageCheckpoint;
pub use beside::observed_opcodes;
pub use handover::HandOver;
use notifications::NotificationQueue;
use private::PrivateCalls;
pub use recovery::Restored;
pub use replies::SECOND_OPINION;
use replies::{
    answer_in_drivers_place, answer_ok, answer_with, cache_root_attr, commit_change,
    deliver_driver_message, first_reply_served, mark_recovery_phase, spawn_driver_reader,
    success_reply, write_to_kernel, LogBudget,
};
use requests::{
    is_ours, kernel_queues, shadow_answer, spawn_queue_readers, BufferPool, RequestInfo,
};

/// Largest WRITE payload rebound lets a driver negotiate (the kernel's own ceiling with the
/// default `max_pages_limit` of 256 pages).
pub const MAX_WRITE: u32 = 1 << 20;
/// Room beyond a request's or reply's data for its headers and arguments.
const HEADROOM: usize = 64 * 1024;
/// Room for a request or reply of `MAX_WRITE` bytes of data plus headers and arguments.
const BUFFER_SIZE: usize = MAX_WRITE as usize + HEADROOM;
/// Socket buffers must hold at least one message of `BUFFER_SIZE`; a few keep the driver's
/// threads busy.
const SOCKET_BUFFER: usize = 4 * BUFFER_SIZE;
/// Requests up to this size are copied out of the read buffer to wait for their reply; larger
/// ones (WRITE) keep the buffer, which is replaced from the pool.
const SMALL_REQUEST: usize = 16 * 1024;

/// Offset of `nodeid` in `fuse_in_header`.
const NODEID_AT: usize = std::mem::offset_of!(InHeader, nodeid);

/// What the proxy tells the supervisor; one byte each on the event socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ProxyEvent {
    /// `/dev/fuse` answered `ENODEV`: the file system was unmounted or the connection aborted.
    KernelGone = 1,
    /// The current driver's end of the channel is closed: every process holding it is gone.
    DriverGone = 2,
    /// The current driver sent a message that failed the checks ([`Proxy::misbehaviour`]).
    DriverMisbehaved = 3,
    /// A new driver holds everything the old one did and serves ([`Proxy::take_restored`]).
    Recovered = 4,
    /// Bringing a new driver up failed ([`Proxy::take_restored`] says why).
    RecoveryFailed = 5,
    /// A recovery's latency was measured ([`Proxy::take_recovery_latencies`]).
    RecoveryMeasured = 6,
    /// A driver answered INIT: the process that serves is known now, even when the one that
    /// mounted (a daemonizing driver's parent) has not been reaped yet.
    Initialized = 7,
}

impl ProxyEvent {
    pub fn from_byte(byte: u8) -> Option<Self> {
        Some(match byte {
            1 => ProxyEvent::KernelGone,
            2 => ProxyEvent::DriverGone,
            3 => ProxyEvent::DriverMisbehaved,
            4 => ProxyEvent::Recovered,
            5 => ProxyEvent::RecoveryFailed,
            6 => ProxyEvent::RecoveryMeasured,
            7 => ProxyEvent::Initialized,
            _ => return None,
        })
    }
}

/// Counters the forwarding threads keep; read by the supervisor for logs and status.
#[derive(Debug, Default)]
pub struct ProxyStats {
    /// The driver serves the kernel's queue itself (fast mode, until its first failure).
    pub beside: AtomicBool,
    pub requests: AtomicU64,
    pub replies: AtomicU64,
    pub notifications: AtomicU64,
    /// Driver messages refused by validation.
    pub refused: AtomicU64,
    /// Requests sent again to a new driver, or settled by looking at its state.
    pub resent: AtomicU64,
    /// Requests answered by rebound while no driver could (shadow answers).
    pub shadowed: AtomicU64,
    /// Requests that failed with `EIO` because their object did not survive a restart.
    pub lost_uses: AtomicU64,
    /// Nodes looked up again in a restarted driver.
    pub restored_nodes: AtomicU64,
    /// Nodes and handles a restarted driver did not have (each fails with `EIO`).
    pub lost_objects: AtomicU64,
    /// Fault injection (`rebound inject --fault corrupt`): how many of the driver's next
    /// replies to corrupt before they are checked, and the seed that says how.
    pub corrupt_next: AtomicU64,
    pub corrupt_seed: AtomicU64,
    /// Error replies held back and asked of a restarted driver (a second opinion).
    pub doubted: AtomicU64,
    /// Of those, the ones a restarted driver answered with an error too.
    pub doubts_confirmed: AtomicU64,
    /// Changes in the redo log: acknowledged by the driver, not yet covered by a checkpoint.
    pub redo_entries: AtomicU64,
    /// The most the redo log has held.
    pub redo_entries_max: AtomicU64,
    /// Logged changes the standby on the image's spare has not been given yet.
    pub standby_lacks: AtomicU64,
    /// Checkpoints made, and the longest (with an image checkpoint, requests wait that long).
    pub checkpoints: AtomicU64,
    pub checkpoint_us_max: AtomicU64,
    /// Requests and reply latencies by opcode, for the metrics.
    pub by_opcode: crate::metrics::RequestMetrics,
}

/// The channel pair a driver gets in place of `/dev/fuse`: rebound's end and the driver's.
pub struct Channel {
    pub ours: OwnedFd,
    pub theirs: OwnedFd,
}

impl Channel {
    pub fn new() -> io::Result<Channel> {
        use rustix::net::{socketpair, sockopt, AddressFamily, SocketFlags, SocketType};
        let (ours, theirs) = socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )?;
        for fd in [&ours, &theirs] {
            // A datagram larger than the send buffer is refused (EMSGSIZE), so the buffers
            // must exceed the largest message. The _FORCE variants need CAP_NET_ADMIN and
            // ignore `net.core.wmem_max`.
            sockopt::set_socket_send_buffer_size_force(fd, SOCKET_BUFFER)
                .or_else(|_| sockopt::set_socket_send_buffer_size(fd, SOCKET_BUFFER))?;
            sockopt::set_socket_recv_buffer_size_force(fd, SOCKET_BUFFER)
                .or_else(|_| sockopt::set_socket_recv_buffer_size(fd, SOCKET_BUFFER))?;
        }
        Ok(Channel { ours, theirs })
    }
}

/// The state of the driver side.
enum Link {
    /// The first driver serves the kernel's queue itself (fast mode, see [`beside`]): nothing
    /// crosses the proxy until it takes over.
    Beside,
    /// Requests go to `driver`, the `generation`-th driver since the mount.
    Serving {
        driver: Arc<OwnedFd>,
        generation: u64,
    },
    /// The driver failed: requests are parked until a new one is restored. Once a new driver
    /// is attached, its replies (to rebound's own requests, then to resent ones) flow.
    Recovering {
        attached: Option<(Arc<OwnedFd>, u64)>,
    },
    /// No driver will come back for now: requests fail with `EIO`.
    Failed,
}

impl Link {
    /// The driver whose messages are accepted now.
    fn current(&self) -> Option<(&Arc<OwnedFd>, u64)> {
        match self {
            Link::Serving { driver, generation } => Some((driver, *generation)),
            Link::Recovering {
                attached: Some((driver, generation)),
            } => Some((driver, *generation)),
            _ => None,
        }
    }
}

/// Timing of the recovery under way, from detection to the first request served, and of its
/// phases.
#[derive(Default)]
struct RecoveryClock {
    detected: Option<Instant>,
    awaiting_first_reply: bool,
    /// The phases passed so far, each with the moment it ended, in order.
    marks: Vec<(&'static str, Instant)>,
    finished: Vec<RecoveryTiming>,
}

/// One recovery's latency, from detecting the failure to the first request the new driver
/// served, and how long each phase took, in order: `reap` (the failed driver's processes
/// gone), `backoff`, `pre_restart`, `spawn` (until the new driver's `mount(2)`; near nothing
/// for a standby), `init` (INIT replayed), `replay` (the redo log), `restore` (handles
/// reopened, requests left in flight settled), `first_request`. A phase a recovery did not go
/// through is absent.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RecoveryTiming {
    pub total_ms: f64,
    pub phases: Vec<(&'static str, f64)>,
}

/// How a proxy protects the driver's work beyond restarting it.
#[derive(Clone, Debug, Default)]
pub struct ProxyOptions {
    /// Keep a redo log and checkpoint the driver this often (see [`tracker::redo`]).
    pub checkpoint_interval: Option<Duration>,
    /// How long a checkpoint may wait for the driver.
    pub checkpoint_timeout: Duration,
    /// Checkpoint as soon as the redo log holds this many changes (0: by interval only).
    pub checkpoint_changes: usize,
    /// Clone the driver's image at each checkpoint (see [`crate::checkpoint`]).
    pub image: Option<Arc<ImageCheckpoint>>,
    /// Ask a restarted driver again when an error reply suggests the driver is failing (see
    /// [`fuse_wire::suspect`]), except for this long after a restarted driver confirmed one.
    /// `None`: forward every well-formed error.
    pub second_opinion_cooldown: Option<Duration>,
}

/// When an error reply goes to a restarted driver for a second opinion.
struct SecondOpinions {
    /// After a restarted driver gave the same answer, none is doubted for this long: the
    /// errors are real (a failing disk or network), and restarts would not help.
    cooldown: Duration,
    /// When a restarted driver last confirmed a doubted error.
    confirmed: Mutex<Option<Instant>>,
    /// Whether the restart budget leaves room for one (see [`Proxy::allow_second_opinions`]).
    affordable: AtomicBool,
}

/// A running proxy between one kernel connection and a driver.
pub struct Proxy {
    pub stats: Arc<ProxyStats>,
    shared: Arc<Shared>,
    /// Reused by [`Proxy::deliver_spliced`], so a splice allocates nothing.
    splice_buffer: Mutex<Vec<u8>>,
}

struct Shared {
    /// rebound's `/dev/fuse` descriptors: the one it mounted with and its clones, each read by
    /// its own thread. A reply must go back on the descriptor that read its request.
    queues: Vec<OwnedFd>,
    link: RwLock<Link>,
    generations: AtomicU64,
    inflight: InflightTable,
    objects: Mutex<ObjectTable>,
    /// Negotiated protocol minor version; 0 until INIT completes.
    minor: AtomicU32,
    stats: Arc<ProxyStats>,
    events: UnixStream,
    /// The driver's notifications, on their way to the kernel (see [`notifications`]).
    notifications: NotificationQueue,
    refusal_log: LogBudget,
    /// Lines for requests rebound fails with `EIO` itself (see `answer_in_drivers_place`).
    eio_log: LogBudget,
    buffers: BufferPool,
    /// The kernel's INIT request as the first driver got it, replayed to every new one.
    init: Mutex<Option<Vec<u8>>>,
    /// The serving driver's reply to its replayed INIT, once a restore made it serve: the
    /// answer to a kernel INIT it is handed later (see `recovery::hand_on_strays`).
    restored_init_reply: Mutex<Option<Vec<u8>>>,
    calls: PrivateCalls,
    /// The body of the latest GETATTR reply for the root, answered in the driver's place
    /// while it restarts (its own mount(2) stats the mount point).
    root_attr: Mutex<Option<Vec<u8>>>,
    clock: Mutex<RecoveryClock>,
    /// Why a driver was last refused, for the failure report, with its generation.
    misbehaviour: Mutex<Option<(u64, String)>>,
    /// The generation whose misbehaviour was reported, plus one (0: none).
    misbehaviour_reported: AtomicU64,
    /// The outcome of the latest restore, with its driver's generation.
    restored: Mutex<Option<(u64, Result<Restored, String>)>>,
    /// How long a lookup of a pending node may wait for a restarted driver.
    lookup_timeout_ms: AtomicU64,
    /// The changes acknowledged since the last checkpoint, if kept.
    redo: Option<Mutex<tracker::RedoLog>>,
    /// A driver has made a change to its files (the store is writable): an EROFS is suspect.
    store_changed: AtomicBool,
    checkpoint_due: checkpoints::CheckpointDue,
    /// The channel of a standby on a spare of the image, given the changes acknowledged
    /// since its spare's checkpoint as they come (see `checkpoints::follow`).
    spare_standby: Mutex<Option<recovery::Follower>>,
    /// Set while a failure waits for `spare_standby`: the batch under way ends after the
    /// change it is replaying.
    spare_wanted: AtomicBool,
    /// Directory handles (the kernel's) reopened in a restarted driver and not yet listed from
    /// their start (see `recovery::prime_reopened_directory`).
    unprimed_dirs: Mutex<HashSet<u64>>,
    /// The image checkpoint, if the driver's image is cloned at each checkpoint.
    image: Option<checkpoints::ImageGate>,
    /// Directories where names were lately removed (most recent last): a driver killed there
    /// may have left hidden files behind (see `recovery::leftovers`).
    removal_dirs: Mutex<Vec<u64>>,
    second_opinions: Option<SecondOpinions>,
    /// In fast mode, what rebound keeps beside the driver's path (see [`beside`]).
    beside: Option<beside::Beside>,
    /// Where the tracker's changes outlive rebound, once asked (see [`journal`]).
    journal: OnceLock<journal::Journal>,
}

/// The object table, locked. What it noted is written to the journal (if kept) before the
/// lock is let go: before the reply that made the change can reach the kernel. (A batch
/// observed beside the path is written at its end: see [`Shared::journal_after`].)
struct ObjectsGuard<'a> {
    table: MutexGuard<'a, ObjectTable>,
    shared: &'a Shared,
}

impl std::ops::Deref for ObjectsGuard<'_> {
    type Target = ObjectTable;
    fn deref(&self) -> &ObjectTable {
        &self.table
    }
}

impl std::ops::DerefMut for ObjectsGuard<'_> {
    fn deref_mut(&mut self) -> &mut ObjectTable {
        &mut self.table
    }
}

impl Drop for ObjectsGuard<'_> {
    fn drop(&mut self) {
        if JOURNAL_BATCHED.get() {
            return;
        }
        if let Some(journal) = self.shared.journal.get() {
            journal.flush(&mut self.table, self.shared);
        }
    }
}

thread_local! {
    /// Set while this thread feeds the tracker a batch it observed (see
    /// [`Shared::journal_after`]): its guards leave the journal to the batch's end.
    static JOURNAL_BATCHED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Clears [`JOURNAL_BATCHED`] when the batch ends, by return or by panic.
struct JournalBatch;

impl Drop for JournalBatch {
    fn drop(&mut self) {
        JOURNAL_BATCHED.set(false);
    }
}

/// How many directories [`Shared::removal_dirs`] keeps.
const REMOVAL_DIRS_KEPT: usize = 16;

const REFUSALS_LOGGED_PER_SECOND: u32 = 10;
/// A request whose reply drivers refuse this many times is failed with `EIO` on its own
/// (the driver is not restarted again for it).
const POISON_REFUSALS: u8 = 2;
/// A request in flight at this many driver failures in a row is failed with `EIO` on its own.
pub(crate) const POISON_FAILURES: u8 = 3;

/// How long requests wait (with none answered) before a liveness probe is sent: guarded, a
/// request of rebound's own to the driver; beside the path, a `statfs(2)` of the mount.
fn probe_after(probe_timeout: Duration) -> Duration {
    Duration::from_secs(1).min(probe_timeout / 2)
}

impl Shared {
    /// Runs `feed`, which updates the tracker with what was observed beside the path, and
    /// writes the journal once at its end rather than at each update. Beside the path the
    /// kernel had each reply before rebound saw it, so an earlier write gains nothing, and one
    /// `write(2)` per observed request was a quarter of the observer's CPU during an untar.
    fn journal_after(&self, feed: impl FnOnce()) {
        {
            let _batch = JournalBatch;
            JOURNAL_BATCHED.set(true);
            feed();
        }
        drop(self.objects());
    }

    fn objects(&self) -> ObjectsGuard<'_> {
        // Every update is applied whole under the lock, so a poisoned table is still usable.
        ObjectsGuard {
            table: self.objects.lock().unwrap_or_else(|e| e.into_inner()),
            shared: self,
        }
    }

    fn link(&self) -> RwLockReadGuard<'_, Link> {
        self.link.read().unwrap_or_else(|e| e.into_inner())
    }

    fn report(&self, event: ProxyEvent) {
        use std::io::Write;
        // The supervisor polls the other end; if it is gone, so is everything else.
        let _ = (&self.events).write_all(&[event as u8]);
    }

    fn minor(&self) -> u32 {
        self.minor.load(Ordering::Relaxed)
    }
}

impl Proxy {
    /// Starts forwarding between `kernel` (rebound's `/dev/fuse`) and `driver` (rebound's end
    /// of the first driver's channel), with one kernel queue per CPU (up to four). Events are
    /// written to `events` as single bytes.
    pub fn start(
        kernel: OwnedFd,
        driver: OwnedFd,
        events: UnixStream,
        options: ProxyOptions,
    ) -> io::Result<Proxy> {
        let queues = kernel_queues(kernel);
        let driver = Arc::new(driver);
        let link = Link::Serving {
            driver: driver.clone(),
            generation: 0,
        };
        let proxy = Proxy::launch(queues, events, &options, link, |_| {})?;
        spawn_driver_reader(&proxy.shared, driver, 0)?;
        Ok(proxy)
    }

    /// Starts beside the first driver, which serves the kernel's queue through `device` (its
    /// clone of `kernel`; rebound's reference keeps the requests it reads alive), with
    /// `observer` feeding the tracker until [`Proxy::take_over`] (fast mode, see [`beside`]).
    pub fn start_beside(
        kernel: OwnedFd,
        device: OwnedFd,
        observer: rebound_observe::Observer,
        events: UnixStream,
        options: ProxyOptions,
    ) -> io::Result<Proxy> {
        let beside = beside::Beside::new(observer, device);
        let proxy = Proxy::launch(
            kernel_queues(kernel),
            events,
            &options,
            Link::Beside,
            |shared| {
                shared.beside = Some(beside);
            },
        )?;
        proxy.shared.objects().set_kernel_holds_driver_handles(true);
        beside::spawn_observation(&proxy.shared)?;
        proxy.stats.beside.store(true, Ordering::Relaxed);
        Ok(proxy)
    }

    /// Whether the kernel has ended the connection (an unmount, or an abort): seen by a poll,
    /// for fast mode, where no thread reads the queue to be told so.
    pub fn kernel_gone(&self) -> bool {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        let mut fds = [PollFd::new(&self.shared.queues[0], PollFlags::IN)];
        let now = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        matches!(poll(&mut fds, Some(&now)), Ok(n) if n > 0)
            && fds[0].revents().contains(PollFlags::ERR)
    }

    /// Fast mode: attaches `file`, the driver's new `/dev/fuse` (its `FUSE_DEV_IOC_CLONE`), to
    /// the connection, and keeps a reference to it (see [`beside`]).
    pub fn clone_for_driver(&self, file: OwnedFd) -> io::Result<()> {
        let beside = self
            .shared
            .beside
            .as_ref()
            .ok_or_else(|| io::Error::other("not in fast mode"))?;
        rebound_sys::fuse_dev::attach_to_connection(file.as_fd(), self.shared.queues[0].as_fd())?;
        beside.keep_device(file);
        Ok(())
    }

    /// Whether the driver serves the kernel's queue itself (fast mode, before any failure).
    pub fn is_beside(&self) -> bool {
        self.shared
            .beside
            .as_ref()
            .is_some_and(beside::Beside::active)
    }

    /// Fast mode, while the driver serves the kernel's queue: whether requests wait and none
    /// has ended for `quiet` (false once the proxy has taken over).
    pub fn beside_stalled(&self, quiet: Duration) -> bool {
        self.shared
            .beside
            .as_ref()
            .is_some_and(|b| b.active() && b.stalled(quiet))
    }

    /// Fast mode, once the failed driver's processes are all gone: the proxy takes the
    /// kernel's queue over, with the requests the driver had read back in it. Nothing to do
    /// (false) if it already serves the queue.
    pub fn take_over(&self) -> io::Result<bool> {
        beside::take_over(&self.shared)
    }

    /// From now on the tracker's changes are journaled in `dir`, where a successor finds
    /// them should rebound die (see [`journal`]).
    pub fn keep_journal(&self, dir: &std::path::Path) -> io::Result<()> {
        let shared = &self.shared;
        let mut table = shared.objects.lock().unwrap_or_else(|e| e.into_inner());
        let journal = journal::Journal::create(dir, &mut table, shared)?;
        shared
            .journal
            .set(journal)
            .map_err(|_| io::Error::other("a journal is kept already"))
    }

    /// The run ends with the mount: its journal goes.
    pub fn remove_journal(&self) {
        if let Some(journal) = self.shared.journal.get() {
            journal.remove();
        }
    }

    /// Whether the kernel's INIT has been answered (by this proxy or, for a successor, its
    /// predecessor's).
    pub fn initialized(&self) -> bool {
        // Beside the path, an INIT answered may still wait in the observer's ring.
        beside::drain_now(&self.shared);
        self.shared.minor() > 0
    }

    /// rebound's kernel queues, to be kept by a process that outlives it.
    pub fn kernel_queues_fds(&self) -> Vec<BorrowedFd<'_>> {
        self.shared.queues.iter().map(|q| q.as_fd()).collect()
    }

    /// Builds the shared state over `queues` with the driver side in `link`, `restore`
    /// filling in what a predecessor handed over, and starts a thread per kernel queue and
    /// the checkpointer.
    fn launch(
        queues: Vec<OwnedFd>,
        events: UnixStream,
        options: &ProxyOptions,
        link: Link,
        restore: impl FnOnce(&mut Shared),
    ) -> io::Result<Proxy> {
        let gone = events.try_clone()?;
        // (Close-on-exec like the queue: a driver started later must not inherit it.)
        let queue = rustix::io::fcntl_dupfd_cloexec(&queues[0], 0)?;
        let notifications = NotificationQueue::start(queue, move || {
            use std::io::Write;
            let _ = (&gone).write_all(&[ProxyEvent::KernelGone as u8]);
        })?;
        let stats = Arc::new(ProxyStats::default());
        let mut shared = Shared {
            queues,
            link: RwLock::new(link),
            generations: AtomicU64::new(0),
            inflight: InflightTable::new(),
            objects: Mutex::new(ObjectTable::new()),
            minor: AtomicU32::new(0),
            stats: stats.clone(),
            events,
            notifications,
            refusal_log: LogBudget::new(REFUSALS_LOGGED_PER_SECOND),
            eio_log: LogBudget::new(REFUSALS_LOGGED_PER_SECOND),
            buffers: BufferPool::default(),
            init: Mutex::new(None),
            restored_init_reply: Mutex::new(None),
            calls: PrivateCalls::default(),
            root_attr: Mutex::new(None),
            clock: Mutex::new(RecoveryClock::default()),
            misbehaviour: Mutex::new(None),
            misbehaviour_reported: AtomicU64::new(0),
            restored: Mutex::new(None),
            lookup_timeout_ms: AtomicU64::new(60_000),
            redo: options
                .checkpoint_interval
                .map(|_| Mutex::new(tracker::RedoLog::default())),
            store_changed: AtomicBool::new(false),
            checkpoint_due: checkpoints::CheckpointDue::new(options.checkpoint_changes),
            spare_standby: Mutex::new(None),
            spare_wanted: AtomicBool::new(false),
            unprimed_dirs: Mutex::new(HashSet::new()),
            image: options.image.clone().map(checkpoints::ImageGate::new),
            removal_dirs: Mutex::new(Vec::new()),
            beside: None,
            journal: OnceLock::new(),
            second_opinions: options
                .second_opinion_cooldown
                .map(|cooldown| SecondOpinions {
                    cooldown,
                    confirmed: Mutex::new(None),
                    affordable: AtomicBool::new(true),
                }),
        };
        restore(&mut shared);
        let shared = Arc::new(shared);
        // (A successor's readers start once it has parked what the kernel resends.)
        if matches!(*shared.link(), Link::Serving { .. }) {
            spawn_queue_readers(&shared)?;
        }
        if let Some(interval) = options.checkpoint_interval {
            let checkpointed = shared.clone();
            let timeout = options.checkpoint_timeout;
            std::thread::Builder::new()
                .name("checkpoint".into())
                .spawn(move || checkpoints::run(&checkpointed, interval, timeout))?;
            if shared.image.is_some() {
                let followed = shared.clone();
                std::thread::Builder::new()
                    .name("spare-follower".into())
                    .spawn(move || checkpoints::follow(&followed, timeout))?;
            }
        }
        Ok(Proxy {
            stats,
            shared,
            splice_buffer: Mutex::new(vec![0u8; BUFFER_SIZE]),
        })
    }

    /// How many nodes and open handles the kernel holds through the driver.
    pub fn held_objects(&self) -> (usize, usize) {
        held_objects(&self.shared)
    }

    /// Since when the longest-waiting request sent to the driver waits; `None` if none does.
    pub fn waiting_since(&self) -> Option<Instant> {
        oldest_waiting(&self.shared)
    }

    /// A reader of [`Proxy::held_objects`] that other threads can keep.
    pub fn held_objects_reader(&self) -> impl Fn() -> (usize, usize) + Send + 'static {
        let shared = self.shared.clone();
        move || held_objects(&shared)
    }

    /// Performs a driver's `splice(pipe -> channel, len)`: reads what the pipe holds (up to
    /// `len` bytes) as one message and delivers it with the same checks as a `write(2)`.
    /// A socket would cut a spliced message into datagrams of 16 pipe buffers each, which
    /// other threads' replies could interleave; doing the splice here keeps it whole.
    /// Returns the number of bytes taken from the pipe.
    pub fn deliver_spliced(&self, pipe: BorrowedFd<'_>, len: usize) -> io::Result<usize> {
        let mut buf = self.splice_buffer.lock().unwrap_or_else(|e| e.into_inner());
        let want = len.min(buf.len());
        let mut got = 0;
        // One message may sit in several pipe buffers; read until `len` or the pipe is empty.
        while got < want {
            let ready = rustix::event::poll(
                &mut [rustix::event::PollFd::new(
                    &pipe,
                    rustix::event::PollFlags::IN,
                )],
                Some(&rustix::event::Timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                }),
            )?;
            if ready == 0 {
                break;
            }
            match rustix::io::read(pipe, &mut buf[got..want]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        if got == 0 {
            return Err(Errno::AGAIN.into());
        }
        // Only the current driver splices into the channel rebound knows it by.
        let generation = self.shared.link().current().map_or(0, |(_, g)| g);
        deliver_driver_message(&self.shared, &mut buf[..got], generation);
        Ok(got)
    }
}

/// Since when the driver has left the oldest request unanswered: the kernel's, or one of
/// rebound's own that a kernel request waits for (a lookup of a node a restarted driver has
/// not been asked for yet).
fn oldest_waiting(shared: &Shared) -> Option<Instant> {
    let own = shared.calls.oldest_waiting();
    match (shared.inflight.oldest_sent(), own) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn held_objects(shared: &Shared) -> (usize, usize) {
    let objects = shared.objects();
    (objects.node_count(), objects.handle_count())
}

/// `FUSE_NOTIFY_RESEND` (a bare header, `unique` 0, the code in `error`): the kernel puts the
/// requests being processed on any descriptor of the connection back at the head of its
/// queue, with [`abi::UNIQUE_RESEND`] set. They are read and parked here, before any queue
/// reader runs (the link must be `Recovering`), so that each is settled as in flight at the
/// failure: a reader thread could read one only after a quick successor (a standby) is
/// attached, which would be given it as new, and a rename the failed driver did half of would
/// then be done "again" as nothing. Returns how many requests it parked.
fn resend_requests(shared: &Shared) -> io::Result<usize> {
    use rustix::fs::{fcntl_getfl, fcntl_setfl, OFlags};
    let mut resend = [0u8; size::OUT_HEADER];
    resend[..4].copy_from_slice(&(size::OUT_HEADER as u32).to_ne_bytes());
    resend[4..8].copy_from_slice(&(fuse_wire::NotifyCode::Resend as i32).to_ne_bytes());
    let queue = &shared.queues[0];
    rustix::io::write(queue, &resend)?;
    // Non-blocking for this drain only: no reader shares the descriptor yet.
    let flags = fcntl_getfl(queue)?;
    fcntl_setfl(queue, flags | OFlags::NONBLOCK)?;
    let mut buf = shared.buffers.take();
    let mut parked = 0;
    let drained = loop {
        let len = match rustix::io::read(queue, &mut buf[..]) {
            Ok(len) => len,
            Err(Errno::INTR | Errno::NOENT) => continue,
            Err(Errno::INVAL) if shared.buffers.grow(&mut buf) => continue,
            Err(Errno::AGAIN) => break Ok(()),
            Err(e) => break Err(e),
        };
        let header = InHeader::read_from_prefix(&buf[..len]).ok().map(|(h, _)| h);
        let resent = header.is_some_and(|h| h.unique & abi::UNIQUE_RESEND != 0);
        let opcode = header.and_then(|h| Opcode::from_raw(h.opcode));
        requests::on_request(shared, 0, &mut buf, len);
        // Resent ones come first (interrupts and forgets may come among them): the first
        // new request ends the drain, the readers take the rest.
        if resent {
            parked += 1;
        } else if !matches!(
            opcode,
            Some(Opcode::Interrupt | Opcode::Forget | Opcode::BatchForget)
        ) {
            break Ok(());
        }
    };
    shared.buffers.give(buf);
    fcntl_setfl(queue, flags)?;
    drained?;
    Ok(parked)
}

/// Locks `mutex`, whether or not a thread panicked holding it (what it guards stays usable:
/// every update to it is one assignment or one call).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}
