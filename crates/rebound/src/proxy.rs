//! The isolation layer's data path: rebound's end of `/dev/fuse` on one side, the driver's
//! message channel on the other, and every message checked as it crosses.
//!
//! Owns: the two forwarding threads (kernel to driver, driver to kernel), the INIT rewrite,
//! reply validation against the [`InflightTable`], and answering the kernel in the driver's
//! place when a reply is refused.
//! Must not: know about processes or mounts (the supervisor's), or allocate per request: each
//! thread reads into one buffer it reuses.
//!
//! The channel is an `AF_UNIX` `SOCK_SEQPACKET` socket pair: like `/dev/fuse` it keeps message
//! boundaries, so an unmodified driver reads exactly one request per `read(2)` and writes one
//! reply per `write(2)`.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use fuse_wire::{abi, DriverMessage, Opcode, Request};
use rustix::io::Errno;
use rustix::net::{RecvFlags, SendFlags};
use tracker::{Inflight, InflightTable, ObjectTable, PendingChange};

/// Largest WRITE payload rebound lets a driver negotiate (the kernel's own ceiling with the
/// default `max_pages_limit` of 256 pages).
pub const MAX_WRITE: u32 = 1 << 20;
/// Room for a request or reply of `MAX_WRITE` bytes of data plus headers and arguments.
const BUFFER_SIZE: usize = MAX_WRITE as usize + 64 * 1024;
/// Socket buffers must hold at least one message of `BUFFER_SIZE`; a few keep the driver's
/// threads busy.
const SOCKET_BUFFER: usize = 4 * BUFFER_SIZE;

/// Why a forwarding thread stopped; reported to the supervisor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ProxyEvent {
    /// `/dev/fuse` answered `ENODEV`: the file system was unmounted or the connection aborted.
    KernelGone = 1,
    /// The driver's end of the channel is closed: every process holding it has exited.
    DriverGone = 2,
}

impl ProxyEvent {
    pub fn from_byte(byte: u8) -> Option<Self> {
        match byte {
            1 => Some(ProxyEvent::KernelGone),
            2 => Some(ProxyEvent::DriverGone),
            _ => None,
        }
    }
}

