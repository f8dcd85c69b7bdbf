//! Files a failed driver left behind for itself to delete. libfuse's high-level API does not
//! unlink a file that is still open: it renames it `.fuse_hidden<node><counter>` and deletes
//! it at the last RELEASE. A driver killed in between never does, and its successor, whose
//! node ids and counter start again from the same values, finds those names taken: after ten
//! it answers the next UNLINK of an open file with `EBUSY`.
//!
//! So after a restart, rebound lists the directories where names were removed since the last
//! restart (the last 16) and deletes what is hidden there. No kernel handle can reach such a file any more: one unlinked
//! while open has no name rebound could reopen it by.
//!
//! Owns: finding and removing the leftovers. Must not: touch any other name.

use std::io;

use fuse_wire::abi::{dirent_align, Dirent};
use fuse_wire::ids::{read_u64, readdir_request, unlink_request};
use fuse_wire::ReplyShape;
use zerocopy::FromBytes;

use super::replay::Walker;
use super::NewDriver;

/// The prefix of libfuse's hidden names.
const HIDDEN: &[u8] = b".fuse_hidden";
/// At most this many are deleted in one recovery (the rest in the next ones): a recovery must
/// stay short, or failures as frequent as it is long would stop all progress.
pub(super) const MAX_REMOVED: usize = 256;
/// How much of a directory one READDIR asks for.
const LISTING_SIZE: u32 = 64 * 1024;
/// A directory is listed at most this far (a directory this large rarely has hidden files
/// beyond what fits, and a recovery must stay short).
const MAX_LISTINGS: usize = 64;

impl NewDriver<'_> {
    /// Deletes the hidden files in the kernel's directories `dirs`. Returns how many.
    pub(super) fn remove_leftovers(&self, dirs: &[u64]) -> io::Result<usize> {
        let mut walker = Walker::default();
        let mut removed = 0;
        for &dir in dirs {
            if removed >= MAX_REMOVED {
                break;
            }
            let path: Option<Vec<Box<[u8]>>> = self
                .shared
                .objects()
                .path(dir)
                .map(|path| path.into_iter().map(Box::from).collect());
            let Some(path) = path else { continue };
            let Some((node, _)) = self.walk(&mut walker, &path)? else {
                continue;
            };
            for name in self
                .hidden_names(node)?
                .into_iter()
                .take(MAX_REMOVED - removed)
            {
                if let Ok(Ok(_)) = self.call(unlink_request(0, node, &name), ReplyShape::Empty) {
                    removed += 1;
                }
            }
        }
        self.forget_lookups(walker);
        if removed > 0 {
            tracing::info!("removed {removed} hidden files a failed driver left behind");
        }
        Ok(removed)
    }

    /// The hidden names in the driver's directory `node`.
    fn hidden_names(&self, node: u64) -> io::Result<Vec<Vec<u8>>> {
        let Some(open_out) = self.open(node, 0, true)? else {
            return Ok(Vec::new());
        };
        let fh = read_u64(&open_out, 0).unwrap_or(0);
        let (mut names, mut offset) = (Vec::new(), 0);
        for _ in 0..MAX_LISTINGS {
            let listing = self.call(
                readdir_request(0, node, fh, offset, LISTING_SIZE),
                ReplyShape::UpTo(LISTING_SIZE),
            )?;
            let Ok(listing) = listing else { break };
            let Some(next) = hidden_in(&listing, &mut names) else {
                break;
            };
            offset = next;
        }
        self.release(node, fh, 0, true);
        Ok(names)
    }
}

/// Adds the hidden names of a READDIR reply body to `names`; returns the offset to go on
/// from, or `None` at the end of the directory (or on a malformed listing).
fn hidden_in(listing: &[u8], names: &mut Vec<Vec<u8>>) -> Option<u64> {
    let mut at = 0;
    let mut last = None;
    while let Ok((dirent, rest)) = Dirent::read_from_prefix(&listing[at..]) {
        let name = rest.get(..dirent.namelen as usize)?;
        if name.starts_with(HIDDEN) {
            names.push(name.to_vec());
        }
        last = Some(dirent.off);
        at += dirent_align(size_of::<Dirent>() + name.len())?;
        if at >= listing.len() {
            break;
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;
    use zerocopy::IntoBytes;

    fn dirent(name: &[u8], off: u64) -> Vec<u8> {
        let head = Dirent {
            ino: 7,
            off,
            namelen: name.len() as u32,
            r#type: 8,
        };
        let mut bytes = head.as_bytes().to_vec();
        bytes.extend_from_slice(name);
        bytes.resize(dirent_align(bytes.len()).unwrap(), 0);
        bytes
    }

    #[test]
    fn only_hidden_names_are_picked_and_the_listing_goes_on_from_the_last_offset() {
        let mut listing = dirent(b"a", 1);
        listing.extend(dirent(b".fuse_hidden0000000300000001", 2));
        listing.extend(dirent(b".fuse_hid", 3));
        let mut names = Vec::new();
        assert_eq!(hidden_in(&listing, &mut names), Some(3));
        assert_eq!(names, vec![b".fuse_hidden0000000300000001".to_vec()]);
        assert_eq!(hidden_in(&[], &mut names), None, "the end");
        assert_eq!(
            hidden_in(&listing[..20], &mut Vec::new()),
            None,
            "cut short"
        );
    }
}
