//! Handing the mount over to a successor rebound (`rebound reload`): the driver drained (it
//! is sent nothing new and answers what it holds), the proxy's state as plain data with the
//! kernel queues kept open across `execve`, and the successor's proxy built from it.
//!
//! Requests read from the kernel and not answered when rebound execs are not handed over:
//! the kernel keeps them on the processing list of the queue that read them, and the
//! successor's `FUSE_NOTIFY_RESEND` puts them back in the queue (Linux 6.9+). Only requests no
//! driver was sent are left so (the drain sees to it), so sending them again executes nothing
//! twice.
//!
//! Owns: the hand-over's form and both of its ends. Must not: decide when to hand over (the
//! supervisor does).

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tracker::{ObjectSnapshot, ObjectTable, RedoLog, RedoSnapshot};

use super::{Link, Proxy, ProxyOptions};

/// What a successor's proxy needs of its predecessor's.
#[derive(Debug, Serialize, Deserialize)]
pub struct HandOver {
    /// The kernel queues, by descriptor number (open across `execve`).
    queues: Vec<i32>,
    objects: ObjectSnapshot,
    /// The kernel's INIT request, replayed to every new driver.
    init: Option<Vec<u8>>,
    minor: u32,
    root_attr: Option<Vec<u8>>,
    redo: Option<RedoSnapshot>,
    generations: u64,
    store_changed: bool,
    /// After rebound's death: the journal to read the rest from (the successor reads it, in
    /// its compact form, rather than the keeper writing it all out again here).
    #[serde(default)]
    journal: Option<PathBuf>,
    /// After rebound's death in fast mode: where its observer is pinned, with what it saw
    /// last (see `beside::replay_pinned`).
    #[serde(default)]
    observer_pins: Option<PathBuf>,
    /// The queues taken over (see [`HandOver::inherit_queues`]).
    #[serde(skip)]
    inherited: Vec<std::os::fd::OwnedFd>,
    /// The table the journal gave, in place of `objects`: as replayed, with the replies it
    /// keeps for requests the kernel sends again (a snapshot would drop them).
    #[serde(skip)]
    journaled: Option<ObjectTable>,
}

impl HandOver {
    /// Takes the kernel queues a predecessor left open across `execve` (by their numbers),
    /// close-on-exec again: before this process starts anything (its keeper, a driver), which
    /// would otherwise inherit them.
    pub fn inherit_queues(&mut self) -> io::Result<()> {
        self.inherited = self
            .queues
            .iter()
            .map(|&fd| rebound_sys::fuse_dev::inherited(fd))
            .collect::<io::Result<Vec<_>>>()?;
        Ok(())
    }

    /// What a successor needs after rebound died (see `keeper`): the kernel queues its
    /// keeper held, by descriptor number (open across `execve`), and the journal in `dir`,
    /// which the successor reads (and removes).
    pub fn from_journal(queues: Vec<i32>, dir: &Path, observer_pins: Option<PathBuf>) -> HandOver {
        HandOver {
            observer_pins,
            inherited: Vec::new(),
            queues,
            objects: ObjectTable::new().snapshot(),
            init: None,
            minor: 0,
            root_attr: None,
            redo: None,
            generations: 0,
            store_changed: false,
            journal: Some(dir.to_path_buf()),
            journaled: None,
        }
    }

    /// The journal's state in place of what this hand-over holds, if it names one. The
    /// driver's ids are not in it: every node is looked up again, as after any failure.
    fn read_journal(mut self) -> io::Result<HandOver> {
        let Some(dir) = self.journal.take() else {
            return Ok(self);
        };
        let journaled = super::journal::read(&dir).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("reading the journal in {}: {e}", dir.display()),
            )
        })?;
        let _ = std::fs::remove_dir_all(&dir);
        Ok(HandOver {
            generations: journaled.objects.generation(),
            journaled: Some(journaled.objects),
            init: journaled.init,
            minor: journaled.minor,
            root_attr: journaled.root_attr,
            redo: journaled.redo.map(|r| r.snapshot()),
            ..self
        })
    }
}

impl Proxy {
    /// Sends the driver nothing more (requests wait, as in a recovery) and waits, at most
    /// `timeout`, until it has answered every request it was sent; its replies still flow.
    /// False if it was not serving, or still holds requests at the deadline.
    pub fn drain(&self, timeout: Duration) -> bool {
        {
            let mut link = self.shared.link.write().unwrap_or_else(|e| e.into_inner());
            let Link::Serving { driver, generation } = &*link else {
                return false;
            };
            let attached = Some((driver.clone(), *generation));
            *link = Link::Recovering { attached };
        }
        let deadline = Instant::now() + timeout;
        while self.shared.inflight.oldest_sent().is_some() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        true
    }

