//! `rebound`: the command line. Parses arguments, sets up logging, hands over to the
//! supervisor (`run`), the control socket's client (`status`, `restart`, `upgrade`), the fault
//! injector (`inject`) or, run as `mount.rebound`, the mount helper; nothing else lives here.

mod capability_trace;
mod cgroup;
mod checkpoint;
mod config;
mod control;
mod host;
mod inject;
mod keeper;
mod logging;
mod metrics;
mod mount_helper;
mod observe;
mod paths;
mod proxy;
mod sandbox;
mod service;
mod supervisor;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use config::Config;
use control::OperatorRequest;

/// Keep FUSE file systems alive across driver crashes: run an unmodified driver behind an
/// isolation layer that owns its kernel connection.
#[derive(Parser)]
#[command(name = "rebound", version)]
struct Cli {
    /// More log output (-v debug, -vv trace). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Verb,
}

#[derive(Subcommand)]
enum Verb {
    /// Run a FUSE driver under rebound: `rebound run -- fuse2fs disk.img /mnt/disk`.
    Run {
        /// Settings file (TOML); built-in defaults otherwise.
        #[arg(short, long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Learning mode: the driver keeps every capability and no system call is denied, and
        /// the `[sandbox]` capabilities and system calls it uses are written to FILE.
        #[arg(long, value_name = "FILE")]
        learn: Option<PathBuf>,
        /// Take over a mount a predecessor handed over (`rebound reload` runs this).
        #[arg(long, value_name = "FILE", hide = true)]
        resume: Option<PathBuf>,
        /// The driver's own command line, unchanged.
        #[arg(
            required_unless_present = "resume",
            trailing_var_arg = true,
            allow_hyphen_values = true,
            value_name = "DRIVER"
        )]
        driver: Vec<OsString>,
    },
    /// The keeper of a run (started by `rebound run` itself): takes the mount over should
    /// rebound die. Its socket is its standard input.
    #[command(hide = true)]
    Keep {
        #[arg(long)]
        detached: bool,
    },
    /// One line per mount served by rebound: driver pid, state, restarts, last failure.
    Status {
        /// The same as a JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Restart the driver of a mount now, as after a crash: `rebound restart /mnt/disk`.
    Restart {
        /// The mount point, as served by a `rebound run`.
        mountpoint: PathBuf,
    },
    /// Replace the driver of a mount, keeping the mount and every open file: by a new build
    /// of the same command line (`rebound upgrade /mnt/disk`), or by another command line
    /// (`rebound upgrade /mnt/disk -- fuse2fs-new disk.img /mnt/disk`).
    Upgrade {
        /// The mount point, as served by a `rebound run`.
        mountpoint: PathBuf,
        /// The new driver command line; without it, the driver's own is run anew.
        #[arg(last = true, value_name = "DRIVER")]
        driver: Vec<OsString>,
    },
    /// Replace the rebound that serves a mount by the binary now installed (same pid), the
    /// mount, the driver's state and every open file kept: `rebound reload /mnt/disk`.
    Reload {
        /// The mount point, as served by a `rebound run`.
        mountpoint: PathBuf,
    },
    /// Print the requests of a FUSE mount as they end (names, node ids, outcomes) and the
    /// forgets its driver reads, seen from beside the path (BPF): `rebound observe /mnt/disk`.
    /// Any FUSE mount, served by rebound or not. READ/READDIRPLUS replies and WRITE data are
    /// not carried.
    Observe {
        /// The FUSE mount point.
        mountpoint: PathBuf,
        /// Stop after this many seconds (default: until interrupted).
        #[arg(long, value_name = "N")]
        seconds: Option<u64>,
    },
    /// Inject faults into a live driver (Nooks' fault types, and more):
    /// `rebound inject --mount /mnt/disk --fault pointer --count 5 --seed 7`.
    Inject(inject::InjectArgs),
}

