//! The image checkpoint (ODFT's device-state checkpoint): a copy-on-write clone of the file a
//! driver keeps its state in (fuse2fs's image), taken while the driver has flushed and nothing
//! is in flight, and cloned back over the image before a failed driver's successor starts. The
//! successor then finds the image exactly as consistent as it was at the checkpoint, with no
//! full-image check (`e2fsck -fy`), and the redo log brings it forward.
//!
//! Both clones are reflinks (`FICLONE`: XFS, btrfs): they share blocks instead of copying
//! them, so their cost follows the image's extents, not its size.
//!
//! Checkpoints are numbered as the redo log counts them (`RedoLog::checkpoints`), each in a
//! file of its own beside the image, `.NAME.rebound-checkpoint.N`: a clone cut short (XFS
//! stops a reflink at a fatal signal, and rebound may be SIGKILLed at any moment) or made but
//! not yet recorded in the redo log is never the one rolled back to. The one before the latest
//! is kept too, for a successor whose hand-over was taken just before the latest.
//!
//! A *spare* is one more clone of the current checkpoint, `.NAME.rebound-spare`, for a standby
//! successor to open and initialise on before any failure: at a failure it is renamed over
//! the image, which a roll-back then need not touch (see `supervisor::standby`).
//!
//! Owns: the checkpoint and spare files beside the image, and the order of clones, roll-backs
//! and swaps. Must not: talk to the driver (the proxy quiesces and flushes it before a
//! checkpoint).

use std::ffi::{OsStr, OsString};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A driver's image and its checkpoints.
#[derive(Debug)]
pub struct ImageCheckpoint {
    image: PathBuf,
    /// `.NAME.rebound-checkpoint.` beside the image: checkpoint N is this followed by N.
    prefix: PathBuf,
    /// `.NAME.rebound-spare` beside the image.
    spare: PathBuf,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// How many roll-backs there have been: a checkpoint started before one must not land
    /// after it (it would record as durable what the roll-back just undid).
    rollbacks: u64,
    /// The number of the checkpoint a roll-back goes back to.
    current: u64,
    /// Where the next compaction of the image starts (see [`ImageCheckpoint::take`]).
    compact_at: u64,
}

/// A clone slower than this compacts a part of the image after it: the image's extents
/// multiply under copy-on-write (each write after a clone gets blocks of its own), and a
/// clone's cost follows them (300 checkpoints with 64 random 4 KiB writes between each: 25,933
/// extents, a 0.9 s clone, on this machine's XFS).
const COMPACT_AFTER: Duration = Duration::from_millis(8);
/// How much of the image one compaction rewrites.
const COMPACT_CHUNK: u64 = 8 << 20;

