//! The isolation layer's data path: rebound's end of `/dev/fuse` on one side, the driver's
//! message channel on the other, and every message checked and translated as it crosses.
//!
//! Owns: the forwarding threads (one per kernel queue, one per driver), the INIT rewrite,
//! reply validation against the [`InflightTable`], translating ids through the
//! [`ObjectTable`], and the link to the driver: serving, recovering (requests are parked and
//! a few are answered by rebound itself, as Nooks' shadow driver does), or failed (requests
//! get `EIO`). [`recovery`] brings a new driver up to the old one's state.
//! Must not: know about processes or mounts (the supervisor's), or allocate per request on the
//! forwarding path: each thread reuses its buffers.
//!
//! The channel is an `AF_UNIX` `SOCK_SEQPACKET` socket pair: like `/dev/fuse` it keeps message
//! boundaries, so an unmodified driver reads exactly one request per `read(2)` and writes one
//! reply per `write(2)`.

mod beside;
mod checkpoints;
mod handover;
mod journal;
mod notifications;
mod private;
mod recovery;

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
use rustix::io::Errno;
use rustix::net::{RecvFlags, SendFlags};
use tracker::{
    DriverForget, Inflight, InflightTable, ObjectTable, Patches, PendingChange, RequestBytes,
    ToDriver,
};
use zerocopy::FromBytes;

use crate::checkpoint::ImageCheckpoint;
pub use beside::observed_opcodes;
pub use handover::HandOver;
use notifications::NotificationQueue;
use private::PrivateCalls;
pub use recovery::Restored;

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
    buffers: BufferPool,
    /// The kernel's INIT request as the first driver got it, replayed to every new one.
    init: Mutex<Option<Vec<u8>>>,
    calls: PrivateCalls,
    /// The body of the latest GETATTR reply for the root, answered in the driver's place
    /// while it restarts (its own mount(2) stats the mount point).
    root_attr: Mutex<Option<Vec<u8>>>,
    clock: Mutex<RecoveryClock>,
    /// Why the driver was last refused, for the failure report.
    misbehaviour: Mutex<Option<String>>,
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
/// lock is let go: before the reply that made the change can reach the kernel.
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
        if let Some(journal) = self.shared.journal.get() {
            journal.flush(&mut self.table, self.shared);
        }
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

/// A per-second budget of log lines, shared between threads without a lock.
struct LogBudget {
    start: Instant,
    /// Second (since `start`) of the current window in the high half, lines used in the low.
    window: AtomicU64,
    per_second: u32,
}

impl LogBudget {
    fn new(per_second: u32) -> Self {
        LogBudget {
            start: Instant::now(),
            window: AtomicU64::new(0),
            per_second,
        }
    }

    fn allow(&self) -> bool {
        let now = self.start.elapsed().as_secs();
        let mut current = self.window.load(Ordering::Relaxed);
        loop {
            let (second, used) = (current >> 32, current & 0xffff_ffff);
            let next = if second == now {
                if used >= u64::from(self.per_second) {
                    return false;
                }
                current + 1
            } else {
                (now << 32) | 1
            };
            match self.window.compare_exchange_weak(
                current,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(actual) => current = actual,
            }
        }
    }
}

/// How long requests wait (with none answered) before a liveness probe is sent: guarded, a
/// request of rebound's own to the driver; beside the path, a `statfs(2)` of the mount.
fn probe_after(probe_timeout: Duration) -> Duration {
    Duration::from_secs(1).min(probe_timeout / 2)
}

/// Read buffers for the kernel's requests, recycled so that large requests waiting for their
/// reply do not cost an allocation each. `BUFFER_SIZE`, unless a first driver in fast mode
/// told the kernel a larger `max_write` (see [`BufferPool::fit`]).
struct BufferPool {
    free: Mutex<Vec<Vec<u8>>>,
    size: AtomicUsize,
}

impl Default for BufferPool {
    fn default() -> Self {
        BufferPool {
            free: Mutex::default(),
            size: AtomicUsize::new(BUFFER_SIZE),
        }
    }
}

impl BufferPool {
    const KEEP: usize = 16;

    fn take(&self) -> Vec<u8> {
        let size = self.size.load(Ordering::Relaxed);
        let free = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop();
        free.filter(|buf| buf.len() == size)
            .unwrap_or_else(|| vec![0; size])
    }

    fn give(&self, buf: Vec<u8>) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if buf.len() == self.size.load(Ordering::Relaxed) && free.len() < Self::KEEP {
            free.push(buf);
        }
    }

    /// Makes every buffer taken from now on fit the kernel's `max_write`: the kernel refuses
    /// (`EINVAL`) a read of `/dev/fuse` into less than a WRITE of `max_write` bytes with its
    /// headers, whatever it has to send. A guarded driver's INIT reply is capped to
    /// `MAX_WRITE`; a fast-mode driver's reaches the kernel as it is (fuser's examples say
    /// 16 MiB), and the proxy reads the queue after its failure.
    fn fit(&self, max_write: u32) {
        let needed = (max_write as usize).saturating_add(HEADROOM);
        self.size.fetch_max(needed, Ordering::Relaxed);
    }

    /// Keeps the request in `buf[..len]` for as long as it is in flight: a small one is
    /// copied, a large one takes the buffer (which is replaced).
    fn keep(&self, buf: &mut Vec<u8>, len: usize, patches: Patches) -> RequestBytes {
        let bytes = if len <= SMALL_REQUEST {
            buf[..len].to_vec()
        } else {
            std::mem::replace(buf, self.take())
        };
        RequestBytes {
            buf: Arc::new(bytes),
            len,
            patches,
        }
    }

    fn recycle(&self, request: RequestBytes) {
        if let Ok(buf) = Arc::try_unwrap(request.buf) {
            self.give(buf);
        }
    }
}

