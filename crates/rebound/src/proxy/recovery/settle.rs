//! What the failed driver left unanswered, request by request: repeated when that is safe,
//! otherwise settled first by asking the new driver whether the change already happened (a
//! CREATE whose file exists is answered as created, an UNLINK whose name is gone as done, a
//! RENAME by where the names lead now), so that no change is made twice.
//!
//! Also what a superseded restore took and left waiting for nobody ([`hand_on_strays`]).
//!
//! Owns: the decision per request, and its answer when the request is settled. Must not: hold
//! the object table's lock across a request to the driver.

use std::io;
use std::time::{Duration, Instant};

use fuse_wire::ids::getattr_request;
use fuse_wire::{Opcode, ReplyShape, Request};
use rustix::io::Errno;
use tracker::{Inflight, PendingChange};
use zerocopy::{FromBytes, IntoBytes};

use super::{describe, reopen_flags, resolve, NewDriver};
use crate::proxy::{
    answer_in_drivers_place, answer_ok, answer_with, lock, Link, Shared, POISON_FAILURES,
};

/// Settles, with the serving driver, those of the requests `taken` by the restore of driver
/// `generation` that wait for nobody: the restore was superseded (the supervisor replaced its
/// driver) after it took them, and the later driver's restore took what was in the table
/// before they were put back or sent to the replaced driver. A later restore still under way
/// takes them itself; the restore's own driver serving, nothing is astray.
pub(super) fn hand_on_strays(shared: &Shared, generation: u64, timeout: Duration, taken: &[u64]) {
    loop {
        let link = shared.link();
        let (driver, serving) = match &*link {
            Link::Serving {
                driver,
                generation: serving,
            } if *serving != generation => (driver.clone(), *serving),
            _ => return,
        };
        let strays = shared.inflight.take_named_not_sent_to(taken, serving);
        drop(link);
        if strays.is_empty() {
            return;
        }
        tracing::info!(
            "{} request(s) taken by the restore of driver {generation} go to driver {serving}",
            strays.len()
        );
        let init_reply = std::cell::OnceCell::new();
        if let Some(body) = lock(&shared.restored_init_reply).clone() {
            let _ = init_reply.set(body);
        }
        let new = NewDriver {
            init_reply,
            shared,
            driver: &driver,
            generation: serving,
            timeout,
            direct: false,
        };
        let Err(e) = new.settle_all(strays) else {
            return;
        };
        tracing::debug!("driver {serving} failed while they were settled: {e}");
        let link = shared.link();
        if matches!(&*link, Link::Serving { generation: g, .. } if *g == serving) {
            // It serves still (a lookup timed out): they count as sent to it, so that the
            // hang check finds them.
            shared
                .inflight
                .mark_named_sent(taken, serving, Instant::now());
            return;
        }
        // Another driver serves (they go to it), or a restore is under way (it takes them).
    }
}