impl ImageCheckpoint {
    /// Takes the first checkpoint (number 0), of the image as it is before any driver opened
    /// it. Fails with a one-line reason when the image's file system cannot clone files.
    pub fn new(image: &Path) -> Result<ImageCheckpoint, String> {
        let this = ImageCheckpoint::beside(image)?;
        this.remove_all_but(&[]);
        clone_file(&this.image, &this.file(0)).map_err(|e| {
            this.remove_all_but(&[]);
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

    /// The checkpoints a predecessor rebound left beside `image` (`rebound reload`, or its
    /// death). Which one the redo log it handed over follows is known only once the hand-over
    /// is read: see [`ImageCheckpoint::follow`].
    pub fn adopt(image: &Path) -> Result<ImageCheckpoint, String> {
        let this = ImageCheckpoint::beside(image)?;
        // Its standby's spare died with it.
        this.remove_spare();
        // A predecessor from before checkpoints were numbered kept one file, unnumbered, and
        // handed over a redo log that counts none: it is checkpoint 0.
        let prefix = this.prefix.as_os_str().as_bytes();
        let unnumbered = Path::new(OsStr::from_bytes(&prefix[..prefix.len() - 1]));
        if this.numbers().is_empty() && unnumbered.is_file() {
            let _ = std::fs::rename(unnumbered, this.file(0));
        }
        if this.numbers().is_empty() {
            return Err(format!(
                "image = {}: no checkpoint beside it ({}N) to take over",
                this.image.display(),
                this.prefix.display()
            ));
        }
        Ok(this)
    }

    /// The adopted redo log follows checkpoint `number`: roll-backs go back to it, and the
    /// other files (a clone cut short, or one its log never recorded) are removed.
    pub fn follow(&self, number: u64) -> io::Result<()> {
        if !self.file(number).is_file() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "the redo log follows image checkpoint {number}, which is not at {}",
                    self.file(number).display()
                ),
            ));
        }
        self.lock().current = number;
        self.remove_all_but(&[number]);
        Ok(())
    }

    fn beside(image: &Path) -> Result<ImageCheckpoint, String> {
        let image = std::path::absolute(image).map_err(|e| format!("image: {e}"))?;
        let name = image
            .file_name()
            .ok_or_else(|| format!("image = {}: not a file", image.display()))?;
        let mut hidden = OsString::from(".");
        hidden.push(name);
        let mut spare = hidden.clone();
        hidden.push(".rebound-checkpoint.");
        spare.push(".rebound-spare");
        let prefix = image.with_file_name(hidden);
        let spare = image.with_file_name(spare);
        Ok(ImageCheckpoint {
            image,
            prefix,
            spare,
            state: Mutex::new(State::default()),
        })
    }

    /// The image's path.
    pub fn image(&self) -> &Path {
        &self.image
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn file(&self, number: u64) -> PathBuf {
        let mut path = self.prefix.clone().into_os_string();
        path.push(number.to_string());
        PathBuf::from(path)
    }

    /// The numbers of the checkpoint files beside the image.
    fn numbers(&self) -> Vec<u64> {
        let (Some(dir), Some(prefix)) = (self.prefix.parent(), self.prefix.file_name()) else {
            return Vec::new();
        };
        let prefix = prefix.to_string_lossy();
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| {
                let name = entry.file_name();
                name.to_str()?.strip_prefix(prefix.as_ref())?.parse().ok()
            })
            .collect()
    }

    fn remove_all_but(&self, kept: &[u64]) {
        for number in self.numbers() {
            if !kept.contains(&number) {
                let _ = std::fs::remove_file(self.file(number));
            }
        }
    }

    /// How many roll-backs there have been; pass it to [`ImageCheckpoint::take`].
    pub fn rollbacks(&self) -> u64 {
        self.lock().rollbacks
    }

    /// Clones the image into checkpoint `number`, unless a roll-back came since `rollbacks`
    /// was read, and then runs `covered` (dropping what the checkpoint holds from the redo
    /// log, which then counts `number` checkpoints) before any roll-back can start. Returns
    /// how long the clone took, or `None` if skipped.
    pub fn take(
        &self,
        rollbacks: u64,
        number: u64,
        covered: impl FnOnce(),
    ) -> io::Result<Option<Duration>> {
        let mut state = self.lock();
        if state.rollbacks != rollbacks {
            return Ok(None);
        }
        let started = Instant::now();
        if let Err(e) = clone_file(&self.image, &self.file(number)) {
            let _ = std::fs::remove_file(self.file(number));
            return Err(e);
        }
        covered();
        let previous = std::mem::replace(&mut state.current, number);
        self.remove_all_but(&[previous, number]);
        let took = started.elapsed();
        if took > COMPACT_AFTER {
            // (The checkpoint stands whether or not this works.)
            match compact(&self.image, state.compact_at, COMPACT_CHUNK) {
                Ok(next) => state.compact_at = next,
                Err(e) => tracing::warn!("compacting {}: {e}", self.image.display()),
            }
        }
        Ok(Some(took))
    }

    /// Makes the spare, a new clone of the current checkpoint, and returns that checkpoint's
    /// number. `retain` runs with that number before any later checkpoint can be taken (the
    /// redo log keeps from then on what checkpoints cover: the spare lacks it).
    pub fn make_spare(&self, retain: impl FnOnce(u64)) -> io::Result<(u64, PathBuf)> {
        let (number, source) = {
            let state = self.lock();
            // Open now: the file may be removed by the checkpoint after next, not its blocks.
            let source = File::open(self.file(state.current))?;
            retain(state.current);
            (state.current, source)
        };
        // A new file: a standby killed on the last one may still hold it open.
        self.remove_spare();
        if let Err(e) = clone_from(&source, &self.spare) {
            self.remove_spare();
            return Err(e);
        }
        Ok((number, self.spare.clone()))
    }

    /// The spare's device and inode numbers, if there is one.
    pub fn spare_file_id(&self) -> Option<(u64, u64)> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(&self.spare).ok()?;
        Some((meta.dev(), meta.ino()))
    }

    /// Removes the spare, if any.
    pub fn remove_spare(&self) {
        let _ = std::fs::remove_file(&self.spare);
    }

    /// Renames the spare over the image: a standby that opened it takes over, and the image
    /// is from now on the file it writes. Like a roll-back, a checkpoint started before this
    /// does not land.
    pub fn swap_in_spare(&self) -> io::Result<Duration> {
        let mut state = self.lock();
        state.rollbacks += 1;
        let started = Instant::now();
        std::fs::rename(&self.spare, &self.image)?;
        Ok(started.elapsed())
    }

    /// Clones the current checkpoint back over the image (same file, so the driver's command
    /// line still names it). Only while no driver has the image open.
    pub fn roll_back(&self) -> io::Result<Duration> {
        let mut state = self.lock();
        state.rollbacks += 1;
        let started = Instant::now();
        clone_file(&self.file(state.current), &self.image)?;
        Ok(started.elapsed())
    }
}