impl Shared {
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
            buffers: BufferPool::default(),
            init: Mutex::new(None),
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
        if !matches!(*shared.link(), Link::Beside) {
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

    /// Tells the current driver its connection is over: its reads on the channel return 0
    /// from now on, as reads of `/dev/fuse` fail once a mount is gone (in fast mode, the
    /// connection itself is ended). Drivers that wait for
    /// their reader threads before exiting (go-fuse) need this.
    pub fn disconnect_driver(&self) {
        if let Some(beside) = self.shared.beside.as_ref().filter(|b| b.active()) {
            beside.end_connection();
            return;
        }
        if let Some((driver, _)) = self.shared.link().current() {
            let _ = rustix::net::shutdown(&**driver, rustix::net::Shutdown::Both);
        }
    }

    /// Whether rebound ended the connection itself (fast mode, a driver that unmounted): the
    /// mount is dead, and still mounted until rebound unmounts it.
    pub fn connection_ended(&self) -> bool {
        self.shared.beside.as_ref().is_some_and(|b| b.ended())
    }

    /// The driver failed (`cause` says how): from now on requests wait for its successor, and
    /// the failed driver's messages are ignored. Returns false if recovery was already under
    /// way.
    pub fn driver_failed(&self) -> bool {
        let mut link = self.shared.link.write().unwrap_or_else(|e| e.into_inner());
        if let Some((driver, _)) = link.current() {
            // Unblocks a forwarding thread stuck sending to a driver that stopped reading.
            let _ = rustix::net::shutdown(&**driver, rustix::net::Shutdown::Both);
        }
        let was_serving = matches!(*link, Link::Serving { .. });
        *link = Link::Recovering { attached: None };
        drop(link);
        self.shared.calls.clear_probe();
        self.shared.calls.abort_all();
        let mut clock = self.shared.clock.lock().unwrap_or_else(|e| e.into_inner());
        if clock.detected.is_none() || was_serving {
            clock.detected = Some(Instant::now());
            clock.awaiting_first_reply = false;
            clock.marks.clear();
        }
        was_serving
    }

    /// Whether the current driver's channel is closed at its end (no current driver: true).
    /// A [`ProxyEvent::DriverGone`] reported for a driver that was current then may be read
    /// after a new one took over; this tells whether it concerns the driver there is now.
    pub fn driver_channel_closed(&self) -> bool {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        let link = self.shared.link();
        let Some((driver, _)) = link.current() else {
            return true;
        };
        let mut fds = [PollFd::new(&**driver, PollFlags::RDHUP)];
        let now = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        matches!(poll(&mut fds, Some(&now)), Ok(n) if n > 0)
            && fds[0]
                .revents()
                .intersects(PollFlags::HUP | PollFlags::RDHUP | PollFlags::ERR)
    }

    /// The recovery under way has passed `phase` (see [`RecoveryTiming`]).
    pub fn recovery_phase_done(&self, phase: &'static str) {
        mark_recovery_phase(&self.shared, phase);
    }

    /// Hands the proxy a new driver's channel: it is brought up to the old driver's state on a
    /// thread of its own, which reports [`ProxyEvent::Recovered`] or
    /// [`ProxyEvent::RecoveryFailed`]. `timeout` bounds each of rebound's requests to it.
    /// The kernel's INIT for a standby successor to answer before it is needed (see
    /// `supervisor::standby`), with a unique of rebound's own: `(unique, request)`. `None`
    /// until the kernel has sent one.
    pub fn init_for_standby(&self) -> Option<(u64, Vec<u8>)> {
        let mut request = self
            .shared
            .init
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()?;
        let unique = self.shared.calls.next_unique();
        write_u64(&mut request, std::mem::offset_of!(InHeader, unique), unique);
        Some((unique, request))
    }

    /// A standby's reply to the INIT of [`Proxy::init_for_standby`] (`unique`): its body, if
    /// it is valid and a success, or why not.
    pub fn check_standby_init(&self, unique: u64, reply: &[u8]) -> Result<Vec<u8>, String> {
        let parsed = DriverMessage::parse(reply)
            .and_then(|parsed| {
                parsed
                    .validate_reply(ReplyShape::Init, self.shared.minor())
                    .map(|_| parsed)
            })
            .map_err(|e| format!("its reply to INIT was refused: {e}"))?;
        if parsed.header.unique != unique {
            return Err(format!(
                "it answered {} to INIT {unique}",
                parsed.header.unique
            ));
        }
        if parsed.header.error != 0 {
            return Err(format!(
                "it refused INIT ({})",
                io::Error::from_raw_os_error(-parsed.header.error)
            ));
        }
        Ok(parsed.body.to_vec())
    }

    /// Restores a new driver through `channel`. `init_reply`: its answer to the kernel's INIT
    /// if it already gave one (a standby's), else the INIT is replayed first. `on_spare`: it
    /// runs on the image's spare, and lacks what the redo log keeps for it (see
    /// [`Proxy::make_spare`]), not what came since the last checkpoint.
    pub fn attach_driver(
        &self,
        channel: OwnedFd,
        timeout: Duration,
        init_reply: Option<Vec<u8>>,
        on_spare: bool,
    ) -> io::Result<()> {
        let shared = &self.shared;
        let generation = shared.generations.fetch_add(1, Ordering::Relaxed) + 1;
        shared
            .lookup_timeout_ms
            .store(timeout.as_millis() as u64, Ordering::Relaxed);
        mark_recovery_phase(shared, "spawn");
        let driver = Arc::new(channel);
        *shared.link.write().unwrap_or_else(|e| e.into_inner()) = Link::Recovering {
            attached: Some((driver.clone(), generation)),
        };
        spawn_driver_reader(shared, driver.clone(), generation)?;
        let shared = shared.clone();
        std::thread::Builder::new()
            .name("recovery".into())
            .spawn(move || {
                let outcome = recovery::restore(
                    &shared,
                    &driver,
                    generation,
                    timeout,
                    (init_reply, on_spare),
                );
                let event = if outcome.is_ok() {
                    ProxyEvent::Recovered
                } else {
                    ProxyEvent::RecoveryFailed
                };
                *lock(&shared.restored) = Some((generation, outcome));
                shared.report(event);
            })?;
        Ok(())
    }

    /// Fails the parked requests of the driver's own processes (a restarting driver that
    /// touched its mount point before serving it), so that they can die when killed: a
    /// process waiting on a FUSE request that was read cannot be killed until it is answered.
    pub fn fail_requests_of_driver(&self) {
        self.fail_picked(|request, pid| request.sent.is_none() && is_ours(pid));
    }

    /// Answers as the shadow does while no driver serves (see [`shadow_answer`]) the
    /// requests in flight that rebound's own processes made, failing with `EIO` those it
    /// cannot answer. Called as a standby successor takes over: its mount helper may have
    /// looked at the mount point while the failed driver served (and hung), and the request,
    /// kept for the next driver, would wait for the very process that cannot serve before its
    /// mount returns.
    pub fn shadow_requests_of_own_processes(&self) {
        let ours = |request: &Inflight| {
            InHeader::read_from_prefix(request.request.bytes())
                .is_ok_and(|(header, _)| is_ours(header.pid))
        };
        for (unique, request) in self.shared.inflight.take_if(ours) {
            let msg = request.request.bytes();
            let queue = request.queue.into();
            let answered = RequestInfo::of(msg)
                .is_ok_and(|info| shadow_answer(&self.shared, &info, queue, msg));
            if !answered {
                tracing::debug!("request {unique} of a standby's process failed with EIO");
                answer_in_drivers_place(&self.shared, unique, queue, Errno::IO);
            }
        }
    }

    /// Fails the requests made by `threads` (the driver's threads that are dying). A driver
    /// thread that waits on its own mount as the driver dies (go-fuse opens a file there as
    /// it starts, to probe poll support, and a dying process closing such a file sends a
    /// FLUSH) waits on, fatal signal or not, once the request has been read; no dying driver
    /// answers it, and unanswered the process never finishes dying.
    pub fn fail_requests_of(&self, threads: &HashSet<u32>) {
        self.fail_picked(|_, pid| threads.contains(&pid));
    }

    /// Fails with `EIO` the requests in flight that `pick` chooses, given each request and
    /// the pid of the thread that made it.
    fn fail_picked(&self, mut pick: impl FnMut(&Inflight, u32) -> bool) {
        let picked = |request: &Inflight| {
            InHeader::read_from_prefix(request.request.bytes())
                .is_ok_and(|(header, _)| pick(request, header.pid))
        };
        for (unique, request) in self.shared.inflight.take_if(picked) {
            tracing::debug!("request {unique} of a driver process failed with EIO");
            answer_in_drivers_place(&self.shared, unique, request.queue.into(), Errno::IO);
        }
    }

    /// What the latest recovery restored, or why it failed; `None` if that driver is no longer
    /// the one attached. A restore that ends after its driver was given up (the supervisor saw
    /// it fail another way and started the next) reports nothing: taken for the next driver's,
    /// its failure would end that one too (the demo, 2026-11-26: "removing hidden files:
    /// Broken pipe" of a dead standby ended the driver started after it).
    pub fn take_restored(&self) -> Option<Result<Restored, String>> {
        let (generation, outcome) = lock(&self.shared.restored).take()?;
        let current = self.shared.link().current().map(|(_, g)| g);
        if current != Some(generation) {
            tracing::debug!("restore of a driver no longer attached ended: {outcome:?}");
            return None;
        }
        Some(outcome)
    }

    /// No driver is coming back for now: every waiting request and every new one fails with
    /// `EIO`, and the mount stays.
    pub fn fail_requests(&self) {
        *self.shared.link.write().unwrap_or_else(|e| e.into_inner()) = Link::Failed;
        for (unique, request) in self.shared.inflight.take_all() {
            answer_in_drivers_place(&self.shared, unique, request.queue.into(), Errno::IO);
        }
    }

    /// Why the driver's last refused message was refused.
    pub fn misbehaviour(&self) -> Option<String> {
        self.shared
            .misbehaviour
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Whether the serving driver still answers: `Some(cause)` if a request waited longer than
    /// `request_timeout` or a liveness probe longer than `probe_timeout`. Sends a probe when
    /// a request has waited a second and none is out.
    pub fn check_liveness(
        &self,
        request_timeout: Duration,
        probe_timeout: Duration,
    ) -> Option<String> {
        let shared = &self.shared;
        let driver = match &*shared.link() {
            Link::Serving { driver, .. } => driver.clone(),
            Link::Beside => {
                return beside::hang(shared.beside.as_ref()?, request_timeout, probe_timeout)
            }
            _ => return None,
        };
        let now = Instant::now();
        if let Some(since) = shared.calls.probe_waiting_since() {
            let waited = now.duration_since(since);
            if waited >= probe_timeout {
                return Some(format!(
                    "hang: liveness probe unanswered for {} ms",
                    waited.as_millis()
                ));
            }
        }
        let oldest = oldest_waiting(shared)?;
        let waited = now.duration_since(oldest);
        if waited >= request_timeout {
            return Some(format!(
                "hang: a request unanswered for {} ms",
                waited.as_millis()
            ));
        }
        if waited >= probe_after(probe_timeout) {
            shared.calls.probe(&driver, |unique| {
                fuse_wire::ids::getattr_request(unique, ROOT_ID)
            });
        }
        None
    }

    /// Whether a suspect reply may cost a restart now: the supervisor says no when the restart
    /// budget has only one left (a suspect reply is then forwarded as it is).
    pub fn allow_second_opinions(&self, allowed: bool) {
        if let Some(policy) = &self.shared.second_opinions {
            policy.affordable.store(allowed, Ordering::Relaxed);
        }
    }

    /// Recoveries measured since the last call.
    pub fn take_recovery_timings(&self) -> Vec<RecoveryTiming> {
        std::mem::take(
            &mut self
                .shared
                .clock
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .finished,
        )
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
/// requests being processed on any descriptor of the connection back in its queue, with
/// [`abi::UNIQUE_RESEND`] set.
fn resend_requests(shared: &Shared) -> io::Result<()> {
    let mut resend = [0u8; size::OUT_HEADER];
    resend[..4].copy_from_slice(&(size::OUT_HEADER as u32).to_ne_bytes());
    resend[4..8].copy_from_slice(&(fuse_wire::NotifyCode::Resend as i32).to_ne_bytes());
    rustix::io::write(&shared.queues[0], &resend)?;
    Ok(())
}

/// `kernel` and its clones: one kernel queue per CPU (up to four), each read by a thread of
/// its own once the proxy serves.
fn kernel_queues(kernel: OwnedFd) -> Vec<OwnedFd> {
    let wanted = std::thread::available_parallelism().map_or(1, |n| n.get().min(4));
    let mut queues = vec![kernel];
    while queues.len() < wanted {
        match rebound_sys::fuse_dev::clone_connection(queues[0].as_fd()) {
            Ok(clone) => queues.push(clone),
            Err(e) => {
                tracing::debug!("staying with {} kernel queue(s): {e}", queues.len());
                break;
            }
        }
    }
    queues
}

/// Starts a thread per kernel queue, which runs for as long as rebound does: each ends when
/// the kernel side closes.
fn spawn_queue_readers(shared: &Arc<Shared>) -> io::Result<()> {
    for queue in 0..shared.queues.len() {
        let down = shared.clone();
        std::thread::Builder::new()
            .name(format!("kernel-queue-{queue}"))
            .spawn(move || kernel_to_driver(&down, queue))?;
    }
    Ok(())
}

fn spawn_driver_reader(
    shared: &Arc<Shared>,
    driver: Arc<OwnedFd>,
    generation: u64,
) -> io::Result<()> {
    let up = shared.clone();
    std::thread::Builder::new()
        .name(format!("driver-{generation}"))
        .spawn(move || driver_to_kernel(&up, &driver, generation))?;
    Ok(())
}

fn kernel_to_driver(shared: &Shared, queue: usize) {
    let kernel = &shared.queues[queue];
    let mut buf = shared.buffers.take();
    loop {
        let len = match rustix::io::read(kernel, &mut buf[..]) {
            Ok(len) => len,
            // ENOENT: the request was interrupted before it could be read.
            Err(Errno::INTR | Errno::NOENT | Errno::AGAIN) => continue,
            Err(Errno::NODEV) => return shared.report(ProxyEvent::KernelGone),
            Err(e) => {
                tracing::error!("reading /dev/fuse: {e}");
                return shared.report(ProxyEvent::KernelGone);
            }
        };
        on_request(shared, queue, &mut buf, len);
    }
}

/// What the kernel-side threads need of a request once its bytes are handed on.
struct RequestInfo {
    header: InHeader,
    opcode: Option<Opcode>,
    shape: ReplyShape,
    change: PendingChange,
    fields: fuse_wire::ids::IdFields,
    /// RELEASE/RELEASEDIR: the handle and whether it is a directory's.
    release: Option<(u64, bool)>,
}

impl RequestInfo {
    fn of(msg: &[u8]) -> Result<RequestInfo, fuse_wire::WireError> {
        let req = Request::parse(msg)?;
        let change = req.change();
        let release = match change {
            fuse_wire::Change::Release { fh, dir, .. } => Some((fh, dir)),
            _ => None,
        };
        Ok(RequestInfo {
            header: req.header,
            opcode: req.opcode,
            shape: req.reply_shape(),
            change: PendingChange::of(change),
            fields: req.id_fields(),
            release,
        })
    }
}

/// Handles one request read from the kernel into `buf[..len]`. A large request that must wait
/// for its reply takes `buf` with it (a fresh one takes its place).
fn on_request(shared: &Shared, queue: usize, buf: &mut Vec<u8>, len: usize) {
    let msg = &mut buf[..len];
    let info = match RequestInfo::of(msg) {
        Ok(info) => info,
        Err(e) => {
            tracing::error!("unparsable request from the kernel: {e}");
            return;
        }
    };
    let unique = info.header.unique;
    // Held until the request is with the driver or parked (see `checkpoints`).
    let _gate = shared.image.as_ref().map(checkpoints::ImageGate::pass);
    match info.opcode {
        Some(Opcode::Forget | Opcode::BatchForget) => return forward_forgets(shared, msg),
        // Only the driver that has the interrupted request can act on it.
        Some(Opcode::Interrupt) => {
            if let Link::Serving { driver, .. } = &*shared.link() {
                let _ = rustix::net::send(&**driver, msg, SendFlags::NOSIGNAL);
            }
            return;
        }
        Some(Opcode::Init) => {
            fuse_wire::mask_init_request(msg);
            *shared.init.lock().unwrap_or_else(|e| e.into_inner()) = Some(msg.to_vec());
        }
        _ => {}
    }
    if let Some((fh, true)) = info.release {
        recovery::forget_unprimed(shared, fh);
    }
    if matches!(info.opcode, Some(Opcode::Readdir | Opcode::Readdirplus)) {
        recovery::prime_reopened_directory(shared, msg, &info.fields, &info.change);
    }
    // RELEASE lets go of the handle at once, whatever the driver answers.
    let released = info
        .release
        .map(|(fh, dir)| shared.objects().release(fh, dir));
    if released == Some(ToDriver::Lost) {
        // The handle died with an earlier driver; there is nothing left to close.
        return answer_ok(shared, unique, queue);
    }

    // Decided again after each node a restarted driver had to be asked for first: the link
    // may have changed meanwhile.
    let mut lookups = 0;
    let (link, driver, generation, mut patches) = loop {
        let link = shared.link();
        let (driver, generation) = match &*link {
            Link::Failed => {
                drop(link);
                return answer_in_drivers_place(shared, unique, queue, Errno::IO);
            }
            // (Beside: no thread reads the kernel's queue; a request read is parked.)
            Link::Recovering { .. } | Link::Beside => {
                drop(link);
                if released.is_some() {
                    // The old driver's handle went with it.
                    return answer_ok(shared, unique, queue);
                }
                if shadow_answer(shared, &info, queue, msg) {
                    return;
                }
                // Parked: sent to the new driver once it holds what the kernel holds. One the
                // kernel sends again (FUSE_NOTIFY_RESEND) was read by the failed driver: it is
                // settled as one in flight at the failure.
                let request = shared.buffers.keep(buf, len, Patches::default());
                let sent = (unique & abi::UNIQUE_RESEND != 0).then(|| (0, Instant::now()));
                shared
                    .inflight
                    .insert(unique, inflight_entry(&info, queue, request, sent));
                return;
            }
            Link::Serving { driver, generation } => (driver.clone(), *generation),
        };
        let translated = shared.objects().to_driver(msg, info.fields, &info.change);
        match translated {
            Ok(patches) => break (link, driver, generation, patches),
            Err(tracker::Untranslated::Pending(node)) if lookups <= tracker::MAX_PENDING => {
                // A node the restarted driver has not been asked for yet: look it up by path,
                // without holding the link (the lookup waits for the driver). A node it does
                // not have is marked lost; a driver that fails meanwhile leaves the request to
                // park on the next turn.
                drop(link);
                lookups += 1;
                let timeout =
                    Duration::from_millis(shared.lookup_timeout_ms.load(Ordering::Relaxed));
                let _ = recovery::resolve(shared, &driver, generation, node, timeout);
            }
            Err(tracker::Untranslated::Pending(_)) => {
                drop(link);
                if released.is_some() {
                    return answer_ok(shared, unique, queue);
                }
                let request = shared.buffers.keep(buf, len, Patches::default());
                shared
                    .inflight
                    .insert(unique, inflight_entry(&info, queue, request, None));
                return;
            }
            Err(tracker::Untranslated::Lost) => {
                drop(link);
                shared.stats.lost_uses.fetch_add(1, Ordering::Relaxed);
                return answer_in_drivers_place(shared, unique, queue, Errno::IO);
            }
        }
    };
    if let Some(ToDriver::Mapped(driver_fh)) = released {
        // `fh` is the first field of fuse_release_in.
        if let Some(fh) = read_u64(msg, size::IN_HEADER) {
            if fh != driver_fh && write_u64(msg, size::IN_HEADER, driver_fh) {
                patches.push(size::IN_HEADER, fh);
            }
        }
    }
    shared.stats.requests.fetch_add(1, Ordering::Relaxed);
    shared.stats.by_opcode.request(info.header.opcode);
    if info.shape == ReplyShape::NoReply {
        drop(link);
        let _ = rustix::net::send(&*driver, msg, SendFlags::NOSIGNAL);
        return;
    }
    let request = shared.buffers.keep(buf, len, patches);
    let bytes = request.buf.clone();
    // In the table before the driver can answer; under the link lock, so that a recovery
    // starting now sees it and sends it again.
    shared.inflight.insert(
        unique,
        inflight_entry(&info, queue, request, Some((generation, Instant::now()))),
    );
    drop(link);
    match rustix::net::send(&*driver, &bytes[..len], SendFlags::NOSIGNAL) {
        Ok(_) => {}
        // The driver is gone: the request stays in flight for its successor.
        Err(Errno::PIPE | Errno::CONNRESET) => {}
        Err(e) => {
            tracing::error!("sending request {unique} to the driver: {e}");
            if shared.inflight.take(unique).is_some() {
                answer_in_drivers_place(shared, unique, queue, Errno::IO);
            }
        }
    }
}

fn inflight_entry(
    info: &RequestInfo,
    queue: usize,
    request: RequestBytes,
    sent: Option<(u64, Instant)>,
) -> Inflight {
    Inflight {
        opcode: info.header.opcode,
        shape: info.shape,
        change: info.change.clone(),
        queue: queue as u8,
        request,
        sent,
        failures: 0,
        doubted: false,
    }
}

/// The handle rebound gives a restarting driver that opens the mount's root directory.
const SHADOW_DIR_FH: u64 = u64::MAX;

/// While no driver serves, answers the requests a restarting driver makes itself before it
/// can serve: its `mount(2)` (or fusermount's) stats the mount point, checks access to it,
/// and libfuse 2 lists it to refuse a non-empty mount point. These are requests to this very
/// mount, from the driver that is to serve it. GETATTR of the root gets the latest attributes
/// a driver gave (whoever asks); the driver's own processes are granted ACCESS and see the
/// root as an empty directory.
fn shadow_answer(shared: &Shared, info: &RequestInfo, queue: usize, msg: &[u8]) -> bool {
    let unique = info.header.unique;
    let on_root = info.header.nodeid == ROOT_ID;
    let answered = match info.opcode {
        Some(Opcode::Getattr) if on_root => {
            let cached = shared
                .root_attr
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            // With nothing cached (the driver failed before it ever described the root),
            // only the restarting driver gets a plain directory; others wait for it.
            match cached.or_else(|| is_ours(info.header.pid).then(plain_root_attr)) {
                Some(attr) => {
                    answer_with(shared, unique, queue, &attr);
                    true
                }
                None => false,
            }
        }
        Some(Opcode::Access) if is_ours(info.header.pid) => {
            answer_ok(shared, unique, queue);
            true
        }
        Some(Opcode::Opendir) if on_root && is_ours(info.header.pid) => {
            let mut open_out = [0u8; size::OPEN_OUT];
            write_u64(&mut open_out, 0, SHADOW_DIR_FH);
            answer_with(shared, unique, queue, &open_out);
            true
        }
        Some(Opcode::Readdir | Opcode::Readdirplus)
            if on_root && read_u64(msg, size::IN_HEADER) == Some(SHADOW_DIR_FH) =>
        {
            answer_ok(shared, unique, queue);
            true
        }
        _ => false,
    };
    if answered {
        shared.stats.shadowed.fetch_add(1, Ordering::Relaxed);
    }
    answered
}

/// `fuse_attr_out` of a root directory about which nothing else is known, valid for no time.
fn plain_root_attr() -> Vec<u8> {
    use zerocopy::IntoBytes;
    let attr = abi::AttrOut {
        attr: abi::Attr {
            ino: ROOT_ID,
            mode: 0o040755,
            nlink: 2,
            blksize: 4096,
            ..Default::default()
        },
        ..Default::default()
    };
    attr.as_bytes().to_vec()
}

/// Whether `pid` is rebound or one of its descendants (a driver process, or its fusermount).
fn is_ours(pid: u32) -> bool {
    let me = std::process::id();
    let mut at = pid;
    for _ in 0..64 {
        if at == me {
            return true;
        }
        if at <= 1 {
            return false;
        }
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{at}/stat")) else {
            return false;
        };
        // The command may contain anything; the fields after its closing parenthesis do not.
        let parent = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse().ok());
        match parent {
            Some(parent) => at = parent,
            None => return false,
        }
    }
    false
}

/// FORGET and BATCH_FORGET: the kernel's counts drop at once; the driver hears what it must
/// (see [`ObjectTable::forget`]), in its own ids, or nothing at all.
///
/// Only to a driver whose ids the table holds ([`ObjectTable::forget_sent_to`]): a failed
/// driver's id sent to its successor is unknown to it (libfuse's high-level API aborts on an
/// unknown node; passthrough_ll would use a freed inode).
fn forward_forgets(shared: &Shared, msg: &mut [u8]) {
    let link = shared.link();
    let (driver, generation) = link
        .current()
        .map_or((None, 0), |(driver, g)| (Some(driver.clone()), g));
    drop(link);
    let len = {
        let mut objects = shared.objects();
        match InHeader::read_from_prefix(msg) {
            Ok((header, _)) if header.opcode == Opcode::Forget as u32 => {
                let count = read_u64(msg, size::IN_HEADER).unwrap_or(0);
                match objects.forget_sent_to(header.nodeid, count, generation) {
                    DriverForget::Send { node, count } => {
                        write_u64(msg, NODEID_AT, node);
                        write_u64(msg, size::IN_HEADER, count);
                        msg.len()
                    }
                    DriverForget::Nothing => 0,
                }
            }
            Ok(_) => {
                let entries: Vec<_> = fuse_wire::ids::batch_forget_entries(msg).collect();
                let first = size::IN_HEADER + 8;
                let mut end = first;
                for entry in entries {
                    if let DriverForget::Send { node, count } =
                        objects.forget_sent_to(entry.node, entry.nlookup, generation)
                    {
                        write_u64(msg, end, node);
                        write_u64(msg, end + 8, count);
                        end += 16;
                    }
                }
                let kept = ((end - first) / 16) as u32;
                msg[size::IN_HEADER..size::IN_HEADER + 4].copy_from_slice(&kept.to_ne_bytes());
                msg[..4].copy_from_slice(&(end as u32).to_ne_bytes());
                if kept == 0 {
                    0
                } else {
                    end
                }
            }
            Err(_) => 0,
        }
    };
    if let (Some(driver), true) = (driver, len > 0) {
        tracing::trace!(
            "kernel's forget to the driver: node {:?} count {:?}",
            read_u64(msg, NODEID_AT),
            read_u64(msg, size::IN_HEADER)
        );
        let _ = rustix::net::send(&*driver, &msg[..len], SendFlags::NOSIGNAL);
    }
}

fn driver_to_kernel(shared: &Shared, driver: &OwnedFd, generation: u64) {
    let mut buf = vec![0u8; BUFFER_SIZE];
    loop {
        // TRUNC makes recv return the real length of an oversized message, so it is refused
        // instead of being forwarded cut short.
        let len = match rustix::net::recv(driver, &mut buf[..], RecvFlags::TRUNC) {
            // ECONNRESET: the driver closed its end with requests still unread.
            Ok((0, _)) | Err(Errno::CONNRESET) => break,
            Ok((len, _)) => len,
            Err(Errno::INTR | Errno::AGAIN) => continue,
            Err(e) => {
                tracing::error!("reading from the driver: {e}");
                break;
            }
        };
        if len > buf.len() {
            refuse(
                shared,
                generation,
                None,
                &format!("message of {len} bytes exceeds the channel"),
            );
            continue;
        }
        deliver_driver_message(shared, &mut buf[..len], generation);
    }
    if shared
        .link()
        .current()
        .is_some_and(|(_, g)| g == generation)
    {
        shared.report(ProxyEvent::DriverGone);
    }
}

/// Checks one whole message of driver `generation` and, if it passes, forwards it to the
/// kernel in the kernel's ids.
fn deliver_driver_message(shared: &Shared, msg: &mut [u8], generation: u64) {
    let Ok((header, _)) = OutHeader::read_from_prefix(msg) else {
        return refuse(shared, generation, None, "message shorter than its header");
    };
    if private::is_private(header.unique) {
        let probe = shared.calls.deliver(header.unique, msg);
        if probe && header.error == 0 && msg.len() == size::OUT_HEADER + size::ATTR_OUT {
            cache_root_attr(shared, &msg[size::OUT_HEADER..]);
        }
        return;
    }
    let msg = corrupt_in_transit(&shared.stats, msg);
    // Held while the message is checked, committed and written, so that a recovery cannot
    // start in between: a failed driver's last words never reach the kernel.
    let link = shared.link();
    if link.current().is_none_or(|(_, g)| g != generation) {
        return;
    }
    let Some(reply_to) = check_driver_message(shared, msg, generation) else {
        return;
    };
    if reply_to.is_init {
        match fuse_wire::fix_init_reply(msg, MAX_WRITE) {
            Ok(init) => {
                shared.minor.store(init.minor, Ordering::Relaxed);
                let request = shared
                    .init
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                if let (Some(journal), Some(request)) = (shared.journal.get(), request) {
                    journal.note_init(init.minor, &request);
                }
                tracing::info!(
                    "driver speaks FUSE 7.{}, max_write {} bytes",
                    init.minor,
                    init.max_write
                );
                shared.report(ProxyEvent::Initialized);
            }
            Err(e) => {
                drop(link);
                return refuse(
                    shared,
                    generation,
                    reply_to.request.map(|r| (reply_to.unique, r)),
                    &format!("INIT reply: {e}"),
                );
            }
        }
    }
    if reply_to.notification {
        // Checked and translated while this driver is current; written by a thread that
        // holds no lock, since the kernel may hold it back (see [`notifications`]).
        drop(link);
        return shared.notifications.push(msg);
    }
    write_to_kernel(shared, reply_to.queue, msg);
    if reply_to.is_init {
        // The root's attributes, for the shadow answers of a later recovery.
        if let Some((driver, _)) = link.current() {
            shared.calls.probe(driver, |unique| {
                fuse_wire::ids::getattr_request(unique, ROOT_ID)
            });
        }
    }
    drop(link);
    if let Some(request) = reply_to.request {
        first_reply_served(shared);
        shared.buffers.recycle(request.request);
    }
}

/// Fault injection: while [`ProxyStats::corrupt_next`] is armed, damages the driver message as
/// a faulty channel would (one random bit of its header flipped, and one time in four its
/// body cut short), for the checks that follow to catch. Returns the message to go on with.
fn corrupt_in_transit<'m>(stats: &ProxyStats, msg: &'m mut [u8]) -> &'m mut [u8] {
    let armed = stats
        .corrupt_next
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    if armed.is_err() {
        return msg;
    }
    // The injector's generator, stepped once per corrupted message, so one seed gives one
    // sequence.
    let state = stats.corrupt_seed.fetch_add(1, Ordering::Relaxed);
    let z = rebound_inject::rng::Rng::new(state).next_u64();
    let bit = (z % (size::OUT_HEADER as u64 * 8)) as usize;
    msg[bit / 8] ^= 1 << (bit % 8);
    let len = msg.len();
    let cut = if (z >> 32).is_multiple_of(4) && len > size::OUT_HEADER {
        size::OUT_HEADER + ((z >> 40) as usize % (len - size::OUT_HEADER))
    } else {
        len
    };
    tracing::warn!(
        "fault injection: corrupted a driver message (header bit {bit}, {len} -> {cut} bytes)"
    );
    &mut msg[..cut]
}

