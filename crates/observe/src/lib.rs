//! Sees one FUSE connection's requests and replies from beside the path: a BPF program on the
//! kernel's `fuse_request_end` tracepoint copies each request's header and arguments as the
//! wire carries them (and each FORGET a driver reads), into a ring buffer drained in batches;
//! one on `fuse_request_send` notes each request that waits, in a mapped array, until it ends
//! (for the oldest's age: [`Observer::oldest_waiting`]).
//! This is how rebound will keep its object tracker current while a driver serves the kernel's
//! queue itself (the fast path, `docs/fast-path.md`); `rebound observe` shows it on any mount.
//!
//! Owns: loading and attaching the program (`bpf/observe.bpf.c`), the facts it needs from the
//! running kernel (the connection's device number, where forgets are freed), and turning ring
//! records into [`Event`]s. Must not: interpret requests (fuse-wire and the tracker do), or
//! block: [`Observer::drain`] returns what is there.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use aya::maps::{MapData, PerCpuArray, RingBuf};
use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::BtfTracePoint;
use aya::{Btf, Ebpf, EbpfLoader};

mod shared;

/// The programs, with the tracepoints they attach to. Each observer attaches the first two;
/// forgets are seen by the host's shared program (see [`shared`]) or, where the observer
/// cannot share it, by its own `forget_read`.
const PROGRAMS: [(&str, &str); 4] = [
    ("request_send", "fuse_request_send"),
    ("request_end", "fuse_request_end"),
    (FORGET_READ, "kfree"),
    (shared::PROGRAM, "kfree"),
];
const FORGET_READ: &str = "forget_read";
/// The maps a pinned observer pins (see [`Observer::attach`]): what a successor reads.
const PINNED_MAPS: [&str; 1] = ["events"];

/// The program, compiled by `build.rs`.
static PROGRAM: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/observe.bpf.o"));

/// Sizes of a ring record (`struct event` in the program).
const HEAD: usize = 40;
const REQUEST_MAX: usize = 1024;
const REPLY_MAX: usize = 512;
const RECORD: usize = HEAD + REQUEST_MAX + REPLY_MAX;
/// A READDIRPLUS record (`struct entries_event`): a record, then the reply's entries.
const ENTRIES_MAX: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum ObserveError {
    #[error("{0} is not a FUSE mount point")]
    NotFuse(String),
    #[error("reading {0}: {1}")]
    Read(&'static str, std::io::Error),
    #[error("fuse_dev_do_read is not in /proc/kallsyms: forgets cannot be seen on this kernel")]
    NoForgetSite,
    #[error("loading the observer's BPF program: {0}")]
    Load(String),
    #[error("attaching to the {0} tracepoint: {1}")]
    Attach(&'static str, String),
    #[error("pinning the observer in {0}: {1}")]
    Pin(String, String),
}

/// What the observer saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A request that ended: its bytes as the driver read them (the header's `len` is set to
    /// what is carried) and the reply's (header and arguments, its `len` set likewise); `cut`
    /// when an argument was longer than carried or in pages (READ replies, WRITE data, and
    /// READDIRPLUS entries the driver wrote in a way not followed).
    Request {
        request: Vec<u8>,
        reply: Vec<u8>,
        cut: bool,
    },
    /// Process `reader` read a FORGET of `count` lookups of `node`. Its connection is not
    /// known: forgets of every FUSE connection are seen, and the reader tells them apart.
    Forget { node: u64, count: u64, reader: u32 },
}

/// What the observer saw, as [`Observer::drain_with`] hands it over: the same as [`Event`],
/// in buffers the observer reuses (no allocation per event).
#[derive(Debug, PartialEq, Eq)]
pub enum Seen<'a> {
    Request {
        request: &'a [u8],
        reply: &'a mut [u8],
        cut: bool,
    },
    Forget {
        node: u64,
        count: u64,
        reader: u32,
    },
}

