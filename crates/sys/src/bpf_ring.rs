//! Reading what is left in a BPF ring buffer whose reader died (a pinned observer's, see
//! `rebound_observe::drain_pinned`), as the kernel lays it out (`kernel/bpf/ringbuf.c`).
//!
//! aya's reader cannot: it takes the producer's position to be 0 until it has read a record,
//! so on a ring whose consumer has moved on it reads stale bytes as records without end (aya
//! 0.13.1, `ProducerData::pos_cache`).
//!
//! Owns: the two mappings and the positions. Must not: parse records (the caller does).

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use rustix::mm::{mmap, munmap, MapFlags, ProtFlags};

/// `BPF_RINGBUF_HDR_SZ`: a record's length word (with the two bits below) and page offset.
const HEADER: usize = 8;
const BUSY: u32 = 1 << 31;
const DISCARD: u32 = 1 << 30;

/// A shared mapping of part of the ring map, unmapped when dropped.
struct Mapping {
    at: *mut std::ffi::c_void,
    len: usize,
}

impl Mapping {
    fn new(map: BorrowedFd<'_>, len: usize, offset: u64, prot: ProtFlags) -> std::io::Result<Self> {
        // SAFETY: a new shared mapping of the ring map's own pages, placed by the kernel (no
        // address given, so nothing of this process is replaced); the kernel allows the
        // consumer page read-write and the rest read-only, as asked.
        let at = unsafe {
            mmap(
                std::ptr::null_mut(),
                len,
                prot,
                MapFlags::SHARED,
                map,
                offset,
            )?
        };
        Ok(Mapping { at, len })
    }

    /// The 8-aligned word at `offset`, which the kernel updates atomically.
    fn word<T>(&self, offset: usize) -> &T {
        assert!(offset + std::mem::size_of::<T>() <= self.len && offset.is_multiple_of(8));
        // SAFETY: in bounds (asserted) of a live mapping, aligned (the mapping is
        // page-aligned and the offset 8-aligned); `T` is an atomic the kernel also uses
        // atomically.
        unsafe { &*(self.at.cast::<u8>().add(offset).cast::<T>()) }
    }

    fn bytes(&self, offset: usize, len: usize) -> &[u8] {
        assert!(offset + len <= self.len);
        // SAFETY: in bounds (asserted) of a live mapping, read only while `self` lives.
        unsafe { std::slice::from_raw_parts(self.at.cast::<u8>().add(offset), len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped by `new` with this length; no reference into it outlives `self`.
        let _ = unsafe { munmap(self.at, self.len) };
    }
}

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