fn cache_root_attr(shared: &Shared, attr: &[u8]) {
    {
        let mut cached = shared.root_attr.lock().unwrap_or_else(|e| e.into_inner());
        if cached.as_deref() == Some(attr) {
            return;
        }
        *cached = Some(attr.to_vec());
    }
    // (Not under the cache's lock: starting a journal file anew takes it.)
    if let Some(journal) = shared.journal.get() {
        journal.note_root_attr(attr);
    }
}

/// Records the end of a phase of the recovery under way (none: nothing recorded).
fn mark_recovery_phase(shared: &Shared, phase: &'static str) {
    let mut clock = shared.clock.lock().unwrap_or_else(|e| e.into_inner());
    if clock.detected.is_some() {
        clock.marks.push((phase, Instant::now()));
    }
}

/// Ends the latency measurement of a recovery at the first request the new driver serves.
fn first_reply_served(shared: &Shared) {
    let mut clock = shared.clock.lock().unwrap_or_else(|e| e.into_inner());
    if clock.awaiting_first_reply {
        clock.awaiting_first_reply = false;
        if let Some(detected) = clock.detected.take() {
            let now = Instant::now();
            let ms = |from: Instant, to: Instant| to.duration_since(from).as_secs_f64() * 1e3;
            let mut phases = Vec::new();
            let mut since = detected;
            for (phase, at) in std::mem::take(&mut clock.marks) {
                phases.push((phase, ms(since, at)));
                since = at;
            }
            phases.push(("first_request", ms(since, now)));
            clock.finished.push(RecoveryTiming {
                total_ms: ms(detected, now),
                phases,
            });
            drop(clock);
            shared.report(ProxyEvent::RecoveryMeasured);
        }
    }
}

