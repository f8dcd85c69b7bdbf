//! `rebound`: the command line. Parses arguments, sets up logging, hands over to the
//! supervisor (`run`), the control socket's client (`status`, `restart`) or the fault injector
//! (`inject`); nothing else lives here.

mod capability_trace;
mod cgroup;
mod checkpoint;
mod config;
mod control;
mod inject;
mod paths;
mod proxy;
mod sandbox;
mod supervisor;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

use config::Config;

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
        /// The driver's own command line, unchanged.
        #[arg(
            required = true,
            trailing_var_arg = true,
            allow_hyphen_values = true,
            value_name = "DRIVER"
        )]
        driver: Vec<OsString>,
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
    /// Inject faults into a live driver (Nooks' fault types, and more):
    /// `rebound inject --mount /mnt/disk --fault pointer --count 5 --seed 7`.
    Inject(inject::InjectArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let default_level = match cli.verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();

    match cli.command {
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
        Verb::Restart { mountpoint } => {
            let Some((socket, status)) = control::find_run(&control::run_dir(), &mountpoint) else {
                eprintln!("rebound: no rebound run serves {}", mountpoint.display());
                return ExitCode::from(1);
            };
            match control::request_restart(&socket) {
                Ok(answer) if answer.ok => {
                    match answer.recovery_ms {
                        Some(ms) => println!(
                            "restarted the driver of {} in {ms:.1} ms",
                            status.mountpoint
                        ),
                        None => println!("restarted the driver of {}", status.mountpoint),
                    }
                    ExitCode::SUCCESS
                }
                Ok(answer) => {
                    eprintln!(
                        "rebound: restarting the driver of {}: {}",
                        status.mountpoint,
                        answer.error.as_deref().unwrap_or("failed")
                    );
                    ExitCode::from(1)
                }
                Err(e) => {
                    eprintln!(
                        "rebound: restarting the driver of {}: {e}",
                        status.mountpoint
                    );
                    ExitCode::from(1)
                }
            }
        }
        Verb::Run {
            config,
            learn,
            driver,
        } => {
            let config = match config.as_deref().map(Config::load).transpose() {
                Ok(config) => Config {
                    learn,
                    ..config.unwrap_or_default()
                },
                Err(message) => {
                    eprintln!("rebound: {message}");
                    return ExitCode::from(2);
                }
            };
            match supervisor::run(&config, &driver) {
                Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
                Err(e) => {
                    eprintln!("rebound: {e:#}");
                    ExitCode::from(1)
                }
            }
        }
    }
}
