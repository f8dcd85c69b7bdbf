//! `rebound inject`: puts faults into a live driver (through the `rebound-inject` crate) or,
//! for a reply corrupted in transit, asks the rebound run that serves the mount to corrupt it.
//!
//! Owns: resolving the target (a pid, or the driver of a mount rebound serves), the seed when
//! none is given, and printing one JSON line per injection on stdout (the log a campaign
//! keeps).
//! Must not: choose or apply faults itself; that is the `rebound-inject` crate's business.

use std::path::PathBuf;

use anyhow::{bail, Context};
use rebound_inject::modules::Selection;
use rebound_inject::{FaultKind, Request};

use crate::control;

#[derive(clap::Args)]
pub struct InjectArgs {
    /// The driver process (every thread of it is stopped while its code is changed).
    #[arg(long, conflicts_with = "mount")]
    pid: Option<i32>,
    /// A mount served by `rebound run`: its current driver.
    #[arg(long)]
    mount: Option<PathBuf>,
    /// source, destination, pointer, interface, branch, loop, text, nop (code faults, Nooks'
    /// Table II); kill, hang, leak; corrupt (the next COUNT replies in rebound's channel).
    #[arg(long)]
    fault: String,
    /// How many faults (for corrupt: how many replies).
    #[arg(long, default_value_t = 1)]
    count: usize,
    /// The seed that chooses the faults; the same seed and driver binaries give the same
    /// faults. Random (and printed in the log) when not given.
    #[arg(long)]
    seed: Option<u64>,
    /// Only code of modules whose file name contains this (repeatable); the driver's
    /// executable and its own libraries otherwise.
    #[arg(long = "module")]
    modules: Vec<String>,
    /// Also libc and the other C runtime and system libraries.
    #[arg(long)]
    libc: bool,
    /// Also libfuse.
    #[arg(long)]
    libfuse: bool,
    /// For leak: how many MiB at most.
    #[arg(long, default_value_t = 1024)]
    leak_mb: u64,
    /// Choose and log the faults, change nothing.
    #[arg(long)]
    dry_run: bool,
}

pub fn run(args: InjectArgs) -> anyhow::Result<()> {
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    if args.fault == "corrupt" {
        let mount = args
            .mount
            .context("--fault corrupt needs --mount (a rebound mount)")?;
        let (socket, _) = control::find_run(&control::run_dir(), &mount)
            .with_context(|| format!("no rebound run serves {}", mount.display()))?;
        let answer = control::request_corrupt(&socket, args.count as u64, seed)
            .map_err(anyhow::Error::msg)?;
        if !answer.contains("\"ok\":true") {
            bail!("{answer}");
        }
        println!(
            "{}",
            serde_json::json!({ "fault": "corrupt", "seed": seed, "count": args.count,
                                "mount": mount.display().to_string() })
        );
        return Ok(());
    }
    let kind = FaultKind::parse(&args.fault)
        .with_context(|| format!("unknown fault `{}` (see rebound inject --help)", args.fault))?;
    let pid = match (args.pid, &args.mount) {
        (Some(pid), _) => pid,
        (None, Some(mount)) => control::find_run(&control::run_dir(), mount)
            .and_then(|(_, status)| status.driver_pid)
            .with_context(|| format!("no rebound run with a driver serves {}", mount.display()))?,
        (None, None) => bail!("say which driver: --pid PID or --mount MOUNTPOINT"),
    };
    let req = Request {
        pid,
        kind,
        count: args.count,
        seed,
        selection: Selection {
            libc: args.libc,
            libfuse: args.libfuse,
            only: args.modules,
        },
        dry_run: args.dry_run,
        leak_mb: args.leak_mb,
    };
    for rec in rebound_inject::inject(&req)? {
        println!("{}", serde_json::to_string(&rec)?);
    }
    Ok(())
}