/// What a driver message that passed the checks answers.
struct ReplyTo {
    unique: u64,
    /// A successful reply to INIT, which rebound rewrites before forwarding.
    is_init: bool,
    /// The kernel queue that read the request (0 for notifications).
    queue: usize,
    /// The request it answers (none for notifications and INTERRUPT replies).
    request: Option<Inflight>,
    /// A notification, which goes to the kernel through [`NotificationQueue`].
    notification: bool,
}

/// Applies the wrapper checks to one driver message and translates its ids to the kernel's.
/// Returns where it goes if it may be forwarded.
fn check_driver_message(shared: &Shared, msg: &mut [u8], generation: u64) -> Option<ReplyTo> {
    let (unique, error, notification) = match DriverMessage::parse(msg) {
        Ok(parsed) if parsed.is_notification() => {
            let checked = parsed.validate_notification();
            (parsed.header.unique, parsed.header.error, Some(checked))
        }
        Ok(parsed) => (parsed.header.unique, parsed.header.error, None),
        Err(e) => {
            refuse(shared, generation, None, &format!("malformed message: {e}"));
            return None;
        }
    };
    if let Some(checked) = notification {
        return match checked {
            Ok(code) => {
                if !notification_to_kernel(shared, code, msg) {
                    // About nodes the kernel does not hold: nothing to tell it.
                    return None;
                }
                shared.stats.notifications.fetch_add(1, Ordering::Relaxed);
                Some(ReplyTo {
                    unique,
                    is_init: false,
                    queue: 0,
                    request: None,
                    notification: true,
                })
            }
            Err(e) => {
                refuse(shared, generation, None, &format!("notification: {e}"));
                None
            }
        };
    }
    if unique & abi::INT_REQ_BIT != 0 {
        let checked = DriverMessage::parse(msg)
            .and_then(|parsed| parsed.validate_reply(ReplyShape::ErrorOnly, 0));
        return match checked {
            // The interrupted request, if still in flight, says which queue read it.
            Ok(()) => Some(ReplyTo {
                unique,
                is_init: false,
                queue: shared
                    .inflight
                    .queue_of(unique & !abi::INT_REQ_BIT)
                    .map_or(0, usize::from),
                request: None,
                notification: false,
            }),
            Err(e) => {
                refuse(
                    shared,
                    generation,
                    None,
                    &format!("reply to INTERRUPT {unique:#x}: {e}"),
                );
                None
            }
        };
    }
    let Some(request) = shared.inflight.take(unique) else {
        refuse(
            shared,
            generation,
            None,
            &format!("reply to request {unique}, which is not in flight"),
        );
        return None;
    };
    let checked = DriverMessage::parse(msg)
        .and_then(|parsed| parsed.validate_reply(request.shape, shared.minor()));
    if let Err(e) = checked {
        let op = Opcode::from_raw(request.opcode)
            .map_or_else(|| request.opcode.to_string(), |op| format!("{op:?}"));
        refuse(
            shared,
            generation,
            Some((unique, request)),
            &format!("reply to {op} request {unique}: {e}"),
        );
        return None;
    }
    shared.stats.replies.fetch_add(1, Ordering::Relaxed);
    if let Some((_, sent)) = request.sent {
        shared.stats.by_opcode.reply(request.opcode, sent);
    }
    let body = &mut msg[size::OUT_HEADER..];
    let request = match suspicion(shared, unique, &request, error, body) {
        Some(why) => doubt(shared, generation, unique, request, &why)?,
        None => request,
    };
    if error == 0 {
        // Committed before the kernel sees the reply, so that a FORGET the reply makes
        // possible can never arrive first; the ids in the reply become the kernel's.
        if shared.redo.is_some() {
            // Before the commit, while names still lead where the request found them.
            record_mutation(shared, &request, body);
        }
        commit_change(shared, &request.change, body);
        if matches!(
            Opcode::from_raw(request.opcode),
            Some(Opcode::Setlk | Opcode::Setlkw)
        ) {
            // Taken again if the driver is restarted (`fh` leads fuse_lk_in).
            let bytes = kernel_bytes(&request);
            if let Some(fh) = read_u64(&bytes, size::IN_HEADER) {
                shared.objects().locked(fh, bytes.into());
            }
        }
        if request.opcode == Opcode::Getattr as u32
            && read_u64(request.request.bytes(), NODEID_AT) == Some(ROOT_ID)
        {
            cache_root_attr(shared, body);
        }
    }
    Some(ReplyTo {
        unique,
        is_init: request.opcode == Opcode::Init as u32 && error == 0,
        queue: usize::from(request.queue),
        request: Some(request),
        notification: false,
    })
}