impl From<Seen<'_>> for Event {
    fn from(seen: Seen<'_>) -> Event {
        match seen {
            Seen::Request {
                request,
                reply,
                cut,
            } => Event::Request {
                request: request.to_vec(),
                reply: reply.to_vec(),
                cut,
            },
            Seen::Forget {
                node,
                count,
                reader,
            } => Event::Forget {
                node,
                count,
                reader,
            },
        }
    }
}

/// The buffers a record's request and reply are copied into (see [`Seen`]).
#[derive(Default)]
struct Scratch {
    request: Vec<u8>,
    reply: Vec<u8>,
}

/// Slots of the BPF program's `started` array (a `__u64` each).
const STARTED_SLOTS: usize = 4096;

/// How many opcodes [`Observer::ended_by_opcode`] counts apart (as the BPF program does).
pub const OPCODE_SLOTS: usize = 64;

/// The observer of one connection, attached until dropped.
pub struct Observer {
    /// Holds the programs attached.
    _bpf: Ebpf,
    ring: RingBuf<MapData>,
    ended: PerCpuArray<MapData, u64>,
    /// The `started` array's slots (the unique of a request that has not ended, or 0), mapped.
    started: rebound_sys::bpf_map::SharedArray,
    /// The uniques [`Observer::oldest_waiting`] last found there, and when each was first.
    watched: std::collections::HashMap<u64, std::time::Instant>,
    connection: u32,
    mountpoint: PathBuf,
    /// Where its programs and maps are pinned, if they are (see [`Observer::attach`]).
    pinned: Option<(PathBuf, Vec<PinnedLink>)>,
    scratch: Scratch,
    /// Its slot of the host's shared forget program, if it has one (else its own
    /// `forget_read` puts forgets in its ring).
    slot: Option<shared::Slot>,
    /// Why it has none though asked to share, for the caller to say.
    not_shared: Option<String>,
    /// Forgets taken from the slot, until handed over.
    forgets: Vec<(u64, u64, u32)>,
}

impl Drop for Observer {
    /// Detaches a pinned observer: its pins go (an unpinned one detaches with its
    /// descriptors).
    fn drop(&mut self) {
        if let Some((dir, links)) = self.pinned.take() {
            remove_pins(&dir);
            drop(links);
        }
    }
}

/// Removes what an observer pinned in `dir`, what its owner marked there (empty
/// directories), and `dir`: its programs detach once nothing else holds them (a live
/// observer's descriptors still do).
pub fn remove_pins(dir: &Path) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            let _ = std::fs::remove_dir(path);
        } else {
            let _ = std::fs::remove_file(path);
        }
    }
    let _ = std::fs::remove_dir(dir);
}

/// This process leaves its slot of the host's shared forget program pinned in `dir` (see
/// [`Observer::attach`]), as dropping its observer does: for a process that ends without.
/// The last live run to leave detaches the program.
pub fn leave_shared_forgets(dir: &Path) {
    shared::leave(dir, std::process::id());
}

/// What a pinned observer in `dir` holds that was never drained, its process having died;
/// then its pins are removed, and it detaches. The caller makes sure nothing more is to come
/// (the connection's driver is gone).
pub fn drain_pinned(dir: &Path) -> Result<Vec<Event>, ObserveError> {
    let pin_error =
        |e: &dyn std::fmt::Display| ObserveError::Pin(dir.display().to_string(), e.to_string());
    let drained = (|| {
        let data = MapData::from_pin(dir.join("events")).map_err(|e| pin_error(&e))?;
        let size = data.info().map_err(|e| pin_error(&e))?.max_entries() as usize;
        let mut events = Vec::new();
        let mut scratch = Scratch::default();
        rebound_sys::bpf_ring::drain(data.fd().as_fd(), size, |record| {
            events.extend(parse_record(record, &mut scratch).map(Event::from))
        })
        .map_err(|e| pin_error(&e))?;
        Ok(events)
    })();
    remove_pins(dir);
    drained
}