impl Drop for ImageCheckpoint {
    fn drop(&mut self) {
        self.remove_all_but(&[]);
        self.remove_spare();
    }
}

/// Rewrites `len` bytes of `image` from `at` (from its start past its end) with what they hold,
/// in one write, and waits for them to reach the disk: the range then lies in one extent, or
/// a few, instead of one per write since the last clone. Returns where the next compaction
/// starts. Only while no driver writes the image (the checkpoint's gate holds its requests):
/// read, then written back, a write in between would be undone. The bytes are the same, so a
/// rewrite cut short by a crash leaves the image as it was.
fn compact(image: &Path, at: u64, len: u64) -> io::Result<u64> {
    use std::os::unix::fs::FileExt;
    let file = OpenOptions::new().read(true).write(true).open(image)?;
    let size = file.metadata()?.len();
    let at = if at >= size { 0 } else { at };
    let mut bytes = vec![0u8; len.min(size - at) as usize];
    file.read_exact_at(&mut bytes, at)?;
    file.write_all_at(&bytes, at)?;
    file.sync_data()?;
    Ok(at + bytes.len() as u64)
}

/// Makes `to` share `from`'s blocks, with `from`'s length.
fn clone_file(from: &Path, to: &Path) -> io::Result<()> {
    clone_from(&File::open(from)?, to)
}

/// Makes `to` share the blocks of the open file `source`, with its length.
fn clone_from(source: &File, to: &Path) -> io::Result<()> {
    let target = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(to)?;
    rustix::fs::ioctl_ficlone(&target, source)?;
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

    #[test]
    fn a_successor_follows_the_checkpoint_its_redo_log_names_and_removes_the_others() {
        // As rebound's death leaves them: checkpoint 3, the one before it, and 4, a clone
        // that was cut short or never recorded in the redo log.
        let dir = tempdir_in("/dev/shm");
        let image = dir.join("disk.img");
        std::fs::write(&image, b"state").unwrap();
        for number in [2, 3, 4] {
            std::fs::write(
                dir.join(format!(".disk.img.rebound-checkpoint.{number}")),
                b"",
            )
            .unwrap();
        }
        std::fs::write(dir.join(".disk.img.rebound-checkpoint.x"), b"").unwrap();
        let adopted = ImageCheckpoint::adopt(&image).unwrap();
        assert!(adopted.follow(5).is_err(), "a checkpoint that is not there");
        adopted.follow(3).unwrap();
        let mut left = adopted.numbers();
        left.sort_unstable();
        assert_eq!(left, vec![3]);
        assert_eq!(adopted.lock().current, 3);
        drop(adopted);
        assert!(ImageCheckpoint::adopt(&image)
            .unwrap_err()
            .contains("no checkpoint"));
        assert!(
            dir.join(".disk.img.rebound-checkpoint.x").exists(),
            "not a checkpoint's name"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_unnumbered_checkpoint_of_an_older_predecessor_is_checkpoint_0() {
        let dir = tempdir_in("/dev/shm");
        let image = dir.join("disk.img");
        std::fs::write(&image, b"state").unwrap();
        std::fs::write(dir.join(".disk.img.rebound-checkpoint"), b"then").unwrap();
        let adopted = ImageCheckpoint::adopt(&image).unwrap();
        adopted.follow(0).unwrap();
        assert_eq!(std::fs::read(adopted.file(0)).unwrap(), b"then");
        drop(adopted);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn compaction_keeps_the_image_and_goes_round_it() {
        let dir = tempdir_in("/tmp");
        let image = dir.join("disk.img");
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&image, &bytes).unwrap();
        assert_eq!(compact(&image, 0, 4096).unwrap(), 4096);
        assert_eq!(
            compact(&image, 8192, 4096).unwrap(),
            10_000,
            "cut at the end"
        );
        assert_eq!(compact(&image, 10_000, 4096).unwrap(), 4096, "round again");
        assert_eq!(std::fs::read(&image).unwrap(), bytes);
        std::fs::remove_dir_all(dir).unwrap();
    }

    fn tempdir_in(parent: &str) -> PathBuf {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = Path::new(parent).join(format!("rebound-ckpt-test-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