/// A copy of a request in flight in the kernel's ids.
fn kernel_bytes(request: &Inflight) -> Vec<u8> {
    let mut bytes = request.request.bytes().to_vec();
    request.request.patches.undo(&mut bytes);
    bytes
}

/// Records in the tracker a change the driver made, with its reply's `body` (whose ids become
/// the kernel's).
fn commit_change(shared: &Shared, change: &PendingChange, body: &mut [u8]) {
    if let PendingChange::Remove { parent, .. }
    | PendingChange::Rename {
        new_parent: parent, ..
    } = change
    {
        note_removal_dir(shared, *parent);
    }
    if *change != PendingChange::None {
        shared.objects().on_success(change.clone(), body);
    }
}

/// A name was removed (or replaced) in the kernel's directory `dir`.
fn note_removal_dir(shared: &Shared, dir: u64) {
    let mut dirs = shared
        .removal_dirs
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if dirs.last() != Some(&dir) {
        dirs.retain(|&d| d != dir);
        dirs.push(dir);
        if dirs.len() > REMOVAL_DIRS_KEPT {
            dirs.remove(0);
        }
    }
}

/// Adds a change the driver acknowledged (with `reply`) to the redo log, with the paths of the
/// nodes it names and the inode number of the file it is about.
fn record_mutation(shared: &Shared, request: &Inflight, reply: &[u8]) {
    let (Some(redo), Some(op)) = (&shared.redo, Opcode::from_raw(request.opcode)) else {
        return;
    };
    if !tracker::redo::is_mutation(op) {
        return;
    }
    let bytes = kernel_bytes(request);
    let Ok(req) = Request::parse(&bytes) else {
        return;
    };
    let nodes: Vec<u64> = req
        .id_fields()
        .into_iter()
        .filter_map(|field| match field {
            fuse_wire::IdField::Node { at } => read_u64(&bytes, at),
            fuse_wire::IdField::Handle { .. } => None,
        })
        .collect();
    let (paths, ino) = {
        let objects = shared.objects();
        let paths = nodes
            .iter()
            .map(|&node| {
                objects
                    .path(node)
                    .map(|path| path.into_iter().map(Box::from).collect())
            })
            .collect();
        let ino = match &request.change {
            PendingChange::Entry { .. } | PendingChange::Create { .. } => {
                tracker::objects::entry_ino(reply, 0)
            }
            PendingChange::Remove { parent, name } | PendingChange::Rename { parent, name, .. } => {
                objects.ino_named(*parent, name)
            }
            _ => objects.node(req.header.nodeid).map_or(0, |node| node.ino),
        };
        (paths, ino)
    };
    let mut redo = redo.lock().unwrap_or_else(|e| e.into_inner());
    if op == Opcode::Write {
        redo.note_written(req.header.nodeid);
    }
    let mutation = tracker::Mutation {
        request: bytes.into(),
        paths,
        ino,
    };
    // (Under the log's lock: the journal has its entries in the log's order.)
    if let Some(journal) = shared.journal.get() {
        journal.note_mutation(&mutation);
    }
    redo.record(mutation);
    shared
        .stats
        .redo_entries
        .store(redo.len() as u64, Ordering::Relaxed);
    shared
        .stats
        .redo_entries_max
        .fetch_max(redo.len() as u64, Ordering::Relaxed);
    shared.checkpoint_due.logged(redo.len());
}

