//! Requests from the kernel to the driver, while the proxy serves: the threads that read the
//! kernel's queues (one per CPU, up to four), what each request records before it is forwarded
//! (the in-flight table, the tracker's pending change, the redo log), the answers rebound gives
//! in the driver's place (while one restarts, and for its own shadow directory), and forgets,
//! translated to the driver's ids.
//!
//! Owns: the path from a kernel queue to the driver's channel. Must not: read the driver's
//! messages (`replies` does) or decide about the driver's health (it reports what it sees).

use super::*;
/// `kernel` and its clones: one kernel queue per CPU (up to four), each read by a thread of
/// its own once the proxy serves.
pub(super) fn kernel_queues(kernel: OwnedFd) -> Vec<OwnedFd> {
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
pub(super) fn spawn_queue_readers(shared: &Arc<Shared>) -> io::Result<()> {
    for queue in 0..shared.queues.len() {
        let down = shared.clone();
        std::thread::Builder::new()
            .name(format!("kernel-queue-{queue}"))
            .spawn(move || kernel_to_driver(&down, queue))?;
    }
    Ok(())
}

pub(super) fn kernel_to_driver(shared: &Shared, queue: usize) {
    let kernel = &shared.queues[queue];
    let mut buf = shared.buffers.take();
    loop {
        let len = match rustix::io::read(kernel, &mut buf[..]) {
            Ok(len) => len,
            // ENOENT: the request was interrupted before it could be read.
            Err(Errno::INTR | Errno::NOENT | Errno::AGAIN) => continue,
            Err(Errno::INVAL) if shared.buffers.grow(&mut buf) => continue,
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
pub(super) struct RequestInfo {
    pub(super) header: InHeader,
    pub(super) opcode: Option<Opcode>,
    pub(super) shape: ReplyShape,
    pub(super) change: PendingChange,
    pub(super) fields: fuse_wire::ids::IdFields,
    /// RELEASE/RELEASEDIR: the handle, whether it is a directory's, and the node it is on.
    pub(super) release: Option<(u64, bool, u64)>,
}

impl RequestInfo {
    pub(super) fn of(msg: &[u8]) -> Result<RequestInfo, fuse_wire::WireError> {
        let req = Request::parse(msg)?;
        let change = req.change();
        let release = match change {
            fuse_wire::Change::Release { fh, dir, node } => Some((fh, dir, node)),
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

/// The open flags the driver is given through the channel for the caller's `flags`: a handle
/// that may write loses `O_DIRECT`. A socket cannot hand the driver a write's data page-aligned
/// (libfuse reads a request whole into one buffer, the data after its headers), so a driver
/// that opens its backing file with the caller's flags (passthrough_ll) failed every
/// `O_DIRECT` write with `EINVAL`; reads arrive in buffers libfuse aligns, and a read-only
/// handle keeps the flag. On the kernel's side the file stays `O_DIRECT`: no FUSE page cache,
/// each request sent as the caller made it.
pub(super) fn driver_flags(flags: u32) -> u32 {
    use rustix::fs::OFlags;
    let read_only = flags & OFlags::ACCMODE.bits() == OFlags::RDONLY.bits();
    if read_only {
        flags
    } else {
        flags & !OFlags::DIRECT.bits()
    }
}

/// Handles one request read from the kernel into `buf[..len]`. A large request that must wait
/// for its reply takes `buf` with it (a fresh one takes its place).
pub(super) fn on_request(shared: &Shared, queue: usize, buf: &mut ResidentBuffer, len: usize) {
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
        Some(Opcode::Open | Opcode::Create) => fuse_wire::map_open_flags(msg, driver_flags),
        _ => {}
    }
    if unique & abi::UNIQUE_RESEND != 0 {
        // A request a dead rebound had committed, and died before it answered: the journal
        // gave its reply back. Executed again, it would make its change twice.
        let committed = shared.objects().take_replayed_reply(unique);
        if let Some(body) = committed {
            tracing::debug!(
                "request {unique} ({:?}) was answered from the journal",
                info.opcode
            );
            return answer_with(shared, unique, queue, &body);
        }
    }
    if matches!(info.opcode, Some(Opcode::Readdir | Opcode::Readdirplus)) {
        recovery::prime_reopened_directory(shared, msg, &info.fields, &info.change);
    }
    // RELEASE lets go of the handle at once, whatever the driver answers. Whether it releases
    // an earlier use of a value the driver gave again is decided under the same lock, so
    // that two releases of the value on two queues cannot both take themselves for it.
    let released = info.release.map(|(fh, dir, node)| {
        let mut objects = shared.objects();
        let earlier = objects.releases_an_earlier_use(fh, dir, node);
        (fh, dir, earlier, objects.release(fh, dir, node))
    });
    if let Some((fh, true, false, _)) = released {
        // (Not for an earlier use: the directory's listing mark is the later use's.)
        recovery::forget_unprimed(shared, fh);
    }
    let released = released.map(|(.., to_driver)| to_driver);
    if released == Some(ToDriver::Lost) {
        // The handle died with an earlier driver, or this releases an earlier use of a value
        // the driver gave again: there is nothing left to close.
        return answer_ok(shared, unique, queue);
    }

    // Decided again after each node a restarted driver had to be asked for first: the link
    // may have changed meanwhile.
    let (mut lookups, mut looked_up_in) = (0, None);
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
                if shadow_answer(shared, &info, queue, &buf[..len]) {
                    return;
                }
                // Parked: sent to the new driver once it holds what the kernel holds. One the
                // kernel sends again (FUSE_NOTIFY_RESEND) was read by the failed driver: it is
                // settled as one in flight at the failure.
                let sent = (unique & abi::UNIQUE_RESEND != 0).then(|| (0, Instant::now()));
                if !park(shared, &info, queue, buf, len, sent, |link| {
                    matches!(link, Link::Recovering { .. } | Link::Beside)
                }) {
                    continue; // a new driver serves meanwhile: it is sent there
                }
                return;
            }
            Link::Serving { driver, generation } => (driver.clone(), *generation),
        };
        if looked_up_in != Some(generation) {
            // Lookups are counted per driver: a new one may need them all again.
            (lookups, looked_up_in) = (0, Some(generation));
        }
        let translated = shared
            .objects()
            .to_driver(&mut buf[..len], info.fields, &info.change);
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
                // For the next driver (this one failed during the lookup), unless one
                // already took over.
                if !park(shared, &info, queue, buf, len, None, |link| match link {
                    Link::Serving { generation: g, .. } => *g == generation,
                    Link::Recovering { .. } | Link::Beside => true,
                    Link::Failed => false,
                }) {
                    continue;
                }
                return;
            }
            Err(tracker::Untranslated::Lost) => {
                drop(link);
                shared.stats.lost_uses.fetch_add(1, Ordering::Relaxed);
                return answer_in_drivers_place(shared, unique, queue, Errno::IO);
            }
        }
    };
    let msg = &mut buf[..len];
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

/// Parks the request in `buf[..len]` in the in-flight table, if `still` holds for the link:
/// both under the link's lock, as a recovery takes what is parked and lets the new driver
/// serve under it. (Parked after a recovery took the rest, a request would wait for a driver
/// that never gets it.) Returns false, parking nothing, if `still` no longer holds.
fn park(
    shared: &Shared,
    info: &RequestInfo,
    queue: usize,
    buf: &mut ResidentBuffer,
    len: usize,
    sent: Option<(u64, Instant)>,
    still: impl FnOnce(&Link) -> bool,
) -> bool {
    let link = shared.link();
    if !still(&link) {
        return false;
    }
    let request = shared.buffers.keep(buf, len, Patches::default());
    shared.inflight.insert(
        info.header.unique,
        inflight_entry(info, queue, request, sent),
    );
    drop(link);
    true
}

pub(super) fn inflight_entry(
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
pub(super) const SHADOW_DIR_FH: u64 = u64::MAX;

/// While no driver serves, answers the requests a restarting driver makes itself before it
/// can serve: its `mount(2)` (or fusermount's) stats the mount point, checks access to it,
/// and libfuse 2 lists it to refuse a non-empty mount point. These are requests to this very
/// mount, from the driver that is to serve it. GETATTR of the root gets the latest attributes
/// a driver gave (whoever asks); the driver's own processes are granted ACCESS and see the
/// root as an empty directory.
pub(super) fn shadow_answer(shared: &Shared, info: &RequestInfo, queue: usize, msg: &[u8]) -> bool {
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
pub(super) fn plain_root_attr() -> Vec<u8> {
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
pub(super) fn is_ours(pid: u32) -> bool {
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
pub(super) fn forward_forgets(shared: &Shared, msg: &mut [u8]) {
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

/// Read buffers for the kernel's requests, recycled so that large requests waiting for their
/// reply do not cost an allocation each. `BUFFER_SIZE`, unless a first driver in fast mode
/// told the kernel a larger `max_write` (see [`BufferPool::fit`]). Each is a
/// [`ResidentBuffer`]: a read that needed a page fault could be failed by the kernel with
/// `EIO` for the application, were rebound killed during it.
pub(super) struct BufferPool {
    free: Mutex<Vec<ResidentBuffer>>,
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
    pub(super) const KEEP: usize = 16;

    pub(super) fn take(&self) -> ResidentBuffer {
        let size = self.size.load(Ordering::Relaxed);
        let free = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop();
        match free.filter(|buf| buf.len() == size) {
            Some(buf) => buf,
            // Present up to what a request can hold: its payload is at most `max_pages`
            // pages (1 MiB unless the host raised `max_pages_limit`), whatever `max_write`
            // a fast-mode driver told the kernel. As for any allocation: out of memory,
            // rebound ends (its keeper takes over).
            None => ResidentBuffer::new(size, BUFFER_SIZE).unwrap_or_else(|_| {
                std::alloc::handle_alloc_error(std::alloc::Layout::array::<u8>(size).unwrap())
            }),
        }
    }

    pub(super) fn give(&self, buf: ResidentBuffer) {
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
    pub(super) fn fit(&self, max_write: u32) {
        let needed = (max_write as usize).saturating_add(HEADROOM);
        self.size.fetch_max(needed, Ordering::Relaxed);
    }

    /// Replaces `buf`, which the kernel refused (`EINVAL`) as smaller than its `max_write`
    /// with headers, with one twice its size; false once that would pass `LARGEST`. A
    /// successor of a rebound that died or reloaded in fast mode learns a first driver's
    /// larger `max_write` this way: it never saw that INIT reply.
    pub(super) fn grow(&self, buf: &mut ResidentBuffer) -> bool {
        const LARGEST: usize = 256 << 20;
        let wanted = buf.len().saturating_mul(2);
        if wanted > LARGEST {
            tracing::error!(
                "the kernel refuses reads into {} bytes: its max_write is too large for rebound",
                buf.len()
            );
            return false;
        }
        if self.size.fetch_max(wanted, Ordering::Relaxed) < wanted {
            tracing::info!("the kernel wants larger read buffers: now {wanted} bytes");
        }
        *buf = self.take();
        true
    }

    /// Keeps the request in `buf[..len]` for as long as it is in flight: a small one is
    /// copied, a large one takes the buffer (which is replaced).
    pub(super) fn keep(
        &self,
        buf: &mut ResidentBuffer,
        len: usize,
        patches: Patches,
    ) -> RequestBytes {
        let bytes = if len <= SMALL_REQUEST {
            RequestStore::Copied(buf[..len].to_vec())
        } else {
            RequestStore::Read(std::mem::replace(buf, self.take()))
        };
        RequestBytes {
            buf: Arc::new(bytes),
            len,
            patches,
        }
    }

    pub(super) fn recycle(&self, request: RequestBytes) {
        if let Ok(RequestStore::Read(buf)) = Arc::try_unwrap(request.buf) {
            self.give(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{BufferPool, BUFFER_SIZE};

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
    fn a_refused_buffer_doubles_until_a_bound() {
        let pool = BufferPool::default();
        let mut buf = pool.take();
        assert!(pool.grow(&mut buf));
        assert_eq!(buf.len(), 2 * BUFFER_SIZE);
        assert_eq!(
            pool.take().len(),
            2 * BUFFER_SIZE,
            "the pool did not follow"
        );
        let mut grown = 1;
        while pool.grow(&mut buf) {
            grown += 1;
        }
        assert!(
            buf.len() <= 256 << 20 && buf.len() > 128 << 20,
            "{}",
            buf.len()
        );
        assert_eq!(grown, 7);
    }
}