    /// Keeps the kernel queues open across `execve`, or (`keep` false) no longer.
    pub fn keep_queues_across_exec(&self, keep: bool) -> io::Result<()> {
        rebound_sys::fuse_dev::keep_across_exec(&self.kernel_queues_fds(), keep)
    }

    /// The proxy's state, for a successor (see [`Proxy::keep_queues_across_exec`]).
    pub fn hand_over(&self) -> HandOver {
        let shared = &self.shared;
        let locked = |m: &std::sync::Mutex<Option<Vec<u8>>>| {
            m.lock().unwrap_or_else(|e| e.into_inner()).clone()
        };
        HandOver {
            queues: shared.queues.iter().map(|q| q.as_raw_fd()).collect(),
            objects: shared.objects().snapshot(),
            init: locked(&shared.init),
            minor: shared.minor(),
            root_attr: locked(&shared.root_attr),
            redo: shared
                .redo
                .as_ref()
                .map(|r| r.lock().unwrap_or_else(|e| e.into_inner()).snapshot()),
            generations: shared.generations.load(Ordering::Relaxed),
            store_changed: shared.store_changed.load(Ordering::Relaxed),
            journal: None,
            observer_pins: None,
            inherited: Vec::new(),
            journaled: None,
        }
    }

    /// The successor's proxy: over the inherited kernel queues, with the predecessor's
    /// state, waiting for a driver (requests park until one is restored, as after a
    /// failure). The kernel is asked to send again what the predecessor had read.
    pub fn resume(state: HandOver, events: UnixStream, options: ProxyOptions) -> io::Result<Proxy> {
        let mut state = state.read_journal()?;
        if state.inherited.is_empty() {
            state.inherit_queues()?;
        }
        let queues = std::mem::take(&mut state.inherited);
        if queues.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "no kernel queue",
            ));
        }
        if let Some(image) = &options.image {
            image.follow(state.redo.as_ref().map_or(0, RedoSnapshot::checkpoints))?;
        }
        let link = Link::Recovering { attached: None };
        let proxy = Proxy::launch(queues, events, &options, link, |shared| {
            let objects = state
                .journaled
                .unwrap_or_else(|| ObjectTable::from_snapshot(state.objects));
            shared.objects = objects.into();
            shared.init = state.init.into();
            shared.minor = state.minor.into();
            shared.root_attr = state.root_attr.into();
            if let (Some(redo), Some(snapshot)) = (&mut shared.redo, state.redo) {
                *redo = RedoLog::from_snapshot(snapshot).into();
            }
            shared.generations = state.generations.into();
            shared.store_changed = state.store_changed.into();
            if let Some(dir) = &state.observer_pins {
                // What the dead rebound's observer saw: the kernel held the driver's handles.
                shared.objects().set_kernel_holds_driver_handles(true);
                super::beside::replay_pinned(shared, dir);
                shared.objects().set_kernel_holds_driver_handles(false);
            }
        })?;
        proxy.driver_failed();
        let parked = super::resend_requests(&proxy.shared)?;
        tracing::debug!("{parked} requests the driver had read were sent again");
        super::spawn_queue_readers(&proxy.shared)?;
        Ok(proxy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_journal_read_keeps_the_replies_for_requests_sent_again() {
        // A predecessor committed an OPEN (request 42) and died before it answered.
        let mut table = ObjectTable::new();
        table.keep_journal();
        let snapshot = table.snapshot();
        let mut open_out = 7u64.to_ne_bytes().to_vec();
        open_out.resize(16, 0);
        let open = tracker::PendingChange::Open {
            node: 1,
            flags: 2,
            dir: false,
        };
        table.on_success(42, open, &mut open_out);
        let dir = std::env::temp_dir().join(format!("rebound-handover-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = super::super::journal::file_of(&snapshot, &table.take_journal());
        std::fs::write(dir.join("journal.0"), file).unwrap();

        let state = HandOver::from_journal(Vec::new(), &dir, None)
            .read_journal()
            .unwrap();
        assert!(!dir.exists(), "the successor removes the journal it read");
        let mut objects = state.journaled.expect("the journaled table itself");
        let resent = 42 | fuse_wire::abi::UNIQUE_RESEND;
        assert_eq!(objects.take_replayed_reply(resent), Some(open_out));
    }
}