/// Rewrites the node ids of a checked notification to the kernel's. Returns false if it names
/// a node the kernel does not hold.
fn notification_to_kernel(shared: &Shared, code: fuse_wire::NotifyCode, msg: &mut [u8]) -> bool {
    let objects = shared.objects();
    let mut known = true;
    let mut fields = Vec::new();
    fuse_wire::ids::for_each_notification_id(code, msg, |field| fields.push(field.at()));
    for at in fields {
        match read_u64(msg, at).and_then(|driver| objects.node_from_driver(driver)) {
            Some(node) => {
                write_u64(msg, at, node);
            }
            None => known = false,
        }
    }
    known
}

/// Logs a refused driver message and reports the driver as failed: a driver that sends
/// garbage is not trusted with the next request. A request it answered badly is parked for
/// the driver that replaces it. At most `REFUSALS_LOGGED_PER_SECOND` lines are logged each
/// second; the count in the stats is complete.
fn refuse(shared: &Shared, generation: u64, request: Option<(u64, Inflight)>, why: &str) {
    let total = shared.stats.refused.fetch_add(1, Ordering::Relaxed) + 1;
    if shared.refusal_log.allow() {
        tracing::warn!("refused driver message: {why}");
    } else {
        tracing::debug!("refused driver message ({total} in all): {why}");
    }
    if let Some((unique, mut request)) = request {
        request.failures += 1;
        if request.failures >= POISON_REFUSALS {
            // The same request again: it is what the driver cannot answer. Only it fails.
            tracing::warn!(
                "request {unique} was answered badly {} times; failing it with EIO",
                request.failures
            );
            return answer_in_drivers_place(shared, unique, request.queue.into(), Errno::IO);
        }
        request.sent = None;
        shared.inflight.insert(unique, request);
    }
    report_misbehaviour(shared, generation, why);
}