impl Observer {
    /// Attaches to the FUSE connection mounted at `mountpoint`, to report the requests of
    /// the opcodes in `wanted` (bit N: opcode N; opcodes from 64 up always), and GETATTR of
    /// the root; the others are only counted ([`Observer::ended`]). With `pin` (a directory to
    /// make on a BPF file system), its programs and maps are pinned there: should this
    /// process die, they stay attached, and [`drain_pinned`] gives what it had not drained.
    /// With `shared` (a directory on a BPF file system), the forgets its process's
    /// descendants read come from the host's one forget program, pinned there (see
    /// [`shared`]); without, from its own, which reports every forget of the host.
    /// [`LoadedObserver::load`] then [`LoadedObserver::attach`], in one.
    pub fn attach(
        mountpoint: &Path,
        wanted: u64,
        pin: Option<&Path>,
        shared: Option<&Path>,
    ) -> Result<Observer, ObserveError> {
        LoadedObserver::load(wanted, shared)?.attach(mountpoint, pin)
    }
}

/// The observer's programs, checked and loaded by the kernel but attached to nothing yet: what
/// fails on a kernel that cannot observe (no BPF, no BTF, no FUSE tracepoints, a verifier that
/// refuses the program) fails here, before a driver is started, so that the run can choose
/// its mode while it still can. Attaching it to a mount is then quick.
pub struct LoadedObserver {
    bpf: Ebpf,
    shared: Option<PathBuf>,
    /// Its slots' rings are full-size: it may be the one to attach the shared program.
    can_publish: bool,
}

impl LoadedObserver {
    /// Loads the observer's programs, to report the opcodes in `wanted`, and to share the
    /// host's forget program pinned in `shared` (see [`Observer::attach`]).
    pub fn load(wanted: u64, shared: Option<&Path>) -> Result<LoadedObserver, ObserveError> {
        let (read_lo, read_hi) = forget_site()?;
        let mut loader = EbpfLoader::new();
        loader
            .set_global("READ_LO", &read_lo, true)
            .set_global("READ_HI", &read_hi, true)
            .set_global("WANTED", &wanted, true);
        // The slots' rings of this object serve only if it is the first to share: else they
        // are a page each (the least a ring can be).
        let rings: Vec<String> = shared::ring_names().collect();
        let can_publish = shared.is_some_and(|dir| !shared::attached(dir));
        if !can_publish {
            let page = rustix::param::page_size() as u32;
            for ring in &rings {
                loader.set_max_entries(ring, page);
            }
        }
        let mut bpf = loader
            .load(PROGRAM)
            .map_err(|e| ObserveError::Load(e.to_string()))?;
        let btf = Btf::from_sys_fs().map_err(|e| ObserveError::Load(e.to_string()))?;
        for (program, tracepoint) in PROGRAMS {
            let failed = |e: &dyn std::fmt::Display| ObserveError::Load(format!("{program}: {e}"));
            let p: &mut BtfTracePoint = bpf
                .program_mut(program)
                .ok_or_else(|| failed(&"missing from the object"))?
                .try_into()
                .map_err(|e: aya::programs::ProgramError| failed(&e))?;
            p.load(tracepoint, &btf).map_err(|e| failed(&e))?;
        }
        Ok(LoadedObserver {
            bpf,
            shared: shared.map(Path::to_path_buf),
            can_publish,
        })
    }

