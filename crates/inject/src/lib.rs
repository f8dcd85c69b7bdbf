//! Software fault injection into a live FUSE driver, after Nooks (Swift et al., TOCS 2005,
//! §4, Table II): faults in the driver's machine code, and the failures that are not code
//! faults (killed by a signal, hung, leaking memory).
//!
//! Owns: the fault plan (which instructions of which modules, and their new bytes), derived
//! only from a seed and the module files, so that the same seed gives the same faults in every
//! process running the same driver binaries whatever ASLR did ([`plan`]); applying a plan to a
//! process and logging each injection ([`inject`]).
//! Must not: classify outcomes (the campaign runner does), or touch rebound's channel (a reply
//! corrupted in transit is injected inside rebound, through its control socket).

pub mod fault;
pub mod modules;
pub mod ptrace;
pub mod rng;

use anyhow::{bail, Context};
use serde::Serialize;

use fault::{CodeFault, Patch};
use modules::{ModuleCode, Selection};
use rng::Rng;

/// A fault `rebound inject` puts into a process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    Code(CodeFault),
    /// Kill by a signal (SIGSEGV, SIGBUS, SIGABRT or SIGKILL, from the seed).
    Kill,
    /// Every thread blocked in a read-like system call (where a driver waits for requests)
    /// spins in a tight loop once the call returns; threads in no system call spin at once.
    Hang,
    /// The process maps and touches memory it never frees, until `leak_mb` or until the
    /// kernel refuses.
    Leak,
}