/// Asks for a restart of driver `generation` (once), giving `why`.
fn report_misbehaviour(shared: &Shared, generation: u64, why: &str) {
    if shared
        .misbehaviour_reported
        .swap(generation + 1, Ordering::Relaxed)
        != generation + 1
    {
        *shared
            .misbehaviour
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(why.to_string());
        shared.report(ProxyEvent::DriverMisbehaved);
    }
}

/// Why a well-formed reply to `request` looks like its driver failing rather than like an
/// answer, if it does and second opinions are on: an error no working driver gives for that
/// request ([`fuse_wire::is_suspect_error`]), or an entry that cannot be right
/// ([`tracker::ObjectTable::impossible_entry`]).
fn suspicion(
    shared: &Shared,
    unique: u64,
    request: &Inflight,
    error: i32,
    body: &[u8],
) -> Option<String> {
    shared.second_opinions.as_ref()?;
    let op = Opcode::from_raw(request.opcode)?;
    // Set once: a store on every reply would bounce the flag's cache line between threads.
    if error == 0 && tracker::redo::is_mutation(op) && !shared.store_changed.load(Ordering::Relaxed)
    {
        shared.store_changed.store(true, Ordering::Relaxed);
    }
    if error != 0 {
        let errno = error.saturating_neg();
        // A driver that is read-only by design (squashfuse, on a mount not marked `ro`)
        // answers EROFS to every change; one that has made changes and says so has lost track.
        if errno == libc::EROFS && !shared.store_changed.load(Ordering::Relaxed) {
            return None;
        }
        return fuse_wire::is_suspect_error(op, errno).then(|| {
            format!(
                "answered {op:?} request {unique} with \"{}\"",
                io::Error::from_raw_os_error(errno)
            )
        });
    }
    if !matches!(
        request.change,
        PendingChange::Entry { .. } | PendingChange::Create { .. }
    ) {
        return None;
    }
    let why = shared
        .objects()
        .impossible_entry(op, &request.change, body)?;
    // A LOOKUP that revalidates a cached name runs without the directory's lock, so it can
    // overtake an UNLINK, RENAME or LINK in the driver whose reply comes after its own: the
    // name the kernel knows the node by may be changing. Not impossible, then.
    let renaming = |r: &Inflight| {
        matches!(
            r.change,
            PendingChange::Remove { .. } | PendingChange::Rename { .. }
        ) || r.opcode == Opcode::Link as u32
    };
    if op == Opcode::Lookup && shared.inflight.any(renaming) {
        return None;
    }
    Some(format!("answered {op:?} request {unique}: {why}"))
}