    /// Attaches the programs to the FUSE connection mounted at `mountpoint` (see
    /// [`Observer::attach`] for `pin`).
    pub fn attach(self, mountpoint: &Path, pin: Option<&Path>) -> Result<Observer, ObserveError> {
        let mut bpf = self.bpf;
        let connection = connection_of(mountpoint)?;
        // The connection is the only variable the programs read (`.bss`): set before they
        // run, so that they never see another connection's requests as this one's.
        let variables = bpf
            .map_mut(".bss")
            .ok_or_else(|| ObserveError::Load("no map `.bss`".into()))?;
        aya::maps::Array::<_, u32>::try_from(variables)
            .and_then(|mut variables| variables.set(0, connection, 0))
            .map_err(|e| ObserveError::Load(format!("setting the connection: {e}")))?;
        let (slot, not_shared) = match &self.shared {
            Some(dir) => match shared::Slot::join(&mut bpf, dir, self.can_publish) {
                Ok(slot) => (Some(slot), None),
                Err(e) => (None, Some(e)),
            },
            None => (None, None),
        };
        let mut links = Vec::new();
        for (program, tracepoint) in PROGRAMS {
            // The shared program is attached by `Slot::join`, once for the host.
            if program == shared::PROGRAM || (program == FORGET_READ && slot.is_some()) {
                continue;
            }
            let attach = |bpf: &mut Ebpf| -> Result<Option<FdLink>, String> {
                let p: &mut BtfTracePoint = bpf
                    .program_mut(program)
                    .ok_or("missing from the object")?
                    .try_into()
                    .map_err(|e: aya::programs::ProgramError| e.to_string())?;
                let id = p.attach().map_err(|e| e.to_string())?;
                // A link to pin is taken from the program, which would detach it when dropped.
                pin.map(|_| p.take_link(id).map(FdLink::from))
                    .transpose()
                    .map_err(|e| e.to_string())
            };
            let link = attach(&mut bpf).map_err(|e| ObserveError::Attach(tracepoint, e))?;
            links.extend(link.map(|link| (program, link)));
        }
        let pinned = match pin {
            Some(dir) => Some((dir.to_path_buf(), pin_all(&bpf, dir, links)?)),
            None => None,
        };
        let ended = bpf
            .take_map("ended")
            .ok_or_else(|| ObserveError::Load("no map `ended`".into()))?;
        let ended = PerCpuArray::try_from(ended).map_err(|e| ObserveError::Load(e.to_string()))?;
        let started = bpf
            .take_map("started")
            .ok_or_else(|| ObserveError::Load("no map `started`".into()))?;
        let started = match started {
            aya::maps::Map::Array(data) => data,
            _ => {
                return Err(ObserveError::Load(
                    "the map `started` is not an array".into(),
                ))
            }
        };
        let started =
            rebound_sys::bpf_map::SharedArray::map(started.fd().as_fd(), STARTED_SLOTS * 8)
                .map_err(|e| ObserveError::Load(format!("mapping `started`: {e}")))?;
        let map = bpf
            .take_map("events")
            .ok_or_else(|| ObserveError::Load("no map `events`".into()))?;
        let ring = RingBuf::try_from(map).map_err(|e| ObserveError::Load(e.to_string()))?;
        Ok(Observer {
            _bpf: bpf,
            ring,
            ended,
            started,
            watched: std::collections::HashMap::new(),
            connection,
            mountpoint: mountpoint.to_path_buf(),
            pinned,
            scratch: Scratch::default(),
            slot,
            not_shared,
            forgets: Vec::new(),
        })
    }
}

impl Observer {
    /// Where the observed connection was mounted when the observer attached.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// How many of the connection's requests have ended since the attach, reported or not.
    pub fn ended(&self) -> u64 {
        self.ended_in(0)
    }

    /// Slot `slot` of the `ended` counts, summed over the CPUs.
    fn ended_in(&self, slot: u32) -> u64 {
        self.ended
            .get(&slot, 0)
            .map(|counts| counts.iter().sum())
            .unwrap_or(0)
    }

    /// How long the oldest of the connection's requests that have not ended has waited, as
    /// these calls see it: since the first call that found it waiting (so up to one period of
    /// the calls less than since it was sent). `None` if none waits. Reads every slot of the
    /// mapped array (32 KiB): for a periodic look.
    pub fn oldest_waiting(&mut self) -> Option<std::time::Duration> {
        let now = std::time::Instant::now();
        let mut watched = std::collections::HashMap::with_capacity(self.watched.len());
        for slot in 0..STARTED_SLOTS {
            let unique = self.started.word(slot);
            if unique != 0 {
                watched.insert(unique, self.watched.get(&unique).copied().unwrap_or(now));
            }
        }
        self.watched = watched;
        self.watched.values().min().map(|&first| now - first)
    }

