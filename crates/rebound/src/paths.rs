//! Paths as rebound compares them: lexically, never by asking the file system (a lookup on a
//! FUSE mount point could wait on the very driver rebound is dealing with).

use std::path::{Component, Path, PathBuf};

/// Lexical normalisation: no `.` components, `..` removes the component before it, no
/// trailing slash.
pub fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other.as_os_str()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalisation_is_lexical() {
        assert_eq!(normalize(Path::new("/a/./b/../c/")), PathBuf::from("/a/c"));
    }
}