/// Acts on a suspect reply (see [`suspicion`]) of driver `generation` to `request`: the
/// request waits for a restarted driver, which answers it in its turn (as a request in flight
/// at a crash: what already happened is settled, not done twice), and `None` is returned.
/// The restarted driver's answer, and any while a confirmed suspicion cools second opinions
/// down, is given back to be forwarded.
fn doubt(
    shared: &Shared,
    generation: u64,
    unique: u64,
    mut request: Inflight,
    why: &str,
) -> Option<Inflight> {
    let Some(policy) = &shared.second_opinions else {
        return Some(request);
    };
    let mut confirmed = policy.confirmed.lock().unwrap_or_else(|e| e.into_inner());
    if request.doubted {
        *confirmed = Some(Instant::now());
        shared
            .stats
            .doubts_confirmed
            .fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            "a restarted driver {why} too: forwarded; no second opinions for {} s",
            policy.cooldown.as_secs()
        );
        return Some(request);
    }
    if confirmed.is_some_and(|at| at.elapsed() < policy.cooldown)
        || !policy.affordable.load(Ordering::Relaxed)
    {
        return Some(request);
    }
    drop(confirmed);
    request.doubted = true;
    shared.inflight.insert(unique, request);
    shared.stats.doubted.fetch_add(1, Ordering::Relaxed);
    report_misbehaviour(shared, generation, &format!("{why}{SECOND_OPINION}"));
    None
}

/// How the cause of a restart for a second opinion ends.
pub const SECOND_OPINION: &str = "; asking a restarted driver";

/// Answers a request with success and no data, in the driver's place.
fn answer_ok(shared: &Shared, unique: u64, queue: usize) {
    write_to_kernel(shared, queue, &fuse_wire::error_reply(unique, 0));
}

/// A successful reply to request `unique` carrying `body`.
fn success_reply(unique: u64, body: &[u8]) -> Vec<u8> {
    let mut reply = fuse_wire::error_reply(unique, 0).to_vec();
    reply.extend_from_slice(body);
    let len = reply.len() as u32;
    reply[..4].copy_from_slice(&len.to_ne_bytes());
    reply
}

/// Answers a request with success and `body`, in the driver's place.
fn answer_with(shared: &Shared, unique: u64, queue: usize, body: &[u8]) {
    write_to_kernel(shared, queue, &success_reply(unique, body));
}

fn answer_in_drivers_place(shared: &Shared, unique: u64, queue: usize, errno: Errno) {
    let reply = fuse_wire::error_reply(unique, errno.raw_os_error());
    write_to_kernel(shared, queue, &reply);
}

fn write_to_kernel(shared: &Shared, queue: usize, msg: &[u8]) {
    let kernel = shared.queues.get(queue).unwrap_or(&shared.queues[0]);
    match rustix::io::write(kernel.as_fd(), msg) {
        Ok(_) => {}
        // The request was interrupted and already completed: nobody waits for this reply.
        Err(Errno::NOENT) => {}
        Err(Errno::NODEV) => shared.report(ProxyEvent::KernelGone),
        Err(e) => tracing::warn!("kernel refused a driver message: {e}"),
    }
}

/// Locks `mutex`, whether or not a thread panicked holding it (what it guards stays usable:
/// every update to it is one assignment or one call).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::{BufferPool, LogBudget, BUFFER_SIZE};

    #[test]
    fn buffers_grow_to_a_larger_max_write_and_never_shrink() {
        let pool = BufferPool::default();
        let small = pool.take();
        assert_eq!(small.len(), BUFFER_SIZE);
        pool.give(small);
        pool.fit(16 << 20);
        let large = pool.take();
        assert!(large.len() >= (16 << 20) + 80, "{}", large.len());
        pool.fit(4096);
        pool.give(large);
        assert!(
            pool.take().len() >= (16 << 20) + 80,
            "a smaller max_write shrank them"
        );
    }

    #[test]
    fn log_budget_allows_a_fixed_number_per_second() {
        let budget = LogBudget::new(3);
        let allowed = (0..10).filter(|_| budget.allow()).count();
        // All ten calls fall in the same second unless the test straddles a boundary.
        assert!((3..=6).contains(&allowed), "{allowed}");
    }
}