fn main() -> ExitCode {
    if mount_helper::invoked_as_helper() {
        let args: Vec<OsString> = std::env::args_os().skip(1).collect();
        return mount_helper::main(&args);
    }
    let mut cli = Cli::parse();
    // A successor rebound's driver and config are the ones handed over.
    let succession = match &mut cli.command {
        Verb::Run {
            resume: Some(path),
            config,
            driver,
            ..
        } => match supervisor::Succession::take(path) {
            Ok(succession) => {
                *driver = succession.argv();
                config.clone_from(&succession.config);
                Some(succession)
            }
            Err(e) => {
                eprintln!("rebound: {e:#}");
                return ExitCode::from(2);
            }
        },
        _ => None,
    };
    let default_level = match cli.verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    // A run's journal entries carry its mount point (as its command line names it) and driver.
    let mut fields = Vec::new();
    if let Verb::Run { driver, .. } = &cli.command {
        if let Some(program) = driver.first() {
            fields.push(("REBOUND_DRIVER", program.to_string_lossy().into_owned()));
        }
        // (A successor's mount point is mounted, and served by nobody until it has started:
        // it must not be looked at.)
        let cwd = std::env::current_dir().unwrap_or_else(|_| "/".into());
        let mountpoint = match &succession {
            Some(succession) => Some(succession.mountpoint().to_path_buf()),
            None => sandbox::named::likely_mountpoint(driver, &cwd),
        };
        if let Some(mountpoint) = mountpoint {
            fields.push(("REBOUND_MOUNTPOINT", mountpoint.display().to_string()));
        }
    }
    logging::init(default_level, &fields);

    match cli.command {
        Verb::Observe {
            mountpoint,
            seconds,
        } => match observe::run(&mountpoint, seconds) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("rebound: observe: {e:#}");
                ExitCode::from(1)
            }
        },
        Verb::Inject(args) => match inject::run(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("rebound: inject: {e:#}");
                ExitCode::from(1)
            }
        },
        Verb::Status { json } => {
            let all = control::query_all(&control::run_dir());
            if json {
                match serde_json::to_string_pretty(&all) {
                    Ok(text) => println!("{text}"),
                    Err(e) => {
                        eprintln!("rebound: {e}");
                        return ExitCode::from(1);
                    }
                }
            } else {
                print!("{}", control::render_table(&all));
            }
            ExitCode::SUCCESS
        }
        Verb::Restart { mountpoint } => ask_run(&mountpoint, OperatorRequest::Restart),
        Verb::Upgrade { mountpoint, driver } => {
            let request = match upgrade_command(&mountpoint, driver) {
                Ok(argv) => OperatorRequest::Upgrade(argv),
                Err(message) => {
                    eprintln!("rebound: upgrade: {message}");
                    return ExitCode::from(2);
                }
            };
            ask_run(&mountpoint, request)
        }
        Verb::Reload { mountpoint } => reload(&mountpoint),
        Verb::Keep { detached } => keeper::main(detached),
        Verb::Run {
            config: source,
            learn,
            driver,
            ..
        } => {
            let config = match source.as_deref().map(Config::load).transpose() {
                Ok(config) => Config {
                    learn,
                    source,
                    ..config.unwrap_or_default()
                },
                Err(message) => {
                    eprintln!("rebound: {message}");
                    return ExitCode::from(2);
                }
            };
            match supervisor::run(&config, &driver, succession) {
                Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
                Err(e) => {
                    eprintln!("rebound: {e:#}");
                    ExitCode::from(1)
                }
            }
        }
    }
}

/// Asks the run that serves `mountpoint` for `request` (a restart or an upgrade) and says
/// how it went.
fn ask_run(mountpoint: &std::path::Path, request: OperatorRequest) -> ExitCode {
    let Some((socket, status)) = control::find_run(&control::run_dir(), mountpoint) else {
        eprintln!("rebound: no rebound run serves {}", mountpoint.display());
        return ExitCode::from(1);
    };
    let (done, doing) = match request {
        OperatorRequest::Restart => ("restarted", "restarting"),
        OperatorRequest::Upgrade(_) => ("upgraded", "upgrading"),
        OperatorRequest::Reload => ("reloaded", "reloading"),
    };
    match control::request_restart(&socket, &request) {
        Ok(answer) if answer.ok => {
            let took = answer
                .recovery_ms
                .map_or_else(String::new, |ms| format!(" in {ms:.1} ms"));
            println!("{done} the driver of {}{took}", status.mountpoint);
            ExitCode::SUCCESS
        }
        Ok(answer) => {
            let why = answer.error.as_deref().unwrap_or("failed");
            eprintln!(
                "rebound: {doing} the driver of {}: {why}",
                status.mountpoint
            );
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("rebound: {doing} the driver of {}: {e}", status.mountpoint);
            ExitCode::from(1)
        }
    }
}