    /// The same, by opcode: slot N counts opcode N (opcodes from `OPCODE_SLOTS - 1` up share
    /// the last). One map read per slot: for a periodic look, not for every batch.
    pub fn ended_by_opcode(&self) -> [u64; OPCODE_SLOTS] {
        std::array::from_fn(|slot| self.ended_in(1 + slot as u32))
    }

    /// The connection observed, as the kernel numbers it (`fc->dev`; its directory in
    /// `/sys/fs/fuse/connections`).
    pub fn connection(&self) -> u32 {
        self.connection
    }

    /// What was seen since the last call, oldest first.
    pub fn drain(&mut self) -> Vec<Event> {
        let mut events = Vec::new();
        self.drain_with(|seen| events.push(seen.into()));
        events
    }

    /// As [`Observer::drain`], handing each event to `each` as it is read. Forgets from the
    /// shared program's slot come after the requests: taken first, they are handed over once
    /// every request that ended before them is (a driver reads a forget only of lookups whose
    /// replies the kernel took, each seen ending before).
    pub fn drain_with(&mut self, mut each: impl FnMut(Seen<'_>)) {
        if let Some(slot) = &self.slot {
            slot.take(&mut self.forgets);
        }
        while let Some(record) = self.ring.next() {
            if let Some(seen) = parse_record(&record, &mut self.scratch) {
                each(seen);
            }
        }
        for (node, count, reader) in self.forgets.drain(..) {
            each(Seen::Forget {
                node,
                count,
                reader,
            });
        }
    }

    /// Its slot of the host's shared forget program, if it has one.
    pub fn forget_slot(&self) -> Option<u32> {
        self.slot.as_ref().map(|slot| slot.slot)
    }

    /// Why forgets are seen by this observer's own program though it was asked to share the
    /// host's (no BPF file system, every slot taken), if they are.
    pub fn not_shared(&self) -> Option<&str> {
        self.not_shared.as_deref()
    }
}

/// Pins `links` and the maps of `bpf` in `dir` (made if need be; on a BPF file system).
fn pin_all(
    bpf: &Ebpf,
    dir: &Path,
    links: Vec<(&str, FdLink)>,
) -> Result<Vec<PinnedLink>, ObserveError> {
    let failed = |e: &dyn std::fmt::Display| {
        remove_pins(dir);
        ObserveError::Pin(dir.display().to_string(), e.to_string())
    };
    std::fs::create_dir_all(dir).map_err(|e| failed(&e))?;
    for name in PINNED_MAPS {
        let map = bpf
            .map(name)
            .ok_or_else(|| failed(&format!("no map `{name}`")))?;
        map.pin(dir.join(name)).map_err(|e| failed(&e))?;
    }
    let mut pinned = Vec::new();
    for (program, link) in links {
        match link.pin(dir.join(program)) {
            Ok(link) => pinned.push(link),
            Err(e) => {
                for link in pinned {
                    let _ = link.unpin();
                }
                return Err(failed(&e));
            }
        }
    }
    Ok(pinned)
}

/// A record's kind (`enum kind` in the program) for a forget.
const FORGET: u32 = 1;

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap_or_default())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or_default())
}

