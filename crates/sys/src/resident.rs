//! Memory the kernel can write into without a page fault: the buffers rebound reads
//! `/dev/fuse` into.
//!
//! Why: the kernel copies a request into the reader's buffer after taking it off its queue,
//! pinning the buffer's pages as it goes. Pages that are present and writable are pinned
//! without a lock or a fault; any other page takes the slow path, which gives up if the reader
//! has a SIGKILL pending (rebound killed, or its other threads killed by its own `execve` at a
//! reload). The copy then fails, and the kernel ends the request with `EIO`, which the
//! application sees. A [`ResidentBuffer`] is left out of `fork(2)` (`MADV_DONTFORK`) before
//! its pages are made present, so no fork can write-protect them for copy-on-write either.
//! What can still move a page (swap, migration, NUMA balancing, KSM) is outside its reach.
//!
//! Owns: the mapping. Must not: know what is read into it.

use std::io;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use rustix::mm::{madvise, mmap_anonymous, munmap, Advice, MapFlags, ProtFlags};

/// A private anonymous mapping of `len` bytes, left out of children, of which the first
/// `present` bytes are present and writable from the start; zeroed when made, unmapped when
/// dropped.
pub struct ResidentBuffer {
    at: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns its mapping as a `Vec` owns its allocation; access goes through
// `&`/`&mut` borrows of the slice, so the usual aliasing rules make sharing and sending safe.
unsafe impl Send for ResidentBuffer {}
// SAFETY: as above; `&ResidentBuffer` only gives out `&[u8]`.
unsafe impl Sync for ResidentBuffer {}

impl ResidentBuffer {
    pub fn new(len: usize, present: usize) -> io::Result<Self> {
        let len = len.max(1);
        // SAFETY: a new private anonymous mapping placed by the kernel (no address given, so
        // nothing of this process is replaced).
        let at = unsafe {
            mmap_anonymous(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        }?;
        let Some(start) = NonNull::new(at.cast::<u8>()) else {
            return Err(io::Error::other("mmap returned null"));
        };
        // Owned from here, so an error below unmaps it.
        let mut buffer = ResidentBuffer { at: start, len };
        // SAFETY: the range is exactly the mapping just made, which nothing else refers to; a
        // child that is not given it never touches it (rebound's children only set up their
        // confinement, in `spawn` and `sandbox`, and exec or exit).
        unsafe { madvise(at, len, Advice::LinuxDontFork) }?;
        let present = present.min(len);
        // SAFETY: part of the mapping just made; populating it changes no contents (the pages
        // are zero-filled either way).
        match unsafe { madvise(at, present, Advice::LinuxPopulateWrite) } {
            Ok(()) => {}
            // Before Linux 5.14: a write to each page makes it present just as well.
            Err(rustix::io::Errno::INVAL) => {
                for page in buffer[..present].chunks_mut(rustix::param::page_size()) {
                    page[0] = 0;
                }
            }
            Err(e) => return Err(e.into()),
        }
        Ok(buffer)
    }
}

impl Deref for ResidentBuffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `at` is the start of a live mapping of `len` readable bytes, initialised (an
        // anonymous mapping is zero-filled), owned by `self` for the borrow's lifetime.
        unsafe { std::slice::from_raw_parts(self.at.as_ptr(), self.len) }
    }
}

impl DerefMut for ResidentBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and the mapping is writable; `&mut self` makes this borrow
        // the only one.
        unsafe { std::slice::from_raw_parts_mut(self.at.as_ptr(), self.len) }
    }
}

impl Drop for ResidentBuffer {
    fn drop(&mut self) {
        // SAFETY: the mapping is this buffer's alone, and no borrow of it outlives `self`.
        let _ = unsafe { munmap(self.at.as_ptr().cast(), self.len) };
    }
}

impl std::fmt::Debug for ResidentBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ResidentBuffer({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::ResidentBuffer;

    /// The `/proc/self/smaps` entry of the mapping that starts at `at`.
    fn smaps_entry(at: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let start = format!("{at:x}-");
        let mut entry = String::new();
        let mut inside = false;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if first.contains('-') && !first.ends_with(':') {
                inside = line.starts_with(&start);
            }
            if inside {
                entry.push_str(line);
                entry.push('\n');
            }
        }
        entry
    }

    #[test]
    fn the_present_part_is_resident_and_the_whole_left_out_of_children() {
        let len = (1 << 20) + 64 * 1024;
        let mut buffer = ResidentBuffer::new(len + (1 << 20), len).unwrap();
        let entry = smaps_entry(buffer.as_ptr() as usize);
        let rss_kb = entry
            .lines()
            .find_map(|l| l.strip_prefix("Rss:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok());
        assert_eq!(rss_kb, Some(len / 1024), "{entry}");
        let flags = entry
            .lines()
            .find_map(|l| l.strip_prefix("VmFlags:"))
            .unwrap_or("");
        assert!(flags.split_whitespace().any(|f| f == "dc"), "{entry}");
        assert!(buffer[..len].iter().all(|&b| b == 0));
        buffer[len - 1] = 7;
        assert_eq!(buffer[len - 1], 7);
    }
}
