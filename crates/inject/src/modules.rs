//! The code a fault may go into: a process's executable mappings, the ELF files behind them,
//! and which of them belong to the driver.
//!
//! Owns: reading `/proc/PID/maps`, choosing the driver's own modules (its executable and the
//! libraries that are not system libraries, libc and libfuse only when asked), loading their
//! executable sections from the files (not from memory, so that the same seed gives the same
//! faults in every process that maps the same files, whatever ASLR did), symbol lookup, and
//! mapping a file offset to the address it is loaded at in one process.
//! Must not: write to a process, or choose faults.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use object::{Object, ObjectSection, ObjectSymbol, SectionKind, SymbolKind};

/// One line of `/proc/PID/maps` that maps a file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub exec: bool,
    pub offset: u64,
    pub path: String,
}

/// Libraries that are not part of a driver unless asked for: the C runtime, the dynamic
/// loader, and general-purpose libraries many programs share.
const SYSTEM_LIBS: &[&str] = &[
    "ld-linux",
    "libc.so",
    "libm.so",
    "libpthread",
    "libdl.so",
    "librt.so",
    "libgcc_s",
    "libstdc++",
    "libglib-",
    "libgobject-",
    "libgio-",
    "libgmodule-",
    "libgthread-",
    "libpcre",
    "libselinux",
    "libz.so",
    "libffi",
    "libmount",
    "libblkid",
    "libuuid",
    "libcap",
    "libattr",
    "libacl",
    "libcrypto",
    "libssl",
    "libsystemd",
    "liblzma",
    "libzstd",
    "liblz4",
    "libgcrypt",
    "libgpg-error",
    "libunwind",
];

/// Which modules count as the driver's.
#[derive(Clone, Debug, Default)]
pub struct Selection {
    /// Include libc (and the other C runtime libraries).
    pub libc: bool,
    /// Include libfuse / libfuse3.
    pub libfuse: bool,
    /// Only modules whose file name contains one of these (all the driver's when empty).
    pub only: Vec<String>,
}

pub fn read_maps(pid: i32) -> anyhow::Result<Vec<Mapping>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .with_context(|| format!("reading /proc/{pid}/maps"))?;
    Ok(text.lines().filter_map(parse_maps_line).collect())
}

fn parse_maps_line(line: &str) -> Option<Mapping> {
    let mut fields = line.split_whitespace();
    let range = fields.next()?;
    let perms = fields.next()?;
    let offset = u64::from_str_radix(fields.next()?, 16).ok()?;
    let _dev = fields.next()?;
    let _inode = fields.next()?;
    let path: Vec<&str> = fields.collect();
    let path = path.join(" ");
    if !path.starts_with('/') || path.ends_with(" (deleted)") {
        return None;
    }
    let (start, end) = range.split_once('-')?;
    Some(Mapping {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        exec: perms.as_bytes().get(2) == Some(&b'x'),
        offset,
        path,
    })
}

fn file_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// The paths of the executable file mappings of the process that belong to the driver, sorted
/// (so the order does not depend on where ASLR put them).
pub fn driver_modules(pid: i32, maps: &[Mapping], sel: &Selection) -> anyhow::Result<Vec<String>> {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut out: Vec<String> = maps
        .iter()
        .filter(|m| m.exec)
        .map(|m| m.path.clone())
        .filter(|p| {
            let name = file_name(p);
            if !sel.only.is_empty() {
                return sel.only.iter().any(|o| name.contains(o.as_str()));
            }
            if *p == exe {
                return true;
            }
            if name.starts_with("libfuse") {
                return sel.libfuse;
            }
            let system = SYSTEM_LIBS.iter().any(|s| name.starts_with(s));
            !system || sel.libc
        })
        .collect();
    out.sort();
    out.dedup();
    if out.is_empty() {
        bail!("process {pid} maps no code of the driver's own (see --module, --libc, --libfuse)");
    }
    Ok(out)
}

/// One executable section of a module file.
#[derive(Clone, Debug)]
pub struct CodeSection {
    pub name: String,
    pub file_offset: u64,
    /// The section's address in the file's own address space (ELF virtual address).
    pub vaddr: u64,
    pub bytes: Vec<u8>,
}

