//! What the supervisor does to the proxy around a driver's failure: ends the link to a
//! failed driver, decides what becomes of the requests it held (failed, answered in its place,
//! or kept for its successor), hands a standby the INIT it must answer and checks that answer,
//! attaches the successor, and tells whether the serving driver still answers (the liveness
//! check). The recovery itself (bringing a successor to the old driver's state) is
//! [`super::recovery`]'s.
//!
//! Must not: start or stop processes (the supervisor does).

use super::*;

impl Proxy {
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
                let mut restored = lock(&shared.restored);
                if shared.link().current().map(|(_, g)| g) != Some(generation) {
                    // Superseded: its outcome must not take the place of its successor's
                    // before the supervisor reads that.
                    tracing::debug!("restore of a driver no longer attached ended: {outcome:?}");
                    return;
                }
                *restored = Some((generation, outcome));
                drop(restored);
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

    /// Why the current driver's last refused message was refused; `None` if no message of
    /// the current driver was (one refused of a driver since replaced is not its successor's).
    pub fn misbehaviour(&self) -> Option<String> {
        let current = self.shared.link().current().map(|(_, g)| g)?;
        match &*lock(&self.shared.misbehaviour) {
            Some((generation, why)) if *generation == current => Some(why.clone()),
            _ => None,
        }
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
}