/// One ring record as an event, its request and reply copied into `scratch` (`None` for a
/// record of another shape).
fn parse_record<'a>(b: &[u8], scratch: &'a mut Scratch) -> Option<Seen<'a>> {
    if b.len() < RECORD {
        return None;
    }
    const REQUEST_END: u32 = 0;
    const ENTRIES_END: u32 = 2;
    match u32_at(b, 0) {
        kind @ (REQUEST_END | ENTRIES_END) => {
            let request_len = (u32_at(b, 4) as usize).min(REQUEST_MAX);
            let reply_len = (u32_at(b, 8) as usize).min(REPLY_MAX);
            let Scratch { request, reply } = scratch;
            request.clear();
            request.extend_from_slice(&b[HEAD..HEAD + request_len]);
            if request.len() >= 4 {
                request[..4].copy_from_slice(&(request_len as u32).to_le_bytes());
            }
            reply.clear();
            reply.extend_from_slice(&b[HEAD + REQUEST_MAX..HEAD + REQUEST_MAX + reply_len]);
            if kind == ENTRIES_END && b.len() >= RECORD + ENTRIES_MAX {
                let len = (u32_at(b, 36) as usize).min(ENTRIES_MAX);
                reply.extend_from_slice(&b[RECORD..RECORD + len]);
            }
            if reply.len() >= 4 {
                let len = reply.len() as u32;
                reply[..4].copy_from_slice(&len.to_le_bytes());
            }
            Some(Seen::Request {
                request,
                reply,
                cut: u32_at(b, 12) != 0,
            })
        }
        FORGET => Some(Seen::Forget {
            node: u64_at(b, 16),
            count: u64_at(b, 24),
            reader: u32_at(b, 32),
        }),
        _ => None,
    }
}

/// The device number the kernel knows the FUSE connection at `mountpoint` by (`fc->dev`):
/// its `major:minor` in /proc/self/mountinfo, encoded as the kernel's `MKDEV`.
pub fn connection_of(mountpoint: &Path) -> Result<u32, ObserveError> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| ObserveError::Read("/proc/self/mountinfo", e))?;
    // (Made absolute without looking at it: a mount whose driver hangs must not hang this.)
    let absolute = std::path::absolute(mountpoint).unwrap_or_else(|_| mountpoint.to_path_buf());
    let wanted = absolute.to_string_lossy();
    // The last line for the path: the mount on top.
    info.lines()
        .rev()
        .find_map(|line| {
            // id parent major:minor root mountpoint options... - fstype source super-options
            let fields: Vec<&str> = line.split(' ').collect();
            let fstype = fields.iter().skip_while(|f| **f != "-").nth(1)?;
            let mountpoint =
                String::from_utf8_lossy(&unescape_mount_field(fields.get(4)?)).into_owned();
            (mountpoint == wanted && fstype.starts_with("fuse")).then_some(fields[2])
        })
        .and_then(|dev| {
            let (major, minor) = dev.split_once(':')?;
            Some(major.parse::<u32>().ok()? << 20 | minor.parse::<u32>().ok()?)
        })
        .ok_or_else(|| ObserveError::NotFuse(wanted.into_owned()))
}

