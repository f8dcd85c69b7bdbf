//! What the driver's program is made of, wherever it is installed: its executable, the
//! interpreter a script names and the script an interpreter runs, the directory (or install
//! prefix) each of them lives in, the library directories their ELF headers name (`RPATH`,
//! `RUNPATH`, with `$ORIGIN`), the search paths of its environment (`PYTHONPATH`,
//! `LD_LIBRARY_PATH`, `LD_PRELOAD`, ...), and an interpreter's working directory. A driver built in `/tmp`, run
//! from a virtualenv or imported with `python3 -m` must see these to start at all.
//!
//! Owns: finding those paths from the command line, the environment and the ELF files.
//! Must not: decide what the driver's view shows (`super` binds what is found read-only), or
//! follow a path into the mount point (the mount may be waiting for this driver).

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use object::elf;
use object::read::elf::{Dyn, FileHeader};
use object::Endianness;

use crate::paths::normalize;

/// One file or directory of the driver's program, and what it is to the driver (for the log).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    pub path: PathBuf,
    pub what: String,
}

/// Environment variables that list where a program's code is, `:`-separated.
const CODE_PATH_VARS: &[&str] = &[
    "PYTHONPATH",
    "PYTHONHOME",
    "VIRTUAL_ENV",
    "PERL5LIB",
    "PERLLIB",
    "RUBYLIB",
    "GEM_HOME",
    "GEM_PATH",
    "NODE_PATH",
    "CLASSPATH",
    "LD_LIBRARY_PATH",
];

/// Programs whose first file argument is the script they run (`python3 driver.py`); a
/// version suffix is ignored (`python3.11`).
const INTERPRETERS: &[&str] = &[
    "python", "perl", "ruby", "node", "nodejs", "bash", "sh", "dash", "zsh", "ksh", "lua",
    "luajit", "php", "tclsh",
];

/// How many shared libraries deep `NEEDED` entries are followed.
const LIBRARY_DEPTH: usize = 8;

/// The parts of the program `argv` runs from `cwd`, with `env` its environment. Only paths
/// that exist are returned, and never `/` or a whole private directory (`/tmp`, `/run`,
/// `/dev/shm`): a program in `/tmp/x.py` gets that file, not the rest of `/tmp`.
pub fn find(argv: &[OsString], cwd: &Path, env: &dyn Fn(&str) -> Option<OsString>) -> Vec<Part> {
    let mut finder = Finder {
        parts: Vec::new(),
        libraries_seen: HashSet::new(),
        library_path: split_list(env("LD_LIBRARY_PATH").as_deref(), cwd),
        path: env("PATH"),
    };
    let Some(program) = argv.first() else {
        return Vec::new();
    };
    let mut runners = Vec::new();
    if let Some(executable) = executable(Path::new(program), cwd, finder.path.as_deref()) {
        finder.program(&executable, "the driver's executable");
        runners.push(executable.clone());
        if let Some(interpreter) = finder.shebang(&executable) {
            finder.program(&interpreter, "the interpreter of the driver's executable");
            runners.push(interpreter);
        }
    }
    let interpreted = runners.iter().any(|r| is_interpreter(r));
    if interpreted {
        let script = argv.iter().skip(1).find_map(|arg| {
            if arg.as_bytes().starts_with(b"-") {
                return None;
            }
            let path = normalize(&cwd.join(arg));
            path.is_file().then_some(path)
        });
        if let Some(script) = script {
            finder.program(&script, "the driver's script");
        }
    }
    for var in CODE_PATH_VARS {
        for path in split_list(env(var).as_deref(), cwd) {
            finder.add(&path, format!("${var}"));
        }
    }
    if let Some(preload) = env("LD_PRELOAD") {
        let preload = preload.as_bytes();
        for entry in preload.split(|&b| b == b':' || b.is_ascii_whitespace()) {
            if !entry.is_empty() {
                let path = normalize(&cwd.join(OsStr::from_bytes(entry)));
                finder.add(&path, "$LD_PRELOAD".into());
                finder.libraries(&path, 0);
            }
        }
    }
    // An interpreter looks for modules there (`python3 -m pkg`); a compiled driver's relative
    // paths are resolved on its command line already.
    if interpreted {
        finder.add(cwd, "the working directory".into());
    }
    finder.parts
}

