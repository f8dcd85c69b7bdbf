//! Shared mappings of BPF maps' memory (`mmap(2)` of a map's descriptor): the ring buffer's
//! pages for [`crate::bpf_ring`], and arrays created with `BPF_F_MMAPABLE`, which a BPF program
//! updates and user space reads without a system call per element ([`SharedArray`]).
//!
//! Owns: the mappings, their bounds and alignment. Must not: interpret what is mapped.

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::mm::{mmap, munmap, MapFlags, ProtFlags};

/// A shared mapping of part of a BPF map, unmapped when dropped.
pub(crate) struct Mapping {
    at: *mut std::ffi::c_void,
    len: usize,
}

impl Mapping {
    pub(crate) fn new(
        map: BorrowedFd<'_>,
        len: usize,
        offset: u64,
        prot: ProtFlags,
    ) -> std::io::Result<Self> {
        // SAFETY: a new shared mapping of the map's own pages, placed by the kernel (no address
        // given, so nothing of this process is replaced), with the protection the caller asks
        // and the kernel allows for those pages.
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
    pub(crate) fn word<T>(&self, offset: usize) -> &T {
        assert!(offset + std::mem::size_of::<T>() <= self.len && offset.is_multiple_of(8));
        // SAFETY: in bounds (asserted) of a live mapping, aligned (the mapping is
        // page-aligned and the offset 8-aligned); `T` is an atomic the kernel also uses
        // atomically.
        unsafe { &*(self.at.cast::<u8>().add(offset).cast::<T>()) }
    }

    pub(crate) fn bytes(&self, offset: usize, len: usize) -> &[u8] {
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

/// A read-only view of a `BPF_F_MMAPABLE` array map, as 64-bit words (its elements laid end to
/// end, each rounded up to 8 bytes, as the kernel lays them out).
pub struct SharedArray {
    mapping: Mapping,
}

// SAFETY: the mapping is only read, through atomic loads, and stays valid until the value is
// dropped, whichever thread holds or drops it.
unsafe impl Send for SharedArray {}
// SAFETY: as above: concurrent reads are atomic loads.
unsafe impl Sync for SharedArray {}

impl SharedArray {
    /// Maps the first `bytes` bytes (a multiple of the page size) of the array `map`.
    pub fn map(map: BorrowedFd<'_>, bytes: usize) -> std::io::Result<SharedArray> {
        if bytes == 0 || !bytes.is_multiple_of(rustix::param::page_size()) {
            return Err(std::io::Error::other(format!(
                "mapping {bytes} bytes of an array"
            )));
        }
        // The mapping holds the map: its descriptor may be closed once this returns.
        Ok(SharedArray {
            mapping: Mapping::new(map, bytes, 0, ProtFlags::READ)?,
        })
    }

    /// Word `index` (within the bytes mapped: checked), as a BPF program last stored it.
    pub fn word(&self, index: usize) -> u64 {
        self.mapping
            .word::<AtomicU64>(index * 8)
            .load(Ordering::Acquire)
    }
}
