//! A standby successor brought forward before any failure: the redo log's changes replayed
//! in it through its own channel, which no reader thread of the proxy's reads (see
//! `checkpoints::follow`), so that replies are read here, one exchange at a time.
//!
//! Owns: the exchange with that channel. Must not: decide what is replayed or when.

use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fuse_wire::ids::read_u64;
use rustix::net::SendFlags;

use super::replay::log_skipped;
use super::{NewDriver, Shared};

/// A standby successor given the redo log's changes as they come, through its `channel`,
/// which no other thread reads. Each batch is a replay of its own (its lookups given back and
/// its files closed at its end), so that the standby holds nothing of rebound's when it is
/// handed over.
pub(in crate::proxy) struct Follower {
    channel: Arc<OwnedFd>,
}

impl Follower {
    pub(in crate::proxy) fn new(channel: OwnedFd) -> Follower {
        Follower {
            channel: Arc::new(channel),
        }
    }

    /// Applies `entries`, the next of the log (see `tracker::RedoLog::lacking`), or the first
    /// of them until `stop` is set; logs what could not be applied, and returns how many were
    /// replayed or skipped (the standby lacks the rest).
    pub(in crate::proxy) fn give(
        &mut self,
        shared: &Shared,
        timeout: Duration,
        entries: &[tracker::Mutation],
        stop: &AtomicBool,
    ) -> io::Result<usize> {
        let new = NewDriver {
            init_reply: std::cell::OnceCell::new(),
            shared,
            driver: &self.channel,
            generation: 0,
            timeout,
            direct: true,
        };
        let (applied, skipped) = new.replay_until(entries, || stop.load(Ordering::Relaxed))?;
        log_skipped(&skipped);
        Ok(applied + skipped.len())
    }
}

/// Sends `requests` (each with its unique) on `channel` and reads their replies from it, in
/// the order of the requests, at most `timeout` in all.
pub(super) fn call_directly(
    channel: &OwnedFd,
    requests: &[(u64, Vec<u8>)],
    timeout: Duration,
) -> io::Result<Vec<Vec<u8>>> {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let deadline = Instant::now() + timeout;
    for (_, request) in requests {
        rustix::net::send(channel, request, SendFlags::NOSIGNAL)?;
    }
    let mut replies: std::collections::HashMap<u64, Vec<u8>> = Default::default();
    let mut buffer = vec![0u8; 64 << 10];
    while replies.len() < requests.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        let left = Timespec::try_from(left).map_err(io::Error::other)?;
        let mut fds = [PollFd::new(channel, PollFlags::IN)];
        if poll(&mut fds, Some(&left))? == 0 {
            return Err(io::ErrorKind::TimedOut.into());
        }
        let (len, _) = rustix::net::recv(channel, &mut buffer, rustix::net::RecvFlags::DONTWAIT)?;
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the driver closed its channel",
            ));
        }
        let reply = &buffer[..len.min(buffer.len())];
        let unique = read_u64(reply, std::mem::offset_of!(fuse_wire::OutHeader, unique));
        if let Some(unique) = unique.filter(|u| requests.iter().any(|(r, _)| r == u)) {
            replies.insert(unique, reply.to_vec());
        }
    }
    Ok(requests
        .iter()
        .map(|(unique, _)| replies.remove(unique).unwrap_or_default())
        .collect())
}
