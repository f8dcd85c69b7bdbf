//! Reading what is left in a BPF ring buffer whose reader died (a pinned observer's, see
//! `rebound_observe::drain_pinned`), as the kernel lays it out (`kernel/bpf/ringbuf.c`).
//!
//! aya's reader cannot: it takes the producer's position to be 0 until it has read a record,
//! so on a ring whose consumer has moved on it reads stale bytes as records without end (aya
//! 0.13.1, `ProducerData::pos_cache`).
//!
//! Owns: the positions. Must not: parse records (the caller does).

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use rustix::mm::ProtFlags;

use crate::bpf_map::Mapping;

/// `BPF_RINGBUF_HDR_SZ`: a record's length word (with the two bits below) and page offset.
const HEADER: usize = 8;
const BUSY: u32 = 1 << 31;
const DISCARD: u32 = 1 << 30;

/// Passes each record of the ring `map` (of `size` data bytes, a power of two) that is
/// committed and not yet consumed to `each`, oldest first, and moves the consumer past them.
pub fn drain(map: BorrowedFd<'_>, size: usize, mut each: impl FnMut(&[u8])) -> std::io::Result<()> {
    if !size.is_power_of_two() {
        return Err(std::io::Error::other(format!("a ring of {size} bytes")));
    }
    let page = rustix::param::page_size();
    let consumer = Mapping::new(map, page, 0, ProtFlags::READ | ProtFlags::WRITE)?;
    // The producer's page, then the data pages twice in a row: a record that wraps reads whole.
    let producer = Mapping::new(map, page + 2 * size, page as u64, ProtFlags::READ)?;
    let consumer_pos: &AtomicU64 = consumer.word(0);
    let end = producer.word::<AtomicU64>(0).load(Ordering::Acquire);
    let mut pos = consumer_pos.load(Ordering::Acquire);
    while pos < end {
        let offset = page + (pos as usize & (size - 1));
        let header = producer.word::<AtomicU32>(offset).load(Ordering::Acquire);
        let len = (header & !(BUSY | DISCARD)) as usize;
        if header & BUSY != 0 || len > size {
            break;
        }
        if header & DISCARD == 0 {
            each(producer.bytes(offset + HEADER, len));
        }
        pos += ((HEADER + len + 7) & !7) as u64;
    }
    consumer_pos.store(pos, Ordering::Release);
    Ok(())
}
