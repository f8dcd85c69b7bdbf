//! Host-wide settings rebound adjusts for its drivers when the first one starts serving the
//! kernel's queue (fast mode): the largest pipe an unprivileged process may make
//! (`fs.pipe-max-size`).
//!
//! Why: libfuse 3 reads each request with `splice(2)` into a pipe of its own when it can make
//! that pipe hold the largest request (256 pages of data and a page of headers; the kernel
//! rounds the size up to a power of two of pages: 2 MiB with 4 KiB pages). The host's default
//! limit is 1 MiB, and the driver in rebound's sandbox lacks `CAP_SYS_RESOURCE`, so it falls
//! back to `read(2)`. A `read(2)` copies the request into the driver's memory, faulting its
//! pages in as it goes; when the driver dies during that copy (a crash kills all its threads),
//! the fault fails and the kernel ends the request with `EIO` (`fuse_dev_do_read`): an
//! application error no recovery can take back. A splice copies into pages the kernel
//! allocates, so the request is read whole or stays in the queue, and fast mode's takeover
//! sends it again.
//!
//! Must not: lower a setting, or change one the configuration does not ask for.

use std::io;
use std::path::Path;

const PIPE_MAX_SIZE: &str = "/proc/sys/fs/pipe-max-size";

/// The pipe libfuse 3 asks for with pages of `page` bytes: 256 pages of data (its
/// `FUSE_MAX_MAX_PAGES`) and 4 KiB of headers, as the kernel rounds it (`round_pipe_size`).
fn fuse_pipe_bytes(page: u64) -> u64 {
    (256 * page + 4096).div_ceil(page).next_power_of_two() * page
}

/// Raises `fs.pipe-max-size` to [`fuse_pipe_bytes`] if it is lower, and logs what it did or
/// why it could not (a container's `/proc/sys` is often read-only).
pub fn widen_pipes() {
    let to = fuse_pipe_bytes(rustix::param::page_size() as u64);
    match raise(Path::new(PIPE_MAX_SIZE), to) {
        Ok(None) => {}
        Ok(Some(before)) => tracing::info!(
            "raised fs.pipe-max-size from {before} to {to} bytes, so that libfuse 3 drivers \
             read requests by splice (raise_pipe_max_size)"
        ),
        Err(e) => tracing::warn!(
            "cannot raise fs.pipe-max-size to {to} bytes ({e}): a libfuse 3 driver reads \
             requests with read(2), and one it is reading when it dies fails with EIO"
        ),
    }
}

/// Writes `to` into the setting at `path` if it holds less; returns the old value if it did.
fn raise(path: &Path, to: u64) -> io::Result<Option<u64>> {
    let text = std::fs::read_to_string(path)?;
    let now: u64 = text
        .trim()
        .parse()
        .map_err(|_| io::Error::other(format!("{} holds {:?}", path.display(), text.trim())))?;
    if now >= to {
        return Ok(None);
    }
    std::fs::write(path, format!("{to}\n"))?;
    Ok(Some(now))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in for the setting's file, removed when dropped.
    struct Setting(std::path::PathBuf);

    impl Drop for Setting {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn setting(name: &str, value: &str) -> Setting {
        let path = std::env::temp_dir().join(format!("rebound-{name}-{}", std::process::id()));
        std::fs::write(&path, value).unwrap();
        Setting(path)
    }

    #[test]
    fn the_pipe_is_what_libfuse_3_asks_for_rounded_as_the_kernel_does() {
        assert_eq!(fuse_pipe_bytes(4096), 2 << 20);
        assert_eq!(fuse_pipe_bytes(16 << 10), 8 << 20);
        assert_eq!(fuse_pipe_bytes(64 << 10), 32 << 20);
    }

    #[test]
    fn a_lower_limit_is_raised_and_its_old_value_returned() {
        let Setting(path) = &setting("lower", "1048576\n");
        assert_eq!(raise(path, 2 << 20).unwrap(), Some(1 << 20));
        assert_eq!(std::fs::read_to_string(path).unwrap(), "2097152\n");
    }

    #[test]
    fn a_limit_as_high_or_higher_is_left_alone() {
        for value in ["2097152\n", "4194304\n"] {
            let Setting(path) = &setting("higher", value);
            assert_eq!(raise(path, 2 << 20).unwrap(), None);
            assert_eq!(std::fs::read_to_string(path).unwrap(), value);
        }
    }

    #[test]
    fn a_setting_that_is_not_a_number_is_an_error_naming_it() {
        let Setting(path) = &setting("nan", "lots\n");
        let e = raise(path, 2 << 20).unwrap_err().to_string();
        assert!(
            e.contains(&*path.to_string_lossy()) && e.contains("lots"),
            "{e}"
        );
    }
}