/// A mountinfo field with its octal escapes (`\040` for a space) undone: the path's bytes.
/// (Here because the observer finds its mount by the table; rebound's `paths` uses it too.)
pub fn unescape_mount_field(field: &str) -> Vec<u8> {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| bytes[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                let value = u32::from(d[0] - b'0') << 6
                    | u32::from(d[1] - b'0') << 3
                    | u32::from(d[2] - b'0');
                out.push(value as u8); // (the kernel writes at most \\377)
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    out
}

/// Where `fuse_dev_do_read` lies (its address and the next symbol's), from /proc/kallsyms.
fn forget_site() -> Result<(u64, u64), ObserveError> {
    let symbols = std::fs::read_to_string("/proc/kallsyms")
        .map_err(|e| ObserveError::Read("/proc/kallsyms", e))?;
    let mut addresses: Vec<(u64, &str)> = symbols
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let address = u64::from_str_radix(fields.next()?, 16).ok()?;
            let name = fields.nth(1)?;
            Some((address, name))
        })
        .collect();
    addresses.sort_unstable();
    let at = addresses
        .iter()
        .position(|(a, name)| *name == "fuse_dev_do_read" && *a != 0)
        .ok_or(ObserveError::NoForgetSite)?;
    let start = addresses[at].0;
    let end = addresses[at + 1..]
        .iter()
        .find(|(a, _)| *a > start)
        .map(|(a, _)| *a)
        .ok_or(ObserveError::NoForgetSite)?;
    Ok((start, end))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(b: &[u8]) -> Option<Event> {
        parse_record(b, &mut Scratch::default()).map(Event::from)
    }

    fn record(kind: u32, request: &[u8], reply: &[u8], cut: u32, node: u64, count: u64) -> Vec<u8> {
        let mut b = vec![0u8; RECORD];
        b[0..4].copy_from_slice(&kind.to_le_bytes());
        b[4..8].copy_from_slice(&(request.len() as u32).to_le_bytes());
        b[8..12].copy_from_slice(&(reply.len() as u32).to_le_bytes());
        b[12..16].copy_from_slice(&cut.to_le_bytes());
        b[16..24].copy_from_slice(&node.to_le_bytes());
        b[24..32].copy_from_slice(&count.to_le_bytes());
        b[32..36].copy_from_slice(&77u32.to_le_bytes());
        b[HEAD..HEAD + request.len()].copy_from_slice(request);
        b[HEAD + REQUEST_MAX..HEAD + REQUEST_MAX + reply.len()].copy_from_slice(reply);
        b
    }

    #[test]
    fn a_request_record_carries_its_bytes_with_the_length_it_carries() {
        let mut request = vec![0u8; 40];
        request[0..4].copy_from_slice(&4096u32.to_le_bytes()); // the wire's length
        request.extend_from_slice(b"name\0");
        let reply = [7u8; 16];
        let Some(Event::Request {
            request: got,
            reply: got_reply,
            cut,
        }) = parsed(&record(0, &request, &reply, 1, 0, 0))
        else {
            panic!("not a request");
        };
        assert_eq!(u32_at(&got, 0), 45);
        assert_eq!(&got[40..], b"name\0");
        assert_eq!(got_reply[4..], reply[4..]);
        assert_eq!(u32_at(&got_reply, 0), 16);
        assert!(cut);
    }

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape_mount_field(r"/mnt/my\040disk"), b"/mnt/my disk");
        assert_eq!(unescape_mount_field(r"/a\134b"), br"/a\b");
        assert_eq!(unescape_mount_field(r"/plain\"), br"/plain\");
    }

    #[test]
    fn a_forget_record_gives_node_and_count() {
        assert_eq!(
            parsed(&record(1, &[], &[], 0, 42, 3)),
            Some(Event::Forget {
                node: 42,
                count: 3,
                reader: 77
            })
        );
    }

    #[test]
    fn a_readdirplus_record_carries_its_entries_after_the_reply_header() {
        let header = [0u8; 16];
        let mut b = record(2, &[0u8; 40], &header, 0, 0, 0);
        b.resize(RECORD + ENTRIES_MAX, 0);
        b[36..40].copy_from_slice(&5u32.to_le_bytes());
        b[RECORD..RECORD + 5].copy_from_slice(b"abcde");
        let Some(Event::Request { reply, cut, .. }) = parsed(&b) else {
            panic!("not a request");
        };
        assert_eq!(&reply[16..], b"abcde");
        assert_eq!(u32_at(&reply, 0), 21);
        assert!(!cut);
    }

    #[test]
    fn records_of_another_shape_are_ignored() {
        assert_eq!(parsed(&[0u8; 16]), None);
        assert_eq!(parsed(&record(9, &[], &[], 0, 0, 0)), None);
        // Lengths beyond the record are bounded, not trusted.
        let mut b = record(0, &[], &[], 0, 0, 0);
        b[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(
            matches!(parsed(&b), Some(Event::Request { request, .. }) if request.len() == REQUEST_MAX)
        );
    }

    #[test]
    fn a_record_read_into_used_buffers_carries_only_its_own_bytes() {
        let mut scratch = Scratch::default();
        let long = record(0, &[1u8; 300], &[2u8; 200], 0, 0, 0);
        assert!(parse_record(&long, &mut scratch).is_some());
        let short = record(0, &[3u8; 40], &[4u8; 16], 0, 0, 0);
        let Some(Seen::Request { request, reply, .. }) = parse_record(&short, &mut scratch) else {
            panic!("not a request");
        };
        assert_eq!((request.len(), reply.len()), (40, 16));
        assert!(request[4..].iter().all(|&b| b == 3) && reply[4..].iter().all(|&b| b == 4));
    }
}