impl NewDriver<'_> {
    /// Settles requests a failed driver left ([`NewDriver::settle`]). If the new driver fails
    /// too, those not settled go back in the table, as they were, for the next one.
    pub(super) fn settle_all(&self, requests: Vec<(u64, Inflight)>) -> io::Result<()> {
        let mut left = requests.into_iter();
        while let Some((unique, request)) = left.next() {
            if let Err(e) = self.settle(unique, request.clone()) {
                for (unique, request) in std::iter::once((unique, request)).chain(left) {
                    self.shared.inflight.insert(unique, request);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Deals with a request the failed driver left unanswered (or that waited for this one):
    /// answers it if the new driver's state shows it already happened, otherwise sends it.
    pub(super) fn settle(&self, unique: u64, mut request: Inflight) -> io::Result<()> {
        let queue = usize::from(request.queue);
        if request.sent.is_none() {
            self.send_again(unique, request);
            return Ok(());
        }
        request.failures += 1;
        if let Some((generation, sent)) = request.sent {
            tracing::debug!(
                "request {unique} ({}) was in flight at failure {} (sent to generation \
                 {generation} {:.1} ms before)",
                describe(&request),
                request.failures,
                sent.elapsed().as_secs_f64() * 1e3
            );
        }
        if request.failures >= POISON_FAILURES {
            tracing::warn!(
                "request {unique} ({}) was in flight at {} driver failures in a row; failing \
                 it with EIO",
                describe(&request),
                request.failures
            );
            answer_in_drivers_place(self.shared, unique, queue, Errno::IO);
            return Ok(());
        }
        let op = Opcode::from_raw(request.opcode);
        let shared = self.shared;
        match (op, &request.change) {
            // The handle went with the old driver.
            (Some(Opcode::Release | Opcode::Releasedir), _) => answer_ok(shared, unique, queue),
            (
                Some(Opcode::Mkdir | Opcode::Mknod | Opcode::Symlink | Opcode::Link),
                PendingChange::Entry { parent, name },
            ) => {
                let Some(dir) = self.dir(*parent)? else {
                    self.lost(unique, queue);
                    return Ok(());
                };
                match self.lookup(dir, name)? {
                    Some((_, mut entry)) => {
                        shared
                            .objects()
                            .on_success(unique, request.change.clone(), &mut entry);
                        answer_with(shared, unique, queue, &entry);
                    }
                    None => self.send_again(unique, request),
                }
            }
            (
                Some(Opcode::Create),
                PendingChange::Create {
                    parent,
                    name,
                    flags,
                },
            ) => {
                let Some(dir) = self.dir(*parent)? else {
                    self.lost(unique, queue);
                    return Ok(());
                };
                match self.lookup(dir, name)? {
                    Some((node, entry)) => match self.open(node, reopen_flags(*flags), false)? {
                        Some(open_out) => {
                            let mut reply = entry;
                            reply.extend_from_slice(&open_out);
                            shared
                                .objects()
                                .on_success(unique, request.change.clone(), &mut reply);
                            answer_with(shared, unique, queue, &reply);
                        }
                        None => {
                            self.drop_lookup(node);
                            self.send_again(unique, request);
                        }
                    },
                    None => self.send_again(unique, request),
                }
            }
            (Some(Opcode::Unlink | Opcode::Rmdir), PendingChange::Remove { parent, name }) => {
                let Some(dir) = self.dir(*parent)? else {
                    self.lost(unique, queue);
                    return Ok(());
                };
                match self.lookup(dir, name)? {
                    Some((node, _)) => {
                        self.drop_lookup(node);
                        self.send_again(unique, request);
                    }
                    None => {
                        shared
                            .objects()
                            .on_success(unique, request.change.clone(), &mut []);
                        answer_ok(shared, unique, queue);
                    }
                }
            }
            (
                Some(Opcode::Rename | Opcode::Rename2),
                PendingChange::Rename {
                    parent,
                    name,
                    new_parent,
                    new_name,
                    exchange,
                },
            ) => {
                let (Some(from), Some(to)) = (self.dir(*parent)?, self.dir(*new_parent)?) else {
                    self.lost(unique, queue);
                    return Ok(());
                };
                let source = self.lookup(from, name)?;
                let target = self.lookup(to, new_name)?;
                for (node, _) in source.iter().chain(target.iter()) {
                    self.drop_lookup(*node);
                }
                let happened = if *exchange {
                    // Both names exist either way: their files tell (see `exchanged`).
                    let before = {
                        let objects = shared.objects();
                        (
                            objects.ino_named(*parent, name),
                            objects.ino_named(*new_parent, new_name),
                        )
                    };
                    exchanged(before, (ino_of(&source), ino_of(&target)))
                } else if self.complete_half_rename(from, name, ino_of(&source), ino_of(&target))? {
                    Some(true)
                } else {
                    Some(source.is_none() && target.is_some())
                };
                match happened {
                    Some(true) => {
                        shared
                            .objects()
                            .on_success(unique, request.change.clone(), &mut []);
                        answer_ok(shared, unique, queue);
                    }
                    Some(false) => self.send_again(unique, request),
                    None => {
                        tracing::warn!(
                            "cannot tell whether the exchange of {:?} and {:?} happened before \
                             the driver failed (its inode numbers do not say): failing it",
                            String::from_utf8_lossy(name),
                            String::from_utf8_lossy(new_name)
                        );
                        self.lost(unique, queue);
                    }
                }
            }
            (Some(Opcode::Write), _) => match self.appended(&request)? {
                Some(size) => {
                    let written = fuse_wire::abi::WriteOut { size, padding: 0 };
                    answer_with(shared, unique, queue, written.as_bytes());
                }
                None => self.send_again(unique, request),
            },
            // Reads, writes at explicit offsets, attribute changes, opens, lookups: repeating
            // them gives what the first attempt would have.
            _ => self.send_again(unique, request),
        }
        Ok(())
    }

    /// For a write(2) through an `O_APPEND` handle that the file already holds, the size it
    /// wrote. Such a write lands at the end of the file whatever its offset says, so sending
    /// it again would append it twice; the kernel gave it the file's size as its offset, so
    /// a file that reaches past offset + size has it (one writer: the kernel's own).
    fn appended(&self, request: &Inflight) -> io::Result<Option<u32>> {
        let mut bytes = request.request.bytes().to_vec();
        request.request.patches.undo(&mut bytes);
        let Ok(req) = Request::parse(&bytes) else {
            return Ok(None);
        };
        let Ok((write, _)) = fuse_wire::abi::WriteIn::read_from_prefix(req.body) else {
            return Ok(None);
        };
        let append = rustix::fs::OFlags::APPEND.bits();
        if write.flags & append == 0 || write.write_flags & fuse_wire::abi::WRITE_CACHE != 0 {
            return Ok(None);
        }
        let Some(driver_node) = resolve(
            self.shared,
            self.driver,
            self.generation,
            req.header.nodeid,
            self.timeout,
        )?
        else {
            return Ok(None);
        };
        let attr = self
            .call(getattr_request(0, driver_node), ReplyShape::Attr)?
            .ok()
            .and_then(|body| {
                fuse_wire::abi::AttrOut::read_from_prefix(&body)
                    .ok()
                    .map(|(out, _)| out.attr.size)
            });
        let end = write.offset.saturating_add(u64::from(write.size));
        Ok(attr.filter(|&size| size >= end).map(|_| write.size))
    }
}

/// The inode number of a looked-up entry; 0 for none.
fn ino_of(found: &Option<(u64, Vec<u8>)>) -> u64 {
    found
        .as_ref()
        .map_or(0, |(_, entry)| tracker::objects::entry_ino(entry, 0))
}

/// Whether a RENAME_EXCHANGE of two entries whose files had inode numbers `before` (source,
/// target) happened, from the inode numbers the two names lead to `now`: `Some(true)` if they
/// are swapped, `Some(false)` if not, `None` if it cannot be told (a number unknown, or not
/// one of the two: the driver's inode numbers change across restarts, as libfuse's high-level
/// API's do without `use_ino`). Sending it again when it had happened would swap them back.
fn exchanged(before: (u64, u64), now: (u64, u64)) -> Option<bool> {
    let (source, target) = before;
    if source == 0 || target == 0 || source == target {
        return None;
    }
    if now == (target, source) {
        Some(true)
    } else if now == (source, target) {
        Some(false)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::exchanged;

    #[test]
    fn an_exchange_is_told_by_inode_numbers_or_not_at_all() {
        assert_eq!(exchanged((11, 12), (12, 11)), Some(true));
        assert_eq!(exchanged((11, 12), (11, 12)), Some(false));
        assert_eq!(exchanged((11, 12), (13, 14)), None);
        assert_eq!(exchanged((11, 12), (11, 11)), None);
        assert_eq!(exchanged((0, 12), (12, 0)), None);
        assert_eq!(exchanged((11, 11), (11, 11)), None);
    }
}