/// The file `program` (argv[0]) names, found as `execvp` would (through `PATH` when it has no
/// slash).
pub fn executable(program: &Path, cwd: &Path, path: Option<&OsStr>) -> Option<PathBuf> {
    if program.as_os_str().as_bytes().contains(&b'/') {
        return Some(normalize(&cwd.join(program)));
    }
    std::env::split_paths(path?)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

struct Finder {
    parts: Vec<Part>,
    libraries_seen: HashSet<PathBuf>,
    library_path: Vec<PathBuf>,
    path: Option<OsString>,
}

impl Finder {
    fn add(&mut self, path: &Path, what: String) {
        if is_whole_system_dir(path) || !path.exists() {
            return;
        }
        if self.parts.iter().any(|p| p.path == path) {
            return;
        }
        self.parts.push(Part {
            path: path.to_path_buf(),
            what,
        });
    }

    /// A program file (an executable, an interpreter, a script): the file, its home (the
    /// directory it is in, or the install prefix of a `bin` directory), for the file as named
    /// and as its symbolic links resolve; and the libraries an ELF file names.
    fn program(&mut self, file: &Path, what: &str) {
        self.add(file, what.to_string());
        let resolved = std::fs::canonicalize(file).unwrap_or_else(|_| file.to_path_buf());
        for f in [file, resolved.as_path()] {
            if let Some(home) = home(f) {
                self.add(&home, format!("the directory of {what}"));
            }
        }
        self.libraries(&resolved, 0);
    }

    /// The interpreter a `#!` line of `file` names (through `PATH` for `/usr/bin/env NAME`).
    fn shebang(&self, file: &Path) -> Option<PathBuf> {
        let mut head = [0u8; 256];
        let n = std::fs::File::open(file).ok()?.read(&mut head).ok()?;
        let line = head[..n].strip_prefix(b"#!")?;
        let line = line.split(|&b| b == b'\n').next()?;
        let mut words = line
            .split(|b| b.is_ascii_whitespace())
            .filter(|w| !w.is_empty());
        let interpreter = Path::new(OsStr::from_bytes(words.next()?));
        if interpreter.file_name() != Some(OsStr::new("env")) {
            return Some(interpreter.to_path_buf());
        }
        let name = words.find(|w| !w.starts_with(b"-"))?;
        executable(
            Path::new(OsStr::from_bytes(name)),
            Path::new("/"),
            self.path.as_deref(),
        )
    }

    /// The library directories an ELF file names in `RPATH`/`RUNPATH`, and those of every
    /// library it needs that is found there or in `LD_LIBRARY_PATH`.
    fn libraries(&mut self, file: &Path, depth: usize) {
        if depth > LIBRARY_DEPTH || !self.libraries_seen.insert(file.to_path_buf()) {
            return;
        }
        let Some(dynamic) = read_dynamic(file) else {
            return;
        };
        let origin = file.parent().unwrap_or(Path::new("/"));
        let mut search = Vec::new();
        for list in &dynamic.run_paths {
            for entry in list.split(|&b| b == b':').filter(|e| !e.is_empty()) {
                let expanded = expand_origin(entry, origin);
                let dir = normalize(&origin.join(OsStr::from_bytes(&expanded)));
                self.add(&dir, format!("a library directory of {}", file.display()));
                search.push(dir);
            }
        }
        search.extend(self.library_path.iter().cloned());
        for needed in &dynamic.needed {
            let name = Path::new(OsStr::from_bytes(needed));
            let found = if needed.contains(&b'/') {
                Some(normalize(&origin.join(name)))
            } else {
                search.iter().map(|d| d.join(name)).find(|p| p.is_file())
            };
            if let Some(library) = found {
                self.libraries(&library, depth + 1);
            }
        }
    }
}

/// A directory whose whole content is not the driver's to see: `/`, the private directories,
/// home directories (`strict` hides them), anything under `/proc` or `/sys`, and `/dev` but for
/// `/dev/shm`'s subdirectories.
fn is_whole_system_dir(path: &Path) -> bool {
    ["/", "/tmp", "/run", "/dev", "/dev/shm", "/root", "/home"]
        .iter()
        .any(|root| path == Path::new(root))
        || path.parent() == Some(Path::new("/home"))
        || ["/proc", "/sys"].iter().any(|p| path.starts_with(p))
        || (path.starts_with("/dev") && !path.starts_with("/dev/shm"))
}

/// Where a program file lives: its directory, or for `PREFIX/bin/x` the prefix when it holds a
/// virtualenv (`pyvenv.cfg`) or a `lib` directory, as an install prefix or a build tree does.
fn home(file: &Path) -> Option<PathBuf> {
    let dir = file.parent()?;
    if matches!(
        dir.file_name().and_then(OsStr::to_str),
        Some("bin" | "sbin")
    ) {
        if let Some(prefix) = dir.parent() {
            if prefix.join("pyvenv.cfg").is_file() || prefix.join("lib").is_dir() {
                return Some(prefix.to_path_buf());
            }
        }
    }
    Some(dir.to_path_buf())
}

/// Whether `program` is an interpreter that runs a script named after it (`python3.11`,
/// `perl`), by its name or, through a symbolic link, its target's.
fn is_interpreter(program: &Path) -> bool {
    let named = |p: &Path| {
        p.file_name()
            .and_then(OsStr::to_str)
            .map(|n| n.trim_end_matches(|c: char| c.is_ascii_digit() || c == '.'))
            .is_some_and(|n| INTERPRETERS.contains(&n))
    };
    named(program) || std::fs::canonicalize(program).is_ok_and(|p| named(&p))
}

/// The entries of a `:`-separated list of paths, relative ones taken from `cwd`.
fn split_list(list: Option<&OsStr>, cwd: &Path) -> Vec<PathBuf> {
    let Some(list) = list else {
        return Vec::new();
    };
    list.as_bytes()
        .split(|&b| b == b':')
        .filter(|e| !e.is_empty())
        .map(|e| normalize(&cwd.join(OsStr::from_bytes(e))))
        .collect()
}

/// `$ORIGIN` and `${ORIGIN}` replaced by the directory of the object.
fn expand_origin(entry: &[u8], origin: &Path) -> Vec<u8> {
    let origin = origin.as_os_str().as_bytes();
    let mut out = Vec::with_capacity(entry.len());
    let mut rest = entry;
    while !rest.is_empty() {
        if let Some(tail) = rest.strip_prefix(b"${ORIGIN}") {
            out.extend_from_slice(origin);
            rest = tail;
        } else if let Some(tail) = rest.strip_prefix(b"$ORIGIN") {
            out.extend_from_slice(origin);
            rest = tail;
        } else {
            out.push(rest[0]);
            rest = &rest[1..];
        }
    }
    out
}

/// What the dynamic section of an ELF file names.
#[derive(Default)]
struct Dynamic {
    needed: Vec<Vec<u8>>,
    /// `RPATH` and `RUNPATH` lists, unexpanded.
    run_paths: Vec<Vec<u8>>,
}

fn read_dynamic(file: &Path) -> Option<Dynamic> {
    let data = std::fs::read(file).ok()?;
    match object::FileKind::parse(data.as_slice()).ok()? {
        object::FileKind::Elf64 => dynamic_of::<elf::FileHeader64<Endianness>>(&data),
        object::FileKind::Elf32 => dynamic_of::<elf::FileHeader32<Endianness>>(&data),
        _ => None,
    }
}

fn dynamic_of<Elf: FileHeader<Endian = Endianness>>(data: &[u8]) -> Option<Dynamic> {
    let header = Elf::parse(data).ok()?;
    let endian = header.endian().ok()?;
    let sections = header.sections(endian, data).ok()?;
    let (entries, link) = sections.dynamic(endian, data).ok()??;
    let strings = sections.strings(endian, data, link).ok()?;
    let mut out = Dynamic::default();
    for entry in entries {
        let Some(tag) = entry.tag32(endian) else {
            continue;
        };
        let Ok(value) = entry.string(endian, strings) else {
            continue;
        };
        match tag {
            elf::DT_NEEDED => out.needed.push(value.to_vec()),
            elf::DT_RPATH | elf::DT_RUNPATH => out.run_paths.push(value.to_vec()),
            _ => {}
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<OsString> {
        None
    }

    #[test]
    fn origin_is_expanded_in_both_spellings() {
        assert_eq!(
            expand_origin(b"$ORIGIN/../lib:${ORIGIN}/x", Path::new("/o")),
            b"/o/../lib:/o/x".to_vec()
        );
    }

    #[test]
    fn a_script_run_by_an_interpreter_brings_its_directory_but_not_all_of_tmp() {
        let dir = std::env::temp_dir().join(format!("rebound-program-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("pkg")).unwrap();
        std::fs::write(dir.join("driver.py"), "import pkg\n").unwrap();
        std::fs::write(std::env::temp_dir().join("top-level.py"), "").unwrap();
        let argv: Vec<OsString> = vec![
            "/usr/bin/python3".into(),
            "-X".into(),
            "faulthandler".into(),
            dir.join("driver.py").into(),
            "/mnt".into(),
        ];
        let parts = find(&argv, Path::new("/"), &no_env);
        let paths: Vec<&Path> = parts.iter().map(|p| p.path.as_path()).collect();
        assert!(
            paths.contains(&dir.join("driver.py").as_path()),
            "{paths:?}"
        );
        assert!(paths.contains(&dir.as_path()), "{paths:?}");

        let argv: Vec<OsString> = vec![
            "/usr/bin/python3".into(),
            std::env::temp_dir().join("top-level.py").into(),
        ];
        let parts = find(&argv, Path::new("/tmp"), &no_env);
        assert!(
            parts.iter().all(|p| p.path != Path::new("/tmp")),
            "{parts:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_non_interpreter_gets_no_script() {
        let argv: Vec<OsString> = vec!["/bin/true".into(), "/etc/hostname".into()];
        let parts = find(&argv, Path::new("/"), &no_env);
        assert!(parts.iter().all(|p| p.path != Path::new("/etc/hostname")));
    }

    #[test]
    fn search_paths_of_the_environment_are_parts() {
        let dir = std::env::temp_dir().join(format!("rebound-pypath-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let env = |var: &str| {
            (var == "PYTHONPATH").then(|| OsString::from(format!("{}:", dir.display())))
        };
        let argv: Vec<OsString> = vec!["/bin/true".into()];
        let parts = find(&argv, Path::new("/"), &env);
        assert!(
            parts
                .iter()
                .any(|p| p.path == dir && p.what == "$PYTHONPATH"),
            "{parts:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_libraries_of_an_elf_executable_are_read() {
        // Every dynamically linked executable needs libc.
        let dynamic = read_dynamic(Path::new("/bin/sh")).expect("an ELF /bin/sh");
        assert!(dynamic.needed.iter().any(|n| n.starts_with(b"libc.so")));
        assert!(read_dynamic(Path::new("/etc/hostname")).is_none());
    }

    #[test]
    fn whole_system_directories_are_never_parts() {
        assert!(is_whole_system_dir(Path::new("/tmp")));
        assert!(is_whole_system_dir(Path::new("/dev/pts")));
        assert!(!is_whole_system_dir(Path::new("/dev/shm/x")));
        assert!(!is_whole_system_dir(Path::new("/tmp/x")));
    }
}
