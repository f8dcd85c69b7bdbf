//! Messages from the driver to the kernel, while the proxy serves: each reply is checked against
//! the request it answers before the kernel sees it, and what it changes is committed to the
//! tracker; a refused reply is answered in the driver's place, suspect errors get a second
//! opinion, and notifications are passed on.
//!
//! Owns: the path from the driver's channel to a kernel queue. Must not: read the kernel's
//! queues (`requests` does) or restart the driver (it reports a misbehaviour; the supervisor
//! acts).

use super::*;
pub(super) fn spawn_driver_reader(
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

pub(super) fn driver_to_kernel(shared: &Shared, driver: &OwnedFd, generation: u64) {
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
pub(super) fn deliver_driver_message(shared: &Shared, msg: &mut [u8], generation: u64) {
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
            // Under the link's lock, as every refusal of a reply: the request it parks again
            // is then either seen by a recovery that starts after it or sent by it.
            Err(e) => {
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
pub(super) fn corrupt_in_transit<'m>(stats: &ProxyStats, msg: &'m mut [u8]) -> &'m mut [u8] {
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

pub(super) fn cache_root_attr(shared: &Shared, attr: &[u8]) {
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
pub(super) fn mark_recovery_phase(shared: &Shared, phase: &'static str) {
    let mut clock = shared.clock.lock().unwrap_or_else(|e| e.into_inner());
    if clock.detected.is_some() {
        clock.marks.push((phase, Instant::now()));
    }
}

/// Ends the latency measurement of a recovery at the first request the new driver serves.
pub(super) fn first_reply_served(shared: &Shared) {
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
pub(super) struct ReplyTo {
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
pub(super) fn check_driver_message(
    shared: &Shared,
    msg: &mut [u8],
    generation: u64,
) -> Option<ReplyTo> {
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
        commit_change(shared, unique, &request.change, body);
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
pub(super) fn kernel_bytes(request: &Inflight) -> Vec<u8> {
    let mut bytes = request.request.bytes().to_vec();
    request.request.patches.undo(&mut bytes);
    bytes
}

/// Records in the tracker a change the driver made for the kernel's request `unique`, with its
/// reply's `body` (whose ids become the kernel's).
pub(super) fn commit_change(shared: &Shared, unique: u64, change: &PendingChange, body: &mut [u8]) {
    if let PendingChange::Remove { parent, .. }
    | PendingChange::Rename {
        new_parent: parent, ..
    } = change
    {
        note_removal_dir(shared, *parent);
    }
    if *change != PendingChange::None {
        shared.objects().on_success(unique, change.clone(), body);
    }
}

/// A name was removed (or replaced) in the kernel's directory `dir`.
pub(super) fn note_removal_dir(shared: &Shared, dir: u64) {
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
pub(super) fn record_mutation(shared: &Shared, request: &Inflight, reply: &[u8]) {
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
pub(super) fn notification_to_kernel(
    shared: &Shared,
    code: fuse_wire::NotifyCode,
    msg: &mut [u8],
) -> bool {
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
/// the driver that replaces it (the caller holds the link's lock, so that a recovery sees
/// it). At most `REFUSALS_LOGGED_PER_SECOND` lines are logged each
/// second; the count in the stats is complete.
pub(super) fn refuse(
    shared: &Shared,
    generation: u64,
    request: Option<(u64, Inflight)>,
    why: &str,
) {
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
pub(super) fn report_misbehaviour(shared: &Shared, generation: u64, why: &str) {
    if shared
        .misbehaviour_reported
        .swap(generation + 1, Ordering::Relaxed)
        != generation + 1
    {
        *lock(&shared.misbehaviour) = Some((generation, why.to_string()));
        shared.report(ProxyEvent::DriverMisbehaved);
    }
}

/// Why a well-formed reply to `request` looks like its driver failing rather than like an
/// answer, if it does and second opinions are on: an error no working driver gives for that
/// request ([`fuse_wire::is_suspect_error`]), or an entry that cannot be right
/// ([`tracker::ObjectTable::impossible_entry`]).
pub(super) fn suspicion(
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
pub(super) fn doubt(
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
pub(super) fn answer_ok(shared: &Shared, unique: u64, queue: usize) {
    write_to_kernel(shared, queue, &fuse_wire::error_reply(unique, 0));
}

/// A successful reply to request `unique` carrying `body`.
pub(super) fn success_reply(unique: u64, body: &[u8]) -> Vec<u8> {
    let mut reply = fuse_wire::error_reply(unique, 0).to_vec();
    reply.extend_from_slice(body);
    let len = reply.len() as u32;
    reply[..4].copy_from_slice(&len.to_ne_bytes());
    reply
}

/// Answers a request with success and `body`, in the driver's place.
pub(super) fn answer_with(shared: &Shared, unique: u64, queue: usize, body: &[u8]) {
    write_to_kernel(shared, queue, &success_reply(unique, body));
}

#[track_caller]
pub(super) fn answer_in_drivers_place(shared: &Shared, unique: u64, queue: usize, errno: Errno) {
    // An application sees an error rebound gave: always worth a line (the place it was
    // decided, for the reason logged beside it).
    if errno == Errno::IO && shared.eio_log.allow() {
        tracing::warn!(
            "request {unique} answered with EIO in the driver's place ({})",
            std::panic::Location::caller()
        );
    }
    let reply = fuse_wire::error_reply(unique, errno.raw_os_error());
    write_to_kernel(shared, queue, &reply);
}

pub(super) fn write_to_kernel(shared: &Shared, queue: usize, msg: &[u8]) {
    let kernel = shared.queues.get(queue).unwrap_or(&shared.queues[0]);
    match rustix::io::write(kernel.as_fd(), msg) {
        Ok(_) => {}
        // The request was interrupted and already completed: nobody waits for this reply.
        Err(Errno::NOENT) => {}
        Err(Errno::NODEV) => shared.report(ProxyEvent::KernelGone),
        Err(e) => tracing::warn!("kernel refused a driver message: {e}"),
    }
}

/// A per-second budget of log lines, shared between threads without a lock.
pub(super) struct LogBudget {
    start: Instant,
    /// Second (since `start`) of the current window in the high half, lines used in the low.
    window: AtomicU64,
    per_second: u32,
}

impl LogBudget {
    pub(super) fn new(per_second: u32) -> Self {
        LogBudget {
            start: Instant::now(),
            window: AtomicU64::new(0),
            per_second,
        }
    }

    pub(super) fn allow(&self) -> bool {
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