/// A module's code and function symbols, read from its file.
#[derive(Clone, Debug)]
pub struct ModuleCode {
    /// The path as the process maps it.
    pub path: String,
    pub sections: Vec<CodeSection>,
    /// Function symbols: address, size, name; sorted by address.
    pub symbols: Vec<(u64, u64, String)>,
}

impl ModuleCode {
    /// Loads `path` as process `pid` sees it (through `/proc/PID/root`, for drivers in their
    /// own mount namespace).
    pub fn load(pid: i32, path: &str) -> anyhow::Result<ModuleCode> {
        let seen: PathBuf =
            Path::new(&format!("/proc/{pid}/root")).join(path.trim_start_matches('/'));
        let data = std::fs::read(&seen)
            .or_else(|_| std::fs::read(path))
            .with_context(|| format!("reading {path}"))?;
        ModuleCode::parse(path, &data)
    }

    pub fn parse(path: &str, data: &[u8]) -> anyhow::Result<ModuleCode> {
        let file = object::File::parse(data).with_context(|| format!("parsing {path}"))?;
        let mut sections = Vec::new();
        for s in file.sections() {
            if s.kind() != SectionKind::Text {
                continue;
            }
            let Some((offset, size)) = s.file_range() else {
                continue;
            };
            let name = s.name().unwrap_or("?").to_string();
            // PLT stubs are the dynamic loader's jumps, not the driver's code.
            if name.starts_with(".plt") || name == ".init" || name == ".fini" {
                continue;
            }
            sections.push(CodeSection {
                name,
                file_offset: offset,
                vaddr: s.address(),
                bytes: data[offset as usize..(offset + size) as usize].to_vec(),
            });
        }
        let mut symbols: Vec<(u64, u64, String)> = file
            .symbols()
            .chain(file.dynamic_symbols())
            .filter(|s| s.kind() == SymbolKind::Text && s.address() != 0)
            .filter_map(|s| Some((s.address(), s.size(), s.name().ok()?.to_string())))
            .collect();
        symbols.sort();
        symbols.dedup_by_key(|s| s.0);
        Ok(ModuleCode {
            path: path.to_string(),
            sections,
            symbols,
        })
    }

    /// `function+0xoff` for an address of the file, when a symbol covers it.
    pub fn symbolize(&self, vaddr: u64) -> Option<String> {
        let i = self
            .symbols
            .partition_point(|s| s.0 <= vaddr)
            .checked_sub(1)?;
        let (start, size, name) = &self.symbols[i];
        (vaddr < start + size.max(&1) || *size == 0).then(|| format!("{name}+{:#x}", vaddr - start))
    }
}

/// Where file offset `file_offset` of `path` is mapped in the process whose maps these are.
pub fn runtime_address(maps: &[Mapping], path: &str, file_offset: u64) -> Option<u64> {
    maps.iter()
        .filter(|m| m.path == path)
        .find(|m| file_offset >= m.offset && file_offset < m.offset + (m.end - m.start))
        .map(|m| m.start + (file_offset - m.offset))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines() {
        let m = parse_maps_line(
            "7f1c2a000000-7f1c2a1a0000 r-xp 00028000 08:01 1234   /usr/lib/x86_64-linux-gnu/libc.so.6",
        )
        .unwrap();
        assert!(m.exec);
        assert_eq!(m.offset, 0x28000);
        assert_eq!(m.path, "/usr/lib/x86_64-linux-gnu/libc.so.6");
        assert!(parse_maps_line("7ffd1000-7ffd2000 r-xp 00000000 00:00 0 [vdso]").is_none());
        let maps = vec![m];
        assert_eq!(
            runtime_address(&maps, "/usr/lib/x86_64-linux-gnu/libc.so.6", 0x28010),
            Some(0x7f1c2a000010)
        );
    }

    #[test]
    fn this_test_binary_has_code() {
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let m = ModuleCode::parse(&exe.to_string_lossy(), &std::fs::read(&exe).unwrap()).unwrap();
        assert!(m
            .sections
            .iter()
            .any(|s| s.name == ".text" && !s.bytes.is_empty()));
        let maps = read_maps(std::process::id() as i32).unwrap();
        let mods = driver_modules(std::process::id() as i32, &maps, &Selection::default()).unwrap();
        assert!(mods.contains(&exe.to_string_lossy().into_owned()));
        assert!(!mods.iter().any(|p| p.contains("libc.so")));
    }
}
