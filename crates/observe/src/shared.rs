//! The host's one forget program, shared by every fast-mode run.
//!
//! A driver's forgets are seen only at `kfree` (see `bpf/observe.bpf.c`), and a program there
//! runs at every `kfree` of the host, about 50 ns each: one per run made each fast-mode mount
//! cost work that never touches FUSE about 1.7% of a 2-CPU machine
//! (`bench/results/host-tax-2026-11-29.md`). So the first run attaches `forget_share` and pins
//! it in a directory of the BPF file system with its maps; each run takes a slot there (its pid
//! in `forget_owners`, and the ring `forgets<slot>`), and the last to leave unpins it all, which
//! detaches the program. A run that died keeps its slot until the next run joins.
//!
//! Owns: the shared directory's pins, the slots, and the lock every join and leave takes.
//! Must not: parse requests, or hold the lock longer than a join or a leave.

use std::fs::File;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use aya::maps::{HashMap, Map, MapData};
use aya::programs::BtfTracePoint;
use aya::Ebpf;
use rustix::fs::{flock, FlockOperation};

/// Slots, as `FORGET_SLOTS` in the program.
const SLOTS: u32 = 16;
/// The program's link, pinned: while it is, the program is attached.
const LINK: &str = "link";
const OWNERS: &str = "forget_owners";
/// The program, in the object.
pub(crate) const PROGRAM: &str = "forget_share";

fn ring_name(slot: u32) -> String {
    format!("forgets{slot}")
}

/// The names of the slots' rings, as the object has them.
pub(crate) fn ring_names() -> impl Iterator<Item = String> {
    (0..SLOTS).map(ring_name)
}

/// Whether the shared program is attached, pinned in `dir`.
pub(crate) fn attached(dir: &Path) -> bool {
    dir.join(LINK).exists()
}

/// The lock on the shared directory's parent (a file of the BPF file system cannot be made, a
/// directory can be locked): held while a run joins or leaves, released with the descriptor.
struct Lock {
    _held: File,
}

impl Lock {
    fn take(dir: &Path) -> Result<Lock, String> {
        let parent = dir.parent().unwrap_or(dir);
        let file = File::open(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
        flock(file.as_fd(), FlockOperation::LockExclusive)
            .map_err(|e| format!("locking {}: {e}", parent.display()))?;
        Ok(Lock { _held: file })
    }
}

/// Whether process `pid` lives (a zombie does not).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

fn owners(dir: &Path) -> Result<HashMap<MapData, u32, u32>, String> {
    let data = MapData::from_pin(dir.join(OWNERS)).map_err(|e| format!("{OWNERS}: {e}"))?;
    HashMap::try_from(Map::HashMap(data)).map_err(|e| format!("{OWNERS}: {e}"))
}

/// This run's slot: the forgets its drivers read arrive in its ring.
pub(crate) struct Slot {
    dir: PathBuf,
    pid: u32,
    pub(crate) slot: u32,
    ring: MapData,
    size: usize,
}

impl Slot {
    /// Joins the shared program pinned in `dir`, attaching and pinning `bpf`'s own first if
    /// none is and `bpf`'s rings were made full-size for that (`can_publish`): a slot for
    /// this process's descendants' forgets. Fails (and the caller sees forgets on its own)
    /// without a BPF file system, with every slot taken, or when the program it was loaded
    /// to join has been detached since.
    pub(crate) fn join(bpf: &mut Ebpf, dir: &Path, can_publish: bool) -> Result<Slot, String> {
        let parent = dir.parent().unwrap_or(dir);
        std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
        let _lock = Lock::take(dir)?;
        if !attached(dir) {
            if !can_publish {
                return Err(
                    "the shared program was detached after this run loaded its own \
                            with rings of a page, too small to share"
                        .into(),
                );
            }
            // Maps left by a run that died before it pinned the link.
            crate::remove_pins(dir);
            publish(bpf, dir).inspect_err(|_| crate::remove_pins(dir))?;
        }
        let mut owners = owners(dir)?;
        let mut taken = Vec::new();
        for entry in owners.iter().collect::<Vec<_>>() {
            let (pid, slot) = entry.map_err(|e| format!("{OWNERS}: {e}"))?;
            if alive(pid) {
                taken.push(slot);
            } else {
                let _ = owners.remove(&pid);
            }
        }
        let slot = (0..SLOTS)
            .find(|s| !taken.contains(s))
            .ok_or_else(|| format!("all {SLOTS} slots are taken by live runs"))?;
        let pid = std::process::id();
        let ring = MapData::from_pin(dir.join(ring_name(slot)))
            .map_err(|e| format!("{}: {e}", ring_name(slot)))?;
        let size = ring
            .info()
            .map_err(|e| format!("{}: {e}", ring_name(slot)))?
            .max_entries() as usize;
        let joined = Slot {
            dir: dir.to_path_buf(),
            pid,
            slot,
            ring,
            size,
        };
        // What a dead run left in the ring is not this run's.
        joined.take(&mut Vec::new());
        owners
            .insert(pid, slot, 0)
            .map_err(|e| format!("{OWNERS}: {e}"))?;
        Ok(joined)
    }

    /// Appends the forgets that arrived since the last call, oldest first: (node, count,
    /// reader).
    pub(crate) fn take(&self, out: &mut Vec<(u64, u64, u32)>) {
        let _ = rebound_sys::bpf_ring::drain(self.ring.fd().as_fd(), self.size, |b| {
            if b.len() >= 24 && crate::u32_at(b, 0) == crate::FORGET {
                out.push((
                    crate::u64_at(b, 8),
                    crate::u64_at(b, 16),
                    crate::u32_at(b, 4),
                ));
            }
        });
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        leave(&self.dir, self.pid);
    }
}

/// Process `pid` leaves its slot of the shared program pinned in `dir`, if it has one; if no
/// live run is left, everything there is unpinned, which detaches the program.
pub(crate) fn leave(dir: &Path, pid: u32) {
    if !attached(dir) {
        return;
    }
    let Ok(_lock) = Lock::take(dir) else {
        return;
    };
    let Ok(mut owners) = owners(dir) else {
        return;
    };
    let _ = owners.remove(&pid);
    let others = owners.keys().filter_map(Result::ok).any(alive);
    if !others {
        crate::remove_pins(dir);
    }
}

/// Attaches `bpf`'s shared program and pins it with its maps in `dir`.
fn publish(bpf: &mut Ebpf, dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for name in ring_names().chain([OWNERS.to_string()]) {
        bpf.map(&name)
            .ok_or_else(|| format!("no map `{name}`"))?
            .pin(dir.join(&name))
            .map_err(|e| format!("pinning {name}: {e}"))?;
    }
    let program: &mut BtfTracePoint = bpf
        .program_mut(PROGRAM)
        .ok_or(format!("no program `{PROGRAM}`"))?
        .try_into()
        .map_err(|e: aya::programs::ProgramError| e.to_string())?;
    let id = program.attach().map_err(|e| e.to_string())?;
    let link = program.take_link(id).map_err(|e| e.to_string())?;
    aya::programs::links::FdLink::from(link)
        .pin(dir.join(LINK))
        .map_err(|e| format!("pinning the link: {e}"))?;
    Ok(())
}