/// The command line `rebound upgrade` sends: none (the driver's own), or `driver` with a
/// relative program path made absolute. The run resolves the other arguments from its own
/// working directory, so a relative one that names a file here is refused when the two differ.
fn upgrade_command(
    mountpoint: &std::path::Path,
    driver: Vec<OsString>,
) -> Result<Option<Vec<OsString>>, String> {
    let Some((program, args)) = driver.split_first() else {
        return Ok(None);
    };
    let here = std::env::current_dir().map_err(|e| format!("the working directory: {e}"))?;
    let program = std::path::Path::new(program);
    let program = if program.is_relative() && program.components().count() > 1 {
        here.join(program).into_os_string()
    } else {
        program.as_os_str().to_owned()
    };
    let run_dir = control::find_run(&control::run_dir(), mountpoint)
        .and_then(|(_, s)| std::fs::read_link(format!("/proc/{}/cwd", s.rebound_pid)).ok());
    if let Some(run_dir) = run_dir.filter(|dir| *dir != here) {
        if let Some(relative) = args.iter().find(|a| {
            let path = std::path::Path::new(a);
            path.is_relative() && here.join(path).exists()
        }) {
            return Err(format!(
                "`{}` is a relative path, and the run resolves it from its own working \
                 directory {}: give it as an absolute path",
                relative.to_string_lossy(),
                run_dir.display()
            ));
        }
    }
    Ok(Some(
        std::iter::once(program)
            .chain(args.iter().cloned())
            .collect(),
    ))
}

/// `rebound reload MOUNTPOINT`: asks the run to hand its mount over to the binary now
/// installed, then waits for the successor (same pid) to serve it.
fn reload(mountpoint: &std::path::Path) -> ExitCode {
    let Some((socket, before)) = control::find_run(&control::run_dir(), mountpoint) else {
        eprintln!("rebound: no rebound run serves {}", mountpoint.display());
        return ExitCode::from(1);
    };
    let asked = std::time::Instant::now();
    match control::request_restart(&socket, &OperatorRequest::Reload) {
        Ok(answer) if answer.ok => {}
        Ok(answer) => {
            let why = answer.error.as_deref().unwrap_or("refused");
            eprintln!("rebound: reloading {}: {why}", before.mountpoint);
            return ExitCode::from(1);
        }
        Err(e) => {
            eprintln!("rebound: reloading {}: {e}", before.mountpoint);
            return ExitCode::from(1);
        }
    }
    while asked.elapsed() < control::RESTART_WAIT {
        let now = control::find_run(&control::run_dir(), mountpoint).map(|(_, s)| s);
        match now {
            Some(s) if s.reloads > before.reloads && s.state == "serving" => {
                println!(
                    "reloaded rebound for {} (pid {}): serving again after {:.1} ms",
                    s.mountpoint,
                    s.rebound_pid,
                    asked.elapsed().as_secs_f64() * 1000.0
                );
                return ExitCode::SUCCESS;
            }
            Some(s)
                if s.reloads == before.reloads
                    && s.state == "serving"
                    && s.restarts > before.restarts =>
            {
                eprintln!(
                    "rebound: reloading {}: not handed over ({}); the driver was restarted instead",
                    s.mountpoint,
                    s.last_failure.as_deref().unwrap_or("see the run's log")
                );
                return ExitCode::from(1);
            }
            _ => std::thread::sleep(std::time::Duration::from_millis(20)),
        }
    }
    eprintln!(
        "rebound: reloading {}: no successor served within {} s",
        before.mountpoint,
        control::RESTART_WAIT.as_secs()
    );
    ExitCode::from(1)
}