impl FaultKind {
    pub fn parse(name: &str) -> Option<FaultKind> {
        Some(match name {
            "kill" => FaultKind::Kill,
            "hang" => FaultKind::Hang,
            "leak" => FaultKind::Leak,
            other => FaultKind::Code(CodeFault::parse(other)?),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Code(c) => c.name(),
            FaultKind::Kill => "kill",
            FaultKind::Hang => "hang",
            FaultKind::Leak => "leak",
        }
    }
}

/// One planned code fault, in file terms.
#[derive(Clone, Debug)]
pub struct Planned {
    pub kind: CodeFault,
    /// Index into the modules the plan was made from.
    pub module: usize,
    pub file_offset: u64,
    pub vaddr: u64,
    pub old_bytes: Vec<u8>,
    pub patch: Patch,
}

/// Chooses `count` distinct instructions of `kind` at random (uniformly over every candidate
/// instruction of every module) and their faulty bytes. Deterministic in `seed` and the
/// modules' contents and order.
pub fn plan(
    kind: CodeFault,
    count: usize,
    seed: u64,
    modules: &[ModuleCode],
) -> anyhow::Result<Vec<Planned>> {
    // (module, section, offset in section, length)
    let mut candidates: Vec<(usize, usize, usize, usize)> = Vec::new();
    for (m, module) in modules.iter().enumerate() {
        for (s, sec) in module.sections.iter().enumerate() {
            candidates.extend(
                fault::scan(kind, &sec.bytes, sec.vaddr)
                    .into_iter()
                    .map(|(o, l)| (m, s, o, l)),
            );
        }
    }
    if candidates.is_empty() {
        bail!(
            "no instruction in the driver's code that a {} fault applies to",
            kind.name()
        );
    }
    // One stream per fault type, so that seed 1 does not pick the same spots for every type.
    let mut rng = Rng::new(seed ^ 0x5245_424f_554e_4421 ^ ((kind as u64 + 1) << 56));
    let mut out: Vec<Planned> = Vec::new();
    let mut attempts = 0;
    while out.len() < count && attempts < count * 64 + 64 {
        attempts += 1;
        let (m, s, o, l) = candidates[rng.below(candidates.len() as u64) as usize];
        let sec = &modules[m].sections[s];
        let file_offset = sec.file_offset + o as u64;
        let overlaps = out.iter().any(|p| {
            p.module == m
                && file_offset < p.file_offset + p.old_bytes.len() as u64
                && p.file_offset < file_offset + l as u64
        });
        if overlaps {
            continue;
        }
        let bytes = &sec.bytes[o..o + l];
        let vaddr = sec.vaddr + o as u64;
        if let Some(patch) = fault::transform(kind, bytes, vaddr, &mut rng) {
            out.push(Planned {
                kind,
                module: m,
                file_offset,
                vaddr,
                old_bytes: bytes.to_vec(),
                patch,
            });
        }
    }
    if out.len() < count {
        bail!(
            "found only {} of {count} {} faults to inject",
            out.len(),
            kind.name()
        );
    }
    Ok(out)
}

/// The log record of one injection.
#[derive(Clone, Debug, Serialize)]
pub struct Injection {
    pub pid: i32,
    pub fault: &'static str,
    pub seed: u64,
    pub module: Option<String>,
    pub file_offset: Option<u64>,
    /// The address written, in hex, in this process.
    pub addr: Option<String>,
    pub symbol: Option<String>,
    pub old_bytes: Option<String>,
    pub new_bytes: Option<String>,
    pub before: Option<String>,
    pub after: Option<String>,
    /// For kill: the signal; for hang: the thread; for leak: the megabytes leaked.
    pub detail: Option<String>,
}

impl Injection {
    fn new(pid: i32, kind: FaultKind, seed: u64) -> Injection {
        Injection {
            pid,
            fault: kind.name(),
            seed,
            module: None,
            file_offset: None,
            addr: None,
            symbol: None,
            old_bytes: None,
            new_bytes: None,
            before: None,
            after: None,
            detail: None,
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// What to inject, where.
#[derive(Clone, Debug)]
pub struct Request {
    pub pid: i32,
    pub kind: FaultKind,
    pub count: usize,
    pub seed: u64,
    pub selection: Selection,
    /// Plan and log, write nothing.
    pub dry_run: bool,
    /// For leak: how much, at most.
    pub leak_mb: u64,
}

/// Injects the faults of `req` into its process; returns one record per fault.
pub fn inject(req: &Request) -> anyhow::Result<Vec<Injection>> {
    match req.kind {
        FaultKind::Code(kind) => inject_code(req, kind),
        FaultKind::Kill => {
            let signals = [
                nix::sys::signal::Signal::SIGSEGV,
                nix::sys::signal::Signal::SIGBUS,
                nix::sys::signal::Signal::SIGABRT,
                nix::sys::signal::Signal::SIGKILL,
            ];
            let sig = signals[Rng::new(req.seed).below(signals.len() as u64) as usize];
            let mut rec = Injection::new(req.pid, req.kind, req.seed);
            rec.detail = Some(sig.as_str().to_string());
            if !req.dry_run {
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(req.pid), sig)
                    .with_context(|| format!("kill -{sig} {}", req.pid))?;
            }
            Ok(vec![rec])
        }
        FaultKind::Hang => inject_hang(req),
        FaultKind::Leak => inject_leak(req),
    }
}

fn inject_code(req: &Request, kind: CodeFault) -> anyhow::Result<Vec<Injection>> {
    let maps = modules::read_maps(req.pid)?;
    let paths = modules::driver_modules(req.pid, &maps, &req.selection)?;
    let mods: Vec<ModuleCode> = paths
        .iter()
        .map(|p| ModuleCode::load(req.pid, p))
        .collect::<anyhow::Result<_>>()?;
    let planned = plan(kind, req.count, req.seed, &mods)?;
    let stopped = if req.dry_run {
        None
    } else {
        Some(ptrace::Stopped::attach(req.pid)?)
    };
    let mut out = Vec::new();
    for p in planned {
        let module = &mods[p.module];
        let addr = modules::runtime_address(&maps, &module.path, p.file_offset)
            .with_context(|| format!("{}+{:#x} is not mapped", module.path, p.file_offset))?;
        if let Some(s) = &stopped {
            let now = s.read(addr, p.old_bytes.len())?;
            if now != p.old_bytes {
                bail!(
                    "{:#x} holds {} in memory, not the file's {} (already injected?)",
                    addr,
                    hex(&now),
                    hex(&p.old_bytes)
                );
            }
            s.write(addr, &p.patch.new_bytes)?;
        }
        let mut rec = Injection::new(req.pid, req.kind, req.seed);
        rec.module = Some(module.path.clone());
        rec.file_offset = Some(p.file_offset);
        rec.addr = Some(format!("{addr:#x}"));
        rec.symbol = module.symbolize(p.vaddr);
        rec.old_bytes = Some(hex(&p.old_bytes));
        rec.new_bytes = Some(hex(&p.patch.new_bytes));
        rec.before = Some(p.patch.before.clone());
        rec.after = Some(p.patch.after.clone());
        out.push(rec);
    }
    Ok(out)
}

/// System calls a driver waits for requests in.
const READ_LIKE: [u64; 6] = [
    libc::SYS_read as u64,
    libc::SYS_readv as u64,
    libc::SYS_recvmsg as u64,
    libc::SYS_recvfrom as u64,
    libc::SYS_splice as u64,
    libc::SYS_ppoll as u64,
];

fn inject_hang(req: &Request) -> anyhow::Result<Vec<Injection>> {
    let stopped = ptrace::Stopped::attach(req.pid)?;
    let mut spots: Vec<(u64, i32)> = Vec::new();
    let threads = stopped.stopped_threads();
    for &tid in &threads {
        let regs = stopped.regs(tid)?;
        // Stopped on the way out of an interrupted system call: `rip` is just after the
        // `syscall` instruction, where the thread goes on once the call (restarted) returns.
        if READ_LIKE.contains(&regs.orig_rax) && !spots.iter().any(|s| s.0 == regs.rip) {
            spots.push((regs.rip, tid));
        }
    }
    if spots.is_empty() {
        // No thread waits: the first spins where it stands.
        let tid = *threads.first().context("no thread of the driver stopped")?;
        spots.push((stopped.regs(tid)?.rip, tid));
    }
    let mut out = Vec::new();
    for (addr, tid) in spots {
        let old = stopped.read(addr, 2)?;
        let new = [0xeb, 0xfe]; // jmp $
        if !req.dry_run {
            stopped.write(addr, &new)?;
        }
        let mut rec = Injection::new(req.pid, req.kind, req.seed);
        rec.addr = Some(format!("{addr:#x}"));
        rec.old_bytes = Some(hex(&old));
        rec.new_bytes = Some(hex(&new));
        rec.after = Some("jmp $".into());
        rec.detail = Some(format!("thread {tid}"));
        out.push(rec);
    }
    Ok(out)
}

fn inject_leak(req: &Request) -> anyhow::Result<Vec<Injection>> {
    const CHUNK_MB: u64 = 64;
    let mut stopped = ptrace::Stopped::attach(req.pid)?;
    let tid = *stopped
        .stopped_threads()
        .first()
        .context("no thread of the driver stopped")?;
    let mut leaked = 0;
    let mut why = "asked amount".to_string();
    while leaked < req.leak_mb && !req.dry_run {
        let len = CHUNK_MB << 20;
        let flags = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE) as u64;
        let prot = (libc::PROT_READ | libc::PROT_WRITE) as u64;
        // A memory limit may kill the process part way (the OOM killer of its cgroup): that
        // is what the leak did, not a failure to inject it.
        let r = match stopped.syscall(
            tid,
            libc::SYS_mmap as u64,
            [0, len, prot, flags, u64::MAX, 0],
        ) {
            Ok(r) => r,
            Err(e) if leaked > 0 => {
                why = format!("the process stopped answering: {e:#}");
                break;
            }
            Err(e) => return Err(e),
        };
        if (-4095..0).contains(&r) {
            why = format!("mmap failed: errno {}", -r);
            break;
        }
        leaked += CHUNK_MB;
    }
    let mut rec = Injection::new(req.pid, req.kind, req.seed);
    rec.detail = Some(format!("{leaked} MiB leaked in thread {tid} ({why})"));
    Ok(vec![rec])
}