/// Counters a forwarding thread keeps; read by the supervisor for logs and status.
#[derive(Debug, Default)]
pub struct ProxyStats {
    pub requests: AtomicU64,
    pub replies: AtomicU64,
    pub notifications: AtomicU64,
    /// Driver messages refused by validation.
    pub refused: AtomicU64,
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

/// A running proxy between one kernel connection and one driver channel.
pub struct Proxy {
    pub stats: Arc<ProxyStats>,
    shared: Arc<Shared>,
    /// Reused by [`Proxy::deliver_spliced`], so a splice allocates nothing.
    splice_buffer: std::sync::Mutex<Vec<u8>>,
}

struct Shared {
    /// rebound's `/dev/fuse` descriptors: the one it mounted with and its clones, each read by
    /// its own thread. A reply must go back on the descriptor that read its request.
    queues: Vec<OwnedFd>,
    driver: OwnedFd,
    inflight: InflightTable,
    objects: std::sync::Mutex<ObjectTable>,
    /// Negotiated protocol minor version; 0 until INIT completes.
    minor: AtomicU32,
    stats: Arc<ProxyStats>,
    events: UnixStream,
    refusal_log: LogBudget,
}

const REFUSALS_LOGGED_PER_SECOND: u32 = 10;

/// A per-second budget of log lines, shared between threads without a lock.
struct LogBudget {
    start: std::time::Instant,
    /// Second (since `start`) of the current window in the high half, lines used in the low.
    window: AtomicU64,
    per_second: u32,
}

impl LogBudget {
    fn new(per_second: u32) -> Self {
        LogBudget {
            start: std::time::Instant::now(),
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

impl Shared {
    fn objects(&self) -> std::sync::MutexGuard<'_, ObjectTable> {
        // Every update is applied whole under the lock, so a poisoned table is still usable.
        self.objects.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn report(&self, event: ProxyEvent) {
        use std::io::Write;
        // The supervisor polls the other end; if it is gone, so is everything else.
        let _ = (&self.events).write_all(&[event as u8]);
    }
}

impl Proxy {
    /// Starts forwarding between `kernel` (rebound's `/dev/fuse`) and `driver` (rebound's end
    /// of the channel), with one kernel queue per CPU (up to four). Events are written to
    /// `events` as single bytes.
    pub fn start(kernel: OwnedFd, driver: OwnedFd, events: UnixStream) -> io::Result<Proxy> {
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
        let stats = Arc::new(ProxyStats::default());
        let shared = Arc::new(Shared {
            queues,
            driver,
            inflight: InflightTable::new(),
            objects: std::sync::Mutex::new(ObjectTable::new()),
            minor: AtomicU32::new(0),
            stats: stats.clone(),
            events,
            refusal_log: LogBudget::new(REFUSALS_LOGGED_PER_SECOND),
        });
        // The threads run for as long as rebound does: they end when either side closes.
        for queue in 0..shared.queues.len() {
            let down = shared.clone();
            std::thread::Builder::new()
                .name(format!("kernel-queue-{queue}"))
                .spawn(move || kernel_to_driver(&down, queue))?;
        }
        let up = shared.clone();
        std::thread::Builder::new()
            .name("driver-to-kernel".into())
            .spawn(move || driver_to_kernel(&up))?;
        Ok(Proxy {
            stats,
            shared,
            splice_buffer: std::sync::Mutex::new(vec![0u8; BUFFER_SIZE]),
        })
    }

    /// How many nodes and open handles the kernel holds through the driver.
    pub fn held_objects(&self) -> (usize, usize) {
        held_objects(&self.shared)
    }

    /// A reader of [`Proxy::held_objects`] that other threads can keep.
    pub fn held_objects_reader(&self) -> impl Fn() -> (usize, usize) + Send + 'static {
        let shared = self.shared.clone();
        move || held_objects(&shared)
    }

    /// Tells the driver its connection is over: its reads on the channel return 0 from now
    /// on, as reads of `/dev/fuse` fail once a mount is gone. Drivers that wait for their
    /// reader threads before exiting (go-fuse) need this.
    pub fn disconnect_driver(&self) {
        let _ = rustix::net::shutdown(&self.shared.driver, rustix::net::Shutdown::Both);
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
        deliver_driver_message(&self.shared, &mut buf[..got]);
        Ok(got)
    }
}

fn held_objects(shared: &Shared) -> (usize, usize) {
    let objects = shared.objects();
    (objects.node_count(), objects.handle_count())
}

fn kernel_to_driver(shared: &Shared, queue: usize) {
    let kernel = &shared.queues[queue];
    let mut buf = vec![0u8; BUFFER_SIZE];
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
        let msg = &mut buf[..len];
        let (unique, raw_opcode, opcode, shape, change) = match Request::parse(msg) {
            Ok(req) => {
                let change = match req.change() {
                    fuse_wire::Change::None => PendingChange::None,
                    change => shared.objects().on_request(change),
                };
                (
                    req.header.unique,
                    req.header.opcode,
                    req.opcode,
                    req.reply_shape(),
                    change,
                )
            }
            Err(e) => {
                tracing::error!("unparsable request from the kernel: {e}");
                continue;
            }
        };
        if opcode == Some(Opcode::Init) {
            fuse_wire::mask_init_request(msg);
        }
        // INTERRUPT replies are optional and carry their own id; they are checked on the way
        // back without an entry.
        if !matches!(
            shape,
            fuse_wire::ReplyShape::NoReply | fuse_wire::ReplyShape::ErrorOnly
        ) {
            shared.inflight.insert(
                unique,
                Inflight {
                    opcode: raw_opcode,
                    shape,
                    change,
                    queue: queue as u8,
                },
            );
        }
        shared.stats.requests.fetch_add(1, Ordering::Relaxed);
        match rustix::net::send(&shared.driver, msg, SendFlags::NOSIGNAL) {
            Ok(_) => {}
            Err(Errno::PIPE | Errno::CONNRESET) => {
                shared.inflight.take(unique);
                return shared.report(ProxyEvent::DriverGone);
            }
            Err(e) => {
                tracing::error!("sending request {unique} to the driver: {e}");
                shared.inflight.take(unique);
                answer_in_drivers_place(shared, unique, queue, Errno::IO);
            }
        }
    }
}

fn driver_to_kernel(shared: &Shared) {
    let mut buf = vec![0u8; BUFFER_SIZE];
    loop {
        // TRUNC makes recv return the real length of an oversized message, so it is refused
        // instead of being forwarded cut short.
        let len = match rustix::net::recv(&shared.driver, &mut buf[..], RecvFlags::TRUNC) {
            // ECONNRESET: the driver closed its end with requests still unread.
            Ok((0, _)) | Err(Errno::CONNRESET) => return shared.report(ProxyEvent::DriverGone),
            Ok((len, _)) => len,
            Err(Errno::INTR | Errno::AGAIN) => continue,
            Err(e) => {
                tracing::error!("reading from the driver: {e}");
                return shared.report(ProxyEvent::DriverGone);
            }
        };
        if len > buf.len() {
            refuse(
                shared,
                None,
                &format!("message of {len} bytes exceeds the channel"),
            );
            continue;
        }
        deliver_driver_message(shared, &mut buf[..len]);
    }
}

/// Checks one whole driver message and, if it passes, forwards it to the kernel.
fn deliver_driver_message(shared: &Shared, msg: &mut [u8]) {
    let Some(reply_to) = check_driver_message(shared, msg) else {
        return;
    };
    if reply_to.is_init {
        match fuse_wire::fix_init_reply(msg, MAX_WRITE) {
            Ok(init) => {
                shared.minor.store(init.minor, Ordering::Relaxed);
                tracing::info!(
                    "driver speaks FUSE 7.{}, max_write {} bytes",
                    init.minor,
                    init.max_write
                );
            }
            Err(e) => {
                refuse(
                    shared,
                    Some((reply_to.unique, reply_to.queue)),
                    &format!("INIT reply: {e}"),
                );
                return;
            }
        }
    }
    write_to_kernel(shared, reply_to.queue, msg);
}

/// What a driver message that passed the checks answers.
struct ReplyTo {
    unique: u64,
    /// A successful reply to INIT, which rebound rewrites before forwarding.
    is_init: bool,
    /// The kernel queue that read the request (0 for notifications).
    queue: usize,
}

/// Applies the wrapper checks to one driver message. Returns where it goes if it may be
/// forwarded; a refused reply is answered with `EIO` so the caller does not wait forever.
fn check_driver_message(shared: &Shared, msg: &[u8]) -> Option<ReplyTo> {
    let parsed = match DriverMessage::parse(msg) {
        Ok(parsed) => parsed,
        Err(e) => {
            refuse(shared, None, &format!("malformed message: {e}"));
            return None;
        }
    };
    let unique = parsed.header.unique;
    if parsed.is_notification() {
        return match parsed.validate_notification() {
            Ok(_) => {
                shared.stats.notifications.fetch_add(1, Ordering::Relaxed);
                Some(ReplyTo {
                    unique,
                    is_init: false,
                    queue: 0,
                })
            }
            Err(e) => {
                refuse(shared, None, &format!("notification: {e}"));
                None
            }
        };
    }
    if unique & abi::INT_REQ_BIT != 0 {
        return match parsed.validate_reply(fuse_wire::ReplyShape::ErrorOnly, 0) {
            // The interrupted request, if still in flight, says which queue read it.
            Ok(()) => Some(ReplyTo {
                unique,
                is_init: false,
                queue: shared
                    .inflight
                    .queue_of(unique & !abi::INT_REQ_BIT)
                    .map_or(0, usize::from),
            }),
            Err(e) => {
                refuse(
                    shared,
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
            None,
            &format!("reply to request {unique}, which is not in flight"),
        );
        return None;
    };
    let minor = shared.minor.load(Ordering::Relaxed);
    match parsed.validate_reply(request.shape, minor) {
        Ok(()) => {
            shared.stats.replies.fetch_add(1, Ordering::Relaxed);
            // Committed before the kernel sees the reply, so that a FORGET the reply makes
            // possible can never arrive first.
            if parsed.header.error == 0 && request.change != PendingChange::None {
                shared.objects().on_success(request.change, parsed.body);
            }
            Some(ReplyTo {
                unique,
                is_init: request.opcode == Opcode::Init as u32 && parsed.header.error == 0,
                queue: usize::from(request.queue),
            })
        }
        Err(e) => {
            let op = Opcode::from_raw(request.opcode)
                .map_or_else(|| request.opcode.to_string(), |op| format!("{op:?}"));
            refuse(
                shared,
                Some((unique, usize::from(request.queue))),
                &format!("reply to {op} request {unique}: {e}"),
            );
            None
        }
    }
}

/// Logs a refused driver message; if it answered a known request, fails that request.
/// A driver can send garbage as fast as it likes, so at most `REFUSALS_LOGGED_PER_SECOND`
/// are logged each second; the count in the stats is complete.
fn refuse(shared: &Shared, request: Option<(u64, usize)>, why: &str) {
    let total = shared.stats.refused.fetch_add(1, Ordering::Relaxed) + 1;
    if shared.refusal_log.allow() {
        tracing::warn!("refused driver message: {why}");
    } else {
        tracing::debug!("refused driver message ({total} in all): {why}");
    }
    if let Some((unique, queue)) = request {
        answer_in_drivers_place(shared, unique, queue, Errno::IO);
    }
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

#[cfg(test)]
mod tests {
    use super::LogBudget;

    #[test]
    fn log_budget_allows_a_fixed_number_per_second() {
        let budget = LogBudget::new(3);
        let allowed = (0..10).filter(|_| budget.allow()).count();
        // All ten calls fall in the same second unless the test straddles a boundary.
        assert!((3..=6).contains(&allowed), "{allowed}");
    }
}
