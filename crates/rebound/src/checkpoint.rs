//! The image checkpoint (ODFT's device-state checkpoint): a copy-on-write clone of the file a
//! driver keeps its state in (fuse2fs's image), taken while the driver has flushed and nothing
//! is in flight, and cloned back over the image before a failed driver's successor starts. The
//! successor then finds the image exactly as consistent as it was at the checkpoint, with no
//! full-image check (`e2fsck -fy`), and the redo log brings it forward.
//!
//! Both clones are reflinks (`FICLONE`: XFS, btrfs): they share blocks instead of copying
//! them, so their cost follows the image's extents, not its size.
//!
//! Owns: the checkpoint file beside the image, and the order of clones and roll-backs. Must
//! not: talk to the driver (the proxy quiesces and flushes it before a checkpoint).

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A driver's image and its last checkpoint.
#[derive(Debug)]
pub struct ImageCheckpoint {
    image: PathBuf,
    checkpoint: PathBuf,
    /// How many roll-backs there have been: a checkpoint started before one must not land
    /// after it (it would record as durable what the roll-back just undid).
    rollbacks: Mutex<u64>,
}

impl ImageCheckpoint {
    /// Takes the first checkpoint, of the image as it is before any driver opened it. Fails
    /// with a one-line reason when the image's file system cannot clone files.
    pub fn new(image: &Path) -> Result<ImageCheckpoint, String> {
        let this = ImageCheckpoint::beside(image)?;
        clone_file(&this.image, &this.checkpoint).map_err(|e| {
            let _ = std::fs::remove_file(&this.checkpoint);
            let hint = if e.raw_os_error() == Some(libc::EOPNOTSUPP)
                || e.raw_os_error() == Some(libc::EXDEV)
                || e.raw_os_error() == Some(libc::EINVAL)
            {
                ": its file system cannot clone files; keep the image on XFS or btrfs, or \
                 leave `image` unset and repair it with pre_restart"
            } else {
                ""
            };
            format!(
                "image = {}: taking the first checkpoint: {e}{hint}",
                this.image.display()
            )
        })?;
        Ok(this)
    }

    /// The checkpoint a predecessor rebound left beside `image` (`rebound reload`), with the
    /// redo log it handed over: what a roll-back then replays from.
    pub fn adopt(image: &Path) -> Result<ImageCheckpoint, String> {
        let this = ImageCheckpoint::beside(image)?;
        if !this.checkpoint.is_file() {
            return Err(format!(
                "image = {}: no checkpoint at {} to take over",
                this.image.display(),
                this.checkpoint.display()
            ));
        }
        Ok(this)
    }

    /// The image and where its checkpoint lives (a hidden file beside it).
    fn beside(image: &Path) -> Result<ImageCheckpoint, String> {
        let image = std::path::absolute(image).map_err(|e| format!("image: {e}"))?;
        let name = image
            .file_name()
            .ok_or_else(|| format!("image = {}: not a file", image.display()))?;
        let mut hidden = std::ffi::OsString::from(".");
        hidden.push(name);
        hidden.push(".rebound-checkpoint");
        let checkpoint = image.with_file_name(hidden);
        Ok(ImageCheckpoint {
            image,
            checkpoint,
            rollbacks: Mutex::new(0),
        })
    }

    /// How many roll-backs there have been; pass it to [`ImageCheckpoint::take`].
    pub fn rollbacks(&self) -> u64 {
        *self.rollbacks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Clones the image into the checkpoint, unless a roll-back came since `rollbacks` was
    /// read, and then runs `covered` (dropping what the checkpoint holds from the redo log)
    /// before any roll-back can start. Returns how long the clone took, or `None` if skipped.
    pub fn take(&self, rollbacks: u64, covered: impl FnOnce()) -> io::Result<Option<Duration>> {
        let count = self.rollbacks.lock().unwrap_or_else(|e| e.into_inner());
        if *count != rollbacks {
            return Ok(None);
        }
        let started = Instant::now();
        clone_file(&self.image, &self.checkpoint)?;
        covered();
        drop(count);
        Ok(Some(started.elapsed()))
    }

    /// Clones the checkpoint back over the image (same file, so the driver's command line still
    /// names it). Only while no driver has the image open.
    pub fn roll_back(&self) -> io::Result<Duration> {
        let mut count = self.rollbacks.lock().unwrap_or_else(|e| e.into_inner());
        *count += 1;
        let started = Instant::now();
        clone_file(&self.checkpoint, &self.image)?;
        Ok(started.elapsed())
    }
}

impl Drop for ImageCheckpoint {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.checkpoint);
    }
}

/// Makes `to` share `from`'s blocks, with `from`'s length.
fn clone_file(from: &Path, to: &Path) -> io::Result<()> {
    let source = File::open(from)?;
    let target = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(to)?;
    rustix::fs::ioctl_ficlone(&target, &source)?;
    // A clone over a longer file leaves its tail.
    target.set_len(source.metadata()?.len())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_system_without_reflinks_is_named_in_one_line() {
        // /dev/shm is a tmpfs, which cannot clone files.
        let dir = tempdir_in("/dev/shm");
        let image = dir.join("disk.img");
        std::fs::write(&image, b"state").unwrap();
        let err = ImageCheckpoint::new(&image).unwrap_err();
        assert!(err.contains("cannot clone files"), "{err}");
        assert!(!err.contains('\n'));
        std::fs::remove_dir_all(dir).unwrap();
    }

    fn tempdir_in(parent: &str) -> PathBuf {
        let dir = Path::new(parent).join(format!("rebound-ckpt-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
